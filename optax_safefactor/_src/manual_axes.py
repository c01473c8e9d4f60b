"""Inside ``jax.shard_map``: values that differ between devices, and whole-array decisions.

Under ``jax.jit`` every array is whole (GSPMD splits the work, not the maths), so a leaf's
reductions and the guard's verdict are the whole array's, and nothing here changes the
program. Inside ``jax.shard_map`` each device sees its own shard of a split param, and
with ``check_vma=True`` (shard_map's default) a value's type names the mesh axes over which
it differs between devices. This module reads those axes so that

- the guard's verdict and counters are the whole step's: a leaf is finite when every
  shard of it is, so that every device skips the same steps (each deciding from its own
  shard would apply half of a step, and leave replicated counters that differ);
- the spike rule's gradient norm is the whole tree's;
- what cannot be computed from a shard (Adafactor's row and column statistics, the update's
  RMS clipping, the parameter scale: reductions over a whole leaf, over axes this module
  cannot tell apart) is refused with the leaf's path, as are gradients that were not
  averaged over the devices whose params they update.

With ``check_vma=False`` the types carry no axes: every value then looks replicated, and
nothing can be checked or agreed (the guide on sharding says so).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def varying_axes(x: Any) -> tuple[str, ...]:
  """The manual mesh axes over which ``x`` differs between devices, sorted; ``()`` outside
  ``jax.shard_map`` (under ``jax.jit`` or ``jax.pmap``), for anything that is not an array,
  and inside ``shard_map(check_vma=False)``.

  >>> varying_axes(jnp.ones(3))
  ()
  """
  try:
    aval = jax.typeof(x)
  except TypeError:
    return ()
  # JAX 0.7 names the axes ``aval.vma``; later releases keep them in
  # ``aval.manual_axis_type.varying``.
  manual = getattr(aval, "manual_axis_type", None)
  axes = getattr(manual, "varying", None) if manual is not None else getattr(aval, "vma", None)
  return tuple(sorted(axes)) if axes else ()


def on_every_shard(flags: jax.Array) -> jax.Array:
  """``flags`` (bools) true only where they are true on every device over which they
  vary: a split leaf is finite when each of its shards is. Unchanged (the same object)
  where nothing varies, which is everywhere outside ``jax.shard_map``."""
  axes = varying_axes(flags)
  if not axes:
    return flags
  return jax.lax.pmin(flags.astype(jnp.int32), axes) > 0


def whole_sum(shard_sum: jax.Array) -> jax.Array:
  """A sum over a leaf's shard, summed over the devices over which it varies: the sum over
  the whole leaf. Unchanged where nothing varies."""
  axes = varying_axes(shard_sum)
  return jax.lax.psum(shard_sum, axes) if axes else shard_sum


def axes_phrase(axes: tuple[str, ...]) -> str:
  """``mesh axis 'x'`` or ``mesh axes 'x', 'y'``, for messages.

  >>> axes_phrase(("data", "model"))
  "mesh axes 'data', 'model'"
  """
  names = ", ".join(repr(axis) for axis in axes)
  return f"mesh axis {names}" if len(axes) == 1 else f"mesh axes {names}"


def pmean_call(name: str, axes: tuple[str, ...]) -> str:
  """The call that averages ``name`` over ``axes``, for messages.

  >>> pmean_call("grads", ("data",))
  "jax.lax.pmean(grads, 'data')"
  """
  return f"jax.lax.pmean({name}, {repr(axes[0]) if len(axes) == 1 else repr(axes)})"


def unaveraged_grads_error(path_name: str, axes: tuple[str, ...]) -> ValueError:
  """The error for a grad that differs between devices over ``axes`` where its param
  does not: each device would step the same param differently."""
  return ValueError(
      f"{path_name}: the gradient differs from device to device inside jax.shard_map (it "
      f"varies over {axes_phrase(axes)}) while the param does not, so each device would "
      f"update the same param differently; average the gradients first, "
      f"{pmean_call('grads', axes)}"
  )


def shard_statistics_error(path_name: str, axes: tuple[str, ...],
                           reductions: list[str]) -> ValueError:
  """The error for a leaf split over ``axes`` inside ``jax.shard_map`` whose step reduces
  over the whole leaf (``reductions`` says which): each device would compute them over
  its own shard, which is another algorithm."""
  listed = " and ".join([", ".join(reductions[:-1]), reductions[-1]] if len(reductions) > 1
                        else reductions)
  return ValueError(
      f"{path_name} is split over {axes_phrase(axes)} inside jax.shard_map, and {listed} "
      "reduce over the whole leaf, which a device holding one shard would compute over that "
      "shard alone. Call the optimizer under jax.jit with the params' shardings instead (the "
      "whole arrays, split by the compiler; osf.state_partition_specs gives the state's), or "
      "give shard_map the param replicated (in_specs P()) and average the gradients with "
      "jax.lax.pmean"
  )
