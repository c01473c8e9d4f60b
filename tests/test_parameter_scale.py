"""The parameter scale ``clip(rms(param), min_parameter_scale, max_parameter_scale)``, by value.

Every other value check uses params whose RMS is far above the default floor (1e-3)
and no ceiling, so neither bound was ever exercised: a scale of ``rms(param)`` alone
passes them all, and with it zero-initialised params never move.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from tests.helpers import max_relative_error
from tests.reference import ReferenceAdafactor

SHAPES = {"w": (24, 20), "b": (20,)}
MIN_DIM = 8


def _grads(step):
  rng = np.random.default_rng(step)
  return {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}


@functools.cache
def _safefactor(**bounds):
  """The transformation and its jitted update, shared by tests with the same bounds."""
  tx = osf.safefactor(0.1, min_dim_size_to_factor=MIN_DIM, **bounds)
  return tx, jax.jit(tx.update)


def _run_against_reference(params, steps=3, **bounds):
  """safefactor and the float64 reference from ``params``, step by step."""
  tx, update = _safefactor(**bounds)
  state = tx.init(params)
  reference = ReferenceAdafactor(learning_rate=0.1, **bounds)
  reference.init_all(params, min_dim_size_to_factor=MIN_DIM)
  for step in range(steps):
    grads = _grads(step)
    updates, state = update(grads, state, params)
    expected = reference.step(grads, params)
    for name in SHAPES:
      assert max_relative_error(updates[name], expected[name]) < 2e-5, (step, name)
    params = optax.apply_updates(params, updates)
  assert int(osf.skipped_steps(state)) == 0
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


def test_zero_initialised_params_move_by_the_floor():
  """Guards against a scale of ``rms(param)`` without its floor: zeros would never move.

  The first update of all-zero params is exactly ``-lr * min_parameter_scale * u``,
  with ``u`` the clipped, normalised gradient (from the reference).
  """
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  reference = ReferenceAdafactor(learning_rate=None, multiply_by_parameter_scale=False)
  normalised = reference.init_all(params, min_dim_size_to_factor=MIN_DIM).step(_grads(0), params)
  tx, update = _safefactor()
  updates, _ = update(_grads(0), tx.init(params), params)
  for name in SHAPES:
    np.testing.assert_allclose(updates[name], 0.1 * 1e-3 * normalised[name], rtol=2e-5)
    assert np.all(np.asarray(updates[name]) != 0)
  # And training goes on from there, step by step with the reference.
  _run_against_reference(params)


@pytest.mark.parametrize("rms", [0.01, 0.2])
def test_min_parameter_scale_other_than_the_default(rms):
  # 0.05 binds for params of RMS 0.01 and not for 0.2: the floor is the argument,
  # not a constant 1e-3.
  params = {k: jnp.full(s, rms) for k, s in SHAPES.items()}
  _run_against_reference(params, min_parameter_scale=0.05)


@pytest.mark.parametrize("rms", [0.1, 2.0])
def test_max_parameter_scale(rms):
  # 0.3 caps params of RMS 2 (updates 6.7 times smaller than rms(param) would give)
  # and leaves params of RMS 0.1 alone. Guards against an ignored or inverted cap.
  params = {k: jnp.full(s, rms) for k, s in SHAPES.items()}
  _run_against_reference(params, max_parameter_scale=0.3)
