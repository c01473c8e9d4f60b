"""float16 updates beyond float16's range are clamped to +-65504, never Inf.

The README promises that updates are "cast back to the gradient dtype, clamped to its
finite range". The skip decision is taken on float32 statistics before that cast, so
a plain ``astype`` would turn a finite float32 update of 1e5 into Inf after the guard
has already passed it: Inf params on the next ``apply_updates``, with nothing skipped.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from tests.reference import ReferenceAdafactor

FLOAT16_MAX = float(jnp.finfo(jnp.float16).max)  # 65504


def _problem():
  rng = np.random.default_rng(0)
  scales = np.outer(np.linspace(0.2, 2.0, 24), np.linspace(2.0, 0.3, 20))
  params = {"w": jnp.asarray(rng.normal(size=(24, 20)), jnp.float16),
            "b": jnp.asarray(rng.normal(size=(20,)), jnp.float16)}
  grads = {"w": jnp.asarray(rng.normal(size=(24, 20)) * scales, jnp.float16),
           "b": jnp.asarray(rng.normal(size=(20,)), jnp.float16)}
  return params, grads


@pytest.mark.parametrize("guard", [True, False])
def test_large_learning_rate_saturates_at_the_float16_maximum(guard):
  """Guards against casting the float32 update with ``astype`` (Inf) instead of clamping.

  The factored estimate gives "w" unnormalised values spread around 1: times 3e4 some
  stay inside float16's range and some do not. Each must equal the float64
  reference's update, clamped to +-65504 (and rounded to float16).
  """
  params, grads = _problem()
  config = dict(multiply_by_parameter_scale=False, clipping_threshold=None)
  tx = osf.safefactor(3e4, min_dim_size_to_factor=8, skip_nonfinite_steps=guard, **config)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  reference = ReferenceAdafactor(learning_rate=3e4, **config)
  expected = reference.init_all(params, min_dim_size_to_factor=8).step(grads, params)
  for name in ("w", "b"):
    assert updates[name].dtype == jnp.float16
    clamped = np.clip(expected[name], -FLOAT16_MAX, FLOAT16_MAX)
    np.testing.assert_allclose(np.asarray(updates[name], np.float64), clamped, rtol=1e-3)
  saturated = np.abs(expected["w"]) > FLOAT16_MAX
  assert 0 < saturated.sum() < saturated.size  # both kinds of element are present
  if guard:
    assert int(osf.skipped_steps(state)) == 0


def test_large_weight_decay_saturates_too():
  # Decoupled weight decay is added after every scaling: 1e6 * 0.5 overflows float16.
  params = {"w": jnp.full((4, 3), 0.5, jnp.float16)}
  tx = osf.safefactor(0.0, weight_decay_rate=1e6)
  updates, state = jax.jit(tx.update)({"w": jnp.ones((4, 3), jnp.float16)}, tx.init(params),
                                      params)
  np.testing.assert_array_equal(updates["w"], np.full((4, 3), -FLOAT16_MAX, np.float16))
  assert int(osf.skipped_steps(state)) == 0


# --- one clamping rule in every write-back mode -------------------------------------------
# 0.2 had two: the nearest cast turned an Inf update into +-65504 while the stochastic and
# Kahan write-backs kept it Inf. The one rule: a finite value beyond the range saturates,
# NaN and Inf pass through (so a guard, or a user with the guard off, sees them).


def _write_back_of(mode, dtype, learning_rate, guard=False):
  params = {"w": jnp.full((8, 6), 0.5, dtype)}
  grads = {"w": jnp.asarray(np.linspace(-2.0, 2.0, 48).reshape(8, 6), dtype)}
  tx = osf.safefactor(learning_rate, skip_nonfinite_steps=guard, param_rounding=mode,
                      multiply_by_parameter_scale=False, clipping_threshold=None)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  return np.asarray(updates["w"], np.float64), np.asarray(grads["w"], np.float64)


@pytest.mark.parametrize("mode", ["nearest", "stochastic", "kahan"])
def test_a_finite_overflow_saturates_in_every_mode(mode):
  update, grad = _write_back_of(mode, jnp.float16, 1e9)
  # Every non-zero gradient's update overflows float16: -sign(g) * 65504 after landing
  # (the landed param, 0.5 + update, rounds to the same largest value).
  nonzero = grad != 0
  landed = np.asarray(jnp.asarray(0.5 + update, jnp.float16), np.float64)
  np.testing.assert_array_equal(np.abs(landed[nonzero]), FLOAT16_MAX)
  np.testing.assert_array_equal(np.sign(update[nonzero]), -np.sign(grad[nonzero]))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("mode", ["nearest", "stochastic", "kahan"])
def test_an_infinite_update_stays_infinite_in_every_mode(mode, dtype):
  # A schedule that returns Inf, with the guard off: the update is -sign(g) * Inf
  # wherever g != 0, whichever way it is written back.
  update, grad = _write_back_of(mode, dtype, lambda count: jnp.inf)
  nonzero = grad != 0
  np.testing.assert_array_equal(update[nonzero], -np.sign(grad[nonzero]) * np.inf)
  # With the guard on the same step is skipped: zero updates, in every mode.
  guarded, _ = _write_back_of(mode, dtype, lambda count: jnp.inf, guard=True)
  np.testing.assert_array_equal(guarded, 0.0)


@pytest.mark.parametrize("mode", ["nearest", "stochastic", "kahan"])
def test_float16_state_past_its_range_saturates_in_every_mode(mode):
  # The same rule for state: stochastic rounding saturated a float16 momentum and float16
  # statistics, where rounding to nearest (and Kahan's) stored Inf. A momentum stored as
  # Inf is read by the next step, not this one: the step that wrote it was applied, and
  # every later one skipped. Here the blend passes 65504 on the second step (1e5 x 0.5 +
  # 5e4 x 0.5), and gradients of 300 make a statistic of 90000 on the first.
  params = {"w": jnp.full((4, 3), 0.5, jnp.float16)}
  grads = {"w": jnp.asarray(np.linspace(-300.0, 300.0, 12).reshape(4, 3), jnp.float16)}
  tx = osf.safefactor(1e5, momentum=0.5, dtype_momentum="float16", state_dtype="float16",
                      param_rounding=mode, multiply_by_parameter_scale=False,
                      clipping_threshold=None, factored=False)
  state, update = tx.init(params), jax.jit(tx.update)
  for _ in range(3):
    _, state = update(grads, state, params)
  momentum = np.asarray(state.inner_state.momentum["w"], np.float64)
  statistics = np.asarray(state.inner_state.second_moment["w"].v, np.float64)
  nonzero = np.asarray(grads["w"], np.float64) != 0
  np.testing.assert_array_equal(np.abs(momentum[nonzero]), FLOAT16_MAX)
  assert statistics.max() == FLOAT16_MAX
  assert int(osf.skipped_steps(state)) == 0


@pytest.mark.parametrize("mode", ["nearest", "stochastic", "kahan"])
def test_a_complex128_params_complex64_momentum_is_stored_as_cast(x64, mode):
  # The rule clamps real values; a complex one has no order to clamp by, and the store
  # failed in jnp.clip for a complex128 param's complex64 momentum (dtype_momentum's
  # default "float32" is complex64 for a complex param).
  params = {"w": jnp.full((4, 3), 1 + 2j, jnp.complex128)}
  tx = osf.safefactor(0.1, momentum=0.9, param_rounding=mode)
  updates, state = jax.jit(tx.update)(params, tx.init(params), params)
  momentum = state.inner_state.momentum["w"]
  assert momentum.dtype == jnp.complex64 and updates["w"].dtype == jnp.complex128
  assert bool(jnp.all(jnp.isfinite(momentum))) and int(osf.skipped_steps(state)) == 0

@pytest.mark.parametrize("mode", ["nearest", "stochastic", "kahan"])
def test_a_param_at_the_float16_maximum_pushed_further(mode):
  # The documented difference between the modes at the range's edge (safefactor's
  # param_rounding): the update itself is finite in every mode, but "nearest" leaves the
  # sum to optax.apply_updates, which adds in float16 and overflows to Inf as it does for
  # any optax transformation; the two landing modes land the param on 65504.
  params = {"w": jnp.full((4, 3), FLOAT16_MAX, jnp.float16)}
  grads = {"w": jnp.full((4, 3), -1.0, jnp.float16)}
  tx = osf.safefactor(1.0, param_rounding=mode)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert np.isfinite(np.asarray(updates["w"], np.float32)).all()
  landed = np.asarray(optax.apply_updates(params, updates)["w"], np.float32)
  expected = np.inf if mode == "nearest" else FLOAT16_MAX
  np.testing.assert_array_equal(landed, np.full((4, 3), expected, np.float32))
  assert int(osf.skipped_steps(state)) == 0


# From each start the largest value is a difference at a tie in the top binade (35504 in
# float16, between 35488 and 35520); each learning rate takes the exact sum past the largest
# value but not past float32's, so that the target is the largest value.
@pytest.mark.parametrize(("dtype", "start", "learning_rate"),
                         [(jnp.float16, 30000.0, 1e9), (jnp.bfloat16, 131 * 2.0**119, 2.525e38)])
@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_landing_tie_past_the_largest_value_stays_finite(mode, dtype, start, learning_rate,
                                                           sign):
  # The difference rounds to its even neighbour, away from zero, and param + update is then
  # a tie just past the largest value (65520), which rounds to Inf. The landing modes
  # landed such a param on Inf, and Kahan's compensation became -Inf, so that every later
  # step was skipped. No update lands it on the largest value: it lands an ulp below.
  largest = jnp.asarray(jnp.finfo(dtype).max, dtype)
  below = np.float32(np.nextafter(largest, jnp.asarray(0, dtype)))
  params = {"w": jnp.full((4, 3), sign * start, dtype)}  # and the mirror image
  grads = {"w": jnp.full((4, 3), -sign, dtype)}
  tx = osf.safefactor(learning_rate, param_rounding=mode, multiply_by_parameter_scale=False,
                      clipping_threshold=None)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  landed = optax.apply_updates(params, updates)["w"]
  np.testing.assert_array_equal(np.asarray(landed, np.float32), sign * below)
  assert jax.tree.all(jax.tree.map(lambda x: bool(jnp.all(jnp.isfinite(x))), state))
  assert int(osf.skipped_steps(state)) == 0
