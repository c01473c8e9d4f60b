"""Which axes of a parameter the second moment is factored over.

A plan names the *row* axes and the *column* axes of a parameter; every other axis
keeps its size in both statistics (a batch axis). The plan is decided once, in
``init``, and is then written into the shapes of the state: ``v_row`` has the
parameter's shape with the column axes set to 1, ``v_col`` has it with the row
axes set to 1. ``update`` reads the plan back off those shapes, so no axis index
is ever recomputed or shifted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class FactorPlan(NamedTuple):
  """The axes a factored second moment averages over.

  Attributes:
    row_axes: axes that index the rows; ``v_col`` is averaged over them.
    col_axes: axes that index the columns; ``v_row`` is averaged over them.
  """

  row_axes: tuple[int, ...]
  col_axes: tuple[int, ...]

  def row_stat_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of ``v_row``: ``shape`` with the column axes set to 1."""
    return tuple(1 if axis in self.col_axes else size for axis, size in enumerate(shape))

  def col_stat_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of ``v_col``: ``shape`` with the row axes set to 1."""
    return tuple(1 if axis in self.row_axes else size for axis, size in enumerate(shape))


def default_plan(
    shape: Sequence[int], factored: bool, min_dim_size_to_factor: int
) -> FactorPlan | None:
  """The heuristic plan of ``optax.scale_by_factored_rms``, without the axis shift.

  The largest axis holds the columns and the second largest the rows, when the
  smaller of the two has at least ``min_dim_size_to_factor`` elements. Ties go to
  the earlier axis, as in optax, so the two libraries factor the same axes.

  >>> default_plan((300, 200), True, 128)
  FactorPlan(row_axes=(1,), col_axes=(0,))
  >>> default_plan((4, 300, 200), True, 128)
  FactorPlan(row_axes=(2,), col_axes=(1,))
  >>> default_plan((300, 100), True, 128) is None
  True

  Args:
    shape: the parameter's shape.
    factored: whether to factor at all.
    min_dim_size_to_factor: the smallest size both factored axes must have.

  Returns:
    The plan, or ``None`` when the second moment is kept unfactored.
  """
  if not factored or len(shape) < 2:
    return None
  by_size = np.argsort(np.asarray(shape), kind="stable")
  row_axis, col_axis = int(by_size[-2]), int(by_size[-1])
  if shape[row_axis] < min_dim_size_to_factor:
    return None
  return FactorPlan(row_axes=(row_axis,), col_axes=(col_axis,))


def plan_from_stat_shapes(
    shape: Sequence[int], row_stat_shape: Sequence[int], col_stat_shape: Sequence[int]
) -> FactorPlan:
  """Read a plan back off the shapes of ``v_row`` and ``v_col``.

  Axes of size 1 in the parameter are never listed: averaging over them changes
  nothing, so they need no role.

  >>> plan_from_stat_shapes((300, 200), (1, 200), (300, 1))
  FactorPlan(row_axes=(1,), col_axes=(0,))
  """
  col_axes = tuple(a for a, (s, r) in enumerate(zip(shape, row_stat_shape, strict=True)) if s != r)
  row_axes = tuple(a for a, (s, c) in enumerate(zip(shape, col_stat_shape, strict=True)) if s != c)
  return FactorPlan(row_axes=row_axes, col_axes=col_axes)
