"""State sharding that follows the params: statistics keep the param spec, less reduced axes.

A factored statistic has the param's shape with some axes set to 1 (keepdims), so
its partition spec is the param's spec with those axes set to ``None``: a size-1
axis never names a mesh axis. Momentum has the param's spec unchanged. Every
communication the update then needs is an all-reduce of a row- or column-sized
statistic or of a scalar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from optax_safefactor._src import numerics


def reduced_spec(
    spec: PartitionSpec, param_shape: Sequence[int], stat_shape: Sequence[int]
) -> PartitionSpec:
  """``spec`` with every axis that is 1 in ``stat_shape`` set to ``None``.

  >>> reduced_spec(PartitionSpec("data", "model"), (256, 512), (256, 1))
  P('data', None)
  >>> reduced_spec(PartitionSpec("data"), (256, 512), (1, 512))
  P(None, None)
  """
  entries = tuple(spec) + (None,) * (len(param_shape) - len(spec))
  return PartitionSpec(*(
      entry if stat_size == param_size and stat_size != 1 else None
      for entry, param_size, stat_size in zip(entries, param_shape, stat_shape, strict=True)
  ))


def leaf_spec(
    param_spec: PartitionSpec, param_shape: Sequence[int], leaf_shape: Sequence[int]
) -> PartitionSpec:
  """Spec for a state leaf that belongs to a param: reduced when it fits, else replicated."""
  fits = len(leaf_shape) == len(param_shape) and all(
      leaf in (param, 1) for leaf, param in zip(leaf_shape, param_shape, strict=True)
  )
  if not fits:
    return PartitionSpec()
  return reduced_spec(param_spec, param_shape, leaf_shape)


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


def full_like_param(
    param: Any, shape: Sequence[int], fill_value: Any, dtype: numerics.DTypeLike
) -> jax.Array:
  """``jnp.full(shape, fill_value, dtype)``, placed like ``param`` less its reduced axes."""
  sharding = _known_sharding(param)
  if isinstance(sharding, NamedSharding):
    stat_sharding = NamedSharding(
        sharding.mesh, reduced_spec(sharding.spec, param.shape, shape)
    )
    if isinstance(param, jax.core.Tracer):
      return jnp.full(shape, fill_value, dtype, out_sharding=stat_sharding)
    return jnp.full(shape, fill_value, dtype, device=stat_sharding)
  # Follow the param's commitment: a state committed where the params are not (or the
  # reverse) differs from what a jitted step returns, and the second step compiles again.
  if isinstance(sharding, Sharding) and getattr(param, "committed", False):
    return jnp.full(shape, fill_value, dtype, device=sharding)
  return jnp.full(shape, fill_value, dtype)


def _matches_params(params: Any, subtree: Any) -> bool:
  try:
    jax.tree.map(lambda *_: None, params, subtree)
  except (ValueError, TypeError):
    return False
  return True


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
    >>> specs.inner_state.second_moment["w"]
    FactoredMoment(v_row=P('data', None), v_col=P(None, 'model'))

  Args:
    optimizer: any optax transformation; its ``init`` is only traced abstractly.
    params: the params, as arrays or ``jax.ShapeDtypeStruct`` (no memory is used).
    param_specs: a tree of ``PartitionSpec`` like ``params``; ``None`` to read them off
      the params' ``NamedSharding``.
    mesh: if given, return ``NamedSharding``s on this mesh instead of specs.

  Returns:
    A pytree of ``PartitionSpec`` (or ``NamedSharding``) shaped like the state.
  """
  if param_specs is None:
    def spec_of(param):
      sharding = getattr(param, "sharding", None)
      return sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()

    param_specs = jax.tree.map(spec_of, params)
  shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  abstract_state = jax.eval_shape(optimizer.init, shapes)

  def specs_for(subtree):
    if _matches_params(params, subtree):
      return jax.tree.map(
          lambda param, spec, part: jax.tree.map(
              lambda leaf: leaf_spec(spec, param.shape, leaf.shape), part
          ),
          params, param_specs, subtree,
      )
    children, treedef = jax.tree_util.tree_flatten(subtree, is_leaf=lambda x: x is not subtree)
    if treedef.num_leaves == 1 and treedef.num_nodes == 1:
      return PartitionSpec()
    return jax.tree.unflatten(treedef, [specs_for(child) for child in children])

  specs = specs_for(abstract_state)
  if mesh is None:
    return specs
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
