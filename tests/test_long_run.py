"""Long runs: a bug at step 3000 is not exonerated by a 10-step test."""

import jax
import jax.numpy as jnp
import numpy as np

import optax_safefactor as osf
from tests.helpers import DEAD_UNITS, float16_dead_unit_problem, train_scanned


def test_float16_model_with_dead_units_runs_3000_steps_without_nan():
  params, loss = float16_dead_unit_problem(np.random.default_rng(0), batch=64)
  tx = osf.safefactor(1e-3, momentum=0.9)
  params, state, losses, finite = train_scanned(tx, params, loss, jnp.zeros(3000, bool))
  assert bool(jnp.all(finite))
  assert bool(jnp.all(jnp.isfinite(losses.astype(jnp.float32))))
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state))
  assert int(osf.skipped_steps(state)) == 0
  assert float(losses[-1]) < 0.8 * float(losses[0])
  # Dead units never received a gradient: their weights are exactly where they started.
  np.testing.assert_array_equal(params["bias"][-DEAD_UNITS:], np.full(DEAD_UNITS, -1e3, np.float16))
