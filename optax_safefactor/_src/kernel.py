r"""The per-leaf Adafactor step, as small pure functions with their formulas.

For a leaf with gradient :math:`g`, params :math:`p`, row axes :math:`R`, column
axes :math:`C` and batch axes :math:`B` (separate slices), one step is

.. math::
  r_t &= \beta_t r_{t-1} + (1-\beta_t)\,\mathrm{mean}_C(|g|^2+\epsilon)
       &\text{(row statistic)}\\
  c_t &= \beta_t c_{t-1} + (1-\beta_t)\,\mathrm{mean}_R(|g|^2+\epsilon)
       &\text{(column statistic)}\\
  \hat v &= r_t\, c_t / \mathrm{mean}_R(r_t) &\text{(factored estimate)}\\
  s &= g / \sqrt{\hat v} &\text{(scaled gradient)}\\
  u &= \eta_t \cdot s / \max(1, \mathrm{rms}_{\setminus B}(s)/d)
        \cdot \mathrm{clip}(\mathrm{rms}_{\setminus B}(p), p_{\min}, p_{\max})
       &\text{(clipping, learning rate, parameter scale)}\\
  m_t &= \beta_1 m_{t-1} + (1-\beta_1)\,u,\quad u \leftarrow m_t &\text{(momentum)}\\
  u &\leftarrow u + \lambda_t p &\text{(decoupled weight decay)}\\
  \Delta &= \mathrm{cast}(-u) &\text{(the update, in the gradient's dtype)}

An unfactored leaf keeps one statistic per element, :math:`v_t = \beta_t v_{t-1} +
(1-\beta_t)(|g|^2+\epsilon)`. Arithmetic runs in the compute dtype (float32, or
float64 for float64 inputs) and statistics are stored in the state dtype.

The step is split in two halves around the skip decision: :func:`leaf_scaling`
produces the new statistics, the small arrays that scale the gradient, and whether
anything it saw was non-finite; :func:`leaf_update` then builds the update from the
gradient and those small arrays. No full-size array but an unfactored leaf's statistic
crosses from one half to the other, which is what keeps the step's temporaries small.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_safefactor._src import bit_streams, numerics, xla_hints
from optax_safefactor._src.hyperparams import Hyperparams
from optax_safefactor._src.placement import LeafPlacement
from optax_safefactor._src.plan import FactorPlan
from optax_safefactor._src.schedules import Decay, StepValues
from optax_safefactor._src.spikes import GRADIENT_KEPT_UP_TO, SquareSource
from optax_safefactor._src.trees import keep_unless_skipped, select, zero_if_skipped
from optax_safefactor._src.write_back import Rounding, is_narrow, store, write_back


class FactoredMoment(NamedTuple):
  """Second moment of a factored leaf, kept with all of the leaf's axes (keepdims).

  Attributes:
    v_row: the leaf's shape with the column axes set to 1.
    v_col: the leaf's shape with the row axes set to 1.
  """

  v_row: jax.Array
  v_col: jax.Array


class FullMoment(NamedTuple):
  """Second moment of an unfactored leaf: one statistic per element.

  Attributes:
    v: the leaf's shape: the moving average of ``g**2 + eps`` per element.
  """

  v: jax.Array


Moment = FactoredMoment | FullMoment


MOMENT_TYPES = (FactoredMoment, FullMoment)


def is_moment(x: Any) -> bool:
  return isinstance(x, MOMENT_TYPES)


# Squares -------------------------------------------------------------------------


def abs_sq(x: jax.Array) -> jax.Array:
  """``|x|**2`` as a real array (complex numbers get real second moments).

  >>> abs_sq(jnp.array([3.0 + 4.0j])).tolist()
  [25.0]
  """
  if jnp.iscomplexobj(x):
    return jnp.real(x) ** 2 + jnp.imag(x) ** 2
  return x * x


def sum_abs_sq(x: jax.Array, keep_axes: tuple[int, ...] = ()) -> tuple[jax.Array, int]:
  """Sum of ``|x|**2`` over every axis but ``keep_axes`` (keepdims when any are kept),
  and how many terms each sum has.

  A sum is finite exactly when the mean made from it is (its terms are not negative),
  and it has no size in it: the skip's finite flags read sums, so that leaves of
  different sizes share the flags' compiled kernels (a mean's ``1/n`` is a constant
  that makes each size's kernel its own).
  """
  axes = tuple(sorted(set(range(x.ndim)) - set(keep_axes)))
  count = math.prod(map(x.shape.__getitem__, axes))
  if x.size == 0:
    shape = tuple([1 if a in axes else size for a, size in enumerate(x.shape)])
    return jnp.zeros(shape if keep_axes else (), numerics.real_dtype(x.dtype)), count
  total = xla_hints.sum_of(abs_sq(x), axes)
  return (total if keep_axes else total.reshape(())), count


def mean_of(total: jax.Array, count: int) -> jax.Array:
  """``total / count``, as :func:`jax.numpy.mean` divides (by the count in the sum's
  dtype, so a count past int32 is fine); 0 for an empty sum."""
  return total / jnp.asarray(max(count, 1), total.dtype)


# Second moment ---------------------------------------------------------------------


def init_moment(leaf: LeafPlacement, plan: FactorPlan, state_dtype: Any, eps: Any) -> Moment:
  r"""Statistics for one leaf, filled with the floor :math:`\max(\epsilon, \text{tiny})`.

  Starting at the floor rather than at zero means no statistic is ever zero, even
  for a leaf whose gradient is always zero. A boxed param's statistics are boxed and
  placed like it, less the reduced axes.
  """
  shape = leaf.value.shape
  dtype = numerics.resolve_state_dtype(state_dtype, leaf.value.dtype)
  floor = numerics.positive_floor(eps, dtype)
  if not plan.factored:
    return FullMoment(leaf.full(shape, floor, dtype))
  return FactoredMoment(leaf.full(plan.row_stat_shape(shape), floor, dtype),
                        leaf.full(plan.col_stat_shape(shape), floor, dtype))


def _blend(old: jax.Array, new_mean: jax.Array, decay: Decay) -> jax.Array:
  r""":math:`\beta\,\mathrm{old} + (1-\beta)\,\mathrm{new}`, in the compute dtype."""
  return decay.beta2 * old.astype(new_mean.dtype) + decay.complement * new_mean


def update_second_moment(
    grad: jax.Array, moment: Moment, plan: FactorPlan, decay: Decay, eps: Any,
    compute_dtype: Any, how: Rounding | None = None, *, with_square_terms: bool = False,
    rows_are_leaves: bool = False,
) -> tuple[Moment, jax.Array | None]:
  r"""The new statistics: :math:`r_t = \beta r + (1-\beta)\,\mathrm{mean}_C(|g|^2+\epsilon)`,
  :math:`c_t = \beta c + (1-\beta)\,\mathrm{mean}_R(|g|^2+\epsilon)` (keepdims), or
  :math:`v_t = \beta v + (1-\beta)(|g|^2+\epsilon)` for an unfactored leaf; ``decay`` (:math:`\beta`
  and :math:`1-\beta`) is in the real compute dtype.

  With ``with_square_terms``, also where the spike rule reads :math:`\sum |g|^2` from
  (:class:`spikes.SquareSource`; for a factored leaf its row means; for unfactored leaves
  packed as rows, ``rows_are_leaves``, each row's sum), else ``None``."""
  ct = compute_dtype
  eps = jnp.asarray(eps, decay.beta2.dtype)
  if isinstance(moment, FullMoment):
    squares = abs_sq(grad.astype(ct))
    blended = _blend(moment.v, squares + eps, decay)
    terms = None
    if with_square_terms and rows_are_leaves:
      terms = SquareSource("sum", jnp.sum(squares, axis=tuple(range(1, squares.ndim))))
    elif with_square_terms:
      terms = (SquareSource("elements", grad) if grad.size <= GRADIENT_KEPT_UP_TO
               else SquareSource("sum", jnp.sum(squares)))
    return FullMoment(*store((blended,), moment.v.dtype, how,
                             (bit_streams.STREAM_STATISTICS,))), terms
  grad_for_rows, grad_for_cols = xla_hints.separate_reads(grad, grad)
  row_mean = jnp.mean(abs_sq(grad_for_rows.astype(ct)), plan.col_axes, keepdims=True) + eps
  col_mean = jnp.mean(abs_sq(grad_for_cols.astype(ct)), plan.row_axes, keepdims=True) + eps
  blended = (_blend(moment.v_row, row_mean, decay), _blend(moment.v_col, col_mean, decay))
  terms = (SquareSource("row_means", row_mean, grad.size // max(row_mean.size, 1))
           if with_square_terms else None)
  return FactoredMoment(*store(
      blended, moment.v_row.dtype, how,
      (bit_streams.STREAM_STATISTICS, bit_streams.STREAM_COLUMN_STATISTICS))), terms


class ScaleFactors(NamedTuple):
  r"""Small arrays whose product is :math:`1/\sqrt{\hat v}` (never stored full-size).

  Attributes:
    factors: ``(rsqrt(v),)`` for an unfactored leaf;
      :math:`(\sqrt{\mathrm{mean}_R(r)/r},\ 1/\sqrt{c})` for a factored one. Where the
      statistics are checked through the clipping, NaN where they are not finite: the
      unfactored factor, and the factored column factor, carry
      :func:`xla_hints.nan_unless_finite` of the statistics.
    cap: the largest product, :math:`1/\sqrt{\text{tiny}}`: reached only where the
      factored estimate :math:`\hat v` underflows the compute dtype; ``None`` for an
      unfactored leaf, whose statistic is floored directly. A scalar, or where the
      statistics are checked through the clipping, a column-shaped array of the cap
      (:func:`xla_hints.leaf_cap`).
  """

  factors: tuple[jax.Array, ...]
  cap: jax.Array | None


def scale_factors(
    moment: Moment, plan: FactorPlan, floor: jax.Array, cap: jax.Array, *, poison: bool,
    per_row: bool = False,
) -> tuple[ScaleFactors, jax.Array]:
  r"""The factors of :math:`1/\sqrt{\hat v}`, :math:`\hat v = r\,c/\mathrm{mean}_R(r)`.

  Every statistic is floored at ``floor`` (:math:`\max(\epsilon, \text{tiny})`, in the
  real compute dtype) first, so no rsqrt or division sees zero; ``cap`` bounds the
  factored product. The factors are computed from the stored statistics, so this step
  uses exactly what the next one will see.

  Returns:
    ``(factors, finite)``: ``finite`` is a scalar bool, True when the statistics are
    finite; with ``poison`` it is always True and the factors carry NaN instead, for
    a reduction that the caller checks anyway. With ``per_row`` (unfactored leaves
    packed as rows), one bool per row.
  """
  stat_dtype = floor.dtype
  if isinstance(moment, FullMoment):
    stored = moment.v.astype(stat_dtype)
    factor = numerics.rsqrt_of_floored(jnp.maximum(stored, floor))
    if poison:
      return ScaleFactors((factor + xla_hints.nan_unless_finite(stored),), None), jnp.array(True)
    return ScaleFactors((factor,), None), numerics.all_finite(moment.v, per_row=per_row)
  row = jnp.maximum(moment.v_row.astype(stat_dtype), floor)
  col = jnp.maximum(moment.v_col.astype(stat_dtype), floor)
  rows = math.prod([row.shape[a] for a in plan.row_axes])
  root_normaliser = jnp.sqrt(xla_hints.sum_of(row, plan.row_axes) / rows)
  # sqrt(normaliser) * rsqrt(row), not sqrt(normaliser / row): the quotient overflows to
  # inf (and so to the cap) for a row on the floor once the normaliser passes
  # max / floor (4 with eps=0, 3.4e8 with eps=1e-30), far from any underflow of the
  # estimate. Each factor here is at most sqrt(max) * rsqrt(tiny) < max: only the
  # product can pass the cap, and then it should.
  factors = (numerics.rsqrt_of_floored(row), root_normaliser * numerics.rsqrt_of_floored(col))
  if poison:
    # The normaliser sums every row statistic, so it is non-finite when one of them
    # is (all are non-negative: no cancellation), and so is its root: read from the
    # root, the normaliser has one reader and its reduction fuses with the root. The
    # columns poison their own factor.
    nan_if_bad = xla_hints.nan_unless_finite(root_normaliser,
                                             moment.v_col.astype(stat_dtype))
    # Carried by the column factor, so the product is NaN where a statistic is, with no
    # full-size add of its own, and jnp.minimum keeps that NaN against the cap. The cap
    # is column-shaped too, NaN there on the CPU (xla_hints.leaf_cap).
    return ScaleFactors((factors[0], factors[1] + nan_if_bad),
                        xla_hints.leaf_cap(cap, nan_if_bad)), jnp.array(True)
  finite = numerics.all_finite(moment.v_row) & numerics.all_finite(moment.v_col)
  return ScaleFactors(factors, cap), finite


def scale_by_factors(grad: jax.Array, scale: ScaleFactors) -> jax.Array:
  r""":math:`g \cdot \min(\prod \text{factors}, \text{cap})`."""
  product = scale.factors[0]
  for factor in scale.factors[1:]:
    product = product * factor
  if scale.cap is not None:
    product = jnp.minimum(product, scale.cap)
  return grad * product.astype(grad.dtype)


# Multipliers -----------------------------------------------------------------------


def clipped(multiplier: jax.Array | None, mean_square: jax.Array, threshold: Any) -> jax.Array:
  r""":math:`m/\max(1, \sqrt{\mathrm{mean}(s^2)}/d)` (``m`` is 1 when ``None``): the
  update's RMS before ``m`` is at most :math:`d`."""
  dtype = mean_square.dtype
  # Floored at the smallest normal, as every divisor: a positive threshold below it is 0
  # where the backend flushes subnormals (XLA's CPU and GPU), and one below float32's range
  # rounds to 0, so an all-zero gradient's RMS would be 0 / 0: NaN updates, with the
  # clipping's sum finite and nothing skipped.
  threshold = jnp.maximum(jnp.asarray(threshold, dtype), jnp.finfo(dtype).tiny)
  numerator = jnp.asarray(1, dtype) if multiplier is None else multiplier
  return numerator / jnp.maximum(jnp.asarray(1, dtype),
                                 numerics.root_of_squares(mean_square) / threshold)


def param_rms(param: jax.Array, batch_axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  r""":math:`\mathrm{rms}(p)` over all axes but the batch axes (keepdims), in ``param``'s
  (compute) dtype, and the sum of squares it comes from (finite exactly when the RMS is)."""
  total, count = sum_abs_sq(param, batch_axes)
  return numerics.root_of_squares(mean_of(total, count)), total


def parameter_scale(rms: jax.Array, min_scale: Any, max_scale: Any | None) -> jax.Array:
  r""":math:`\min(\max(\mathrm{rms}(p), p_{\min}), p_{\max})`.

  Written as a select so that NaN in the params stays NaN, where a ``maximum`` could
  clamp it away on some backends.
  """
  real_ct = rms.dtype
  min_scale = jnp.asarray(min_scale, real_ct)
  scale = select(~(rms <= min_scale), rms, min_scale)  # NaN stays NaN
  if max_scale is not None:
    scale = jnp.minimum(scale, jnp.asarray(max_scale, real_ct))
  return scale


def momentum_blend(update: jax.Array, momentum: jax.Array, beta1: jax.Array) -> jax.Array:
  r""":math:`m_t = \beta_1 m_{t-1} + (1-\beta_1)\,u`, in ``update``'s dtype."""
  beta1 = beta1.astype(update.dtype)
  return (1 - beta1) * update + beta1 * momentum.astype(update.dtype)


def decoupled_weight_decay(
    update: jax.Array, param: jax.Array, rate: jax.Array, mask: jax.Array | None
) -> jax.Array:
  r""":math:`u + \lambda p` (where ``mask`` is True, when one is given)."""
  decay = rate.astype(update.dtype) * param.astype(update.dtype)
  if mask is not None:
    decay = select(mask, decay, 0)
  return update + decay


# The two halves of a leaf's step -----------------------------------------------------


class Leaf(NamedTuple):
  """What one leaf's step needs besides its arrays, worked out once per leaf per trace.

  Attributes:
    plan: which axes are rows, columns and batch.
    compute_dtype: the dtype its arithmetic runs in (float32, float64, complex).
    real_dtype: the real counterpart of ``compute_dtype``: its statistics' arithmetic.
    floor, cap: the floor under its statistics and the cap on its factored scale, in
      ``real_dtype`` (see :class:`numerics.LeafNumbers`).
    decays: whether weight decay applies to the leaf at all.
    decay_mask: where it applies: True (everywhere) or an array of bools.
    rounding: how its wide values are written into narrow params and state, or ``None``
      for round to nearest.
    rows_are_leaves: the arrays are unfactored leaves packed as rows (``_src/packing.py``;
      the plan's batch axis is the row axis): the finite flag and the spike rule's sums
      are then one per row.
  """

  plan: FactorPlan
  compute_dtype: np.dtype
  real_dtype: np.dtype
  floor: jax.Array
  cap: jax.Array
  decays: bool
  decay_mask: Any
  rounding: Rounding | None
  rows_are_leaves: bool = False


class LeafScaling(NamedTuple):
  r"""What the first half hands the second (and the spike rule): small arrays only.

  Attributes:
    factors: the factors of :math:`1/\sqrt{\hat v}`.
    multiplier: clipping, learning rate and parameter scale, multiplied (or ``None``).
    square_terms: with spike skipping on, where :math:`\sum |g|^2` is read from.
  """

  factors: ScaleFactors
  multiplier: jax.Array | None
  square_terms: SquareSource | None = None


def leaf_scaling(
    hp: Hyperparams, step: StepValues, grad: jax.Array, leaf: Leaf, moment: Moment,
    param: jax.Array | None, momentum: jax.Array | None, compensation: jax.Array | None,
) -> tuple[Moment, LeafScaling, jax.Array]:
  """First half: new statistics, the scaling of the update, and whether all was finite.

  ``momentum`` and ``compensation`` are the old state that the second half blends into
  the update (``None`` when off); here they are only checked.

  Returns:
    ``(new_moment, scaling, finite)``. ``finite`` is a scalar bool, True exactly when
    the new statistics and each factor of the multiplier (the parameter scale's and the
    clipping's sums; the learning rate is the step's, checked once) are finite: the
    scaled gradient is at most ``|grad| / sqrt(floor)``, and ``|grad|**2`` is part of
    the statistics. The product of finite factors is not checked: the flags read the
    reductions alone (:func:`sum_abs_sq`), so an update overflows unseen only where a
    learning rate times the params' RMS passes the dtype's largest value. For leaves
    packed as rows (``leaf.rows_are_leaves``), one per row.
  """
  ct, real_ct, plan = leaf.compute_dtype, leaf.real_dtype, leaf.plan
  per_row = leaf.rows_are_leaves
  clipping = hp.clipping_threshold is not None
  decays = leaf.decays
  # A rounding write-back lands the update on a narrow param: it reads the param.
  reads_param_on_write_back = leaf.rounding is not None and is_narrow(param.dtype)
  new_moment, square_terms = update_second_moment(
      grad, moment, plan, step.decay[real_ct], hp.eps, ct, leaf.rounding,
      with_square_terms=hp.skip_spikes is not None, rows_are_leaves=per_row)
  # With clipping, the statistics' finiteness rides on the clipping reduction.
  factors, finite = scale_factors(new_moment, plan, leaf.floor, leaf.cap, poison=clipping,
                                  per_row=per_row)
  multiplier = None
  # The reductions whose finiteness the skip also reads, checked together at the end.
  checked = []

  def times(factor):
    return factor if multiplier is None else multiplier * factor

  # The old momentum is blended into the update, so NaN there must skip the step. With
  # clipping its finiteness rides on the clipping reduction, which reads the scaled
  # gradient anyway: no reduction of its own (tests/test_compile.py). A narrow momentum is
  # read on its own there: its upcast, shared with the blend, was kept in full on the CPU.
  # Without a guard nothing reads the verdict: the momentum is not read before it is blended.
  momentum_on_clipping = clipping and momentum is not None and hp.skip_nonfinite_steps
  # The full-size reads of this half's reductions, in the compute dtype. A narrow param is
  # read on its own, so that its upcast fuses into its reduction and no wide copy of it is
  # kept for later passes.
  grad_read = xla_hints.fresh_read(grad, ct) if clipping else None
  param_read = (xla_hints.fresh_read(param, ct) if hp.multiply_by_parameter_scale
                else None)
  if clipping:
    scaled = scale_by_factors(grad_read, factors)
    if momentum_on_clipping:
      scaled = scaled + xla_hints.nan_unless_finite(xla_hints.fresh_read(momentum, ct))
    # The flag reads the sum, not the mean: see sum_abs_sq.
    square_sum, count = sum_abs_sq(scaled, plan.batch_axes)
    checked.append(square_sum)
  if step.learning_rate is not None:
    # Its finiteness is the step's, checked once (schedules.step_values), not per leaf.
    multiplier = times(jnp.asarray(step.learning_rate, real_ct))
  if hp.multiply_by_parameter_scale:
    rms, param_square_sum = param_rms(param_read, plan.batch_axes)
    # The flag reads the reduction itself, not the clamp or the mean: XLA then copies
    # neither into the flag's kernel, which leaves of every size share.
    checked.append(param_square_sum)
    multiplier = times(parameter_scale(rms, hp.min_parameter_scale, hp.max_parameter_scale))
  elif decays or reads_param_on_write_back:
    checked.append(param)
  if clipping:
    # The clipping divides the rest of the multiplier: one scalar kernel per leaf makes
    # the whole multiplier, where a clipping factor of its own was a kernel of its own.
    multiplier = clipped(multiplier, mean_of(square_sum, count), hp.clipping_threshold)
  # The old momentum (without clipping) and compensation are blended into the update: NaN
  # there is NaN in it. A sum fuses into the read of a state in the compute dtype, where
  # all(isfinite) writes a boolean temporary per leaf on the CPU backend; for a narrower
  # state the sum's upcast is written out in full instead, and all(isfinite) is the
  # cheaper (measured temporaries).
  for state in (None if momentum_on_clipping else momentum, compensation):
    if state is not None:
      finite &= (xla_hints.finite_by_sum(state, per_row) if np.dtype(state.dtype) == ct
                 else numerics.all_finite(state, per_row=per_row))
  if checked:
    finite &= numerics.all_finite(*checked, per_row=per_row)
  if per_row:
    finite = jnp.broadcast_to(finite, grad.shape[:1])
  return new_moment, LeafScaling(factors, multiplier, square_terms), finite


def leaf_update(
    hp: Hyperparams, step: StepValues, step_finite: jax.Array | None, grad: jax.Array,
    leaf: Leaf, scaling: LeafScaling, momentum: jax.Array | None,
    param: jax.Array | None, compensation: jax.Array | None, new_moment: Moment,
    moment: Moment,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None, Moment]:
  """Second half: the update, scaled again from the gradient, with the skip applied.

  ``step_finite`` is ``None`` without a guard, else the step's scalar verdict: a
  skipped step gives zero updates and the old statistics, momentum and compensation,
  exactly. ``new_moment`` is the first half's, ``moment`` the state's.

  Returns:
    ``(update, new_momentum, new_compensation, kept_moment)``; the update is in the
    gradient's dtype.
  """
  ct = leaf.compute_dtype
  factors, multiplier = xla_hints.unmergeable((scaling.factors, scaling.multiplier))
  if (step_finite is not None and isinstance(moment, FullMoment) and not leaf.rows_are_leaves
      and not (leaf.rounding and leaf.rounding.stochastic and is_narrow(moment.v.dtype))):
    # An unfactored leaf's statistic and factor are full-size: computed again where a
    # compiler would keep them across the verdict (with NaN carried, not a flag to compute).
    plan = leaf.plan  # (static values only in the closure: a traced eps escaped its trace)
    def again(grad, v, beta2, complement, floor, eps):
      (new,), _ = update_second_moment(grad, FullMoment(v), plan, Decay(beta2, complement), eps, ct)
      return [new, *scale_factors(FullMoment(new), plan, floor, None, poison=True)[0].factors]
    grad, old, new_v, factor = xla_hints.computed_again(again, [grad, moment.v], [
        *step.decay[leaf.real_dtype], leaf.floor, jnp.asarray(hp.eps, leaf.real_dtype)],
        [new_moment.v, factors.factors[0]])
    moment, new_moment, factors = FullMoment(old), FullMoment(new_v), ScaleFactors((factor,), None)
  update = scale_by_factors(grad.astype(ct), factors)
  if multiplier is not None:
    update = update * multiplier.astype(ct)
  new_momentum = None
  if momentum is not None:
    blended = momentum_blend(update, momentum, jnp.asarray(hp.momentum, leaf.real_dtype))
    (stored,) = store((blended,), momentum.dtype, leaf.rounding, (bit_streams.STREAM_MOMENTUM,))
    new_momentum = keep_unless_skipped(step_finite, stored, momentum)
    # Reading the update back from the kept state lets the state be written in place;
    # when the state is narrower than the compute dtype, use the exact value.
    update = new_momentum if np.dtype(momentum.dtype) == ct else blended
  if leaf.decays:
    mask = None if leaf.decay_mask is True else jnp.asarray(leaf.decay_mask)
    update = decoupled_weight_decay(
        update, param, jnp.asarray(step.weight_decay_rate, leaf.real_dtype), mask)
  update, new_compensation = write_back(-update if hp.negate_updates else update, param,
                                        grad.dtype, leaf.rounding, compensation)
  if compensation is not None:
    new_compensation = keep_unless_skipped(step_finite, new_compensation, compensation)
  kept_moment = type(moment)(*map(partial(keep_unless_skipped, step_finite), new_moment, moment))
  return zero_if_skipped(step_finite, update), new_momentum, new_compensation, kept_moment
