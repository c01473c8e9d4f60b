"""``safefactor``: Adafactor as one fused, float32-throughout transformation."""

from __future__ import annotations

import math
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_safefactor._src import boxes, checks, moments, numerics
from optax_safefactor._src.base import (
    WitnessedTransformation,
    keep_unless_skipped,
    unzip_leaf_results,
    zero_if_skipped,
)
from optax_safefactor._src.guard import skip_nonfinite
from optax_safefactor._src.plan import FactorRulesFn, batch_axes_fn
from optax_safefactor._src.sharding import full_like_param


class SafefactorState(NamedTuple):
  """State of the Adafactor core of :func:`safefactor`.

  Attributes:
    count: number of applied steps (drives the beta2 and learning-rate schedules).
    second_moment: one :class:`FactoredMoment` or :class:`FullMoment` per leaf.
    momentum: the first moment per leaf, or ``None`` when momentum is off.
  """

  count: jax.Array
  second_moment: Any
  momentum: Any


def _validate(
    *, decay_rate, min_dim_size_to_factor, clipping_threshold, momentum, eps, beta2_cap,
    min_parameter_scale, max_parameter_scale, learning_rate, weight_decay_rate,
) -> None:
  check = checks.check_hyperparameter
  check("learning_rate", learning_rate, math.isfinite, "finite")
  check("decay_rate", decay_rate, lambda x: x > 0, "positive")
  check("min_dim_size_to_factor", min_dim_size_to_factor, lambda x: x >= 1, "at least 1")
  check("clipping_threshold", clipping_threshold, lambda x: x >= 1, "at least 1 (or None)")
  check("momentum", momentum, lambda x: 0 <= x < 1, "in [0, 1) (or None)")
  check("eps", eps, lambda x: x >= 0, "non-negative")
  check("beta2_cap", beta2_cap, lambda x: 0 < x <= 1, "in (0, 1] (or None)")
  check("min_parameter_scale", min_parameter_scale, lambda x: x >= 0, "non-negative")
  check("max_parameter_scale", max_parameter_scale, lambda x: x > 0, "positive (or None)")
  check("weight_decay_rate", weight_decay_rate, math.isfinite, "finite (or None)")


def _momentum_dtype(dtype_momentum: Any, param_dtype: Any) -> np.dtype:
  dtype = np.dtype(jnp.dtype(dtype_momentum))
  if jnp.issubdtype(param_dtype, jnp.complexfloating):
    return np.dtype(jnp.complex128) if dtype.itemsize >= 8 else np.dtype(jnp.complex64)
  return dtype


def _leaf_mask(weight_decay_mask: Any, params: Any) -> Any:
  """Per-leaf weight-decay mask; a mask may be a prefix of the params tree."""
  if weight_decay_mask is None:
    return jax.tree.map(lambda _: True, params)
  mask = weight_decay_mask(params) if callable(weight_decay_mask) else weight_decay_mask
  return jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), mask, params)


def scale_by_adafactor(
    learning_rate: optax.ScalarOrSchedule | None,
    min_dim_size_to_factor: int,
    decay_rate: jax.typing.ArrayLike,
    decay_offset: jax.typing.ArrayLike,
    multiply_by_parameter_scale: bool,
    clipping_threshold: jax.typing.ArrayLike | None,
    momentum: jax.typing.ArrayLike | None,
    dtype_momentum: Any,
    weight_decay_rate: jax.typing.ArrayLike | None,
    eps: jax.typing.ArrayLike,
    factored: bool,
    weight_decay_mask: Any,
    *,
    state_dtype: str | None,
    beta2_cap: jax.typing.ArrayLike | None,
    min_parameter_scale: jax.typing.ArrayLike,
    max_parameter_scale: jax.typing.ArrayLike | None,
    factor_rules: FactorRulesFn | None = None,
) -> WitnessedTransformation:
  """The whole Adafactor step for each leaf in one function, in the compute dtype.

  Chaining optax's clipping and parameter-scale transforms would round the
  update to the parameter dtype between links (float16 overflows at |u| > 256);
  here the update stays in float32 (or wider) from the gradient to the final cast.
  """
  needs_params = multiply_by_parameter_scale or weight_decay_rate is not None
  batch_axes_for = batch_axes_fn(factor_rules)

  def init_fn(params):
    plan_for = moments.factor_plan_fn(factored, min_dim_size_to_factor, factor_rules)
    second_moment = moments.init_second_moment(params, plan_for, state_dtype, eps)
    first_moment = None
    if momentum is not None:
      def zeros_like_param(param):
        value = boxes.unbox(param)
        zeros = full_like_param(value, value.shape, 0, _momentum_dtype(dtype_momentum, value.dtype))
        return boxes.rebox_like(param, zeros)

      first_moment = jax.tree.map(zeros_like_param, params, is_leaf=boxes.is_box)
    return SafefactorState(jnp.zeros([], jnp.int32), second_moment, first_moment)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if params is None and needs_params:
      raise ValueError(
          "safefactor needs params in update(grads, state, params) when "
          "multiply_by_parameter_scale is on or weight_decay_rate is set"
      )
    moments.check_update_inputs(updates, state.second_moment, params)
    beta2 = moments.second_moment_decay(state.count, decay_rate, decay_offset, None, beta2_cap)
    if learning_rate is None:
      lr = None
    else:
      lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    decay_mask = _leaf_mask(weight_decay_mask, updates) if weight_decay_rate is not None else None

    def scale_leaf(path, grad, moment, param, decay_this_leaf):
      """New statistics, scale factors, the update's multiplier, and finiteness."""
      ct = numerics.compute_dtype(grad.dtype)
      real_ct = numerics.real_dtype(ct)
      # With clipping, the statistics' finiteness rides on the clipping RMS below.
      new_moment, scale, finite = moments.update_moment(
          grad, moment, beta2, eps, witness_in_scaled=clipping_threshold is not None
      )
      # Batch axes (stacked layers, experts) are separate params: per-slice statistics.
      batch_axes = batch_axes_for(path, grad.shape)
      multiplier = None
      if clipping_threshold is not None:
        # Its own view of the gradient, so that the upcast is not shared with the final
        # pass (a shared one is a full-size float32 temporary that outlives the verdict).
        grad_for_clipping = jax.lax.optimization_barrier(grad).astype(ct)
        mean_square = numerics.mean_abs_sq(moments.scale_by_factors(grad_for_clipping, scale),
                                           batch_axes)
        finite &= numerics.all_finite(mean_square)
        threshold = jnp.asarray(clipping_threshold, real_ct)
        multiplier = 1 / jnp.maximum(jnp.asarray(1, real_ct), jnp.sqrt(mean_square) / threshold)
      if lr is not None:
        lr_value = jnp.asarray(lr, real_ct)
        finite &= jnp.isfinite(lr_value)
        multiplier = lr_value if multiplier is None else multiplier * lr_value
      if multiply_by_parameter_scale:
        # Behind a barrier XLA fuses the upcast into the reduction; without one it wrote
        # every narrow param's float32 copy to a temporary, all alive at once.
        param_for_scale = jax.lax.optimization_barrier(param)
        rms = jnp.sqrt(numerics.mean_abs_sq(param_for_scale.astype(ct), batch_axes))
        finite &= numerics.all_finite(rms)
        min_scale = jnp.asarray(min_parameter_scale, real_ct)
        param_scale = jnp.where(rms <= min_scale, min_scale, rms)
        if max_parameter_scale is not None:
          param_scale = jnp.minimum(param_scale, jnp.asarray(max_parameter_scale, real_ct))
        multiplier = param_scale if multiplier is None else multiplier * param_scale
      elif weight_decay_rate is not None and decay_this_leaf is not False:
        finite &= numerics.all_finite(param)
      return (scale, multiplier), new_moment, finite

    def finish_leaf(step_finite, grad, scaling, first_moment, param, decay_this_leaf):
      """The update, scaled again from the gradient, with the step's verdict applied.

      Scaling again here, from the gradient and the small factors, rather than
      keeping the scaled gradient from the clipping pass, leaves that full-size
      array a single reader: it lives for one reduction instead of across the
      verdict (XLA kept every leaf's alive at once: a whole tree of temporaries,
      allocated and faulted in on every step). ``gate_factors`` makes the factors new
      values, so XLA cannot merge the two scalings back into one.
      """
      scale, multiplier = scaling
      ct = numerics.compute_dtype(grad.dtype)
      u = moments.scale_by_factors(grad.astype(ct), moments.gate_factors(step_finite, scale))
      if multiplier is not None:
        u = u * multiplier.astype(ct)
      new_first_moment = None
      if momentum is not None:
        beta1 = jnp.asarray(momentum, numerics.real_dtype(ct)).astype(ct)
        blended = (1 - beta1) * u + beta1 * first_moment.astype(ct)
        new_first_moment = keep_unless_skipped(
            step_finite, blended.astype(first_moment.dtype), first_moment
        )
        # Reading the update back from the kept state lets the state be written in
        # place; when the state is narrower than the compute dtype, use the exact value.
        stored_exactly = np.dtype(first_moment.dtype) == np.dtype(ct)
        u = new_first_moment if stored_exactly else blended
      if weight_decay_rate is not None and decay_this_leaf is not False:
        rate = jnp.asarray(weight_decay_rate, numerics.real_dtype(ct)).astype(ct)
        decay = rate * param.astype(ct)
        if decay_this_leaf is not True:
          decay = jnp.where(decay_this_leaf, decay, jnp.zeros((), ct))
        u = u + decay
      update = zero_if_skipped(step_finite, numerics.saturating_cast(-u, grad.dtype))
      return update, new_first_moment

    none_tree = jax.tree.map(lambda _: None, updates)
    params_tree = none_tree if params is None else params
    mask_tree = none_tree if decay_mask is None else decay_mask
    scaled = jax.tree_util.tree_map_with_path(
        scale_leaf, updates, state.second_moment, params_tree, mask_tree
    )
    scaling, new_second, finite = unzip_leaf_results(updates, scaled, 3)

    def finish(step_finite):
      finished = jax.tree.map(
          partial(finish_leaf, step_finite),
          updates,
          scaling,
          none_tree if momentum is None else state.momentum,
          params_tree,
          mask_tree,
      )
      new_updates, new_first = unzip_leaf_results(updates, finished, 2)
      return new_updates, SafefactorState(
          keep_unless_skipped(step_finite, optax.safe_increment(state.count), state.count),
          moments.keep_moments_unless_skipped(step_finite, new_second, state.second_moment),
          new_first if momentum is not None else None,
      )

    return finite, finish

  return WitnessedTransformation(init_fn, update_fn)


def safefactor(
    learning_rate: optax.ScalarOrSchedule | None = None,
    min_dim_size_to_factor: int = 128,
    decay_rate: float = 0.8,
    decay_offset: int = 0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold: float | None = 1.0,
    momentum: float | None = None,
    dtype_momentum: Any = "float32",
    weight_decay_rate: float | None = None,
    eps: float = 1e-30,
    factored: bool = True,
    weight_decay_mask: Any = None,
    *,
    state_dtype: str | None = None,
    beta2_cap: float | None = None,
    min_parameter_scale: float = 1e-3,
    max_parameter_scale: float | None = None,
    skip_nonfinite_steps: bool = True,
    max_consecutive_skips: int | None = None,
    factor_rules: FactorRulesFn | None = None,
    checked: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Adafactor that is safe in float16, bfloat16 and float32: a drop-in for ``optax.adafactor``.

  Same positional arguments, defaults and (on healthy float32 inputs) results as
  :func:`optax.adafactor`, with these differences:

  - all arithmetic runs in float32 (float64 for float64 inputs) and the second
    moment is stored in float32, whatever the parameter dtype; updates are cast
    back to the gradient dtype at the end, clamped to its finite range;
  - the statistics start at an epsilon floor and every rsqrt and divisor is
    floored, so zero gradients, dead units and masked parameters are safe;
  - the factored statistics keep all axes (keepdims), so a tall matrix gets the
    transpose of the update of its transpose;
  - a step whose updates or new state would be non-finite is skipped and counted
    (see :func:`skip_nonfinite`), unless ``skip_nonfinite_steps=False``.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_safefactor as osf
    >>> def loss(params):
    ...   return jnp.sum((params["w"] - 1.0) ** 2)
    >>> tx = osf.safefactor(learning_rate=0.1)
    >>> params = {"w": jnp.full((4, 3), 0.5)}
    >>> state = tx.init(params)
    >>> for _ in range(100):
    ...   updates, state = tx.update(jax.grad(loss)(params), state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> print(f"{loss(params):.4f}")
    0.0000

  Args:
    learning_rate: a scalar or an ``optax`` schedule; ``None`` leaves the
      updates unscaled (to scale them later in a chain).
    min_dim_size_to_factor: factor a leaf only when its two largest axes both have
      at least this many elements.
    decay_rate: exponent of beta2's power schedule ``1 - (t + 1) ** -decay_rate``.
    decay_offset: step at which the beta2 schedule starts (fine-tuning).
    multiply_by_parameter_scale: scale updates by ``max(rms(param), min_parameter_scale)``.
    clipping_threshold: clip each leaf's update to this RMS; ``None`` for no clipping.
    momentum: decay of an (undebiased) first moment; ``None`` for no momentum.
    dtype_momentum: dtype name of the first moment.
    weight_decay_rate: decoupled weight decay, or ``None``.
    eps: added to squared gradients; also the floor under every rsqrt.
    factored: whether to factor second moments at all.
    weight_decay_mask: a tree (or a function of params returning one) of bools
      choosing the leaves that decay.
    state_dtype: dtype name of the second moment; ``None`` for float32 (float64 for
      float64 params).
    beta2_cap: an upper bound on beta2, as big_vision's 0.999; ``None`` for none.
    min_parameter_scale: the smallest parameter scale (``optax``'s 1e-3).
    max_parameter_scale: the largest parameter scale, or ``None``.
    skip_nonfinite_steps: wrap the transformation in :func:`skip_nonfinite`.
    max_consecutive_skips: passed to :func:`skip_nonfinite` as ``max_consecutive``.
    checked: passed to :func:`skip_nonfinite`: raise through checkify on the first
      non-finite leaf, with its path and the step (debugging).
    factor_rules: ``(path, shape) -> roles`` choosing each axis's role: ``"row"``,
      ``"column"``, ``"batch"`` (a separate slice: stacked layers, experts),
      ``"none"``, or ``None`` to leave it to the heuristic; the callable may return
      ``None`` for the heuristic on the whole leaf. See :func:`logical_factor_rules`.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs`.

  References:
    Shazeer et al, `Adafactor: Adaptive Learning Rates with Sublinear Memory
    Cost <https://arxiv.org/abs/1804.04235>`_, 2018

    Zhai et al, `Scaling Vision Transformers <https://arxiv.org/abs/2106.04560>`_, 2021
  """
  _validate(
      decay_rate=decay_rate, min_dim_size_to_factor=min_dim_size_to_factor,
      clipping_threshold=clipping_threshold, momentum=momentum, eps=eps, beta2_cap=beta2_cap,
      min_parameter_scale=min_parameter_scale, max_parameter_scale=max_parameter_scale,
      learning_rate=learning_rate, weight_decay_rate=weight_decay_rate,
  )
  core = scale_by_adafactor(
      learning_rate, min_dim_size_to_factor, decay_rate, decay_offset,
      multiply_by_parameter_scale, clipping_threshold, momentum, dtype_momentum,
      weight_decay_rate, eps, factored, weight_decay_mask,
      state_dtype=state_dtype, beta2_cap=beta2_cap, min_parameter_scale=min_parameter_scale,
      max_parameter_scale=max_parameter_scale, factor_rules=factor_rules,
  )
  if not skip_nonfinite_steps:
    return core
  return skip_nonfinite(core, max_consecutive_skips, checked=checked)
