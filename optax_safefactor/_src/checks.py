"""Static checks run while tracing ``init`` and ``update``: free under jit.

Every message names the parameter path (``params['dense']['kernel']``) so that a
mismatch in a tree of hundreds of leaves is found at once.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

KeyPath = tuple[Any, ...]


def path_name(path: KeyPath, root: str = "params") -> str:
  """``params['dense']['kernel']`` for a key path."""
  return root + jax.tree_util.keystr(path)


def _paths(tree: Any) -> list[str]:
  return [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def check_same_structure(grads: Any, reference: Any, reference_name: str) -> None:
  """Raise ``ValueError`` listing missing and unexpected leaves when the trees differ."""
  grads_def = jax.tree.structure(grads)
  reference_def = jax.tree.structure(reference)
  if grads_def == reference_def:
    return
  grad_paths, reference_paths = _paths(grads), _paths(reference)
  missing = [p for p in reference_paths if p not in set(grad_paths)]
  unexpected = [p for p in grad_paths if p not in set(reference_paths)]
  details = []
  if missing:
    details.append(f"missing from grads: {', '.join(missing)}")
  if unexpected:
    details.append(f"in grads but not in {reference_name}: {', '.join(unexpected)}")
  if not details:
    details.append(f"grads tree {grads_def} != {reference_name} tree {reference_def}")
  raise ValueError(f"grads do not match {reference_name}: " + "; ".join(details))


def check_param_leaf(path: KeyPath, leaf: Any, what: str = "param") -> None:
  """A leaf must be a floating or complex array: no Python numbers, no integers or bools."""
  if not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
    raise TypeError(
        f"{path_name(path)}: {what} is a {type(leaf).__name__} ({leaf!r}), not an array; "
        "make it one with jnp.asarray (a Python number has no dtype or shape to keep "
        "statistics for)"
    )
  if not jnp.issubdtype(leaf.dtype, jnp.inexact):
    raise TypeError(
        f"{path_name(path)}: {what} dtype {leaf.dtype} is not floating or complex; "
        "exclude it with optax.masked or optax.multi_transform"
    )


def check_state_type(state: Any, expected: type, grads: Any) -> None:
  """``update`` must get the state this transformation's ``init`` made.

  The usual mistakes are an ``optax.adafactor`` state (to be converted with
  ``migrate_from_optax``), arguments in the wrong order, and a checkpoint restored
  without a target (plain lists and dicts).
  """
  if isinstance(state, expected):
    return
  if isinstance(grads, expected):
    raise TypeError(
        "update got the optimizer state as its first argument; call "
        "update(grads, opt_state, params)"
    )
  kind = type(state).__name__
  hint = ""
  if _holds_optax_factored_state(state):
    hint = ("; it looks like an optax.adafactor state: convert it with "
            "osf.migrate_from_optax(optax_state, optimizer, params)")
  elif isinstance(state, (list, dict)):
    hint = ("; a checkpoint restored without a target gives plain lists and dicts: "
            "restore with the state of optimizer.init(params) (or "
            "jax.eval_shape(optimizer.init, params)) as the target")
  raise TypeError(f"update expected a {expected.__name__} from this optimizer's init, "
                  f"got a {kind}{hint}")


def _holds_optax_factored_state(state: Any) -> bool:
  import optax

  def is_factored(x):
    return isinstance(x, optax.FactoredState)

  return any(is_factored(x) for x in jax.tree.leaves(state, is_leaf=is_factored))


def check_update_inputs(grads: Any, params: Any | None) -> None:
  """Static checks of ``update``'s grads (and params), naming the parameter path."""
  jax.tree_util.tree_map_with_path(lambda path, g: check_param_leaf(path, g, "grad"), grads)
  if params is not None:
    check_same_structure(grads, params, "params")
    jax.tree_util.tree_map_with_path(check_grad_matches_param, grads, params)


def check_state_fits_plans(grads: Any, second_moment: Any, plans: Any) -> None:
  """Each leaf's statistics must have the shapes its plan gives (keepdims).

  The state's shapes record the plan ``init`` used; a mismatch means the state was
  made for other params or with other factoring settings.
  """
  def check_leaf(path, grad, moment, plan):
    if plan.factored:
      expected = {"v_row": plan.row_stat_shape(grad.shape),
                  "v_col": plan.col_stat_shape(grad.shape)}
    else:
      expected = {"v": tuple(grad.shape)}
    found = {name: tuple(stat.shape) for name, stat in moment._asdict().items()}
    if found != expected:
      raise ValueError(
          f"{path_name(path)}: optimizer state {found} does not fit grad shape "
          f"{tuple(grad.shape)} (expected {expected}); was the state made for other "
          "parameters, or with other factored / min_dim_size_to_factor / factor_rules?"
      )

  jax.tree_util.tree_map_with_path(check_leaf, grads, second_moment, plans)


def check_grad_matches_param(path: KeyPath, grad: Any, param: Any) -> None:
  """Shapes must be equal and dtypes identical."""
  if tuple(grad.shape) != tuple(param.shape):
    raise ValueError(
        f"{path_name(path)}: grad shape {tuple(grad.shape)} != param shape {tuple(param.shape)}"
    )
  if grad.dtype != param.dtype:
    raise TypeError(
        f"{path_name(path)}: grad dtype {grad.dtype} != param dtype {param.dtype}; "
        "cast the gradients to the parameters' dtype"
    )
