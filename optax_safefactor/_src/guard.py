"""Skip and count non-finite steps instead of stepping on NaN."""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import checkify

from optax_safefactor._src import checks, numerics
from optax_safefactor._src.base import (
  WitnessedTransformation,
  all_once,
  keep_unless_skipped,
  tree_all,
  unzip_leaf_results,
  zero_if_skipped,
)
from optax_safefactor._src.boxes import is_box, unbox


class SkipNonfiniteState(NamedTuple):
  """State of :func:`skip_nonfinite`.

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


class NonFiniteStepsError(FloatingPointError):
  """Raised when ``max_consecutive`` steps in a row were skipped."""


def _per_leaf(params: Any, value: int) -> Any:
  # Plain scalars even for boxed params: a param's sharding does not fit a counter.
  return jax.tree.map(lambda _: jnp.asarray(value, jnp.int32), params, is_leaf=is_box)


def _generic_update_with_witness(inner: optax.GradientTransformation):
  """Witness for a transformation that does not report one: scan every output.

  Parts of the state shaped like the updates (Adam's ``mu`` and ``nu``, say) are
  charged to their leaf; any other non-finite state is charged to every leaf.
  """

  def update(updates, state, params=None, **extra_args):
    new_updates, new_state = optax.with_extra_args_support(inner).update(
        updates, state, params, **extra_args
    )
    updates_def = jax.tree.structure(new_updates)

    def is_shaped_like_updates(x):
      return jax.tree.structure(x) == updates_def

    parts = jax.tree.leaves(new_state, is_leaf=is_shaped_like_updates)
    shaped = [part for part in parts if is_shaped_like_updates(part)]
    unattributed = all_once([
        numerics.all_finite(part) for part in parts
        if not is_shaped_like_updates(part) and jnp.issubdtype(part.dtype, jnp.inexact)
    ])

    def leaf_witness(update, *state_leaves):
      finite = [numerics.all_finite(x) for x in (update, *state_leaves)
                if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
      return tree_all(finite) & unattributed

    def finish(step_finite):
      if step_finite is None:
        return new_updates, new_state
      return (
          jax.tree.map(partial(zero_if_skipped, step_finite), new_updates),
          jax.tree.map(partial(keep_unless_skipped, step_finite), new_state, state),
      )

    return jax.tree.map(leaf_witness, new_updates, *shaped), finish

  return update


def _raise_nonfinite_steps(consecutive, step, leaf_finite, *, leaf_names, max_consecutive):
  finite_flags = np.asarray(leaf_finite)
  bad = [name for name, finite in zip(leaf_names, finite_flags, strict=True) if not finite]
  raise NonFiniteStepsError(
      f"{int(consecutive)} consecutive optimizer steps were non-finite and skipped "
      f"(max_consecutive={max_consecutive}); at step {int(step)} the non-finite leaves were: "
      f"{', '.join(bad) or '(optimizer state only)'}. Params and optimizer state hold the last "
      "finite step."
  )


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
  whose square overflows, say) is caught as well as a bad incoming gradient.

  When ``inner`` reports a per-leaf finiteness witness (every transformation of
  this package does), the decision costs a few scalar reductions of statistics
  it computes anyway. Any other transformation is wrapped too, at the price of one
  reduction over each output.

  Skipping is all or nothing for a step. Per-leaf counters record which leaves
  were non-finite, and when; see :func:`skipped_steps` and the state's fields.

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
      raises :class:`NonFiniteStepsError` (naming the non-finite leaves) through a
      host callback, so persistently broken training stops instead of idling. The
      error surfaces at the next synchronisation with the device; everything
      computed since the last applied step was skipped, so nothing is lost. ``None``
      (the default) skips for ever.
    checked: also raise, through ``jax.experimental.checkify``, on the first step in
      which any leaf is non-finite, naming the parameter path and the step. The step
      is still skipped. Run the training step under ``checkify.checkify`` or
      ``chex.chexify`` (without either, tracing the step fails with checkify's own
      error); meant for debugging, since checking synchronises with the host.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` whose state is a
    :class:`SkipNonfiniteState`.
  """
  if max_consecutive is not None and int(max_consecutive) < 1:
    raise ValueError(f"max_consecutive must be a positive int or None, got {max_consecutive!r}")
  if isinstance(inner, WitnessedTransformation):
    update_with_witness = inner.update_with_witness
  else:
    update_with_witness = _generic_update_with_witness(inner)

  def init_fn(params):
    return SkipNonfiniteState(
        inner_state=inner.init(params),
        skipped_steps=jnp.zeros([], jnp.int32),
        consecutive_skips=jnp.zeros([], jnp.int32),
        step=jnp.zeros([], jnp.int32),
        nonfinite_steps=_per_leaf(params, 0),
        last_nonfinite_step=_per_leaf(params, -1),
    )

  def update_fn(updates, state, params=None, **extra_args):
    leaf_finite, finish = update_with_witness(updates, state.inner_state, params, **extra_args)
    step_finite = all_once(jax.tree.leaves(leaf_finite))
    new_updates, new_inner_state = finish(step_finite)

    def count_leaf(count, last, finite):
      return (
          jnp.where(finite, count, optax.safe_increment(count)),
          jnp.where(finite, last, state.step),
      )

    counted = jax.tree.map(count_leaf, state.nonfinite_steps, state.last_nonfinite_step,
                           leaf_finite)
    nonfinite_steps, last_nonfinite_step = unzip_leaf_results(state.nonfinite_steps, counted, 2)
    consecutive = jnp.where(step_finite, 0, optax.safe_increment(state.consecutive_skips))
    if checked:
      for path, finite in jax.tree_util.tree_flatten_with_path(leaf_finite)[0]:
        checkify.check(
            finite, f"{checks.path_name(path)}: non-finite gradient, update or optimizer "
            "state at step {step}; the step was skipped", step=state.step,
        )

    if max_consecutive is not None:
      flat = jax.tree_util.tree_flatten_with_path(leaf_finite)[0]
      leaf_names = tuple(checks.path_name(path) for path, _ in flat)
      finite_vector = (
          jnp.stack([finite for _, finite in flat]) if flat else jnp.zeros([0], bool)
      )

      def report():
        jax.debug.callback(
            lambda c, s, f: _raise_nonfinite_steps(
                c, s, f, leaf_names=leaf_names, max_consecutive=max_consecutive
            ),
            consecutive, state.step, finite_vector,
        )

      jax.lax.cond(consecutive >= max_consecutive, report, lambda: None)

    new_state = SkipNonfiniteState(
        inner_state=new_inner_state,
        skipped_steps=jnp.where(
            step_finite, state.skipped_steps, optax.safe_increment(state.skipped_steps)
        ),
        consecutive_skips=consecutive,
        step=optax.safe_increment(state.step),
        nonfinite_steps=nonfinite_steps,
        last_nonfinite_step=last_nonfinite_step,
    )
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _skip_states(opt_state: Any) -> list[SkipNonfiniteState]:
  def is_skip_state(x):
    return isinstance(x, SkipNonfiniteState)

  return [x for x in jax.tree.leaves(opt_state, is_leaf=is_skip_state) if is_skip_state(x)]


def skipped_steps(opt_state: Any) -> jax.Array:
  """Total skipped steps of every :func:`skip_nonfinite` found anywhere in a state.

  Works through ``optax.chain``, ``inject_hyperparams``, ``MultiSteps`` and any
  other nesting, and on an ``nnx.Optimizer``'s ``opt_state``.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_safefactor as osf
    >>> tx = osf.safefactor(learning_rate=0.1)
    >>> params = {"w": jnp.ones((2, 3))}
    >>> state = tx.init(params)
    >>> _, state = tx.update({"w": jnp.full((2, 3), jnp.inf)}, state, params)
    >>> osf.skipped_steps(state)
    Array(1, dtype=int32)

  Raises:
    ValueError: when the state holds no :func:`skip_nonfinite` state.
  """
  found = _skip_states(opt_state)
  if not found:
    raise ValueError(
        "no skip_nonfinite state found in opt_state; was the optimizer built with "
        "skip_nonfinite (safefactor does so unless skip_nonfinite_steps=False)?"
    )
  counts = [jnp.asarray(unbox(s.skipped_steps), jnp.int32) for s in found]
  return sum(counts[1:], counts[0])


def nonfinite_report(opt_state: Any) -> dict[str, int]:
  """What the non-finite guard saw, as a flat dict of ints ready to log.

  Keys: ``skipped_steps``, ``consecutive_skips`` and ``steps`` (update calls), then
  ``nonfinite_steps/<path>`` and ``last_nonfinite_step/<path>`` (-1 if never) for each
  parameter. With several guards in one state, the keys of the second and later ones
  are prefixed ``guard<i>/``.

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
  """
  found = _skip_states(opt_state)
  if not found:
    raise ValueError("no skip_nonfinite state found in opt_state")
  report: dict[str, int] = {}
  for index, guard in enumerate(found):
    prefix = f"guard{index}/" if index else ""
    for name in ("skipped_steps", "consecutive_skips"):
      report[prefix + name] = int(unbox(getattr(guard, name)))
    report[prefix + "steps"] = int(unbox(guard.step))
    for field in ("nonfinite_steps", "last_nonfinite_step"):
      flat = jax.tree_util.tree_flatten_with_path(getattr(guard, field), is_leaf=is_box)[0]
      for path, value in flat:
        report[f"{prefix}{field}/{checks.path_name(path)}"] = int(unbox(value))
  return report


def nonfinite_summary(opt_state: Any) -> str:
  """One line for a training log: skipped steps and the leaves that were non-finite.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_safefactor as osf
    >>> tx = osf.safefactor(0.1)
    >>> params = {"w": jnp.ones((2, 3))}
    >>> state = tx.init(params)
    >>> print(osf.nonfinite_summary(state))
    no non-finite steps in 0 steps
    >>> _, state = tx.update({"w": jnp.full((2, 3), jnp.inf)}, state, params)
    >>> print(osf.nonfinite_summary(state))
    skipped 1 of 1 steps (1 in a row); non-finite: params['w'] x1 (last at step 0)
  """
  report = nonfinite_report(opt_state)
  if report["skipped_steps"] == 0:
    return f"no non-finite steps in {report['steps']} steps"
  leaves = [
      f"{key.split('/', 1)[1]} x{count} (last at step "
      f"{report['last_nonfinite_step/' + key.split('/', 1)[1]]})"
      for key, count in report.items()
      if key.startswith("nonfinite_steps/") and count
  ]
  return (
      f"skipped {report['skipped_steps']} of {report['steps']} steps "
      f"({report['consecutive_skips']} in a row); non-finite: {', '.join(leaves) or 'state only'}"
  )
