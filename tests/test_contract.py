"""One contract for every public factory: it behaves as an optax citizen inside every wrapper."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from tests.helpers import TRANSFORMATIONS, WRAPPER_EVERY_K, WRAPPERS, max_relative_error
from tests.reference import ReferenceAdafactor

TARGET = {"w": jnp.linspace(-1.0, 1.0, 16 * 12).reshape(16, 12), "b": jnp.full((12,), 0.5),
          "frozen": jnp.ones((3,))}


def _loss(params):
  return sum(jnp.sum((params[k] - TARGET[k]) ** 2) for k in ("w", "b"))


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("factory", sorted(TRANSFORMATIONS))
def test_factory_inside_wrapper(factory, wrapper):
  subject = TRANSFORMATIONS[factory]
  tx = WRAPPERS[wrapper](subject.build())
  params = {"w": jnp.zeros((16, 12)) + 0.1, "b": jnp.zeros((12,)) + 0.1, "frozen": jnp.ones((3,))}
  state = tx.init(params)
  reference = ReferenceAdafactor(**subject.reference).init_all(
      {k: params[k] for k in ("w", "b")}, min_dim_size_to_factor=subject.min_dim_size_to_factor)
  # Calls grouped into one applied step, by the wrapper and by the transformation itself.
  every_k = WRAPPER_EVERY_K.get(wrapper, 1) * subject.every_k
  traces = []

  @jax.jit
  def step(params, state):
    traces.append(1)
    grads = jax.grad(_loss)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, grads, updates

  with jax.numpy_dtype_promotion("standard"):  # optax's own wrappers mix dtypes
    for i in range(60 * every_k):
      before = {k: np.asarray(params[k], np.float64) for k in ("w", "b")}
      params, state, grads, updates = step(params, state)
      # Every update is the float64 reference's, given the same params and gradients:
      # "the loss went down" (the old check) passes a sign error in one leaf, a wrong
      # learning rate or a dropped momentum. MultiSteps and accumulate_gradients apply the
      # mean of equal gradients (params do not move in between) on every k-th call.
      if (i + 1) % every_k:
        assert all(not np.any(np.asarray(updates[k])) for k in ("w", "b"))
        continue
      grads = {k: np.asarray(grads[k], np.float64) for k in ("w", "b")}
      if wrapper == "chain":  # clip_by_global_norm(10.0): it binds on the first steps
        norm = np.sqrt(sum(np.sum(g**2) for g in grads.values()))
        grads = {k: g * min(1.0, 10.0 / norm) for k, g in grads.items()}
      expected = reference.step(grads, before)
      # Relative to the step's largest update: momentum and weight decay can cancel
      # in one leaf near the optimum.
      step_scale = max(float(np.max(np.abs(u))) for u in expected.values())
      for k in ("w", "b"):
        assert max_relative_error(updates[k], expected[k], step_scale) < 2e-5, (i, k)
  assert len(traces) == 1, "the second step must not recompile"
  if wrapper in ("multi_transform", "masked"):
    np.testing.assert_array_equal(params["frozen"], jnp.ones((3,)))
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


def test_tree_get_count_is_unique_and_counts_steps():
  params = {"w": jnp.ones((16, 12))}
  for tx in (osf.safefactor(0.1), osf.safefactor(0.1, momentum=0.9),
             osf.scale_by_safe_factored_rms()):
    state = tx.init(params)
    for _ in range(3):
      _, state = tx.update(params, state, params)
    assert int(optax.tree_utils.tree_get(state, "count")) == 3


@pytest.mark.parametrize("name,first,second", [
    ("learning_rate", 0.0, 0.1),
    ("decay_rate", 0.8, 0.5),
    ("clipping_threshold", 1.1, 4.0),  # the update's RMS is 1.27: the first binds
    ("momentum", 0.0, 0.9),
    ("weight_decay_rate", 0.0, 0.5),
])
def test_injected_hyperparameters_change_without_recompiling(name, first, second):
  """Each injected value is used as given: updates equal the float64 reference's.

  Guards against a hyperparameter read once at construction (or cast, or ignored
  under ``inject_hyperparams``), and against clipping that is only right at 1.0.
  """
  params = {"w": jnp.linspace(0.1, 2.0, 16 * 12).reshape(16, 12)}
  rng = np.random.default_rng(0)
  grads = {"w": jnp.asarray(rng.normal(size=(16, 12)), jnp.float32)}
  config = {"learning_rate": 0.1, "momentum": 0.5, "weight_decay_rate": 0.1,
            "decay_rate": 0.8, "clipping_threshold": 1.0, name: first}
  tx = optax.inject_hyperparams(osf.safefactor)(min_dim_size_to_factor=8, **config)
  state = tx.init(params)
  reference = ReferenceAdafactor(**config).init_all(params, min_dim_size_to_factor=8)
  traces = []

  @jax.jit
  def update(state, grads):
    traces.append(1)
    return tx.update(grads, state, params)

  # Step 0 has beta2 = 0 whatever the decay rate: compare at step 1, with new gradients.
  _, state = update(state, grads)
  reference.step(grads, params)
  later_grads = {"w": jnp.asarray(rng.normal(size=(16, 12)) * 3.0, jnp.float32)}
  with_first, _ = update(state, later_grads)
  state.hyperparams[name] = jnp.asarray(second, jnp.float32)
  with_second, _ = update(state, later_grads)
  assert len(traces) == 1
  for value, result in ((first, with_first), (second, with_second)):
    expected = copy.deepcopy(reference)
    setattr(expected, name, value)
    error = max_relative_error(result["w"], expected.step(later_grads, params)["w"])
    assert error < 2e-5, (name, value, error)
  assert not np.allclose(with_first["w"], with_second["w"])


@pytest.mark.parametrize("config", [{}, {"skip_nonfinite_steps": False},
                                    {"skip_nonfinite_steps": False, "momentum": 0.9}])
def test_the_step_vmaps_and_differentiates(config):
  # The compiler hints are one primitive each (per_compiler.choose): under jax.vmap it runs
  # the plain computation per member, under differentiation it differentiates the plain
  # computation. An ensemble of 3 optimizers stepped by one vmapped jitted update equals each
  # member stepped alone, and the update's derivative along the params is exact.
  tx = osf.safefactor(1e-2, **config)
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(16, 12)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(12,)), jnp.float32)}
  grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
           for _ in range(3)]
  state = tx.init(params)
  update = jax.jit(lambda g, s: tx.update(g, s, params)[0])
  stacked_grads = jax.tree.map(lambda *g: jnp.stack(g), *grads)
  stacked_state = jax.tree.map(lambda x: jnp.stack([x] * 3), state)
  together = jax.jit(jax.vmap(lambda g, s: tx.update(g, s, params)[0]))(stacked_grads,
                                                                       stacked_state)
  for member, g in enumerate(grads):
    alone = update(g, state)
    for key in params:
      np.testing.assert_allclose(together[key][member], alone[key], rtol=1e-5, atol=1e-7)

  # Each update is lr * max(RMS(param), 1e-3) * (a term free of the param): scaling the
  # params by (1 + t) scales it by (1 + t), so its derivative along the params is itself.
  primal, tangent = jax.jit(lambda p: jax.jvp(
      lambda x: tx.update(grads[0], state, x)[0], (p,), (p,)))(params)
  for key in params:
    assert float(jnp.max(jnp.abs(primal[key]))) > 0
    np.testing.assert_allclose(tangent[key], primal[key], rtol=1e-5, atol=1e-9)
