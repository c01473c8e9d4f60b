"""safefactor against optax.adafactor and the float64 reference, and as an optax citizen."""

import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from optax_safefactor._src.plan import default_plan
from tests.helpers import (
  assert_trees_close,
  is_all_zero,
  max_relative_error,
  random_tree,
  run_steps,
  tree_all_finite,
)
from tests.reference import ReferenceAdafactor

SHAPES = {
    "tall": (300, 140),
    "wide": (140, 300),
    "stacked": (3, 130, 150),
    "bias": (150,),
    "small": (5, 7),
    "scalar": (),
}

COMBINATIONS = [
    dict(zip(("momentum", "multiply_by_parameter_scale", "clipping_threshold",
              "weight_decay_rate"), values, strict=True))
    for values in itertools.product((None, 0.9), (True, False), (1.0, None), (None, 1e-2))
]


def _id(config):
  return "-".join(f"{k[:4]}={v}" for k, v in config.items())


def test_signature_is_a_drop_in_for_optax():
  ours = inspect.signature(osf.safefactor).parameters
  theirs = inspect.signature(optax.adafactor).parameters
  assert list(ours)[: len(theirs)] == list(theirs)
  for name, parameter in theirs.items():
    if name == "dtype_momentum":
      assert ours[name].default == "float32"
    else:
      assert ours[name].default == parameter.default, name
  extras = list(ours)[len(theirs):]
  assert all(ours[name].kind is inspect.Parameter.KEYWORD_ONLY for name in extras)
  for parameter in ours.values():
    assert not callable(parameter.default) and not isinstance(parameter.default, np.dtype)


@pytest.mark.parametrize("config", COMBINATIONS, ids=_id)
def test_matches_optax_adafactor_on_healthy_float32(config, rng):
  params = random_tree(rng, SHAPES)
  grads = [random_tree(rng, SHAPES, scale=10.0 ** (step % 3 - 1)) for step in range(12)]
  with jax.numpy_dtype_promotion("standard"):
    _, _, expected = run_steps(optax.adafactor(0.05, **config), params, grads.__getitem__, 12)
  _, _, actual = run_steps(osf.safefactor(0.05, **config), params, grads.__getitem__, 12)
  for step in range(12):
    # Relative to the step's largest update: with momentum and weight decay a
    # scalar leaf's terms can cancel, and a plain relative error would measure the
    # cancellation, not the optimizer.
    step_scale = max(float(jnp.max(jnp.abs(u))) for u in expected[step].values())
    for name in SHAPES:
      error = max_relative_error(actual[step][name], expected[step][name], step_scale)
      assert error < 1e-5, (step, name, error)


@pytest.mark.parametrize("config", COMBINATIONS[::3], ids=_id)
def test_matches_float64_reference_step_by_step(config, rng):
  params = random_tree(rng, SHAPES)
  reference = ReferenceAdafactor(learning_rate=0.05, **config)
  for name, value in params.items():
    plan = default_plan(value.shape, True, 128)
    reference.init(name, value.shape, None if plan is None else tuple(plan))
  tx = osf.safefactor(0.05, **config)
  state = tx.init(params)
  update = jax.jit(tx.update)
  reference_params = {k: np.asarray(v, np.float64) for k, v in params.items()}
  for step in range(30):
    grads = random_tree(rng, SHAPES, scale=10.0 ** (step % 5 - 2))
    updates, state = update(grads, state, params)
    expected = reference.step(grads, params)
    for name in SHAPES:
      assert max_relative_error(updates[name], expected[name]) < 2e-5, (step, name)
    params = optax.apply_updates(params, updates)
    reference_params = {k: reference_params[k] + expected[k] for k in SHAPES}
  assert tree_all_finite(state)


def test_learning_rate_schedule_and_count(rng):
  params = random_tree(rng, {"w": (4, 3)})
  schedule = optax.linear_schedule(1.0, 0.0, 4)
  tx = osf.safefactor(schedule, multiply_by_parameter_scale=False, clipping_threshold=None)
  grads = {"w": jnp.ones((4, 3))}
  _, state, history = run_steps(tx, params, lambda _: grads, 5)
  # With unit gradients the scaled gradient is exactly 1, so each update is -lr.
  np.testing.assert_allclose([float(u["w"][0, 0]) for u in history], [-1, -0.75, -0.5, -0.25, 0],
                             atol=1e-6)
  assert int(optax.tree_utils.tree_get(state.inner_state, "count")) == 5


def test_jit_equals_eager(rng):
  params = random_tree(rng, SHAPES)
  grads = [random_tree(rng, SHAPES) for _ in range(3)]
  tx = osf.safefactor(0.1, momentum=0.9, weight_decay_rate=1e-3)
  _, eager_state, eager = run_steps(tx, params, grads.__getitem__, 3, jit=False)
  _, jit_state, jitted = run_steps(tx, params, grads.__getitem__, 3, jit=True)
  assert_trees_close((eager, eager_state), (jitted, jit_state), rtol=2e-6)


def test_no_recompilation_after_first_step(rng):
  params = random_tree(rng, SHAPES, dtype=jnp.bfloat16)
  tx = osf.safefactor(0.1, momentum=0.9)
  state = tx.init(params)
  traces = []

  @jax.jit
  def step(params, state, grads):
    traces.append(1)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(3):
    params, state = step(params, state, random_tree(rng, SHAPES, dtype=jnp.bfloat16))
  assert len(traces) == 1


def test_inject_hyperparams_under_jit(rng):
  params = random_tree(rng, SHAPES)
  grads = [random_tree(rng, SHAPES) for _ in range(6)]
  injected = optax.inject_hyperparams(osf.safefactor)(
      learning_rate=0.1, momentum=0.9, weight_decay_rate=1e-3, clipping_threshold=1.0
  )
  plain = osf.safefactor(learning_rate=0.1, momentum=0.9, weight_decay_rate=1e-3)
  _, state, injected_updates = run_steps(injected, params, grads.__getitem__, 6)
  _, _, plain_updates = run_steps(plain, params, grads.__getitem__, 6)
  assert_trees_close(injected_updates, plain_updates, rtol=1e-6)
  assert int(osf.skipped_steps(state)) == 0

  # Changing an injected value changes the result without retracing.
  traces = []

  @jax.jit
  def update(grads, state, params):
    traces.append(1)
    return injected.update(grads, state, params)

  state.hyperparams["learning_rate"] = jnp.asarray(0.0, jnp.float32)
  state.hyperparams["momentum"] = jnp.asarray(0.0, jnp.float32)
  state.hyperparams["weight_decay_rate"] = jnp.asarray(0.0, jnp.float32)
  zero, state = update(grads[0], state, params)
  state.hyperparams["learning_rate"] = jnp.asarray(0.2, jnp.float32)
  nonzero, state = update(grads[1], state, params)
  assert all(is_all_zero(u) for u in jax.tree.leaves(zero))
  assert all(float(jnp.max(jnp.abs(u))) > 0.0 for u in jax.tree.leaves(nonzero))
  assert len(traces) == 1


def test_inject_hyperparams_with_float16_params(rng):
  # inject_hyperparams casts numeric hyperparameters to the params' dtype: eps=1e-30
  # becomes 0 in float16, and the floor must still hold.
  params = random_tree(rng, {"w": (130, 140), "b": (7,)}, dtype=jnp.float16)
  tx = optax.inject_hyperparams(osf.safefactor)(learning_rate=0.01)
  zeros = jax.tree.map(jnp.zeros_like, params)
  _, state, history = run_steps(tx, params, lambda _: zeros, 3)
  assert tree_all_finite((state, history))
  assert int(osf.skipped_steps(state)) == 0


def test_multi_steps(rng):
  params = random_tree(rng, SHAPES)
  grads = [random_tree(rng, SHAPES) for _ in range(6)]
  tx = optax.MultiSteps(osf.safefactor(0.1, momentum=0.9), every_k_schedule=3)
  with jax.numpy_dtype_promotion("standard"):  # MultiSteps itself mixes dtypes
    _, state, history = run_steps(tx, params, grads.__getitem__, 6)
  mean_grads = [jax.tree.map(lambda *g: sum(g) / 3, *grads[i:i + 3]) for i in (0, 3)]
  _, _, expected = run_steps(osf.safefactor(0.1, momentum=0.9), params, mean_grads.__getitem__, 2)
  for k in SHAPES:
    assert is_all_zero(history[0][k])
    np.testing.assert_allclose(history[2][k], expected[0][k], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(history[5][k], expected[1][k], rtol=1e-5, atol=1e-7)
  assert int(osf.skipped_steps(state)) == 0


def test_chain_and_extra_args(rng):
  params = random_tree(rng, SHAPES)
  tx = optax.chain(optax.clip_by_global_norm(1.0), osf.safefactor(0.1))
  state = tx.init(params)
  updates, state = tx.update(random_tree(rng, SHAPES), state, params, unused_extra_arg=1)
  assert tree_all_finite(updates)


def test_weight_decay_mask(rng):
  params = random_tree(rng, {"w": (4, 3), "b": (3,)})
  mask = {"w": True, "b": False}
  config = dict(multiply_by_parameter_scale=False, clipping_threshold=None)
  zeros = jax.tree.map(jnp.zeros_like, params)
  masked = osf.safefactor(1.0, weight_decay_rate=0.5, weight_decay_mask=mask, **config)
  callable_mask = osf.safefactor(1.0, weight_decay_rate=0.5, weight_decay_mask=lambda p: mask,
                                 **config)
  for tx in (masked, callable_mask):
    updates, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.5 * params["w"], rtol=1e-6)
    np.testing.assert_array_equal(updates["b"], jnp.zeros(3))


def test_first_steps_compile_once(rng):
  # Params fresh from an initializer are uncommitted; a state committed to a device
  # would differ from what the step returns, and the second step would compile again.
  params = random_tree(rng, SHAPES)
  tx = osf.safefactor(0.1, momentum=0.9)

  @jax.jit
  def step(params, state):
    updates, state = tx.update(params, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for _ in range(3):
    params, state = step(params, state)
  assert step._cache_size() == 1
