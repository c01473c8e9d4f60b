"""Adafactor in float64 NumPy, written from the paper, as the tests' independent reference.

Shazeer and Stern 2018, Algorithms 4 and 5, generalised so that the factored
statistics keep every axis (keepdims): axes that are neither rows nor columns are
batch axes and keep their size in both statistics. Clipping and the parameter scale
span the whole leaf, as in ``optax.adafactor``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def reference_plan(shape, factored: bool = True, min_dim_size_to_factor: int = 128):
  """The factoring rule of ``optax.adafactor``, as ``(row_axes, col_axes)`` or ``None``.

  A leaf of rank 2 or more is factored over its two largest axes when the smaller of
  them has at least ``min_dim_size_to_factor`` elements. The largest axis (the later
  one on a tie) is averaged out of the row statistic (it is the column axis), the
  second largest is the row axis, whose mean of the row statistic is the normaliser.
  """
  if not factored or len(shape) < 2:
    return None
  by_size = sorted(range(len(shape)), key=lambda axis: shape[axis])  # stable: ties keep order
  row_axis, col_axis = by_size[-2], by_size[-1]
  if shape[row_axis] < min_dim_size_to_factor:
    return None
  return (row_axis,), (col_axis,)


@dataclass
class ReferenceAdafactor:
  learning_rate: float | None = None
  decay_rate: float = 0.8
  decay_offset: int = 0
  multiply_by_parameter_scale: bool = True
  clipping_threshold: float | None = 1.0
  momentum: float | None = None
  weight_decay_rate: float | None = None
  eps: float = 1e-30
  min_parameter_scale: float = 1e-3
  max_parameter_scale: float | None = None
  beta2_cap: float | None = None
  count: int = 0
  row: dict = field(default_factory=dict)
  col: dict = field(default_factory=dict)
  full: dict = field(default_factory=dict)
  first: dict = field(default_factory=dict)

  def init(self, name: str, shape: tuple[int, ...], plan, batch_axes=()):
    """``plan`` is ``(row_axes, col_axes[, batch_axes])`` or ``None`` (unfactored).

    Along batch axes every slice is a separate parameter: clipping and the parameter
    scale are computed per slice.
    """
    floor = max(self.eps, np.finfo(np.float32).tiny)
    if plan is not None and len(plan) == 3:
      batch_axes = plan[2]
      plan = plan[:2] if plan[0] else None
    self.batch_axes = {**getattr(self, "batch_axes", {}), name: tuple(batch_axes)}
    if plan is None:
      self.full[name] = np.full(shape, floor)
    else:
      row_axes, col_axes = plan
      self.row[name] = np.full([1 if a in col_axes else s for a, s in enumerate(shape)], floor)
      self.col[name] = np.full([1 if a in row_axes else s for a, s in enumerate(shape)], floor)
    self.first[name] = np.zeros(shape)
    self.plans = {**getattr(self, "plans", {}), name: plan}

  def init_all(self, params: dict, factored: bool = True, min_dim_size_to_factor: int = 128):
    """``init`` for every leaf of a flat dict, with the default factoring rule."""
    for name, value in params.items():
      self.init(name, np.shape(value), reference_plan(np.shape(value), factored,
                                                      min_dim_size_to_factor))
    return self

  def beta2(self) -> float:
    t = max(self.count - self.decay_offset, 0) + 1
    beta2 = 1.0 - t ** (-self.decay_rate)
    return beta2 if self.beta2_cap is None else min(beta2, self.beta2_cap)

  def step(self, grads: dict, params: dict) -> dict:
    """One step over a dict of leaves; returns float64 (or complex128) updates."""
    beta2 = self.beta2()
    updates = {}
    for name, grad in grads.items():
      # Complex leaves get real statistics of |g|**2 (and a real RMS of |p|).
      dtype = np.complex128 if np.iscomplexobj(grad) else np.float64
      g = np.asarray(grad, dtype)
      p = np.asarray(params[name], dtype)
      g_sq = np.abs(g) ** 2 + self.eps
      plan = self.plans[name]
      if plan is None:
        self.full[name] = beta2 * self.full[name] + (1 - beta2) * g_sq
        v_hat = self.full[name]
      else:
        row_axes, col_axes = plan
        self.row[name] = beta2 * self.row[name] + (1 - beta2) * g_sq.mean(col_axes, keepdims=True)
        self.col[name] = beta2 * self.col[name] + (1 - beta2) * g_sq.mean(row_axes, keepdims=True)
        v_hat = self.row[name] * self.col[name] / self.row[name].mean(row_axes, keepdims=True)
      u = g / np.sqrt(v_hat)
      slice_axes = tuple(a for a in range(g.ndim) if a not in self.batch_axes[name])

      def slice_rms(x, slice_axes=slice_axes):
        return np.sqrt(np.mean(np.abs(x) ** 2, axis=slice_axes, keepdims=True))

      if self.clipping_threshold is not None:
        u = u / np.maximum(1.0, slice_rms(u) / self.clipping_threshold)
      if self.learning_rate is not None:
        u = u * self.learning_rate
      if self.multiply_by_parameter_scale:
        scale = np.maximum(slice_rms(p), self.min_parameter_scale)
        if self.max_parameter_scale is not None:
          scale = np.minimum(scale, self.max_parameter_scale)
        u = u * scale
      if self.momentum is not None:
        self.first[name] = self.momentum * self.first[name] + (1 - self.momentum) * u
        u = self.first[name]
      if self.weight_decay_rate is not None:
        u = u + self.weight_decay_rate * p
      updates[name] = -u
    self.count += 1
    return updates
