"""Migration: optax.adafactor for N steps, convert, safefactor for M steps == N + M optax steps."""

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_safefactor as osf
from tests.helpers import max_relative_error, random_tree, run_steps

SHAPES = {"tall": (300, 140), "wide": (140, 300), "stacked": (3, 130, 150), "bias": (150,)}


def _continue(optax_tx, safe_tx, n, m, rng):
  params = random_tree(rng, SHAPES)
  grads = [random_tree(rng, SHAPES, scale=10.0 ** (step % 3 - 1)) for step in range(n + m)]
  with jax.numpy_dtype_promotion("standard"):
    _, _, expected = run_steps(optax_tx, params, grads.__getitem__, n + m)
    params, optax_state, _ = run_steps(optax_tx, params, grads.__getitem__, n)
  state = osf.migrate_from_optax(optax_state, safe_tx, params)
  update = jax.jit(safe_tx.update)
  for step in range(n, n + m):
    updates, state = update(grads[step], state, params)
    scale = max(float(jnp.max(jnp.abs(u))) for u in expected[step].values())
    for name in SHAPES:
      assert max_relative_error(updates[name], expected[step][name], scale) < 1e-5, (step, name)
    params = optax.apply_updates(params, updates)
  return state


@pytest.mark.parametrize("momentum", [None, 0.9])
def test_adafactor_job_continues_with_safefactor(momentum, rng):
  config = dict(momentum=momentum, weight_decay_rate=1e-3)
  state = _continue(optax.adafactor(0.05, **config), osf.safefactor(0.05, **config), 6, 6, rng)
  assert int(osf.skipped_steps(state)) == 0
  assert int(optax.tree_utils.tree_get(state, "count")) == 12


def test_scale_by_factored_rms_continues(rng):
  state = _continue(optax.scale_by_factored_rms(), osf.scale_by_safe_factored_rms(), 5, 5, rng)
  assert int(state.count) == 10


def test_mismatched_factoring_is_refused(rng):
  params = random_tree(rng, SHAPES)
  optax_state = optax.adafactor(0.1, min_dim_size_to_factor=200).init(params)
  with pytest.raises(ValueError, match=r"params\['\w+'\]: optax and safefactor factor"):
    osf.migrate_from_optax(optax_state, osf.safefactor(0.1), params)
  with pytest.raises(ValueError, match="momentum"):
    osf.migrate_from_optax(optax.adafactor(0.1).init(params), osf.safefactor(0.1, momentum=0.9),
                           params)
