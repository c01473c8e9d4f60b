"""``jax.export``: the step exports for several platforms at once and runs as ``jax.jit``'s.

Each compiler hint is chosen when the program is lowered (``_src/per_compiler.py``), so a
program exported for the CPU, CUDA and TPU carries every compiler's form and picks the one
of the device it runs on: called here on the CPU, it must step bit for bit as the program
``jax.jit`` lowers for the CPU alone.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import export

import optax_safefactor as osf

PLATFORMS = ("cpu", "cuda", "tpu")

TRANSFORMATIONS = {
    # (The default step is this one's without momentum and spikes.)
    "momentum-and-spikes": lambda: osf.safefactor(1e-3, momentum=0.9, skip_spikes=6.0,
                                                  spike_window=4),
    "stochastic": lambda: osf.safefactor(1e-3, param_rounding="stochastic"),
    "kahan": lambda: osf.safefactor(1e-3, param_rounding="kahan"),
    "skip_nonfinite(sgd)": lambda: osf.skip_nonfinite(optax.sgd(1e-3, momentum=0.9)),
    "accumulate_gradients": lambda: osf.accumulate_gradients(osf.safefactor(1e-3), 2),
}


def _params(dtype):
  return {"w": jnp.linspace(-1.0, 1.0, 300 * 200, dtype=jnp.float32).reshape(300, 200)
                  .astype(dtype),
          "norm": jnp.ones((200,), dtype), "small": jnp.full((3, 5), 0.5, dtype)}


def _grads(params, step):
  grads = jax.tree.map(lambda p: (jnp.cos(p.astype(jnp.float32) * (step + 1.0)) * 0.01)
                       .astype(p.dtype), params)
  if step == 2:  # a poisoned step, skipped
    grads["norm"] = grads["norm"].at[3].set(jnp.nan)
  return grads


@pytest.mark.parametrize("name", TRANSFORMATIONS)
def test_the_step_exported_for_three_platforms_runs_on_the_cpu_as_the_jitted_one(name):
  tx = TRANSFORMATIONS[name]()
  dtype = jnp.bfloat16 if name in ("stochastic", "kahan") else jnp.float32
  params = _params(dtype)
  state = tx.init(params)

  def step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  exported = export.export(jax.jit(step), platforms=PLATFORMS)(_grads(params, 0), state, params)
  assert exported.platforms == PLATFORMS
  jitted = (params, state)
  for index in range(3):
    grads = _grads(params, index)
    params, state = exported.call(grads, state, params)
    jitted = jax.jit(step)(grads, jitted[1], jitted[0])
    for got, want in zip(jax.tree.leaves((params, state)), jax.tree.leaves(jitted), strict=True):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert int(osf.skipped_steps(state)) == 1


def test_the_stop_after_consecutive_skips_is_a_host_callback_that_export_refuses():
  # As the guide on non-finite steps says: export the step without max_consecutive_skips,
  # and call check_nonfinite_steps between steps.
  tx = osf.safefactor(1e-3, max_consecutive_skips=3)
  params = _params(jnp.float32)

  def step(grads, state, params):
    return tx.update(grads, state, params)

  with pytest.raises(NotImplementedError, match="host_callbacks"):
    export.export(jax.jit(step), platforms=("cpu",))(_grads(params, 0), tx.init(params), params)
