"""The reports checked by value: every step number, leaf path and count, after known poison.

A report that says "non-finite" and names some leaf passes a test that greps for the leaf;
these tests compare whole messages, whole dicts and whole summary lines, over runs where
each leaf goes bad at a different step, so that an off-by-one step, a leaf named that was
bad earlier but not at the step reported, or a guard's counts under another guard's name
each change the text.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from tests.helpers import run_steps

SHAPES = {"a": (3,), "b": (2, 2), "c": (4,)}
HELD = "Params and optimizer state hold the last finite step."


def _params():
  return {name: jnp.ones(shape) for name, shape in SHAPES.items()}


def _grads(bad=(), value=jnp.nan, good=1.0):
  """Gradients of ``good`` with the leaves named in ``bad`` set to ``value``."""
  return {name: jnp.full(shape, value if name in bad else good)
          for name, shape in SHAPES.items()}


# a alone is bad at step 1, b and c at step 2: the error raised at step 2 names b and c only.
STREAK = [_grads(), _grads({"a"}), _grads({"b", "c"}, jnp.inf)]
STREAK_ERROR = ("2 consecutive optimizer steps were non-finite and skipped (max_consecutive=2); "
                f"at step 2 the non-finite leaves were: params['b'], params['c']. {HELD}")

STOPPING = {
    "safefactor": lambda: osf.safefactor(0.1, max_consecutive_skips=2),
    "skip_nonfinite": lambda: osf.skip_nonfinite(optax.sgd(0.1), max_consecutive=2),
}


@pytest.mark.parametrize("name", sorted(STOPPING))
def test_max_consecutive_error_names_the_last_step_and_its_leaves_eagerly(name):
  # Guards against an error that reports the step after the last skip (the counter
  # already incremented), or every leaf of the streak, or every leaf of the tree.
  tx = STOPPING[name]()
  params = _params()
  state = tx.init(params)
  for grads in STREAK[:-1]:
    _, state = tx.update(grads, state, params)
  with pytest.raises(osf.NonFiniteStepsError) as caught:
    tx.update(STREAK[-1], state, params)
  assert str(caught.value) == STREAK_ERROR


@pytest.mark.parametrize("name", sorted(STOPPING))
def test_max_consecutive_error_names_the_last_step_and_its_leaves_under_jit(name):
  # Under jit the error is raised on the host by a callback and JAX wraps it: the
  # message it carries must be the same, word for word, as the eager one.
  tx = STOPPING[name]()
  params = _params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  for grads in STREAK[:-1]:
    _, state = update(grads, state, params)
  jax.block_until_ready(state)
  with pytest.raises(jax.errors.JaxRuntimeError) as caught:
    _, state = update(STREAK[-1], state, params)
    jax.block_until_ready(state)
  assert f"NonFiniteStepsError: {STREAK_ERROR}" in str(caught.value), str(caught.value)


def test_check_nonfinite_steps_names_the_leaves_of_the_last_step_only():
  # Guards against naming every leaf that was ever non-finite: a was bad at step 0 and
  # b at step 1; at step 1, the last skip, only b was.
  tx = osf.safefactor(0.1)
  params = _params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  for grads in (_grads({"a"}), _grads({"b"}, jnp.inf)):
    _, state = update(grads, state, params)
  osf.check_nonfinite_steps(state, max_consecutive=3)  # a streak of 2 is under 3
  with pytest.raises(osf.NonFiniteStepsError) as caught:
    osf.check_nonfinite_steps(state, max_consecutive=2)
  assert str(caught.value) == (
      "2 consecutive optimizer steps were non-finite and skipped (max_consecutive=2); at "
      f"step 1 the non-finite leaves were: params['b']. {HELD}")


def test_check_nonfinite_steps_names_the_leaves_of_the_last_micro_batch_only():
  tx = osf.accumulate_gradients(optax.sgd(0.1), every_k=2)
  params = _params()
  state = tx.init(params)
  for grads in (_grads(), _grads({"a", "b"}), _grads({"c"}, jnp.inf)):
    _, state = tx.update(grads, state, params)
  with pytest.raises(osf.NonFiniteStepsError) as caught:
    osf.check_nonfinite_steps(state, max_consecutive=2)
  assert str(caught.value) == (
      "2 consecutive micro-batches were non-finite and skipped (max_consecutive=2); at "
      "micro-batch 2 the non-finite leaves were: params['c']. The accumulator holds the "
      "finite micro-batches only.")


# --- three guards in one state, each skipping at known calls ---------------------------------
#
# accumulate_gradients(every_k=2) around an outer skip_nonfinite, around a chain of an inner
# skip_nonfinite(scale(1e20)) and scale(1e20). With gradients of 1e-3 nothing overflows; a
# mean of 1 overflows the outer guard only (1e40), a mean of 1e19 the inner one (1e39, and
# the inner guard's zeros are finite for the outer one); a NaN or Inf micro-batch is left
# out by the accumulation before either guard sees it.

SMALL, OUTER_OVERFLOW, INNER_OVERFLOW = 1e-3, 1.0, 1e19
LEAVES = {"a": (3,), "b": (2, 2)}


def _filled(values):
  return {name: jnp.full(shape, values.get(name, SMALL)) for name, shape in LEAVES.items()}


MICRO_BATCHES = [
    _filled({}),                                  # 0
    _filled({"a": jnp.nan}),                      # 1: left out (a)
    _filled({}),                                  # 2: completes step 0, applied by both guards
    _filled({"a": OUTER_OVERFLOW}),               # 3
    _filled({"a": OUTER_OVERFLOW}),               # 4: completes step 1, outer guard skips (a)
    _filled({"b": jnp.inf}),                      # 5: left out (b)
    _filled({"b": INNER_OVERFLOW}),               # 6
    _filled({"b": INNER_OVERFLOW}),               # 7: completes step 2, inner guard skips (b)
]


@functools.cache
def _three_guards_state():
  inner = osf.skip_nonfinite(optax.scale(1e20))
  tx = osf.accumulate_gradients(osf.skip_nonfinite(optax.chain(inner, optax.scale(1e20))), 2)
  params = {name: jnp.ones(shape) for name, shape in LEAVES.items()}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for grads in MICRO_BATCHES:
    _, state = update(grads, state, params)
  return state


def test_report_of_three_guards_by_value():
  # Guards against counts charged to the wrong guard, leaf or step. The inner guard's
  # counters are part of the outer guard's state, so the step the outer guard skipped
  # (step 1) left them as they were: the inner guard saw 2 steps, not 3.
  report = osf.nonfinite_report(_three_guards_state())
  # Keys for the leaves that were non-finite only: none with a 0 count or a -1 step.
  assert report == {
      "skipped_steps": 1, "consecutive_skips": 0, "steps": 3,
      "nonfinite_steps/params['a']": 1, "last_nonfinite_step/params['a']": 1,
      "guard1/skipped_steps": 1, "guard1/consecutive_skips": 1, "guard1/steps": 2,
      "guard1/nonfinite_steps/params['b']": 1, "guard1/last_nonfinite_step/params['b']": 1,
      "skipped_micro_batches": 2, "consecutive_skipped_micro_batches": 0,
      "micro_batches": 8,
      "nonfinite_micro_batches/params['a']": 1, "nonfinite_micro_batches/params['b']": 1,
      "last_nonfinite_micro_batch/params['a']": 1,
      "last_nonfinite_micro_batch/params['b']": 5,
      "total_skipped_steps": 4,
  }
  assert int(osf.skipped_steps(_three_guards_state())) == 4


def test_summary_of_three_guards_by_value():
  assert osf.nonfinite_summary(_three_guards_state()) == (
      "4 skipped in total; "
      "guard0 (opt_state.inner_state): skipped 1 of 3 steps (0 in a row); non-finite: "
      "params['a'] x1 (last at step 1); "
      "guard1 (opt_state.inner_state.inner_state[0]): skipped 1 of 2 steps (1 in a row); "
      "non-finite: params['b'] x1 (last at step 1); "
      # The latest first, of leaves as often non-finite.
      "accumulation (opt_state.micro_batches): skipped 2 of 8 micro-batches (0 in a row); "
      "non-finite: params['b'] x1 (last at micro-batch 5), params['a'] x1 (last at "
      "micro-batch 1)")


def test_check_of_three_guards_raises_for_the_guard_in_a_row():
  # Only the inner guard's last call was skipped: the error is its own, at its own step.
  state = _three_guards_state()
  with pytest.raises(osf.NonFiniteStepsError) as caught:
    osf.check_nonfinite_steps(state, max_consecutive=1)
  assert str(caught.value) == (
      "1 optimizer step was non-finite and skipped (max_consecutive=1); at step 1 the "
      f"non-finite leaves were: params['b']. {HELD}")
  osf.check_nonfinite_steps(state, max_consecutive=2)


def _poisoned_run(params, poisoned_leaves_at):
  """safefactor over ``params``; at step s the leaves ``poisoned_leaves_at[s]`` are NaN."""
  tx = osf.safefactor(0.1)

  def grads(step):
    return {name: jnp.full(p.shape, jnp.nan if name in poisoned_leaves_at[step] else 0.1)
            for name, p in params.items()}

  return run_steps(tx, params, grads, len(poisoned_leaves_at))[1]


def test_a_nan_loss_over_many_leaves_is_one_short_phrase():
  # One NaN loss makes every leaf non-finite: 0.2 listed all 40 here (1,944 characters).
  params = {f"layer_{i:02d}_{part}": jnp.ones(shape) for i in range(20)
            for part, shape in (("kernel", (4, 4)), ("bias", (4,)))}
  state = _poisoned_run(params, [set(), set(params), set()])
  assert osf.nonfinite_summary(state) == (
      "skipped 1 of 3 steps (0 in a row); non-finite: all 40 leaves x1 (last at step 1)")


def test_the_summary_names_the_worst_leaves_then_how_many_more():
  names = [f"leaf_{j}" for j in range(10)]
  params = {name: jnp.ones((3,)) for name in names}
  # At step s the leaves from s on: leaf j is non-finite min(j, 5) + 1 times, last at step
  # min(j, 5). Worst: the most often, then the latest, then in the tree's order.
  state = _poisoned_run(params, [set(names[s:]) for s in range(6)] + [set()])
  assert osf.nonfinite_summary(state) == (
      "skipped 6 of 7 steps (0 in a row); non-finite: params['leaf_5'] x6 (last at step 5), "
      "params['leaf_6'] x6 (last at step 5), params['leaf_7'] x6 (last at step 5) and 7 more "
      "leaves")
  report = osf.nonfinite_report(state)
  assert report["nonfinite_steps/params['leaf_0']"] == 1
  assert report["nonfinite_steps/params['leaf_9']"] == 6


def test_the_summary_stays_short_with_long_paths_and_several_guards():
  # 120 leaves with 70-character names, each non-finite a different number of times,
  # under a guard inside accumulate_gradients: the line stays within about 600 characters.
  names = [f"transformer/encoder/block_{j:03d}/attention/query/kernel_with_a_long_name"
           for j in range(120)]
  params = {name: jnp.ones((2,)) for name in names}
  tx = osf.accumulate_gradients(osf.safefactor(0.1), 2)

  def grads(call):
    return {name: jnp.full((2,), jnp.nan if j % (call + 2) == 0 else 0.1)
            for j, name in enumerate(names)}

  state = run_steps(tx, params, grads, 6)[1]
  summary = osf.nonfinite_summary(state)
  # Two guards share the path budget: one 70-character path fits in half of it.
  assert summary == (
      "6 skipped in total; guard0 (opt_state.inner_state): no steps yet; accumulation "
      "(opt_state.micro_batches): skipped 6 of 6 micro-batches "
      "(6 in a row); non-finite: params['transformer/encoder/block_000/attention/query/"
      "kernel_with_a_long_name'] x6 (last at micro-batch 5) and 92 more leaves")
  assert len(summary) < 600, (len(summary), summary)
  report = osf.nonfinite_report(state)
  assert all(value >= 0 for value in report.values())  # no -1 placeholder


def test_the_most_often_non_finite_leaf_comes_first_then_one_more_leaf():
  # "often" outranks "late": a leaf non-finite in 3 steps comes before one non-finite
  # in the last step only; ties keep the tree's (sorted) order; a single leaf left over
  # is "1 more leaf".
  names = ["often", "late", "third", "fourth"]
  params = {name: jnp.ones((2,)) for name in names}
  poisoned = [{"often", "third", "fourth"}, {"often"}, {"often"}, set(), {"late"}]
  state = _poisoned_run(params, poisoned)
  assert osf.nonfinite_summary(state) == (
      "skipped 4 of 5 steps (1 in a row); non-finite: params['often'] x3 (last at step 2), "
      "params['late'] x1 (last at step 4), params['fourth'] x1 (last at step 0) and 1 more leaf")


def test_a_state_already_past_the_bound_is_reported():
  # check_nonfinite_steps between steps: a run resumed with a smaller bound than it ran
  # with is already past it, and must stop as surely as one that just reached it.
  params = {"w": jnp.ones((3,))}
  state = _poisoned_run(params, [{"w"}] * 4)
  assert int(state.consecutive_skips) == 4
  with pytest.raises(osf.NonFiniteStepsError, match="4 consecutive optimizer steps"):
    osf.check_nonfinite_steps(state, max_consecutive=2)


# A non-finite hyperparameter -------------------------------------------------------------

SOURCES = "a schedule's value or an injected one, non-finite or out of its range"


def _nan_from(step, value=0.1):
  """A schedule that is ``value`` before ``step`` and NaN from it on."""
  return lambda count: jnp.where(count >= step, jnp.nan, value)


@pytest.mark.parametrize("name,tx", [
    ("learning_rate", osf.safefactor(_nan_from(1))),
    ("weight_decay_rate", osf.safefactor(0.1, weight_decay_rate=_nan_from(1, 1e-3))),
    ("decay_rate", osf.scale_by_safe_factored_rms(
        decay_rate_fn=lambda step, rate: jnp.where(step >= 1, jnp.nan, 0.5),
        skip_nonfinite_steps=True)),
])
def test_a_nonfinite_hyperparameter_is_named_not_every_leaf(name, tx):
  # 0.2 said "non-finite: all 3 leaves x3 (last at step 3)": nothing named the schedule.
  _, state, _ = run_steps(tx, _params(), lambda step: _grads(), 4)
  # A NaN beta2 also makes every leaf's statistics NaN: those leaves are named after it.
  leaves = "; all 3 leaves x3 (last at step 3)" if name == "decay_rate" else ""
  assert osf.nonfinite_summary(state) == (
      f"skipped 3 of 4 steps (3 in a row); non-finite: hyperparameter {name} x3 (last at "
      f"step 3), {SOURCES}{leaves}")
  report = osf.nonfinite_report(state)
  assert {key: value for key, value in report.items() if "/params[" not in key} == {
      "skipped_steps": 3, "consecutive_skips": 3, "steps": 4,
      f"nonfinite_hyperparam_steps/{name}": 3, f"last_nonfinite_hyperparam_step/{name}": 3,
      "total_skipped_steps": 3}
  with pytest.raises(osf.NonFiniteStepsError) as raised:
    osf.check_nonfinite_steps(state, 2)
  named_leaves = ("the leaves: params['a'], params['b'], params['c']" if leaves
                  else "no leaf was")
  assert str(raised.value) == (
      f"3 consecutive optimizer steps were non-finite and skipped (max_consecutive=2); at step "
      f"3 the non-finite hyperparameters were: {name} ({SOURCES}), and {named_leaves}. {HELD}")


def test_max_consecutive_skips_names_the_learning_rate():
  tx = osf.safefactor(_nan_from(1), max_consecutive_skips=2)
  with pytest.raises(osf.NonFiniteStepsError,
                     match=r"at step 2 the non-finite hyperparameters were: learning_rate "
                           r"\(a schedule's value or an injected one, non-finite or out of "
                           r"its range\), and no leaf was"):
    run_steps(tx, _params(), lambda step: _grads(), 4, jit=False)


def test_a_learning_rate_that_overflows_float32_is_named():
  tx = osf.safefactor(1e39)  # finite as a Python float, inf in the float32 step
  with pytest.warns(RuntimeWarning, match="overflow encountered in cast"):  # numpy's, as cast
    _, state, _ = run_steps(tx, _params(), lambda step: _grads(), 2)
  assert osf.nonfinite_report(state)["nonfinite_hyperparam_steps/learning_rate"] == 2


def test_a_bad_hyperparameter_and_a_bad_leaf_are_both_named():
  # The schedule reads the applied steps: from step 1 on, every step is skipped.
  tx = osf.safefactor(_nan_from(1))
  _, state, _ = run_steps(tx, _params(), lambda step: _grads(("b",) if step == 2 else ()), 3)
  assert osf.nonfinite_summary(state) == (
      "skipped 2 of 3 steps (2 in a row); non-finite: hyperparameter learning_rate x2 (last at "
      f"step 2), {SOURCES}; params['b'] x1 (last at step 2)")


def test_an_injected_learning_rate_is_named_by_either_guard():
  params = _params()
  for tx, leaves in ((optax.inject_hyperparams(osf.safefactor)(learning_rate=0.1), ""),
                     (osf.skip_nonfinite(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)),
                      "; all 3 leaves x1 (last at step 0)")):
    state = tx.init(params)
    injected = state if not isinstance(state, osf.SkipNonfiniteState) else state.inner_state
    injected.hyperparams["learning_rate"] = jnp.asarray(jnp.nan)
    _, state = jax.jit(tx.update)(_grads(), state, params)
    assert osf.nonfinite_summary(state) == (
        "skipped 1 of 1 step (1 in a row); non-finite: hyperparameter learning_rate x1 (last "
        f"at step 0), {SOURCES}{leaves}")


@pytest.mark.parametrize("name, value", [
    ("eps", -1.0), ("momentum", 1.5), ("momentum", 1.0), ("clipping_threshold", -1.0),
    ("clipping_threshold", 0.0), ("min_parameter_scale", -1.0), ("max_parameter_scale", 0.0),
    ("decay_rate", -0.8), ("decay_rate", 0.0)])
def test_an_injected_value_out_of_its_range_is_skipped_and_named(name, value):
  # Construction refuses each of these as a number; injected between steps they trained
  # on silently (momentum 1.5 turned the update round, a negative threshold unclipped it).
  params = _params()
  tx = optax.inject_hyperparams(osf.safefactor)(learning_rate=0.1, momentum=0.5,
                                                max_parameter_scale=10.0)
  state = tx.init(params)
  state.hyperparams[name] = jnp.asarray(value, state.hyperparams[name].dtype)
  updates, state = jax.jit(tx.update)(_grads(), state, params)
  assert all(not np.any(update) for update in jax.tree.leaves(updates))
  # The hyperparameter first; leaves it made non-finite (eps=-1's statistics) after it.
  assert osf.nonfinite_summary(state).startswith(
      f"skipped 1 of 1 step (1 in a row); non-finite: hyperparameter {name} x1 (last at step "
      f"0), {SOURCES}")


def test_a_beta2_schedule_outside_0_1_is_skipped_and_named():
  # A weight of 1.5 on the old statistics is no moving average (the new square's weight is
  # -0.5); every value is finite, so only the range names it.
  tx = osf.scale_by_safe_factored_rms(
      decay_rate_fn=lambda step, rate: jnp.where(step >= 1, 1.5, 0.5), skip_nonfinite_steps=True)
  _, state, _ = run_steps(tx, _params(), lambda step: _grads(), 3)
  assert osf.nonfinite_summary(state) == (
      f"skipped 2 of 3 steps (2 in a row); non-finite: hyperparameter decay_rate x2 (last at "
      f"step 2), {SOURCES}")


def test_an_injected_value_within_its_range_trains_as_a_number_does():
  params = _params()
  injected = optax.inject_hyperparams(osf.safefactor)(learning_rate=0.1, momentum=0.5, eps=0.0,
                                                      decay_rate=0.8)
  state = injected.init(params)
  state.hyperparams["momentum"] = jnp.asarray(0.0)
  updates, state = jax.jit(injected.update)(_grads(), state, params)
  plain = osf.safefactor(0.1, momentum=0.0, eps=0.0, decay_rate=0.8)
  expected, _ = jax.jit(plain.update)(_grads(), plain.init(params), params)
  assert int(osf.skipped_steps(state)) == 0
  for got, want in zip(jax.tree.leaves(updates), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(got, want)


def test_checked_mode_names_the_hyperparameter():
  from jax.experimental import checkify

  tx = osf.safefactor(_nan_from(0), checked=True)
  params = _params()
  error, _ = checkify.checkify(tx.update)(_grads(), tx.init(params), params)
  assert "learning_rate: non-finite hyperparameter at step 0" in error.get()


@pytest.mark.parametrize("extra", [0, 1])
def test_leaves_fill_the_path_budget_exactly_and_no_further(extra):
  # Each shown leaf is "params['<name>'] x1 (last at step 0)", 30 characters and its name;
  # two of them fill the 360-character budget with names of 150 and 150, and overrun it
  # by one with 150 and 151 (then the second is counted, not shown).
  first, second = "a" * 150, "b" * (150 + extra)
  params = {first: jnp.ones((2,)), second: jnp.ones((2,)), "clean": jnp.ones((2,))}
  state = _poisoned_run(params, [{first, second}])
  shown = f"params['{first}'] x1 (last at step 0)"
  assert len(shown) + len(f"params['{second}'] x1 (last at step 0)") == 360 + extra
  tail = f", params['{second}'] x1 (last at step 0)" if not extra else " and 1 more leaf"
  assert osf.nonfinite_summary(state) == (
      f"skipped 1 of 1 step (1 in a row); non-finite: {shown}{tail}")


def test_a_batched_state_is_refused_with_how_to_read_one_member():
  # An ensemble's state (init and update under jax.vmap) failed inside the reports with
  # "zip() argument 2 is longer than argument 1".
  tx = osf.skip_nonfinite(optax.sgd(1e-3))
  params = {"w": jnp.ones((3, 4))}
  state = jax.vmap(tx.init)(params)
  _, state = jax.vmap(tx.update)({"w": jnp.ones((3, 4)).at[1].set(jnp.nan)}, state, params)
  assert osf.skipped_steps(state).tolist() == [0, 1, 0]
  message = (r"the reports read one optimizer's state, and this one holds a batch of \(3,\) "
             r"\(made under jax.vmap\): pass one member's, e.g. jax.tree.map\(lambda x: x\[i\], "
             r"opt_state\)")
  for report in (osf.nonfinite_report, osf.nonfinite_summary,
                 functools.partial(osf.check_nonfinite_steps, max_consecutive=1)):
    with pytest.raises(ValueError, match=message):
      report(state)
  member = jax.tree.map(lambda x: x[1], state)
  assert osf.nonfinite_report(member)["skipped_steps"] == 1


def test_a_traced_state_is_refused_with_what_works_inside_jit():
  # Under jax.jit the reports failed with JAX's bare TracerArrayConversionError.
  tx = osf.safefactor(1e-3)
  state = tx.init({"w": jnp.ones((4, 3))})
  for report in (osf.nonfinite_report, osf.nonfinite_summary,
                 functools.partial(osf.check_nonfinite_steps, max_consecutive=1)):
    with pytest.raises(TypeError, match=r"the reports read the counters on the host, and this "
                                        r"state is traced \(inside jax.jit, say\).*"
                                        r"skipped_steps\(opt_state\)"):
      jax.jit(report)(state)
  assert int(jax.jit(osf.skipped_steps)(state)) == 0


def test_an_abstract_state_is_refused_saying_it_holds_shapes():
  # jax.eval_shape's state (the restore target the checkpoints guide builds) failed in
  # int() or with the message for a vmapped state.
  abstract = jax.eval_shape(osf.safefactor(0.1).init, {"w": jnp.ones((4, 3))})
  for report in (osf.skipped_steps, osf.skipped_spikes, osf.nonfinite_summary,
                 osf.nonfinite_report):
    with pytest.raises(TypeError, match=r"this optimizer state is abstract \(jax.eval_shape's"):
      report(abstract)


def test_the_summary_names_each_part_of_a_multi_transform():
  # Two safefactors under optax.multi_transform were "guard0" and "guard1", in the order of
  # the parts' sorted labels, with nothing to say which part each was.
  params = {"blocks": {"kernel": jnp.ones((4, 3))}, "head": jnp.ones((3,))}
  tx = optax.multi_transform({"stack": osf.safefactor(0.1), "head": osf.safefactor(0.1)},
                             {"blocks": "stack", "head": "head"})
  grads = {"blocks": {"kernel": jnp.ones((4, 3))}, "head": jnp.full((3,), jnp.nan)}
  _, state = tx.update(grads, tx.init(params), params)
  assert osf.nonfinite_summary(state) == (
      "1 skipped in total; guard0 (opt_state.inner_states['head'].inner_state): skipped 1 of "
      "1 step (1 in a row); non-finite: params['head'] x1 (last at step 0); "
      "guard1 (opt_state.inner_states['stack'].inner_state): no skipped steps in 1 step")


@pytest.mark.parametrize("report", [
    osf.skipped_steps, osf.skipped_spikes, osf.nonfinite_report, osf.nonfinite_summary,
    lambda state: osf.check_nonfinite_steps(state, 3)])
def test_the_optimizer_given_for_its_state_is_named(report):
  # osf.skipped_steps(tx) asked "was the optimizer built with skip_nonfinite?" of an
  # optimizer that was.
  for tx in (osf.safefactor(0.1), osf.accumulate_gradients(osf.safefactor(0.1), 2)):
    with pytest.raises(TypeError, match=(
        r"^this is an optimizer \(a GradientTransformationExtraArgs\), not its state: pass "
        r"the state it makes and updates, opt_state = optimizer.init\(params\)$")):
      report(tx)
