"""What the guards saw, as host numbers: one record per guard, the source of every report.

:func:`guard_records` reads every guard that :func:`counters.find_counters` finds in an
optimizer state into a :class:`GuardRecord`; the reports (``reports``) only format them,
so they always agree with each other.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from optax_safefactor._src import counters, spikes
from optax_safefactor._src.placement import unbox


class GuardRecord(NamedTuple):
  """What one guard saw, as host numbers: the single source of every report.

  ``kind`` is ``"steps"`` for a :class:`SkipNonfiniteState` and ``"micro_batches"``
  for :func:`accumulate_gradients`' :class:`MicroBatchCounters`; it decides the words
  and keys the reports use, never the numbers. ``hyperparams`` and ``last_hyperparams``
  are the guard's :class:`HyperparamCounts` by name (empty for micro-batch counters).
  ``where`` is the guard's place in the optimizer state (``opt_state.inner_states['head']``
  in an ``optax.multi_transform``), which tells several guards apart.
  """

  skipped: int
  consecutive: int
  calls: int
  nonfinite: dict[str, int]
  last_nonfinite: dict[str, int]
  kind: str
  spikes: SpikeRecord | None
  hyperparams: dict[str, int]
  last_hyperparams: dict[str, int]
  where: str = "opt_state"


class SpikeRecord(NamedTuple):
  """What one guard's spike rule saw, as host numbers (a part of :class:`GuardRecord`).

  ``last_*`` describe the last skipped spike: its step, the statistic (``"gradient
  norm"`` or ``"loss"``), its value and the limit it was above, and the parameter whose
  gradient norm was largest then, with that norm; they are ``None`` before any.
  """

  skipped: int
  consecutive: int
  last_step: int | None
  last_statistic: str | None
  last_value: float | None
  last_limit: float | None
  last_leaf: str | None
  last_leaf_norm: float | None


def _kind(found: counters.SkipNonfiniteState | counters.MicroBatchCounters) -> str:
  return "micro_batches" if isinstance(found, counters.MicroBatchCounters) else "steps"


def _spike_record(history: Any, leaf_names: list[str]) -> SpikeRecord | None:
  if history is None:
    return None
  skipped = int(history.skipped_spikes)
  leaf = int(history.last_spike_leaf)
  seen = skipped > 0
  return SpikeRecord(
      skipped=skipped,
      consecutive=int(history.consecutive_spikes),
      last_step=int(history.last_spike_step) if seen else None,
      last_statistic=spikes.STATISTIC_NAMES[int(history.last_spike_statistic)] if seen else None,
      last_value=float(history.last_spike_value) if seen else None,
      last_limit=float(history.last_spike_limit) if seen else None,
      last_leaf=leaf_names[leaf] if seen and 0 <= leaf < len(leaf_names) else None,
      last_leaf_norm=float(history.last_spike_leaf_norm) if seen else None,
  )


def guard_records(opt_state: Any) -> list[GuardRecord]:
  """One :class:`GuardRecord` per guard found anywhere in ``opt_state``, guards inside
  another guard included, in the state's tree order (a guard before those inside it).

  The micro-batch counters of :func:`accumulate_gradients` are records too, of kind
  ``"micro_batches"``.
  """
  records = []
  for path, guard in counters.find_counters_with_paths(opt_state):
    if isinstance(unbox(guard.step), jax.core.Tracer):
      raise TypeError(
          "the reports read the counters on the host, and this state is traced (inside "
          "jax.jit, say): call them outside it, on the state the step returns; inside, "
          "skipped_steps(opt_state) and skipped_spikes(opt_state) give the totals")
    batch = np.shape(unbox(guard.step))
    if batch:
      # jax.vmap over init and update (an ensemble) gives every counter a batch axis.
      raise ValueError(
          f"the reports read one optimizer's state, and this one holds a batch of {batch} "
          "(made under jax.vmap): pass one member's, e.g. jax.tree.map(lambda x: x[i], "
          "opt_state); skipped_steps(opt_state) gives every member's total")
    nonfinite = guard.nonfinite_steps.host_values()
    hyperparam_counts = getattr(guard, "nonfinite_hyperparams", None)
    hyperparams, last_hyperparams = ({}, {}) if hyperparam_counts is None else (
        hyperparam_counts.host_values())
    records.append(GuardRecord(
        skipped=int(unbox(guard.skipped_steps)),
        consecutive=int(unbox(guard.consecutive_skips)),
        calls=int(unbox(guard.step)),
        nonfinite=nonfinite,
        last_nonfinite=guard.last_nonfinite_step.host_values(),
        kind=_kind(guard),
        spikes=_spike_record(getattr(guard, "spikes", None), list(nonfinite)),
        hyperparams=hyperparams,
        last_hyperparams=last_hyperparams,
        where="opt_state" + jax.tree_util.keystr(path),
    ))
  return records
