"""NaN and +Inf in every input of a step, not only the gradient: each is skipped and counted.

What makes a step skipped is in ``optax_safefactor/_src/guard.py``'s docstring: for
safefactor, everything the update is built from; for ``skip_nonfinite``, everything the
wrapped transformation produces; for ``accumulate_gradients``, the sum of the micro-batch
gradients. A guard that looks at the gradient alone passes every gradient test, so the
poison here is put everywhere else: the learning rate and the weight-decay rate, the
params, and each part of the optimizer state.

Two contracts, depending on where the poison is:

- an input of one call (a rate, the params read by that call) is skipped, and the run
  with the poisoned call equals, bit for bit, the run without it;
- a poisoned *state* leaf is read by the step, which is skipped, and a skipped step keeps
  the state exactly as it was (poison included): every later step is skipped and counted
  too, until the run is stopped (``max_consecutive_skips``) or the state restored. A
  schedule that is NaN at one applied step stalls the same way: a skipped step does not
  advance the count the schedule reads.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from tests.helpers import assert_trees_bitwise_equal, is_all_zero

POISONS = {"nan": jnp.nan, "inf": jnp.inf}
SHAPES = {"w": (6, 4), "b": (4,)}
POISONED_STEP = 2
STEPS = 6  # long enough after the poisoned step for momentum and statistics to carry it


def _tree(seed, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return {name: jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)
          for name, shape in SHAPES.items()}


def _poisoned(tree, value):
  """``tree`` with one element of ``w`` set to ``value``."""
  return {**tree, "w": tree["w"].at[1, 2].set(jnp.asarray(value, tree["w"].dtype))}


def _promotion(uses_optax):
  """optax's adam mixes int and float counts: standard promotion for it, strict for ours."""
  return jax.numpy_dtype_promotion("standard" if uses_optax else "strict")


def _nonfinite_counts(state):
  return {name: int(count) for name, count in state.nonfinite_steps.per_leaf().items()}


# --- one call's inputs: skipped, and the run equals the run without that call ---------------

# Each problem builds its transformation from this call's rates, as inject_hyperparams does,
# so that one compiled update can be fed a NaN rate at one call only.
ONE_CALL_PROBLEMS = {
    "parameter_scale": (jnp.float32, lambda lr, wd: osf.safefactor(
        lr, min_dim_size_to_factor=2, momentum=0.9)),
    "weight_decay": (jnp.float32, lambda lr, wd: osf.safefactor(
        lr, min_dim_size_to_factor=2, momentum=0.9, multiply_by_parameter_scale=False,
        weight_decay_rate=wd)),
    # Neither parameter scale nor weight decay reads the params: only the write-back does.
    "stochastic_rounding": (jnp.bfloat16, lambda lr, wd: osf.safefactor(
        lr, min_dim_size_to_factor=2, multiply_by_parameter_scale=False,
        param_rounding="stochastic")),
    "kahan_rounding": (jnp.bfloat16, lambda lr, wd: osf.safefactor(
        lr, min_dim_size_to_factor=2, momentum=0.9, multiply_by_parameter_scale=False,
        param_rounding="kahan")),
    "skip_nonfinite_adamw": (jnp.float32, lambda lr, wd: osf.skip_nonfinite(
        optax.adamw(lr, weight_decay=wd))),
}
LEARNING_RATE, WEIGHT_DECAY_RATE = 0.05, 1e-2


@functools.cache
def _one_call_update(problem):
  make = ONE_CALL_PROBLEMS[problem][1]

  def update(grads, state, params, learning_rate, weight_decay_rate):
    return make(learning_rate, weight_decay_rate).update(grads, state, params)

  return jax.jit(update)


def _run_calls(problem, calls):
  """Run ``calls``: per call, ``(grads, params_poison, lr, wd)``.

  When ``params_poison`` is not ``None``, the params this call reads have one element
  set to it; the updates are applied to the run's own params. Returns (params, state,
  per-call updates).
  """
  dtype, make = ONE_CALL_PROBLEMS[problem]
  params = _tree(0, dtype)
  state = make(LEARNING_RATE, WEIGHT_DECAY_RATE).init(params)
  update = _one_call_update(problem)
  history = []
  with _promotion(problem.startswith("skip_nonfinite")):
    for grads, params_poison, learning_rate, weight_decay_rate in calls:
      read = params if params_poison is None else _poisoned(params, params_poison)
      updates, state = update(grads, state, read, jnp.float32(learning_rate),
                              jnp.float32(weight_decay_rate))
      params = optax.apply_updates(params, updates)
      history.append(updates)
  return params, state, history


def _clean_calls(problem):
  dtype = ONE_CALL_PROBLEMS[problem][0]
  return [(_tree(10 + step, dtype), None, LEARNING_RATE, WEIGHT_DECAY_RATE)
          for step in range(STEPS - 1)]


def _with_poisoned_call(problem, what, value):
  """The clean calls with one more, poisoned in ``what``, before call ``POISONED_STEP``."""
  rates = {"learning_rate": LEARNING_RATE, "weight_decay_rate": WEIGHT_DECAY_RATE}
  if what in rates:
    rates[what] = value
  poisoned = (_tree(99, ONE_CALL_PROBLEMS[problem][0]), value if what == "params" else None,
              rates["learning_rate"], rates["weight_decay_rate"])
  clean = _clean_calls(problem)
  return [*clean[:POISONED_STEP], poisoned, *clean[POISONED_STEP:]]


NO_LEAF = {"w": 0, "b": 0}

# (problem, what is poisoned, the leaves blamed, the hyperparameters blamed)
ONE_CALL_CASES = [
    # Guards against a skip decided on the gradient only: a NaN learning rate multiplies
    # every update. safefactor checks it once per step (schedules.step_values) and blames
    # the learning rate, not every leaf.
    ("parameter_scale", "learning_rate", NO_LEAF, {"learning_rate": 1}),
    # Guards against a NaN param RMS let through: it multiplies the update when
    # multiply_by_parameter_scale is on (``checked.append(rms)``).
    ("parameter_scale", "params", {"w": 1, "b": 0}, {}),
    # Guards against a NaN param let through when weight decay adds ``rate * param`` to
    # the update and no parameter scale reads it (``checked.append(param)``).
    ("weight_decay", "params", {"w": 1, "b": 0}, {}),
    # Guards against a NaN weight-decay rate let through (it was not checked at all: NaN
    # updates were returned and the step counted as applied).
    ("weight_decay", "weight_decay_rate", NO_LEAF, {"weight_decay_rate": 1}),
    # Guards against a param read only by the rounding write-back let through: the
    # update became NaN, and Kahan wrote NaN into its compensation for good.
    ("stochastic_rounding", "params", {"w": 1, "b": 0}, {}),
    ("kahan_rounding", "params", {"w": 1, "b": 0}, {}),
    # skip_nonfinite decides from what adamw produces: a NaN rate or a NaN param (read
    # by its weight decay) makes NaN updates.
    ("skip_nonfinite_adamw", "learning_rate", {"w": 1, "b": 1}, {}),
    ("skip_nonfinite_adamw", "params", {"w": 1, "b": 0}, {}),
]


def _hyperparam_counts(state):
  """The hyperparameters the guard counted as non-finite, by name: {} for none.

  A guard that checks no hyperparameter (skip_nonfinite around a plain optax
  transformation) keeps no counts at all.
  """
  if state.nonfinite_hyperparams is None:
    return {}, {}
  counts, last = state.nonfinite_hyperparams.host_values()
  return {name: count for name, count in counts.items() if count}, last


@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("problem,what,blamed,blamed_hyperparams", ONE_CALL_CASES,
                         ids=[f"{p}-{w}" for p, w, _, _ in ONE_CALL_CASES])
def test_a_poisoned_input_of_one_call_is_skipped_and_leaves_no_trace(problem, what, blamed,
                                                                     blamed_hyperparams,
                                                                     poison):
  params, state, history = _run_calls(problem, _with_poisoned_call(problem, what,
                                                                   POISONS[poison]))
  expected_params, expected_state, expected_history = _run_calls(problem,
                                                                 _clean_calls(problem))
  assert all(is_all_zero(u) for u in jax.tree.leaves(history[POISONED_STEP]))
  assert int(osf.skipped_steps(state)) == 1
  assert _nonfinite_counts(state) == blamed
  assert {k: int(v) for k, v in state.last_nonfinite_step.per_leaf().items()} == {
      k: POISONED_STEP if n else -1 for k, n in blamed.items()}
  hyperparams, last = _hyperparam_counts(state)
  assert hyperparams == blamed_hyperparams
  assert all(last[name] == POISONED_STEP for name in blamed_hyperparams)
  assert_trees_bitwise_equal(params, expected_params)
  assert_trees_bitwise_equal(state.inner_state, expected_state.inner_state)
  assert_trees_bitwise_equal(history[:POISONED_STEP] + history[POISONED_STEP + 1:],
                        expected_history)


def test_a_param_that_no_part_of_the_step_reads_is_not_a_reason_to_skip():
  # The decision is on what the step writes: without parameter scale, weight decay or a
  # rounding write-back the params are never read, so a NaN in them changes nothing
  # (the NaN element stays NaN under apply_updates, as it would after any optimizer).
  tx = osf.safefactor(0.05, min_dim_size_to_factor=2, multiply_by_parameter_scale=False)
  params, grads = _tree(0), _tree(1)
  state = tx.init(params)
  update = jax.jit(tx.update)
  clean_updates, _ = update(grads, state, params)
  updates, new_state = update(grads, state, _poisoned(params, jnp.nan))
  assert int(osf.skipped_steps(new_state)) == 0
  assert_trees_bitwise_equal(updates, clean_updates)


def test_a_concrete_nonfinite_rate_is_refused_at_construction():
  # The other half of the rates' contract: a number known when the optimizer is built
  # is checked then, with the argument's name; only schedules and traced values reach
  # the step, which skips them.
  for value in (jnp.nan, jnp.inf):
    with pytest.raises(ValueError, match=r"learning_rate must be finite, got"):
      osf.safefactor(value)
    with pytest.raises(ValueError, match=r"weight_decay_rate must be finite \(or None\), got"):
      osf.safefactor(0.1, weight_decay_rate=value)


# --- schedules: NaN at one applied step stalls the run there --------------------------------

SCHEDULED = {
    "safefactor_learning_rate": lambda schedule: osf.safefactor(
        schedule, min_dim_size_to_factor=2, momentum=0.9),
    "safefactor_weight_decay_rate": lambda schedule: osf.safefactor(
        0.05, min_dim_size_to_factor=2, multiply_by_parameter_scale=False,
        weight_decay_rate=schedule),
    "skip_nonfinite_adam_learning_rate": lambda schedule: osf.skip_nonfinite(
        optax.adam(schedule)),
}


@functools.cache
def _scheduled(name, poison):
  def schedule(count):
    return jnp.where(count == POISONED_STEP, jnp.float32(POISONS[poison]), jnp.float32(0.05))

  tx = SCHEDULED[name](schedule)
  return tx, jax.jit(tx.update)


@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("name", sorted(SCHEDULED))
def test_a_schedule_nonfinite_at_one_applied_step_stalls_there(name, poison):
  # Guards against a NaN schedule value reaching the params (a skip decided on the
  # gradient only), and against a skipped step that advances the count: the schedule
  # is a function of the applied steps, so the run must stay at the poisoned step, with
  # the state of the last applied one, bit for bit.
  tx, update = _scheduled(name, poison)
  params = _tree(0)
  state = tx.init(params)
  with _promotion(name.startswith("skip_nonfinite")):
    for step in range(STEPS):
      updates, state = update(_tree(10 + step), state, params)
      params = optax.apply_updates(params, updates)
      if step == POISONED_STEP - 1:
        stalled_params, stalled_inner = params, state.inner_state
      if step >= POISONED_STEP:
        assert all(is_all_zero(u) for u in jax.tree.leaves(updates)), step
  skips = STEPS - POISONED_STEP
  assert int(osf.skipped_steps(state)) == skips == int(state.consecutive_skips)
  if name.startswith("safefactor_"):  # safefactor blames the hyperparameter, not the leaves
    assert _nonfinite_counts(state) == NO_LEAF
    assert _hyperparam_counts(state)[0] == {name.removeprefix("safefactor_"): skips}
  else:  # skip_nonfinite sees only what adam produces: every leaf non-finite
    assert _nonfinite_counts(state) == {"w": skips, "b": skips}
  assert_trees_bitwise_equal(params, stalled_params)
  assert_trees_bitwise_equal(state.inner_state, stalled_inner)


# --- state: a poisoned leaf is read, skipped, and kept as it was ------------------------------

def _safefactor_state_problem():
  # bfloat16 params with Kahan rounding and momentum: every kind of state leaf at once.
  return osf.safefactor(0.05, min_dim_size_to_factor=2, momentum=0.9, param_rounding="kahan")


def _unclipped_state_problem():
  # Without clipping the momentum's finiteness has a reduction of its own.
  return osf.safefactor(0.05, min_dim_size_to_factor=2, momentum=0.9, clipping_threshold=None)


def _adam_state_problem():
  return osf.skip_nonfinite(optax.adam(0.05))


def _set_in(node, path, value):
  """``node`` with the first element of the array at ``path`` (field names, keys or tuple
  indices) set to ``value``."""
  if not path:
    return node.at[(0,) * node.ndim].set(jnp.asarray(value, node.dtype))
  name, *rest = path
  if hasattr(node, "_fields"):
    return node._replace(**{name: _set_in(getattr(node, name), rest, value)})
  if isinstance(node, dict):
    return {**node, name: _set_in(node[name], rest, value)}
  return tuple([_set_in(x, rest, value) if i == name else x for i, x in enumerate(node)])


STATE_CASES = {
    # Guards against a non-finite statistic in the state let through; an Inf column
    # statistic scales its column by 0, so the update alone would look fine.
    "row_statistics": (_safefactor_state_problem, jnp.bfloat16,
                       ("inner_state", "second_moment", "w", "v_row")),
    "column_statistics": (_safefactor_state_problem, jnp.bfloat16,
                          ("inner_state", "second_moment", "w", "v_col")),
    "full_statistics": (_safefactor_state_problem, jnp.bfloat16,
                        ("inner_state", "second_moment", "b", "v")),
    # Guards against a momentum or a compensation that the step blends into the update
    # unchecked: both gave NaN updates, counted as applied.
    "momentum": (_safefactor_state_problem, jnp.bfloat16, ("inner_state", "momentum", "w")),
    "momentum_unclipped": (_unclipped_state_problem, jnp.float32,
                           ("inner_state", "momentum", "w")),
    "kahan_compensation": (_safefactor_state_problem, jnp.bfloat16,
                           ("inner_state", "compensation", "w")),
    # skip_nonfinite reads every floating leaf of the new state: an Inf second moment
    # gives finite (zero) updates, so only the state shows it.
    "adam_first_moment": (_adam_state_problem, jnp.float32, ("inner_state", 0, "mu", "w")),
    "adam_second_moment": (_adam_state_problem, jnp.float32, ("inner_state", 0, "nu", "w")),
}


@functools.cache
def _state_problem(make):
  tx = make()
  return tx, jax.jit(tx.update)


@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("case", sorted(STATE_CASES))
def test_a_poisoned_state_leaf_is_skipped_and_kept_as_it_was(case, poison):
  make, dtype, path = STATE_CASES[case]
  tx, update = _state_problem(make)
  params = _tree(0, dtype)
  state = tx.init(params)
  with _promotion(make is _adam_state_problem):
    for step in range(POISONED_STEP):
      updates, state = update(_tree(10 + step, dtype), state, params)
      params = optax.apply_updates(params, updates)
    poisoned = _set_in(state, path, POISONS[poison])
    state, kept_params = poisoned, params
    for step in range(POISONED_STEP, STEPS):
      updates, state = update(_tree(10 + step, dtype), state, params)
      assert all(is_all_zero(u) for u in jax.tree.leaves(updates)), step
      params = optax.apply_updates(params, updates)
  assert_trees_bitwise_equal(state.inner_state, poisoned.inner_state)
  assert_trees_bitwise_equal(params, kept_params)
  skips = STEPS - POISONED_STEP
  assert int(osf.skipped_steps(state)) == skips == int(state.consecutive_skips)
  # Charged to the leaf whose state is poisoned, and to no other.
  blamed = {"w": skips, "b": 0} if "w" in path else {"w": 0, "b": skips}
  assert _nonfinite_counts(state) == blamed


def test_an_overflowing_second_moment_is_skipped_though_the_updates_are_finite():
  # Guards against a skip_nonfinite that reads the updates only: 1e20 is finite, its
  # square is not, and adam's update mu / sqrt(nu) is then 1e19 / Inf = 0. Only the new
  # state is non-finite; the run with that step must equal the run without it.
  tx, update = _state_problem(_adam_state_problem)
  params = _tree(0)

  def run(grads_sequence):
    state, p, history = tx.init(params), params, []
    with _promotion(True):
      for grads in grads_sequence:
        updates, state = update(grads, state, p)
        p = optax.apply_updates(p, updates)
        history.append(updates)
    return p, state, history

  clean = [_tree(10 + step) for step in range(STEPS - 1)]
  overflowing = {**clean[0], "b": clean[0]["b"].at[3].set(1e20)}
  with _promotion(True):
    inner_updates, inner_state = optax.adam(0.05).update(overflowing, optax.adam(0.05).init(
        params))
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(inner_updates))
  assert not bool(jnp.all(jnp.isfinite(inner_state[0].nu["b"])))
  p, state, history = run([*clean[:POISONED_STEP], overflowing, *clean[POISONED_STEP:]])
  expected_p, expected_state, _ = run(clean)
  assert all(is_all_zero(u) for u in jax.tree.leaves(history[POISONED_STEP]))
  assert _nonfinite_counts(state) == {"w": 0, "b": 1}
  assert_trees_bitwise_equal(p, expected_p)
  assert_trees_bitwise_equal(state.inner_state, expected_state.inner_state)


# --- accumulate_gradients: what a micro-batch reads ------------------------------------------

EVERY_K = 2


@functools.cache
def _accumulation():
  inner = osf.safefactor(0.05, min_dim_size_to_factor=2, momentum=0.9, weight_decay_rate=1e-3)
  tx = osf.accumulate_gradients(inner, EVERY_K)
  return tx, jax.jit(tx.update)


def _accumulate(micro_batches, poison_state_before=None, value=None):
  """Run ``micro_batches``, each ``(grads, params_poison)`` as in ``_run_calls``; before
  micro-batch ``poison_state_before``, one accumulator element is set to ``value``."""
  tx, update = _accumulation()
  params = _tree(0)
  state = tx.init(params)
  history = []
  for index, (grads, params_poison) in enumerate(micro_batches):
    if index == poison_state_before:
      state = state._replace(accumulator=_poisoned(state.accumulator, value))
    read = params if params_poison is None else _poisoned(params, params_poison)
    updates, state = update(grads, state, read)
    params = optax.apply_updates(params, updates)
    history.append(updates)
  return params, state, history


MICRO_BATCHES = 8  # four groups


def _clean_micro_batches():
  return [(_tree(20 + index), None) for index in range(MICRO_BATCHES)]


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_poisoned_micro_batch_gradient_is_left_out(poison):
  # Guards against a non-finite micro-batch entering the accumulator (MultiSteps' trap);
  # the grads of every position are tested in test_accumulate.py, +Inf here.
  clean = _clean_micro_batches()
  bad = (_poisoned(_tree(99), POISONS[poison]), None)
  params, state, history = _accumulate([*clean[:3], bad, *clean[3:]])
  expected_params, expected_state, _ = _accumulate(clean)
  assert is_all_zero(history[3]["w"]) and is_all_zero(history[3]["b"])
  assert_trees_bitwise_equal(params, expected_params)
  assert_trees_bitwise_equal(state._replace(micro_batches=None),
                        expected_state._replace(micro_batches=None))
  assert int(state.micro_batches.skipped_steps) == 1
  assert _nonfinite_counts(state.micro_batches) == {"w": 1, "b": 0}


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_params_poisoned_where_no_group_completes_are_never_read(poison):
  # Only the micro-batch that completes a group steps the inner transformation (and
  # reads the params): elsewhere poisoned params change nothing, and count nothing.
  clean = _clean_micro_batches()
  mid_group = [*clean[:2], (clean[2][0], POISONS[poison]), *clean[3:]]
  params, state, _ = _accumulate(mid_group)
  expected_params, expected_state, _ = _accumulate(clean)
  assert_trees_bitwise_equal(params, expected_params)
  assert_trees_bitwise_equal(state, expected_state)


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_params_poisoned_where_a_group_completes_are_skipped_by_the_inner_guard(poison):
  # The micro-batch's gradients are finite, so accumulation counts no skip; the inner
  # safefactor reads the params (parameter scale, weight decay) and skips its step.
  clean = _clean_micro_batches()
  completing = [*clean[:3], (clean[3][0], POISONS[poison]), *clean[4:]]
  _, state, history = _accumulate(completing)
  assert is_all_zero(history[3]["w"]) and is_all_zero(history[3]["b"])
  assert int(state.micro_batches.skipped_steps) == 0
  guard = state.inner_state
  assert int(guard.skipped_steps) == 1 and _nonfinite_counts(guard) == {"w": 1, "b": 0}
  assert int(guard.last_nonfinite_step.per_leaf()["w"]) == 1


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_stale_accumulator_between_groups_is_ignored(poison):
  # Between groups the accumulator still holds the last group's sum, which the next
  # micro-batch must ignore (not add to, not multiply by zero: 0 * NaN is NaN).
  clean = _clean_micro_batches()
  params, state, _ = _accumulate(clean, poison_state_before=2, value=POISONS[poison])
  expected_params, expected_state, _ = _accumulate(clean)
  assert_trees_bitwise_equal(params, expected_params)
  assert_trees_bitwise_equal(state, expected_state)


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_poisoned_accumulator_within_a_group_leaves_out_every_micro_batch(poison):
  # Mid-group the accumulator is read: every sum with it is non-finite, so every later
  # micro-batch is left out and counted, the group never completes, and the
  # accumulator is kept as it was rather than written with a non-finite sum.
  clean = _clean_micro_batches()
  _, state, history = _accumulate(clean, poison_state_before=3, value=POISONS[poison])
  assert all(is_all_zero(u) for step in history[3:] for u in jax.tree.leaves(step))
  counters = state.micro_batches
  assert int(counters.skipped_steps) == MICRO_BATCHES - 3 == int(counters.consecutive_skips)
  assert _nonfinite_counts(counters) == {"w": MICRO_BATCHES - 3, "b": 0}
  assert int(state.applied_steps) == 1 and int(state.accumulated) == 1
  assert bool(jnp.isnan(state.accumulator["w"][1, 2])) == (poison == "nan")
