"""Which axes of a parameter are rows, columns or batch: decided once per leaf.

A plan names the *row* axes and the *column* axes of a parameter, and its *batch*
axes (stacked layers, experts: separate slices). :class:`Planner` builds it from
``(path, shape)`` once per leaf, from the user's factor rules or the heuristic, and
both ``init`` and ``update`` use that plan. The plan is also written into the state's
shapes (``v_row`` has the parameter's shape with the column axes set to 1, ``v_col``
with the row axes set to 1), which serves as a consistency check and lets migration
read a plan back; a shape cannot tell a batch axis from an axis with no role, which
is why ``update`` asks the planner rather than the state.
"""

from __future__ import annotations

import difflib
import math
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec

from optax_safefactor._src import checks, placement, user_warnings

ROLES = ("row", "column", "batch", "none")

#: Logical axis names that hold separate layers or experts: factored per slice.
#: Read-only: copy it into a dict of your own to extend it.
DEFAULT_LOGICAL_RULES: Mapping[str, str] = types.MappingProxyType({
    "layers": "batch", "layer": "batch", "stack": "batch", "stage": "batch",
    "expert": "batch", "experts": "batch",
})

Roles = Sequence[str | None]
FactorRulesFn = Callable[[Any, tuple[int, ...]], "Roles | None"]


class FactorPlan(NamedTuple):
  """The axes a factored second moment averages over.

  Attributes:
    row_axes: axes that index the rows; ``v_col`` is averaged over them.
    col_axes: axes that index the columns; ``v_row`` is averaged over them.
    batch_axes: axes that index separate slices (stacked layers, experts): the
      statistics, the row-mean normaliser, update clipping and the parameter scale
      are all computed per slice. Every other axis keeps its size in both
      statistics, but clipping and the parameter scale span it (as in optax).
  """

  row_axes: tuple[int, ...]
  col_axes: tuple[int, ...]
  batch_axes: tuple[int, ...] = ()

  @property
  def factored(self) -> bool:
    return bool(self.row_axes) and bool(self.col_axes)

  def row_stat_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of ``v_row``: ``shape`` with the column axes set to 1."""
    return tuple([1 if axis in self.col_axes else size for axis, size in enumerate(shape)])

  def col_stat_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of ``v_col``: ``shape`` with the row axes set to 1."""
    return tuple([1 if axis in self.row_axes else size for axis, size in enumerate(shape)])

  def stat_shapes(self, shape: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """The statistics' shapes for a leaf of ``shape``, by their names in the state."""
    if self.factored:
      return {"v_row": self.row_stat_shape(shape), "v_col": self.col_stat_shape(shape)}
    return {"v": tuple(shape)}


def default_plan(
    shape: Sequence[int], factored: bool, min_dim_size_to_factor: int
) -> FactorPlan | None:
  """The heuristic plan of ``optax.scale_by_factored_rms``, without the axis shift.

  The largest axis holds the columns and the second largest the rows, when the
  smaller of the two has at least ``min_dim_size_to_factor`` elements. Of equal axes
  the later counts as the larger, as in optax, so the two libraries factor the same axes.

  >>> default_plan((256, 256, 256), True, 128)
  FactorPlan(row_axes=(1,), col_axes=(2,), batch_axes=())

  >>> default_plan((300, 200), True, 128)
  FactorPlan(row_axes=(1,), col_axes=(0,), batch_axes=())
  >>> default_plan((4, 300, 200), True, 128)
  FactorPlan(row_axes=(2,), col_axes=(1,), batch_axes=())
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


def plan_from_roles(
    shape: Sequence[int], roles: Roles, min_dim_size_to_factor: int, factored: bool,
    where: str = "param",
) -> FactorPlan:
  """A plan from per-axis roles; axes whose role is ``None`` are left to the heuristic.

  >>> plan_from_roles((4, 300, 200), ("batch", None, None), 128, True)
  FactorPlan(row_axes=(2,), col_axes=(1,), batch_axes=(0,))
  >>> plan_from_roles((3, 3, 64, 128), ("row", "row", "row", "column"), 128, True)
  FactorPlan(row_axes=(0, 1, 2), col_axes=(3,), batch_axes=())

  Raises:
    ValueError: naming ``where``, for a rule of the wrong rank, an unknown role, or
      rows without columns.
  """
  if isinstance(roles, str) or not isinstance(roles, Iterable):
    # A bare string would otherwise be read as one role per character.
    raise TypeError(
        f"{where}: factor rule gives {roles!r}; return one role per axis of the rank-"
        f"{len(shape)} param (each one of {', '.join(map(repr, ROLES))} or None, as in "
        f"{(None,) * len(shape)}), or None for the heuristic"
    )
  roles = tuple(roles)
  if len(roles) != len(shape):
    raise ValueError(
        f"{where}: factor rule gives {len(roles)} roles {roles} for a rank-{len(shape)} "
        f"param of shape {tuple(shape)}"
    )
  unknown = [role for role in roles if role is not None and role not in ROLES]
  if unknown:
    raise ValueError(f"{where}: unknown factor roles {unknown}; use one of {ROLES} or None")
  row_axes = _axes_with_role(roles, "row")
  col_axes = _axes_with_role(roles, "column")
  if bool(row_axes) != bool(col_axes):
    raise ValueError(f"{where}: factor rule {roles} names rows without columns or vice versa")
  if not row_axes:
    open_axes = [a for a, role in enumerate(roles) if role is None]
    heuristic = default_plan(
        [shape[a] for a in open_axes], factored, min_dim_size_to_factor
    )
    if heuristic is not None:
      row_axes = (open_axes[heuristic.row_axes[0]],)
      col_axes = (open_axes[heuristic.col_axes[0]],)
  return FactorPlan(row_axes, col_axes, _axes_with_role(roles, "batch"))


def _axes_with_role(roles: Roles, role: str) -> tuple[int, ...]:
  return tuple([axis for axis, axis_role in enumerate(roles) if axis_role == role])


class Planner:
  """The plan of every leaf, built once per ``(path, shape)`` and then reused.

  ``init`` and every trace of ``update`` ask the same planner, so the user's factor
  rules run once per leaf, and the two can never disagree.

  >>> planner = Planner(factored=True, min_dim_size_to_factor=128, factor_rules=None)
  >>> planner((jax.tree_util.DictKey("w"),), (300, 200))
  FactorPlan(row_axes=(1,), col_axes=(0,), batch_axes=())
  >>> planner((jax.tree_util.DictKey("b"),), (200,)).factored
  False
  """

  def __init__(self, factored: bool, min_dim_size_to_factor: Any,
               factor_rules: FactorRulesFn | None):
    self._factored = factored
    self._min_dim_size_to_factor = min_dim_size_to_factor
    self._factor_rules = factor_rules
    self._roles: dict[tuple[str, tuple[int, ...]], Roles | None] = {}
    self._plans: dict[tuple[Any, ...], FactorPlan] = {}

  def _min_size(self, factored_in_state: bool | None) -> int | float:
    if isinstance(self._min_dim_size_to_factor, jax.core.Tracer):
      if factored_in_state is not None:
        # optax.inject_hyperparams rebuilds the transformation with traced numbers on
        # every update; the size threshold only decides *whether* to factor, which the
        # state that init made records.
        return 0 if factored_in_state else math.inf
      raise checks.traced_shape_setting("min_dim_size_to_factor",
                                        "which leaves are factored (the state's shapes)")
    return int(self._min_dim_size_to_factor)

  def __call__(
      self, path: Any, shape: Sequence[int], factored_in_state: bool | None = None
  ) -> FactorPlan:
    """The plan for one leaf.

    ``factored_in_state`` (used by ``update``) says whether the state holds factored
    statistics for the leaf; it is read only when ``min_dim_size_to_factor`` is traced.
    """
    shape = tuple([int(size) for size in shape])
    key = (jax.tree_util.keystr(tuple(path)), shape)
    if key not in self._roles:
      self._roles[key] = None if self._factor_rules is None else self._factor_rules(path, shape)
    plan_key = (*key, factored_in_state)
    if plan_key not in self._plans:
      self._plans[plan_key] = self._build(path, shape, self._roles[key],
                                          self._min_size(factored_in_state))
    return self._plans[plan_key]

  def _build(self, path: Any, shape: tuple[int, ...], roles: Roles | None,
             min_size: int | float) -> FactorPlan:
    if roles is None:
      plan = default_plan(shape, self._factored, min_size)
      return FactorPlan((), ()) if plan is None else plan
    return plan_from_roles(shape, roles, min_size, self._factored,
                           where="params" + jax.tree_util.keystr(tuple(path)))


def _is_names(node: Any) -> bool:
  """One param's logical axis names: a tuple (a ``PartitionSpec`` is one), or a list, of
  names and ``None``s. A list of names was taken for a list of params, each name a leaf,
  and matched no param: every rule was silently left to the heuristic."""
  return isinstance(node, tuple) or (
      isinstance(node, list) and all(name is None or isinstance(name, str) for name in node))


class NamedParamRules:
  """``factor_rules`` read off a table of params by name, which knows the names it holds.

  ``roles(name, entry, shape)`` gives a named param's roles; a param the table does not
  name is left to the heuristic. Because of that, a misspelt name costs nothing visible:
  the param it meant is factored by the heuristic (a stacked ``layers`` axis as a matrix
  axis). :meth:`misspelt` finds that case for ``init`` to warn of.
  """

  def __init__(self, entries: Mapping[str, Any], name_of: Callable[[Any], str],
               roles: Callable[[str, Any, tuple[int, ...]], Roles | None], origin: str):
    self._entries = dict(entries)
    self._name_of = name_of
    self._roles = roles
    self._origin = origin

  def __call__(self, path: Any, shape: tuple[int, ...]) -> Roles | None:
    name = self._name_of(path)
    if name not in self._entries:
      return None
    return self._roles(name, self._entries[name], tuple(shape))

  def misspelt(self, paths_and_shapes: Iterable[tuple[Any, Sequence[int]]],
               masked_paths: Iterable[Any] = ()) -> str | None:
    """A warning when the table names a param the tree lacks while a param of two or
    more axes goes unnamed. Either alone is ordinary: one table may name a whole model
    whose params ``optax.multi_transform`` splits, or name only the stacked params. A
    name under ``masked_paths`` (where ``optax.masked`` or ``optax.multi_transform`` left
    a subtree out, as an ``optax.MaskedNode``) is not lacking."""
    names = {self._name_of(path): len(shape) for path, shape in paths_and_shapes}
    masked = [self._name_of(path) for path in masked_paths]
    absent = sorted(name for name in set(self._entries) - set(names)
                    if not any(name == prefix or (name.startswith(prefix)
                                                  and name[len(prefix)] in "[./")
                               for prefix in masked))
    unnamed = sorted(name for name, rank in names.items()
                     if rank >= 2 and name not in self._entries)
    if not absent or not unnamed:
      return None
    guesses = [f"{name} (closest unnamed param: {close[0]})"
               if (close := difflib.get_close_matches(name, unnamed, n=1, cutoff=0.5))
               else name for name in absent]
    return (f"{self._origin} names params this tree does not have: {', '.join(guesses)}; "
            f"and {len(unnamed)} param(s) of two or more axes have no names, so the "
            f"heuristic factors them ({', '.join(unnamed[:3])}"
            f"{', ...' if len(unnamed) > 3 else ''}). Check the names' tree against the "
            "params' paths")


def warn_if_misspelt(factor_rules: Any, params: Any,
                     paths_and_shapes: Iterable[tuple[Any, Sequence[int]]]) -> None:
  """Warn, once per ``init``, of names in ``factor_rules`` that match no param."""
  if isinstance(factor_rules, NamedParamRules):
    def is_masked(node):
      return isinstance(node, optax.MaskedNode)

    masked = [path for path, node in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=is_masked)[0] if is_masked(node)]
    message = factor_rules.misspelt(paths_and_shapes, masked)
    if message is not None:
      user_warnings.warn(message)


def _key_path(path: Any) -> str:
  return "params" + jax.tree_util.keystr(tuple(path))


def _as_names(names: Any) -> tuple[Any, ...]:
  """One param's names as a tuple; a ``PartitionSpec`` is kept as one (it may be short)."""
  return names if isinstance(names, PartitionSpec) else tuple(names)


def logical_factor_rules(
    axis_names: Any, rules: Mapping[str, str] | None = None
) -> FactorRulesFn:
  """Factor rules from logical axis names (flax partitioning names, T5X style).

  ``init`` warns when ``axis_names`` names a param the tree does not have while a param
  of two or more axes has no names: a misspelt path, which would leave that param to the
  heuristic.

  Args:
    axis_names: a tree like the params whose leaves are tuples (or lists) of logical axis
      names (``None`` for an unnamed axis), e.g. what ``nn.get_partition_spec`` holds for
      logically partitioned params, or ``nnx.get_partition_spec`` of an NNX model's
      params (each names' tuple inside its Variable). A ``PartitionSpec`` shorter than
      its param leaves the last axes unnamed, as in sharding (flax gives an
      unannotated param ``P()``); a plain tuple must name every axis.
    rules: logical name -> role; defaults to :data:`DEFAULT_LOGICAL_RULES`
      (``layers``, ``stack``, ``expert``... are batch axes). Names without a rule are
      left to the heuristic. Anything but a mapping is a ``TypeError``.

  Returns:
    A ``(path, shape) -> roles`` callable for ``factor_rules``.

  >>> rules = logical_factor_rules({"w": ("layers", "embed", "mlp")})
  >>> rules((jax.tree_util.DictKey("w"),), (12, 768, 3072))
  ('batch', None, None)
  """
  rules = DEFAULT_LOGICAL_RULES if rules is None else rules
  if not isinstance(rules, Mapping):
    # (name, role) pairs, as flax writes its logical axis rules, or presets.t5x's
    # "standard", failed in init with an AttributeError that named neither.
    raise TypeError(f"logical_factor_rules: rules must be a mapping from logical axis name "
                    f"to role, got {rules!r}; for (name, role) pairs, pass dict(pairs)")
  # nnx.get_partition_spec gives each param's names in a Variable, as the params are.
  names_by_path = {
      _key_path(path): _as_names(placement.unbox(names))
      for path, names in jax.tree_util.tree_flatten_with_path(
          axis_names, is_leaf=lambda node: _is_names(node) or placement.is_box(node))[0]
  }

  def roles_for(name, names, shape):
    if isinstance(names, PartitionSpec):
      # As in sharding, a spec shorter than the param leaves its last axes unnamed: flax
      # gives a param with no names (a bias, a norm's scale) the empty P().
      names = (*names, *[None] * (len(shape) - len(names)))
    return tuple(None if axis is None else rules.get(axis) for axis in names)

  return NamedParamRules(names_by_path, _key_path, roles_for, "logical_factor_rules")


def plan_from_stat_shapes(
    shape: Sequence[int], row_stat_shape: Sequence[int], col_stat_shape: Sequence[int]
) -> FactorPlan:
  """Read a plan back off the shapes of ``v_row`` and ``v_col``.

  Axes of size 1 in the parameter are never listed: averaging over them changes
  nothing, so they need no role.

  >>> plan_from_stat_shapes((300, 200), (1, 200), (300, 1))
  FactorPlan(row_axes=(1,), col_axes=(0,), batch_axes=())
  """
  col_axes = tuple(a for a, (s, r) in enumerate(zip(shape, row_stat_shape, strict=True)) if s != r)
  row_axes = tuple(a for a, (s, c) in enumerate(zip(shape, col_stat_shape, strict=True)) if s != c)
  return FactorPlan(row_axes=row_axes, col_axes=col_axes)
