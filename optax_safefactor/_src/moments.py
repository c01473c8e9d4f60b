"""The factored second moment: state types, initialisation and the per-leaf update."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_safefactor._src import boxes, checks, numerics
from optax_safefactor._src.base import (
  WitnessedTransformation,
  keep_unless_skipped,
  unzip_leaf_results,
  zero_if_skipped,
)
from optax_safefactor._src.plan import (
  FactorPlan,
  FactorRulesFn,
  default_plan,
  plan_from_roles,
  plan_from_stat_shapes,
)
from optax_safefactor._src.sharding import full_like_param

DecayRateFn = Callable[[jax.Array, jax.typing.ArrayLike], jax.Array]


class FactoredMoment(NamedTuple):
  """Second moment of a factored leaf, kept with all of the leaf's axes (keepdims).

  Attributes:
    v_row: the leaf's shape with the column axes set to 1.
    v_col: the leaf's shape with the row axes set to 1.
  """

  v_row: jax.Array
  v_col: jax.Array


class FullMoment(NamedTuple):
  """Second moment of an unfactored leaf: one statistic per element."""

  v: jax.Array


Moment = FactoredMoment | FullMoment


def is_moment(x: Any) -> bool:
  return isinstance(x, (FactoredMoment, FullMoment))


class SafeFactoredState(NamedTuple):
  """State of :func:`scale_by_safe_factored_rms`.

  Attributes:
    count: number of steps taken (skipped steps are not counted).
    second_moment: one :class:`FactoredMoment` or :class:`FullMoment` per leaf.
  """

  count: jax.Array
  second_moment: Any


def power_decay(step: jax.Array, exponent: jax.typing.ArrayLike) -> jax.Array:
  """Adafactor's second-moment decay ``1 - (step + 1) ** -exponent``."""
  t = jnp.asarray(step, jnp.float32) + 1.0
  return 1.0 - t ** (-jnp.asarray(exponent, jnp.float32))


def second_moment_decay(
    count: jax.Array,
    decay_rate: jax.typing.ArrayLike,
    step_offset: jax.typing.ArrayLike,
    decay_rate_fn: DecayRateFn | None,
    beta2_cap: jax.typing.ArrayLike | None,
) -> jax.Array:
  """beta2 for this step, as a float32 scalar.

  The local step ``count - step_offset`` is clamped at 0: with a large offset the
  power schedule would otherwise raise a negative base to a fractional power.
  """
  local_step = jnp.maximum(
      jnp.asarray(count, jnp.int32) - jnp.asarray(step_offset, jnp.int32), 0
  )
  schedule = power_decay if decay_rate_fn is None else decay_rate_fn
  beta2 = jnp.asarray(schedule(local_step, decay_rate), jnp.float32)
  if beta2_cap is not None:
    beta2 = jnp.minimum(beta2, jnp.asarray(beta2_cap, jnp.float32))
  return beta2


def init_moment(
    param: jax.Array,
    plan: FactorPlan | None,
    state_dtype: numerics.DTypeLike | None,
    epsilon: jax.typing.ArrayLike,
) -> Moment:
  """Statistics for one leaf, filled with the epsilon floor rather than zeros.

  They are placed like the param, less the reduced axes (see ``sharding.py``).
  """
  dtype = numerics.resolve_state_dtype(state_dtype, param.dtype)
  floor = numerics.positive_floor(epsilon, dtype)
  if plan is None or not plan.factored:
    return FullMoment(full_like_param(param, param.shape, floor, dtype))
  return FactoredMoment(
      full_like_param(param, plan.row_stat_shape(param.shape), floor, dtype),
      full_like_param(param, plan.col_stat_shape(param.shape), floor, dtype),
  )


def _blend(old: jax.Array, new_mean: jax.Array, beta2: jax.Array) -> jax.Array:
  return beta2 * old.astype(new_mean.dtype) + (1.0 - beta2) * new_mean


class ScaleFactors(NamedTuple):
  """The small arrays whose product scales one leaf's gradient (never stored full-size).

  Attributes:
    factors: one array for an unfactored leaf; row- and column-shaped arrays for a
      factored one, whose product is capped at ``cap``.
    cap: the rsqrt of the floor, or ``None`` for an unfactored leaf.
    poison: ``None``, or 0 where the statistics are finite and NaN where they are
      not, added after the cap (a minimum may clamp a NaN away on some backends).
  """

  factors: tuple[jax.Array, ...]
  cap: jax.Array | None
  poison: jax.Array | None


def update_moment(
    grad: jax.Array,
    moment: Moment,
    beta2: jax.Array,
    epsilon: jax.typing.ArrayLike,
    *,
    witness_in_scaled: bool = False,
) -> tuple[Moment, ScaleFactors, jax.Array]:
  """One leaf's new statistics, and the factors that scale its gradient by their rsqrt.

  Args:
    grad: the gradient, in its own dtype (it is upcast to the compute dtype here).
    moment: the leaf's current statistics.
    beta2: this step's decay, a scalar.
    epsilon: added to ``|grad|**2``; also the floor under every rsqrt.
    witness_in_scaled: the caller reduces the scaled gradient anyway (the clipping
      RMS) and checks that reduction: then a non-finite statistic poisons the scale
      with NaN instead of being reduced on its own, which saves a reduction (a
      kernel) per statistic.

  Returns:
    ``(new_moment, scale, finite)``: the new statistics in the state dtype; the
    :class:`ScaleFactors` for :func:`scale_by_factors`; and a scalar bool, True
    exactly when the new statistics are finite (always True with
    ``witness_in_scaled``, where the poison carries the verdict instead). The scaled
    gradient is then finite too: it is at most ``|grad| / sqrt(floor)``, and
    ``|grad|**2`` is part of the statistics.
  """
  ct = numerics.compute_dtype(grad.dtype)
  stat_dtype = numerics.real_dtype(ct)
  beta2 = beta2.astype(stat_dtype)
  floor = numerics.positive_floor(epsilon, stat_dtype)
  eps = jnp.asarray(epsilon, stat_dtype)

  if isinstance(moment, FullMoment):
    new_v = _blend(moment.v, numerics.abs_sq(grad.astype(ct)) + eps, beta2).astype(moment.v.dtype)
    # Read back what is stored, so this step uses exactly the statistics the next one sees.
    stored = new_v.astype(stat_dtype)
    factor = jax.lax.rsqrt(jnp.maximum(stored, floor))
    if witness_in_scaled:
      scale = ScaleFactors((factor,), None, numerics.nan_unless_finite(stored))
      return FullMoment(new_v), scale, jnp.array(True)
    return FullMoment(new_v), ScaleFactors((factor,), None, None), numerics.all_finite(new_v)

  plan = plan_from_stat_shapes(grad.shape, moment.v_row.shape, moment.v_col.shape)
  # Each reduction gets its own view of the gradient: a square shared by the two
  # would be written to a full-size temporary and read back twice, where separate
  # ones fuse into their reductions, which then read the gradient itself.
  # (It is taken before the upcast, which would otherwise be shared the same way.)
  grad_for_rows, grad_for_cols = jax.lax.optimization_barrier((grad, grad))
  row_mean = jnp.mean(numerics.abs_sq(grad_for_rows.astype(ct)), plan.col_axes,
                      keepdims=True) + eps
  col_mean = jnp.mean(numerics.abs_sq(grad_for_cols.astype(ct)), plan.row_axes,
                      keepdims=True) + eps
  new_row = _blend(moment.v_row, row_mean, beta2).astype(moment.v_row.dtype)
  new_col = _blend(moment.v_col, col_mean, beta2).astype(moment.v_col.dtype)
  row = jnp.maximum(new_row.astype(stat_dtype), floor)
  col = jnp.maximum(new_col.astype(stat_dtype), floor)
  normaliser = jnp.mean(row, plan.row_axes, keepdims=True)
  # rsqrt(v_row * v_col / mean(v_row)), from row- and column-sized factors; the cap is
  # the rsqrt of the floor, reached only where the factored estimate underflows.
  factors = (jnp.sqrt(normaliser / row), jax.lax.rsqrt(col))
  cap = jax.lax.rsqrt(floor)
  new_moment = FactoredMoment(new_row, new_col)
  if witness_in_scaled:
    # The normaliser sums every row statistic, so it is non-finite when one of them
    # is (all are non-negative: no cancellation); the columns poison their own factor.
    poison = (numerics.nan_unless_finite(normaliser)
              + numerics.nan_unless_finite(new_col.astype(stat_dtype)))
    return new_moment, ScaleFactors(factors, cap, poison), jnp.array(True)
  finite = numerics.all_finite(new_row) & numerics.all_finite(new_col)
  return new_moment, ScaleFactors(factors, cap, None), finite


def scale_by_factors(grad: jax.Array, scale: ScaleFactors) -> jax.Array:
  """``grad`` times the product of the factors (capped), plus the poison."""
  product = scale.factors[0]
  for factor in scale.factors[1:]:
    product = product * factor
  if scale.cap is not None:
    product = jnp.minimum(product, scale.cap)
  if scale.poison is not None:
    product = product + scale.poison
  return grad * product.astype(grad.dtype)


def gate_factors(step_finite: jax.Array | None, scale: ScaleFactors) -> ScaleFactors:
  """The factors, zeroed when the step is skipped (small arrays only).

  Without a verdict they pass through an optimization barrier instead, so either
  way they are new values: XLA cannot merge a scaling by them with one by the
  original factors.
  """
  if step_finite is None:
    return jax.lax.optimization_barrier(scale)
  return ScaleFactors(
      tuple(jnp.where(step_finite, f, jnp.zeros((), f.dtype)) for f in scale.factors),
      scale.cap,
      None if scale.poison is None else jnp.where(step_finite, scale.poison, 0),
  )


def scale_by_moment(
    grad: jax.Array,
    moment: Moment,
    beta2: jax.Array,
    epsilon: jax.typing.ArrayLike,
) -> tuple[jax.Array, Moment, jax.Array]:
  """One leaf's step: :func:`update_moment`, then :func:`scale_by_factors`.

  Returns:
    ``(scaled, new_moment, finite)``, as :func:`update_moment` describes.
  """
  new_moment, scale, finite = update_moment(grad, moment, beta2, epsilon)
  return scale_by_factors(grad, scale), new_moment, finite


def keep_moments_unless_skipped(step_finite, new_moments: Any, old_moments: Any) -> Any:
  return jax.tree.map(partial(keep_unless_skipped, step_finite), new_moments, old_moments)


def check_moment_fits(path: checks.KeyPath, moment: Moment, grad: jax.Array) -> None:
  for name, stat in moment._asdict().items():
    checks.check_stat_fits(path, name, stat, grad)


def factor_plan_fn(
    factored: bool, min_dim_size_to_factor: Any, factor_rules: FactorRulesFn | None = None
) -> Callable[[checks.KeyPath, jax.Array], FactorPlan | None]:
  """The plan for each ``(path, param)``: the rule's roles, else the heuristic."""
  if not numerics.is_concrete(min_dim_size_to_factor):
    raise TypeError(
        "min_dim_size_to_factor is traced inside init; it decides state shapes, so give it "
        "as a Python int (with optax.inject_hyperparams pass "
        "static_args=('min_dim_size_to_factor',) or call init outside jax.jit)"
    )
  min_size = int(min_dim_size_to_factor)

  def plan_for(path: checks.KeyPath, param: jax.Array) -> FactorPlan | None:
    shape = tuple(param.shape)
    roles = None if factor_rules is None else factor_rules(path, shape)
    if roles is None:
      return default_plan(shape, factored, min_size)
    return plan_from_roles(shape, roles, min_size, factored, where=checks.path_name(path))

  return plan_for


def init_second_moment(params: Any, plan_for, state_dtype, epsilon) -> Any:
  """The tree of per-leaf statistics for ``params``."""

  def init_leaf(path, param):
    value = boxes.unbox(param)
    checks.check_inexact_leaf(path, value)
    moment = init_moment(value, plan_for(path, value), state_dtype, epsilon)
    return type(moment)(*(boxes.rebox_like(param, stat) for stat in moment))

  return jax.tree_util.tree_map_with_path(init_leaf, params, is_leaf=boxes.is_box)


def check_update_inputs(grads: Any, second_moment: Any, params: Any | None) -> None:
  """Static checks of ``update``'s inputs, with the parameter path in every message."""
  if params is not None:
    checks.check_same_structure(grads, params, "params")
    jax.tree_util.tree_map_with_path(checks.check_grad_matches_param, grads, params)
  moment_tree = jax.tree.map(lambda _: 0, second_moment, is_leaf=is_moment)
  checks.check_same_structure(grads, moment_tree, "the optimizer state")
  jax.tree_util.tree_map_with_path(
      lambda path, grad, moment: check_moment_fits(path, moment, grad), grads, second_moment
  )


def scale_by_safe_factored_rms(
    factored: bool = True,
    decay_rate: jax.typing.ArrayLike = 0.8,
    step_offset: jax.typing.ArrayLike = 0,
    min_dim_size_to_factor: int = 128,
    epsilon: jax.typing.ArrayLike = 1e-30,
    decay_rate_fn: DecayRateFn | None = None,
    *,
    state_dtype: str | None = None,
    beta2_cap: jax.typing.ArrayLike | None = None,
    factor_rules: FactorRulesFn | None = None,
) -> WitnessedTransformation:
  r"""Scale updates by a factored estimate of the gradient RMS, safely (as in Adafactor).

  A drop-in for :func:`optax.scale_by_factored_rms` (same positional arguments)
  that keeps its statistics in float32 whatever the parameter dtype, starts them
  at an epsilon floor, floors every rsqrt, clamps the local step at 0 and stores
  the factored statistics with keepdims shapes, so the update reads the factored
  axes off the state and tall and wide matrices are treated alike.

  For a factored leaf with row axes :math:`R` and column axes :math:`C`,

  .. math::
    r_t = \beta_t r_{t-1} + (1-\beta_t)\,\mathrm{mean}_C(g^2+\epsilon), \quad
    c_t = \beta_t c_{t-1} + (1-\beta_t)\,\mathrm{mean}_R(g^2+\epsilon), \quad
    u = g \big/ \sqrt{r_t c_t / \mathrm{mean}_R(r_t)},

  with :math:`\beta_t = 1 - (t+1)^{-\text{decay\_rate}}`.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_safefactor as osf
    >>> tx = osf.scale_by_safe_factored_rms(min_dim_size_to_factor=2)
    >>> params = {"w": jnp.ones((3, 2), jnp.float16)}
    >>> state = tx.init(params)
    >>> state.second_moment["w"].v_row.shape, state.second_moment["w"].v_row.dtype
    ((1, 2), dtype('float32'))
    >>> updates, state = tx.update({"w": jnp.zeros((3, 2), jnp.float16)}, state, params)
    >>> bool(jnp.isfinite(updates["w"]).all())
    True

  Args:
    factored: whether to factor the second moment of leaves of rank 2 and more.
    decay_rate: exponent of the power decay schedule of beta2.
    step_offset: steps before this count use the first step's decay (fine-tuning).
    min_dim_size_to_factor: factor only when both factored axes have this size.
    epsilon: added to the squared gradient; also the floor under every rsqrt
      (never below the compute dtype's smallest normal).
    decay_rate_fn: ``(step, decay_rate) -> beta2``; ``None`` for the power decay.
    state_dtype: dtype name of the statistics; ``None`` for float32 (float64 for
      float64 parameters).
    beta2_cap: an upper bound on beta2 (0.999 in big_vision), or ``None``.
    factor_rules: per-axis roles, as for :func:`safefactor`.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs`.

  References:
    Shazeer et al, `Adafactor: Adaptive Learning Rates with Sublinear Memory
    Cost <https://arxiv.org/abs/1804.04235>`_, 2018
  """

  def init_fn(params):
    plan_for = factor_plan_fn(factored, min_dim_size_to_factor, factor_rules)
    return SafeFactoredState(
        count=jnp.zeros([], jnp.int32),
        second_moment=init_second_moment(params, plan_for, state_dtype, epsilon),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    check_update_inputs(updates, state.second_moment, params)
    beta2 = second_moment_decay(state.count, decay_rate, step_offset, decay_rate_fn, beta2_cap)

    def update_leaf(grad, moment):
      scaled, new_moment, finite = scale_by_moment(
          grad.astype(numerics.compute_dtype(grad.dtype)), moment, beta2, epsilon
      )
      return numerics.saturating_cast(scaled, grad.dtype), new_moment, finite

    results = jax.tree.map(update_leaf, updates, state.second_moment)
    new_updates, new_moments, finite = unzip_leaf_results(updates, results, 3)

    def finish(step_finite):
      return jax.tree.map(partial(zero_if_skipped, step_finite), new_updates), SafeFactoredState(
          keep_unless_skipped(step_finite, optax.safe_increment(state.count), state.count),
          keep_moments_unless_skipped(step_finite, new_moments, state.second_moment),
      )

    return finite, finish

  return WitnessedTransformation(init_fn, update_fn)

