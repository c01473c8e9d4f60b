"""One regression test per trap in the incumbents (see the design notes' table).

Each test shows the trap where optax still has it, so the test can fail: it
asserts the incumbent's failure as well as safefactor's success.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_safefactor as osf
from tests.helpers import (
  assert_trees_close,
  assert_trees_equal,
  is_all_zero,
  max_relative_error,
  random_tree,
  run_steps,
  tree_all_finite,
)
from tests.reference import ReferenceAdafactor


def _float16_problem(gradient_value: float):
  params = {"w": jnp.full((256, 130), 0.5, jnp.float16), "b": jnp.full((130,), 0.5, jnp.float16)}
  grads = jax.tree.map(lambda p: jnp.full(p.shape, gradient_value, jnp.float16), params)
  return params, grads


@pytest.mark.parametrize("gradient_value", [0.0, 1e-7, 300.0])
def test_float16_zero_tiny_and_large_gradients(gradient_value):
  params, grads = _float16_problem(gradient_value)
  with jax.numpy_dtype_promotion("standard"):
    _, _, optax_history = run_steps(optax.adafactor(0.01), params, lambda _: grads, 3)
  assert not tree_all_finite(optax_history), "optax is expected to fail here"

  _, state, history = run_steps(osf.safefactor(0.01), params, lambda _: grads, 3)
  assert tree_all_finite((history, state))
  assert int(osf.skipped_steps(state)) == 0
  for updates in history:
    assert updates["w"].dtype == jnp.float16
    if gradient_value == 0.0:
      assert is_all_zero(updates["w"])
  if gradient_value != 0.0:
    # Unit RMS, times lr and the parameter scale 0.5, against the gradient's sign.
    np.testing.assert_allclose(history[0]["w"].astype(jnp.float32), -0.005, rtol=1e-3)


def test_float16_gradients_match_float32_run():
  params16, grads16 = _float16_problem(300.0)
  params32 = jax.tree.map(lambda x: x.astype(jnp.float32), params16)
  grads32 = jax.tree.map(lambda x: x.astype(jnp.float32), grads16)
  _, state16, h16 = run_steps(osf.safefactor(0.01), params16, lambda _: grads16, 5)
  _, state32, h32 = run_steps(osf.safefactor(0.01), params32, lambda _: grads32, 5)
  assert_trees_equal(state16, state32)
  for a, b in zip(jax.tree.leaves(h16), jax.tree.leaves(h32), strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), rtol=1e-3)


def test_bfloat16_state_tracks_float32_after_gradient_jump():
  # beta2 = 0.999: 1 - beta2 is below bfloat16's resolution near 1, so a bfloat16
  # state cannot follow a 10x jump in the gradient. safefactor keeps float32 state.
  def run(tx_factory, dtype):
    def grads(step):
      return {"w": jnp.full((130, 200), 1.0 if step < 200 else 10.0, dtype)}

    params = {"w": jnp.ones((130, 200), dtype)}
    return run_steps(tx_factory(), params, grads, 400, apply_updates=False)[1]

  def ours():
    return osf.scale_by_safe_factored_rms(decay_rate_fn=lambda step, rate: jnp.float32(0.999))

  def theirs():
    return optax.scale_by_factored_rms(decay_rate_fn=lambda step, rate: jnp.float32(0.999))

  kept = 0.999**200  # the EMA, started at ~0, after 200 steps of 1 and 200 steps of 100
  expected = kept * (1 - kept) * 1.0 + (1 - kept) * 100.0
  bf16 = run(ours, jnp.bfloat16).second_moment["w"]
  f32 = run(ours, jnp.float32).second_moment["w"]
  for name in ("v_row", "v_col"):
    np.testing.assert_allclose(getattr(bf16, name), getattr(f32, name), rtol=1e-6)
    np.testing.assert_allclose(getattr(bf16, name), expected, rtol=1e-3)

  with jax.numpy_dtype_promotion("standard"):
    stuck = run(theirs, jnp.bfloat16)
  assert float(jnp.max(stuck.v_row["w"] if isinstance(stuck.v_row, dict) else stuck.v_row)) < (
      0.9 * expected
  ), "optax's bfloat16 state is expected to lag"


_TALL_CONFIG = dict(learning_rate=0.1, min_dim_size_to_factor=4, momentum=0.9)


def _update_of(param_shape, grads_sequence, **config):
  tx = osf.safefactor(**{**_TALL_CONFIG, **config})
  params = {"w": jnp.linspace(-1.0, 1.0, int(np.prod(param_shape))).reshape(param_shape)}
  state = tx.init(params)
  update = jax.jit(tx.update)  # one compilation per shape: eager dispatch is far slower
  for grads in grads_sequence:
    updates, state = update({"w": grads}, state, params)
  return updates["w"]


def _reference_update_of(param_shape, grads_sequence):
  """The float64 reference's last update for ``_update_of``'s problem, and the reference."""
  params = {"w": np.linspace(-1.0, 1.0, int(np.prod(param_shape))).reshape(param_shape)}
  config = dict(_TALL_CONFIG)
  min_dim = config.pop("min_dim_size_to_factor")
  reference = ReferenceAdafactor(**config).init_all(params, min_dim_size_to_factor=min_dim)
  for grads in grads_sequence:
    expected = reference.step({"w": np.asarray(grads)}, params)
  return expected["w"], reference


def _rows_and_columns_of_different_scales(rng, shape, steps=3):
  # Scales that vary along both axes, so that neither factor is close to 1.
  scales = np.outer(np.linspace(0.1, 3.0, shape[0]), np.linspace(3.0, 0.2, shape[1]))
  return [jnp.asarray(rng.normal(size=shape) * scales, jnp.float32) for _ in range(steps)]


def test_tall_matrix_update_matches_the_reference(rng):
  """Guards against the timm AdafactorBigVision bug (fixed in its PR 2749).

  Its state keeps the reduced axis, but the normaliser (the mean of the row statistic)
  was taken over the column axes, where that statistic already has size 1: the row
  factor ``sqrt(mean(v_row) / v_row)`` became exactly 1 for tall matrices. That bug is
  the same for a matrix and its transpose, so only a comparison of one matrix's
  update with the float64 reference (exact formulas) can see it.
  """
  grads = _rows_and_columns_of_different_scales(rng, (30, 20))
  tall = _update_of((30, 20), grads)
  expected, reference = _reference_update_of((30, 20), grads)
  assert max_relative_error(tall, expected) < 1e-5
  # The row factor is far from 1 here, so the timm bug moves the update by far more
  # than the tolerance above.
  row = reference.row["w"]
  row_factor = np.sqrt(row.mean(axis=reference.plans["w"][0], keepdims=True) / row)
  assert np.ptp(row_factor) > 0.5, row_factor
  # And the orientation does not matter: the tall update is the wide one's transpose.
  wide = _update_of((20, 30), [g.T for g in grads])
  assert_trees_close(tall, wide.T, rtol=1e-5)


@settings(max_examples=8)
@given(
    shape=st.lists(st.integers(4, 9), min_size=3, max_size=4, unique=True),
    data=st.data(),
)
def test_update_is_equivariant_under_axis_permutations(shape, data):
  permutation = data.draw(st.permutations(range(len(shape))))
  rng = np.random.default_rng(len(shape))
  grads = [jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2)]
  original = _update_of(tuple(shape), grads)
  permuted_shape = tuple(shape[a] for a in permutation)
  permuted = _update_of(permuted_shape, [jnp.transpose(g, permutation) for g in grads])
  # The parameter values differ under permutation only by position; the parameter
  # scale is an RMS, so it is invariant too.
  assert_trees_close(jnp.transpose(original, permutation), permuted, rtol=1e-5)
  # Equivariance cannot see a bug that every orientation shares (a normaliser over the
  # wrong axes, a batch axis reduced away): the unpermuted update must also equal the
  # float64 reference's.
  expected, _ = _reference_update_of(tuple(shape), grads)
  assert max_relative_error(original, expected) < 1e-5


def _poisoned_run(poison, momentum, steps=8, poisoned_step=3):
  rng = np.random.default_rng(1)
  shapes = {"w": (140, 130), "b": (130,)}
  params = random_tree(rng, shapes)
  clean = [random_tree(rng, shapes) for _ in range(steps)]
  tx = osf.safefactor(0.05, momentum=momentum)

  def poisoned(step):
    if step != poisoned_step:
      return clean[step]
    return {"w": clean[step]["w"].at[7, 11].set(poison), "b": clean[step]["b"]}

  with_poison = run_steps(tx, params, poisoned, steps)
  without = run_steps(tx, params, lambda step: clean[step + (step >= poisoned_step)], steps - 1)
  return with_poison, without


@pytest.mark.parametrize(
    "poison,momentum",
    list(itertools.product([jnp.nan, jnp.inf, -jnp.inf, 3e38], [None, 0.9])),
)
def test_one_poisoned_element_equals_run_without_that_step(poison, momentum):
  (params, state, history), (expected_params, expected_state, _) = _poisoned_run(poison, momentum)
  assert all(is_all_zero(u) for u in jax.tree.leaves(history[3]))
  assert_trees_equal(params, expected_params)
  assert_trees_equal(state.inner_state, expected_state.inner_state)
  assert int(osf.skipped_steps(state)) == 1
  assert state.nonfinite_steps.host_values() == {"params['b']": 0, "params['w']": 1}
  assert state.last_nonfinite_step.host_values() == {"params['b']": -1, "params['w']": 3}


def test_squared_gradient_overflow_is_caught_inside_the_transform():
  # 1e20 is a finite float32 whose square is not: the incoming gradient passes
  # optax.apply_if_finite, the NaN/Inf is made inside the transform.
  params = {"w": jnp.ones((130, 130))}
  grads = {"w": jnp.ones((130, 130)).at[0, 0].set(1e20)}
  assert bool(jnp.all(jnp.isfinite(grads["w"])))
  with jax.numpy_dtype_promotion("standard"):
    guarded_optax = optax.apply_if_finite(optax.adafactor(0.1), max_consecutive_errors=5)
    updates, state = guarded_optax.update(grads, guarded_optax.init(params), params)
  assert not tree_all_finite(state.inner_state) and int(state.total_notfinite) == 0

  tx = osf.safefactor(0.1)
  state = tx.init(params)
  updates, new_state = tx.update(grads, state, params)
  assert int(osf.skipped_steps(new_state)) == 1
  assert is_all_zero(updates["w"])
  assert_trees_equal(new_state.inner_state, state.inner_state)


def test_decay_offset_larger_than_step_count(rng):
  params = random_tree(rng, {"w": (130, 140), "b": (5,)})
  grads = random_tree(rng, {"w": (130, 140), "b": (5,)})
  with jax.numpy_dtype_promotion("standard"):
    _, optax_state, _ = run_steps(optax.adafactor(0.1, decay_offset=100), params,
                                  lambda _: grads, 3)
  assert not tree_all_finite(optax_state), "optax is expected to produce NaN here"
  _, state, history = run_steps(osf.safefactor(0.1, decay_offset=100), params,
                                lambda _: grads, 3)
  assert tree_all_finite((state, history)) and int(osf.skipped_steps(state)) == 0
  # Before the offset every step uses the first step's beta2 (0): the state is g**2 + eps.
  np.testing.assert_allclose(state.inner_state.second_moment["b"].v, grads["b"] ** 2, rtol=1e-6)


def test_all_zero_rows_and_dead_units_stay_finite():
  params = {"w": jnp.ones((200, 130), jnp.float16)}
  grads = {"w": jnp.zeros((200, 130), jnp.float16).at[:100].set(0.01)}
  _, state, history = run_steps(osf.safefactor(0.01), params, lambda _: grads, 5)
  assert tree_all_finite((state, history))
  assert is_all_zero(history[-1]["w"][100:])
  assert float(jnp.min(jnp.abs(history[-1]["w"][:100]))) > 0.0
