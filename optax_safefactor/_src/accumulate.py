"""Gradient accumulation that leaves a non-finite micro-batch out, and counts it.

``optax.MultiSteps`` resets its accumulator with ``(1 - emit) * acc``; ``0 * NaN`` is
NaN, so one bad micro-batch poisons every later group. Here a micro-batch is added
only when the sum stays finite, a finished group's sum is set aside by a select, never
by a product, and the skip is counted by the guard's own counters
(``counters.count_call``), so that :func:`skipped_steps` and the reports see it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_safefactor._src import (
    checks,
    counters,
    hyperparams,
    numerics,
    placement,
    state_checks,
    trees,
    wrapped_update,
    xla_hints,
)
from optax_safefactor._src.argument_names import explain_unknown_arguments

EveryK = int | jax.Array | Callable[[jax.Array], Any]


class AccumulationState(NamedTuple):
  """State of :func:`accumulate_gradients`.

  Attributes:
    inner_state: the inner transformation's state, as of its last update.
    accumulator: per leaf, the sum of the current group's finite micro-batch gradients,
      in float32 (float64 for float64 params), placed and sharded like the param.
      While ``accumulated`` is 0 it still holds the last group's sum, which the next
      micro-batch ignores: clearing it after the step would overwrite what the step
      reads, and XLA would copy it first.
    accumulated: the number of finite micro-batches in the current group (int32).
    applied_steps: the number of times the inner transformation was updated (int32);
      the argument of an ``every_k`` schedule.
    micro_batches: the skipped micro-batches, counted as a guard counts skipped steps.
  """

  inner_state: Any
  accumulator: Any
  accumulated: jax.Array
  applied_steps: jax.Array
  micro_batches: counters.MicroBatchCounters


def _group_size(every_k: EveryK, applied_steps: jax.Array) -> jax.Array:
  """How many finite micro-batches make this group: a schedule's value truncated to an
  integer and floored at 1 (1 for a non-finite value, whose cast XLA leaves undefined)."""
  size = jnp.asarray(hyperparams.scheduled_value("every_k", every_k(applied_steps))
                     if callable(every_k) else every_k)
  if jnp.issubdtype(size.dtype, jnp.floating):
    size = jnp.where(jnp.isfinite(size), size, 1)
  return jnp.maximum(size.astype(jnp.int32), 1)


def _accumulator_like(param: Any) -> Any:
  leaf = placement.leaf_placement(param)
  return leaf.full(leaf.value.shape, 0, numerics.compute_dtype(leaf.value.dtype))


def _mean(summed: jax.Array, grad: jax.Array, count: jax.Array) -> jax.Array:
  """``summed * (1 / count)`` in the accumulator's dtype, handed over in the gradient's dtype.

  A multiplication by the scalar reciprocal, written out: XLA rewrites a division by a
  broadcast scalar into it in some programs and not in others (a sharded one, say), so
  spelling it out gives every compilation, on every mesh, the same bits. It is exact
  for a power-of-two count.
  """
  reciprocal = 1 / count.astype(summed.dtype)
  return (summed * reciprocal).astype(grad.dtype)




@explain_unknown_arguments
def accumulate_gradients(
    inner: optax.GradientTransformation, every_k: EveryK
) -> optax.GradientTransformationExtraArgs:
  r"""Accumulate ``every_k`` finite micro-batches, then step ``inner`` on their mean.

  Where ``optax.MultiSteps`` lets one NaN micro-batch poison its accumulator for good,
  this leaves a non-finite micro-batch out, and counts it. For the finite gradients
  :math:`g_1, \dots, g_k` of a group (:math:`k` = ``every_k``),

  .. math::

    \bar g = \mathrm{cast}_{g}\Big(\frac{1}{k} \sum_{i=1}^{k} \mathrm{f32}(g_i)\Big)

  summed in float32 (float64 for float64 params) and handed to ``inner`` in the
  gradients' own dtype. The micro-batch that completes a group returns
  ``inner.update(ḡ, ...)``'s updates; every other one returns zeros and leaves
  ``inner``'s state alone.

  A micro-batch with a NaN or Inf, or a finite one whose addition would overflow the
  accumulator, is left out: the group waits for the next finite micro-batch, so a
  run with a poisoned micro-batch equals, bit for bit, the run without it (all but
  the counters). It is counted as a skipped update call: :func:`skipped_steps`
  includes it, and :func:`nonfinite_report` and :func:`nonfinite_summary` list it
  under micro-batches, naming the leaves. The accumulator never holds a non-finite
  value; the decision is one flag over every leaf, so on a mesh every device agrees.

  The state adds one accumulator the size of the params, placed and sharded like
  them (flax boxes included), to ``inner``'s own. ``inner.update`` runs only on the
  micro-batch that completes a group (under ``lax.cond``; measured against computing
  and selecting it in ``docs/benchmarks.md``).

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_safefactor as osf
    >>> tx = osf.accumulate_gradients(osf.safefactor(0.1), every_k=2)
    >>> params = {"w": jnp.ones((2, 3))}
    >>> state = tx.init(params)
    >>> for value in (1.0, jnp.nan, 3.0):  # the NaN micro-batch is left out
    ...   updates, state = tx.update({"w": jnp.full((2, 3), value)}, state, params)
    >>> int(state.applied_steps), int(osf.skipped_steps(state))
    (1, 1)
    >>> osf.nonfinite_report(state)["nonfinite_micro_batches/params['w']"]
    1
    >>> print(osf.nonfinite_summary(state))  # doctest: +NORMALIZE_WHITESPACE
    1 skipped in total; guard0 (opt_state.inner_state): no skipped steps in 1 step;
    accumulation (opt_state.micro_batches): skipped 1 of 3 micro-batches (0 in a row);
    non-finite: params['w'] x1 (last at micro-batch 1)

  Args:
    inner: any optax transformation; it sees the mean of each group.
    every_k: the number of finite micro-batches per step: a positive int (or an
      integer scalar array, as ``optax.inject_hyperparams`` passes it, so that it can
      change between steps without a recompile), or a schedule of the number of steps
      applied so far (as ``every_k_schedule`` in ``optax.MultiSteps``), whose value is
      truncated to an integer and floored at 1 (2.5 groups 2 micro-batches; NaN or Inf,
      1).

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` whose state is an
    :class:`AccumulationState`; extra arguments are passed on to ``inner`` on the
    micro-batch that completes a group, the only one that steps it (a spike rule's
    ``value=`` is the one given there: pass the group's mean loss with it).

  Raises:
    TypeError: at construction, when ``inner`` is not a transformation (the factory
      ``osf.safefactor`` rather than ``osf.safefactor(1e-3)``, say); in ``init`` and
      ``update``, when a param or grad leaf is not a floating array; in ``update``,
      when the state is not this transformation's.
    ValueError: when ``every_k`` is neither a positive int (of at most ``2**31 - 1``) nor
      a schedule; in ``update``, when a grad's shape or the grads' structure differs from
      the params'.
  """
  checks.check_transformation(inner, "accumulate_gradients")
  if not callable(every_k):
    # An int, or an integer scalar array: optax.inject_hyperparams hands every_k over as
    # one (a tracer inside a jitted update, which cannot be judged and is taken as it is).
    checks.check_positive_int(every_k, "every_k", meaning=" (or a schedule)")
    # The micro-batches are counted in int32.
    if not isinstance(every_k, jax.core.Tracer) and every_k > np.iinfo(np.int32).max:
      raise ValueError(f"every_k must be at most 2**31 - 1 (an int32 count), got {every_k!r}")
  inner = optax.with_extra_args_support(inner)

  def init_fn(params, *misplaced):
    checks.check_init_arguments(misplaced)
    params = placement.numpy_as_jax(params)
    # A mask inside (accumulate_gradients(optax.masked(...))) still hands every leaf to
    # the accumulator: the mask goes around it.
    checks.check_init_params(params, exclude=(
        "accumulate_gradients sums every leaf it is given, so leave it out around it: "
        "optax.masked(osf.accumulate_gradients(tx, every_k), mask), or "
        f"optax.multi_transform, {checks.OR_LEAVE_OUT}"))
    return AccumulationState(
        inner_state=inner.init(params),
        accumulator=jax.tree.map(_accumulator_like, params, is_leaf=placement.is_box),
        accumulated=jnp.zeros([], jnp.int32),
        applied_steps=jnp.zeros([], jnp.int32),
        micro_batches=counters.init_micro_batch_counters(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    state_checks.check_state_type(state, AccumulationState, updates, "accumulate_gradients")
    state_checks.check_counters(state, ("accumulated", "applied_steps"))
    state_checks.check_counters(state.micro_batches, counters.COUNTER_FIELDS)
    checks.check_same_structure(updates, state.accumulator, "the accumulator")
    jax.tree_util.tree_map_with_path(
        lambda path, grad: checks.check_param_leaf(path, grad, "grad"), updates)
    # The accumulator has its param's shape: a grad of another shape would broadcast
    # into it, or fail there without a path. Checked even when params are not given.
    jax.tree_util.tree_map_with_path(checks.check_grad_shape, updates, state.accumulator)
    if params is not None:
      # Any dtype: grads may be wider than their params (the inner transformation decides).
      checks.check_update_inputs(updates, params, any_dtype=True)
    grads = updates
    count = state.accumulated + 1
    starts_group = state.accumulated == 0

    def add(acc, grad):
      # A new group ignores the last group's sum left in the accumulator.
      base = jnp.where(starts_group, jnp.zeros((), acc.dtype), acc)
      return base + grad.astype(acc.dtype)

    # The verdict: a NaN or Inf gradient, or a finite one that overflows the sum, makes
    # the sum non-finite. One flag for every leaf (and, on a mesh, every device).
    leaf_finite = trees.flag_vector(jax.tree.leaves(jax.tree.map(
        lambda acc, grad: xla_hints.finite_by_sum(add(acc, grad)), state.accumulator, grads)))
    finite = xla_hints.computed_once([leaf_finite])
    emit = finite & (count >= _group_size(every_k, state.applied_steps))
    # A select, never ``(1 - emit) * acc``: a non-finite sum is never written. The new
    # accumulator is written in place of the old one and is what the step reads, so
    # nothing overwrites it afterwards (which would need a copy).
    accumulator = jax.tree.map(
        lambda acc, grad: jnp.where(finite, add(acc, grad), acc), state.accumulator, grads)

    def step_inner(accumulator, inner_state):
      mean = jax.tree.map(partial(_mean, count=count), accumulator, grads)
      new_updates, new_inner = wrapped_update.update(inner, "accumulate_gradients", mean,
                                                     inner_state, params, **extra_args)
      # The held state is the old one: keep each leaf's dtype so both agree.
      new_inner = jax.tree.map(lambda new, old: jnp.asarray(new, jnp.asarray(old).dtype),
                               new_inner, inner_state)
      return new_updates, new_inner

    # inner steps only on the micro-batch that completes a group, under lax.cond: the
    # other micro-batches pay for the sum alone (MultiSteps computes inner's step on
    # every micro-batch and selects it away).
    update_shapes = jax.eval_shape(step_inner, accumulator, state.inner_state)[0]

    def hold_inner(accumulator, inner_state):
      del accumulator
      # zeros_like of the shapes keeps an explicit mesh's sharding in the type.
      return jax.tree.map(jnp.zeros_like, update_shapes), inner_state

    new_updates, new_inner = jax.lax.cond(emit, step_inner, hold_inner, accumulator,
                                          state.inner_state)

    return new_updates, AccumulationState(
        inner_state=new_inner,
        accumulator=accumulator,
        accumulated=jnp.where(emit, 0, jnp.where(finite, count, state.accumulated)),
        applied_steps=jnp.where(emit, optax.safe_increment(state.applied_steps),
                                state.applied_steps),
        micro_batches=counters.count_call(state.micro_batches, leaf_finite, finite),
    )

  return optax.GradientTransformationExtraArgs(init_fn, placement.through_boxes(update_fn))
