r"""The spike rule: a rolling history of each step's statistics, and the verdict on a step.

A step is a spike when one of its statistics (the global gradient norm, and the loss when
``update`` is given ``value=``) is finite and above

.. math::
  \mathrm{limit} = \bar x + k \cdot \max(s, f\,|\bar x|)

where :math:`\bar x` and :math:`s` are the mean and the sample standard deviation
(``ddof=1``) of that statistic over the history, :math:`k` is ``skip_spikes`` and
:math:`f` is :data:`RELATIVE_STD_FLOOR`, and the history holds at least
``spike_window // 2`` values of it. The history holds the statistics of the last
``spike_window`` applied steps: a skipped spike and a non-finite step stay out of it, so
one outlier cannot widen the limit for the steps that follow. After ``spike_window // 2``
spike skips in a row, the next spike is taken and the history restarts from it, so a
lasting change of scale costs at most ``spike_window // 2`` skipped steps.

The verdict is computed from reduced scalars, so on a mesh every device and process
reaches the same one. :func:`judge` decides; :func:`record` writes the new history.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_safefactor._src import (
    checks,
    manual_axes,
    numerics,
    placement,
    state_checks,
    user_warnings,
)

# The standard deviation is at least this fraction of the mean's magnitude: over a nearly
# constant history, with skip_spikes=6, no value within 12% of the mean is a spike.
RELATIVE_STD_FLOOR = 0.02

# Up to this size an unfactored leaf hands the rule its gradient (concatenated and reduced
# with the others'); a larger one its sum (a full-size copy would cost memory).
GRADIENT_KEPT_UP_TO = 16384

# The statistics a spike is judged on, as stored in ``SpikeHistory.last_spike_statistic``.
GRADIENT_NORM, LOSS = 0, 1
STATISTIC_NAMES = {GRADIENT_NORM: "gradient norm", LOSS: "loss"}

# What the history holds where a step had no loss: the lowest float32, which no loss is
# taken to be. Not NaN: with jax_debug_nans on, JAX stops at any NaN a jitted step returns
# or an eager one computes, so the state holds none (a 0.3.0 state's NaN reads as no loss).
NO_LOSS = float(np.finfo(np.float32).min)
# The limit of a statistic with fewer than two values in the history: no finite value is
# above it.
NO_LIMIT = float(np.finfo(np.float32).max)


class SpikeHistory(NamedTuple):
  """The spike rule's state, inside a :class:`SkipNonfiniteState` (``spikes``).

  Attributes:
    gradient_norms: a ring of the last ``spike_window`` applied steps' global gradient
      norms (float32); only the first ``length`` entries are filled.
    losses: the same steps' losses (float32); where ``update`` had no ``value``, the
      lowest float32 (``numpy.finfo(numpy.float32).min``), which no loss is taken to be.
    length: how many entries of the ring are filled (int32, at most ``spike_window``).
    position: where the next entry goes (int32).
    consecutive_spikes: spike skips since the last applied step (int32).
    skipped_spikes: steps skipped as spikes in all (int32).
    last_spike_step: the guard's ``step`` at the last skipped spike, or -1 (int32).
    last_spike_statistic: 0 when that spike was the gradient norm's, 1 the loss's, or -1
      (int32).
    last_spike_value: that statistic's value at the last skipped spike, or 0 (float32).
    last_spike_limit: the limit it was above, or 0 (float32).
    last_spike_leaf: the index, in the params' tree order, of the leaf whose gradient
      norm was largest at the last skipped spike, or -1 (int32).
    last_spike_leaf_norm: that leaf's gradient norm, or 0 (float32).

  Before any spike the ``last_spike_`` fields hold their "none" values: -1 in the integer
  fields, 0 in the float ones (``last_spike_step`` of -1 says that none was seen). No
  field is ever NaN, so that a run with ``jax_debug_nans`` on can return the state.
  """

  gradient_norms: jax.Array
  losses: jax.Array
  length: jax.Array
  position: jax.Array
  consecutive_spikes: jax.Array
  skipped_spikes: jax.Array
  last_spike_step: jax.Array
  last_spike_statistic: jax.Array
  last_spike_value: jax.Array
  last_spike_limit: jax.Array
  last_spike_leaf: jax.Array
  last_spike_leaf_norm: jax.Array


_COUNTERS = ("length", "position", "consecutive_spikes", "skipped_spikes", "last_spike_step",
             "last_spike_statistic", "last_spike_leaf")
_STATISTICS = ("gradient_norms", "losses", "last_spike_value", "last_spike_limit",
               "last_spike_leaf_norm")


def init_history(window: Any) -> SpikeHistory:
  """An empty history of ``window`` steps.

  Every field is an array of its own (never one array shared by several fields), so that
  a jitted step may donate the state.
  """
  if isinstance(window, jax.core.Tracer):
    raise checks.traced_shape_setting("spike_window", "the spike history's length")
  window = int(window)

  def counter(value):
    return jnp.full([], value, jnp.int32)

  def statistic():
    return jnp.zeros([], jnp.float32)

  return SpikeHistory(
      gradient_norms=jnp.zeros([window], jnp.float32),
      losses=jnp.full([window], NO_LOSS, jnp.float32),
      length=counter(0), position=counter(0), consecutive_spikes=counter(0),
      skipped_spikes=counter(0), last_spike_step=counter(-1), last_spike_statistic=counter(-1),
      last_spike_value=statistic(), last_spike_limit=statistic(), last_spike_leaf=counter(-1),
      last_spike_leaf_norm=statistic(),
  )


def check_settings(skip_spikes: Any, spike_window: Any) -> None:
  """``skip_spikes`` a positive finite number (or ``None``), ``spike_window`` an int of at
  least 2; else ``ValueError`` (``TypeError`` for a string). Traced values pass.

  >>> check_settings(6.0, 1)
  Traceback (most recent call last):
  ...
  ValueError: spike_window must be an int of at least 2, got 1 (the steps of history that \
the spike rule keeps; it judges once half of them are there)
  """
  if skip_spikes is not None and not isinstance(skip_spikes, jax.core.Tracer):
    # A switch (True) would be read as a spike at one standard deviation.
    if (isinstance(skip_spikes, str) or callable(skip_spikes)
        or np.asarray(skip_spikes).dtype == np.bool_):
      raise TypeError(f"skip_spikes must be a number of standard deviations such as 6.0 "
                      f"(or None), got {skip_spikes!r}")
    number = float(np.asarray(skip_spikes))
    if not (np.isfinite(number) and number > 0):
      raise ValueError(f"skip_spikes must be a positive number of standard deviations "
                       f"(6.0 is the usual choice) or None, got {skip_spikes!r}")
  meaning = (" (the steps of history that the spike rule keeps; it judges once half of them "
             "are there)")
  checks.check_positive_int(spike_window, "spike_window", meaning=meaning, minimum=2)


# The window a guard keeps when none is given.
DEFAULT_WINDOW = 128


def unused_window(skip_spikes: Any, spike_window: Any, window_name: str = "spike_window",
                  spikes_name: str = "skip_spikes") -> str | None:
  """The warning for a window given without the spike rule, or ``None``.

  >>> unused_window(None, 64)
  "spike_window=64 sets the spike rule's history, and skip_spikes is not set: it has no effect"
  """
  if (skip_spikes is None and not isinstance(spike_window, jax.core.Tracer)
      and int(np.asarray(spike_window)) != DEFAULT_WINDOW):
    return (f"{window_name}={spike_window!r} sets the spike rule's history, and "
            f"{spikes_name} is not set: it has no effect")
  return None


def window_of(history: SpikeHistory) -> int:
  """The history's ``spike_window``: its ring's length (static, from the shape)."""
  return history.gradient_norms.shape[0]


def check_history(history: Any) -> None:
  """A history whose counters are int32 and whose statistics are float32: ``TypeError``
  naming the field otherwise (a state cast whole to bfloat16, say)."""
  state_checks.check_counters(history, _COUNTERS)
  for field in _STATISTICS:
    dtype = np.dtype(getattr(history, field).dtype)
    if dtype != np.float32:
      raise TypeError(
          f"SpikeHistory.{field}: the spike history must stay float32, got {dtype.name}; "
          "cast only the params' statistics of a state, not the guard's")


def loss_given(extra_args: dict[str, Any]) -> jax.Array | None:
  """The loss the spike rule judges: ``update``'s ``value=``, checked (:func:`check_value`).

  ``update`` takes any keyword (``optax.chain`` hands every member the same ones), so a
  loss passed under another name would be ignored and its spikes never judged: warn,
  naming ``value=``.
  """
  if "value" not in extra_args:
    misnamed = [name for name in extra_args if "loss" in name.lower()]
    if misnamed:
      user_warnings.warn(
          f"update() got {', '.join(f'{name}=' for name in misnamed)} but no value=: the "
          "spike rule judges the loss given as value= only (update(grads, state, params, "
          "value=loss)), so this loss is ignored and only the gradient norm is judged")
  return check_value(extra_args.get("value"))


def check_value(value: Any) -> jax.Array | None:
  """``update``'s ``value=`` (the loss) as a float32 scalar, or ``None`` when not given."""
  if value is None:
    return None
  try:  # a string or a bool would fail inside JAX, or count as 0 and 1
    dtype = None if isinstance(value, (str, bytes)) else jnp.result_type(value)
  except (TypeError, ValueError):
    dtype = None
  if dtype is None or not (jnp.issubdtype(dtype, jnp.floating)
                           or jnp.issubdtype(dtype, jnp.integer)):
    raise TypeError(f"value= must be the step's loss, a real number, got {value!r}")
  shape = np.shape(value)
  if shape not in ((), (1,)):
    raise ValueError(
        f"value= must be the step's scalar loss, got an array of shape {shape}; pass the "
        "mean loss (value=jnp.mean(losses))")
  axes = manual_axes.varying_axes(value)
  if axes:
    raise ValueError(
        "value= differs from device to device inside jax.shard_map (it varies over "
        f"{manual_axes.axes_phrase(axes)}), so each device would judge its own loss and skip "
        "other steps; pass the loss averaged over the devices, "
        f"{manual_axes.pmean_call('loss', axes)}")
  return jnp.reshape(jnp.asarray(value), ()).astype(jnp.float32)


def _has_loss(losses: jax.Array) -> jax.Array:
  """Where ``losses`` hold a loss: above :data:`NO_LOSS` (a 0.3.0 state's NaN is not)."""
  return losses > NO_LOSS


def _none_as_zero(statistic: jax.Array) -> jax.Array:
  """A ``last_spike_`` statistic with a 0.3.0 state's NaN "none" read as today's 0."""
  return jnp.where(jnp.isnan(statistic), jnp.zeros([], statistic.dtype), statistic)


class Limit(NamedTuple):
  """One statistic's verdict: whether it is a spike, and the limit it was judged by."""

  spike: jax.Array
  limit: jax.Array


def spike_limit(values: jax.Array, filled: jax.Array, value: jax.Array,
                threshold: jax.typing.ArrayLike, min_length: int) -> Limit:
  r"""Is ``value`` a spike against the ``filled`` entries of ``values``?

  ``limit`` is :math:`\bar x + k \max(s, f |\bar x|)` over the filled entries
  (:data:`NO_LIMIT` when fewer than two); ``spike`` needs at least ``min_length`` of them
  and a finite ``value`` above the limit.

  >>> history = jnp.array([1.0, 1.1, 0.9, 1.0])
  >>> verdict = spike_limit(history, jnp.ones(4, bool), jnp.array(2.0), 6.0, 2)
  >>> bool(verdict.spike), round(float(verdict.limit), 3)
  (True, 1.49)
  """
  count = jnp.sum(filled.astype(jnp.float32))
  mean = jnp.sum(jnp.where(filled, values, 0.0)) / jnp.maximum(count, 1.0)
  # The entries left out are replaced before the subtraction: a NO_LOSS entry minus a
  # large mean would overflow to -Inf, which jax_debug_infs stops at even where unused.
  deviations = jnp.where(filled, values, mean) - mean
  std = jnp.sqrt(jnp.sum(deviations * deviations) / jnp.maximum(count - 1.0, 1.0))
  std = jnp.maximum(std, RELATIVE_STD_FLOOR * jnp.abs(mean))
  limit = mean + jnp.asarray(threshold, jnp.float32) * std
  limit = jnp.where(count >= 2, limit, NO_LIMIT)
  spike = jnp.isfinite(value) & (count >= min_length) & (value > limit)
  return Limit(spike, limit)


class SpikeVerdict(NamedTuple):
  """What :func:`judge` decided about one step.

  Attributes:
    skip: skip this step as a spike (it is finite, a spike, and within the bound).
    restart: the step is a spike taken at the bound: the history restarts from it.
    gradient_norm, loss: the step's statistics (the loss :data:`NO_LOSS` when not given).
    statistic: which statistic was the spike (``GRADIENT_NORM`` or ``LOSS``).
    value, limit: that statistic's value and limit.
    leaf, leaf_norm: the leaf with the largest gradient norm, and that norm.
  """

  skip: jax.Array
  restart: jax.Array
  gradient_norm: jax.Array
  loss: jax.Array
  statistic: jax.Array
  value: jax.Array
  limit: jax.Array
  leaf: jax.Array
  leaf_norm: jax.Array


class SquareSource(NamedTuple):
  """Where one leaf's :math:`\\sum |g|^2` is read from.

  ``kind`` is ``"row_means"`` (a factored leaf's :math:`\\mathrm{mean}_C(|g|^2) +
  \\epsilon`, each standing for ``columns`` elements), ``"elements"`` (the gradient
  itself) or ``"sum"`` (the sum, already reduced).
  """

  kind: str
  values: jax.Array
  columns: int = 1


def _squares(kind: str, values: jax.Array, columns: Any, eps: Any) -> jax.Array:
  """The float32 terms whose sum is the leaf's :math:`\\sum |g|^2`."""
  if kind == "elements":
    values = values.astype(numerics.compute_dtype(values.dtype))
    squares = (jnp.real(values) ** 2 + jnp.imag(values) ** 2 if jnp.iscomplexobj(values)
               else values * values)
    return squares.astype(jnp.float32)
  if kind == "row_means":
    return jnp.maximum(values.astype(jnp.float32) - jnp.asarray(eps, jnp.float32), 0) * columns
  return values.astype(jnp.float32)


def _reduced(source: SquareSource, eps: Any) -> SquareSource:
  return SquareSource("sum", jnp.sum(_squares(source.kind, source.values, source.columns, eps)))


def sums_by_leaf(sources: list[SquareSource], eps: jax.typing.ArrayLike = 0.0) -> jax.Array:
  """Per leaf, :math:`\\sum |g|^2` in float32, from ``sources`` (``eps``: what the row
  means include).

  The leaves' arrays are concatenated as they are, by kind and dtype, then turned into
  squares and reduced once per group: a reduction (and its fusion) per leaf would cost
  compile time for every leaf of the tree.

  >>> sums_by_leaf([SquareSource("elements", jnp.array([1.0, 2.0])),
  ...               SquareSource("row_means", jnp.array([[2.0], [3.0]]), columns=4),
  ...               SquareSource("sum", jnp.array(7.0))])
  Array([ 5., 20.,  7.], dtype=float32)
  """
  sums = jnp.zeros([len(sources)], jnp.float32)
  # A leaf that may be sharded is reduced on its own (its sum is replicated): a
  # concatenation with other leaves would mix shardings, which explicit mesh axes refuse
  # and Auto axes resolve by gathering the sharded leaf onto every device.
  sources = [source if placement.is_replicated(source.values) else _reduced(source, eps)
             for source in sources]
  groups: dict[tuple[str, Any], list[int]] = {}
  for index, source in enumerate(sources):
    groups.setdefault((source.kind, np.dtype(source.values.dtype)), []).append(index)
  for (kind, _), members in groups.items():
    values = [jnp.ravel(sources[i].values) for i in members]
    sizes = [v.size for v in values]
    flat = jnp.concatenate(values) if len(values) > 1 else values[0]
    columns = np.repeat([sources[i].columns for i in members], sizes).astype(np.float32)
    terms = _squares(kind, flat, columns, eps)
    leaf_of_term = np.repeat(np.asarray(members), sizes)
    sums = sums + jax.ops.segment_sum(terms, leaf_of_term, num_segments=len(sources),
                                      indices_are_sorted=True)
  return sums


def judge(history: SpikeHistory, sums: jax.Array, loss: jax.Array | None,
          threshold: jax.typing.ArrayLike, step_finite: jax.Array) -> SpikeVerdict:
  """The verdict on a step whose leaves' gradients have these sums of ``|g|**2`` (a 1-D
  float32 array, one per leaf; :func:`sums_by_leaf`).

  ``step_finite`` is the non-finite guard's verdict: a non-finite step is skipped as such,
  never as a spike.
  """
  window = window_of(history)
  has_leaves = sums.shape[0] > 0
  gradient_norm = jnp.sqrt(jnp.sum(sums))
  loss = jnp.full([], NO_LOSS, jnp.float32) if loss is None else loss
  filled = jnp.arange(window) < history.length
  by_norm = spike_limit(history.gradient_norms, filled, gradient_norm, threshold, window // 2)
  by_loss = spike_limit(history.losses, filled & _has_loss(history.losses), loss,
                        threshold, window // 2)
  # Finite gradients whose float32 sum of squares overflows (about 1.8e19 each, everywhere)
  # are above any finite limit: a spike once the rule judges, not a step it cannot see.
  # (Compared with the largest float32, not with Inf: an Inf constant is what
  # jax_debug_infs stops at.)
  overflowed = (gradient_norm > NO_LIMIT) & (history.length >= window // 2)
  by_norm = by_norm._replace(spike=by_norm.spike | overflowed)
  spike = step_finite & (by_norm.spike | by_loss.spike)
  within_bound = history.consecutive_spikes < window // 2
  on_loss = by_loss.spike & ~by_norm.spike
  leaf = jnp.argmax(sums).astype(jnp.int32) if has_leaves else jnp.full([], -1, jnp.int32)
  leaf_norm = jnp.sqrt(jnp.max(sums)) if has_leaves else jnp.zeros([], jnp.float32)
  return SpikeVerdict(
      skip=spike & within_bound,
      restart=spike & ~within_bound,
      gradient_norm=gradient_norm,
      loss=loss,
      statistic=jnp.where(on_loss, LOSS, GRADIENT_NORM).astype(jnp.int32),
      value=jnp.where(on_loss, loss, gradient_norm),
      limit=jnp.where(on_loss, by_loss.limit, by_norm.limit),
      leaf=leaf,
      leaf_norm=leaf_norm.astype(jnp.float32),
  )


def record(history: SpikeHistory, verdict: SpikeVerdict, step_finite: jax.Array,
           step: jax.Array) -> SpikeHistory:
  """The history after a step: appended to when the step was applied with a finite norm,
  restarted from it at the bound, unchanged when it was skipped (spike or non-finite)."""
  window = window_of(history)
  applied = step_finite & ~verdict.skip
  appends = applied & jnp.isfinite(verdict.gradient_norm)
  position = jnp.where(verdict.restart, 0, history.position)
  loss = jnp.where(jnp.isfinite(verdict.loss), verdict.loss, NO_LOSS)

  def write(ring, value):
    # A select, not dynamic_update_slice: that one refuses a ring and a value placed on
    # different meshes (a state made outside jax.set_mesh, a norm of params placed on an
    # Explicit mesh), where a select places them alike.
    return jnp.where(appends & (jnp.arange(window) == position), value, ring)

  length = jnp.where(verdict.restart, 1, jnp.minimum(history.length + 1, window))
  skip = verdict.skip
  # A state of 0.3.0 marked "none" with NaN: written back with today's marks, so that a
  # run resumed from it with jax_debug_nans on returns no NaN.
  losses = jnp.where(_has_loss(history.losses), history.losses, NO_LOSS)
  return SpikeHistory(
      gradient_norms=write(history.gradient_norms, verdict.gradient_norm),
      losses=write(losses, loss),
      length=jnp.where(appends, length, history.length),
      position=jnp.where(appends, (position + 1) % window, history.position),
      consecutive_spikes=jnp.where(skip, optax.safe_increment(history.consecutive_spikes),
                                   jnp.where(applied, 0, history.consecutive_spikes)),
      skipped_spikes=jnp.where(skip, optax.safe_increment(history.skipped_spikes),
                               history.skipped_spikes),
      last_spike_step=jnp.where(skip, step, history.last_spike_step),
      last_spike_statistic=jnp.where(skip, verdict.statistic, history.last_spike_statistic),
      last_spike_value=jnp.where(skip, verdict.value, _none_as_zero(history.last_spike_value)),
      last_spike_limit=jnp.where(skip, verdict.limit, _none_as_zero(history.last_spike_limit)),
      last_spike_leaf=jnp.where(skip, verdict.leaf, history.last_spike_leaf),
      last_spike_leaf_norm=jnp.where(skip, verdict.leaf_norm,
                                     _none_as_zero(history.last_spike_leaf_norm)),
  )
