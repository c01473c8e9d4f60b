"""Optimizer states written by optax_safefactor 0.2: their per-leaf counters, converted.

Release 0.2 kept each guard's per-leaf counters (``nonfinite_steps`` and
``last_nonfinite_step``) as trees of int32 scalars shaped like the params; later releases
keep each as one :class:`LeafCounts` vector, which compiles in a fraction of the time on
trees of hundreds of leaves. Everything else in the state is unchanged, so these two
functions are all a 0.2 checkpoint needs.
"""

from __future__ import annotations

from typing import Any

import jax

from optax_safefactor._src.counters import COUNTER_TYPES, LeafCounts


def _is_counters(x: Any) -> bool:
  return isinstance(x, COUNTER_TYPES)


def _convert_counters(opt_state: Any, convert_counts) -> Any:
  def convert(node):
    if not _is_counters(node):
      return node
    inner = getattr(node, "inner_state", None)
    if inner is not None:  # a guard around a chain that holds another guard
      node = node._replace(inner_state=_convert_counters(inner, convert_counts))
    return node._replace(nonfinite_steps=convert_counts(node.nonfinite_steps),
                         last_nonfinite_step=convert_counts(node.last_nonfinite_step))

  return jax.tree.map(convert, opt_state, is_leaf=_is_counters)


def _to_vector(counts: Any) -> LeafCounts:
  return counts if isinstance(counts, LeafCounts) else LeafCounts.from_per_leaf(counts)


def _to_tree(counts: Any) -> Any:
  return counts.per_leaf() if isinstance(counts, LeafCounts) else counts


def migrate_from_0_2(opt_state: Any) -> Any:
  """``opt_state`` with the per-leaf counters of release 0.2 in today's layout.

  A 0.2 state keeps each guard's ``nonfinite_steps`` and ``last_nonfinite_step`` as
  trees of int32 scalars shaped like the params; this returns the same state with each
  as a :class:`LeafCounts` vector (the same values, in the params' leaf order), through
  any nesting (``optax.chain``, ``inject_hyperparams``, a guard in a guard,
  :func:`accumulate_gradients`). A state already in today's layout is returned as it
  is. To restore a 0.2 checkpoint, restore it into the target
  :func:`state_in_0_2_layout` gives, then migrate the result.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_safefactor as osf
    >>> tx = osf.safefactor(learning_rate=0.1)
    >>> params = {"b": jnp.zeros(3), "w": jnp.ones((2, 3))}
    >>> old = osf.state_in_0_2_layout(tx.init(params))  # as 0.2 wrote it
    >>> old.nonfinite_steps
    {'b': Array(0, dtype=int32), 'w': Array(0, dtype=int32)}
    >>> osf.migrate_from_0_2(old).nonfinite_steps.counts
    Array([0, 0], dtype=int32)

  Args:
    opt_state: an optimizer state, as release 0.2 wrote it or as today's ``init`` makes it.

  Returns:
    The state, every guard's per-leaf counters as :class:`LeafCounts`.
  """
  return _convert_counters(opt_state, _to_vector)


def state_in_0_2_layout(opt_state: Any) -> Any:
  """``opt_state`` with each guard's per-leaf counters as release 0.2 kept them.

  Each :class:`LeafCounts` becomes a tree of int32 scalars shaped like the params: the
  structure a 0.2 checkpoint was written with, so the target to restore one into
  (``state_in_0_2_layout(jax.eval_shape(tx.init, params))`` with orbax, say); then
  :func:`migrate_from_0_2` makes the restored state usable by ``update``. The inverse of
  :func:`migrate_from_0_2`.

  Args:
    opt_state: an optimizer state (or its abstract shapes, from ``jax.eval_shape``).

  Returns:
    The state, every guard's per-leaf counters as trees shaped like the params.
  """
  return _convert_counters(opt_state, _to_tree)
