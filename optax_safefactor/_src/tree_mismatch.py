"""Why two trees that should match do not, in words.

``update`` reads the grads, the params and the state leaf by leaf, so their trees must
match. When they do not, the usual causes are whole mistakes rather than a leaf astray:
the pair ``jax.value_and_grad`` returns given as the gradients, or the gradients or the
state of a larger tree (linen's ``variables``, with its ``batch_stats``) where the params'
belong. :func:`mismatch_error` names such a cause, with the line that mends it;
otherwise it lists the leaves missing on each side. (``checks.check_same_structure``
compares the structures, and comes here only when they differ.)
"""

from __future__ import annotations

from typing import Any

import jax

from optax_safefactor._src import placement
from optax_safefactor._src.state_checks import with_article

KeyPath = tuple[Any, ...]


def path_name(path: KeyPath, root: str = "params") -> str:
  """``params['dense']['kernel']`` for a key path."""
  return root + jax.tree_util.keystr(path)


def _paths(tree: Any) -> list[str]:
  return [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _by_first_key(tree: Any) -> tuple[set[str], dict[Any, set[str]]]:
  """The paths of ``tree``'s leaves (a flax box one leaf), and the same grouped by their
  first key: ``{first key: the paths below it}``. The key is a dict's key or a sequence's
  index, so that a key of one kind of container matches the same key of another
  (``nnx.State``'s 1, a tuple's 1); paths under an attribute (a named tuple's field) are
  left out of the groups."""
  paths, groups = set(), {}
  for path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=placement.is_box)[0]:
    paths.add(jax.tree_util.keystr(path))
    if path and isinstance(path[0], (jax.tree_util.DictKey, jax.tree_util.SequenceKey)):
      first = path[0].key if isinstance(path[0], jax.tree_util.DictKey) else path[0].idx
      groups.setdefault(first, set()).add(jax.tree_util.keystr(path[1:]))
  return paths, groups


def _is_optimizer_state(node: Any) -> bool:
  kind = type(node)
  return (isinstance(node, tuple) and hasattr(node, "_fields") and kind.__name__.endswith("State")
          and kind.__module__.partition(".")[0] in ("optax", "optax_safefactor"))


def optimizer_state_in(tree: Any) -> str | None:
  """The class name of the first optimizer state (optax's or this package's) in ``tree``,
  which is then no tree of params or gradients, else ``None``.

  >>> import optax
  >>> optimizer_state_in((optax.EmptyState(), {"w": 1.0})), optimizer_state_in({"w": 1.0})
  ('EmptyState', None)
  """
  for node in jax.tree.leaves(tree, is_leaf=_is_optimizer_state):
    if _is_optimizer_state(node):
      return type(node).__name__
  return None


def gradient_pair(tree: Any, reference: Any) -> str | None:
  """What a pair given for the gradients is, when one item of it is the gradients: the
  result of ``jax.value_and_grad`` (``(value, grads)``, with ``has_aux`` ``((value, aux),
  grads)``) or of ``jax.grad(..., has_aux=True)`` (``(grads, aux)``), passed whole.

  Read from the leaves' paths, so that containers of another kind still match:
  ``nnx.Optimizer.update`` hands on such a pair as an ``nnx.State`` keyed 1, its params'
  part alone (the loss, no param, filtered out).

  >>> grads = {"w": 0.5}
  >>> print(gradient_pair((1.0, grads), grads))
  the pair (value, grads) that jax.value_and_grad returns (nnx.value_and_grad alike): ...
  >>> gradient_pair(grads, grads) is None
  True
  """
  _, by_item = _by_first_key(tree)
  wanted, _ = _by_first_key(reference)
  if not by_item or not set(by_item) <= {0, 1}:
    return None
  if by_item.get(1) == wanted and by_item.get(0) != wanted:
    with_aux = isinstance(tree, tuple) and isinstance(tree[0], tuple) and len(tree[0]) == 2
    returned, call = (("((value, aux), grads)",
                       "(loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)")
                      if with_aux else
                      ("(value, grads)", "loss, grads = jax.value_and_grad(loss_fn)(params)"))
    return (f"the pair {returned} that jax.value_and_grad returns (nnx.value_and_grad "
            f"alike): step with its second item alone, as in {call}")
  if by_item.get(0) == wanted and by_item.get(1) != wanted:
    return ("the pair (grads, aux) that jax.grad(..., has_aux=True) returns (nnx.grad "
            "alike): step with its first item alone, as in grads, aux = jax.grad(loss_fn, "
            "has_aux=True)(params)")
  return None


def _others(groups: dict[Any, set[str]], key: Any) -> str:
  others = [repr(other) for other in groups if other != key]
  if not others:
    return ""
  shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
  return f" (beside {shown})"


def nested_part(tree: Any, reference: Any, name: str, reference_name: str) -> str | None:
  """Where one tree is the other found under one dict key, and under no other: the
  gradients or the state of a larger tree, linen's ``variables`` (``{"params": ...,
  "batch_stats": ...}``) the usual. (A named tuple's field is no such key:
  ``optax.lookahead`` takes the gradients of its params' ``fast`` field.)

  >>> params = {"dense": {"kernel": 1.0}}
  >>> variables = {"params": params, "batch_stats": {"mean": 0.0}}
  >>> print(nested_part(params, variables, "grads", "params"))
  params hold the grads' leaves under params['params'] (beside 'batch_stats'): pass ...
  >>> print(nested_part({"params": params}, params, "grads", "the optimizer state"))
  grads hold the leaves of the optimizer state under grads['params']: step with ...
  """
  paths, groups = _by_first_key(tree)
  reference_paths, reference_groups = _by_first_key(reference)
  if not paths or not reference_paths:
    return None

  def only_key(groups, wanted):
    keys = [key for key, below in groups.items() if isinstance(key, str) and below == wanted]
    return keys[0] if len(keys) == 1 else None

  key = only_key(reference_groups, paths)
  if key is not None:
    where, besides = f"[{key!r}]", _others(reference_groups, key)
    linen = " (linen's variables hold the params under ['params'])" if key == "params" else ""
    if reference_name == "params":
      return (f"params hold the {name}' leaves under params{where}{besides}: pass "
              f"params{where}{linen}")
    return (f"{reference_name} was made for a larger tree, which holds the {name}' leaves "
            f"under {where}{besides}: make it with init of that part alone"
            + (" (for linen, init(variables['params']), not init(variables))" if linen else ""))
  key = only_key(groups, reference_paths)
  if key is not None:
    where = f"[{key!r}]"
    return (f"{name} hold the leaves of {reference_name} under {name}{where}"
            f"{_others(groups, key)}: step with {name}{where}"
            + (" (the gradient of linen's whole variables?)" if key == "params" else ""))
  return None


def mismatch_error(tree: Any, reference: Any, reference_name: str, *, name: str = "grads",
                   hint: str = "") -> ValueError:
  """The error for two trees of different structures: why they differ, or the leaves
  missing and unexpected.

  ``name`` is what the user passed as ``tree``; ``hint``, if any, ends the message.
  """
  # An optimizer state where update's gradients or params go: its arguments mixed up.
  state, reference_state = optimizer_state_in(tree), optimizer_state_in(reference)
  if name == "grads" and ((state and not reference_state)
                          or (reference_state and reference_name == "params")):
    holder, what = (name, "gradients") if state else (reference_name, "params")
    return ValueError(f"{name} do not match {reference_name}: {holder} hold an optimizer state "
                      f"({with_article(state or reference_state)}), not {what}: call "
                      f"update(grads, opt_state, params){hint}")
  pair = gradient_pair(tree, reference)
  if pair:
    return ValueError(f"{name} do not match {reference_name}: {name} is {pair}{hint}")
  nested = nested_part(tree, reference, name, reference_name)
  if nested:
    return ValueError(f"{name} do not match {reference_name}: {nested}{hint}")
  paths, reference_paths = _paths(tree), _paths(reference)
  missing = [p for p in reference_paths if p not in set(paths)]
  unexpected = [p for p in paths if p not in set(reference_paths)]
  details = []
  if missing:
    details.append(f"missing from {name}: {', '.join(missing)}")
  if unexpected:
    details.append(f"in {name} but not in {reference_name}: {', '.join(unexpected)}")
  if not details:
    # The same leaves in other containers (flax's boxes of another kind, a list for a
    # tuple): name the first container that differs rather than print both trees.
    tree_def, reference_def = jax.tree.structure(tree), jax.tree.structure(reference)
    details.append(first_node_difference(tree_def, reference_def, name) or
                   f"{name} tree {tree_def} != {reference_name} tree {reference_def}")
  return ValueError(f"{name} do not match {reference_name}: " + "; ".join(details) + hint)


def first_node_difference(tree_def: Any, reference_def: Any, path: str) -> str | None:
  """Where two tree structures first hold different kinds of node, in words.

  >>> first_node_difference(jax.tree.structure({"w": (1, 2)}),
  ...                       jax.tree.structure({"w": [1, 2]}), "params")
  "at params['w'], a tuple where the other holds a list"
  """
  data, reference_data = tree_def.node_data(), reference_def.node_data()
  kind, reference_kind = (None if d is None else d[0] for d in (data, reference_data))
  if kind is not reference_kind:
    def noun(node_kind):
      return "leaf" if node_kind is None else node_kind.__name__
    return (f"at {path}, {with_article(noun(kind))} where the other holds "
            f"{with_article(noun(reference_kind))}")
  children, reference_children = tree_def.children(), reference_def.children()
  keys = data[1] if kind is dict else range(len(children))
  if len(children) != len(reference_children):
    return None
  for key, child, reference_child in zip(keys, children, reference_children, strict=True):
    found = first_node_difference(child, reference_child, f"{path}[{key!r}]")
    if found:
      return found
  return None
