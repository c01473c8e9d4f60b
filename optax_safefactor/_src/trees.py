"""Small tree helpers shared by the transformation and the guard."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def keep_unless_skipped(step_finite: jax.Array | None, new: jax.Array, old: jax.Array) -> jax.Array:
  """``new``, or ``old`` (exactly) when the step is skipped; ``new`` without a guard."""
  if step_finite is None:
    return new
  return jnp.where(step_finite, new, jnp.asarray(old, new.dtype))


def zero_if_skipped(step_finite: jax.Array | None, update: jax.Array) -> jax.Array:
  """``update``, or zeros when the step is skipped; ``update`` without a guard."""
  if step_finite is None:
    return update
  return jnp.where(step_finite, update, jnp.zeros((), update.dtype))


def unzip_leaf_results(reference: Any, results: Any, arity: int) -> tuple[Any, ...]:
  """Split a tree of per-leaf tuples (shaped like ``reference``) into ``arity`` trees.

  >>> unzip_leaf_results({"a": 0, "b": 0}, {"a": (1, 2), "b": (3, 4)}, 2)
  ({'a': 1, 'b': 3}, {'a': 2, 'b': 4})
  """
  treedef = jax.tree.structure(reference)
  columns = list(zip(*treedef.flatten_up_to(results), strict=True)) or [()] * arity
  return tuple(jax.tree.unflatten(treedef, column) for column in columns)


def find_all(tree: Any, kind: type) -> list[Any]:
  """Every node of type ``kind`` in ``tree``, outermost first, without looking inside them.

  >>> from typing import NamedTuple
  >>> class Counter(NamedTuple):
  ...   n: int
  >>> find_all({"a": Counter(1), "b": [Counter(2), 3]}, Counter)
  [Counter(n=1), Counter(n=2)]
  """

  def is_kind(x):
    return isinstance(x, kind)

  return [x for x in jax.tree.leaves(tree, is_leaf=is_kind) if is_kind(x)]
