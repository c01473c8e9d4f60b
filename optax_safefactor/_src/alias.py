"""The public factories: ``safefactor`` and ``scale_by_safe_factored_rms``, assembly only.

Both build a :class:`Hyperparams`, validate it, and hand it to the one Adafactor
transformation (``transform.adafactor``); they differ only in which parts are on.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.typing import DTypeLike

from optax_safefactor._src import hyperparams, transform
from optax_safefactor._src.argument_names import explain_unknown_arguments
from optax_safefactor._src.hyperparams import DecayRateFn, Hyperparams
from optax_safefactor._src.plan import FactorRulesFn


@explain_unknown_arguments
def safefactor(
    learning_rate: optax.ScalarOrSchedule | None = None,
    min_dim_size_to_factor: int = 128,
    decay_rate: float = 0.8,
    decay_offset: int = 0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold: float | None = 1.0,
    momentum: float | None = None,
    dtype_momentum: DTypeLike | None = "float32",
    weight_decay_rate: optax.ScalarOrSchedule | None = None,
    eps: float = 1e-30,
    factored: bool = True,
    weight_decay_mask: Any = None,
    *,
    state_dtype: DTypeLike | None = None,
    beta2_cap: float | None = None,
    min_parameter_scale: float = 1e-3,
    max_parameter_scale: float | None = None,
    skip_nonfinite_steps: bool = True,
    max_consecutive_skips: int | None = None,
    factor_rules: FactorRulesFn | None = None,
    checked: bool = False,
    param_rounding: str = "nearest",
    rounding_seed: int = 0,
    skip_spikes: float | None = None,
    spike_window: int = 128,
    pack_small_leaves: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""Adafactor that is safe in float16, bfloat16 and float32: a drop-in for ``optax.adafactor``.

  Same positional arguments, defaults and (on healthy float32 inputs) results as
  :func:`optax.adafactor`, with these differences:

  - all arithmetic runs in float32 (float64 for float64 inputs) and the second
    moment is stored in float32, whatever the parameter dtype; updates are cast
    back to the gradient dtype at the end, finite values clamped to its finite range;
  - the statistics start at an epsilon floor and every rsqrt and divisor is
    floored, so zero gradients, dead units and masked parameters are safe; so is
    differentiating through ``update`` there (learned optimizers, hyperparameter
    gradients: ``optax.adafactor``'s derivative is NaN at an exact zero), and stochastic
    rounding differentiates as a cast, as rounding to nearest does;
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
    dtype_momentum: dtype (or its name) of the first moment; ``None`` for the params' dtype
      (as in optax); ``"at_least_float32"`` for the params' dtype widened to float32
      (float32 for bfloat16 and float16 params, float64 for float64 ones, as PyTorch's
      Adafactors keep it). A complex param's momentum is complex of that precision:
      ``"float32"`` and ``"complex64"`` both give complex64 there and float32 for a
      real param.
    weight_decay_rate: decoupled weight decay (a scalar or a schedule), or ``None``.
    eps: added to squared gradients; also the floor under every rsqrt.
    factored: whether the heuristic factors second moments (rows and columns that
      ``factor_rules`` names are factored either way).
    weight_decay_mask: a tree (or a function of params returning one) of bools
      choosing the leaves that decay (without ``weight_decay_rate`` it warns that it
      has no effect).
    state_dtype: dtype (or its name) of the second moment; ``None`` for float32 (float64 for
      float64 params). ``"float16"`` statistics saturate where a new statistic passes
      65504, float16's largest value (on the first step, a mean of squared gradients
      over a row or column of 256**2: gradients of 256 throughout it; later steps weigh
      the new squares by ``1 - beta2``, so the bound grows with the step), as every value
      stored narrower does (a float16 or bfloat16 momentum too): the estimate is then too
      small and the clipping bounds the update. ``"bfloat16"`` halves the state with
      float32's range, but rounded to nearest its statistics move by whole ulps: once
      ``1 - beta2`` is below half of bfloat16's ulp (2**-9, after about 2,400 steps at
      the default ``decay_rate``) they can no longer fall. ``param_rounding="stochastic"`` writes
      them stochastically, which keeps them unbiased.
    beta2_cap: an upper bound on beta2, as big_vision's 0.999; ``None`` for none.
    min_parameter_scale: the smallest parameter scale (``optax``'s 1e-3).
    max_parameter_scale: the largest parameter scale, or ``None``. Below
      ``min_parameter_scale`` it wins, as in T5X, and warns that the minimum has no
      effect.
    skip_nonfinite_steps: skip and count non-finite steps, as :func:`skip_nonfinite`
      does (the state is then a :class:`SkipNonfiniteState`). The decision comes from
      statistics the step computes anyway, inside this transformation's own update,
      so it holds under any wrapping (``optax.chain``, ``inject_hyperparams``,
      ``masked``, ``MultiSteps``...).
    max_consecutive_skips: as :func:`skip_nonfinite`'s ``max_consecutive``; needs
      ``skip_nonfinite_steps``. Injectable with ``optax.inject_hyperparams``.
    factor_rules: ``(path, shape) -> roles`` choosing each axis's role: ``"row"``,
      ``"column"``, ``"batch"`` (a separate slice: stacked layers, experts),
      ``"none"``, or ``None`` to leave it to the heuristic; the callable may return
      ``None`` for the heuristic on the whole leaf. Rows and columns a rule names are
      factored whatever their sizes and ``factored`` (which, like
      ``min_dim_size_to_factor``, is the heuristic's): with ``factored=False`` only the
      leaves a rule factors are factored. See :func:`logical_factor_rules`.
    checked: as :func:`skip_nonfinite`'s ``checked``: raise through checkify on the
      first non-finite leaf, with its path and the step (debugging); needs
      ``skip_nonfinite_steps``.
    param_rounding: how the update lands on params narrower than float32 (bfloat16,
      float16): ``"nearest"`` rounds the update to the param dtype (optax's behaviour:
      updates below half an ulp of the param are lost, and ``optax.apply_updates``
      adds in the param dtype, so a param pushed past the dtype's largest value, such as
      float16's 65504, becomes Inf); ``"stochastic"`` lands the
      param on ``param + update`` rounded stochastically (unbiased, no extra state),
      and also stores narrow momentum and statistics (``dtype_momentum`` or
      ``state_dtype`` ``"bfloat16"``) that way;
      ``"kahan"`` rounds to nearest and keeps the rounding error in a compensation
      buffer of the param's dtype, added to the next update. Both landing modes land a
      param pushed past the largest value on that value, or an ulp below it where no
      update in the param's dtype lands there (float16's 30000 cannot reach 65504: 35488
      lands on 65472, 35520 on Inf). The two rounding modes
      need a ``learning_rate``: the rounded update must be the final one. ``init`` warns
      of a mode that finds nothing narrow to round (float32 params only, say).
    rounding_seed: an int keying ``"stochastic"``'s random bits, together with the
      step, the param's path and each element's index (so the bits are the same on
      any sharding or number of hosts). A seed other than 0 with another mode warns
      that it has no effect.
    skip_spikes: also skip, and count, finite spikes. Two statistics are judged, each
      against its own history: the global gradient norm, always, and the loss, on the
      steps whose ``update`` is given ``value=loss``. A step is a spike when either is
      above :math:`\bar x + k \max(s, 0.02 |\bar x|)`, with :math:`k` =
      ``skip_spikes`` (6.0 is the usual choice) and :math:`\bar x`, :math:`s` the mean
      and sample standard deviation of that statistic over the last ``spike_window``
      applied steps (for the loss, those given one), once at least ``spike_window // 2``
      of them are there. The reports name the statistic that spiked (the gradient norm
      when both did), its value and limit, and the param whose gradient norm was
      largest. ``None`` (the default) skips no spike, and ``value=`` is then accepted
      and ignored (``optax.chain`` hands it to every member, and
      ``optax.contrib.reduce_on_plateau`` needs it); with spikes on, a loss passed under
      another keyword (``loss=``) warns that it is ignored. A
      spike is skipped as a non-finite step is (zero updates, state untouched) and stays
      out of the history; after ``spike_window // 2`` spike skips in a row the next spike
      is taken and the history restarts from it, so a lasting change of scale costs at
      most that many skipped steps. The gradient norm is read off the second-moment
      statistics the step computes anyway, so it is the norm of the gradients this
      transformation is given: behind ``optax.clip_by_global_norm`` no spike shows, and
      the clip goes inside ``skip_nonfinite(..., skip_spikes=...)`` instead (the guide
      "Non-finite steps, spikes and gradient accumulation" shows how). A non-finite loss
      is not a spike.
      Spikes count in :func:`skipped_steps` and
      :func:`skipped_spikes`, not toward ``max_consecutive_skips``; needs
      ``skip_nonfinite_steps``. Injectable with ``optax.inject_hyperparams``; an
      injected value is not judged at each step as a constructed one is, so keep it
      positive: at 0 or below, ordinary steps (at 0, those above the mean) are spikes.
    spike_window: the steps of history the spike rule keeps (an int of at least 2). It
      sets the state's shape: under ``optax.inject_hyperparams`` pass it in
      ``static_args``. Another window without ``skip_spikes`` warns that it has no
      effect.
    pack_small_leaves: step the small unfactored leaves (biases, norm scales: up to
      2,048 elements) that share a size, dtypes and settings, where there are 16 or more
      of them, four at a time, as the rows of one array. Each leaf keeps its own clipping,
      parameter scale, weight decay mask, rounding bits and skip flag; only the last bits
      can differ from the leaf's own: the order of a row's reductions, and, with a
      bfloat16 momentum, one rounding of the momentum blend (measured on XLA:CPU, where the
      two programs contract its multiply-add differently). Leaves not known to
      be replicated (sharded, or under a mesh's Auto axes) are stepped alone. On by
      default: measured on a 2-core CPU, XLA compiles the packed step in 0.75x to 1.10x
      of ``optax.adafactor``'s time, the unpacked one in 0.87x to 1.35x (GPT-2 small, a
      576-leaf and a 600-leaf tree), and their step times cannot be told apart; compiled
      only for TPU v5e and H100, the packed step moves the same bytes with 9% to 22%
      fewer fusions. ``False`` steps every leaf alone (for comparison and debugging).
      See ``docs/benchmarks.md``, "XLA compile time in fresh processes", "Packing on TPU
      v5e" and "Packing on H100".

  Returns:
    A :class:`optax.GradientTransformationExtraArgs`.

  Raises:
    TypeError: at construction, for an argument of the wrong kind (a number given as a
      string, a dtype that is not floating, a seed that is not an int); in ``init`` and
      ``update``, naming the parameter path, for a leaf that is not a floating array
      or a grad whose dtype differs from its param's; in ``update``, for a state this
      optimizer's ``init`` did not make (an ``optax.adafactor`` state, swapped
      arguments, a checkpoint restored without a target).
    ValueError: at construction, for a number out of its range (``decay_rate <= 0``,
      ``momentum >= 1``...); in ``update``, naming the path, for grads whose tree or
      shapes differ from the params', and for missing params when
      ``multiply_by_parameter_scale``, weight decay or a rounding mode needs them.

  References:
    Shazeer et al, `Adafactor: Adaptive Learning Rates with Sublinear Memory
    Cost <https://arxiv.org/abs/1804.04235>`_, 2018

    Zhai et al, `Scaling Vision Transformers <https://arxiv.org/abs/2106.04560>`_, 2021
  """
  # Every argument is a Hyperparams field of the same name: a new option is a new field.
  return transform.adafactor(hyperparams.validate(Hyperparams.of(locals())))


@explain_unknown_arguments
def scale_by_safe_factored_rms(
    factored: bool = True,
    decay_rate: jax.typing.ArrayLike = 0.8,
    step_offset: jax.typing.ArrayLike = 0,
    min_dim_size_to_factor: int = 128,
    epsilon: jax.typing.ArrayLike = 1e-30,
    decay_rate_fn: DecayRateFn | None = None,
    *,
    state_dtype: DTypeLike | None = None,
    beta2_cap: jax.typing.ArrayLike | None = None,
    factor_rules: FactorRulesFn | None = None,
    skip_nonfinite_steps: bool = False,
    pack_small_leaves: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""Scale updates by a factored estimate of the gradient RMS, safely (as in Adafactor).

  A drop-in for :func:`optax.scale_by_factored_rms` (same positional arguments)
  that keeps its statistics in float32 whatever the parameter dtype, starts them
  at an epsilon floor, floors every rsqrt, clamps the local step at 0 and stores
  the factored statistics with keepdims shapes from a plan decided once per leaf, so
  tall and wide matrices are treated alike.

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
    factored: whether the heuristic factors the second moment of leaves of rank 2 and
      more (rows and columns that ``factor_rules`` names are factored either way).
    decay_rate: exponent of the power decay schedule of beta2.
    step_offset: steps before this count use the first step's decay (fine-tuning).
    min_dim_size_to_factor: factor only when both factored axes have this size.
    epsilon: added to the squared gradient; also the floor under every rsqrt
      (never below the compute dtype's smallest normal).
    decay_rate_fn: ``(step, decay_rate) -> beta2``; ``None`` for the power decay.
    state_dtype: dtype (or its name) of the statistics; ``None`` for float32 (float64 for
      float64 parameters). Narrower statistics are rounded to nearest here, as
      :func:`safefactor`'s ``state_dtype`` says.
    beta2_cap: an upper bound on beta2 (0.999 in big_vision), or ``None``.
    factor_rules: per-axis roles, as for :func:`safefactor`.
    skip_nonfinite_steps: skip and count non-finite steps inside this transformation,
      as :func:`safefactor` does (off by default, as a building block).
    pack_small_leaves: as for :func:`safefactor`.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` whose state is an
    :class:`AdafactorState` (without momentum), or a :class:`SkipNonfiniteState`
    around one with ``skip_nonfinite_steps``.

  Raises:
    TypeError, ValueError: as :func:`safefactor` raises them, naming this function's
      own arguments (``epsilon``, ``step_offset``).

  References:
    Shazeer et al, `Adafactor: Adaptive Learning Rates with Sublinear Memory
    Cost <https://arxiv.org/abs/1804.04235>`_, 2018
  """
  renamed = {"epsilon": "eps", "step_offset": "decay_offset"}
  return transform.adafactor(hyperparams.validate(
      Hyperparams.of(locals(), renamed, multiply_by_parameter_scale=False,
                     clipping_threshold=None, negate_updates=False),
      names={field: argument for argument, field in renamed.items()},
  ))
