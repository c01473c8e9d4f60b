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


def check_inexact_leaf(path: KeyPath, leaf: Any, what: str = "param") -> None:
  """Refuse integer and bool leaves: they have no gradient to scale."""
  dtype = jnp.asarray(leaf).dtype if not hasattr(leaf, "dtype") else leaf.dtype
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise TypeError(
        f"{path_name(path)}: {what} dtype {dtype} is not floating or complex; "
        "exclude it with optax.masked or optax.multi_transform"
    )


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


def check_stat_fits(path: KeyPath, name: str, stat: Any, grad: Any) -> None:
  """A statistic must have the grad's rank, with each axis equal to the grad's or 1."""
  fits = len(stat.shape) == len(grad.shape) and all(
      s in (g, 1) for s, g in zip(stat.shape, grad.shape, strict=True)
  )
  if not fits:
    raise ValueError(
        f"{path_name(path)}: optimizer state {name} shape {tuple(stat.shape)} does not fit "
        f"grad shape {tuple(grad.shape)}; was the state made for other parameters?"
    )


def check_hyperparameter(name: str, value: Any, is_valid, requirement: str) -> None:
  """Reject a concrete hyperparameter that fails ``is_valid``; tracers and schedules pass.

  Under ``optax.inject_hyperparams`` numbers arrive as arrays, concrete in ``init``
  and traced in ``update``; only concrete ones can be judged here.
  """
  if value is None or callable(value) or isinstance(value, jax.core.Tracer):
    return
  try:
    number = float(jnp.asarray(value))
  except TypeError:
    return
  if not is_valid(number):
    raise ValueError(f"{name} must be {requirement}, got {value!r}")
