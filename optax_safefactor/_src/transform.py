"""The Adafactor transformation over a tree: plans, checks, the two halves, the guard.

``adafactor(hyperparams)`` is the one machinery behind both public factories. Its
``update`` goes down the layers once: static checks (``checks``), this step's
hyperparameter values, per leaf the first half of the step (``kernel.leaf_scaling``),
the step's skip verdict from the leaves' flags, per leaf the second half
(``kernel.leaf_update``), and the guard's counters (``guard.record_step``).
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_safefactor._src import (
    checks,
    guard,
    kernel,
    numerics,
    placement,
    rounding,
    trees,
    xla_hints,
)
from optax_safefactor._src.hyperparams import Hyperparams, momentum_dtype, value_at
from optax_safefactor._src.plan import Planner
from optax_safefactor._src.trees import keep_unless_skipped, unzip_leaf_results


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


def _decay_masks(weight_decay_mask: Any, params: Any) -> Any:
  """Per-leaf weight-decay mask (True, False or a bool array); a mask may be a prefix tree."""
  if weight_decay_mask is None:
    return jax.tree.map(lambda _: True, params)
  mask = weight_decay_mask(params) if callable(weight_decay_mask) else weight_decay_mask
  trees.check_prefix_of(mask, params, "weight_decay_mask")
  return jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), mask, params)


def _leaf_settings(hp: Hyperparams, count: jax.Array, beta2_for, path, grad, decay_mask):
  """One leaf's :class:`kernel.LeafSettings` for this step."""
  how = None
  if hp.param_rounding != "nearest":
    how = kernel.Rounding(hp.param_rounding, hp.rounding_seed, count,
                          rounding.path_hash(path))
  weight_decay_rate = None
  mask = None
  if hp.weight_decay_rate is not None and decay_mask is not False:
    weight_decay_rate = value_at(hp.weight_decay_rate, count)
    mask = None if decay_mask is True else jnp.asarray(decay_mask)
  return kernel.LeafSettings(
      beta2=beta2_for(numerics.real_dtype(numerics.compute_dtype(grad.dtype))),
      eps=hp.eps,
      learning_rate=None if hp.learning_rate is None else value_at(hp.learning_rate, count),
      clipping_threshold=hp.clipping_threshold,
      min_parameter_scale=hp.min_parameter_scale if hp.multiply_by_parameter_scale else None,
      max_parameter_scale=hp.max_parameter_scale,
      momentum=hp.momentum,
      weight_decay_rate=weight_decay_rate,
      weight_decay_mask=mask,
      negate=hp.negate_updates,
      rounding=how,
  )


def adafactor(hp: Hyperparams) -> optax.GradientTransformationExtraArgs:
  """The transformation for validated ``hp``; guarded when ``hp.skip_nonfinite_steps``."""
  planner = Planner(hp.factored, hp.min_dim_size_to_factor, hp.factor_rules)
  guarded = hp.skip_nonfinite_steps

  def init_fn(params):
    def init_leaf(path, param):
      value = placement.unbox(param)
      checks.check_param_leaf(path, value)
      return kernel.init_moment(param, planner(path, value.shape), hp.state_dtype, hp.eps)

    second_moment = jax.tree_util.tree_map_with_path(init_leaf, params, is_leaf=placement.is_box)
    first_moment = None
    if hp.momentum is not None:
      def zeros_like_param(param):
        value = placement.unbox(param)
        return placement.state_like(param, value.shape, 0,
                                    momentum_dtype(hp.dtype_momentum, value.dtype))

      first_moment = jax.tree.map(zeros_like_param, params, is_leaf=placement.is_box)
    compensation = None
    if hp.param_rounding == "kahan":
      def zeros_if_narrow(param):
        value = placement.unbox(param)
        if not rounding.needs_rounding(value.dtype, numerics.compute_dtype(value.dtype)):
          return None
        return placement.state_like(param, value.shape, 0, value.dtype)

      compensation = jax.tree.map(zeros_if_narrow, params, is_leaf=placement.is_box)
    if hp.weight_decay_rate is not None:
      # A mask that does not fit the params fails here, not at the first step.
      _decay_masks(hp.weight_decay_mask,
                   jax.tree.map(placement.unbox, params, is_leaf=placement.is_box))
    state = AdafactorState(jnp.zeros([], jnp.int32), second_moment, first_moment, compensation)
    return guard.init_guarded(state, params) if guarded else state

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    expected = guard.SkipNonfiniteState if guarded else AdafactorState
    checks.check_state_type(state, expected, updates)
    inner = state.inner_state if guarded else state
    if params is None and hp.needs_params:
      raise ValueError(
          "safefactor needs params in update(grads, state, params) when "
          "multiply_by_parameter_scale is on, weight_decay_rate is set or "
          "param_rounding is not 'nearest'"
      )
    checks.check_update_inputs(updates, params)
    checks.check_same_structure(
        updates, jax.tree.map(lambda _: 0, inner.second_moment, is_leaf=kernel.is_moment),
        "the optimizer state",
    )
    plans = jax.tree_util.tree_map_with_path(
        lambda path, grad, moment: planner(
            path, grad.shape, isinstance(moment, kernel.FactoredMoment)
        ),
        updates, inner.second_moment,
    )
    checks.check_state_fits_plans(updates, inner.second_moment, plans)

    beta2_by_dtype = {}

    def beta2_for(dtype):
      if dtype not in beta2_by_dtype:
        beta2_by_dtype[dtype] = kernel.second_moment_decay(
            inner.count, dtype, decay_rate=hp.decay_rate, decay_offset=hp.decay_offset,
            decay_rate_fn=hp.decay_rate_fn, beta2_cap=hp.beta2_cap,
        )
      return beta2_by_dtype[dtype]

    none_tree = jax.tree.map(lambda _: None, updates)
    params_tree = none_tree if params is None else params
    masks = (_decay_masks(hp.weight_decay_mask, updates) if hp.weight_decay_rate is not None
             else none_tree)
    settings = jax.tree_util.tree_map_with_path(
        partial(_leaf_settings, hp, inner.count, beta2_for), updates, masks)
    # Every tree below is read up to the structure of ``updates``: a per-leaf value
    # (a moment, a plan, settings) arrives whole.
    first_half = jax.tree.map(kernel.leaf_scaling, updates, inner.second_moment, params_tree,
                              plans, settings)
    new_second, scalings, leaf_finite = unzip_leaf_results(updates, first_half, 3)
    step_finite = xla_hints.computed_once(jax.tree.leaves(leaf_finite)) if guarded else None

    second_half = jax.tree.map(
        partial(kernel.leaf_update, step_finite), updates, scalings,
        none_tree if hp.momentum is None else inner.momentum, params_tree,
        none_tree if inner.compensation is None else inner.compensation, settings,
    )
    new_updates, new_first, new_compensation = unzip_leaf_results(updates, second_half, 3)
    new_inner = AdafactorState(
        keep_unless_skipped(step_finite, optax.safe_increment(inner.count), inner.count),
        jax.tree.map(partial(keep_unless_skipped, step_finite), new_second, inner.second_moment),
        new_first if hp.momentum is not None else None,
        new_compensation if inner.compensation is not None else None,
    )
    if not guarded:
      return new_updates, new_inner
    return new_updates, guard.record_step(
        state, new_inner, leaf_finite, step_finite,
        max_consecutive=hp.max_consecutive_skips, checked=hp.checked,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
