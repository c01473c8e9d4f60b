"""transformers' and torch's Adafactor (the PyTorch ones) as ``safefactor`` presets."""

from __future__ import annotations

import inspect
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_safefactor._src import kernel, numerics, preset_assembly, user_warnings


def _last_two_axes(path: Any, shape: tuple[int, ...]) -> tuple[str, ...] | None:
  """PyTorch's rule: a tensor of rank 2 or more is factored over its last two axes; the
  leading axes keep their size in both statistics, and clipping and the parameter scale
  span the whole tensor."""
  del path
  if len(shape) < 2:
    return None
  return ("none",) * (len(shape) - 2) + ("row", "column")


_FACTORED_AXES = "(the last two axes of every tensor of rank 2 or more, as in PyTorch)"


class _CountState(NamedTuple):
  count: jax.Array


def _decay_scaled_by_param_rms(weight_decay: float, learning_rate: optax.ScalarOrSchedule,
                               min_scale: float) -> optax.GradientTransformation:
  """Adds ``-weight_decay * lr_t * max(rms(p), min_scale) * p``: HF's decay under
  ``scale_parameter`` (its ``lr`` includes the parameter scale)."""

  def init(params):
    del params
    return _CountState(jnp.zeros((), jnp.int32))

  def update(updates, state, params=None):
    if params is None:
      raise ValueError("presets.transformers(): weight_decay with scale_parameter needs params")
    rate = preset_assembly.value_at(learning_rate, state.count)

    def decayed(u, p):
      # In float32 at least (float64 for float64 leaves), as safefactor computes.
      ct = u.dtype if jnp.finfo(u.dtype).bits >= 32 else jnp.dtype(jnp.float32)
      wide = p.astype(ct)
      # The RMS of |p|, as safefactor's parameter scale reads it: a complex param's scale is
      # real (HF's norm is of |p| too), where the mean of p**2 is a complex number.
      rms = numerics.root_of_squares(jnp.mean(kernel.abs_sq(wide)))
      scale = jnp.maximum(rms, jnp.asarray(min_scale, rms.dtype)).astype(ct)
      decay = (jnp.asarray(weight_decay * rate, ct) * scale) * wide
      return (u.astype(ct) - decay).astype(u.dtype)

    return jax.tree.map(decayed, updates, params), _CountState(optax.safe_increment(state.count))

  return optax.GradientTransformation(init, update)


# transformers -------------------------------------------------------------------------


def transformers(
    lr: optax.ScalarOrSchedule | None = None,
    eps: tuple[float, float] = (1e-30, 1e-3),
    clip_threshold: float = 1.0,
    decay_rate: float = -0.8,
    beta1: float | None = None,
    weight_decay: float = 0.0,
    scale_parameter: bool = True,
    relative_step: bool = True,
    warmup_init: bool = False,
    **overrides: Any,
) -> optax.GradientTransformationExtraArgs:
  r"""Hugging Face ``transformers.optimization.Adafactor`` (also timm's ``Adafactor``).

  Same arguments and defaults, same updates: :math:`\beta_{2,t} = 1 - t^{\text{decay\_rate}}`
  (step :math:`t` from 1), ``eps[0]`` added to :math:`g^2`, a tensor of rank 2 or more
  factored over its last two axes (the leading ones kept, clipping and the parameter scale
  over the whole tensor), the update clipped to RMS ``clip_threshold``, then scaled by

  - ``relative_step=True``: :math:`\rho_t = \min(10^{-2}, 1/\sqrt t)`, or with
    ``warmup_init`` :math:`\min(10^{-6} t, 1/\sqrt t)`, a schedule; else ``lr``;
  - ``scale_parameter=True``: times :math:`\max(\text{eps[1]}, \mathrm{rms}(p))`
    (``multiply_by_parameter_scale`` with ``min_parameter_scale=eps[1]``);

  then ``beta1`` momentum (kept as HF keeps ``exp_avg``: in the params' dtype, at least
  float32), and weight decay as HF applies it,
  ``p -= weight_decay * lr_t * p`` with the scaled ``lr_t`` above, before the update.

  Measured against transformers 5.25.0 on torch 2.13.0 (``tests/test_presets.py``), 30
  steps on tall, wide, vector, stacked 3-D, partly zero and all-zero leaves, with and
  without ``beta1``, ``weight_decay``, ``scale_parameter``, ``relative_step`` and
  ``warmup_init``: the updates differ by at most 3.4e-7 (float32) and 9.0e-16 (float64)
  of the leaf's largest update, beyond the one ulp of the param by which the two
  roundings of ``param + update`` may differ.

  Late in a run the float32 statistics drift apart a little: safefactor blends with
  :math:`1 - \beta_{2,t}` computed in float32 from :math:`\beta_{2,t}` rounded to float32,
  which is off by up to :math:`6\cdot 10^{-8}/(1-\beta_{2,t})` relative, where HF's
  weight is a double (after a jump to step 40001 the updates differed by 1.2e-5 of the
  largest). The relative step's :math:`1/\sqrt t` branch (after step :math:`10^4`) is
  checked that way.

  Differences by design: safefactor's statistics start at a floor instead of 0 (the
  first step's :math:`\beta_2` is 0, so nothing of it remains); with ``eps[0] = 0`` HF
  divides 0 by 0 on an all-zero row, where safefactor floors the statistic; a
  non-finite step is skipped (``skip_nonfinite_steps=False`` turns that off); a
  ``clip_threshold`` of 0 or ``None`` is refused (``ValueError``), where HF divides by it.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_safefactor as osf
    >>> tx = osf.presets.transformers(lr=1e-3, relative_step=False, scale_parameter=False)
    >>> params = {"w": jnp.ones((4, 3))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones((4, 3))}, state, params)
    >>> print(f"{float(updates['w'][0, 0]):.4f}")
    -0.0010

  Args:
    lr: the external learning rate (a number or an optax schedule); needs
      ``relative_step=False``.
    eps: ``(eps1, eps2)``: added to :math:`g^2`, and the smallest parameter scale.
    clip_threshold: the largest RMS of the scaled gradient.
    decay_rate: :math:`\beta_{2,t} = 1 - t^{\text{decay\_rate}}`; negative.
    beta1: momentum of the (scaled) update, or ``None``.
    weight_decay: HF's decay, ``p -= weight_decay * lr_t * p``; ``weight_decay_mask``
      (an override) says which params it reaches, under ``scale_parameter`` too.
    scale_parameter: scale the step by the parameter's RMS.
    relative_step: use :math:`\min(10^{-2}, 1/\sqrt t)` as the learning rate.
    warmup_init: with ``relative_step``, :math:`\min(10^{-6} t, 1/\sqrt t)` instead.
    **overrides: further keyword arguments of :func:`optax_safefactor.safefactor`.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs`.

  Raises:
    ValueError: as HF raises (``lr`` with ``relative_step``, ``warmup_init`` without it),
      for no learning rate at all, a non-negative ``decay_rate``, a ``clip_threshold``
      that is not positive and finite.
    TypeError: for a number that is not one (a string, say), a switch that is not True or
      False, or an override this preset sets itself or ``safefactor`` does not know.
  """
  taken = {"learning_rate": "lr, relative_step and warmup_init", "eps": "eps[0]",
           "min_parameter_scale": "eps[1]", "clipping_threshold": "clip_threshold",
           "decay_rate": "decay_rate", "momentum": "beta1",
           "weight_decay_rate": "weight_decay and lr", "factor_rules": _FACTORED_AXES,
           "factored": _FACTORED_AXES, "min_dim_size_to_factor": _FACTORED_AXES,
           "multiply_by_parameter_scale": "scale_parameter"}
  overrides = preset_assembly.check_overrides(transformers, overrides, taken)
  preset_assembly.check_switches("transformers", scale_parameter=scale_parameter,
                                 relative_step=relative_step, warmup_init=warmup_init)
  eps1, eps2 = _pair("transformers", eps)
  for name, value, schedule_ok in (("lr", lr, True), ("eps[0]", eps1, False),
                                   ("eps[1]", eps2, False)):
    preset_assembly.check_number("transformers", name, value, "at least 0 and finite",
                                 lambda x: 0 <= x < math.inf, none_ok=name == "lr",
                                 schedule_ok=schedule_ok)
  preset_assembly.check_number("transformers", "clip_threshold", clip_threshold,
                               "positive and finite", lambda x: 0 < x < math.inf)
  preset_assembly.check_number("transformers", "decay_rate", decay_rate,
                               "negative (beta2 = 1 - t**decay_rate)", lambda x: x < 0)
  preset_assembly.check_number("transformers", "beta1", beta1, "in [0, 1) (or None)",
                               lambda x: 0 <= x < 1, none_ok=True)
  preset_assembly.check_number("transformers", "weight_decay", weight_decay, "finite",
                               math.isfinite)
  if not scale_parameter and eps2 != inspect.signature(transformers).parameters["eps"].default[1]:
    # HF ignores it silently; a value chosen for it is warned of.
    user_warnings.warn(f"presets.transformers(): eps[1]={eps2!r} has no effect: scale_parameter is "
                       "False")
  if lr is not None and relative_step:
    # transformers' words, then what to pass: relative_step defaults to True there.
    raise ValueError("Cannot combine manual `lr` and `relative_step=True` options: pass "
                     "relative_step=False to train at lr (relative_step is True by default, "
                     "as in transformers), or lr=None for the relative step size")
  if warmup_init and not relative_step:
    raise ValueError("`warmup_init=True` requires `relative_step=True`")
  if lr is None and not relative_step:
    raise ValueError("lr=None with relative_step=False leaves no learning rate; give lr")
  if relative_step:
    def learning_rate(count):
      step = preset_assembly.one_based_step(count)
      start = 1e-6 * step if warmup_init else 1e-2
      return jnp.minimum(start, jax.lax.rsqrt(step))
  else:
    learning_rate = lr
  settings = dict(
      learning_rate=learning_rate, decay_rate=-decay_rate, eps=eps1,
      min_parameter_scale=eps2, multiply_by_parameter_scale=scale_parameter,
      clipping_threshold=clip_threshold, momentum=beta1, factor_rules=_last_two_axes,
      dtype_momentum="at_least_float32")
  after = []
  if preset_assembly.is_set(weight_decay):
    if scale_parameter:
      decay = _decay_scaled_by_param_rms(weight_decay, learning_rate, eps2)
      # safefactor's weight_decay_mask says which params its own decay reaches: this
      # decay is a step of its own, so the mask goes with it.
      mask = overrides.get("weight_decay_mask")
      if mask is not None:
        overrides = {name: value for name, value in overrides.items()
                     if name != "weight_decay_mask"}
        decay = optax.masked(decay, mask)
      after.append(decay)
    else:
      settings["weight_decay_rate"] = preset_assembly.times(weight_decay, learning_rate)
  return preset_assembly.build("transformers", settings, overrides, taken=taken, after=after)


def _pair(preset: str, eps: Any) -> tuple[Any, Any]:
  """``eps`` as ``(eps[0], eps[1])``; a single number is refused naming the pair."""
  if not isinstance(eps, (tuple, list)) or len(eps) != 2:
    raise TypeError(f"presets.{preset}(): eps must be a pair (eps[0], eps[1]), as in torch, "
                    f"got {eps!r}")
  return eps[0], eps[1]


# torch ----------------------------------------------------------------------------------


def torch(
    lr: optax.ScalarOrSchedule = 1e-2,
    beta2_decay: float = -0.8,
    eps: tuple[float | None, float] = (None, 1e-3),
    d: float = 1.0,
    weight_decay: float = 0.0,
    *,
    foreach: bool | None = None,
    maximize: bool = False,
    **overrides: Any,
) -> optax.GradientTransformationExtraArgs:
  r"""``torch.optim.Adafactor`` (PyTorch 2.5 and later), with its arguments and defaults.

  PyTorch's variant differs from the paper, and the preset follows it: no epsilon is
  added to :math:`g^2`; the step size is :math:`\alpha_t = \max(\text{eps[1]},
  \mathrm{rms}(p)) \min(\text{lr}, 1/\sqrt t)` (the parameter scale is always on, ``lr``
  caps the relative step); :math:`\beta_{2,t} = 1 - t^{\text{beta2\_decay}}`; the update
  is clipped to RMS ``d``; weight decay is ``p *= 1 - lr * weight_decay``, with the
  plain ``lr``; a tensor of rank 2 or more is factored over its last two axes (the
  leading ones kept, clipping and the parameter scale over the whole tensor);
  ``maximize`` negates the gradient. ``foreach`` picks PyTorch's loop and changes no
  number, so it is accepted and has no effect.

  Measured against torch 2.13.0 (``tests/test_presets.py``), 30 steps on tall, wide,
  vector, stacked 3-D, partly zero and all-zero leaves, with and without ``weight_decay``,
  ``maximize`` and a relative step that ``lr`` caps: the updates differ by at most 5.2e-7
  (float32) and 1.5e-15 (float64) of the leaf's largest update, beyond the one ulp of the
  param by which the two roundings of ``param + update`` may differ.

  Like HF's, PyTorch's mixing weight :math:`t^{\text{beta2\_decay}}` is a double, where
  safefactor's float32 :math:`1 - \beta_{2,t}` is off by up to
  :math:`6\cdot 10^{-8}/(1-\beta_{2,t})` relative: a difference that grows late in a run.

  Differences by design, both only for tiny gradients:

  - PyTorch floors :math:`\hat v` at :math:`\epsilon_1^2` (hard); the preset adds
    ``eps = eps1**2`` to :math:`g^2` (soft), so the two agree to a relative
    :math:`\epsilon_1^2/\hat v` and on elements near that floor differ by at most a
    factor :math:`\sqrt 2`. With ``eps[0]=None`` PyTorch takes ``finfo(param.dtype).eps``
    per parameter; the preset takes float32's (1.19e-7) for every parameter: pass
    ``eps=(2.2e-16, 1e-3)`` for float64's.
  - PyTorch floors the row-mean normaliser at :math:`\epsilon_1`, which for a tensor
    (or leading slice) whose mean :math:`\bar r` of :math:`g^2` is below it scales the
    update by :math:`s = \sqrt{\epsilon_1/\bar r}` before clipping; the preset does not.
    PyTorch's update is then between 1 and :math:`s` times the preset's, in the same
    direction (equal whenever both are clipped).

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_safefactor as osf
    >>> tx = osf.presets.torch(lr=1e-2)
    >>> params = {"w": jnp.ones((4, 3))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones((4, 3))}, state, params)
    >>> print(f"{float(updates['w'][0, 0]):.4f}")
    -0.0100

  Args:
    lr: the cap on the relative step :math:`\min(\text{lr}, 1/\sqrt t)` and the weight
      decay's multiplier (a number or an optax schedule).
    beta2_decay: :math:`\beta_{2,t} = 1 - t^{\text{beta2\_decay}}`; negative.
    eps: ``(eps1, eps2)``: the floor of :math:`\hat v` (as ``eps1**2``; ``None`` for
      float32's machine epsilon) and the smallest parameter scale.
    d: the largest RMS of the update before the step size (at least 1 here).
    weight_decay: decoupled decay, ``p *= 1 - lr * weight_decay``.
    foreach: accepted for PyTorch's signature; no effect.
    maximize: ascend the objective instead.
    **overrides: further keyword arguments of :func:`optax_safefactor.safefactor`.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs`.

  Raises:
    ValueError: for a negative ``lr``, ``eps`` or ``weight_decay``, a non-negative
      ``beta2_decay``, ``d`` below 1.
    TypeError: for a number that is not one (a string, say), a switch that is not True or
      False, or an override this preset sets itself or ``safefactor`` does not know.
  """
  del foreach
  taken = {"learning_rate": "lr", "eps": "eps[0]", "min_parameter_scale": "eps[1]",
           "clipping_threshold": "d", "decay_rate": "beta2_decay",
           "weight_decay_rate": "weight_decay and lr", "factor_rules": _FACTORED_AXES,
           "factored": _FACTORED_AXES, "min_dim_size_to_factor": _FACTORED_AXES,
           "multiply_by_parameter_scale": "(always on in torch.optim.Adafactor)"}
  overrides = preset_assembly.check_overrides(torch, overrides, taken)
  preset_assembly.check_switches("torch", maximize=maximize)
  eps1, eps2 = _pair("torch", eps)
  eps1 = float(np.finfo(np.float32).eps) if eps1 is None else eps1
  for name, value in (("lr", lr), ("eps[0]", eps1), ("eps[1]", eps2),
                      ("weight_decay", weight_decay)):
    preset_assembly.check_number("torch", name, value, "at least 0 and finite",
                                 lambda x: 0 <= x < math.inf, schedule_ok=name == "lr")
  preset_assembly.check_number("torch", "beta2_decay", beta2_decay,
                               "negative (beta2 = 1 - t**beta2_decay)", lambda x: x < 0)
  preset_assembly.check_number("torch", "d", d, "at least 1 here", lambda x: x >= 1)

  def relative_step(count):
    step = preset_assembly.one_based_step(count)
    return jnp.minimum(preset_assembly.value_at(lr, count), jax.lax.rsqrt(step))

  settings = dict(
      learning_rate=relative_step, decay_rate=-beta2_decay, eps=eps1 * eps1,
      min_parameter_scale=eps2, multiply_by_parameter_scale=True, clipping_threshold=d,
      factor_rules=_last_two_axes,
      weight_decay_rate=(preset_assembly.times(weight_decay, lr)
                         if preset_assembly.is_set(weight_decay) else None))
  before = [optax.scale(-1.0)] if maximize else []
  return preset_assembly.build("torch", settings, overrides, taken=taken, before=before)
