"""Spike skipping (``skip_spikes``): the rule against a NumPy restatement, and its contract.

The reference (``tests.reference.ReferenceSpikeRule``) restates the rule from its
docstring in float64 over the recorded statistics; the tests compare the exact positions of the
skipped steps, the counters and the runs' bits.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf
from tests.helpers import assert_trees_bitwise_equal, assert_trees_close, is_all_zero
from tests.reference import ReferenceSpikeRule

SHAPES = {"w": (12, 9), "b": (9,)}


def reference_skips(norms, losses=None, *, threshold, window, nonfinite=()):
  """The spike rule in float64 (``tests.reference.ReferenceSpikeRule``): per step,
  "spike", "nonfinite" or "applied" (a spike taken at the bound is applied).

  ``norms`` (and ``losses``, NaN for a step without one) are each step's statistics.
  """
  rule = ReferenceSpikeRule(threshold, window, ["g"])
  verdicts = []
  for step, norm in enumerate(norms):
    loss = None if losses is None else losses[step]
    verdict = rule.step({"g": np.asarray([np.nan if step in nonfinite else norm])}, loss)
    verdicts.append("applied" if verdict == "restart" else verdict)
  return verdicts


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}


def _grads(scales, seed=1):
  """Per step, a random gradient tree scaled by ``scales[step]`` (a fresh direction each)."""
  rng = np.random.default_rng(seed)
  return [{k: jnp.asarray(rng.normal(size=s) * scale, jnp.float32) for k, s in SHAPES.items()}
          for scale in scales]


def _norm(grads):
  return float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2)
                           for g in jax.tree.leaves(grads))))


def _run(tx, grads, params=None, values=None):
  """Steps ``tx`` on each tree of ``grads`` (params fixed); per step, whether it was skipped."""
  params = _params() if params is None else params
  state = tx.init(params)
  update = jax.jit(tx.update)
  skipped, total = [], 0
  for step, g in enumerate(grads):
    extra = {} if values is None else {"value": values[step]}
    updates, state = update(g, state, params, **extra)
    now = int(osf.skipped_steps(state))
    skipped.append(now > total)
    total = now
  return state, skipped, updates


def _scales(steps, seed, spikes=(), jump_at=None):
  rng = np.random.default_rng(seed)
  scales = 1 + 0.1 * rng.uniform(-1, 1, steps)
  for step, factor in spikes:
    scales[step] *= factor
  if jump_at is not None:
    scales[jump_at:] *= 3
  return scales


def _safefactor(skip_spikes=None, spike_window=128, **kwargs):
  return osf.safefactor(1e-2, momentum=0.9, min_dim_size_to_factor=4, skip_spikes=skip_spikes,
                        spike_window=spike_window, **kwargs)


def _safefactor_to_inject(skip_spikes=None, spike_window=128):
  return _safefactor(skip_spikes, spike_window)


SUBJECTS = {
    "safefactor": _safefactor,
    "skip_nonfinite": lambda **kw: osf.skip_nonfinite(optax.sgd(1e-2, momentum=0.9), **kw),
}


@pytest.mark.parametrize("subject", sorted(SUBJECTS))
def test_skip_positions_equal_the_reference_rule(subject):
  # Spikes of several sizes, two close together, a lasting tripling and a NaN step.
  window = 16
  scales = _scales(140, seed=3, spikes=[(20, 4.0), (30, 50.0), (33, 3.0), (60, 1.3)],
                   jump_at=90)
  grads = _grads(scales)
  grads[45] = {**grads[45], "b": grads[45]["b"].at[0].set(jnp.nan)}
  tx = SUBJECTS[subject](skip_spikes=6.0, spike_window=window)
  state, skipped, _ = _run(tx, grads)
  expected = reference_skips([_norm(g) for g in grads], threshold=6.0, window=window,
                             nonfinite={45})
  assert [s for s, v in enumerate(skipped) if v] == [
      s for s, v in enumerate(expected) if v != "applied"]
  spikes = [s for s, v in enumerate(expected) if v == "spike"]
  # The reference's own sanity: the spikes at 20, 30 and 33 are found (33 only because 30
  # stayed out of the history), the 30% rise at 60 and the NaN step at 45 are not spikes.
  assert {20, 30, 33} <= set(spikes) and 60 not in spikes and 45 not in spikes
  # The tripling at 90: window // 2 spike skips, then the history restarts.
  assert spikes[-8:] == list(range(90, 98)) and not expected[98:].count("spike")
  assert int(osf.skipped_spikes(state)) == len(spikes)
  assert int(osf.skipped_steps(state)) == len(spikes) + 1


def test_a_skipped_spike_leaves_the_run_as_if_the_step_never_came():
  scales = _scales(40, seed=4, spikes=[(25, 50.0)])
  grads = _grads(scales)
  without = grads[:25] + grads[26:]
  tx = SUBJECTS["safefactor"](skip_spikes=6.0, spike_window=16)
  state, skipped, _ = _run(tx, grads)
  plain_state, plain_skipped, _ = _run(tx, without)
  assert [s for s, v in enumerate(skipped) if v] == [25] and not any(plain_skipped)
  assert_trees_bitwise_equal(state.inner_state, plain_state.inner_state)
  assert int(state.inner_state.count) == 39


def test_the_skipped_step_returns_zero_updates_and_the_report_names_it():
  scales = _scales(12, seed=5, spikes=[(11, 50.0)])
  grads = _grads(scales)
  grads[11] = {**grads[11], "w": grads[11]["w"] * 3}  # the largest gradient is w's
  tx = SUBJECTS["safefactor"](skip_spikes=6.0, spike_window=16)
  state, skipped, updates = _run(tx, grads)
  assert skipped[-1] and all(is_all_zero(u) for u in jax.tree.leaves(updates))
  report = osf.nonfinite_report(state)
  assert report["skipped_spikes"] == 1 and report["skipped_steps"] == 1
  assert report["consecutive_spikes"] == 1 and report["consecutive_skips"] == 0
  assert report["last_spike_step"] == 11
  np.testing.assert_allclose(report["last_spike_gradient_norm"], _norm(grads[11]), rtol=1e-5)
  history = [_norm(g) for g in grads[:11]]
  limit = np.mean(history) + 6 * max(np.std(history, ddof=1), 0.02 * np.mean(history))
  np.testing.assert_allclose(report["last_spike_limit"], limit, rtol=1e-5)
  np.testing.assert_allclose(report["last_spike_largest_gradient/params['w']"],
                             np.linalg.norm(np.asarray(grads[11]["w"], np.float64)), rtol=1e-5)
  summary = osf.nonfinite_summary(state)
  assert summary.startswith("skipped 1 of 12 steps; 1 spike (last at step 11: gradient norm ")
  assert summary.endswith(f"> limit {limit:.4g}, largest in params['w'])")


@pytest.mark.parametrize("subject", sorted(SUBJECTS))
def test_a_fresh_spike_history_says_no_spike_yet(subject):
  # Guards against a starting value that reads as a spike seen: before any spike the state's
  # own fields (what a log or a checkpoint shows) say none, as SpikeHistory documents.
  history = SUBJECTS[subject](skip_spikes=6.0, spike_window=16).init(_params()).spikes
  assert {name: int(getattr(history, name)) for name in (
      "length", "position", "consecutive_spikes", "skipped_spikes", "last_spike_step",
      "last_spike_statistic", "last_spike_leaf")} == {
          "length": 0, "position": 0, "consecutive_spikes": 0, "skipped_spikes": 0,
          "last_spike_step": -1, "last_spike_statistic": -1, "last_spike_leaf": -1}
  # The float fields are 0 and the losses the lowest float32, not NaN: a state holding NaN
  # stops a run with jax_debug_nans on (tests/test_debug_flags.py).
  for name in ("last_spike_value", "last_spike_limit", "last_spike_leaf_norm"):
    assert float(getattr(history, name)) == 0.0, name
  assert history.gradient_norms.shape == history.losses.shape == (16,)
  assert is_all_zero(history.gradient_norms)
  assert bool(jnp.all(history.losses == np.finfo(np.float32).min))


def test_no_decision_before_half_a_window():
  window = 16
  for spike_at, skipped_expected in ((window // 2 - 1, False), (window // 2, True)):
    scales = _scales(window, seed=6, spikes=[(spike_at, 100.0)])
    _, skipped, _ = _run(SUBJECTS["safefactor"](skip_spikes=6.0, spike_window=window),
                         _grads(scales)[:spike_at + 1])
    assert skipped[-1] == skipped_expected


def test_a_constant_history_does_not_make_every_small_rise_a_spike():
  # The same gradient for 20 steps: the sample std is 0, so the floor (2% of the mean) sets
  # the limit at 1.12 times the mean for k = 6. A 10% rise is taken, a 15% rise skipped.
  base = _grads([1.0])[0]
  for factor, skipped_expected in ((1.10, False), (1.15, True)):
    grads = [base] * 20 + [jax.tree.map(lambda g, f=factor: g * f, base)]
    _, skipped, _ = _run(SUBJECTS["skip_nonfinite"](skip_spikes=6.0, spike_window=16), grads)
    assert skipped == [False] * 20 + [skipped_expected]


def test_no_false_positive_over_a_long_noisy_run():
  # The gradient's scale varies by up to 10% from step to step, for 1,500 steps, with a fresh
  # direction each step: at 6 standard deviations nothing is a spike. Run as one lax.scan.
  steps = 1500
  params = _params()
  tx = SUBJECTS["safefactor"](skip_spikes=6.0)
  rng = np.random.default_rng(7)
  scales = jnp.asarray(1 + 0.1 * rng.uniform(-1, 1, steps), jnp.float32)
  keys = jax.random.split(jax.random.key(0), steps)

  def body(carry, inputs):
    state, params = carry
    key, scale = inputs
    grads = {k: scale * jax.random.normal(jax.random.fold_in(key, i), s)
             for i, (k, s) in enumerate(sorted(SHAPES.items()))}
    updates, state = tx.update(grads, state, params)
    return (state, optax.apply_updates(params, updates)), None

  (state, _), _ = jax.jit(lambda s, p: jax.lax.scan(body, (s, p), (keys, scales)))(
      tx.init(params), params)
  assert int(osf.skipped_spikes(state)) == 0 and int(state.step) == steps
  assert int(state.spikes.length) == 128


def test_a_lasting_change_of_scale_costs_half_a_window_then_trains():
  window = 32
  scales = _scales(200, seed=8, jump_at=100)
  tx = SUBJECTS["safefactor"](skip_spikes=6.0, spike_window=window)
  state, skipped, _ = _run(tx, _grads(scales))
  assert [s for s, v in enumerate(skipped) if v] == list(range(100, 100 + window // 2))
  assert int(state.inner_state.count) == 200 - window // 2
  # The history restarted at the tripled scale: it holds only steps of that scale.
  norms = np.asarray(state.spikes.gradient_norms)
  before = [_norm(g) for g in _grads(scales)[:100]]
  assert int(state.spikes.length) == window and norms.min() > 2 * np.mean(before)


def test_a_loss_spike_is_skipped_with_value():
  steps = 30
  scales = _scales(steps, seed=9)
  rng = np.random.default_rng(10)
  losses = 2.0 + 0.01 * rng.normal(size=steps)
  losses[20] = 3.0
  values = [jnp.float32(v) for v in losses]
  tx = SUBJECTS["safefactor"](skip_spikes=6.0, spike_window=16)
  state, skipped, _ = _run(tx, _grads(scales), values=values)
  expected = reference_skips([_norm(g) for g in _grads(scales)], losses.astype(np.float32),
                             threshold=6.0, window=16)
  assert [s for s, v in enumerate(skipped) if v] == [20] == [
      s for s, v in enumerate(expected) if v == "spike"]
  report = osf.nonfinite_report(state)
  np.testing.assert_allclose(report["last_spike_loss"], 3.0)
  # Without value= the same gradients are never skipped.
  _, skipped, _ = _run(tx, _grads(scales))
  assert not any(skipped)


@pytest.mark.parametrize("subject", sorted(SUBJECTS))
def test_a_loss_spike_of_a_tree_without_leaves_names_no_leaf(subject):
  # The gradient norm of no leaves is 0, and the loss alone spikes: the state's leaf field
  # keeps its "none", -1, as SpikeHistory documents, and the report names no parameter.
  tx = SUBJECTS[subject](skip_spikes=6.0, spike_window=4)
  state, update = tx.init({}), jax.jit(tx.update)
  for loss in (1.0, 1.01, 0.99, 1.0, 5.0):
    _, state = update({}, state, {}, value=jnp.float32(loss))
  assert int(state.spikes.skipped_spikes) == 1 and int(state.spikes.last_spike_leaf) == -1
  report = osf.nonfinite_report(state)
  assert report["last_spike_loss"] == 5.0
  assert not any(key.startswith("last_spike_largest_gradient") for key in report)


def test_nonfinite_steps_and_spikes_are_counted_apart():
  scales = _scales(23, seed=11, spikes=[(20, 50.0), (22, 50.0)])
  grads = _grads(scales)
  grads[21] = {**grads[21], "w": grads[21]["w"].at[0, 0].set(jnp.inf)}
  # max_consecutive_skips=2: three skips in a row, but only one of them non-finite.
  tx = SUBJECTS["safefactor"](skip_spikes=6.0, spike_window=16, max_consecutive_skips=2)
  state, skipped, _ = _run(tx, grads)
  assert [s for s, v in enumerate(skipped) if v] == [20, 21, 22]
  report = osf.nonfinite_report(state)
  assert (report["skipped_steps"], report["skipped_spikes"]) == (3, 2)
  assert report["consecutive_skips"] == 1 and report["nonfinite_steps/params['w']"] == 1
  assert report["consecutive_spikes"] == 2
  assert osf.nonfinite_summary(state).startswith(
      "skipped 3 of 23 steps; 1 non-finite (1 in a row): params['w'] x1 (last at step 21); "
      "2 spikes (last at step 22: gradient norm")


def test_spike_skipping_off_changes_nothing():
  grads = _grads(_scales(20, seed=12, spikes=[(15, 50.0)]))
  state_off, skipped, _ = _run(SUBJECTS["safefactor"](), grads)
  assert skipped[15] is False and state_off.spikes is None
  assert int(osf.skipped_spikes(state_off)) == 0
  assert "skipped_spikes" not in osf.nonfinite_report(state_off)
  state_on, _, _ = _run(SUBJECTS["safefactor"](skip_spikes=1e9), grads)
  if jax.__version_info__ >= (0, 10, 2):
    assert_trees_bitwise_equal(state_on.inner_state, state_off.inner_state)
  else:
    # The XLA of the floors fuses the two programs (the rule reads the row means) apart
    # and rounds a few of the 20 steps' momenta differently in their last bit.
    assert_trees_close(state_on.inner_state, state_off.inner_state, rtol=1e-5)


def test_the_gradient_norm_is_read_off_the_statistics():
  # safefactor's norm comes from its row means; it must equal the gradient's norm.
  grads = _grads(_scales(3, seed=13))
  state, _, _ = _run(SUBJECTS["safefactor"](skip_spikes=6.0), grads)
  np.testing.assert_allclose(np.asarray(state.spikes.gradient_norms[:3]),
                             [_norm(g) for g in grads], rtol=2e-6)


def test_a_jitted_step_may_donate_the_state():
  # The fresh history's counters were one shared array: donating the state failed with
  # "Attempt to donate the same buffer twice".
  tx = SUBJECTS["safefactor"](skip_spikes=6.0, spike_window=16)
  params = _params()
  update = jax.jit(tx.update, donate_argnums=1)
  state = tx.init(params)
  for g in _grads(_scales(3, seed=19)):
    _, state = update(g, state, params)
  assert int(state.step) == 3 and int(state.spikes.length) == 3


def test_checkpointed_history_resumes_bit_identically():
  grads = _grads(_scales(40, seed=14, spikes=[(30, 50.0)]))
  tx = SUBJECTS["safefactor"](skip_spikes=6.0, spike_window=16)
  full, _, _ = _run(tx, grads)
  params = _params()
  state = tx.init(params)
  for g in grads[:25]:
    _, state = jax.jit(tx.update)(g, state, params)
  restored = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), state)  # a host round trip
  for g in grads[25:]:
    _, restored = jax.jit(tx.update)(g, restored, params)
  assert_trees_bitwise_equal(restored, full)
  assert int(full.spikes.skipped_spikes) == 1


# Wrappers: the spike is judged on what the transformation receives.
WRAPPED = {
    "chain": lambda: optax.chain(optax.clip_by_global_norm(1e6),
                                 SUBJECTS["safefactor"](skip_spikes=6.0, spike_window=16)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(
        _safefactor_to_inject, static_args=("spike_window",))(skip_spikes=6.0,
                                                               spike_window=16),
    "masked": lambda: optax.masked(SUBJECTS["safefactor"](skip_spikes=6.0, spike_window=16),
                                   {"w": True, "b": False}),
    "multi_steps": lambda: optax.MultiSteps(
        SUBJECTS["safefactor"](skip_spikes=6.0, spike_window=16), every_k_schedule=2),
    "accumulate_gradients": lambda: osf.accumulate_gradients(
        SUBJECTS["safefactor"](skip_spikes=6.0, spike_window=16), every_k=2),
    "skip_nonfinite_chain": lambda: osf.skip_nonfinite(
        optax.chain(optax.trace(0.9), optax.scale(-1e-2)), skip_spikes=6.0,
        spike_window=16),
}


@pytest.mark.parametrize("wrapper", sorted(WRAPPED))
def test_spikes_are_skipped_inside_every_wrapper(wrapper):
  every_k = 2 if wrapper in ("multi_steps", "accumulate_gradients") else 1
  scales = np.repeat(_scales(30, seed=15, spikes=[(24, 50.0)]), every_k)
  # optax's MultiSteps mixes int and float counts: it needs standard promotion.
  promotion = "standard" if wrapper == "multi_steps" else "strict"
  with jax.numpy_dtype_promotion(promotion):
    state, _, _ = _run(WRAPPED[wrapper](), _grads(scales))
  assert int(osf.skipped_spikes(state)) == 1
  assert int(osf.skipped_steps(state)) == 1


def test_the_threshold_is_injectable_without_a_recompile():
  tx = optax.inject_hyperparams(_safefactor_to_inject, static_args=("spike_window",))(
      skip_spikes=6.0, spike_window=16)
  params = _params()
  grads = _grads(_scales(24, seed=16, spikes=[(20, 50.0), (22, 50.0)]))
  state = tx.init(params)
  traces = []

  @jax.jit
  def update(grads, state):
    traces.append(None)
    return tx.update(grads, state, params)

  for step, g in enumerate(grads):
    if step == 21:  # a threshold no spike reaches: the spike at 22 is taken
      state.hyperparams["skip_spikes"] = jnp.asarray(1e6, jnp.float32)
    _, state = update(g, state)
  assert len(traces) == 1 and int(osf.skipped_spikes(state)) == 1


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(skip_spikes=0.0), ValueError, "skip_spikes must be a positive number"),
    (dict(skip_spikes=float("nan")), ValueError, "skip_spikes must be a positive number"),
    (dict(skip_spikes=-6.0), ValueError, "skip_spikes must be a positive number"),
    (dict(skip_spikes="6"), TypeError, "skip_spikes must be a number"),
    # One message for every window refused: 0 was told "a positive int", and then 1 refused.
    *[(dict(skip_spikes=6.0, spike_window=window), ValueError,
       rf"^spike_window must be an int of at least 2, got {re.escape(repr(window))} \(the steps")
      for window in (0, 1, -3, 12.5, True)],
    (dict(skip_spikes=6.0, skip_nonfinite_steps=False), ValueError,
     "skip_spikes .* needs skip_nonfinite_steps=True"),
])
def test_bad_settings_are_refused_by_name(kwargs, error, match):
  with pytest.raises(error, match=match):
    osf.safefactor(0.1, **kwargs)


@pytest.mark.parametrize("threshold", [1e-3, 0.5, 1.0, 3])
def test_any_positive_number_of_standard_deviations_is_taken(threshold):
  # Below one standard deviation too: a strict rule, not a mistake.
  for tx in (osf.safefactor(0.1, skip_spikes=threshold),
             osf.skip_nonfinite(optax.sgd(0.1), skip_spikes=threshold)):
    params = {"w": jnp.ones((3, 2))}
    _, state = tx.update({"w": jnp.ones((3, 2))}, tx.init(params), params)
    assert int(osf.skipped_steps(state)) == 0


def test_a_state_without_history_and_a_loss_that_is_not_a_scalar_are_refused():
  params = _params()
  grads = _grads([1.0])[0]
  with_spikes = osf.safefactor(0.1, skip_spikes=6.0)
  without = osf.safefactor(0.1)
  with pytest.raises(ValueError, match=r"has no spike history.*skip_spikes=6.0"):
    with_spikes.update(grads, without.init(params), params)
  with pytest.raises(ValueError, match=r"has a spike history.*skip_spikes=None"):
    without.update(grads, with_spikes.init(params), params)
  with pytest.raises(ValueError, match=r"holds 128 steps.*spike_window=16"):
    osf.safefactor(0.1, skip_spikes=6.0, spike_window=16).update(
        grads, with_spikes.init(params), params)
  with pytest.raises(ValueError, match=r"value= must be the step's scalar loss.*\(4,\)"):
    with_spikes.update(grads, with_spikes.init(params), params, value=jnp.ones(4))
  # A string loss failed inside JAX's dtype code; a bool was a loss of 0 or 1.
  for value in ("1.0", True, jnp.array(True), 1 + 2j):
    with pytest.raises(TypeError, match=r"value= must be the step's loss, a real number, got"):
      with_spikes.update(grads, with_spikes.init(params), params, value=value)
  cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x,
                      with_spikes.init(params))
  cast = cast._replace(inner_state=with_spikes.init(params).inner_state)
  with pytest.raises(TypeError, match=r"SpikeHistory.gradient_norms: .* float32, got bfloat16"):
    with_spikes.update(grads, cast, params)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_a_sharded_run_skips_the_same_steps_as_one_device(axis_type):
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type, axis_type))
  specs = {"w": P("model", None), "b": P("model")}
  shapes = {"w": (16, 8), "b": (8,)}
  rng = np.random.default_rng(17)
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
  scales = _scales(24, seed=18, spikes=[(14, 50.0), (20, 5.0)])
  grads = [{k: jnp.asarray(rng.normal(size=s) * scale, jnp.float32) for k, s in shapes.items()}
           for scale in scales]
  tx = osf.safefactor(1e-2, momentum=0.9, min_dim_size_to_factor=4, skip_spikes=6.0,
                      spike_window=8)
  one_device, skipped_one, _ = _run(tx, grads, params)
  with jax.set_mesh(mesh):
    def place(tree):
      return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}

    sharded, skipped_mesh, _ = _run(tx, [place(g) for g in grads], place(params))
  assert skipped_mesh == skipped_one and sum(skipped_one) == 2
  assert int(osf.skipped_spikes(sharded)) == 2
  np.testing.assert_allclose(np.asarray(sharded.spikes.gradient_norms),
                             np.asarray(one_device.spikes.gradient_norms), rtol=1e-6)


@pytest.mark.parametrize("subject", sorted(SUBJECTS))
@pytest.mark.parametrize("keyword", ["loss", "train_loss"])
def test_a_loss_under_another_keyword_warns_naming_value(subject, keyword):
  # 0.2 accepted update(..., loss=loss) silently: the user believed loss spikes were judged.
  params = {"w": jnp.ones((4, 3))}
  tx = SUBJECTS[subject](skip_spikes=6.0)
  with pytest.warns(UserWarning, match=rf"got {keyword}= but no value=: .*judges the loss "
                                       r"given as value= only"):
    tx.update(params, tx.init(params), params, **{keyword: jnp.float32(1.0)})


@pytest.mark.parametrize("subject", sorted(SUBJECTS))
def test_value_is_silent_with_spikes_on_or_off(subject):
  # optax.chain hands value= to every member and reduce_on_plateau needs it: it stays legal.
  params = {"w": jnp.ones((4, 3))}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for skip_spikes in (None, 6.0):
      tx = SUBJECTS[subject](skip_spikes=skip_spikes)
      tx.update(params, tx.init(params), params, value=jnp.float32(1.0), loss=1.0)
    tx = SUBJECTS[subject](skip_spikes=None)
    tx.update(params, tx.init(params), params, loss=jnp.float32(1.0))
    chain = optax.chain(SUBJECTS[subject](skip_spikes=6.0),
                        optax.contrib.reduce_on_plateau(patience=2))
    with jax.numpy_dtype_promotion("standard"):  # reduce_on_plateau mixes int32 and float32
      chain.update(params, chain.init(params), params, value=jnp.float32(1.0))


def _reference_run(tx, grads, values=None, window=4):
  """Per step, whether ``tx`` skipped it, and the restatement's verdicts."""
  params = jax.tree.map(jnp.zeros_like, grads[0])
  state = tx.init(params)
  rule = ReferenceSpikeRule(6.0, window, [f"params['{k}']" for k in sorted(params)])
  skipped, verdicts = [], []
  for step, g in enumerate(grads):
    extra = {} if values is None else {"value": values[step]}
    updates, state = tx.update(g, state, params, **extra)
    skipped.append(all(is_all_zero(u) for u in jax.tree.leaves(updates)))
    loss = None if values is None else float(np.ravel(values[step])[0])
    verdicts.append(rule.step({f"params['{k}']": np.asarray(v) for k, v in g.items()}, loss))
  return state, skipped, verdicts


def test_the_smallest_window_judges_from_two_steps():
  # spike_window=2, the least allowed: the limit needs two steps of history.
  grads = [{"w": jnp.full(4, scale)} for scale in (1.0, 1.0, 50.0, 1.0)]
  state, skipped, verdicts = _reference_run(osf.safefactor(0.1, skip_spikes=6.0, spike_window=2),
                                            grads, window=2)
  assert skipped == [False, False, True, False]
  assert verdicts == ["applied", "applied", "spike", "applied"]
  assert int(osf.skipped_spikes(state)) == 1


def test_a_loss_of_shape_1_is_judged_as_the_scalar():
  grads = [{"w": jnp.full(4, 1.0)}] * 5
  values = [jnp.full([1], loss, jnp.float32) for loss in (2.0, 2.0, 2.0, 2.0, 20.0)]
  state, skipped, verdicts = _reference_run(
      osf.safefactor(0.1, skip_spikes=6.0, spike_window=4), grads, values)
  assert skipped == [False] * 4 + [True] and verdicts[-1] == "spike"
  assert osf.nonfinite_report(state)["last_spike_loss"] == 20.0


def test_a_complex_gradient_norm_counts_both_parts():
  grads = [{"z": jnp.asarray([1 + 2j, 3 - 1j, 0.5j], jnp.complex64) * scale}
           for scale in (1.0, 1.1, 0.9, 1.0, 1.3)]
  state, skipped, verdicts = _reference_run(
      osf.safefactor(0.1, skip_spikes=6.0, spike_window=8), grads, window=8)
  np.testing.assert_allclose(np.asarray(state.spikes.gradient_norms)[:5],
                             [np.linalg.norm(np.asarray(g["z"])) for g in grads], rtol=1e-6)
  assert skipped == [v == "spike" for v in verdicts]


@pytest.mark.parametrize("subject", sorted(SUBJECTS))
def test_an_empty_tree_steps_with_spikes_on(subject):
  tx = SUBJECTS[subject](skip_spikes=6.0, spike_window=4)
  state = tx.init({})
  for _ in range(3):
    _, state = tx.update({}, state, {})
  assert int(state.step) == 3 and int(osf.skipped_spikes(state)) == 0
  assert int(state.spikes.length) == 3
