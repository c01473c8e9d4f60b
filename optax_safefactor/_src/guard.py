"""Skip and count non-finite steps instead of stepping on NaN; one report of what was seen."""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import checkify

from optax_safefactor._src import checks, numerics, xla_hints
from optax_safefactor._src.placement import is_box, unbox
from optax_safefactor._src.trees import (
    find_all,
    keep_unless_skipped,
    unzip_leaf_results,
    zero_if_skipped,
)


class SkipNonfiniteState(NamedTuple):
  """State of :func:`skip_nonfinite` (and of :func:`safefactor`, which guards itself).

  Attributes:
    inner_state: the wrapped transformation's state, as of the last applied step.
    skipped_steps: total number of skipped steps (int32).
    consecutive_skips: skipped steps since the last applied one (int32).
    step: number of ``update`` calls, applied or skipped (int32).
    nonfinite_steps: per leaf, the number of steps in which that leaf's output
      was non-finite (int32 scalars, shaped like the params).
    last_nonfinite_step: per leaf, the value of ``step`` the last time that leaf
      was non-finite, or -1 (int32 scalars, shaped like the params).
  """

  inner_state: Any
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  step: jax.Array
  nonfinite_steps: Any
  last_nonfinite_step: Any


class MicroBatchCounters(NamedTuple):
  """What :func:`accumulate_gradients` counts: its skipped micro-batches.

  The fields of :class:`SkipNonfiniteState` less ``inner_state``, counted by the same
  code, with a micro-batch (one ``update`` call) in place of a step. The reports name
  them as micro-batches, and :func:`skipped_steps` includes them: a skipped micro-batch
  is a skipped update call.

  Attributes:
    skipped_steps: total number of skipped micro-batches (int32).
    consecutive_skips: skipped micro-batches since the last finite one (int32).
    step: number of micro-batches seen, finite or not (int32).
    nonfinite_steps: per leaf, the number of micro-batches in which that leaf was
      non-finite (int32 scalars, shaped like the params).
    last_nonfinite_step: per leaf, the value of ``step`` the last time that leaf was
      non-finite, or -1 (int32 scalars, shaped like the params).
  """

  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  step: jax.Array
  nonfinite_steps: Any
  last_nonfinite_step: Any


# Guard states and micro-batch counters: everything the reports read.
_COUNTER_TYPES = (SkipNonfiniteState, MicroBatchCounters)


class NonFiniteStepsError(FloatingPointError):
  """Raised when ``max_consecutive`` steps in a row were skipped."""


# Shown (and pickled) under its public name.
NonFiniteStepsError.__module__ = "optax_safefactor"


def per_leaf_counters(params: Any, value: int) -> Any:
  """One int32 scalar per param leaf (plain, even for boxed params: a param's sharding
  does not fit a scalar counter)."""
  return jax.tree.map(lambda _: jnp.asarray(value, jnp.int32), params, is_leaf=is_box)


def _zero_counts(params: Any) -> dict[str, Any]:
  return dict(
      skipped_steps=jnp.zeros([], jnp.int32),
      consecutive_skips=jnp.zeros([], jnp.int32),
      step=jnp.zeros([], jnp.int32),
      nonfinite_steps=per_leaf_counters(params, 0),
      last_nonfinite_step=per_leaf_counters(params, -1),
  )


def init_guarded(inner_state: Any, params: Any) -> SkipNonfiniteState:
  """A guard's state around ``inner_state``, with every counter at zero."""
  return SkipNonfiniteState(inner_state=inner_state, **_zero_counts(params))


def init_micro_batch_counters(params: Any) -> MicroBatchCounters:
  """Micro-batch counters for ``params``, every one at zero."""
  return MicroBatchCounters(**_zero_counts(params))


def _nonfinite_message(consecutive: int, step: int, bad_leaves: list[str],
                       max_consecutive: int, words: _Wording | None = None) -> str:
  words = words or _WORDING["steps"]
  # max_consecutive=1 stops at the first skip: "1 consecutive steps were" is wrong twice.
  what = (f"1 {words.skipped_one} was" if consecutive == 1
          else f"{consecutive} consecutive {words.skipped_what} were")
  return (
      f"{what} non-finite and skipped "
      f"(max_consecutive={max_consecutive}); at {words.one} {step} the non-finite leaves "
      f"were: {', '.join(bad_leaves) or '(optimizer state only)'}. {words.held}"
  )


def _raise_from_device(consecutive, step, leaf_finite, *, leaf_names, max_consecutive):
  bad = [name for name, finite in zip(leaf_names, np.asarray(leaf_finite), strict=True)
         if not finite]
  raise NonFiniteStepsError(
      _nonfinite_message(int(consecutive), int(step), bad, max_consecutive)
  )


def _stop_after_max_consecutive(consecutive, step, leaf_finite, max_consecutive) -> None:
  """Raise :class:`NonFiniteStepsError` once ``max_consecutive`` steps in a row were skipped.

  Eagerly the error is raised here, as itself. Under ``jax.jit`` it is raised on the
  host through a callback, and JAX delivers it wrapped in ``JaxRuntimeError`` (whose
  message carries this one); :func:`check_nonfinite_steps` between steps raises the
  type itself from the state.
  """
  flat = jax.tree_util.tree_flatten_with_path(leaf_finite)[0]
  leaf_names = tuple(checks.path_name(path) for path, _ in flat)
  if not isinstance(consecutive, jax.core.Tracer):
    if int(consecutive) >= max_consecutive:
      bad = [name for name, (_, finite) in zip(leaf_names, flat, strict=True) if not finite]
      raise NonFiniteStepsError(
          _nonfinite_message(int(consecutive), int(step), bad, max_consecutive)
      )
    return
  finite_vector = jnp.stack([finite for _, finite in flat]) if flat else jnp.zeros([0], bool)

  def report():
    jax.debug.callback(
        partial(_raise_from_device, leaf_names=leaf_names, max_consecutive=max_consecutive),
        consecutive, step, finite_vector,
    )

  jax.lax.cond(consecutive >= max_consecutive, report, lambda: None)


Counters = TypeVar("Counters", SkipNonfiniteState, MicroBatchCounters)


def count_call(counters: Counters, leaf_finite: Any, call_finite: jax.Array) -> Counters:
  """``counters`` after one more ``update`` call whose verdict is ``call_finite``.

  ``counters`` is a :class:`SkipNonfiniteState` or a :class:`MicroBatchCounters`;
  ``leaf_finite`` has one scalar bool per param leaf. Nothing but the counters changes.
  """

  def count_leaf(count, last, finite):
    return (
        jnp.where(finite, count, optax.safe_increment(count)),
        jnp.where(finite, last, counters.step),
    )

  counted = jax.tree.map(count_leaf, counters.nonfinite_steps, counters.last_nonfinite_step,
                         leaf_finite)
  nonfinite_steps, last_nonfinite_step = unzip_leaf_results(counters.nonfinite_steps, counted, 2)
  return counters._replace(
      skipped_steps=jnp.where(
          call_finite, counters.skipped_steps, optax.safe_increment(counters.skipped_steps)
      ),
      consecutive_skips=jnp.where(
          call_finite, 0, optax.safe_increment(counters.consecutive_skips)
      ),
      step=optax.safe_increment(counters.step),
      nonfinite_steps=nonfinite_steps,
      last_nonfinite_step=last_nonfinite_step,
  )


def record_step(
    state: SkipNonfiniteState,
    new_inner_state: Any,
    leaf_finite: Any,
    step_finite: jax.Array,
    *,
    max_consecutive: int | None,
    checked: bool,
) -> SkipNonfiniteState:
  """The guard's new state after a step whose verdict is ``step_finite``.

  ``new_inner_state`` must already be the old inner state where the step is skipped;
  ``leaf_finite`` has one scalar bool per param leaf.
  """
  counted = count_call(state, leaf_finite, step_finite)
  if checked:
    for path, finite in jax.tree_util.tree_flatten_with_path(leaf_finite)[0]:
      checkify.check(
          finite, f"{checks.path_name(path)}: non-finite gradient, update or optimizer "
          "state at step {step}; the step was skipped", step=state.step,
      )
  if max_consecutive is not None:
    _stop_after_max_consecutive(counted.consecutive_skips, state.step, leaf_finite,
                                max_consecutive)
  return counted._replace(inner_state=new_inner_state)


def _leaf_finite_from_outputs(new_updates: Any, new_state: Any) -> Any:
  """Per-leaf finiteness of any transformation's outputs: one reduction over each.

  Parts of the state shaped like the updates (Adam's ``mu`` and ``nu``, say) are
  charged to their leaf; any other non-finite state is charged to every leaf.
  """
  updates_def = jax.tree.structure(new_updates)

  def is_shaped_like_updates(x):
    return jax.tree.structure(x) == updates_def

  parts = jax.tree.leaves(new_state, is_leaf=is_shaped_like_updates)
  shaped = [part for part in parts if is_shaped_like_updates(part)]
  unattributed = xla_hints.computed_once([
      numerics.all_finite(part) for part in parts
      if not is_shaped_like_updates(part) and jnp.issubdtype(part.dtype, jnp.inexact)
  ])

  def leaf_finite(update, *state_leaves):
    finite = [numerics.all_finite(x) for x in (update, *state_leaves)
              if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
    return jnp.all(jnp.stack(finite)) & unattributed if finite else unattributed

  return jax.tree.map(leaf_finite, new_updates, *shaped)


def skip_nonfinite(
    inner: optax.GradientTransformation,
    max_consecutive: int | None = None,
    *,
    checked: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Skip, and count, every step whose updates or new state would be non-finite.

  A skipped step returns zero updates and leaves ``inner``'s state exactly as it
  was (its count, moments and momentum included), so a run with a poisoned step
  equals the run without that step. The decision is taken on what ``inner``
  *produces*, so NaN or Inf made inside the transformation (a finite gradient
  whose square overflows, say) is caught as well as a bad incoming gradient. It
  costs one reduction over each output; :func:`safefactor` guards itself, deciding
  from statistics it computes anyway, so it needs no wrapper.

  Skipping is all or nothing for a step. Per-leaf counters record which leaves
  were non-finite, and when; see :func:`skipped_steps` and :func:`nonfinite_report`.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_safefactor as osf
    >>> tx = osf.skip_nonfinite(optax.sgd(0.1))
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.array([1.0, jnp.nan, 0.0])}, state, params)
    >>> updates["w"], int(osf.skipped_steps(state))
    (Array([0., 0., 0.], dtype=float32), 1)

  Args:
    inner: any optax transformation.
    max_consecutive: if given, the step that makes this many consecutive skips
      raises :class:`NonFiniteStepsError` naming the non-finite leaves, so
      persistently broken training stops instead of idling. Called eagerly, ``update``
      raises it as itself. Under ``jax.jit`` it is raised on the host through a
      callback, surfaces at the next synchronisation with the device, and JAX wraps
      it in ``jax.errors.JaxRuntimeError`` (the message carries the original); to
      catch the type itself, call :func:`check_nonfinite_steps` on the state between
      steps instead. Everything computed since the last applied step was skipped, so
      nothing is lost. ``None`` (the default) skips for ever.
    checked: also raise, through ``jax.experimental.checkify``, on the first step in
      which any leaf is non-finite, naming the parameter path and the step. The step
      is still skipped. Run the training step under ``checkify.checkify`` or
      ``chex.chexify`` (without either, tracing the step fails with checkify's own
      error); meant for debugging, since checking synchronises with the host.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` whose state is a
    :class:`SkipNonfiniteState`.

  Raises:
    TypeError: at construction, when ``inner`` is not a transformation (the factory
      ``optax.sgd`` rather than ``optax.sgd(1e-3)``, say); in ``init`` and ``update``,
      when a param or grad leaf is not an array; in ``update``, when the state is not
      this transformation's.
    ValueError: when ``max_consecutive`` is not a positive int or ``None``; in
      ``update``, when grads and params differ in structure or in a leaf's shape.
  """
  checks.check_transformation(inner, "skip_nonfinite")
  checks.check_positive_int(
      max_consecutive, "max_consecutive", none_ok=True,
      meaning=" (the number of consecutive skipped steps that raises NonFiniteStepsError; "
              "None never raises)")
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    # Any dtype: skip_nonfinite wraps any transformation, which decides about integer leaves.
    checks.check_init_params(params, any_dtype=True)
    return init_guarded(inner.init(params), params)

  def update_fn(updates, state, params=None, **extra_args):
    checks.check_state_type(state, SkipNonfiniteState, updates, "skip_nonfinite")
    checks.check_update_inputs(updates, params, any_dtype=True)
    new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
    leaf_finite = _leaf_finite_from_outputs(new_updates, new_inner)
    step_finite = xla_hints.computed_once(jax.tree.leaves(leaf_finite))
    new_updates = jax.tree.map(partial(zero_if_skipped, step_finite), new_updates)
    new_inner = jax.tree.map(partial(keep_unless_skipped, step_finite), new_inner,
                             state.inner_state)
    return new_updates, record_step(state, new_inner, leaf_finite, step_finite,
                                    max_consecutive=max_consecutive, checked=checked)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# Reports ---------------------------------------------------------------------------


class GuardRecord(NamedTuple):
  """What one guard saw, as host numbers: the single source of every report.

  ``kind`` is ``"steps"`` for a :class:`SkipNonfiniteState` and ``"micro_batches"``
  for :func:`accumulate_gradients`' :class:`MicroBatchCounters`; it decides the words
  and keys the reports use, never the numbers.
  """

  skipped: int
  consecutive: int
  calls: int
  nonfinite: dict[str, int]
  last_nonfinite: dict[str, int]
  kind: str = "steps"


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


def _guard_states(opt_state: Any) -> list[SkipNonfiniteState | MicroBatchCounters]:
  return find_all(opt_state, _COUNTER_TYPES)


def _kind(counters: SkipNonfiniteState | MicroBatchCounters) -> str:
  return "micro_batches" if isinstance(counters, MicroBatchCounters) else "steps"


def _no_guard_error() -> ValueError:
  return ValueError(
      "no skip_nonfinite state found in opt_state; was the optimizer built with "
      "skip_nonfinite (safefactor does so unless skip_nonfinite_steps=False) or "
      "accumulate_gradients?"
  )


def _per_leaf_ints(tree: Any) -> dict[str, int]:
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]
  return {checks.path_name(path): int(unbox(value)) for path, value in flat}


def guard_records(opt_state: Any) -> list[GuardRecord]:
  """One :class:`GuardRecord` per guard found anywhere in ``opt_state``, guards inside
  another guard included, in the state's tree order (a guard before those inside it).

  The micro-batch counters of :func:`accumulate_gradients` are records too, of kind
  ``"micro_batches"``.
  """
  found = _guard_states(opt_state)
  if not found:
    raise _no_guard_error()
  return [
      GuardRecord(
          skipped=int(unbox(guard.skipped_steps)),
          consecutive=int(unbox(guard.consecutive_skips)),
          calls=int(unbox(guard.step)),
          nonfinite=_per_leaf_ints(guard.nonfinite_steps),
          last_nonfinite=_per_leaf_ints(guard.last_nonfinite_step),
          kind=_kind(guard),
      )
      for guard in found
  ]


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
  found = _guard_states(opt_state)
  if not found:
    raise _no_guard_error()
  counts = [jnp.asarray(unbox(guard.skipped_steps), jnp.int32) for guard in found]
  return sum(counts[1:], counts[0])


def nonfinite_report(opt_state: Any) -> dict[str, int]:
  """What the guards saw, as a flat dict of ints ready to log.

  Keys: ``skipped_steps``, ``consecutive_skips`` and ``steps`` (update calls), then
  ``nonfinite_steps/<path>`` and ``last_nonfinite_step/<path>`` (-1 if never) for each
  parameter. With several guards in one state, the keys of the second and later ones
  are prefixed ``guard<i>/``. ``total_skipped_steps``, always there, sums every guard
  (it equals :func:`skipped_steps`).

  Micro-batches skipped by :func:`accumulate_gradients` have keys of their own:
  ``skipped_micro_batches``, ``consecutive_skipped_micro_batches``, ``micro_batches``
  (micro-batches seen), ``nonfinite_micro_batches/<path>`` and
  ``last_nonfinite_micro_batch/<path>`` (prefixed ``accumulation<i>/`` from the second
  accumulation on); ``total_skipped_steps`` includes them.

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
    A dict from the keys above to Python ints.

  Raises:
    ValueError: when the state holds no guard.
  """
  records = guard_records(opt_state)
  report: dict[str, int] = {}
  for index, label, record in _labelled(records):
    keys = _WORDING[record.kind]
    prefix = f"{label}/" if index else ""
    report[prefix + keys.skipped] = record.skipped
    report[prefix + keys.consecutive] = record.consecutive
    report[prefix + keys.calls] = record.calls
    for path, count in record.nonfinite.items():
      report[f"{prefix}{keys.nonfinite}/{path}"] = count
    for path, last in record.last_nonfinite.items():
      report[f"{prefix}{keys.last_nonfinite}/{path}"] = last
  report["total_skipped_steps"] = sum(record.skipped for record in records)
  return report


def _counted(count: int, words: _Wording) -> str:
  """``1 step``, ``2 steps``: a count with its noun."""
  return f"{count} {words.one if count == 1 else words.many}"


def _describe(record: GuardRecord) -> str:
  words = _WORDING[record.kind]
  if record.calls == 0:
    return f"no {words.many} yet"
  if record.skipped == 0:
    return f"no skipped {words.many} in {_counted(record.calls, words)}"
  leaves = [
      f"{path} x{count} (last at {words.one} {record.last_nonfinite[path]})"
      for path, count in record.nonfinite.items()
      if count
  ]
  return (
      f"skipped {record.skipped} of {_counted(record.calls, words)} ({record.consecutive} in a "
      f"row); non-finite: {', '.join(leaves) or 'state only'}"
  )


def nonfinite_summary(opt_state: Any) -> str:
  """One line for a training log: skipped steps and the leaves that were non-finite.

  It formats the same records as :func:`nonfinite_report`, so the two (and
  :func:`skipped_steps`) always agree; with several guards each gets its own clause
  (``guard<i>`` for steps, ``accumulation`` for skipped micro-batches).

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
  """
  records = guard_records(opt_state)
  if len(records) == 1:
    return _describe(records[0])
  total = sum(record.skipped for record in records)
  clauses = "; ".join(f"{label}: {_describe(record)}" for _, label, record in
                      _labelled(records))
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
  """
  # 0 would "stop" a healthy fresh state, and a float or bool is a slip: refuse both.
  checks.check_positive_int(
      max_consecutive, "max_consecutive",
      meaning=" (check_nonfinite_steps raises once a guard has skipped this many steps "
              "in a row)")
  for record in guard_records(opt_state):
    if record.consecutive >= max_consecutive:
      last_step = record.calls - 1
      bad = [path for path, last in record.last_nonfinite.items() if last == last_step]
      raise NonFiniteStepsError(
          _nonfinite_message(record.consecutive, last_step, bad, max_consecutive,
                             _WORDING[record.kind])
      )
