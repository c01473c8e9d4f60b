"""What the guards saw, for the host: a count, a log line, a dict to log, and the one error.

Every report is derived from :func:`guard_records.guard_records`, one record per guard
found by :func:`counters.find_counters`, so the reports always agree with each other; the
:class:`NonFiniteStepsError` message is built by :func:`nonfinite_steps_error` alone.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_safefactor._src import checks, counters
from optax_safefactor._src.guard_records import GuardRecord, SpikeRecord, guard_records
from optax_safefactor._src.placement import unbox


class NonFiniteStepsError(FloatingPointError):
  """Raised when ``max_consecutive`` steps in a row were skipped."""


# Shown (and pickled) under its public name.
NonFiniteStepsError.__module__ = "optax_safefactor"


class _Wording(NamedTuple):
  """How the reports name one kind of record: its keys, its words, its error's ending."""

  skipped: str
  consecutive: str
  calls: str
  nonfinite: str
  last_nonfinite: str
  label: str
  one: str
  many: str
  skipped_one: str
  skipped_what: str
  held: str


_WORDING = {
    "steps": _Wording(
        skipped="skipped_steps", consecutive="consecutive_skips", calls="steps",
        nonfinite="nonfinite_steps", last_nonfinite="last_nonfinite_step", label="guard",
        one="step", many="steps", skipped_one="optimizer step", skipped_what="optimizer steps",
        held="Params and optimizer state hold the last finite step."),
    "micro_batches": _Wording(
        skipped="skipped_micro_batches", consecutive="consecutive_skipped_micro_batches",
        calls="micro_batches", nonfinite="nonfinite_micro_batches",
        last_nonfinite="last_nonfinite_micro_batch", label="accumulation",
        one="micro-batch", many="micro-batches", skipped_one="micro-batch",
        skipped_what="micro-batches",
        held="The accumulator holds the finite micro-batches only."),
}


def nonfinite_steps_error(consecutive: int, step: int, bad_leaves: list[str],
                          max_consecutive: int, kind: str = "steps",
                          bad_hyperparams: list[str] = ()) -> NonFiniteStepsError:
  """The error for ``consecutive`` skips in a row, the last at ``step``, naming
  ``bad_hyperparams`` (first: a NaN learning rate makes every leaf non-finite) and
  ``bad_leaves``.

  >>> print(nonfinite_steps_error(1, 4, ["['w']"], 1))
  1 optimizer step was non-finite and skipped (max_consecutive=1); at step 4 the non-finite \
leaves were: ['w']. Params and optimizer state hold the last finite step.
  >>> print(nonfinite_steps_error(2, 4, [], 2, bad_hyperparams=["learning_rate"]))
  2 consecutive optimizer steps were non-finite and skipped (max_consecutive=2); at step 4 \
the non-finite hyperparameters were: learning_rate (a schedule's value or an injected one, \
non-finite or out of its range), and no leaf was. Params and optimizer state hold the last \
finite step.
  """
  words = _WORDING[kind]
  # max_consecutive=1 stops at the first skip: "1 consecutive steps were" is wrong twice.
  what = (f"1 {words.skipped_one} was" if consecutive == 1
          else f"{consecutive} consecutive {words.skipped_what} were")
  leaves = f"the non-finite leaves were: {', '.join(bad_leaves) or '(optimizer state only)'}"
  if bad_hyperparams:
    leaves = (f"the non-finite hyperparameters were: {', '.join(bad_hyperparams)} "
              f"({HYPERPARAM_SOURCES}), and "
              + (f"the leaves: {', '.join(bad_leaves)}" if bad_leaves else "no leaf was"))
  return NonFiniteStepsError(
      f"{what} non-finite and skipped "
      f"(max_consecutive={max_consecutive}); at {words.one} {step} {leaves}. {words.held}"
  )


# Where a non-finite hyperparameter comes from, for the error and the summary; an
# array's value is also judged against the range construction requires of a number.
HYPERPARAM_SOURCES = "a schedule's value or an injected one, non-finite or out of its range"


def _labelled(records: list[GuardRecord]) -> list[tuple[int, str, GuardRecord]]:
  """Each record with its index among records of its kind and its label (``guard1``)."""
  seen: dict[str, int] = {}
  labelled = []
  for record in records:
    index = seen.get(record.kind, 0)
    seen[record.kind] = index + 1
    wording = _WORDING[record.kind]
    label = f"{wording.label}{index}" if index or record.kind == "steps" else wording.label
    labelled.append((index, label, record))
  return labelled


def skipped_steps(opt_state: Any) -> jax.Array:
  """Total skipped steps of every guard found anywhere in a state (int32 array).

  Micro-batches skipped by :func:`accumulate_gradients` are included: a skipped
  micro-batch is a skipped update call. Works through ``optax.chain``,
  ``inject_hyperparams``, ``MultiSteps`` and any other nesting, on an
  ``nnx.Optimizer``'s ``opt_state``, and under ``jax.jit``.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_safefactor as osf
    >>> tx = osf.safefactor(learning_rate=0.1)
    >>> params = {"w": jnp.ones((2, 3))}
    >>> state = tx.init(params)
    >>> _, state = tx.update({"w": jnp.full((2, 3), jnp.inf)}, state, params)
    >>> osf.skipped_steps(state)
    Array(1, dtype=int32)

  Args:
    opt_state: an optimizer state holding at least one guard: a
      :class:`SkipNonfiniteState` (of :func:`skip_nonfinite`, or of :func:`safefactor`
      unless ``skip_nonfinite_steps=False``) or the counters of
      :func:`accumulate_gradients`, at any depth.

  Returns:
    A scalar int32 array: the skipped steps and micro-batches of every guard, summed.

  Raises:
    ValueError: when the state holds no guard.
  """
  counts = [jnp.asarray(unbox(guard.skipped_steps), jnp.int32)
            for guard in counters.find_counters(opt_state)]
  return sum(counts[1:], counts[0])


def skipped_spikes(opt_state: Any) -> jax.Array:
  """Steps skipped as spikes by every guard found anywhere in a state (int32 array).

  Counts the steps that ``skip_spikes`` skipped (:func:`safefactor`'s or
  :func:`skip_nonfinite`'s); :func:`skipped_steps` counts them too, with the non-finite
  ones. A guard without spike skipping adds 0. Works through any nesting and under
  ``jax.jit``, as :func:`skipped_steps` does.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_safefactor as osf
    >>> tx = osf.safefactor(0.1, skip_spikes=6.0, spike_window=4)
    >>> params = {"w": jnp.ones((2, 3))}
    >>> state = tx.init(params)
    >>> for scale in (1.0, 1.1, 0.9, 50.0):  # the fourth gradient is 50 times the others
    ...   _, state = tx.update({"w": jnp.full((2, 3), scale)}, state, params)
    >>> osf.skipped_spikes(state), osf.skipped_steps(state)
    (Array(1, dtype=int32), Array(1, dtype=int32))

  Args:
    opt_state: an optimizer state holding at least one guard (as for
      :func:`skipped_steps`).

  Returns:
    A scalar int32 array: the spike skips of every guard, summed.

  Raises:
    ValueError: when the state holds no guard.
  """
  counts = [jnp.asarray(unbox(guard.spikes.skipped_spikes), jnp.int32)
            if getattr(guard, "spikes", None) is not None else jnp.zeros([], jnp.int32)
            for guard in counters.find_counters(opt_state)]
  return sum(counts[1:], counts[0])


def nonfinite_report(opt_state: Any) -> dict[str, int | float]:
  """What the guards saw, as a flat dict of ints ready to log.

  Keys: ``skipped_steps``, ``consecutive_skips`` and ``steps`` (update calls), for every
  state that holds a guard (the micro-batch keys below instead, for a state whose only
  counters are :func:`accumulate_gradients`');
  then, for each parameter that was ever non-finite and for no other,
  ``nonfinite_steps/<path>`` (in how many steps it was) and ``last_nonfinite_step/<path>``
  (the ``steps`` value of the last one), and likewise for each hyperparameter that an
  ``optax.inject_hyperparams`` or a schedule ever made non-finite,
  ``nonfinite_hyperparam_steps/<name>`` and ``last_nonfinite_hyperparam_step/<name>``.
  ``total_skipped_steps``, always there, sums every guard (it equals
  :func:`skipped_steps`; a guard's own ``skipped_steps`` counts that guard's steps
  alone). A healthy run's report has these four keys however many parameters there are,
  so it can be logged every step. With several guards in one state, the keys of the
  second and later ones are prefixed ``guard<i>/``.

  Micro-batches skipped by :func:`accumulate_gradients` have keys of their own:
  ``skipped_micro_batches``, ``consecutive_skipped_micro_batches``, ``micro_batches``
  (micro-batches seen), ``nonfinite_micro_batches/<path>`` and
  ``last_nonfinite_micro_batch/<path>`` (prefixed ``accumulation<i>/`` from the second
  accumulation on); ``total_skipped_steps`` includes them.

  A guard with spike skipping on adds ``skipped_spikes`` and ``consecutive_spikes``
  (its ``skipped_steps`` includes the spikes; its ``consecutive_skips`` counts non-finite
  steps only) and, once a spike was skipped, ``last_spike_step``, the statistic's value as
  ``last_spike_gradient_norm`` or ``last_spike_loss`` (floats), ``last_spike_limit``, and
  ``last_spike_largest_gradient/<path>``: the gradient norm of the parameter whose norm
  was largest at that step.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_safefactor as osf
    >>> tx = osf.safefactor(0.1)
    >>> params = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({"w": jnp.ones((2, 3)), "b": jnp.full(3, jnp.nan)}, state, params)
    >>> report = osf.nonfinite_report(state)
    >>> report["skipped_steps"], report["nonfinite_steps/params['b']"]
    (1, 1)

  Args:
    opt_state: an optimizer state holding at least one guard (as for
      :func:`skipped_steps`), with concrete values: call it outside ``jax.jit``.

  Returns:
    A dict from the keys above to Python ints, and to Python floats for the last spike's
    value, limit and leaf norm.

  Raises:
    ValueError: when the state holds no guard.
    TypeError: when the state is traced (inside ``jax.jit``).
  """
  records = guard_records(opt_state)
  report: dict[str, int | float] = {}
  for index, label, record in _labelled(records):
    keys = _WORDING[record.kind]
    prefix = f"{label}/" if index else ""
    report[prefix + keys.skipped] = record.skipped
    report[prefix + keys.consecutive] = record.consecutive
    report[prefix + keys.calls] = record.calls
    # Only the leaves that were non-finite: a key per parameter would be -1 and 0 for
    # nearly all of them.
    for path, count in record.nonfinite.items():
      if count:
        report[f"{prefix}{keys.nonfinite}/{path}"] = count
    for path, count in record.nonfinite.items():
      if count:
        report[f"{prefix}{keys.last_nonfinite}/{path}"] = record.last_nonfinite[path]
    for name, count in record.hyperparams.items():
      if count:
        report[f"{prefix}nonfinite_hyperparam_steps/{name}"] = count
        report[f"{prefix}last_nonfinite_hyperparam_step/{name}"] = (
            record.last_hyperparams[name])
    report.update({prefix + key: value for key, value in _spike_keys(record.spikes).items()})
  report["total_skipped_steps"] = sum(record.skipped for record in records)
  return report


def _spike_keys(spike: SpikeRecord | None) -> dict[str, int | float]:
  """The report's keys for one guard's spike rule (none when it is off)."""
  if spike is None:
    return {}
  keys: dict[str, int | float] = {"skipped_spikes": spike.skipped,
                                  "consecutive_spikes": spike.consecutive}
  if spike.last_step is not None:
    keys["last_spike_step"] = spike.last_step
    keys[f"last_spike_{spike.last_statistic.replace(' ', '_')}"] = spike.last_value
    keys["last_spike_limit"] = spike.last_limit
    if spike.last_leaf is not None:
      keys[f"last_spike_largest_gradient/{spike.last_leaf}"] = spike.last_leaf_norm
  return keys


def _describe_spikes(spike: SpikeRecord) -> str:
  """``2 spikes (last at step 250: gradient norm 51.5 > limit 6.21, largest in params['w'])``."""
  count = f"{spike.skipped} spike{'' if spike.skipped == 1 else 's'}"
  if spike.last_step is None:
    return count
  largest = f", largest in {spike.last_leaf}" if spike.last_leaf is not None else ""
  return (f"{count} (last at step {spike.last_step}: {spike.last_statistic} "
          f"{spike.last_value:.4g} > limit {spike.last_limit:.4g}{largest})")


def _counted(count: int, words: _Wording) -> str:
  """``1 step``, ``2 steps``: a count with its noun."""
  return f"{count} {words.one if count == 1 else words.many}"


# The summary names at most this many leaves per guard, within this many characters of
# paths (however many leaves a model has: one NaN loss makes every leaf non-finite).
SUMMARY_LEAVES = 3
SUMMARY_PATH_CHARACTERS = 360


def _nonfinite_leaves(record: GuardRecord, words: _Wording, budget: int) -> str:
  """The non-finite hyperparameters, then the leaves, worst first: the most often
  non-finite, then the latest."""
  hyperparams = [f"{name} x{count} (last at {words.one} {record.last_hyperparams[name]})"
                 for name, count in record.hyperparams.items() if count]
  leaves = _nonfinite_leaves_only(record, words, budget)
  if not hyperparams:
    return leaves or "state only"
  named = f"hyperparameter {', '.join(hyperparams)}, {HYPERPARAM_SOURCES}"
  return f"{named}; {leaves}" if leaves else named


def _nonfinite_leaves_only(record: GuardRecord, words: _Wording, budget: int) -> str:
  """The non-finite leaves (worst first), or ``""`` for none."""
  bad = [(path, count, record.last_nonfinite[path])
         for path, count in record.nonfinite.items() if count]
  if not bad:
    return ""
  if len(bad) > 1 and len(bad) == len(record.nonfinite) and len({b[1:] for b in bad}) == 1:
    _, count, last = bad[0]
    return f"all {len(bad)} leaves x{count} (last at {words.one} {last})"
  bad.sort(key=lambda b: (-b[1], -b[2]))
  shown: list[str] = []
  for path, count, last in bad:
    item = f"{path} x{count} (last at {words.one} {last})"
    if shown and (len(shown) == SUMMARY_LEAVES
                  or sum(map(len, shown)) + len(item) > budget):
      break
    shown.append(item)
  more = len(bad) - len(shown)
  return ", ".join(shown) + (f" and {more} more {'leaf' if more == 1 else 'leaves'}"
                             if more else "")


def _describe(record: GuardRecord, budget: int = SUMMARY_PATH_CHARACTERS) -> str:
  words = _WORDING[record.kind]
  if record.calls == 0:
    return f"no {words.many} yet"
  if record.skipped == 0:
    return f"no skipped {words.many} in {_counted(record.calls, words)}"
  spike = record.spikes
  if spike is None or spike.skipped == 0:
    return (
        f"skipped {record.skipped} of {_counted(record.calls, words)} ({record.consecutive} in "
        f"a row); non-finite: {_nonfinite_leaves(record, words, budget)}"
    )
  nonfinite = record.skipped - spike.skipped
  clauses = [_describe_spikes(spike)]
  if nonfinite:
    clauses.insert(0, f"{nonfinite} non-finite ({record.consecutive} in a row): "
                      f"{_nonfinite_leaves(record, words, budget)}")
  return f"skipped {record.skipped} of {_counted(record.calls, words)}; " + "; ".join(clauses)


def nonfinite_summary(opt_state: Any) -> str:
  """One line for a training log: skipped steps and the leaves that were non-finite.

  It formats the same records as :func:`nonfinite_report`, so the two (and
  :func:`skipped_steps`) always agree; with several guards each gets its own clause
  (``guard<i>`` for steps, ``accumulation`` for skipped micro-batches, as the report's
  keys are prefixed), with its place in the state (``opt_state.inner_states['head']`` for
  a part of an ``optax.multi_transform``). It names the
  worst non-finite leaves (the most often non-finite first, then the latest), at most
  three per guard, then how many more; when every leaf was non-finite in the same steps
  (a NaN loss), it says so in one phrase. The line stays under about 600 characters
  however many leaves the model has.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_safefactor as osf
    >>> tx = osf.safefactor(0.1)
    >>> params = {"w": jnp.ones((2, 3))}
    >>> state = tx.init(params)
    >>> print(osf.nonfinite_summary(state))
    no steps yet
    >>> _, state = tx.update({"w": jnp.full((2, 3), jnp.inf)}, state, params)
    >>> print(osf.nonfinite_summary(state))
    skipped 1 of 1 step (1 in a row); non-finite: params['w'] x1 (last at step 0)

  Args:
    opt_state: an optimizer state holding at least one guard (as for
      :func:`skipped_steps`), with concrete values: call it outside ``jax.jit``.

  Returns:
    One line of text, without a trailing newline.

  Raises:
    ValueError: when the state holds no guard.
    TypeError: when the state is traced (inside ``jax.jit``).
  """
  records = guard_records(opt_state)
  if len(records) == 1:
    return _describe(records[0])
  total = sum(record.skipped for record in records)
  # The whole line stays about as long: the guards' places come out of the leaves' budget.
  places = sum(len(record.where) for record in records)
  budget = max(SUMMARY_PATH_CHARACTERS - places, SUMMARY_PATH_CHARACTERS // 4) // len(records)
  clauses = "; ".join(f"{label} ({record.where}): {_describe(record, budget)}"
                      for _, label, record in _labelled(records))
  return f"{total} skipped in total; {clauses}"


def check_nonfinite_steps(opt_state: Any, max_consecutive: int) -> None:
  """Raise :class:`NonFiniteStepsError` when a guard has skipped ``max_consecutive`` in a row.

  A host-side check to call between jitted steps: it raises the error type itself
  (inside ``jax.jit`` JAX can only deliver a wrapped one), naming the leaves that were
  non-finite at the last skipped step. Consecutive skipped micro-batches of
  :func:`accumulate_gradients` count too.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_safefactor as osf
    >>> tx = osf.safefactor(0.1)
    >>> params = {"w": jnp.ones((2, 3))}
    >>> state = tx.init(params)
    >>> _, state = tx.update({"w": jnp.full((2, 3), jnp.nan)}, state, params)
    >>> osf.check_nonfinite_steps(state, max_consecutive=1)
    Traceback (most recent call last):
    ...
    optax_safefactor.NonFiniteStepsError: 1 optimizer step was non-finite and skipped ...

  Args:
    opt_state: an optimizer state holding at least one guard (as for
      :func:`skipped_steps`), with concrete values: call it outside ``jax.jit``.
    max_consecutive: a positive int: raise once any guard's current run of skipped
      steps (or skipped micro-batches) reaches it.

  Returns:
    ``None``, when no guard has reached ``max_consecutive``.

  Raises:
    NonFiniteStepsError: when a guard has skipped ``max_consecutive`` or more in a row.
    ValueError: when ``max_consecutive`` is not a positive int, or the state holds no
      guard.
    TypeError: when the state is traced (inside ``jax.jit``).
  """
  # 0 would "stop" a healthy fresh state, and a float or bool is a slip: refuse both.
  checks.check_positive_int(
      max_consecutive, "max_consecutive",
      meaning=" (check_nonfinite_steps raises once a guard has skipped this many steps "
              "in a row)")
  for record in guard_records(opt_state):
    if record.consecutive >= max_consecutive:
      last_step = record.calls - 1
      named = [step for step in (*record.last_nonfinite.values(),
                                 *record.last_hyperparams.values()) if step >= 0]
      if record.spikes is not None and record.spikes.last_step == last_step and named:
        # A spike skip neither ends nor extends a run of non-finite steps: the last of
        # them came before it.
        last_step = max(named)
      bad = [path for path, last in record.last_nonfinite.items() if last == last_step]
      bad_hyperparams = [name for name, last in record.last_hyperparams.items()
                         if last == last_step]
      raise nonfinite_steps_error(record.consecutive, last_step, bad, max_consecutive,
                                  record.kind, bad_hyperparams)
