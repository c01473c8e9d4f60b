"""Small tree helpers shared by the transformation and the guard."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_safefactor._src import compat, manual_axes


def select(pred: jax.Array, on_true: Any, on_false: Any) -> jax.Array:
  """``jnp.where(pred, on_true, on_false)`` in ``on_true``'s dtype, as one select op.

  ``jnp.where`` wraps each call in a nested jit, which lowers to a call of its own
  computation that XLA must inline again: a step with hundreds of leaves made hundreds of
  them (155 calls in a 24-leaf step), each paid for in tracing, lowering and XLA's passes.
  A scalar ``on_false`` is filled to ``on_true``'s shape (placed as it is), and a
  predicate that is a scalar or of the values' shape goes to ``lax.select`` directly
  (which broadcasts a scalar predicate in its lowering); anything else to ``jnp.where``.

  >>> select(jnp.array(False), jnp.ones(2), 0).tolist()
  [0.0, 0.0]
  """
  on_true = jnp.asarray(on_true)
  on_false = jnp.asarray(on_false, on_true.dtype)
  if on_false.ndim == 0 and on_true.ndim:
    on_false = jax.lax.full_like(on_true, on_false)
  if on_false.shape == on_true.shape and jnp.shape(pred) in ((), on_true.shape):
    return jax.lax.select(jnp.asarray(pred, bool), on_true, on_false)
  return jnp.where(pred, on_true, on_false)


def keep_unless_skipped(step_finite: jax.Array | None, new: jax.Array, old: jax.Array) -> jax.Array:
  """``new``, or ``old`` (exactly) when the step is skipped; ``new`` without a guard.

  A state's value and its update share their shape and dtype, so this is ``lax.select``
  itself (see :func:`select`)."""
  if step_finite is None:
    return new
  if getattr(jax.typeof(old), "sharding", None) != getattr(jax.typeof(new), "sharding", None):
    # A state placed unlike what the step makes of it (restored onto one replicated
    # sharding, say): on explicit mesh axes lax.select refuses the pair, so the kept
    # value takes the new one's placement, as optax's arithmetic gives it.
    old = (compat.match_sharding(old, new) if isinstance(new, jax.core.Tracer)
           else jax.device_put(old, new.sharding))
  return jax.lax.select(step_finite, new, old)


def zero_if_skipped(step_finite: jax.Array | None, update: jax.Array) -> jax.Array:
  """``update``, or zeros when the step is skipped; ``update`` without a guard."""
  if step_finite is None:
    return update
  return select(step_finite, update, 0)


def unzip_leaf_results(reference: Any, results: Any, arity: int) -> tuple[Any, ...]:
  """Split a tree of per-leaf tuples (shaped like ``reference``) into ``arity`` trees.

  >>> unzip_leaf_results({"a": 0, "b": 0}, {"a": (1, 2), "b": (3, 4)}, 2)
  ({'a': 1, 'b': 3}, {'a': 2, 'b': 4})
  """
  treedef = jax.tree.structure(reference)
  columns = list(zip(*treedef.flatten_up_to(results), strict=True)) or [()] * arity
  return tuple([jax.tree.unflatten(treedef, column) for column in columns])


def find_all(tree: Any, kind: type) -> list[Any]:
  """Every node of type ``kind`` in ``tree``, those inside another one included.

  In the tree's order, each node before the nodes inside it: a guard wrapped around
  a chain that holds safefactor's own guard gives both.

  >>> from typing import NamedTuple
  >>> class Counter(NamedTuple):
  ...   n: object
  >>> find_all({"a": Counter(Counter(1)), "b": [Counter(2), 3]}, Counter)
  [Counter(n=Counter(n=1)), Counter(n=1), Counter(n=2)]
  """
  return [node for _, node in find_all_with_paths(tree, kind)]


def find_all_with_paths(tree: Any, kind: type) -> list[tuple[tuple[Any, ...], Any]]:
  """:func:`find_all`'s nodes, each with its key path in ``tree``.

  >>> from typing import NamedTuple
  >>> class Counter(NamedTuple):
  ...   n: object
  >>> [jax.tree_util.keystr(path) for path, _ in
  ...  find_all_with_paths({"a": Counter(Counter(1)), "b": [Counter(2), 3]}, Counter)]
  ["['a']", "['a'].n", "['b'][0]"]
  """
  found = [((), tree)] if isinstance(tree, kind) else []

  def look_inside(prefix, node):
    def is_kind_below(x):
      return x is not node and isinstance(x, kind)

    for path, x in jax.tree_util.tree_flatten_with_path(node, is_leaf=is_kind_below)[0]:
      if is_kind_below(x):
        found.append(((*prefix, *path), x))
        look_inside((*prefix, *path), x)

  look_inside((), tree)
  return found


def _key_names(path: Any) -> tuple[str, ...]:
  return tuple(jax.tree_util.keystr((key,)) for key in path)


def check_prefix_of(prefix: Any, full: Any, prefix_name: str, full_name: str = "params",
                    *, leaf: str = "a leaf") -> None:
  """Raise ``ValueError`` naming the leaves where ``prefix`` is not a prefix tree of ``full``.
  A ``None`` in ``prefix`` is named as such: JAX reads it as an empty subtree, where the user
  (as with ``jax.jit``'s shardings) meant a leaf; ``leaf`` says what to write there.

  >>> check_prefix_of({"w": True}, {"w": 1.0, "b": 2.0}, "mask")
  Traceback (most recent call last):
  ...
  ValueError: mask does not match params (it may stop above params' leaves): nothing for params['b']
  >>> check_prefix_of({"w": True, "b": None}, {"w": 1.0, "b": 2.0}, "mask", leaf="False")
  Traceback (most recent call last):
  ...
  ValueError: mask does not match params (it may stop above params' leaves): nothing for \
params['b'] (mask['b'] is None, which JAX reads as an empty subtree, not a leaf: write False)
  """
  try:
    jax.tree.map(lambda *_: None, prefix, full)
    return
  except ValueError:
    pass
  prefix_paths = [_key_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(prefix)[0]]
  full_paths = [_key_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(full)[0]]

  def covers(short, long):
    return long[:len(short)] == short

  missing = [f for f in full_paths if not any(covers(p, f) for p in prefix_paths)]
  extra = [p for p in prefix_paths if not any(covers(p, f) for f in full_paths)]
  nones = [_key_names(p) for p, x in jax.tree_util.tree_flatten_with_path(
      prefix, is_leaf=lambda x: x is None)[0] if x is None]
  details = []
  if missing:
    named = [p for p in nones if any(covers(p, f) for f in missing)]
    details.append("nothing for " + ", ".join(full_name + "".join(f) for f in missing) + (
        f" ({', '.join(prefix_name + ''.join(p) for p in named)} "
        f"{'is' if len(named) == 1 else 'are'} None, which JAX reads as an empty subtree, "
        f"not a leaf: write {leaf})" if named else ""))
  if extra:
    details.append(", ".join(prefix_name + "".join(p) for p in extra) + f" not in {full_name}")
  # Same leaves, other node types (a list for a tuple, say): show both structures.
  details = details or [f"{jax.tree.structure(prefix)} against {jax.tree.structure(full)}"]
  raise ValueError(
      f"{prefix_name} does not match {full_name} (it may stop above {full_name}' leaves): "
      + "; ".join(details)
  )


def flag_vector(flags: list[jax.Array]) -> jax.Array:
  """Scalar flags, or vectors of them (one per packed leaf), as one bool vector.

  Inside ``jax.shard_map`` a split leaf's flag is its shard's: the vector is then true
  only where every device's is (:func:`manual_axes.on_every_shard`), so that the step's
  verdict and counters are the whole tree's, the same on every device.
  """
  if not flags:
    return jnp.zeros([0], bool)
  if all([jnp.ndim(flag) == 0 for flag in flags]):
    vector = jnp.stack(flags)
  else:
    vector = jnp.concatenate([jnp.ravel(flag) for flag in flags])
  # (Only a traced value can differ between devices.)
  return manual_axes.on_every_shard(vector) if isinstance(vector, jax.core.Tracer) else vector


def check_decay_mask(path: tuple[Any, ...], mask: Any, param: Any) -> None:
  """A leaf's weight-decay mask: ``True``, ``False`` or a bool array that broadcasts to the
  param's shape; else an error naming the param.

  >>> import jax.numpy as jnp
  >>> check_decay_mask((jax.tree_util.DictKey("w"),), jnp.ones((2, 2), bool), jnp.ones((4, 3)))
  Traceback (most recent call last):
  ...
  ValueError: weight_decay_mask for params['w']: a bool array of shape (2, 2) does not ...
  """
  if isinstance(mask, (bool, np.bool_)):
    return
  dtype = getattr(mask, "dtype", None)
  where = f"weight_decay_mask for params{jax.tree_util.keystr(path)}"
  if dtype is None or np.dtype(dtype) != np.bool_:
    # A float mask would otherwise be read as True wherever it is not 0.
    got = (f"{type(mask).__name__} {mask!r}" if dtype is None
           else f"a {np.dtype(dtype).name} array")
    raise TypeError(f"{where}: a mask is True, False or a bool array, got {got}")
  try:
    fits = np.broadcast_shapes(np.shape(mask), np.shape(param)) == np.shape(param)
  except ValueError:
    fits = False
  if not fits:
    raise ValueError(f"{where}: a bool array of shape {tuple(np.shape(mask))} does not "
                     f"broadcast to the param's shape {tuple(np.shape(param))}")
