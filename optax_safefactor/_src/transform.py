"""The Adafactor transformation over a tree: plans, checks, the two halves, the guard.

``adafactor(hyperparams)`` is the one machinery behind both public factories. Its
``update`` goes down the layers once: static checks (``checks``), this step's
hyperparameter values, per leaf the first half of the step (``kernel.leaf_scaling``),
the step's skip verdict from the leaves' flags, per leaf the second half
(``kernel.leaf_update``), and the guard's counters (``guard.record_step``).
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_safefactor._src import (
  checks,
  counters,
  guard,
  kernel,
  numerics,
  packing,
  placement,
  schedules,
  spikes,
  state_checks,
  trees,
  unit_order,
  user_warnings,
  write_back,
  xla_hints,
)
from optax_safefactor._src.hyperparams import Hyperparams
from optax_safefactor._src.plan import Planner, warn_if_misspelt
from optax_safefactor._src.trees import flag_vector, keep_unless_skipped, unzip_leaf_results


class AdafactorState(NamedTuple):
  """State of :func:`safefactor`'s Adafactor step and of :func:`scale_by_safe_factored_rms`.

  Attributes:
    count: number of applied steps (skipped steps are not counted); drives the beta2
      and learning-rate schedules.
    second_moment: one :class:`FactoredMoment` or :class:`FullMoment` per leaf.
    momentum: the first moment per leaf, or ``None`` when momentum is off.
    compensation: with ``param_rounding="kahan"``, per bfloat16/float16 param what
      rounding lost, in the param's dtype and placed like it (``None`` for wider
      params); ``None`` in the other modes.
  """

  count: jax.Array
  second_moment: Any
  momentum: Any = None
  compensation: Any = None


_NOTHING_DECAYED = (
    "weight_decay_mask is False for every param, so no param is decayed (under "
    "optax.inject_hyperparams a mask function must be among static_args, "
    "static_args=('weight_decay_mask',), or it is called with the step count)")


def _decay_masks(weight_decay_mask: Any, params: Any) -> Any:
  """Per-leaf weight-decay mask (True, False or a bool array); a mask may be a prefix tree."""
  if weight_decay_mask is None:
    return jax.tree.map(lambda _: True, params)
  mask = weight_decay_mask(params) if callable(weight_decay_mask) else weight_decay_mask
  trees.check_prefix_of(mask, params, "weight_decay_mask", leaf="False for a param not decayed")
  masks = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), mask, params)
  jax.tree_util.tree_map_with_path(trees.check_decay_mask, masks, params)
  return masks


def _check_64_bit_state(hp: Hyperparams) -> None:
  """A float64 (or complex128) state asked for by name needs 64-bit JAX: without it JAX
  makes every such array float32, and the first update refused that state as one made
  for another optimizer."""
  if jax.config.jax_enable_x64:
    return
  for name in ("state_dtype", "dtype_momentum"):
    value = getattr(hp, name)
    if (value is None or (isinstance(value, str) and value == numerics.AT_LEAST_FLOAT32)
        or isinstance(value, (jax.Array, jax.core.Tracer))):
      continue
    if numerics.real_dtype(jnp.dtype(value)).itemsize >= 8:
      raise ValueError(
          f"{name}={value!r} needs 64-bit JAX, which is off: JAX would make the state "
          "float32. Turn it on first (jax.config.update('jax_enable_x64', True)), or keep "
          "the state in float32")


def adafactor(hp: Hyperparams) -> optax.GradientTransformationExtraArgs:
  """The transformation for validated ``hp``; guarded when ``hp.skip_nonfinite_steps``."""
  planner = Planner(hp.factored, hp.min_dim_size_to_factor, hp.factor_rules)
  guarded = hp.skip_nonfinite_steps
  keeps_compensation = write_back.keeps_compensation(hp.param_rounding)
  rounds_onto_params = write_back.rounds_onto_params(hp.param_rounding)
  # What every leaf's step reduces over the whole leaf, beside a factored leaf's
  # statistics: inside jax.shard_map, a leaf split between devices is refused for them.
  whole_leaf = list(itertools.compress(
      ("its update's RMS clipping", "its parameter scale", "skip_spikes' gradient norm"),
      (hp.clipping_threshold is not None, hp.multiply_by_parameter_scale,
       hp.skip_spikes is not None)))

  def init_fn(params, *misplaced):
    checks.check_init_arguments(misplaced)
    _check_64_bit_state(hp)
    checks.check_not_a_state(params)
    checks.check_not_linen_variables(params)
    params = placement.numpy_as_jax(params)
    planned = []
    rounded = []  # (stored dtype, compute dtype) of what the write-back rounds

    def init_leaf(path, param):
      leaf = placement.leaf_placement(param)
      value = leaf.value
      checks.check_param_leaf(path, value, box=leaf.box)
      moment = kernel.init_moment(leaf, planner(path, value.shape), hp.state_dtype, hp.eps)
      planned.append((path, value.shape))
      momentum = None
      if hp.momentum is not None:
        dtype = numerics.momentum_dtype(hp.dtype_momentum, value.dtype)
        momentum = leaf.full(value.shape, 0, dtype)
      compensation = None
      if keeps_compensation and write_back.is_narrow(value.dtype):
        compensation = leaf.full(value.shape, 0, value.dtype)
      wide = numerics.compute_dtype(value.dtype)
      rounded.append((value.dtype, wide))
      if write_back.draws_bits(hp.param_rounding):
        # Stochastic rounding writes a narrow momentum and narrow statistics that way too.
        rounded.extend((x.dtype, wide) for x in jax.tree.leaves((moment, momentum)))
      return moment, momentum, compensation, value

    per_leaf = jax.tree_util.tree_map_with_path(init_leaf, params, is_leaf=placement.is_box)
    warn_if_misspelt(hp.factor_rules, params, planned)
    unused = write_back.nothing_to_round(hp.param_rounding, rounded,
                                         state_too=write_back.draws_bits(hp.param_rounding))
    if unused:
      user_warnings.warn(unused)
    reference = jax.tree.map(lambda _: 0, params, is_leaf=placement.is_box)
    second_moment, momentum, compensation, values = unzip_leaf_results(reference, per_leaf, 4)
    if hp.weight_decay_rate is not None:
      # A mask that does not fit the params fails here, not at the first step.
      masks = jax.tree.leaves(_decay_masks(hp.weight_decay_mask, values))
      if masks and all(mask is False or mask is np.False_ for mask in masks):
        user_warnings.warn(_NOTHING_DECAYED)
    state = AdafactorState(jnp.zeros([], jnp.int32), second_moment,
                           momentum if hp.momentum is not None else None,
                           compensation if keeps_compensation else None)
    if not guarded:
      return state
    spike_window = None if hp.skip_spikes is None else hp.spike_window
    return counters.init_guarded(state, values, spike_window, schedules.CHECKED_HYPERPARAMS)

  def update_fn(updates, state, params=None, **extra_args):
    expected = counters.SkipNonfiniteState if guarded else AdafactorState
    state_checks.check_state_type(state, expected, updates,
                            inner=AdafactorState if guarded else None)
    inner = state.inner_state if guarded else state
    state_checks.check_counters(inner, ("count",), safefactors=True)
    if guarded:
      state_checks.check_counters(state, counters.COUNTER_FIELDS, safefactors=True)
    checks.check_has_momentum(inner.momentum, hp.momentum)
    checks.check_has_compensation(inner.compensation, keeps_compensation, hp.param_rounding,
                                  updates)
    if params is None and hp.needs_params:
      raise ValueError(
          "safefactor needs params in update(grads, state, params): this optimizer has "
          f"{' and '.join(hp.params_read_by)}"
      )
    checks.check_update_against_state(updates, params, inner.second_moment,
                                      kernel.MOMENT_TYPES)
    if guarded:
      guard.check_spike_state(state, hp.skip_spikes, hp.spike_window)
    treedef = jax.tree.structure(updates)
    none_tree = treedef.unflatten([None] * treedef.num_leaves)
    masks = (_decay_masks(hp.weight_decay_mask, updates) if hp.weight_decay_rate is not None
             else none_tree)
    momentum_tree = none_tree if hp.momentum is None else inner.momentum

    # The dtype rules, worked out once per gradient dtype: the numbers, and the dtypes this
    # optimizer keeps the statistics and the momentum in.
    numbers_by_dtype = {}
    real_dtypes = set()

    def leaf_of(path, grad, moment, mask, momentum):
      numbers = numbers_by_dtype.get(grad.dtype)
      if numbers is None:
        numbers = numbers_by_dtype[grad.dtype] = (
            numerics.leaf_numbers(grad.dtype, hp.eps),
            numerics.resolve_state_dtype(hp.state_dtype, grad.dtype),
            numerics.momentum_dtype(hp.dtype_momentum, grad.dtype))
        real_dtypes.add(numbers_by_dtype[grad.dtype][0].real)
      numbers, state_dtype, kept_momentum_dtype = numbers
      factored = isinstance(moment, kernel.FactoredMoment)
      plan = planner(path, grad.shape, factored)
      reductions = ["its row and column statistics"] * factored + whole_leaf
      checks.check_leaf_state(path, grad, moment, plan.stat_shapes(grad.shape), momentum,
                              (state_dtype, f"state_dtype={hp.state_dtype!r}"),
                              (kept_momentum_dtype, f"dtype_momentum={hp.dtype_momentum!r}"),
                              whole_leaf=reductions)
      return kernel.Leaf(
          plan=plan,
          compute_dtype=numbers.compute,
          real_dtype=numbers.real,
          floor=numbers.floor,
          cap=numbers.cap,
          decays=hp.weight_decay_rate is not None and mask is not False,
          decay_mask=mask,
          rounding=(write_back.rounding_for(hp.param_rounding, hp.rounding_seed, inner.count,
                                            path) if rounds_onto_params else None),
      )

    leaves = jax.tree_util.tree_map_with_path(leaf_of, updates, inner.second_moment, masks,
                                              momentum_tree)
    if keeps_compensation and inner.compensation is not None:
      # (None: a state made without Kahan, for params none of which is narrow.)
      jax.tree_util.tree_map_with_path(checks.check_leaf_compensation, updates,
                                       inner.compensation)
    step = schedules.step_values(hp, inner.count, real_dtypes)
    params_tree = none_tree if params is None else params
    # Every tree below is read up to the structure of ``updates``: a per-leaf value
    # (a moment, a Leaf) arrives whole.
    compensation_tree = none_tree if inner.compensation is None else inner.compensation
    # The leaves, then the units the kernel steps: a leaf alone, or small leaves packed.
    columns = [treedef.flatten_up_to(tree) for tree in (
        updates, leaves, inner.second_moment, params_tree, momentum_tree, compensation_tree)]
    leaf_count = len(columns[0])
    if hp.pack_small_leaves and leaf_count >= packing.MIN_LEAVES_TO_PACK:
      units = packing.units(*columns, enabled=True)
      any_packed = any([unit.packed for unit in units])
      # A leaf stepped alone is its own unit: packing's bookkeeping is for packed groups.
      leaf_inputs = list(zip(*columns, strict=True))
      inputs = [[packing.gather(unit, column) for column in columns] if unit.packed
                else list(leaf_inputs[unit.index]) for unit in units]
    else:
      # Too few leaves for a packed group: packing's bookkeeping is not entered at all.
      units = [packing.Unit(packing.Group((index,), (tuple(grad.shape),)), False, index, (index,))
               for index, grad in enumerate(columns[0])]
      any_packed = False
      inputs = list(map(list, zip(*columns, strict=True)))
    if rounds_onto_params:
      roundings = write_back.with_stream_keys(
          [leaf.rounding for _, leaf, *_ in inputs],
          [write_back.streams_to_round(param, momentum, tuple(moment))
           for _, _, moment, param, momentum, _ in inputs])
      for unit_inputs, rounding in zip(inputs, roundings, strict=True):
        unit_inputs[1] = unit_inputs[1]._replace(rounding=rounding)
    if guarded:
      first_half = [kernel.leaf_scaling(hp, step, *unit_inputs) for unit_inputs in inputs]
    else:
      first_half, second_half = _unit_after_unit(hp, step, inputs)

    def per_leaf(values_by_unit, split):
      flat = [None] * leaf_count
      for unit, value in zip(units, values_by_unit, strict=True):
        if not unit.packed:
          flat[unit.index] = value
          continue
        for index, member in zip(unit.group.owned, split(unit, value), strict=True):
          flat[index] = member
      return flat

    # The flags as one vector in unit order (a packed unit brings one per row), then in
    # the leaves' order for the counters: one gather where packing reordered them.
    unit_order = [index for unit in units for index in unit.owned]
    finite_by_unit = flag_vector([packing.owned_rows(unit, finite) if unit.packed else finite
                                  for unit, (_, _, finite) in zip(units, first_half, strict=True)])
    step_finite = None
    if guarded:
      step_finite, finite_by_unit = xla_hints.skip_verdict(finite_by_unit,
                                                           step.traced_flags())
    leaf_finite = (finite_by_unit if unit_order == sorted(unit_order)
                   else finite_by_unit[np.argsort(unit_order)])
    spike, applied = None, step_finite
    if guarded and hp.skip_spikes is not None:
      # per_leaf splits packed units only: each row is its own leaf's sum.
      terms = per_leaf([scaling.square_terms for _, scaling, _ in first_half],
                       lambda unit, terms: [spikes.SquareSource("sum", value)
                                            for value in packing.rows(unit, terms.values)])
      spike = spikes.judge(state.spikes, spikes.sums_by_leaf(terms, hp.eps),
                           spikes.loss_given(extra_args), hp.skip_spikes,
                           step_finite)
      applied = xla_hints.computed_once([step_finite, ~spike.skip])

    if guarded:
      second_half = [
          kernel.leaf_update(hp, step, applied, grad, leaf, scaling, momentum, param,
                             compensation, new_moment, moment)
          for (grad, leaf, moment, param, momentum, compensation), (new_moment, scaling, _)
          in zip(inputs, first_half, strict=True)]

    row_index = xla_hints.row_indices(inner.count, packing.ROWS_PER_GROUP) if any_packed else []

    def tree_of(values_by_unit):
      return treedef.unflatten(per_leaf(
          values_by_unit, lambda unit, value: packing.scatter(unit, value, row_index)))

    # Per output (update, momentum, compensation, statistics), its value in each unit; with
    # nothing packed, the units are the leaves in order.
    by_output = list(zip(*second_half, strict=True)) or [()] * 4
    new_updates, new_first, new_compensation, kept_second = map(
        tree_of if any_packed else treedef.unflatten, by_output)
    new_inner = AdafactorState(
        keep_unless_skipped(applied, optax.safe_increment(inner.count), inner.count),
        kept_second,
        new_first if hp.momentum is not None else None,
        new_compensation if inner.compensation is not None else None,
    )
    if not guarded:
      return new_updates, new_inner
    return new_updates, guard.record_step(
        state, new_inner, leaf_finite, step_finite,
        max_consecutive=hp.max_consecutive_skips, checked=hp.checked, spike=spike,
        hyperparams_finite=step.flag_vector(),
    )

  return optax.GradientTransformationExtraArgs(init_fn, placement.through_boxes(update_fn))


def _unit_after_unit(hp: Hyperparams, step: schedules.StepValues,
                     inputs: list[list[Any]]) -> tuple[list[Any], list[Any]]:
  """Both halves of every unit's step without a guard: no verdict to wait for, so each
  unit's update follows its own scaling.

  On the compilers where it pays, a unit's gradient is read only once the unit before it
  has written its new momentum (:func:`unit_order.read_after`), or without momentum its
  update (:func:`unit_order.read_after_update`), so that each leaf's reads and writes come
  together rather than every leaf's scaling first and every update last.
  """
  first_half, second_half = [], []
  for grad, leaf, moment, param, momentum, compensation in inputs:
    if second_half and second_half[-1][1] is not None:
      update, written, *rest = second_half[-1]
      grad, written = unit_order.read_after(grad, written)
      second_half[-1] = (update, written, *rest)
    elif second_half:
      grad, moment = unit_order.read_after_update(grad, moment, second_half[-1][0])
    new_moment, scaling, finite = kernel.leaf_scaling(hp, step, grad, leaf, moment, param,
                                                      momentum, compensation)
    first_half.append((new_moment, scaling, finite))
    second_half.append(kernel.leaf_update(hp, step, None, grad, leaf, scaling, momentum, param,
                                          compensation, new_moment, moment))
  return first_half, second_half

