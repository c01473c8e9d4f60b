"""Adafactor in float64 NumPy, written from the paper, as the tests' independent reference.

Shazeer and Stern 2018, Algorithms 4 and 5, generalised so that the factored
statistics keep every axis (keepdims): axes that are neither rows nor columns are
batch axes and keep their size in both statistics. Clipping and the parameter scale
span the whole leaf, as in ``optax.adafactor``.

On top of the paper, the safeguards the library documents, each as its formula: every
statistic is floored at ``max(eps, tiny)`` before it divides anything (``tiny`` being
the smallest normal of the leaf's real compute dtype: float64 for float64 and
complex128 leaves, float32 for the rest), and the factored estimate is never taken
below ``tiny`` (so the scale ``1/sqrt(v_hat)`` is at most ``1/sqrt(tiny)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


def reference_plan_from_roles(shape, roles, factored: bool = True,
                              min_dim_size_to_factor: int = 128):
  """The plan ``(row_axes, col_axes, batch_axes)`` that per-axis roles ask for.

  ``roles`` is ``None`` (the heuristic for the whole leaf) or one role per axis:
  ``"row"``, ``"column"``, ``"batch"`` (a separate slice), ``"none"`` (an axis that
  keeps its size in both statistics and is never factored), or ``None`` (left to the
  heuristic). Rows and columns named explicitly are factored whatever ``factored`` and
  the size threshold say; otherwise the heuristic picks among the ``None`` axes only.
  Unfactored leaves have empty row and column axes.
  """
  if roles is None:
    plan = reference_plan(shape, factored, min_dim_size_to_factor)
    return ((), (), ()) if plan is None else (*plan, ())
  rows = tuple(a for a, role in enumerate(roles) if role == "row")
  cols = tuple(a for a, role in enumerate(roles) if role == "column")
  batch = tuple(a for a, role in enumerate(roles) if role == "batch")
  if not rows:
    open_axes = [a for a, role in enumerate(roles) if role is None]
    plan = reference_plan([shape[a] for a in open_axes], factored, min_dim_size_to_factor)
    if plan is not None:
      rows, cols = (open_axes[plan[0][0]],), (open_axes[plan[1][0]],)
  return rows, cols, batch


def smallest_normal(dtype) -> float:
  """``tiny`` of the real compute dtype of a leaf of ``dtype``: float64 for 8-byte reals."""
  real = np.finfo(np.dtype(dtype)).dtype
  return float(np.finfo(np.float64 if real.itemsize >= 8 else np.float32).tiny)


def _round_to(x: np.ndarray, dtype) -> np.ndarray:
  """``x`` stored in ``dtype`` and read back in float64 (complex128 for complex ``x``)."""
  wide = np.complex128 if np.iscomplexobj(x) else np.float64
  return np.asarray(np.asarray(x).astype(dtype), wide)


@dataclass
class ReferenceAdafactor:
  """Numbers are floats; ``learning_rate`` and ``weight_decay_rate`` may also be
  schedules ``count -> value``, and ``decay_rate_fn`` is ``(local_step, decay_rate) ->
  beta2``. ``weight_decay_mask`` maps a leaf's name to True, False or an array of bools
  (``None``: every leaf decays). ``momentum_dtype`` maps a leaf's name to the dtype its
  first moment is stored in (missing: float64, never rounded)."""

  learning_rate: Any = None
  decay_rate: float = 0.8
  decay_offset: int = 0
  multiply_by_parameter_scale: bool = True
  clipping_threshold: float | None = 1.0
  momentum: float | None = None
  weight_decay_rate: Any = None
  eps: float = 1e-30
  min_parameter_scale: float = 1e-3
  max_parameter_scale: float | None = None
  beta2_cap: float | None = None
  decay_rate_fn: Any = None
  weight_decay_mask: dict | None = None
  momentum_dtype: dict = field(default_factory=dict)
  # The dtype the second-moment statistics are stored in, rounded to nearest after each
  # blend and at the floor (None: float64, never rounded).
  statistics_dtype: Any = None
  count: int = 0
  row: dict = field(default_factory=dict)
  col: dict = field(default_factory=dict)
  full: dict = field(default_factory=dict)
  first: dict = field(default_factory=dict)

  def _stored(self, statistic):
    """A statistic as it is kept: rounded to nearest in ``statistics_dtype``, if set."""
    if self.statistics_dtype is None:
      return statistic
    return np.asarray(statistic).astype(self.statistics_dtype).astype(np.float64)

  def init(self, name: str, shape: tuple[int, ...], plan, batch_axes=(), dtype=np.float32):
    """``plan`` is ``(row_axes, col_axes[, batch_axes])`` or ``None`` (unfactored).

    Along batch axes every slice is a separate parameter: clipping and the parameter
    scale are computed per slice. ``dtype`` is the leaf's, for the floor the
    statistics start at.
    """
    floor = self._stored(np.float64(max(self.eps, smallest_normal(dtype))))
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
                                                      min_dim_size_to_factor),
                dtype=np.asarray(value).dtype)
    return self

  def _at_count(self, value):
    """A hyperparameter's value this step: a schedule is called with the count."""
    return float(value(self.count)) if callable(value) else value

  def beta2(self) -> float:
    local_step = max(self.count - self.decay_offset, 0)
    if self.decay_rate_fn is None:
      beta2 = 1.0 - (local_step + 1) ** (-self.decay_rate)
    else:
      beta2 = float(self.decay_rate_fn(local_step, self.decay_rate))
    return beta2 if self.beta2_cap is None else min(beta2, self.beta2_cap)

  def _inverse_rms_estimate(self, name: str, tiny: float) -> np.ndarray:
    """``1/sqrt(v_hat)`` from the floored statistics, ``v_hat`` at least ``tiny``.

    In logarithms, so that no product of two statistics underflows float64 (the
    statistics of a float64 leaf go down to float64's own ``tiny``).
    """
    floor = max(self.eps, tiny)
    plan = self.plans[name]
    if plan is None:
      log_v = np.log(np.maximum(self.full[name], floor))
    else:
      row = np.maximum(self.row[name], floor)
      col = np.maximum(self.col[name], floor)
      log_v = np.log(row) + np.log(col) - np.log(row.mean(plan[0], keepdims=True))
    return np.exp(-0.5 * np.maximum(log_v, np.log(tiny)))

  def step(self, grads: dict, params: dict) -> dict:
    """One step over a dict of leaves; returns float64 (or complex128) updates."""
    beta2 = self.beta2()
    learning_rate = self._at_count(self.learning_rate)
    weight_decay_rate = self._at_count(self.weight_decay_rate)
    updates = {}
    for name, grad in grads.items():
      # Complex leaves get real statistics of |g|**2 (and a real RMS of |p|).
      tiny = smallest_normal(np.asarray(grad).dtype)
      dtype = np.complex128 if np.iscomplexobj(grad) else np.float64
      g = np.asarray(grad, dtype)
      p = np.asarray(params[name], dtype)
      g_sq = np.abs(g) ** 2 + self.eps
      plan = self.plans[name]
      if plan is None:
        self.full[name] = self._stored(beta2 * self.full[name] + (1 - beta2) * g_sq)
      else:
        row_axes, col_axes = plan
        self.row[name] = self._stored(
            beta2 * self.row[name] + (1 - beta2) * g_sq.mean(col_axes, keepdims=True))
        self.col[name] = self._stored(
            beta2 * self.col[name] + (1 - beta2) * g_sq.mean(row_axes, keepdims=True))
      u = g * self._inverse_rms_estimate(name, tiny)
      slice_axes = tuple(a for a in range(g.ndim) if a not in self.batch_axes[name])

      def slice_rms(x, slice_axes=slice_axes):
        return np.sqrt(np.mean(np.abs(x) ** 2, axis=slice_axes, keepdims=True))

      if self.clipping_threshold is not None:
        u = u / np.maximum(1.0, slice_rms(u) / self.clipping_threshold)
      if learning_rate is not None:
        u = u * learning_rate
      if self.multiply_by_parameter_scale:
        scale = np.maximum(slice_rms(p), self.min_parameter_scale)
        if self.max_parameter_scale is not None:
          scale = np.minimum(scale, self.max_parameter_scale)
        u = u * scale
      if self.momentum is not None:
        # The step uses the exact blend; only what is kept for the next step is
        # stored in the first moment's dtype.
        u = self.momentum * self.first[name] + (1 - self.momentum) * u
        self.first[name] = u
        if name in self.momentum_dtype:
          self.first[name] = _round_to(u, self.momentum_dtype[name])
      if weight_decay_rate is not None:
        mask = True if self.weight_decay_mask is None else self.weight_decay_mask[name]
        u = u + np.where(mask, weight_decay_rate * p, 0)
      updates[name] = -u
    self.count += 1
    return updates


# The spike rule (``skip_spikes``), restated from safefactor's docstring: the floor on the
# standard deviation is this fraction of the mean's magnitude.
SPIKE_STD_FLOOR = 0.02


def spike_limit(history: list[float], threshold: float) -> float:
  """``mean + k max(s, 0.02 |mean|)`` over ``history`` (the finite values recorded), in
  float64; NaN for fewer than two values (no sample standard deviation)."""
  values = np.asarray(history, np.float64)
  if len(values) < 2:
    return np.nan
  mean = values.mean()
  return mean + threshold * max(values.std(ddof=1), SPIKE_STD_FLOOR * abs(mean))


@dataclass
class LastSpike:
  """What the reports name for the last skipped spike."""

  step: int
  statistic: str  # "gradient norm" or "loss": the gradient norm when both spiked
  value: float
  limit: float
  leaf: str  # the leaf whose gradient norm was largest at that step
  leaf_norm: float


@dataclass
class ReferenceSpikeRule:
  """The guard with spike skipping, in float64: the verdicts, counters and reports.

  A step is non-finite when a leaf's gradient is (or its state, named in ``step``): it is
  skipped and counted per leaf, never judged as a spike, and not recorded. A finite step
  is a spike when its gradient norm, or its loss when one is given, is finite and above
  :func:`spike_limit` of that statistic's recorded history (for the loss, its finite
  entries), once that history holds at least ``window // 2`` values. A spike is skipped
  while fewer than ``window // 2`` spikes were skipped in a row; the next one is taken
  and the history restarts from it. An applied step is recorded (its loss NaN when none
  was given, or not finite) when its gradient norm is finite; the ring keeps the last
  ``window`` records. ``leaf_names`` are the params' paths in tree order.
  """

  threshold: float
  window: int
  leaf_names: list[str]
  norms: list[float] = field(default_factory=list)  # the ring, in slot order
  losses: list[float] = field(default_factory=list)
  position: int = 0  # the slot the next record goes to
  length: int = 0  # the filled slots: the first ``length`` of the ring
  steps: int = 0
  skipped_steps: int = 0
  consecutive_skips: int = 0  # non-finite skips since the last applied step
  skipped_spikes: int = 0
  consecutive_spikes: int = 0
  nonfinite: dict = field(default_factory=dict)  # per leaf: (count, last step)
  last_spike: LastSpike | None = None

  def __post_init__(self):
    self.norms = [np.nan] * self.window
    self.losses = [np.nan] * self.window

  def recorded_norms(self) -> list[float]:
    return self.norms[:self.length]

  def recorded_losses(self) -> list[float]:
    return self.losses[:self.length]

  def limits(self) -> tuple[float, float]:
    """The gradient norm's and the loss's limits for the next step (NaN: none)."""
    losses = [x for x in self.recorded_losses() if np.isfinite(x)]
    return (spike_limit(self.recorded_norms(), self.threshold),
            spike_limit(losses, self.threshold))

  def _is_spike(self, recorded: list[float], value: float) -> bool:
    recorded = [x for x in recorded if np.isfinite(x)]
    if not np.isfinite(value) or len(recorded) < self.window // 2:
      return False
    return bool(value > spike_limit(recorded, self.threshold))

  def step(self, grads: dict, loss: float | None = None, nonfinite_state=()) -> str:
    """One ``update`` call on ``grads`` (a dict of arrays, by leaf path, in tree order),
    with ``value=loss`` when ``loss`` is not None; ``nonfinite_state`` names leaves whose
    optimizer state is not finite. Returns ``"nonfinite"``, ``"spike"`` (skipped),
    ``"restart"`` (a spike taken at the bound) or ``"applied"``."""
    step = self.steps
    self.steps += 1
    sums = {name: float(np.sum(np.abs(np.asarray(g).astype(np.complex128)) ** 2))
            for name, g in grads.items()}
    bad = [name for name in self.leaf_names
           if not np.all(np.isfinite(np.asarray(grads[name]))) or name in nonfinite_state]
    if bad:
      for name in bad:
        count, _ = self.nonfinite.get(name, (0, -1))
        self.nonfinite[name] = (count + 1, step)
      self.skipped_steps += 1
      self.consecutive_skips += 1
      return "nonfinite"
    norm = float(np.sqrt(sum(sums.values())))
    loss = np.nan if loss is None else float(loss)
    norm_spike = self._is_spike(self.recorded_norms(), norm)
    loss_spike = self._is_spike(self.recorded_losses(), loss)
    if (norm_spike or loss_spike) and self.consecutive_spikes < self.window // 2:
      norm_limit, loss_limit = self.limits()
      leaf = max(self.leaf_names, key=lambda name: sums[name])
      self.last_spike = LastSpike(
          step, "gradient norm" if norm_spike else "loss", norm if norm_spike else loss,
          norm_limit if norm_spike else loss_limit, leaf, float(np.sqrt(sums[leaf])))
      self.skipped_steps += 1
      self.skipped_spikes += 1
      self.consecutive_spikes += 1
      return "spike"
    # A spike skip leaves the run of non-finite skips as it was; an applied step ends both.
    self.consecutive_spikes = self.consecutive_skips = 0
    restart = norm_spike or loss_spike
    if np.isfinite(norm):
      if restart:
        self.position = self.length = 0
      self.norms[self.position] = norm
      self.losses[self.position] = loss if np.isfinite(loss) else np.nan
      self.position = (self.position + 1) % self.window
      self.length = min(self.length + 1, self.window)
    return "restart" if restart else "applied"

  def report(self) -> dict:
    """``osf.nonfinite_report`` of a state holding this one guard."""
    report = {"skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips,
              "steps": self.steps}
    for name, (count, last) in self.nonfinite.items():
      report[f"nonfinite_steps/{name}"] = count
      report[f"last_nonfinite_step/{name}"] = last
    report["skipped_spikes"] = self.skipped_spikes
    report["consecutive_spikes"] = self.consecutive_spikes
    spike = self.last_spike
    if spike is not None:
      report["last_spike_step"] = spike.step
      report[f"last_spike_{spike.statistic.replace(' ', '_')}"] = spike.value
      report["last_spike_limit"] = spike.limit
      report[f"last_spike_largest_gradient/{spike.leaf}"] = spike.leaf_norm
    report["total_skipped_steps"] = self.skipped_steps
    return report

  def spike_clause(self, value: float, limit: float) -> str:
    """``osf.nonfinite_summary``'s clause on spikes, the value and limit (as the state
    holds them, in float32) formatted as it does."""
    spikes = f"{self.skipped_spikes} spike{'' if self.skipped_spikes == 1 else 's'}"
    spike = self.last_spike
    return (f"{spikes} (last at step {spike.step}: {spike.statistic} {value:.4g} > limit "
            f"{limit:.4g}, largest in {spike.leaf})")

  def summary_start(self) -> str:
    """The start of ``osf.nonfinite_summary``, up to the non-finite leaves' names."""
    steps = f"{self.steps} step{'' if self.steps == 1 else 's'}"
    if self.steps == 0:
      return "no steps yet"
    if self.skipped_steps == 0:
      return f"no skipped steps in {steps}"
    if self.skipped_spikes == 0:
      return (f"skipped {self.skipped_steps} of {steps} ({self.consecutive_skips} in a row); "
              "non-finite: ")
    start = f"skipped {self.skipped_steps} of {steps}; "
    nonfinite = self.skipped_steps - self.skipped_spikes
    if nonfinite:
      start += f"{nonfinite} non-finite ({self.consecutive_skips} in a row): "
    return start
