"""Optimizer states written by optax_safefactor 0.2: their guards' counters, converted.

Release 0.2 kept each guard's per-leaf counters (``nonfinite_steps`` and
``last_nonfinite_step``) as trees of int32 scalars shaped like the params; 0.3 keeps
each as one :class:`LeafCounts` vector, which compiles in a fraction of the time on
trees of hundreds of leaves, and adds the guard's ``nonfinite_hyperparams`` (a
:class:`HyperparamCounts`, which 0.2 did not have). Everything else in the state is
unchanged, so these two functions are all a 0.2 checkpoint needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from optax_safefactor._src.counters import (
    COUNTER_TYPES,
    HyperparamCounts,
    LeafCounts,
    SkipNonfiniteState,
)
from optax_safefactor._src.guard import injected_hyperparams
from optax_safefactor._src.placement import is_box
from optax_safefactor._src.schedules import CHECKED_HYPERPARAMS
from optax_safefactor._src.transform import AdafactorState
from optax_safefactor._src.trees import find_all


def _is_counters(x: Any) -> bool:
  return isinstance(x, COUNTER_TYPES)


def _convert_counters(opt_state: Any, convert_counts, convert_hyperparams) -> Any:
  def convert(node):
    if not _is_counters(node):
      return node
    inner = getattr(node, "inner_state", None)
    if inner is not None:  # a guard around a chain that holds another guard
      node = node._replace(inner_state=_convert_counters(inner, convert_counts,
                                                         convert_hyperparams))
    if isinstance(node, SkipNonfiniteState):
      node = node._replace(nonfinite_hyperparams=convert_hyperparams(node))
    return node._replace(nonfinite_steps=convert_counts(node.nonfinite_steps),
                         last_nonfinite_step=convert_counts(node.last_nonfinite_step))

  return jax.tree.map(convert, opt_state, is_leaf=_is_counters)


def _hyperparam_counts(guard: SkipNonfiniteState) -> HyperparamCounts | None:
  """The guard's hyperparameter counts, none seen where 0.2 kept none: safefactor's
  own guard checks its step's hyperparameters, ``skip_nonfinite`` the injected ones
  (``None`` where there are none, as ``init`` makes it)."""
  if (isinstance(guard.nonfinite_hyperparams, HyperparamCounts)
      or isinstance(guard.nonfinite_steps, LeafCounts)):  # today's layout, as it is
    return guard.nonfinite_hyperparams
  names = (CHECKED_HYPERPARAMS if isinstance(guard.inner_state, AdafactorState)
           else tuple(injected_hyperparams(guard.inner_state)))
  return _zeros_in_boxes(names, _first_box(guard.nonfinite_steps)) if names else None


# nnx.Optimizer keeps every state array in a box (an ``OptArray``): a conversion keeps
# the box, so that the converted state can go back into the optimizer.


def _first_box(tree: Any) -> Any:
  return next((leaf for leaf in jax.tree.leaves(tree, is_leaf=is_box) if is_box(leaf)), None)


def _zeros_in_boxes(names: tuple[str, ...], box: Any) -> HyperparamCounts:
  """No hyperparameter counted yet, each array in a box like ``box`` (if one)."""
  zeros = HyperparamCounts.zeros(names)
  if box is None:
    return zeros
  return dataclasses.replace(zeros, counts=box.replace(value=zeros.counts),
                             last_step=box.replace(value=zeros.last_step))


def _to_vector(counts: Any) -> LeafCounts:
  if isinstance(counts, LeafCounts):
    return counts
  vector = LeafCounts.from_per_leaf(counts)
  box = _first_box(counts)
  return vector if box is None else dataclasses.replace(vector,
                                                        counts=box.replace(value=vector.counts))


def _to_tree(counts: Any) -> Any:
  if not isinstance(counts, LeafCounts):
    return counts
  if not is_box(counts.counts):
    return counts.per_leaf()
  return jax.tree.map(lambda scalar: counts.counts.replace(value=scalar), counts.per_leaf())


_GUARD_FIELDS = frozenset({"inner_state", "nonfinite_steps", "last_nonfinite_step"})


def _refuse_guards_as_mappings(opt_state: Any, function: str) -> None:
  """A guard flattened into a mapping (``nnx.state`` of an optimizer gives one) is not
  recognised as a guard, so nothing in it would be converted: refused, not passed over."""
  def look(node):
    keys = getattr(node, "keys", None)
    if callable(keys) and not isinstance(node, COUNTER_TYPES) and set(keys()) >= _GUARD_FIELDS:
      raise TypeError(
          f"{function} found a guard's fields ({', '.join(sorted(_GUARD_FIELDS))}) in a "
          f"mapping ({type(node).__name__}), not in the guard's own state type, so it cannot "
          f"convert them (nnx.state of an nnx.Optimizer gives such a mapping): convert the "
          f"optimizer's opt_state instead, optimizer.opt_state = osf.{function}("
          f"optimizer.opt_state), then take nnx.state or nnx.split of the pair "
          f"(docs/guides/checkpoints.md)")
    children, _ = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
    if len(children) != 1 or children[0] is not node:
      for child in children:
        look(child)

  look(opt_state)


def _hyperparams_as_in(opt_state: Any, like_guards: Any) -> Any:
  """``opt_state`` with each guard's hyperparameter counts laid out as the next of
  ``like_guards``' (the guards in pre-order, as :func:`trees.find_all` gives them)."""
  def convert(node):
    if not isinstance(node, SkipNonfiniteState):
      return node
    template = next(like_guards).nonfinite_hyperparams
    node = node._replace(inner_state=_hyperparams_as_in(node.inner_state, like_guards))
    counts = node.nonfinite_hyperparams
    if template is None:
      return node._replace(nonfinite_hyperparams=None)
    if isinstance(counts, HyperparamCounts) and counts.names == template.names:
      return node
    return node._replace(nonfinite_hyperparams=_zeros_in_boxes(template.names,
                                                               _first_box(template.counts)))

  return jax.tree.map(convert, opt_state, is_leaf=lambda x: isinstance(x, SkipNonfiniteState))


def migrate_from_0_2(opt_state: Any, like: Any = None) -> Any:
  """``opt_state`` with the guards' counters of release 0.2 in today's layout.

  A 0.2 state keeps each guard's ``nonfinite_steps`` and ``last_nonfinite_step`` as
  trees of int32 scalars shaped like the params, and has no ``nonfinite_hyperparams``;
  this returns the same state with each as a :class:`LeafCounts` vector (the same
  values, in the params' leaf order) and ``nonfinite_hyperparams`` at zero, through
  any nesting (``optax.chain``, ``inject_hyperparams``, a guard in a guard,
  :func:`accumulate_gradients`). A state already in today's layout is returned as it
  is. To restore a 0.2 checkpoint, restore it into the target
  :func:`state_in_0_2_layout` gives, then migrate the result.

  A 0.2 state does not say whether a guard around an unguarded safefactor state is
  safefactor's own (which checks its step's hyperparameters) or :func:`skip_nonfinite`
  around ``safefactor(skip_nonfinite_steps=False)`` or ``scale_by_safe_factored_rms``
  (which checks only injected ones): it is taken for safefactor's own, unless ``like``
  is given.

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
    like: optionally, the optimizer's state as today's ``init`` makes it (or its
      ``jax.eval_shape``, the target the checkpoint was restored into before
      :func:`state_in_0_2_layout`): each guard's hyperparameter counters take the
      layout of the guard in the same place in ``like``.

  Returns:
    The state, every guard's per-leaf counters as :class:`LeafCounts`.

  Raises:
    ValueError: when ``like`` holds another number of guards than ``opt_state``.
    TypeError: when a guard's fields come as a mapping (``nnx.state`` of an
      ``nnx.Optimizer``): convert ``optimizer.opt_state`` instead.
  """
  _refuse_guards_as_mappings(opt_state, "migrate_from_0_2")
  migrated = _convert_counters(opt_state, _to_vector, _hyperparam_counts)
  if like is None:
    return migrated
  guards, like_guards = find_all(migrated, SkipNonfiniteState), find_all(like, SkipNonfiniteState)
  if len(guards) != len(like_guards):
    raise ValueError(
        f"like holds {len(like_guards)} guards (SkipNonfiniteState) and opt_state "
        f"{len(guards)}: pass as like the state of the optimizer opt_state was made by")
  return _hyperparams_as_in(migrated, iter(like_guards))


def state_in_0_2_layout(opt_state: Any) -> Any:
  """``opt_state`` with each guard's per-leaf counters as release 0.2 kept them.

  Each :class:`LeafCounts` becomes a tree of int32 scalars shaped like the params, and
  ``nonfinite_hyperparams`` is dropped: the structure a 0.2 checkpoint was written with,
  so the target to restore one into (``state_in_0_2_layout(jax.eval_shape(tx.init,
  params))`` with orbax, say); then :func:`migrate_from_0_2` makes the restored state
  usable by ``update``. The inverse of :func:`migrate_from_0_2`.

  Args:
    opt_state: an optimizer state (or its abstract shapes, from ``jax.eval_shape``).

  Returns:
    The state, every guard's per-leaf counters as trees shaped like the params (in the
    counters' boxes, for an ``nnx.Optimizer``'s state).

  Raises:
    TypeError: when a guard's fields come as a mapping (``nnx.state`` of an
      ``nnx.Optimizer``): convert ``optimizer.opt_state`` instead.
  """
  _refuse_guards_as_mappings(opt_state, "state_in_0_2_layout")
  return _convert_counters(opt_state, _to_tree, lambda guard: None)
