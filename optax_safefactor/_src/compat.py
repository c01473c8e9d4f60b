"""Shims for the older JAX releases this package supports (the floor is in ``pyproject.toml``).

Each shim names the JAX release that added the real thing, so that it can go (and its call
sites use plain JAX) once the floor reaches that release. Features are detected by their
presence, not by version number.

Releases older than the floor lack ``jax.set_mesh`` (added in 0.7.1), which the tests and
the README's examples use, and usable explicit mesh axes (``jax.sharding.reshard``, 0.7.0).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

# jnp.full(..., out_sharding=): added in JAX 0.10.2 (jnp.zeros and jnp.ones had it from 0.7.0).
_FULL_HAS_OUT_SHARDING: bool = "out_sharding" in inspect.signature(jnp.full).parameters


def full(
    shape: Sequence[int], fill_value: Any, dtype: Any, *, out_sharding: NamedSharding
) -> jax.Array:
  """``jnp.full(shape, fill_value, dtype, out_sharding=out_sharding)``.

  For use inside ``jax.jit`` on a mesh with Explicit axes, where the result's sharding is
  part of its type. ``out_sharding=`` on ``jnp.full`` was added in JAX 0.10.2; before it,
  the same array is a replicated ``jnp.full`` resharded onto ``out_sharding`` (each
  device keeps its own slice, nothing is communicated).
  """
  if _FULL_HAS_OUT_SHARDING:
    return jnp.full(shape, fill_value, dtype, out_sharding=out_sharding)
  return jax.sharding.reshard(jnp.full(shape, fill_value, dtype), out_sharding)


def match_sharding(x: jax.Array, like: jax.Array) -> jax.Array:
  """``x``, of ``like``'s shape, placed as ``like`` is, where explicit mesh axes make
  placement part of the type.

  Inside ``jax.jit`` on a mesh with Explicit axes, an array built from indices (``iota``)
  is replicated while a param is sharded. From JAX 0.8.0, ``jnp.where`` and friends reshard
  such an operand themselves; JAX 0.7.x raises ``select cases must have the same
  shardings``. Anywhere else (Auto axes, eager arrays, equal shardings) ``x`` is returned
  unchanged.
  """
  if not isinstance(like, jax.core.Tracer):
    return x
  sharding = getattr(jax.typeof(like), "sharding", None)
  axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
  if not any(axis_type == jax.sharding.AxisType.Explicit for axis_type in axis_types):
    return x
  if jax.typeof(x).sharding.spec == sharding.spec:
    return x
  # The whole sharding, not its spec: a bare spec needs a current mesh (jax.set_mesh),
  # and a step on arrays placed on an Explicit mesh compiles without one.
  return jax.sharding.reshard(x, sharding)
