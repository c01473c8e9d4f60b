"""Optimizer state placed like its param: one rule for boxes and partition specs alike.

A state array that belongs to a param (a statistic, a momentum, an accumulator, a
compensation buffer) has the param's rank, each axis either the param's size or 1
(keepdims). Its placement is the param's, with every axis that is 1 in the state
left unnamed: a size-1 axis never names a mesh axis. That one rule,
:func:`fitted_axis_names`, gives flax boxes their sharding names and
``NamedSharding``s their ``PartitionSpec``; every communication the update then
needs is an all-reduce of a row- or column-sized statistic or of a scalar.

Flax boxes (nnx Variables, linen ``Partitioned``) are recognised by their methods,
not their types, since flax is optional. An update handed boxed grads steps the arrays
inside and boxes its results back (:func:`through_boxes`). NumPy arrays are taken as
``jax.jit`` takes them (:func:`numpy_as_jax`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from optax_safefactor._src import compat, trees

# nnx Variables keep their mesh-axis names under one of these metadata keys,
# depending on the flax version.
_NNX_SHARDING_KEYS = ("out_sharding", "sharding_names", "sharding")


def fitted_axis_names(
    names: Sequence[Any], param_shape: Sequence[int], state_shape: Sequence[int]
) -> tuple[Any, ...]:
  """The param's per-axis names (mesh axes), with every axis reduced in the state unnamed.

  >>> fitted_axis_names(("data", "model"), (256, 512), (256, 1))
  ('data', None)
  >>> fitted_axis_names(("data", "model"), (256, 512), (1, 512))
  (None, 'model')

  A size-1 axis keeps no name (nothing splits it), and a state of another rank none:

  >>> fitted_axis_names(("data", "model"), (1, 512), (1, 1))
  (None, None)
  >>> fitted_axis_names(("data", "model"), (256, 512), (4,)), fitted_axis_names(
  ...     ("data",), (256,), (2, 256))
  ((None,), (None, None))
  """
  if len(state_shape) != len(param_shape):
    return (None,) * len(state_shape)
  names = tuple(names) + (None,) * (len(param_shape) - len(names))
  return tuple(
      name if size == param_size and size != 1 else None
      for name, param_size, size in zip(names, param_shape, state_shape, strict=True)
  )


def state_spec(
    param_spec: PartitionSpec, param_shape: Sequence[int], state_shape: Sequence[int]
) -> PartitionSpec:
  """The spec of a state array of ``state_shape`` that belongs to a param.

  Replicated when the array does not fit the param (other rank, or an axis that is
  neither the param's size nor 1).

  >>> tuple(state_spec(PartitionSpec("data", "model"), (256, 512), (256, 1)))
  ('data', None)
  >>> tuple(state_spec(PartitionSpec("data"), (256, 512), (1, 512)))
  (None, None)
  """
  if not fits_param(state_shape, param_shape):
    return PartitionSpec()
  return PartitionSpec(*fitted_axis_names(tuple(param_spec), param_shape, state_shape))


# Boxes -----------------------------------------------------------------------------


def _is_nnx_variable(x: Any) -> bool:
  return hasattr(x, "get_metadata") and hasattr(x, "get_value") and hasattr(x, "replace")


def nnx_kind_other_than_param(x: Any) -> str | None:
  """The class name of an nnx Variable that is no ``Param`` (``RngCount``, ``BatchStat``),
  else ``None``: what ``nnx.state(model)`` holds beside the params."""
  if not _is_nnx_variable(x) or any(cls.__name__ == "Param" for cls in type(x).__mro__):
    return None
  return type(x).__name__


# flax's Variables that hold a model's state, never a param to train: running statistics,
# the random streams' keys and counts, a decoder's cache, sown values (and perturbations).
_NNX_STATE_KINDS = frozenset({"BatchStat", "RngState", "Cache", "Intermediate"})


def nnx_state_kind(x: Any) -> str | None:
  """The class name of an nnx Variable that holds a model's state rather than a param
  (``BatchStat``, ``RngCount``, ``RngKey``, ``Cache``, ``Intermediate``), else ``None``.
  A Variable class of the user's own is taken as a param: ``wrt=`` may train it."""
  if _is_nnx_variable(x) and any(cls.__name__ in _NNX_STATE_KINDS for cls in type(x).__mro__):
    return type(x).__name__
  return None


def _is_linen_box(x: Any) -> bool:
  return hasattr(x, "unbox") and hasattr(x, "replace_boxed") and hasattr(x, "names")


def is_box(x: Any) -> bool:
  """Whether ``x`` is a flax metadata box (an nnx Variable or a linen Partitioned) that
  holds a param.

  A box around an empty tree holds none: ``optax.masked`` and ``optax.multi_transform``
  hand the transformation a ``MaskedNode`` for each param they leave out, inside the
  param's box when the params are boxed (``nnx.Optimizer`` inits with Variables). Tree
  maps then go inside and find no leaf, as they do for a bare ``MaskedNode``, so the
  param keeps no state.

  Called on every node of every tree that may hold boxes, so it tests attributes
  inline (an array has none of them) rather than through the two helpers.
  """
  return (((hasattr(x, "get_metadata") and hasattr(x, "get_value") and hasattr(x, "replace"))
           or (hasattr(x, "unbox") and hasattr(x, "replace_boxed") and hasattr(x, "names")))
          and bool(jax.tree.leaves(x)))


def unbox(x: Any) -> Any:
  """The array inside a box; anything else unchanged."""
  if _is_nnx_variable(x):
    return x.get_value()
  if _is_linen_box(x):
    return x.unbox()
  return x


def _value_of(x: Any) -> Any:
  """The array in a box as it is (anything else unchanged): linen's ``unbox()`` would also
  constrain its sharding to the box's names, which an update leaves to the step's
  shardings, as optax's do."""
  if _is_nnx_variable(x):
    return x.get_value()
  if _is_linen_box(x):
    return x.value
  return x


def _any_box(x: Any) -> bool:
  """A box, empty or not: what :func:`through_boxes` takes off and puts back (a state's
  ``None`` for a wide param comes boxed too)."""
  return _is_nnx_variable(x) or _is_linen_box(x)


def unboxed_tree(tree: Any) -> Any:
  return jax.tree.map(_value_of, tree, is_leaf=_any_box)


def boxed_like(boxes: Any, values: Any) -> Any:
  """``values``, a tree of ``boxes``' structure unboxed, in ``boxes``' boxes."""
  return jax.tree.map(lambda box, value: box.replace(value=value) if _any_box(box) else value,
                      boxes, values, is_leaf=_any_box)


_NUMPY_ARRAYS = (np.ndarray, np.generic)


def _as_jax_array(x: Any) -> Any:
  # Floating and complex arrays alone: an integer array keeps its own dtype for the checks'
  # messages (int64, not the int32 JAX would make of it), and a string array is no array
  # JAX can hold.
  if isinstance(x, _NUMPY_ARRAYS) and jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.asarray(x)
  return x


def numpy_as_jax(tree: Any) -> Any:
  """``tree`` with its NumPy arrays as JAX arrays: what ``jax.jit`` would hand the step.

  A NumPy float64 array (``np.ones``, ``np.random.randn``, a ``.npz`` file) is float32
  to JAX unless 64-bit JAX is on, and a jitted step sees it so. Taken as it is, an eager
  step would work out float64 statistics for a float32 optimizer state and refuse it.
  Anything else, a Python number and a NumPy integer array included, stays as it is for
  the checks to judge.

  >>> numpy_as_jax({"w": np.ones(2), "b": 1.0})
  {'b': 1.0, 'w': Array([1., 1.], dtype=float32)}
  """
  # ``map`` of the builtin: no Python frame per leaf on the usual path, where none is.
  if any(map(isinstance, jax.tree.leaves(tree), itertools.repeat(_NUMPY_ARRAYS))):
    return jax.tree.map(_as_jax_array, tree)
  return tree


def through_boxes(update_fn: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[Any, Any]]:
  """``update_fn`` for grads that may come boxed: it steps the arrays inside.

  Linen's ``TrainState`` hands ``update`` boxed grads, params and state (a ``Partitioned``
  is a pytree node, and ``jax.grad`` boxes the grads as the params are). The step runs on
  the arrays, so every leaf is named, planned and rounded as it would be unboxed; the
  updates come back boxed as the grads are (``optax.apply_updates`` adds them to the
  boxed params) and the state as it came in. NumPy arrays come in as ``jax.jit`` would
  hand them in (:func:`numpy_as_jax`), so that an eager step is the jitted one.
  """

  def update(updates, state, params=None, **extra_args):
    updates, state, params = numpy_as_jax((updates, state, params))
    # Two flattenings, no tree rebuilt, when nothing is boxed (nnx.Optimizer unboxes).
    if jax.tree.structure(updates, is_leaf=is_box) == jax.tree.structure(updates):
      return update_fn(updates, state, params, **extra_args)
    new_updates, new_state = update_fn(unboxed_tree(updates), unboxed_tree(state),
                                       unboxed_tree(params), **extra_args)
    return boxed_like(updates, new_updates), boxed_like(state, new_state)

  return update


def _fitted_names(names: Any, param_shape: Sequence[int], state_shape: Sequence[int]) -> Any:
  if not isinstance(names, (tuple, list)) or len(names) != len(param_shape):
    return names
  return fitted_axis_names(names, param_shape, state_shape)


def _rebox(box: Any, param_shape: Sequence[int], value: Any) -> Any:
  """``value`` in a box like ``box`` (a param's), sharding names fitted to its shape."""
  if _is_nnx_variable(box):
    metadata = box.get_metadata()
    fitted = {
        key: _fitted_names(metadata[key], param_shape, value.shape)
        for key in _NNX_SHARDING_KEYS
        if key in metadata
    }
    return box.replace(value=value, **fitted)
  return box.replace(value=value, names=_fitted_names(box.names, param_shape, value.shape))


# Arrays ----------------------------------------------------------------------------


def _known_sharding(param: Any) -> Sharding | None:
  """The param's sharding when it is known: a concrete or abstract array's, or an
  explicit-axes tracer's. Under ``jax.jit`` with Auto axes it is not known."""
  if isinstance(param, jax.core.Tracer):
    sharding = jax.typeof(param).sharding
    explicit = any(
        axis_type == jax.sharding.AxisType.Explicit
        for axis_type in getattr(sharding.mesh, "axis_types", ())
    )
    return sharding if explicit else None
  return getattr(param, "sharding", None)


def _full_like(param: jax.Array, shape: Sequence[int], fill_value: Any, dtype: Any) -> jax.Array:
  sharding = _known_sharding(param)
  if isinstance(sharding, NamedSharding):
    placed = NamedSharding(sharding.mesh, state_spec(sharding.spec, param.shape, shape))
    if isinstance(param, jax.core.Tracer):
      return compat.full(shape, fill_value, dtype, out_sharding=placed)
    return jnp.full(shape, fill_value, dtype, device=placed)
  # Follow the param's commitment: a state committed where the params are not (or the
  # reverse) differs from what a jitted step returns, and the second step compiles again.
  if isinstance(sharding, Sharding) and getattr(param, "committed", False):
    return jnp.full(shape, fill_value, dtype, device=sharding)
  return jnp.full(shape, fill_value, dtype)


class LeafPlacement(NamedTuple):
  """A param leaf unboxed once: its array, and its box (``None`` for a plain array).

  :meth:`full` makes each state array that belongs to the param, placed like it.
  """

  value: Any
  box: Any = None

  def full(self, shape: Sequence[int], fill_value: Any, dtype: Any) -> Any:
    """``jnp.full(shape, fill_value, dtype)`` placed like the param, less its reduced axes,
    and boxed like it (sharding names fitted to ``shape``) when the param is boxed."""
    array = _full_like(self.value, shape, fill_value, dtype)
    return array if self.box is None else _rebox(self.box, self.value.shape, array)


def leaf_placement(param: Any) -> LeafPlacement:
  """``param`` (an array or a flax box) as a :class:`LeafPlacement`."""
  if _is_nnx_variable(param):
    return LeafPlacement(param.get_value(), param)
  if _is_linen_box(param):
    return LeafPlacement(param.unbox(), param)
  return LeafPlacement(param)


def _matches_params(params: Any, subtree: Any) -> bool:
  """Whether ``subtree`` holds a part per param (a flax box is one param, whatever the
  part for it holds: a factored moment of boxes has two arrays where the param has one),
  each of arrays that fit its param or scalars. The structure alone is not enough: a
  chain's states are a tuple as long as a tuple of two params."""
  def part_fits(param, part):
    shape = unbox(param).shape
    return all(not leaf.shape or fits_param(leaf.shape, shape) for leaf in jax.tree.leaves(part))

  try:
    fits = jax.tree.map(part_fits, params, subtree, is_leaf=is_box)
  except (ValueError, TypeError):
    return False
  return all(jax.tree.leaves(fits))


def fits_param(state_shape: Sequence[int], param_shape: Sequence[int]) -> bool:
  """A state array of the param's rank, each axis the param's size or 1: the param's own
  (a moment, or statistics kept with keepdims)."""
  return len(state_shape) == len(param_shape) and all(
      size in (param_size, 1) for size, param_size in zip(state_shape, param_shape, strict=True))


def state_partition_specs(
    optimizer: Any,
    params: Any,
    param_specs: Any = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
) -> Any:
  """Partition specs with the exact structure of ``optimizer.init(params)``'s state.

  Each state leaf that belongs to a param (a statistic, a momentum, an accumulator)
  gets the param's spec with its reduced (size-1) axes set to ``None``; every other
  leaf (counts, counters, hyperparameters) is replicated. Use it for
  ``jax.jit(tx.init, out_shardings=...)`` and for abstract checkpoint targets.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import optax_safefactor as osf
    >>> params = {"w": jax.ShapeDtypeStruct((256, 512), jnp.float32)}
    >>> specs = osf.state_partition_specs(osf.safefactor(), params, {"w": P("data", "model")})
    >>> moment = specs.inner_state.second_moment["w"]
    >>> tuple(moment.v_row), tuple(moment.v_col)
    (('data', None), (None, 'model'))

  Args:
    optimizer: any optax transformation; its ``init`` is only traced abstractly.
    params: the params, as arrays or ``jax.ShapeDtypeStruct`` (no memory is used).
    param_specs: a tree of ``PartitionSpec`` like ``params``; ``None`` to read them off
      the params' ``NamedSharding``.
    mesh: if given, return a ``NamedSharding`` on this mesh per leaf instead of specs.

  Returns:
    A pytree of ``PartitionSpec`` (or ``NamedSharding``) shaped like the state.

  Raises:
    ValueError: naming the param, when ``param_specs`` does not hold one
      ``PartitionSpec`` per param, when a spec has more entries than its param has axes
      or names one mesh axis twice, or when it names an axis that ``mesh`` (without it,
      the mesh ``jax.set_mesh`` made current, if any) does not have.
    TypeError: naming the param, when its spec is not a ``PartitionSpec``.
  """
  # checks places its own messages with this module's helpers: imported here, not above.
  from optax_safefactor._src import checks

  checks.check_transformation(optimizer, "state_partition_specs", "optimizer")
  checks.check_shaped_params(params, "state_partition_specs")
  if mesh is not None and not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(f"state_partition_specs: mesh must be a jax.sharding.Mesh (or None), got "
                    f"{mesh!r}")
  # A flax box (nnx.Param, linen Partitioned) is one param; a spec may come boxed too
  # (nnx.get_partition_spec gives each spec in its Param).
  if param_specs is None:
    def spec_of(param):
      sharding = getattr(unbox(param), "sharding", None)
      return sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()

    param_specs = jax.tree.map(spec_of, params, is_leaf=is_box)
  for path, spec in jax.tree_util.tree_flatten_with_path(param_specs, is_leaf=_plain_spec)[0]:
    if _plain_spec(spec):  # else read as a tuple of params, each name one: "not in params"
      raise TypeError(f"param_specs{jax.tree_util.keystr(path)} must be a PartitionSpec, got "
                      f"the tuple {spec!r}: write PartitionSpec{tuple(spec)!r}")
  trees.check_prefix_of(param_specs, params, "param_specs",
                        leaf="PartitionSpec() for a replicated param")
  if jax.tree.structure(param_specs, is_leaf=is_box) != jax.tree.structure(params,
                                                                           is_leaf=is_box):
    raise ValueError("param_specs must hold one PartitionSpec per param, shaped like params; "
                     f"got {jax.tree.structure(param_specs)}")
  jax.tree_util.tree_map_with_path(partial(_check_spec, mesh), params, param_specs,
                                   is_leaf=is_box)
  shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  abstract_state = jax.eval_shape(optimizer.init, shapes)

  # The guards' counters and spike histories are the step's, not a param's, whatever
  # their length (a single param of 8 elements and 8 counted hyperparameters).
  from optax_safefactor._src.counters import HyperparamCounts, LeafCounts
  from optax_safefactor._src.spikes import SpikeHistory
  counters = (HyperparamCounts, LeafCounts, SpikeHistory)

  def is_counter(node):
    return isinstance(node, counters)

  def part_specs(param, spec, part):
    def leaf_spec(leaf):
      if is_counter(leaf):
        return jax.tree.map(lambda _: PartitionSpec(), leaf)
      return state_spec(unbox(spec), unbox(param).shape, leaf.shape)

    return jax.tree.map(leaf_spec, part, is_leaf=is_counter)

  def specs_for(subtree):
    if _matches_params(params, subtree):
      return jax.tree.map(part_specs, params, param_specs, subtree, is_leaf=is_box)
    children, treedef = jax.tree_util.tree_flatten(subtree, is_leaf=lambda x: x is not subtree)
    if treedef.num_leaves == 1 and treedef.num_nodes == 1:
      return PartitionSpec()
    return jax.tree.unflatten(treedef, [specs_for(child) for child in children])

  specs = specs_for(abstract_state)
  if mesh is None:
    return specs
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)


def _plain_spec(node: Any) -> bool:
  """A plain tuple or list of axis names and ``None``s: a spec written without
  ``PartitionSpec``."""
  return (type(node) in (tuple, list) and bool(node)
          and all(name is None or isinstance(name, str) for name in node)
          and any(isinstance(name, str) for name in node))


def _check_spec(mesh: jax.sharding.Mesh | None, path: Any, param: Any, spec: Any) -> None:
  """A spec that cannot place its param is refused here, naming the param, rather than
  failing inside the optimizer's traced init or JAX's sharding code without a path."""
  spec, shape = unbox(spec), unbox(param).shape
  where = f"param_specs{jax.tree_util.keystr(path)}"
  if not isinstance(spec, PartitionSpec):
    raise TypeError(f"{where} must be a PartitionSpec, got {type(spec).__name__}: {spec!r}")
  if len(spec) > len(shape):
    raise ValueError(f"{where} is {spec} with {len(spec)} entries, for a param of shape "
                     f"{tuple(shape)} (rank {len(shape)})")
  names = [name for entry in spec for name in (entry if isinstance(entry, tuple) else (entry,))
           if isinstance(name, str)]
  repeated = sorted({name for name in names if names.count(name) > 1})
  if repeated:
    raise ValueError(f"{where} is {spec}: it names mesh axis {repeated[0]!r} more than once, "
                     "and a mesh axis shards one dimension at most")
  # Without mesh=, the mesh jax.set_mesh made current (if any) is the one to check against.
  mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
  if mesh.axis_names:
    for name in names:
      if name not in mesh.axis_names:
        raise ValueError(f"{where} is {spec}: the mesh has no axis {name!r} (its axes: "
                         f"{', '.join(map(repr, mesh.axis_names))})")


def _mesh_is_trivial(mesh: Any) -> bool:
  sizes = getattr(mesh, "axis_sizes", None)
  return not sizes or math.prod(sizes) == 1


def _auto_axes(mesh: Any) -> bool:
  types = getattr(mesh, "axis_types", ()) or ()
  return any(axis_type != jax.sharding.AxisType.Explicit for axis_type in types)


def is_replicated(x: Any) -> bool:
  """Whether ``x`` is known to be whole on every device (or on one device).

  A concrete array says so itself. A traced one says so when its type's mesh is trivial
  or its axes are Explicit with no axis in its spec; under Auto axes of a real mesh (its
  own, or the context's) a tracer's spec says nothing, so it is not known.
  """
  if x is None:
    return True
  if not isinstance(x, jax.core.Tracer):
    sharding = getattr(x, "sharding", None)
    return sharding is None or bool(sharding.is_fully_replicated)
  get_context = getattr(jax.sharding, "get_abstract_mesh", None)
  context = None if get_context is None else get_context()
  if not _mesh_is_trivial(context) and _auto_axes(context):
    return False
  sharding = getattr(jax.typeof(x), "sharding", None)
  if sharding is None:
    return _mesh_is_trivial(context)
  if any(axis is not None for axis in sharding.spec):
    return False
  return _mesh_is_trivial(sharding.mesh) or not _auto_axes(sharding.mesh)
