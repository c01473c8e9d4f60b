"""big_vision's and T5X's Adafactor (the JAX ones) as ``safefactor`` presets."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from optax_safefactor._src import numerics, plan, preset_assembly, user_warnings
from optax_safefactor._src.preset_assembly import Schedule

# Both ------------------------------------------------------------------------------------


def _momentum_as_stored(momentum: Any, dtype_momentum: Any,
                        where: str) -> tuple[Any, Any]:
  """The momentum's decay as big_vision and T5X apply it, and a factor for the update.

  Both decay the stored momentum by a Python float times it (optax's ``decay * ema``,
  T5X's ``beta1 * state.m``), and JAX gives a Python scalar the array's dtype: with
  bfloat16 momentum, 0.9 decays it by 0.8984375 while the new update still enters with
  ``1 - 0.9``, and their first moment settles about 1.5% below the update. safefactor
  blends ``(1 - b) u + b m`` with one ``b``: with ``b`` the rounded momentum and ``u``
  scaled by ``(1 - momentum) / (1 - b)`` first (through safefactor's learning rate,
  which comes before the blend), that is their blend, and its momentum is theirs.

  An array (``optax.inject_hyperparams`` hands over even the defaults as arrays) is
  rounded too, so that injecting the learning rate leaves the momentum as it was.
  Left as it is: a momentum in the params' dtype (``None``, ``"at_least_float32"``:
  unknown here), and one the dtype rounds to 1 (theirs then never decays, which
  safefactor refuses: a number warns, naming ``where``, the preset and its argument).

  Returns:
    ``(b, factor)``; ``(momentum, None)`` where nothing is rounded (no factor).
  """
  if momentum is None or dtype_momentum in (None, numerics.AT_LEAST_FLOAT32):
    return momentum, None
  try:
    real = jnp.finfo(dtype_momentum).dtype
  except (TypeError, ValueError):
    return momentum, None  # not a float dtype: safefactor's checks name it
  if isinstance(momentum, (jax.Array, jax.core.Tracer)):
    if not jnp.issubdtype(momentum.dtype, jnp.floating):
      return momentum, None
    # Traced in update: the same steps in init and update build the same chain.
    rounded = momentum.astype(real).astype(momentum.dtype)
    decay = jnp.where(rounded < 1, rounded, momentum)
    return decay, jnp.where(decay == momentum, 1.0, (1 - momentum) / (1 - decay))
  decay = float(np.asarray(momentum, np.float64).astype(real))
  if decay >= 1 > momentum:
    user_warnings.warn(f"{where} is {momentum!r}, which {real.name} rounds to 1: the original "
                       "would never decay its momentum; the preset decays it by "
                       f"{momentum!r}")
  if decay == momentum or decay >= 1:
    return momentum, None
  return decay, (1 - momentum) / (1 - decay)


# big_vision ----------------------------------------------------------------------------


def _none_if_zero(value: Any) -> Any:
  """big_vision's ``or None`` (0 is off), an injected array kept (:func:`is_set`)."""
  return value if preset_assembly.is_set(value) else None


def _big_vision_wd_mask(params: Any) -> Any:
  """big_vision's default ``wd_mults``: only leaves named ``.../kernel`` decay."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: re.fullmatch(".*/kernel", preset_assembly.path_name(path)) is not None,
      params)


def big_vision(
    learning_rate: optax.ScalarOrSchedule,
    *,
    schedule: Schedule | None = None,
    wd: float = 0.0,
    min_dim_size_to_factor: int = 32,
    decay_rate: float = 0.8,
    decay_offset: int = 0,
    beta2_cap: float = 0.999,
    clipping_threshold: float | None = None,
    momentum: float | None = 0.9,
    dtype_momentum: DTypeLike | None = "bfloat16",
    eps: float = 1e-30,
    **overrides: Any,
) -> optax.GradientTransformationExtraArgs:
  r"""big_vision's Adafactor (``optax.big_vision.scale_by_adafactor``, the ViT/SigLIP recipe).

  big_vision chains its ``scale_by_adafactor`` (optax's factored RMS with
  :math:`\beta_t = \min(\text{beta2\_cap}, 1 - (t+1)^{-\text{decay\_rate}})`, optional
  clipping, then momentum without debiasing, stored in bfloat16 and decaying by the
  momentum as bfloat16 holds it: optax's ``decay * ema`` rounds the Python float 0.9 to
  0.8984375, while the new term keeps ``1 - 0.9``), its ``config.lr``
  (``learning_rate``), its decoupled weight decay ``config.wd`` on the leaves its
  ``wd_mults`` pick (by default ``.*/kernel``), and its ``config.schedule``, a multiplier
  of both (``schedule``, a function of the 0-based step, or ``None`` for 1):

  .. math::
    \Delta_t = -\,\mathrm{schedule}(t)\,\big(\text{lr}\cdot m_t + \text{wd}\cdot p\big),
    \qquad m_t = \tilde\beta_1 m_{t-1} + (1-\beta_1)\,\mathrm{clip}(g/\sqrt{\hat v}),

  with :math:`\tilde\beta_1` the momentum rounded to ``dtype_momentum`` (``None`` keeps
  the momentum in the params' dtype, which the preset cannot know when it is built: there
  it decays by the momentum as given). The preset is
  that chain, with ``safefactor`` (no parameter scale; momentum :math:`\tilde\beta_1`,
  and a learning rate of :math:`(1-\beta_1)/(1-\tilde\beta_1)` that puts big_vision's
  new term back) in place of ``scale_by_adafactor``; the non-finite guard judges the
  whole chain.
  ``weight_decay_mask`` (an override) replaces the ``.*/kernel`` rule (with ``wd`` 0 it
  has no effect, and a warning says so).

  Measured against a float64 restatement of big_vision's source (``tests/test_presets.py``),
  30 steps on tall, wide, vector, stacked 3-D, partly zero and all-zero leaves, with and
  without momentum, weight decay, clipping and a warm-up cosine schedule: the updates
  differ by at most 4.8e-16 (float64) and 2.2e-7 (float32, float32 momentum) of the
  leaf's largest update, beyond one ulp of the param. With bfloat16 momentum in float32,
  a blend that float32 rounding puts on the other side of a bfloat16 tie is stored one
  bfloat16 ulp away from the float64 blend's (measured: 1.2e-3 of the largest update, on
  one element); big_vision's own float32 blend is open to the same tie. A float16
  momentum's product :math:`\tilde\beta_1 m` XLA:CPU rounds to float16 in big_vision's
  step (a bfloat16 one it keeps in float32), the preset does not.

  Differences by design: before ``decay_offset`` big_vision's :math:`\beta_2` raises a
  negative number to a fractional power (NaN for ever); the preset clamps the local step
  at 0. The statistics are float32 (optax keeps them in the params' dtype).
  ``param_rounding`` other than ``"nearest"`` is refused: the learning rate and the
  schedule scale the update after ``safefactor``, as in big_vision.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_safefactor as osf
    >>> tx = osf.presets.big_vision(1e-3, wd=1e-4, schedule=optax.linear_schedule(1.0, 0.0, 100))
    >>> params = {"dense": {"kernel": jnp.ones((64, 32)), "bias": jnp.zeros(32)}}
    >>> state = tx.init(params)
    >>> grads = {"dense": {"kernel": jnp.ones((64, 32)), "bias": jnp.ones(32)}}
    >>> updates, state = tx.update(grads, state, params)
    >>> print(f"{float(updates['dense']['kernel'][0, 0]):.6f}")
    -0.000200

  Args:
    learning_rate: big_vision's ``config.lr`` (a number, or an optax schedule).
    schedule: big_vision's ``config.schedule`` as a function of the step (multiplies the
      learning rate and the weight decay), or ``None``.
    wd: big_vision's ``config.wd``: decoupled weight decay, not scaled by ``learning_rate``.
    min_dim_size_to_factor: factor a leaf when its two largest axes have this size.
    decay_rate: exponent of the second-moment decay.
    decay_offset: step at which the decay schedule starts.
    beta2_cap: the largest :math:`\beta_2`.
    clipping_threshold: clip the scaled gradient to this RMS; ``None`` (or 0) for none.
    momentum: the first moment's decay; ``None`` (or 0) for none.
    dtype_momentum: the first moment's dtype name.
    eps: added to :math:`g^2`.
    **overrides: further keyword arguments of :func:`optax_safefactor.safefactor`.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs`.

  Raises:
    TypeError: for a number that is not one (a string, say), a switch that is not True or
      False, or an override this preset sets itself or ``safefactor`` does not know.
    ValueError: for a value ``safefactor`` refuses, or a rounding ``param_rounding``.
  """
  taken = {"learning_rate": "learning_rate and schedule", "weight_decay_rate": "wd",
           "min_dim_size_to_factor": "min_dim_size_to_factor", "decay_rate": "decay_rate",
           "decay_offset": "decay_offset", "beta2_cap": "beta2_cap",
           "clipping_threshold": "clipping_threshold", "momentum": "momentum",
           "dtype_momentum": "dtype_momentum", "eps": "eps"}
  overrides = preset_assembly.check_overrides(big_vision, overrides, taken)
  # These go to optax's own steps, not to safefactor's checks.
  preset_assembly.check_number("big_vision", "learning_rate", learning_rate, "finite",
                               math.isfinite, schedule_ok=True)
  preset_assembly.check_number("big_vision", "wd", wd, "finite", math.isfinite)
  if schedule is not None and not callable(schedule):
    raise TypeError("presets.big_vision(): schedule must be a function of the step (or None), "
                    f"got {schedule!r}")
  if _none_if_zero(momentum) is None:
    preset_assembly.warn_unused(big_vision, {"dtype_momentum": dtype_momentum},
                                "momentum is off")
  mask = overrides.pop("weight_decay_mask", _big_vision_wd_mask)
  decays = preset_assembly.is_set(wd)
  if not decays and mask is not _big_vision_wd_mask:
    user_warnings.warn("presets.big_vision(): weight_decay_mask says which params wd decays, and "
                       "wd is 0: it has no effect")
  momentum, factor = _momentum_as_stored(_none_if_zero(momentum), dtype_momentum,
                                         "presets.big_vision(): momentum")
  settings = dict(
      learning_rate=factor,
      min_dim_size_to_factor=min_dim_size_to_factor,
      decay_rate=decay_rate, decay_offset=decay_offset, beta2_cap=beta2_cap,
      clipping_threshold=_none_if_zero(clipping_threshold), momentum=momentum,
      dtype_momentum=dtype_momentum, eps=eps, multiply_by_parameter_scale=False)
  # safefactor's update is -m_t; big_vision's chain is lr, + wd * p, schedule, then -1.
  after = [optax.scale_by_learning_rate(learning_rate, flip_sign=False)]
  if decays:
    after.append(optax.add_decayed_weights(-wd, mask))
  if schedule is not None:
    after.append(optax.scale_by_schedule(schedule))
  return preset_assembly.build("big_vision", settings, overrides, taken=taken, after=after)


# t5x ------------------------------------------------------------------------------------


# T5X's standard_logical_factor_rules(): logical axis name -> role.
_T5X_STANDARD_RULES = {
    "vocab": "column", "embed": "row", "mlp": "column", "heads": "column", "kv": "column",
    "joined_kv": "column", "relpos_buckets": "none", "layers": "batch", "stack": "batch",
    "q_wi_fused": "column", "o_wo_fused": "column", "multiquery_heads": "column",
    "kv_fused": "column", "layer_norm_scale": "none", "mlp_activations": "column",
}
_T5X_ROLE_NAMES = {"row": "row", "col": "column", "column": "column", "batch": "batch",
                   "none": "none", "unfactorized": "none"}


def _t5x_role(value: Any, where: str) -> str:
  """A T5X ``FactorDim`` member, its name, or T5X's role string, as a role name."""
  if value is None:
    return "none"
  name = getattr(value, "name", value)
  if isinstance(name, str) and name.lower() in _T5X_ROLE_NAMES:
    return _T5X_ROLE_NAMES[name.lower()]
  raise ValueError(f"{where}: unknown T5X factor role {value!r}; use one of "
                   f"{sorted(_T5X_ROLE_NAMES)} or a FactorDim")


def _t5x_roles(rule: Sequence[Any] | None, shape: tuple[int, ...],
               where: str) -> tuple[str, ...] | None:
  """T5X's ``_parse_rule`` as per-axis roles (``None``: the heuristic)."""
  if rule is None:
    return ("none",) * len(shape)
  roles = tuple(_t5x_role(value, where) for value in rule)
  if len(roles) != len(shape):
    raise ValueError(f"{where}: factor rule {tuple(rule)} has {len(roles)} axes for a param "
                     f"of shape {shape}")
  if len(shape) <= 2 and "batch" not in roles:
    return None  # T5X ignores the rule of a matrix without batch axes
  if ("row" in roles) != ("column" in roles):
    # Rows without columns (or the reverse): T5X's logical rules make such a leaf NONE;
    # its factor_map keeps one full-size statistic and its own mean, the same estimate.
    roles = tuple("none" if role in ("row", "column") else role for role in roles)
  return roles


def _t5x_factor_rules(factor_map: Any, logical_factor_rules: Any,
                      param_logical_axes: Any) -> Callable[[Any, tuple[int, ...]], Any]:
  """``factor_rules`` for safefactor from T5X's ``factor_map`` or logical rules."""
  if param_logical_axes is not None:
    rules = (_T5X_STANDARD_RULES if logical_factor_rules == "standard"
             else logical_factor_rules)
    names = {preset_assembly.path_name(path): tuple(axes) for path, axes in
             jax.tree_util.tree_flatten_with_path(
                 param_logical_axes, is_leaf=lambda x: isinstance(x, tuple))[0]}

    def roles_of(name: str, axes: tuple[Any, ...], shape: tuple[int, ...]) -> Any:
      roles = []
      for axis in axes:
        if axis is not None and axis not in rules:
          raise ValueError(f"params/{name}: no logical factor rule for axis {axis!r}")
        roles.append(_t5x_role(None if axis is None else rules[axis], f"params/{name}"))
      if "row" in roles and "column" in roles and "none" in roles:
        raise ValueError(f"params/{name}: incomplete Adafactor spec {tuple(roles)} for "
                         f"{axes}")
      return _t5x_roles(tuple(roles), shape, f"params/{name}")

    return plan.NamedParamRules(names, preset_assembly.path_name, roles_of,
                                "param_logical_axes")

  pairs = list(factor_map.items() if isinstance(factor_map, Mapping) else factor_map)
  compiled = [(re.compile(pattern), rule) for pattern, rule in pairs]

  def factor_rules(path, shape):
    name = preset_assembly.path_name(path)
    for pattern, rule in compiled:
      if pattern.search(name):
        return _t5x_roles(rule, tuple(shape), f"params/{name}")
    raise ValueError(f"params/{name}: no factor rule in factor_map matches")

  return factor_rules


def _t5x_lr_scaled_decay(rate: Any, learning_rate: Any, exponent: Any) -> Any:
  """T5X's ``(rate or 1.0) * learning_rate ** exponent`` (a rate of 0 is taken as none given),
  a schedule when either is one (a rate schedule, safefactor's, as it is); an injected
  exponent of 0 leaves the rate as given (none: 0), as T5X's ``if exponent`` does."""
  rate_or_one = rate if callable(rate) else (
      jnp.where(rate != 0, rate, 1.0) if preset_assembly.injected(rate) else rate or 1.0)

  def at(count):
    decay = (preset_assembly.value_at(rate_or_one, count)
             * preset_assembly.value_at(learning_rate, count) ** exponent)
    if preset_assembly.injected(exponent):
      as_given = 0.0 if rate is None else preset_assembly.value_at(rate, count)
      decay = jnp.where(exponent != 0, decay, as_given)
    return decay

  return at if callable(learning_rate) or callable(rate) else at(None)


def t5x(
    learning_rate: optax.ScalarOrSchedule,
    factored: bool = True,
    multiply_by_parameter_scale: bool = True,
    beta1: float | None = None,
    decay_rate: float = 0.8,
    step_offset: int = 0,
    clipping_threshold: float | None = 1.0,
    weight_decay_rate: float | None = None,
    min_dim_size_to_factor: int = 128,
    epsilon1: float = 1e-30,
    epsilon2: float = 1e-3,
    dtype_momentum: DTypeLike | None = "float32",
    factor_map: Any = None,
    logical_factor_rules: Mapping[str, Any] | str | None = None,
    weight_decay_rate_lr_exponent: float | None = None,
    global_norm_clip_threshold: float | None = None,
    max_parameter_scale: float | None = None,
    *,
    param_logical_axes: Any = None,
    **overrides: Any,
) -> optax.GradientTransformationExtraArgs:
  r"""T5X's Adafactor (``t5x.adafactor.Adafactor``), with its arguments and defaults.

  T5X's algorithm is the paper's with optax's defaults: ``epsilon1`` added to
  :math:`g^2`, :math:`\beta_t = 1 - (t+1)^{-\text{decay\_rate}}` from ``step_offset``,
  clipping, the parameter scale :math:`\min(\max(\mathrm{rms}(p), \text{epsilon2}),
  \text{max\_parameter\_scale})`, ``beta1`` momentum of the scaled update, and weight
  decay ``p *= 1 - weight_decay_rate`` (times ``learning_rate **
  weight_decay_rate_lr_exponent`` when that is set), all in float32. The arguments map
  one to one onto ``safefactor``'s; ``global_norm_clip_threshold`` becomes
  ``optax.clip_by_global_norm`` before it. T5X's ``beta1 * state.m`` decays the stored
  momentum by ``beta1`` rounded to ``dtype_momentum`` (JAX gives the Python float the
  array's dtype: 0.9 is 0.8984375 in bfloat16), while the new term keeps ``1 - beta1``;
  the preset passes safefactor the rounded ``beta1`` and scales its learning rate by
  ``(1 - beta1) / (1 - rounded)``, which is T5X's blend, as the big_vision preset does.

  Factor rules: T5X's ``FactorDim`` ``ROW``, ``COLUMN``, ``BATCH`` and ``NONE`` are
  safefactor's roles ``"row"``, ``"column"``, ``"batch"`` and ``"none"`` (a ``BATCH``
  axis is a separate slice for the statistics, clipping and the parameter scale in both).
  ``factor_map`` is T5X's ``HParamMap`` rules, ``(regex, rule)`` pairs searched in order
  against the ``/``-joined parameter path, a rule being a tuple of roles (``FactorDim``
  members or T5X's names ``"row"``, ``"col"``, ``"batch"``, ``"none"``) or ``None`` for no
  factoring. ``logical_factor_rules`` (a mapping from logical axis name to role, or
  ``"standard"`` for T5X's ``standard_logical_factor_rules()``) with
  ``param_logical_axes`` (a tree like the params of tuples of logical axis names, what
  T5X passes to ``set_param_axes``) works as in T5X. Either way a leaf with rows but no
  columns (or the reverse) is unfactored, keeping its batch axes (T5X's logical rules
  make it so; its ``factor_map`` keeps a full-size statistic and its own mean, the same
  estimate); a rule of a leaf of rank 2 or below without a batch axis is ignored for the
  heuristic, as T5X ignores it. With safefactor's own
  names the same is ``factor_rules=osf.logical_factor_rules(axis_names, rules)``, whose
  :data:`~optax_safefactor.DEFAULT_LOGICAL_RULES` make ``layers``, ``stack``, ``expert``
  axes ``"batch"`` and leave the rest to the heuristic.

  Measured against a float64 restatement of T5X's source (``tests/test_presets.py``),
  30 steps on tall, wide, vector, stacked 3-D (with a ``BATCH`` axis), partly zero and
  all-zero leaves, with and without factoring, momentum, weight decay, clipping, global
  norm clipping and the parameter scale: the updates differ by at most 6.4e-16 (float64)
  and 3.1e-7 (float32) of the leaf's largest update, beyond one ulp of the param.

  Differences by design: before ``step_offset`` T5X's decay raises a negative number to a
  fractional power (NaN); the preset clamps the local step at 0. A leaf of rank above 2
  without a rule is an error in T5X; the preset factors its two largest axes (optax's
  heuristic). ``skip_nan_updates`` (T5X keeps the old value of each NaN element) is not
  taken: safefactor skips a non-finite step as a whole (on by default).
  ``multiply_by_parameter_scale`` is a bool (an ``HParamMap`` of bools is refused).
  T5X casts every gradient to float32 and keeps float32 statistics; for float64 params
  the preset, like safefactor, computes and keeps them in float64.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_safefactor as osf
    >>> tx = osf.presets.t5x(1e-2, logical_factor_rules="standard",
    ...                      param_logical_axes={"mlp": ("layers", "embed", "mlp")})
    >>> state = tx.init({"mlp": jnp.ones((2, 256, 512))})
    >>> state.inner_state.second_moment["mlp"].v_row.shape
    (2, 256, 1)

  Args:
    learning_rate: a number or an optax schedule (T5X's schedule of the step); ``None``
      is refused, as T5X asserts that one is given.
    factored: whether to factor second moments at all.
    multiply_by_parameter_scale: scale the step by the parameter's RMS.
    beta1: momentum of the scaled update, or ``None``.
    decay_rate: exponent of the second-moment decay.
    step_offset: step at which the decay schedule starts (fine-tuning).
    clipping_threshold: clip the scaled gradient to this RMS, or ``None``.
    weight_decay_rate: decoupled weight decay (not scaled by the learning rate), a number
      or an optax schedule, or ``None``.
    min_dim_size_to_factor: factor when both chosen axes have this size (heuristic).
    epsilon1: added to :math:`g^2`.
    epsilon2: the smallest parameter scale.
    dtype_momentum: the momentum's dtype name.
    factor_map: ``(regex, rule)`` pairs, as T5X's ``HParamMap``.
    logical_factor_rules: logical axis name -> role, or ``"standard"`` (without
      ``factored`` T5X ignores it, and a warning says so).
    weight_decay_rate_lr_exponent: weight decay ``(weight_decay_rate or 1) * lr **`` this.
    global_norm_clip_threshold: clip the gradients' global norm to this first.
    max_parameter_scale: the largest parameter scale, or ``None``.
    param_logical_axes: logical axis names per parameter, for ``logical_factor_rules``.
    **overrides: further keyword arguments of :func:`optax_safefactor.safefactor`.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs`.

  Raises:
    ValueError: as T5X raises (``factored=False`` with a ``factor_map``, a rule of the
      wrong rank, an incomplete logical spec), for logical rules without
      ``param_logical_axes`` or the reverse, for ``skip_spikes`` with
      ``global_norm_clip_threshold`` (the spike rule would see clipped gradients; the
      message gives the chain that clips inside the guard), and for values ``safefactor``
      refuses.
    TypeError: for a non-bool ``factored`` or ``multiply_by_parameter_scale``, a number
      that is not one (a ``learning_rate`` of ``None``, say), or an override this
      preset sets itself or ``safefactor`` does not know.
  """
  taken = {"learning_rate": "learning_rate", "factored": "factored",
           "multiply_by_parameter_scale": "multiply_by_parameter_scale", "momentum": "beta1",
           "decay_rate": "decay_rate", "decay_offset": "step_offset",
           "clipping_threshold": "clipping_threshold",
           "weight_decay_rate": "weight_decay_rate and weight_decay_rate_lr_exponent",
           "min_dim_size_to_factor": "min_dim_size_to_factor", "eps": "epsilon1",
           "min_parameter_scale": "epsilon2", "dtype_momentum": "dtype_momentum",
           "factor_rules": "factor_map, logical_factor_rules and param_logical_axes",
           "max_parameter_scale": "max_parameter_scale"}
  if "skip_nan_updates" in preset_assembly.given(overrides):
    raise TypeError(
        "presets.t5x(): skip_nan_updates is not taken: T5X keeps each NaN element's old "
        "value, safefactor skips a non-finite step as a whole (skip_nonfinite_steps=True, "
        "the default)")
  overrides = preset_assembly.check_overrides(t5x, overrides, taken)
  preset_assembly.check_switches("t5x", factored=factored,
                                 multiply_by_parameter_scale=multiply_by_parameter_scale)
  # T5X asserts that a learning rate is given; safefactor would take None as "unscaled".
  preset_assembly.check_number("t5x", "learning_rate", learning_rate, "finite",
                               math.isfinite, schedule_ok=True)
  preset_assembly.check_number("t5x", "global_norm_clip_threshold", global_norm_clip_threshold,
                               "non-negative and finite (0 or None: no clipping, as in T5X)",
                               lambda x: 0 <= x < math.inf, none_ok=True)
  preset_assembly.check_number("t5x", "weight_decay_rate_lr_exponent",
                               weight_decay_rate_lr_exponent, "finite (or None)", math.isfinite,
                               none_ok=True)
  # T5X ignores these silently; a value chosen for them is warned of.
  if beta1 is None:
    preset_assembly.warn_unused(t5x, {"dtype_momentum": dtype_momentum},
                                "beta1 is None (no momentum)")
  if not multiply_by_parameter_scale:
    preset_assembly.warn_unused(t5x, {"epsilon2": epsilon2,
                                      "max_parameter_scale": max_parameter_scale},
                                "multiply_by_parameter_scale is False")
  if not factored:
    preset_assembly.warn_unused(t5x, {"min_dim_size_to_factor": min_dim_size_to_factor,
                                      "logical_factor_rules": logical_factor_rules},
                                "factored is False")
  clip = global_norm_clip_threshold
  if preset_assembly.is_set(clip) and overrides.get("skip_spikes") is not None:
    # The spike rule judges the gradients safefactor is given: behind the clip every step,
    # a spike included, arrives at the clip's norm, and no spike would ever be skipped.
    raise ValueError(
        "presets.t5x(): skip_spikes judges the gradients' norm, and global_norm_clip_threshold "
        "clips it first: once the usual norm is above the threshold every step arrives at it "
        "and no spike is skipped. Clip inside the guard instead: osf.skip_nonfinite(optax.chain("
        f"optax.clip_by_global_norm({global_norm_clip_threshold!r}), osf.presets.t5x(..., "
        f"skip_nonfinite_steps=False)), skip_spikes={overrides['skip_spikes']!r})")
  if not factored and factor_map is not None:
    raise ValueError("Adafactor factored is False but factorization rules have been provided.")
  if (logical_factor_rules is None) != (param_logical_axes is None):
    raise ValueError("logical_factor_rules and param_logical_axes go together: T5X applies "
                     "the rules to the axes it gets from set_param_axes")
  factor_rules = None
  if factored and (factor_map is not None or param_logical_axes is not None):
    factor_rules = _t5x_factor_rules(factor_map, logical_factor_rules, param_logical_axes)
  if preset_assembly.is_set(weight_decay_rate_lr_exponent):
    weight_decay_rate = _t5x_lr_scaled_decay(weight_decay_rate, learning_rate,
                                             weight_decay_rate_lr_exponent)
  beta1, factor = _momentum_as_stored(beta1, dtype_momentum, "presets.t5x(): beta1")
  if factor is not None:
    learning_rate = preset_assembly.times(factor, learning_rate)
  settings = dict(
      learning_rate=learning_rate, factored=factored,
      multiply_by_parameter_scale=multiply_by_parameter_scale, momentum=beta1,
      decay_rate=decay_rate, decay_offset=step_offset, clipping_threshold=clipping_threshold,
      weight_decay_rate=weight_decay_rate, min_dim_size_to_factor=min_dim_size_to_factor,
      eps=epsilon1, min_parameter_scale=epsilon2, dtype_momentum=dtype_momentum,
      factor_rules=factor_rules, max_parameter_scale=max_parameter_scale)
  if preset_assembly.injected(clip):  # an injected 0 is no clipping, as a number 0 is
    # (clip's largest value, not Inf, which jax_debug_infs would stop at: no norm reaches it)
    clip = jnp.where(clip > 0, clip, float(jnp.finfo(clip.dtype).max))
  before = [optax.clip_by_global_norm(clip)] if preset_assembly.is_set(clip) else []
  return preset_assembly.build("t5x", settings, overrides, taken=taken, before=before)
