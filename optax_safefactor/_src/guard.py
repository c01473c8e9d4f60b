"""The guard: what makes a step skipped, and ``skip_nonfinite`` for any transformation.

A step is skipped, all or nothing, when anything it would write is non-finite. For
safefactor (guarded unless ``skip_nonfinite_steps=False``) that is decided per leaf
inside its own update (``kernel.leaf_scaling``), from values the step computes anyway:

- the gradient (its square is part of the new second-moment statistics);
- the new statistics, and the old ones they blend (also a NaN or Inf in the state);
- the clipping reduction of the scaled gradient (when clipping is on);
- this step's learning rate and weight-decay rate (a schedule that returns NaN);
- the old momentum and Kahan compensation, which the update blends in;
- the params' RMS, when ``multiply_by_parameter_scale`` is on; otherwise the params
  themselves, when weight decay applies to the leaf or a rounding write-back
  (``param_rounding`` ``"stochastic"`` or ``"kahan"``) lands on a narrow param.

The update is then finite by construction: every factor it is built from was checked.
:func:`skip_nonfinite` decides for any other transformation from what it *produces*: its
updates and every floating leaf of its new state. A skipped step returns zero updates and
the old state, exactly (its count, moments, momentum and compensation included), and is
counted by :func:`record_step` (``counters.count_call``); the reports read those counts.

So a NaN or Inf in the state is kept by the skip, as the rest of the state is, and every
later step reads it and is skipped too, until the state is restored or
``max_consecutive`` stops the run. A schedule that is NaN at one applied step stalls the
run there the same way, since a skipped step does not advance the count it reads.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import checkify

from optax_safefactor._src import (
    checks,
    manual_axes,
    numerics,
    placement,
    reports,
    spikes,
    state_checks,
    user_warnings,
    wrapped_update,
    xla_hints,
)
from optax_safefactor._src.argument_names import explain_unknown_arguments
from optax_safefactor._src.checked_mode import needs_checkify
from optax_safefactor._src.counters import (
    COUNTER_FIELDS,
    HyperparamCounts,
    SkipNonfiniteState,
    count_call,
    init_guarded,
)
from optax_safefactor._src.kernel import abs_sq
from optax_safefactor._src.trees import (
    find_all,
    flag_vector,
    keep_unless_skipped,
    zero_if_skipped,
)


def _raise_if_over(consecutive, step, leaf_finite, hyperparams_finite, max_consecutive, *,
                   leaf_names, hyperparam_names) -> None:
  """On the host: raise :class:`NonFiniteStepsError` naming the hyperparameters and the
  leaves that were not finite."""
  max_consecutive = int(max_consecutive)
  if max_consecutive < 1:
    # Construction refuses it; optax.inject_hyperparams can hand it over later.
    raise ValueError(f"max_consecutive_skips must be an int of at least 1, got "
                     f"{max_consecutive} (injected): it would stop every step")
  if int(consecutive) >= max_consecutive:
    def bad(names, finite):
      return [name for name, ok in zip(names, np.asarray(finite), strict=True) if not ok]

    raise reports.nonfinite_steps_error(
        int(consecutive), int(step), bad(leaf_names, leaf_finite), max_consecutive,
        bad_hyperparams=bad(hyperparam_names, hyperparams_finite))


def _stop_after_max_consecutive(consecutive, step, leaf_finite, hyperparams_finite,
                                leaf_names, hyperparam_names, max_consecutive) -> None:
  """Raise :class:`NonFiniteStepsError` once ``max_consecutive`` steps in a row were skipped.

  Eagerly the error is raised here, as itself. Under ``jax.jit`` it is raised on the
  host through a callback, and JAX delivers it wrapped in ``JaxRuntimeError`` (whose
  message carries this one); :func:`check_nonfinite_steps` between steps raises the
  type itself from the state.
  """
  raise_if_over = partial(_raise_if_over, leaf_names=leaf_names,
                          hyperparam_names=hyperparam_names)
  # The limit goes to the host as an operand: injected by optax.inject_hyperparams, it is
  # traced, and a callback must not close over a tracer.
  flags = (consecutive, step, leaf_finite, hyperparams_finite, max_consecutive)
  if not isinstance(consecutive, jax.core.Tracer):
    raise_if_over(*flags)
    return
  # Unpartitioned, the callback runs on one device of the whole program: with several
  # processes only the process holding it would stop, and the others would step on and
  # wait in the next collective. Partitioned, every device calls it with its own copy of
  # these replicated flags; in one process that would log the error once per device.
  jax.lax.cond(consecutive >= max_consecutive,
               lambda: jax.debug.callback(raise_if_over, *flags,
                                          partitioned=jax.process_count() > 1),
               lambda: None)


def injected_hyperparams(inner_state: Any) -> dict[str, jax.Array]:
  """The floating values ``optax.inject_hyperparams`` keeps in ``inner_state``, by name
  (``learning_rate``; ``<i>/learning_rate`` when several injections hold them)."""
  # inject_hyperparams' state is an InjectStatefulHyperparamsState (its subclass
  # InjectHyperparamsState in older optax releases).
  injections = find_all(inner_state, optax.InjectStatefulHyperparamsState)
  found = {}
  for index, injection in enumerate(injections):
    for name, value in sorted(injection.hyperparams.items()):
      if jnp.issubdtype(jnp.result_type(value), jnp.floating):
        found[name if len(injections) == 1 else f"{index}/{name}"] = value
  return found


def _hyperparam_counts(state: SkipNonfiniteState,
                       finite: jax.Array) -> HyperparamCounts | None:
  """The guard's hyperparameter counts after a step whose hyperparameters' finiteness is
  ``finite`` (one flag per name); ``None`` for a guard that checks none."""
  counts = state.nonfinite_hyperparams
  if counts is None and finite.shape == (0,):
    return None
  if not isinstance(counts, HyperparamCounts):
    raise TypeError(
        "SkipNonfiniteState.nonfinite_hyperparams must be a HyperparamCounts, got "
        f"{type(counts).__name__}: a state in the layout of optax_safefactor 0.2; convert "
        "it with osf.migrate_from_0_2(opt_state)")
  if counts.counts.shape != finite.shape:
    raise ValueError(
        f"the optimizer state checks the hyperparameters {list(counts.names)}, but this "
        f"optimizer checks {finite.shape[0]}: the state was made by an optimizer of another "
        "configuration; make it with this optimizer's init (a state of release 0.2 "
        "migrated without like=: osf.migrate_from_0_2(opt_state, like=tx.init(params)))")
  return counts.counted(finite, state.step)


def record_step(
    state: SkipNonfiniteState,
    new_inner_state: Any,
    leaf_finite: jax.Array,
    step_finite: jax.Array,
    *,
    max_consecutive: int | None,
    checked: bool,
    spike: spikes.SpikeVerdict | None = None,
    hyperparams_finite: jax.Array | None = None,
) -> SkipNonfiniteState:
  """The guard's new state after a step whose non-finite verdict is ``step_finite``.

  ``new_inner_state`` must already be the old inner state where the step is skipped
  (non-finite, or a spike by ``spike``, the verdict of :func:`spikes.judge` when spike
  skipping is on); ``leaf_finite`` is a bool vector, one flag per param leaf in the
  params' leaf order, and ``hyperparams_finite`` one per hyperparameter the state counts
  (``None`` for none).
  """
  if hyperparams_finite is None:
    hyperparams_finite = jnp.ones([0], bool)
  hyperparam_counts = _hyperparam_counts(state, hyperparams_finite)
  if spike is None:
    counted = count_call(state, leaf_finite, step_finite)
  else:
    counted = count_call(state, leaf_finite, step_finite & ~spike.skip, spike.skip)
    counted = counted._replace(spikes=spikes.record(state.spikes, spike, step_finite,
                                                    state.step))
  counted = counted._replace(nonfinite_hyperparams=hyperparam_counts)
  hyperparam_names = () if hyperparam_counts is None else hyperparam_counts.names
  if checked or max_consecutive is not None:
    leaf_names = state.nonfinite_steps.names()
  if checked:
    for index, name in enumerate(hyperparam_names):
      checkify.check(
          needs_checkify(hyperparams_finite[index]),
          f"{name}: non-finite hyperparameter at step {{step}} "
          f"({reports.HYPERPARAM_SOURCES}); the step was skipped", step=state.step,
      )
    for index, name in enumerate(leaf_names):
      checkify.check(
          needs_checkify(leaf_finite[index]),
          f"{name}: non-finite gradient, update or optimizer "
          "state at step {step}; the step was skipped", step=state.step,
      )
  if max_consecutive is not None:
    _stop_after_max_consecutive(counted.consecutive_skips, state.step, leaf_finite,
                                hyperparams_finite, leaf_names, hyperparam_names,
                                max_consecutive)
  return counted._replace(inner_state=new_inner_state)


def check_spike_state(state: SkipNonfiniteState, skip_spikes: Any,
                      spike_window: Any) -> None:
  """The state has a spike history exactly when spike skipping is on, of its window."""
  if (state.spikes is None) != (skip_spikes is None):
    has = "has no" if state.spikes is None else "has a"
    raise ValueError(
        f"the optimizer state {has} spike history, but the optimizer was built with "
        f"skip_spikes={skip_spikes!r}; make the state with this optimizer's init (a state "
        "from a run without spike skipping can be extended with the spikes field of a new "
        "init's state)")
  if state.spikes is None:
    return
  spikes.check_history(state.spikes)
  window = spikes.window_of(state.spikes)
  if not isinstance(spike_window, jax.core.Tracer) and int(spike_window) != window:
    raise ValueError(f"the state's spike history holds {window} steps, but the optimizer "
                     f"was built with spike_window={int(spike_window)}")


def _finite_or_kept(new: jax.Array, old: Any) -> jax.Array:
  """Whether a scalar of the wrapped state is finite, or infinite as it was before the
  step: a sentinel kept (optax's reduce_on_plateau starts its best value at +Inf), not
  a value this step made non-finite. A NaN never counts as kept (NaN != NaN)."""
  finite = numerics.all_finite(new)
  if (old is None or np.ndim(new) != 0 or np.shape(old) != ()
      or jnp.result_type(old) != jnp.result_type(new)):
    return finite
  return finite | (new == old)


def _leaf_finite_from_outputs(new_updates: Any, new_state: Any, old_state: Any) -> jax.Array:
  """Per-leaf finiteness of any transformation's outputs, one reduction over each, as a
  bool vector in the updates' leaf order.

  Parts of the state shaped like the updates (Adam's ``mu`` and ``nu``, say, with the
  MaskedNode of a param ``optax.masked`` leaves out, or Adafactor's keepdims statistics)
  are charged to their leaf; any other non-finite state is charged to every leaf, but for
  a scalar ``old_state`` held infinite already (:func:`_finite_or_kept`).
  """
  updates_def = jax.tree.structure(new_updates)
  update_shapes = [jnp.shape(update) for update in jax.tree.leaves(new_updates)]

  def is_shaped_like_updates(x):
    # The updates' tree with, in a leaf's place, that leaf's state: arrays of the leaf's
    # rank, each axis its size or 1 (a moment, or statistics kept with keepdims), or
    # nothing (the MaskedNode of a param that optax.masked or optax.multi_transform
    # leaves out).
    if jax.tree.structure(x) == updates_def:
      return True
    if updates_def.num_leaves < 2 or updates_def.num_nodes == 1:
      return False
    try:
      per_leaf = updates_def.flatten_up_to(x)
    except (ValueError, TypeError):
      return False
    return all(hasattr(array, "dtype") and placement.fits_param(jnp.shape(array), shape)
               for part, shape in zip(per_leaf, update_shapes, strict=True)
               for array in jax.tree.leaves(part))

  parts = jax.tree.leaves(new_state, is_leaf=is_shaped_like_updates)
  old_parts = jax.tree.leaves(old_state, is_leaf=is_shaped_like_updates)
  if len(old_parts) != len(parts):
    old_parts = [None] * len(parts)
  shaped = [part for part in parts if is_shaped_like_updates(part)]
  unattributed = xla_hints.computed_once([
      _finite_or_kept(part, old) for part, old in zip(parts, old_parts, strict=True)
      if not is_shaped_like_updates(part) and jnp.issubdtype(part.dtype, jnp.inexact)
  ])

  def leaf_finite(update, *state_parts):
    arrays = [update, *(x for part in state_parts for x in jax.tree.leaves(part))]
    finite = [numerics.all_finite(x) for x in arrays
              if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
    return jnp.all(jnp.stack(finite)) & unattributed if finite else unattributed

  return flag_vector(jax.tree.leaves(jax.tree.map(leaf_finite, new_updates, *shaped)))


def _without_spike_histories(state: Any) -> Any:
  """``state`` less the spike histories of guards inside it: their NaN marks the steps
  not yet seen (:class:`SpikeHistory`'s values before any spike), not a non-finite step."""
  def is_history(x):
    return isinstance(x, spikes.SpikeHistory)

  return jax.tree.map(lambda x: None if is_history(x) else x, state, is_leaf=is_history)


def _kept_unless_skipped(applied: jax.Array, new: Any, old: Any) -> Any:
  """A state leaf of the wrapped transformation: its new value, or the old one when the
  step is skipped, in the wider of their two dtypes. A transformation may change a
  leaf's dtype (optax.adam's moments of bfloat16 params take float32 grads' dtype), and
  the wider keeps the old value exactly and the new one as returned when it widens."""
  if new.dtype != old.dtype:  # (a PRNG key's dtype is no number type: left as it is)
    dtype = jnp.promote_types(new.dtype, old.dtype)
    new, old = new.astype(dtype), old.astype(dtype)
  return keep_unless_skipped(applied, new, old)


def _grads_error(grads: Any, params: Any | None, counted: Any) -> ValueError | None:
  """The error for grads whose leaves are not the params', or ``None`` when they are.

  Raised when the wrapped transformation refuses such grads (in its place, JAX's bare
  structure error, or steps what it should not: a (value, grads) pair, whose updates are
  then not shaped like the params) or when spike skipping, which names a spike by the
  param whose gradient is largest, needs the grads' leaves to be the params'. The
  structure comes first (a pair's aux may hold a Python float); then leaves that are not
  arrays and grads that differ from their params in shape are refused at once.
  """
  if params is not None:
    try:
      checks.check_same_structure(grads, params, "params")
    except ValueError as error:
      return error
  checks.check_update_inputs(grads, params, any_dtype=True)
  # The counters name init's params. (Leaves, not whole structures: a param optax.masked
  # leaves out is boxed in init's tree under nnx, bare in grads.)
  if counted.num_leaves != len(jax.tree.leaves(grads)):
    checks.check_same_structure(grads, counted.unflatten([0] * counted.num_leaves),
                                "the optimizer state")
  return None


def _square_sums(grads: Any) -> jax.Array:
  """Per leaf, the sum of ``|g|**2`` in float32 (0 for a leaf that is not floating)."""

  def square_sum(grad):
    grad = jnp.asarray(grad)
    if not jnp.issubdtype(grad.dtype, jnp.inexact):
      return jnp.zeros([], jnp.float32)
    # (Inside jax.shard_map, a split leaf's sum over the devices that hold its shards.)
    square = abs_sq(grad.astype(numerics.compute_dtype(grad.dtype)))
    return manual_axes.whole_sum(jnp.sum(square))

  sums = [square_sum(grad).astype(jnp.float32) for grad in jax.tree.leaves(grads)]
  return jnp.stack(sums) if sums else jnp.zeros([0], jnp.float32)


@explain_unknown_arguments
def skip_nonfinite(
    inner: optax.GradientTransformation,
    max_consecutive: int | None = None,
    *,
    checked: bool = False,
    skip_spikes: float | None = None,
    spike_window: int = 128,
) -> optax.GradientTransformationExtraArgs:
  """Skip, and count, every step whose updates or new state would be non-finite.

  A skipped step returns zero updates and leaves ``inner``'s state exactly as it
  was (its count, moments and momentum included), so a run with a poisoned step
  equals the run without that step. The decision is taken on what ``inner``
  *produces*, so NaN or Inf made inside the transformation (a finite gradient
  whose square overflows, say) is caught as well as a bad incoming gradient. It
  costs one reduction over each output; :func:`safefactor` guards itself, deciding
  from statistics it computes anyway, so it needs no wrapper. A scalar of ``inner``'s
  state that the step leaves infinite as it was is a sentinel, not a non-finite value
  (``optax.contrib.reduce_on_plateau`` starts its best value at +Inf); a NaN always
  counts, and so does a scalar the step makes infinite.

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
    inner: any optax transformation, one whose grads are not shaped like its params
      included (``optax.lookahead`` takes the fast params' grads) as long as its
      updates are: the counters count the params' leaves.
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
      ``chex.chexify``; compiled without either, the step raises
      :class:`CheckedWithoutCheckifyError`, which says so. Meant for debugging, since
      checking synchronises with the host.
    skip_spikes: also skip, and count, a finite step whose global gradient norm, or
      whose loss on a step whose ``update`` is given ``value=loss`` (both are judged,
      each against its own history), is more than this many standard deviations above
      the mean of the last ``spike_window`` applied steps (6.0 is the usual choice;
      ``None``, the default, skips no spike, and ignores ``value=``). The rule, its
      floor on the standard deviation, its bound on spike skips in a row and what the
      reports name are in :func:`safefactor`'s docstring. The gradient norm is one
      reduction over the incoming gradients; :func:`skipped_spikes` counts the spikes.
    spike_window: the steps of history the spike rule keeps (an int of at least 2);
      it decides once half of them are there. It sets the state's shape: under
      ``optax.inject_hyperparams``, pass it in ``static_args``.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` whose state is a
    :class:`SkipNonfiniteState`.

  Raises:
    TypeError: at construction, when ``inner`` is not a transformation (the factory
      ``optax.sgd`` rather than ``optax.sgd(1e-3)``, say); in ``init`` and ``update``,
      when a param or grad leaf is not an array; in ``update``, when the state is not
      this transformation's.
    ValueError: when ``max_consecutive`` is not a positive int or ``None``; in
      ``update``, when grads and params differ in a leaf's shape, or in structure where
      ``inner`` refuses such grads, returns updates not shaped like the params, or
      spikes are skipped.
  """
  checks.check_transformation(inner, "skip_nonfinite")
  spikes.check_settings(skip_spikes, spike_window)
  checks.check_switch(checked, "checked")
  unused = spikes.unused_window(skip_spikes, spike_window)
  if unused:
    user_warnings.warn(unused)
  checks.check_positive_int(
      max_consecutive, "max_consecutive", none_ok=True,
      meaning=" (the number of consecutive skipped steps that raises NonFiniteStepsError; "
              "None never raises)")
  inner = optax.with_extra_args_support(inner)

  def init_fn(params, *misplaced):
    checks.check_init_arguments(misplaced)
    params = placement.numpy_as_jax(params)
    # Any dtype: skip_nonfinite wraps any transformation, which decides about integer leaves.
    checks.check_init_params(params, any_dtype=True)
    inner_state = inner.init(params)
    return init_guarded(inner_state, params, None if skip_spikes is None else spike_window,
                        tuple(injected_hyperparams(inner_state)))

  def update_fn(updates, state, params=None, **extra_args):
    state_checks.check_state_type(state, SkipNonfiniteState, updates, "skip_nonfinite")
    state_checks.check_counters(state, COUNTER_FIELDS)
    check_spike_state(state, skip_spikes, spike_window)
    grads_error = _grads_error(updates, params, state.nonfinite_steps.treedef)
    if grads_error is not None and skip_spikes is not None:
      raise ValueError(f"{grads_error}; skip_spikes names a spike by the param whose gradient "
                       "is largest, so it needs grads shaped like the params")
    loss = spikes.loss_given(extra_args) if skip_spikes is not None else None
    try:
      new_updates, new_inner = wrapped_update.update(inner, "skip_nonfinite", updates,
                                                     state.inner_state, params, **extra_args)
    except Exception as error:
      if grads_error is None:
        raise
      raise grads_error from error
    if grads_error is not None:
      # Grads of other leaves than the params', which the wrapped transformation takes
      # (optax.lookahead takes the fast params' grads): what it returns must still be
      # shaped like the params, whose leaves the counters count.
      try:
        checks.check_update_inputs(new_updates, params, any_dtype=True,
                                   name="the wrapped transformation's updates")
      except ValueError as error:
        raise grads_error from error
    leaf_finite = _leaf_finite_from_outputs(new_updates, _without_spike_histories(new_inner),
                                            _without_spike_histories(state.inner_state))
    # The values optax.inject_hyperparams used this step, kept in the new inner state; one
    # infinite as it was is a setting (max_norm=inf: no clipping), as for the state's scalars.
    hyperparams = injected_hyperparams(new_inner)
    before = injected_hyperparams(state.inner_state)
    hyperparams_finite = (flag_vector([_finite_or_kept(value, before.get(name))
                                       for name, value in hyperparams.items()])
                          if hyperparams else None)
    step_finite = xla_hints.computed_once(
        [leaf_finite] + ([] if hyperparams_finite is None else [hyperparams_finite]))
    spike, applied = None, step_finite
    if skip_spikes is not None:
      spike = spikes.judge(state.spikes, _square_sums(updates), loss, skip_spikes, step_finite)
      applied = xla_hints.computed_once([step_finite, ~spike.skip])
    new_updates = jax.tree.map(partial(zero_if_skipped, applied), new_updates)
    new_inner = jax.tree.map(partial(_kept_unless_skipped, applied), new_inner,
                             state.inner_state)
    return new_updates, record_step(state, new_inner, leaf_finite, step_finite,
                                    max_consecutive=max_consecutive, checked=checked,
                                    spike=spike, hyperparams_finite=hyperparams_finite)

  return optax.GradientTransformationExtraArgs(init_fn, placement.through_boxes(update_fn))


