"""Update clipping at thresholds other than 1, by value against the float64 reference.

Every value check elsewhere clips at 1.0, where ``rms / threshold`` and
``rms * threshold`` agree: the bug timm fixed in its PR 2790 (clipping scaled by
``rms * threshold``) passes all of them. Here each threshold runs once on gradients
whose scaled RMS is near 1 (clipping must not bind) and once with a spike that makes
the factored estimate much smaller than the gradient elsewhere (clipping binds hard).
"""

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from tests.helpers import max_relative_error
from tests.reference import ReferenceAdafactor

SHAPES = {"w": (24, 20), "b": (20,)}
MIN_DIM = 8  # factors "w"
LR = 0.1


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, 24 * 20).reshape(24, 20), "b": jnp.full((20,), 0.5)}


def _grads(pattern, step):
  rng = np.random.default_rng(step)
  grads = {name: rng.normal(size=shape) for name, shape in SHAPES.items()}
  if pattern == "spike":
    # One large element: every other element is scaled by a tiny factored estimate.
    grads["w"][3, 5] = 300.0
  return {name: jnp.asarray(g, jnp.float32) for name, g in grads.items()}


def _unclipped_rms(reference, grads, params):
  """The RMS of the scaled gradient ``u`` that clipping sees, per leaf, from the reference."""
  probe = copy.deepcopy(reference)
  probe.learning_rate, probe.clipping_threshold = None, None
  probe.multiply_by_parameter_scale = False
  return {k: float(np.sqrt(np.mean(u**2))) for k, u in probe.step(grads, params).items()}


@functools.cache
def _safefactor(threshold):
  """The transformation and its jitted update, shared by both patterns (one compilation)."""
  tx = osf.safefactor(LR, min_dim_size_to_factor=MIN_DIM, clipping_threshold=threshold)
  return tx, jax.jit(tx.update)


@pytest.mark.parametrize("pattern", ["normal", "spike"])
@pytest.mark.parametrize("threshold", [1.5, 2.0, 4.0])
def test_clipping_threshold_matches_reference(threshold, pattern):
  """Guards against ``rms * threshold`` for ``rms / threshold`` and a threshold ignored.

  With ``* threshold`` an update that should not be clipped is divided by the
  threshold, and a clipped one is clipped ``threshold**2`` times too hard.
  """
  params = _params()
  reference = ReferenceAdafactor(learning_rate=LR, clipping_threshold=threshold)
  reference.init_all(params, min_dim_size_to_factor=MIN_DIM)
  tx, update = _safefactor(threshold)
  state = tx.init(params)
  binding = []
  for step in range(3):
    grads = _grads(pattern, step)
    rms = _unclipped_rms(reference, grads, params)
    binding.append(rms["w"] > threshold)
    updates, state = update(grads, state, params)
    expected = reference.step(grads, params)
    for name in SHAPES:
      assert max_relative_error(updates[name], expected[name]) < 2e-5, (step, name)
    params = optax.apply_updates(params, updates)
  # The case each parametrization is meant to cover really happens.
  assert all(binding) if pattern == "spike" else not any(binding), binding
  assert int(osf.skipped_steps(state)) == 0


def test_injected_clipping_threshold_changes_by_value():
  """``inject_hyperparams`` changing the threshold between steps: each step's value.

  Guards against a threshold read once at construction, and against the
  ``rms * threshold`` bug under injection.
  """
  params = _params()
  thresholds = [1.5, 4.0, 10.0, 2.0]  # binding on the spikes only (see the last check)
  tx = optax.inject_hyperparams(osf.safefactor)(
      learning_rate=LR, min_dim_size_to_factor=MIN_DIM, clipping_threshold=thresholds[0])
  state = tx.init(params)
  reference = ReferenceAdafactor(learning_rate=LR).init_all(params, min_dim_size_to_factor=MIN_DIM)
  update = jax.jit(tx.update)
  binding = []
  for step, threshold in enumerate(thresholds):
    state.hyperparams["clipping_threshold"] = jnp.asarray(threshold, jnp.float32)
    reference.clipping_threshold = threshold
    grads = _grads("spike" if step % 2 else "normal", step)
    binding.append(_unclipped_rms(reference, grads, params)["w"] > threshold)
    updates, state = update(grads, state, params)
    expected = reference.step(grads, params)
    for name in SHAPES:
      assert max_relative_error(updates[name], expected[name]) < 2e-5, (step, name)
    params = optax.apply_updates(params, updates)
  assert binding == [False, True, False, True], binding


@pytest.mark.parametrize(("threshold", "injected"),
                         [(1e-40, False), (1e-40, True), (1e-300, False)])
def test_a_threshold_below_the_smallest_normal_gives_zero_updates_not_nan(threshold, injected):
  """Guards against dividing by a threshold that is 0 in the step.

  Both are positive, so construction takes them, and an injected 1e-40 passes its range
  check; in float32 1e-40 is a subnormal (0 where subnormals are flushed, as on XLA's CPU)
  and 1e-300 rounds to 0 (injected, it is refused as 0). An all-zero gradient's RMS over
  such a threshold was 0 / 0: NaN updates, not skipped. Floored, the update's RMS is at
  most the smallest normal: zero.
  """
  params = _params()
  grads = {"w": jnp.zeros(SHAPES["w"]), "b": jnp.ones(SHAPES["b"])}
  make = optax.inject_hyperparams(osf.safefactor) if injected else osf.safefactor
  tx = make(learning_rate=LR, min_dim_size_to_factor=MIN_DIM, clipping_threshold=threshold)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  for name in SHAPES:
    np.testing.assert_array_equal(np.asarray(updates[name]), 0.0)
  assert int(osf.skipped_steps(state)) == 0
