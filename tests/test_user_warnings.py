"""Every warning points at the line of the user's code, however the optimizer is called."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_safefactor as osf

F32 = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
NOTHING_TO_ROUND = "rounds what is stored narrower than it is computed"
NOTHING_DECAYED = "weight_decay_mask is False for every param"


def _caught(run):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    run()
  return caught


def _nnx_optimizer(tx):
  nnx = pytest.importorskip("flax.nnx")  # the core's floor runs without the flax extra

  class Linear(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones((4, 3)))

  return nnx.Optimizer(Linear(), tx, wrt=nnx.Param)


def _no_decay(params):
  return jax.tree.map(lambda _: False, params)


@pytest.mark.parametrize("run,message", [
    (lambda: osf.safefactor(1e-3, param_rounding="kahan").init(F32), NOTHING_TO_ROUND),
    (lambda: optax.chain(optax.clip(1.0), osf.safefactor(1e-3, param_rounding="kahan")).init(
        F32), NOTHING_TO_ROUND),
    (lambda: optax.MultiSteps(osf.safefactor(1e-3, param_rounding="kahan"), 2).init(F32),
     NOTHING_TO_ROUND),
    (lambda: jax.jit(osf.safefactor(1e-3, param_rounding="stochastic").init)(F32),
     NOTHING_TO_ROUND),
    (lambda: _nnx_optimizer(osf.safefactor(1e-3, param_rounding="kahan")), NOTHING_TO_ROUND),
    # inject_hyperparams builds the optimizer inside its own init.
    (lambda: optax.inject_hyperparams(osf.safefactor, static_args=("weight_decay_mask",))(
        learning_rate=1e-3, weight_decay_rate=0.1, weight_decay_mask=_no_decay).init(F32),
     NOTHING_DECAYED),
    (lambda: optax.inject_hyperparams(osf.safefactor)(
        learning_rate=1e-3, rounding_seed=3).init(F32), "rounding_seed=3"),
    (lambda: osf.with_param_rounding(osf.safefactor(1e-3, param_rounding="kahan"),
                                     "kahan").init({"w": jnp.ones(3, jnp.bfloat16)}),
     "param_rounding='kahan' " + NOTHING_TO_ROUND),
], ids=["plain", "chain", "multi_steps", "jit", "nnx_optimizer", "inject_hyperparams",
        "inject_hyperparams_construction", "inner_of_with_param_rounding"])
def test_a_warning_points_at_the_users_line(run, message):
  # With stacklevel counted by hand, each pointed one frame up from safefactor's own code:
  # into optax's chain, MultiSteps or inject_hyperparams, JAX's tracing or Flax's
  # Optimizer, where Python's default filter showed it once for every optimizer built so.
  caught = [w for w in _caught(run) if message in str(w.message)]
  assert len(caught) == 1, [str(w.message) for w in _caught(run)]
  assert caught[0].filename == __file__, caught[0].filename
