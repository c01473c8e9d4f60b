"""Bad input, fuzzing with poisoned steps, long runs, checked mode and diagnostics."""

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

import optax_safefactor as osf
from tests.helpers import (
    DEAD_UNITS,
    float16_dead_unit_problem,
    is_all_zero,
    train_scanned,
    tree_all_finite,
)

SHAPES = {"w": (130, 140), "b": (140,)}


def _one_step(grad_value, dtype=jnp.float32, momentum=None, eps=1e-30):
  params = {k: jnp.full(s, 0.5, dtype) for k, s in SHAPES.items()}
  # Built on the host: an eager ``value * ones`` runs through XLA, which flushes a
  # subnormal to 0 on CPU and would silently test the zero gradient again.
  grads = {"w": jnp.asarray(np.full(SHAPES["w"], grad_value, np.dtype(dtype))),
           "b": jnp.ones(SHAPES["b"], dtype)}
  tx = osf.safefactor(0.01, momentum=momentum, eps=eps)
  state = tx.init(params)
  updates, new_state = jax.jit(tx.update)(grads, state, params)
  return state, grads, updates, new_state


@pytest.mark.parametrize("value,skipped", [
    (np.nan, True), (np.inf, True), (-np.inf, True),
    (1e38, True),       # finite, but its square overflows float32
    (1e-45, False),     # a float32 subnormal: a tiny, finite step
    (0.0, False),
])
def test_gradient_value_matrix(value, skipped):
  state, _, updates, new_state = _one_step(value, momentum=0.9)
  assert int(osf.skipped_steps(new_state)) == int(skipped)
  assert tree_all_finite((updates, new_state))
  if skipped:
    assert all(is_all_zero(u) for u in jax.tree.leaves(updates))
    for a, b in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(new_state.inner_state),
                    strict=True):
      np.testing.assert_array_equal(a, b)
    assert osf.nonfinite_report(new_state)["nonfinite_steps/params['w']"] == 1
  elif value == 0.0:
    assert is_all_zero(updates["w"])


@pytest.mark.parametrize("eps", [1e-30, 0.0])
def test_float32_subnormal_gradients(eps):
  """Subnormal gradients (1e-45) give a finite, tiny or zero update, and no skip.

  XLA on CPU flushes subnormals inside a computation, so the update is computed from
  zeros there (elsewhere, 1e-45 / sqrt(eps) at most): what the package promises is
  that nothing becomes Inf or NaN. With ``eps=0`` the squares add nothing to the
  state, so this guards against a missing floor under the rsqrt (0/0 would make the
  step NaN, and skipped) as well as against NaN from the subnormals themselves.
  """
  state, grads, updates, new_state = _one_step(1e-45, momentum=0.9, eps=eps)
  held = np.asarray(grads["w"])
  assert np.all(held > 0) and np.all(held < np.finfo(np.float32).tiny)  # really subnormal
  assert int(osf.skipped_steps(new_state)) == 0
  assert tree_all_finite((updates, new_state))
  assert float(jnp.max(jnp.abs(updates["w"]))) < 1e-30
  moment = new_state.inner_state.second_moment["w"]
  for stat in (moment.v_row, moment.v_col):
    # beta2 is 0 on the first step: the statistics are the mean of g**2 + eps, with
    # g**2 at most 2e-90 (underflowing to 0 in float32).
    np.testing.assert_allclose(stat, np.float32(eps), rtol=1e-6, atol=0)
  assert int(state.inner_state.count) == 0 and int(new_state.inner_state.count) == 1


def test_mixture_of_bad_values_is_one_skipped_step():
  params = {k: jnp.full(s, 0.5) for k, s in SHAPES.items()}
  w = jnp.zeros(SHAPES["w"]).at[0, 0].set(jnp.nan).at[1, 1].set(jnp.inf).at[2, 2].set(1e38)
  grads = {"w": w.at[3, 3].set(1e-45), "b": jnp.full(SHAPES["b"], -jnp.inf)}
  tx = osf.safefactor(0.01)
  _, state = tx.update(grads, tx.init(params), params)
  report = osf.nonfinite_report(state)
  assert report["skipped_steps"] == 1
  assert report["nonfinite_steps/params['w']"] == 1 and report["nonfinite_steps/params['b']"] == 1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "complex64"])
def test_param_dtype_matrix(dtype, x64):
  dtype = jnp.dtype(dtype)
  rng = np.random.default_rng(0)
  values = rng.normal(size=SHAPES["w"])
  if jnp.issubdtype(dtype, jnp.complexfloating):
    values = values + 1j * rng.normal(size=SHAPES["w"])
  params = {"w": jnp.asarray(values, dtype)}
  tx = osf.safefactor(0.01, momentum=0.9)
  state = tx.init(params)
  updates, state = tx.update(jax.tree.map(lambda p: p * 0.1, params), state, params)
  assert updates["w"].dtype == dtype
  stat_dtype = jnp.float64 if dtype in (jnp.float64,) else jnp.float32
  assert state.inner_state.second_moment["w"].v_row.dtype == stat_dtype
  assert tree_all_finite((updates, state))
  assert int(osf.skipped_steps(state)) == 0


def test_bool_params_are_refused():
  with pytest.raises(TypeError, match=r"params\['mask'\]: param dtype bool"):
    osf.safefactor(0.1).init({"w": jnp.ones(3), "mask": jnp.ones(3, bool)})


@settings(max_examples=15)
@given(
    shape=st.lists(st.sampled_from([1, 3, 8, 17]), min_size=1, max_size=3),
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    log_magnitude=st.floats(-8, 3),
    momentum=st.sampled_from([None, 0.9]),
    poisoned=st.sets(st.integers(0, 7), max_size=4),
    poison=st.sampled_from([np.nan, np.inf, -np.inf]),
    seed=st.integers(0, 1000),
)
def test_fuzz_poisoned_steps_are_counted_exactly(shape, dtype, log_magnitude, momentum, poisoned,
                                                 poison, seed):
  rng = np.random.default_rng(seed)
  shape, dtype = tuple(shape), jnp.dtype(dtype)
  params = {"x": jnp.asarray(rng.normal(size=shape), dtype), "y": jnp.ones((4, 5), dtype)}
  tx = osf.safefactor(0.01, min_dim_size_to_factor=2, momentum=momentum)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(8):
    grad = rng.normal(size=shape) * 10.0**log_magnitude
    if step in poisoned:
      grad.flat[rng.integers(grad.size)] = poison
    grads = {"x": jnp.asarray(grad, dtype), "y": jnp.ones((4, 5), dtype)}
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  assert tree_all_finite((params, state))
  assert int(osf.skipped_steps(state)) == len(poisoned)
  report = osf.nonfinite_report(state)
  # A leaf that was never non-finite has no keys; one that was has both.
  assert report.get("nonfinite_steps/params['x']", 0) == len(poisoned)
  assert "nonfinite_steps/params['y']" not in report
  assert "last_nonfinite_step/params['y']" not in report
  assert report.get("last_nonfinite_step/params['x']", -1) == (max(poisoned) if poisoned else -1)
  assert ("last_nonfinite_step/params['x']" in report) == bool(poisoned)


def test_ten_thousand_float16_steps_with_dead_units_and_nan_batches():
  rng = np.random.default_rng(0)
  steps = 10_000
  poisoned = np.sort(rng.choice(steps, size=37, replace=False))
  params, loss = float16_dead_unit_problem(rng)
  initial_loss = float(loss(params))
  tx = osf.safefactor(1e-3, momentum=0.9)
  is_poisoned = jnp.zeros(steps, bool).at[poisoned].set(True)
  params, state, _, finite = train_scanned(tx, params, loss, is_poisoned)
  assert bool(jnp.all(finite)) and tree_all_finite(state)
  report = osf.nonfinite_report(state)
  assert report["skipped_steps"] == len(poisoned) and report["steps"] == steps
  assert report["last_nonfinite_step/params['hidden']"] == int(poisoned[-1])
  assert int(state.inner_state.count) == steps - len(poisoned)
  # Measured: 1.49 at the start, 0.0010 at the end and at most 0.0020 over the last 1000
  # steps (float16 noise); without momentum 0.0038. The old bound, 0.9 of the initial
  # loss, passed any run that learned at all; this one needs the loss to fall by 99.7%.
  assert initial_loss > 1.0 and float(loss(params)) < 0.005
  np.testing.assert_array_equal(params["bias"][-DEAD_UNITS:], np.full(DEAD_UNITS, -1e3, np.float16))


def _checked_step():
  tx = osf.safefactor(0.1, checked=True)
  params = {"dense": {"kernel": jnp.ones((4, 3))}}

  def step(state, grads):
    return tx.update(grads, state, params)

  bad = {"dense": {"kernel": jnp.ones((4, 3)).at[1, 2].set(jnp.nan)}}
  good = {"dense": {"kernel": jnp.ones((4, 3))}}
  return step, tx.init(params), good, bad


def test_checked_mode_with_checkify_names_path_and_step():
  step, state, good, bad = _checked_step()
  checked = jax.jit(checkify.checkify(step))
  error, (_, state) = checked(state, good)
  error.throw()
  error, (updates, new_state) = checked(state, bad)
  with pytest.raises(checkify.JaxRuntimeError,
                     match=r"params\['dense'\]\['kernel'\]: non-finite .* at step 1"):
    error.throw()
  assert int(osf.skipped_steps(new_state)) == 1 and is_all_zero(updates["dense"]["kernel"])


@pytest.mark.parametrize("build", ["safefactor", "skip_nonfinite"])
def test_checked_mode_compiled_without_checkify_names_the_setting(build):
  if build == "safefactor":
    tx = osf.safefactor(0.1, checked=True)
  else:
    tx = osf.skip_nonfinite(optax.sgd(0.1), checked=True)
  params = {"dense": {"kernel": jnp.ones((4, 3))}}
  state = tx.init(params)

  def step(state, grads):
    return tx.update(grads, state, params)

  with pytest.raises(osf.CheckedWithoutCheckifyError,
                     match=r"checked=True .* checkify\.checkify\(step\)"):
    jax.jit(step)(state, params)
  # Nothing is compiled by eval_shape, and under checkify the marker is an identity.
  assert jax.eval_shape(step, state, params)[1].step.shape == ()
  error, (_, new_state) = jax.jit(checkify.checkify(step))(state, params)
  error.throw()
  assert int(new_state.step) == 1
  # JAX's own runtime-error mode compiles the checks: the marker compiles to nothing.
  jax.config.update("jax_experimental_unsafe_xla_runtime_errors", True)
  try:
    _, new_state = jax.jit(step)(state, params)
  finally:
    jax.config.update("jax_experimental_unsafe_xla_runtime_errors", False)
  assert int(new_state.step) == 1


def test_checked_mode_vmaps_under_checkify():
  # An ensemble of two optimizers stepped by one vmapped step: the checked marker is batched
  # with its member (its batching rule), and only the member with NaN is skipped and named.
  tx = osf.safefactor(0.1, checked=True)
  one = {"dense": {"kernel": jnp.ones((4, 3))}}
  params = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), one)
  states = jax.vmap(tx.init)(params)
  checked = jax.jit(checkify.checkify(jax.vmap(lambda state, grads, params:
                                               tx.update(grads, state, params))))
  good = jax.tree.map(jnp.ones_like, params)
  error, (updates, _) = checked(states, good, params)
  error.throw()

  def member(tree, i):
    return jax.tree.map(lambda x: x[i], tree)

  for i in range(2):
    alone, _ = tx.update(member(good, i), member(states, i), member(params, i))
    np.testing.assert_array_equal(member(updates, i)["dense"]["kernel"],
                                  alone["dense"]["kernel"])
  bad = {"dense": {"kernel": good["dense"]["kernel"].at[1, 1, 2].set(jnp.nan)}}
  error, (updates, new_states) = checked(states, bad, params)
  with pytest.raises(checkify.JaxRuntimeError, match=r"params\['dense'\]\['kernel'\]: non-finite"):
    error.throw()
  assert osf.skipped_steps(new_states).tolist() == [0, 1]
  assert not is_all_zero(updates["dense"]["kernel"][0])
  assert is_all_zero(updates["dense"]["kernel"][1])


_CHEXIFY_RUN = """
import chex, jax, jax.numpy as jnp
from jax.experimental import checkify
import optax_safefactor as osf

tx = osf.safefactor(0.1, checked=True)
params = {"dense": {"kernel": jnp.ones((4, 3))}}
checked = chex.chexify(jax.jit(lambda state, grads: tx.update(grads, state, params)))
_, state = checked(tx.init(params), params)
chex.block_until_chexify_assertions_complete()
bad = {"dense": {"kernel": jnp.ones((4, 3)).at[1, 2].set(jnp.nan)}}
try:
  checked(state, bad)
  chex.block_until_chexify_assertions_complete()
except checkify.JaxRuntimeError as error:
  print("raised:", error, flush=True)
"""


def test_checked_mode_with_chexify():
  # In a process of its own: chex keeps every chexified function registered until the process
  # exits and then logs "[Chex] Some of chexify assertion statuses were not inspected", even
  # when every status was inspected, which would end the suite's output with a false warning
  # (.ci/run fails on that line).
  result = subprocess.run([sys.executable, "-c", _CHEXIFY_RUN], capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stderr
  assert re.search(r"raised: params\['dense'\]\['kernel'\]: non-finite .* at step 1",
                   result.stdout), result.stdout + result.stderr


def test_summary_line():
  params = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
  tx = osf.safefactor(0.1)
  state = tx.init(params)
  for value in (1.0, jnp.nan, jnp.nan, 1.0):
    _, state = tx.update({"w": jnp.full((2, 3), value), "b": jnp.ones(3)}, state, params)
  assert osf.nonfinite_summary(state) == (
      "skipped 2 of 4 steps (0 in a row); non-finite: params['w'] x2 (last at step 2)")


def _with_stat(state, name, value):
  """``state`` with one statistic of leaf ``w`` (or ``b``) overwritten at one place."""
  leaf = "b" if name == "v" else "w"
  moment = state.inner_state.second_moment[leaf]
  stat = getattr(moment, name)
  poisoned = moment._replace(**{name: stat.at[(0,) * stat.ndim].set(value)})
  second_moment = {**state.inner_state.second_moment, leaf: poisoned}
  return state._replace(inner_state=state.inner_state._replace(second_moment=second_moment))


@pytest.mark.parametrize("clipping", [1.0, None])
@pytest.mark.parametrize("name", ["v_row", "v_col", "v"])
@pytest.mark.parametrize("value", [np.inf, np.nan])
def test_a_nonfinite_statistic_in_the_state_is_caught(clipping, name, value):
  # An Inf column statistic scales its column by rsqrt(Inf) = 0: the update stays
  # finite, so only a witness of the statistic itself can see it.
  params = {k: jnp.full(s, 0.5) for k, s in SHAPES.items()}
  grads = {k: jnp.ones(s) for k, s in SHAPES.items()}
  tx = osf.safefactor(0.01, clipping_threshold=clipping)
  # After one step beta2 > 0 (at step 0 it is 0, and 0 * Inf would make NaN).
  _, state = tx.update(grads, tx.init(params), params)
  state = _with_stat(state, name, value)
  updates, new_state = jax.jit(tx.update)(grads, state, params)
  assert int(osf.skipped_steps(new_state)) == 1
  assert all(is_all_zero(u) for u in jax.tree.leaves(updates))
  leaf = "b" if name == "v" else "w"
  assert osf.nonfinite_report(new_state)[f"nonfinite_steps/params['{leaf}']"] == 1


@pytest.mark.parametrize("clipping", [1.0, None])
def test_a_column_statistic_that_overflows_is_caught(clipping):
  # Every square is finite (2.25e36) and so is the mean of every column of 1000, but
  # the mean along one row of 200 overflows. That row's statistic is the one outside
  # the normaliser (v_col: axis 0, the largest, holds the column role): its factor
  # becomes 0 and the update stays finite.
  params = {"w": jnp.full((1000, 200), 0.5)}
  grads = {"w": jnp.zeros((1000, 200)).at[7, :].set(1.5e18)}
  tx = osf.safefactor(0.01, clipping_threshold=clipping)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert state.inner_state.second_moment["w"].v_col.shape == (1000, 1)
  assert int(osf.skipped_steps(state)) == 1
  assert tree_all_finite((updates, state))
