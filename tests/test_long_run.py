"""Long runs: a bug at step 3000 is not exonerated by a 10-step test."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_safefactor as osf


def test_float16_model_with_dead_units_runs_3000_steps_without_nan():
  rng = np.random.default_rng(0)
  inputs = jnp.asarray(rng.normal(size=(64, 130)), jnp.float16)
  targets = jnp.asarray(rng.normal(size=(64, 8)), jnp.float16)
  params = {
      "hidden": jnp.asarray(rng.normal(size=(130, 160)) * 0.1, jnp.float16),
      # Half the hidden units start dead (large negative bias): their rows see zero gradients.
      "bias": jnp.concatenate([jnp.zeros(80), jnp.full(80, -1e3)]).astype(jnp.float16),
      "out": jnp.asarray(rng.normal(size=(160, 8)) * 0.1, jnp.float16),
  }

  def loss(params):
    hidden = jax.nn.relu(inputs @ params["hidden"] + params["bias"][None, :])
    return jnp.mean((hidden @ params["out"] - targets) ** 2)

  tx = osf.safefactor(1e-3, momentum=0.9)

  def step(carry, _):
    params, state = carry
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)]))
    return (params, state), (value, finite)

  (params, state), (losses, finite) = jax.jit(
      lambda p, s: jax.lax.scan(step, (p, s), length=3000)
  )(params, tx.init(params))
  assert bool(jnp.all(finite))
  assert bool(jnp.all(jnp.isfinite(losses.astype(jnp.float32))))
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state))
  assert int(osf.skipped_steps(state)) == 0
  assert float(losses[-1]) < 0.8 * float(losses[0])
  # Dead units never received a gradient: their weights are exactly where they started.
  np.testing.assert_array_equal(params["bias"][80:], np.full(80, -1e3, np.float16))
