"""Runs with JAX's debugging flags on: a finite step never stops them, nor any trace.

JAX's debug flags stop a program at the first NaN (or Inf) that an eager operation computes
or a jitted function returns: the way a user finds where a NaN comes from. A step on finite
gradients must compute neither, with any option, or the flags stop the user's run in the
optimizer instead of at their model's NaN. Before, the spike rule marked "none" in its
history with NaN (so ``init`` alone stopped a run with ``jax_debug_nans`` on), and three
comparisons were made against an Inf constant, which ``jax_debug_infs`` stops at in eager
mode: the spike rule's overflow check, float16 stochastic rounding's next value up, and
``presets.t5x``'s injected global clip of 0.

``jax_check_tracer_leaks`` (``jax.checking_leaks()``) stops a trace that leaves a tracer
referenced after it ends. The GPU form of an unfactored leaf's second half closed over the
leaf's traced floor and cap and over ``eps``, so every guarded step with an unfactored leaf
stopped under it; and a traced ``eps`` (``optax.inject_hyperparams``) escaped its trace when
compiled for a GPU (tests/test_accelerators.py::test_injected_hyperparameters_compile).

What the guard skips is another matter: under ``jax.jit`` the NaN and Inf flags read the
step's outputs, and a skipped step's outputs hold no NaN, so they do not stop at a NaN
gradient the guard skipped (``osf.nonfinite_report`` names its leaf); eager, they stop where
the gradient is first read, as at any NaN.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_safefactor as osf
from optax_safefactor._src import rounding, spikes
from tests.helpers import assert_trees_bitwise_equal, tree_all_finite

DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}
SHAPES = {"w": (6, 5), "b": (5,), "s": ()}
STEPS = 4  # with spike_window=4 the rule judges from the third step on


def _run(tx, params, grads_list, *, jit, losses=None, flags=False):
  """``init`` and the steps; with ``flags`` under both debug flags. Returns (params, state)."""
  if flags:
    with jax.debug_nans(True), jax.debug_infs(True):
      return _run(tx, params, grads_list, jit=jit, losses=losses)
  update = jax.jit(tx.update) if jit else tx.update
  state = tx.init(params)
  for step, grads in enumerate(grads_list):
    extra = {} if losses is None else {"value": jnp.float32(losses[step])}
    updates, state = update(grads, state, params, **extra)
    params = optax.apply_updates(params, updates)
  return params, state


def _problem(seed, dtype, log_magnitude=0.0, zero_fraction=0.0):
  rng = np.random.default_rng(seed)

  def tree(scale):
    values = {name: rng.normal(size=shape) * scale for name, shape in SHAPES.items()}
    return {name: jnp.asarray(np.where(rng.random(size=np.shape(v)) < zero_fraction, 0.0, v),
                              dtype) for name, v in values.items()}

  return tree(1.0), [tree(10.0**log_magnitude) for _ in range(STEPS)]


@settings(max_examples=15)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    momentum=st.sampled_from([None, 0.9]),
    dtype_momentum=st.sampled_from(["float32", "bfloat16"]),
    param_rounding=st.sampled_from(["nearest", "stochastic", "kahan"]),
    skip_spikes=st.sampled_from([None, 6.0, 0.5]),
    with_loss=st.booleans(),
    factored=st.booleans(),
    clipping_threshold=st.sampled_from([None, 1.0]),
    multiply_by_parameter_scale=st.booleans(),
    weight_decay_rate=st.sampled_from([None, 1e-3]),
    state_dtype=st.sampled_from([None, "bfloat16"]),
    pack_small_leaves=st.booleans(),
    skip_nonfinite_steps=st.booleans(),
    log_magnitude=st.floats(-8, 3),
    zero_fraction=st.sampled_from([0.0, 0.5, 1.0]),
    jit=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_finite_steps_run_under_the_debug_flags_as_without_them(
    dtype, momentum, dtype_momentum, param_rounding, skip_spikes, with_loss, factored,
    clipping_threshold, multiply_by_parameter_scale, weight_decay_rate, state_dtype,
    pack_small_leaves, skip_nonfinite_steps, log_magnitude, zero_fraction, jit, seed):
  if skip_spikes is not None and not skip_nonfinite_steps:
    skip_nonfinite_steps = True  # the spike rule is the guard's
  # (dtype_momentum and spike_window only where they act: elsewhere they warn)
  options = {} if momentum is None else {"momentum": momentum, "dtype_momentum": dtype_momentum}
  if skip_spikes is not None:
    options.update(skip_spikes=skip_spikes, spike_window=4)
  options.update({"min_dim_size_to_factor": 2} if factored else {"factored": False})
  narrow_state = state_dtype is not None or options.get("dtype_momentum") == "bfloat16"
  if dtype != "float32" or (param_rounding == "stochastic" and narrow_state):
    options["param_rounding"] = param_rounding
  tx = osf.safefactor(
      1e-2, **options, clipping_threshold=clipping_threshold,
      multiply_by_parameter_scale=multiply_by_parameter_scale,
      weight_decay_rate=weight_decay_rate, state_dtype=state_dtype,
      pack_small_leaves=pack_small_leaves, skip_nonfinite_steps=skip_nonfinite_steps)
  params, grads = _problem(seed, DTYPES[dtype], log_magnitude, zero_fraction)
  losses = [1.0, 1.1, 0.9, 1.05] if with_loss else None
  flagged = _run(tx, params, grads, jit=jit, losses=losses, flags=True)
  plain = _run(tx, params, grads, jit=jit, losses=losses)
  assert_trees_bitwise_equal(flagged, plain)
  assert tree_all_finite(flagged)


def _wrappers():
  return {
      "skip_nonfinite(optax.sgd) with spikes": osf.skip_nonfinite(
          optax.sgd(0.1, momentum=0.9), max_consecutive=3, skip_spikes=6.0, spike_window=4),
      "accumulate_gradients(safefactor with spikes)": osf.accumulate_gradients(
          osf.safefactor(1e-2, momentum=0.9, skip_spikes=6.0, spike_window=4), every_k=2),
      "with_param_rounding(optax.sgd, stochastic)": osf.with_param_rounding(
          optax.sgd(1e-2, momentum=0.9), "stochastic"),
      "with_param_rounding(optax.sgd, kahan)": osf.with_param_rounding(optax.sgd(1e-2), "kahan"),
      "presets.t5x, an injected global clip of 0": optax.inject_hyperparams(osf.presets.t5x)(
          learning_rate=1e-2, global_norm_clip_threshold=0.0),
      "presets.transformers": osf.presets.transformers(skip_spikes=6.0, spike_window=4),
      "presets.big_vision": osf.presets.big_vision(1e-2, skip_spikes=6.0, spike_window=4),
  }


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(_wrappers()))
def test_the_wrappers_and_presets_run_under_the_debug_flags_as_without_them(name, dtype, jit):
  tx = _wrappers()[name]
  params, grads = _problem(3, DTYPES[dtype])
  with jax.numpy_dtype_promotion("standard"):  # optax.sgd's momentum mixes dtypes
    flagged = _run(tx, params, grads, jit=jit, losses=[1.0, 1.1, 0.9, 1.05], flags=True)
    plain = _run(tx, params, grads, jit=jit, losses=[1.0, 1.1, 0.9, 1.05])
  assert_trees_bitwise_equal(flagged, plain)


def test_a_fresh_state_holds_no_nan_or_inf():
  # What jax_debug_nans reads of a jitted step's outputs, the state included.
  params, _ = _problem(0, jnp.bfloat16)
  for tx in (osf.safefactor(1e-2, skip_spikes=6.0), osf.skip_nonfinite(optax.sgd(0.1),
                                                                        skip_spikes=6.0)):
    assert tree_all_finite(tx.init(params))


def test_float16_stochastic_rounding_at_the_largest_value_under_jax_debug_infs():
  # The next value up from the largest float16 was Inf (and the fraction 0 / Inf): now the
  # largest value itself, with the fraction 0. Every draw stays on the largest value.
  largest = float(jnp.finfo(jnp.float16).max)
  x = jnp.array([largest, largest * 1.5, -largest, 1.0 + 2.0**-12], jnp.float32)
  bits = jnp.array([0, 2**32 - 1, 2**31, 2**32 - 1], jnp.uint32)
  with jax.debug_infs(True), jax.debug_nans(True):
    rounded = rounding.stochastic_round(x, jnp.float16, bits)
  assert rounded.tolist() == [largest, largest, -largest, 1.0 + 2.0**-10]


def test_the_spike_limit_leaves_the_missing_losses_out_before_subtracting_under_jax_debug_infs():
  # A step without a loss is marked with the lowest float32: subtracted from a mean past
  # about 1e31 it overflowed to -Inf, unused but computed. The limit is the losses' own:
  # their mean and the standard deviation's floor, 2% of the mean.
  no_loss = float(np.finfo(np.float32).min)
  losses = jnp.array([no_loss, 1e32, 1e32, no_loss], jnp.float32)
  filled = jnp.array([True, True, True, False])
  with jax.debug_infs(True):
    verdict = spikes.spike_limit(losses, filled & (losses > no_loss), jnp.float32(2e32), 6.0, 2)
  np.testing.assert_allclose(float(verdict.limit), 1.12e32, rtol=1e-6)
  assert bool(verdict.spike)


def _state_marked_as_0_3_0(state):
  """``state`` with its spike history's "none" marks as 0.3.0 wrote them: NaN."""
  history = state.spikes
  seen = int(history.skipped_spikes) > 0
  nan = jnp.full([], jnp.nan, jnp.float32)
  no_loss = history.losses == jnp.finfo(jnp.float32).min
  history = history._replace(
      losses=jnp.where(no_loss, jnp.nan, history.losses),
      **({} if seen else {name: nan for name in (
          "last_spike_value", "last_spike_limit", "last_spike_leaf_norm")}))
  return state._replace(spikes=history)


@pytest.mark.parametrize("losses_from", [0, 2])
def test_a_spike_history_marked_by_0_3_0_steps_as_todays_and_is_written_back_without_nan(
    losses_from):
  # A 0.3.0 checkpoint marks a step without a loss, and the spike values before any spike,
  # with NaN: it is read as today's marks (the same verdicts, bit for bit) and written back
  # with them, so that a run resumed from it with jax_debug_nans on is not stopped.
  params, grads = _problem(5, jnp.float32)
  tx = osf.safefactor(1e-2, skip_spikes=6.0, spike_window=4)
  update = jax.jit(tx.update)
  state = tx.init(params)
  for step in range(3):
    extra = {"value": jnp.float32(1.0 + 0.1 * step)} if step >= losses_from else {}
    _, state = update(grads[step], state, params, **extra)
  old = _state_marked_as_0_3_0(state)
  assert not tree_all_finite(old)
  # An ordinary step (the marks kept), then a spike (the last spike's figures written).
  spike = jax.tree.map(lambda g: g * 100, grads[3])
  for grads_now, skipped_spikes in ((grads[3], 0), (spike, 1)):
    expected = update(grads_now, state, params, value=jnp.float32(1.0))
    with jax.debug_nans(True):
      resumed = update(grads_now, old, params, value=jnp.float32(1.0))
    assert int(resumed[1].spikes.skipped_spikes) == skipped_spikes
    assert_trees_bitwise_equal(resumed, expected)
    state, old = expected[1], resumed[1]


def test_a_skipped_nan_gradient_does_not_stop_a_jitted_step_and_stops_an_eager_one():
  params, grads = _problem(7, jnp.float32)
  poisoned = {**grads[0], "w": grads[0]["w"].at[1, 2].set(jnp.nan)}
  tx = osf.safefactor(1e-2)
  state = tx.init(params)
  with jax.debug_nans(True):
    updates, state = jax.jit(tx.update)(poisoned, state, params)
    assert int(osf.skipped_steps(state)) == 1 and tree_all_finite(updates)
    with pytest.raises(FloatingPointError):
      tx.update(poisoned, state, params)


def _traced_configurations():
  static = ("min_dim_size_to_factor", "decay_offset", "spike_window", "rounding_seed",
            "param_rounding")
  injected = optax.inject_hyperparams(osf.safefactor, static_args=static)
  return {
      "safefactor": osf.safefactor(1e-2),
      "unfactored, weight decay": osf.safefactor(1e-2, factored=False, weight_decay_rate=1e-3),
      "guard off, momentum": osf.safefactor(1e-2, skip_nonfinite_steps=False, momentum=0.9),
      "unpacked, momentum, spikes": osf.safefactor(1e-2, pack_small_leaves=False, momentum=0.9,
                                                   skip_spikes=6.0, spike_window=4),
      "stochastic": osf.safefactor(1e-2, param_rounding="stochastic", momentum=0.9,
                                   dtype_momentum="bfloat16"),
      "kahan, max_consecutive_skips": osf.safefactor(1e-2, param_rounding="kahan",
                                                     max_consecutive_skips=3),
      "inject_hyperparams": injected(learning_rate=1e-2, momentum=0.9, eps=1e-30,
                                     weight_decay_rate=1e-3),
      "inject_hyperparams, spikes, stochastic": injected(
          learning_rate=1e-2, skip_spikes=6.0, spike_window=4, param_rounding="stochastic"),
      "accumulate_gradients": osf.accumulate_gradients(osf.safefactor(1e-2), every_k=2),
      "presets.t5x": osf.presets.t5x(1e-2, beta1=0.9),
      "skip_nonfinite(optax.sgd)": osf.skip_nonfinite(optax.sgd(1e-2), skip_spikes=6.0,
                                                      spike_window=4, max_consecutive=3),
      "with_param_rounding(optax.sgd)": osf.with_param_rounding(optax.sgd(1e-2), "stochastic"),
  }


@pytest.mark.parametrize("name", sorted(_traced_configurations()))
def test_no_tracer_outlives_its_trace_under_jax_checking_leaks(name):
  tx = _traced_configurations()[name]
  params = {"w": jnp.ones((160, 130), jnp.bfloat16), "b": jnp.zeros((7,), jnp.bfloat16),
            "u": jnp.ones((3000,), jnp.bfloat16), "f": jnp.ones((4, 3), jnp.bfloat16)}
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.1), params)
  with jax.checking_leaks(), jax.numpy_dtype_promotion("standard"):
    state = jax.jit(tx.init)(params)
    updates, state = jax.jit(lambda g, s, p: tx.update(g, s, p, value=jnp.float32(1.0)))(
        grads, state, params)
  assert tree_all_finite((updates, state))
