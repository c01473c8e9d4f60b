"""The guards' counters: skipped calls in all, in a row, and per leaf, for steps and micro-batches.

A guard (:func:`skip_nonfinite`, safefactor's own) counts skipped optimizer steps in a
:class:`SkipNonfiniteState`; :func:`accumulate_gradients` counts skipped micro-batches
in :class:`MicroBatchCounters`. Both are counted by :func:`count_call`, and both are
found in any optimizer state by :func:`find_counters`, which every report reads.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import optax

from optax_safefactor._src import checks
from optax_safefactor._src.placement import is_box
from optax_safefactor._src.spikes import init_history
from optax_safefactor._src.trees import find_all, unzip_leaf_results


class SkipNonfiniteState(NamedTuple):
  """State of :func:`skip_nonfinite` (and of :func:`safefactor`, which guards itself).

  Attributes:
    inner_state: the wrapped transformation's state, as of the last applied step.
    skipped_steps: total number of skipped steps (int32).
    consecutive_skips: skipped steps since the last applied one (int32).
    step: number of ``update`` calls, applied or skipped (int32).
    nonfinite_steps: per leaf, the number of steps in which that leaf's output
      was non-finite (int32 scalars, shaped like the params).
    last_nonfinite_step: per leaf, the value of ``step`` the last time that leaf
      was non-finite, or -1 (int32 scalars, shaped like the params).
    spikes: with ``skip_spikes``, the spike rule's :class:`SpikeHistory` (its skipped
      spikes are counted in ``skipped_steps`` too, never in ``consecutive_skips``);
      ``None`` without.
  """

  inner_state: Any
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  step: jax.Array
  nonfinite_steps: Any
  last_nonfinite_step: Any
  spikes: Any = None


class MicroBatchCounters(NamedTuple):
  """What :func:`accumulate_gradients` counts: its skipped micro-batches.

  The fields of :class:`SkipNonfiniteState` less ``inner_state``, counted by the same
  code, with a micro-batch (one ``update`` call) in place of a step. The reports name
  them as micro-batches, and :func:`skipped_steps` includes them: a skipped micro-batch
  is a skipped update call.

  Attributes:
    skipped_steps: total number of skipped micro-batches (int32).
    consecutive_skips: skipped micro-batches since the last finite one (int32).
    step: number of micro-batches seen, finite or not (int32).
    nonfinite_steps: per leaf, the number of micro-batches in which that leaf was
      non-finite (int32 scalars, shaped like the params).
    last_nonfinite_step: per leaf, the value of ``step`` the last time that leaf was
      non-finite, or -1 (int32 scalars, shaped like the params).
  """

  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  step: jax.Array
  nonfinite_steps: Any
  last_nonfinite_step: Any


# Guard states and micro-batch counters: everything the reports read.
COUNTER_TYPES = (SkipNonfiniteState, MicroBatchCounters)


def per_leaf_counters(params: Any, value: int) -> Any:
  """One int32 scalar per param leaf (plain, even for boxed params: a param's sharding
  does not fit a scalar counter)."""
  return jax.tree.map(lambda _: jnp.asarray(value, jnp.int32), params, is_leaf=is_box)


def _zero_counts(params: Any) -> dict[str, Any]:
  return dict(
      skipped_steps=jnp.zeros([], jnp.int32),
      consecutive_skips=jnp.zeros([], jnp.int32),
      step=jnp.zeros([], jnp.int32),
      nonfinite_steps=per_leaf_counters(params, 0),
      last_nonfinite_step=per_leaf_counters(params, -1),
  )


def init_guarded(inner_state: Any, params: Any,
                 spike_window: int | None = None) -> SkipNonfiniteState:
  """A guard's state around ``inner_state``, with every counter at zero, and an empty
  spike history of ``spike_window`` steps unless that is ``None``."""
  spikes = None if spike_window is None else init_history(spike_window)
  return SkipNonfiniteState(inner_state=inner_state, **_zero_counts(params), spikes=spikes)


def init_micro_batch_counters(params: Any) -> MicroBatchCounters:
  """Micro-batch counters for ``params``, every one at zero."""
  return MicroBatchCounters(**_zero_counts(params))


Counters = TypeVar("Counters", SkipNonfiniteState, MicroBatchCounters)


def count_call(counters: Counters, leaf_finite: Any, call_finite: jax.Array,
               spike_skipped: jax.Array | None = None) -> Counters:
  """``counters`` after one more ``update`` call whose verdict is ``call_finite``.

  ``counters`` is a :class:`SkipNonfiniteState` or a :class:`MicroBatchCounters`;
  ``leaf_finite`` has one scalar bool per param leaf. ``call_finite`` is False for any
  skipped call; ``spike_skipped`` (when given) is True where the call was skipped as a
  spike, which counts in ``skipped_steps`` but leaves ``consecutive_skips``, the run of
  non-finite skips, as it was. Nothing but the counters changes.
  """
  checks.check_counters(counters, MicroBatchCounters._fields)

  def count_leaf(count, last, finite):
    return (
        jnp.where(finite, count, optax.safe_increment(count)),
        jnp.where(finite, last, counters.step),
    )

  counted = jax.tree.map(count_leaf, counters.nonfinite_steps, counters.last_nonfinite_step,
                         leaf_finite)
  nonfinite_steps, last_nonfinite_step = unzip_leaf_results(counters.nonfinite_steps, counted, 2)
  return counters._replace(
      skipped_steps=jnp.where(
          call_finite, counters.skipped_steps, optax.safe_increment(counters.skipped_steps)
      ),
      consecutive_skips=jnp.where(
          call_finite, 0,
          optax.safe_increment(counters.consecutive_skips) if spike_skipped is None
          else jnp.where(spike_skipped, counters.consecutive_skips,
                         optax.safe_increment(counters.consecutive_skips)),
      ),
      step=optax.safe_increment(counters.step),
      nonfinite_steps=nonfinite_steps,
      last_nonfinite_step=last_nonfinite_step,
  )



def find_counters(opt_state: Any) -> list[SkipNonfiniteState | MicroBatchCounters]:
  """Every guard state and micro-batch counter in ``opt_state``, in its tree order, guards
  inside another guard included; a ``ValueError`` when there is none."""
  found = find_all(opt_state, COUNTER_TYPES)
  if not found:
    raise ValueError(
        "no skip_nonfinite state found in opt_state; was the optimizer built with "
        "skip_nonfinite (safefactor does so unless skip_nonfinite_steps=False) or "
        "accumulate_gradients?"
    )
  return found
