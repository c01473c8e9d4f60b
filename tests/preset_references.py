"""big_vision's and T5X's Adafactor restated in float64 NumPy, for ``tests/test_presets.py``.

Neither library installs as a package, so each is restated here from its source:
big_vision's ``big_vision/optax.py`` (``scale_by_adafactor`` inside the chain that
``make`` builds) and T5X's ``t5x/adafactor.py`` (``Adafactor.apply_param_gradient``).
Both keep the paper's factored second moment with ``eps`` added to ``g**2`` and no
floor; the statistics start at zero. Arrays keep every axis here (keepdims), which
changes no number. A leaf's plan is ``(row_axes, col_axes, batch_axes)``, or ``None``
for an unfactored leaf.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np


def heuristic_plan(shape, min_dim_size_to_factor):
  """optax's and T5X's rule: the largest axis is the column axis, the second largest the
  row axis, when it has at least ``min_dim_size_to_factor`` elements."""
  if len(shape) < 2:
    return None
  by_size = sorted(range(len(shape)), key=lambda axis: shape[axis])
  row, col = by_size[-2], by_size[-1]
  if shape[row] < min_dim_size_to_factor:
    return None
  return (row,), (col,), ()


def _stored(x: np.ndarray, dtype, compute_dtype) -> np.ndarray:
  """``x`` as the state keeps it: computed in ``compute_dtype``, stored in ``dtype``.

  JAX (XLA) converts to a type narrower than float32 through float32, as big_vision's
  ``tree_cast`` of the momentum does in float64 runs; so does this.
  """
  x = np.asarray(x).astype(compute_dtype)
  if np.dtype(dtype).itemsize < 4:
    x = x.astype(np.float32)
  return np.asarray(x.astype(dtype), np.float64)


class _SecondMoment:
  """The factored (or full) second moment of one leaf, started at zero."""

  def __init__(self, shape, plan):
    self.plan = plan
    if plan is None:
      self.v = np.zeros(shape)
    else:
      rows, cols, _ = plan
      self.row = np.zeros([1 if a in cols else s for a, s in enumerate(shape)])
      self.col = np.zeros([1 if a in rows else s for a, s in enumerate(shape)])

  def scaled(self, g: np.ndarray, beta2: float, eps: float) -> np.ndarray:
    """Blend ``g**2 + eps`` in and return ``g / sqrt(v_hat)``."""
    squares = g * g + eps
    if self.plan is None:
      self.v = beta2 * self.v + (1 - beta2) * squares
      return g / np.sqrt(self.v)
    rows, cols, _ = self.plan
    self.row = beta2 * self.row + (1 - beta2) * squares.mean(cols, keepdims=True)
    self.col = beta2 * self.col + (1 - beta2) * squares.mean(rows, keepdims=True)
    normaliser = self.row.mean(rows, keepdims=True)
    return g * (self.row / normaliser) ** -0.5 * self.col ** -0.5


def _decay_of(momentum: float, dtype) -> float:
  """What ``momentum * m`` multiplies a momentum ``m`` stored in ``dtype`` by.

  Both sources write the decay of the stored momentum as a Python float times it, and
  JAX gives a Python scalar the array's dtype: with bfloat16 momentum 0.9 decays by
  0.8984375, while the new term still enters with ``1 - 0.9`` in the update's dtype.
  (Whether the product is then rounded to ``dtype`` too is left to XLA's excess
  precision; that rounding is left out here.)
  """
  return float(np.asarray(momentum, np.float64).astype(dtype))


def _rms(x: np.ndarray, keep_axes=()) -> np.ndarray:
  axes = tuple(a for a in range(x.ndim) if a not in keep_axes)
  return np.sqrt(np.mean(x * x, axis=axes, keepdims=True))


@dataclass
class BigVisionAdafactor:
  """big_vision's ``optax.chain`` around ``scale_by_adafactor``, for one flat dict.

  ``learning_rate`` is ``config.lr``, ``schedule`` ``config.schedule`` (``None``: 1),
  ``wd`` ``config.wd`` on the leaves ``wd_mask`` names. The momentum is stored in
  ``momentum_dtype``, rounded from ``compute_dtype`` (float32 when the run is), and
  decays by ``momentum`` as that dtype holds it (optax's ``ema``: ``decay * ema``).
  """

  learning_rate: float
  schedule: Callable[[int], float] | None = None
  wd: float = 0.0
  wd_mask: dict = field(default_factory=dict)
  min_dim_size_to_factor: int = 32
  decay_rate: float = 0.8
  decay_offset: int = 0
  beta2_cap: float = 0.999
  clipping_threshold: float | None = None
  momentum: float | None = 0.9
  momentum_dtype: Any = ml_dtypes.bfloat16  # or a dtype name
  eps: float = 1e-30
  compute_dtype: Any = np.float64
  count: int = 0

  def init(self, params: dict) -> BigVisionAdafactor:
    self.moments = {name: _SecondMoment(np.shape(p), heuristic_plan(
        np.shape(p), self.min_dim_size_to_factor)) for name, p in params.items()}
    self.ema = {name: np.zeros(np.shape(p)) for name, p in params.items()}
    return self

  def step(self, grads: dict, params: dict) -> dict:
    t = self.count - self.decay_offset + 1.0
    beta2 = min(self.beta2_cap, 1.0 - t ** -self.decay_rate)
    multiplier = 1.0 if self.schedule is None else float(self.schedule(self.count))
    updates = {}
    for name, grad in grads.items():
      g = np.asarray(grad, np.float64)
      u = self.moments[name].scaled(g, beta2, self.eps)
      if self.clipping_threshold:
        u = u / np.maximum(1.0, _rms(u) / self.clipping_threshold)
      if self.momentum:
        u = ((1 - self.momentum) * u
             + _decay_of(self.momentum, self.momentum_dtype) * self.ema[name])
        self.ema[name] = _stored(u, self.momentum_dtype, self.compute_dtype)
      u = self.learning_rate * u
      if self.wd and self.wd_mask.get(name, False):
        u = u + self.wd * np.asarray(params[name], np.float64)
      updates[name] = -multiplier * u
    self.count += 1
    return updates


@dataclass
class T5XAdafactor:
  """T5X's ``Adafactor`` for one flat dict; ``plans`` gives a leaf's plan (``"heuristic"``
  for T5X's default rule), the batch axes are separate slices. The momentum decays by
  ``beta1`` as ``momentum_dtype`` holds it (T5X's ``beta1 * state.m``)."""

  learning_rate: float
  plans: dict = field(default_factory=dict)
  factored: bool = True
  multiply_by_parameter_scale: bool = True
  beta1: float | None = None
  decay_rate: float = 0.8
  step_offset: int = 0
  clipping_threshold: float | None = 1.0
  weight_decay_rate: float | None = None
  min_dim_size_to_factor: int = 128
  epsilon1: float = 1e-30
  epsilon2: float = 1e-3
  max_parameter_scale: float | None = None
  global_norm_clip_threshold: float | None = None
  momentum_dtype: Any = np.float32
  compute_dtype: Any = np.float64
  count: int = 0

  def init(self, params: dict) -> T5XAdafactor:
    self.moments, self.batch_axes = {}, {}
    for name, p in params.items():
      plan = self.plans.get(name, "heuristic") if self.factored else None
      if plan == "heuristic":
        plan = heuristic_plan(np.shape(p), self.min_dim_size_to_factor)
      self.batch_axes[name] = () if plan is None else plan[2]
      if plan is not None and not plan[0]:
        plan = None
      self.moments[name] = _SecondMoment(np.shape(p), plan)
    self.m = {name: np.zeros(np.shape(p)) for name, p in params.items()}
    return self

  def step(self, grads: dict, params: dict) -> dict:
    beta2 = 1.0 - (self.count - self.step_offset + 1.0) ** -self.decay_rate
    grads = {name: np.asarray(g, np.float64) for name, g in grads.items()}
    if self.global_norm_clip_threshold:
      norm = np.sqrt(sum(np.sum(g * g) for g in grads.values()))
      scale = min(1.0, self.global_norm_clip_threshold / norm)
      grads = {name: g * scale for name, g in grads.items()}
    updates = {}
    for name, g in grads.items():
      p = np.asarray(params[name], np.float64)
      batch = self.batch_axes[name]
      step_size = self.learning_rate
      if self.multiply_by_parameter_scale:
        scale = np.maximum(_rms(p, batch), self.epsilon2)
        if self.max_parameter_scale is not None:
          scale = np.minimum(scale, self.max_parameter_scale)
        step_size = step_size * scale
      y = self.moments[name].scaled(g, beta2, self.epsilon1)
      if self.clipping_threshold is not None:
        y = y / np.maximum(1.0, _rms(y, batch) / self.clipping_threshold)
      subtrahend = step_size * y
      if self.beta1 is not None:
        subtrahend = (_decay_of(self.beta1, self.momentum_dtype) * self.m[name]
                      + (1 - self.beta1) * subtrahend)
        self.m[name] = _stored(subtrahend, self.momentum_dtype, self.compute_dtype)
      if self.weight_decay_rate is not None:
        subtrahend = subtrahend + self.weight_decay_rate * p
      updates[name] = -subtrahend
    self.count += 1
    return updates
