"""Flax's metadata boxes around params: nnx Variables and linen ``Partitioned`` boxes.

When ``init`` is given boxed params, each state array is put in a box of the same
kind whose sharding names have the reduced axes set to ``None``: copying a 2-D
``('data', 'model')`` annotation onto a (d, 1) statistic would shard a size-1 axis,
which is why Flax refuses the incumbents' state. Flax is optional, so boxes are
recognised by their methods, not their types.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# nnx Variables keep their mesh-axis names under one of these metadata keys,
# depending on the flax version.
_NNX_SHARDING_KEYS = ("out_sharding", "sharding_names", "sharding")


def _is_nnx_variable(x: Any) -> bool:
  return all(hasattr(x, name) for name in ("get_metadata", "get_value", "replace"))


def _is_linen_box(x: Any) -> bool:
  return all(hasattr(x, name) for name in ("unbox", "replace_boxed", "names"))


def is_box(x: Any) -> bool:
  """Whether ``x`` is a flax metadata box (an nnx Variable or a linen Partitioned)."""
  return _is_nnx_variable(x) or _is_linen_box(x)


def unbox(x: Any) -> Any:
  """The array inside a box; anything else unchanged."""
  if _is_nnx_variable(x):
    return x.get_value()
  if _is_linen_box(x):
    return x.unbox()
  return x


def _reduce_names(names: Any, param_shape: Sequence[int], shape: Sequence[int]) -> Any:
  if not isinstance(names, (tuple, list)) or len(names) != len(param_shape):
    return names
  if len(shape) != len(param_shape):
    return (None,) * len(shape)
  return tuple(
      name if size == param_size and size != 1 else None
      for name, param_size, size in zip(names, param_shape, shape, strict=True)
  )


def rebox_like(box: Any, value: Any) -> Any:
  """``value`` in a box like ``box``, with sharding names fitted to ``value``'s shape.

  Plain values (no box) are returned unchanged.
  """
  if not is_box(box):
    return value
  param_shape = unbox(box).shape
  if _is_nnx_variable(box):
    metadata = box.get_metadata()
    fitted = {
        key: _reduce_names(metadata[key], param_shape, value.shape)
        for key in _NNX_SHARDING_KEYS
        if key in metadata
    }
    return box.replace(value=value, **fitted)
  return box.replace(value=value, names=_reduce_names(box.names, param_shape, value.shape))
