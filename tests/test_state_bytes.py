"""The state is the theoretical minimum plus two int32 counters per leaf (README, Performance).

The minimum: float32 rows and columns for a factored leaf, one float32 per element for
any other leaf, and a float32 momentum per element when momentum is on. On top, the
guard keeps two int32 counters per leaf and a few scalars. The benchmark's own check
allows 64 bytes per leaf; this one allows 8 (the two counters) and 64 in all for the
scalars, on a tree with enough leaves that one more counter per leaf shows.
"""

import math

import jax
import jax.numpy as jnp
import pytest

import optax_safefactor as osf
from tests.reference import reference_plan

# 40 leaves: factored (both orientations, a batch axis), unfactored, 1-D and scalars.
SHAPES = [(256, 130), (130, 256), (3, 130, 140), (100, 300), (5, 7), (300,), ()] * 5 + [
    (128, 128), (129, 128), (7,), (1, 1), (2, 3)]
PER_LEAF_COUNTERS = 2 * 4  # nonfinite_steps and last_nonfinite_step, int32
# count, skipped_steps, consecutive_skips, step, ... (16 int32), and the two counters of
# each of the 8 hyperparameters the guard checks (16 int32).
SCALARS_ALLOWED = 128


def _minimum_bytes(params, momentum):
  total = 0
  for param in params.values():
    plan = reference_plan(param.shape, True, 128)
    if plan is None:
      total += 4 * param.size
    else:
      row_axes, col_axes = plan
      rows = [1 if a in col_axes else s for a, s in enumerate(param.shape)]
      cols = [1 if a in row_axes else s for a, s in enumerate(param.shape)]
      total += 4 * (math.prod(rows) + math.prod(cols))
    if momentum:
      total += 4 * param.size
  return total


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("momentum", [None, 0.9])
@pytest.mark.parametrize("guard", [True, False])
def test_state_is_the_minimum_plus_two_counters_per_leaf(guard, momentum, dtype):
  # Guards against a placeholder or a full-size array kept for factored leaves, a state
  # stored in the param dtype (bfloat16: half the minimum, the trap this package
  # avoids), and per-leaf bookkeeping beyond the two counters.
  params = {f"p{i}": jax.ShapeDtypeStruct(s, jnp.dtype(dtype)) for i, s in enumerate(SHAPES)}
  tx = osf.safefactor(1e-3, momentum=momentum, skip_nonfinite_steps=guard)
  state = jax.eval_shape(tx.init, params)
  state_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state))
  minimum = _minimum_bytes(params, momentum)
  overhead = state_bytes - minimum
  per_leaf = PER_LEAF_COUNTERS * len(params) if guard else 0
  assert per_leaf <= overhead <= per_leaf + SCALARS_ALLOWED, (state_bytes, minimum, overhead)
