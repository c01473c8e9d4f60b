"""The write-back of a skipped step: it leaves params and write-back state alone (contract 5, 8).

With momentum or weight decay the update of a skipped step is not zero before the
verdict is applied (it is ``beta1 * m + lambda * p``), so a Kahan compensation
computed from it moves unless the skip keeps the old one; with low-precision momentum
and statistics every stream draws bits, so a skip that consumed any (by counting the
step) would move every later rounding. Every configuration below has momentum and
weight decay, and each run with a NaN step must equal the run without it, bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from tests.helpers import assert_trees_bitwise_equal, run_steps

SHAPES = {"w": (24, 20), "b": (20,)}

WRITE_BACKS = {
    # safefactor's own write-back, float32 statistics.
    "safefactor": lambda mode: osf.safefactor(
        0.05, min_dim_size_to_factor=8, momentum=0.9, weight_decay_rate=1e-2,
        param_rounding=mode),
    # Every stream of safefactor draws bits: momentum, row and column statistics, params.
    "safefactor_low_precision_state": lambda mode: osf.safefactor(
        1e-3, min_dim_size_to_factor=8, momentum=0.9, weight_decay_rate=1e-3,
        dtype_momentum="bfloat16", state_dtype="bfloat16", param_rounding=mode),
    # The wrapper around any optax optimizer, inside the guard.
    "with_param_rounding": lambda mode: osf.skip_nonfinite(
        osf.with_param_rounding(optax.adamw(1e-3, weight_decay=1e-2), mode)),
}


def _tree(seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.normal(size=s) * scale, jnp.bfloat16) for k, s in SHAPES.items()}


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
@pytest.mark.parametrize("write_back", sorted(WRITE_BACKS))
def test_a_skipped_step_changes_nothing(write_back, mode):
  tx = WRITE_BACKS[write_back](mode)
  params = _tree(0)
  good = [_tree(s, scale=0.1) for s in (1, 2, 3)]
  poisoned = {**good[1], "w": good[1]["w"].at[0, 0].set(jnp.nan)}
  # optax.adamw mixes int and float counts.
  with_skip = run_steps(tx, params, [good[0], poisoned, *good[1:]], dtype_promotion="standard")
  clean = run_steps(tx, params, good, dtype_promotion="standard")
  assert int(osf.skipped_steps(with_skip[1])) == 1 and int(osf.skipped_steps(clean[1])) == 0
  assert_trees_bitwise_equal(with_skip[0], clean[0])
  assert_trees_bitwise_equal(with_skip[1].inner_state, clean[1].inner_state)
  assert int(with_skip[1].inner_state.count) == len(good)
  if mode == "kahan":  # the buffer is in use, so keeping it is not trivially true
    assert any(np.any(np.asarray(c)) for c in jax.tree.leaves(clean[1].inner_state.compensation))


@pytest.mark.parametrize("mode", ["nearest", "stochastic", "kahan"])
def test_a_mode_read_from_a_config_is_the_mode(mode):
  # A mode built at run time (read from a config file, say) is equal to the literal but
  # not the same object: the write-back must compare values, not identities.
  built = "".join(list(mode))
  assert built == mode and built is not mode
  params = _tree(0)
  grads = [_tree(s, scale=0.1) for s in (1, 2)]
  for make in (lambda m: osf.safefactor(0.05, momentum=0.9, param_rounding=m),
               lambda m: osf.with_param_rounding(optax.sgd(1e-2), m)):
    assert_trees_bitwise_equal(run_steps(make(built), params, grads)[:2],
                               run_steps(make(mode), params, grads)[:2])
