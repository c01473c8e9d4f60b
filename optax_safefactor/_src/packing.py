"""Small unfactored leaves packed as the rows of one array, and stepped once.

A transformer's tree is half small vectors (biases, norm scales). Stepped one by one,
each costs the compiler as much as a weight matrix (its own fusions, reductions and
flags) while moving almost no bytes. Leaves that can share one step (unfactored, no
batch axes, the same size, dtypes and settings, and on one device or replicated) are
flattened and stacked as the rows of a ``(leaves, size)`` array per group, stepped once
with the row as the batch axis, and split back. Each row keeps its leaf's semantics: the
clipping and the parameter scale are reduced per row, as they are per leaf; the weight
decay mask and the finite flag are per row; the random rounding bits are keyed by each
row's own path hash and by the element's index in its leaf (``bit_streams.row_bits``),
so they are the bits the leaf draws alone.

Only the order of a reduction can change a result: a row's sum may round differently
from the leaf's own, by at most ``n`` units in the last place of the sum for a leaf of
``n`` elements (the float summation bound, in either order).

Packing is invisible from outside: the state keeps its per-leaf tree, its arrays are
packed and unpacked inside the step like the params. A leaf whose placement is not known
to be replicated (sharded over mesh axes, or on a mesh whose Auto axes do not say) is
left to its own step: a concatenation along a sharded axis would be a reshard.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_safefactor._src import kernel
from optax_safefactor._src.placement import is_replicated
from optax_safefactor._src.plan import FactorPlan
from optax_safefactor._src.write_back import Rounding

#: Leaves of at most this many elements are packed. Measured on the 2-core CPU with 48
#: leaves of one size, packed against alone, step time (docs/benchmarks.md, "Packing small
#: leaves"): 0.82x-0.95x at 2,048 elements in float32 and bfloat16, with and without
#: momentum; 0.89x-1.04x at 3,072, up to 1.10x at 4,096 and 1.26x at 16,384: the copies into
#: and out of the packed array grow with the leaf, the per-leaf cost saved does not.
#: Packing is on by default, so only sizes where it steps faster are packed.
PACKED_UP_TO = 2048

#: At most this many leaves are packed into one array. Each leaf's part of a packed result
#: is split out by a slice of its own, and XLA compiles a kernel per distinct slice: a slice
#: of row 3 of one group is the same kernel as row 3 of another group of that shape, so
#: groups of a few rows keep the distinct kernels few. Measured on the 600-leaf tree
#: (docs/benchmarks.md, "Packing"): groups of 4 rows compiled fastest (2 to 64 tried); 8 and
#: 64 stepped slightly faster on the CPU but compiled slower.
ROWS_PER_GROUP = 4

#: Leaves that could share a group are packed only when there are at least this many of
#: them. A packed kind of leaf brings kernels of its own (packing, the group's step, the
#: readers of its rows), where leaves stepped alone share one set of kernels for every leaf
#: of their shape; only the leaves beyond one per group save the compiler work. Measured on
#: GPT-2 small with momentum (docs/benchmarks.md, "Packing"): its two kinds of 12 biases
#: cost more compile time packed than alone, its 73 vectors of 768 saved more than they cost.
MIN_LEAVES_TO_PACK = 16

# The packed array's rows are its leaves: the row axis is a batch axis, so every
# reduction of the step (clipping, parameter scale) is per row.
ROWS_PLAN = FactorPlan(row_axes=(), col_axes=(), batch_axes=(0,))


class Group(NamedTuple):
  """Leaves stepped together: their positions in the tree's leaf order, and shapes.

  The first ``repeated`` rows are leaves that an earlier group of the kind owns, stepped
  again only so that the kind's last group has as many rows as the others (their results
  are dropped): every group of a kind is then one shape, and so one set of compiled
  kernels, where a shorter last group brought a set of its own.
  """

  members: tuple[int, ...]
  shapes: tuple[tuple[int, ...], ...]
  repeated: int = 0

  @property
  def owned(self) -> tuple[int, ...]:
    """The leaves whose results this group gives: all but the repeated ones."""
    return self.members[self.repeated:]


def _dtype(x: Any) -> Any:
  return None if x is None else np.dtype(x.dtype)


def _key(grad: Any, leaf: kernel.Leaf, moment: Any, param: Any, momentum: Any,
         compensation: Any) -> tuple | None:
  """What leaves must share to be packed together; ``None`` when this one is not packed."""
  if not isinstance(moment, kernel.FullMoment) or leaf.plan.batch_axes:
    return None
  if not 0 < grad.size <= PACKED_UP_TO or not jnp.issubdtype(grad.dtype, jnp.floating):
    return None
  if not all(is_replicated(x) for x in (grad, param, moment.v, momentum, compensation)):
    return None
  mask_is_array = leaf.decays and leaf.decay_mask is not True
  return (grad.size, _dtype(grad), _dtype(param), _dtype(moment.v), _dtype(momentum),
          _dtype(compensation), np.dtype(leaf.compute_dtype), leaf.decays, mask_is_array,
          leaf.rounding is None)


def find_groups(grads: list, leaves: list, moments: list, params: list, momenta: list,
                compensations: list) -> list[Group]:
  """The groups of two or more leaves that are stepped together, in leaf order.

  Leaves that can share a step form a kind; a kind of fewer than ``MIN_LEAVES_TO_PACK``
  leaves is not packed.
  """
  by_key: dict[tuple, list[int]] = {}
  for index, parts in enumerate(zip(grads, leaves, moments, params, momenta, compensations,
                                    strict=True)):
    key = _key(*parts)
    if key is not None:
      by_key.setdefault(key, []).append(index)
  groups = []
  for members in by_key.values():
    if len(members) < MIN_LEAVES_TO_PACK:
      continue
    for start in range(0, len(members), ROWS_PER_GROUP):
      chunk = members[start:start + ROWS_PER_GROUP]
      # A short last group takes its first rows again from the group before it.
      repeated = ROWS_PER_GROUP - len(chunk) if start else 0
      if repeated > 0:
        chunk = members[start - repeated:start + ROWS_PER_GROUP]
      if len(chunk) > 1:
        groups.append(Group(tuple(chunk), tuple([tuple(grads[i].shape) for i in chunk]),
                            repeated))
  return groups


def pack(group: Group, arrays: list) -> Any:
  """The group's arrays, flattened and stacked as rows (``None`` when they are ``None``)."""
  parts = [arrays[i] for i in group.members]
  if parts[0] is None:
    return None
  return jnp.stack([jnp.ravel(x) for x in parts])


def unpack(group: Group, packed: Any, row_index: list) -> list:
  """The owned rows of ``packed`` back in their leaves' shapes (``None`` for ``None``).

  Row ``r`` is read at ``row_index[r]``, an index known only at run time
  (``xla_hints.row_indices``), so that reading it is the same kernel for every row.
  """
  if packed is None:
    return [None] * len(group.owned)
  return [jax.lax.dynamic_slice_in_dim(packed, row_index[row], 1).reshape(group.shapes[row])
          for row in range(group.repeated, len(group.members))]


def packed_leaf(group: Group, leaves: list[kernel.Leaf]) -> kernel.Leaf:
  """The :class:`kernel.Leaf` of the packed array: the members' settings, per row."""
  members = [leaves[i] for i in group.members]
  first = members[0]
  decay_mask = first.decay_mask
  if first.decays and decay_mask is not True:
    decay_mask = jnp.stack([jnp.ravel(jnp.broadcast_to(leaf.decay_mask, shape))
                            for leaf, shape in zip(members, group.shapes, strict=True)])
  rounding = first.rounding
  if rounding is not None:
    hashes = np.asarray([leaf.rounding.path_hash for leaf in members], np.uint32)
    rounding = Rounding(rounding.stochastic, rounding.seed, rounding.step, hashes)
  return first._replace(plan=ROWS_PLAN, decay_mask=decay_mask, rounding=rounding,
                        rows_are_leaves=True)


class Unit(NamedTuple):
  """What one call of the kernel steps: one leaf, or a group of leaves packed as rows.

  Attributes:
    group: the leaves it steps.
    packed: whether they are packed as rows; a unit of one leaf stepped alone is not, and
      its inputs and results are that leaf's own (no gather, no scatter).
    index: the first member's position in the tree's leaf order: the leaf itself, for a
      unit that is not packed.
    owned: the leaves whose results it gives (``Group.owned``).
  """

  group: Group
  packed: bool
  index: int
  owned: tuple[int, ...]


def units(grads: list, leaves: list, moments: list, params: list, momenta: list,
          compensations: list, *, enabled: bool) -> list[Unit]:
  """Every leaf in one unit: the packed groups first, then the other leaves one by one."""
  groups = (find_groups(grads, leaves, moments, params, momenta, compensations)
            if enabled else [])
  packed = {index for group in groups for index in group.owned}
  return [Unit(group, True, group.members[0], group.owned) for group in groups] + [
      Unit(Group((index,), (tuple(grad.shape),)), False, index, (index,))
      for index, grad in enumerate(grads) if index not in packed]


def gather(unit: Unit, column: list) -> Any:
  """The unit's value of a per-leaf ``column``: the leaf's own, or the group's rows."""
  if not unit.packed:
    return column[unit.group.members[0]]
  first = column[unit.group.members[0]]
  if isinstance(first, kernel.FullMoment):
    return kernel.FullMoment(pack(unit.group, {i: column[i].v for i in unit.group.members}))
  if isinstance(first, kernel.Leaf):
    return packed_leaf(unit.group, column)
  return pack(unit.group, column)


def scatter(unit: Unit, value: Any, row_index: list) -> list:
  """The per-leaf values of a unit's result, in its members' order (``unpack``)."""
  if not unit.packed:
    return [value]
  if isinstance(value, kernel.FullMoment):
    return [kernel.FullMoment(v) for v in unpack(unit.group, value.v, row_index)]
  return unpack(unit.group, value, row_index)


def rows(unit: Unit, value: jax.Array) -> list:
  """A per-row value (a flag, a sum) as one scalar per owned member."""
  if not unit.packed:
    return [value]
  return [value[row] for row in range(unit.group.repeated, len(unit.group.members))]


def owned_rows(unit: Unit, value: jax.Array) -> jax.Array:
  """A per-row vector (the finite flags) without the repeated rows' entries."""
  return value[unit.group.repeated:] if unit.packed and unit.group.repeated else value
