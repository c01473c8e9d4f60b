"""Continue a running ``optax.adafactor`` job with safefactor: convert its optimizer state."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_safefactor._src import checks
from optax_safefactor._src.kernel import FactoredMoment, FullMoment, is_moment
from optax_safefactor._src.plan import plan_from_stat_shapes
from optax_safefactor._src.transform import AdafactorState
from optax_safefactor._src.trees import find_all


def _find(tree: Any, kind: type) -> Any | None:
  found = find_all(tree, kind)
  return found[0] if found else None


def _placed_like(value: Any, target: jax.Array) -> jax.Array:
  value = jnp.asarray(value, target.dtype)
  if isinstance(target, jax.core.Tracer):
    return value
  return jax.device_put(value, target.sharding)


# What to do when params and the optax state differ: the tree the optax job trained on.
_PARAMS_HINT = ("; pass the params the optax job was training when its state was saved "
                "(same leaves, same tree)")


def _convert_moment(path, target, optax_row, optax_col, optax_full, param):
  mismatch = ValueError(
      f"{checks.path_name(path)}: optax and safefactor factor this param differently; build "
      "safefactor with the same factored and min_dim_size_to_factor"
  )
  if isinstance(target, FullMoment):
    if tuple(optax_full.shape) != tuple(param.shape):
      raise mismatch
    return FullMoment(_placed_like(optax_full, target.v))
  plan = plan_from_stat_shapes(param.shape, target.v_row.shape, target.v_col.shape)
  if len(plan.col_axes) != 1 or len(plan.row_axes) != 1 or optax_row.ndim != param.ndim - 1:
    raise mismatch
  # optax drops the reduced axis; the keepdims state puts it back as size 1.
  row = jnp.expand_dims(jnp.asarray(optax_row), plan.col_axes[0])
  col = jnp.expand_dims(jnp.asarray(optax_col), plan.row_axes[0])
  if row.shape != target.v_row.shape or col.shape != target.v_col.shape:
    raise mismatch
  return FactoredMoment(_placed_like(row, target.v_row), _placed_like(col, target.v_col))


def migrate_from_optax(optax_state: Any, optimizer: optax.GradientTransformation,
                       params: Any) -> Any:
  """Convert an ``optax.adafactor`` (or ``scale_by_factored_rms``) state for ``optimizer``.

  The step count, the factored second moments and the momentum carry over, so
  training continues where it was: on healthy float32 inputs, N optax steps then M
  safefactor steps equal N + M optax steps. Statistics are cast to safefactor's state
  dtype and placed like ``optimizer.init(params)`` places them; skip counters start
  at 0, and state optax has no counterpart for (the Kahan compensation of
  ``param_rounding="kahan"``) starts as ``optimizer.init(params)`` makes it: zeros.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_safefactor as osf
    >>> params = {"w": jnp.ones((256, 128))}
    >>> old = optax.adafactor(1e-3)
    >>> old_state = old.init(params)
    >>> tx = osf.safefactor(1e-3)
    >>> state = osf.migrate_from_optax(old_state, tx, params)
    >>> moment = state.inner_state.second_moment["w"]
    >>> moment.v_row.shape, moment.v_col.shape
    ((1, 128), (256, 1))

  Args:
    optax_state: the state of a running ``optax.adafactor`` or
      ``optax.scale_by_factored_rms`` (as restored from its checkpoint).
    optimizer: the safefactor transformation to continue with, built with the same
      ``factored``, ``min_dim_size_to_factor`` and momentum setting.
    params: the current params.

  Returns:
    A state for ``optimizer``.

  Raises:
    ValueError: naming the param, when the two optimizers factor it differently, or
      when momentum is on in one and off in the other; naming the first differing
      path, when ``params`` does not have the tree of ``optax_state``'s statistics;
      when ``optimizer`` holds no safefactor state to receive the statistics; when
      ``optax_state`` holds no ``optax.FactoredState`` (a checkpoint restored without
      a target: the message says how to build one).
  """
  factored_state = _find(optax_state, optax.FactoredState)
  if factored_state is None:
    raise ValueError(
        "no optax FactoredState found in optax_state. A checkpoint restored without a "
        "target holds plain lists and dicts, not optax's state classes: restore it with "
        "a target, e.g. target = jax.eval_shape(optax.adafactor(lr).init, params) "
        "(the optimizer the checkpoint was written with), then migrate the result"
    )
  checks.check_same_structure(params, factored_state.v_row,
                              "optax_state's second-moment statistics", name="params",
                              hint=_PARAMS_HINT)
  ema_state = _find(optax_state, optax.EmaState)
  if ema_state is not None:
    checks.check_same_structure(params, ema_state.ema, "optax_state's momentum",
                                name="params", hint=_PARAMS_HINT)
  target = optimizer.init(params)
  if not find_all(target, AdafactorState):
    # Returning ``target`` would silently throw the optax statistics away.
    raise ValueError(
        "optimizer has no safefactor state to receive the optax.adafactor statistics: "
        "optimizer.init(params) holds no AdafactorState. Pass the transformation to "
        "continue with, osf.safefactor(...) or osf.scale_by_safe_factored_rms(...) (or a "
        "chain holding one), built with the same factored, min_dim_size_to_factor and "
        "momentum setting"
    )

  def convert_moments(second_moment):
    return jax.tree_util.tree_map_with_path(
        _convert_moment, second_moment, factored_state.v_row, factored_state.v_col,
        factored_state.v, params,
        is_leaf=is_moment,
    )

  def is_adafactor_state(x):
    return isinstance(x, AdafactorState)

  def convert(node):
    if not is_adafactor_state(node):
      return node  # skip counters and other wrappers' state start fresh
    count = _placed_like(factored_state.count, node.count)
    if node.momentum is not None and ema_state is None:
      raise ValueError("momentum must be on in both optimizers or off in both")
    momentum = node.momentum
    if ema_state is not None:
      if node.momentum is None:
        raise ValueError("momentum must be on in both optimizers or off in both")
      momentum = jax.tree.map(_placed_like, ema_state.ema, node.momentum)
    # Fields optax has no counterpart for (the Kahan compensation) keep their fresh
    # values from init, so the state has exactly init's structure.
    return node._replace(count=count, second_moment=convert_moments(node.second_moment),
                         momentum=momentum)

  return jax.tree.map(convert, target, is_leaf=is_adafactor_state)

