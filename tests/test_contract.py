"""One contract for every public factory: it behaves as an optax citizen inside every wrapper."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf

FACTORIES = {
    "safefactor": lambda: osf.safefactor(0.1),
    "safefactor_momentum": lambda: osf.safefactor(0.1, momentum=0.9, weight_decay_rate=1e-4),
    "scale_by_safe_factored_rms": lambda: optax.chain(
        osf.scale_by_safe_factored_rms(min_dim_size_to_factor=8), optax.scale(-0.02)),
    "skip_nonfinite": lambda: osf.skip_nonfinite(
        optax.chain(osf.scale_by_safe_factored_rms(), optax.scale(-0.02))),
}

WRAPPERS = {
    "plain": lambda tx: tx,
    "chain": lambda tx: optax.chain(optax.clip_by_global_norm(10.0), tx),
    "multi_transform": lambda tx: optax.multi_transform(
        {"opt": tx, "frozen": optax.set_to_zero()}, {"w": "opt", "b": "opt", "frozen": "frozen"}),
    "masked": lambda tx: optax.chain(
        optax.masked(tx, {"w": True, "b": True, "frozen": False}),
        optax.masked(optax.set_to_zero(), {"w": False, "b": False, "frozen": True})),
    "multi_steps": lambda tx: optax.MultiSteps(tx, every_k_schedule=2),
    "apply_if_finite": lambda tx: optax.apply_if_finite(tx, max_consecutive_errors=3),
}

TARGET = {"w": jnp.linspace(-1.0, 1.0, 16 * 12).reshape(16, 12), "b": jnp.full((12,), 0.5),
          "frozen": jnp.ones((3,))}


def _loss(params):
  return sum(jnp.sum((params[k] - TARGET[k]) ** 2) for k in ("w", "b"))


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("factory", sorted(FACTORIES))
def test_factory_inside_wrapper(factory, wrapper):
  tx = WRAPPERS[wrapper](FACTORIES[factory]())
  params = {"w": jnp.zeros((16, 12)) + 0.1, "b": jnp.zeros((12,)) + 0.1, "frozen": jnp.ones((3,))}
  initial_loss = float(_loss(params))
  state = tx.init(params)
  traces = []

  @jax.jit
  def step(params, state):
    traces.append(1)
    updates, state = tx.update(jax.grad(_loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  with jax.numpy_dtype_promotion("standard"):  # optax's own wrappers mix dtypes
    for _ in range(60):
      params, state = step(params, state)
  assert len(traces) == 1, "the second step must not recompile"
  assert float(_loss(params)) < 0.5 * initial_loss
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
    ("clipping_threshold", 1.0, 5.0),
    ("momentum", 0.0, 0.9),
    ("weight_decay_rate", 0.0, 0.5),
])
def test_injected_hyperparameters_change_without_recompiling(name, first, second):
  params = {"w": jnp.linspace(0.1, 2.0, 16 * 12).reshape(16, 12)}
  rng = np.random.default_rng(0)
  grads = {"w": jnp.asarray(rng.normal(size=(16, 12)), jnp.float32)}
  config = {"learning_rate": 0.1, "momentum": 0.5, "weight_decay_rate": 0.1,
            "decay_rate": 0.8, "clipping_threshold": 1.0, name: first}
  tx = optax.inject_hyperparams(osf.safefactor)(min_dim_size_to_factor=8, **config)
  state = tx.init(params)
  traces = []

  @jax.jit
  def update(state, grads):
    traces.append(1)
    return tx.update(grads, state, params)

  # Step 0 has beta2 = 0 whatever the decay rate: compare at step 1, with new gradients.
  _, state = update(state, grads)
  later_grads = {"w": jnp.asarray(rng.normal(size=(16, 12)) * 3.0, jnp.float32)}
  with_first, _ = update(state, later_grads)
  state.hyperparams[name] = jnp.asarray(second, jnp.float32)
  with_second, _ = update(state, later_grads)
  assert len(traces) == 1
  assert not np.allclose(with_first["w"], with_second["w"])
