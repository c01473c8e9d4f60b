"""Continue a running ``optax.adafactor`` job with safefactor: convert its optimizer state."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_safefactor._src import checks, placement, user_warnings
from optax_safefactor._src.accumulate import AccumulationState
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


def _optax_factored_axes(shape: tuple[int, ...]) -> tuple[int, int]:
  """The axes optax.adafactor reduces a factored param's row and column statistics over:
  its largest and its second largest, in the order ``np.argsort`` gives them (of two
  equal axes, the later counts as the larger), as optax sorts them."""
  second, largest = np.argsort(shape)[-2:]
  return int(largest), int(second)


def _convert_moment(path, target, optax_row, optax_col, optax_full, param):
  optax_shapes = (f"{tuple(np.shape(optax_full))}" if np.ndim(optax_row) == 1
                  and np.size(optax_row) == 1 else
                  f"{tuple(np.shape(optax_row))} and {tuple(np.shape(optax_col))}")
  mismatch = ValueError(
      f"{checks.path_name(path)}: optax and safefactor factor this param differently (optax's "
      f"statistics have shape {optax_shapes}, the param {tuple(param.shape)}); build "
      "safefactor with the same factored, min_dim_size_to_factor and factor_rules, and pass "
      "the params the optax job was training"
  )
  if isinstance(target, FullMoment):
    if tuple(optax_full.shape) != tuple(param.shape):
      raise mismatch
    return FullMoment(_placed_like(optax_full, target.v))
  plan = plan_from_stat_shapes(param.shape, target.v_row.shape, target.v_col.shape)
  if len(plan.col_axes) != 1 or len(plan.row_axes) != 1 or optax_row.ndim != param.ndim - 1:
    raise mismatch
  # A square param's statistics have the same shapes either way round: compare the axes.
  if (plan.col_axes[0], plan.row_axes[0]) != _optax_factored_axes(tuple(param.shape)):
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
  Linen's boxed params (``nn.Partitioned``) and states are converted inside their boxes;
  an ``nnx.Optimizer``'s ``opt_state`` (with ``nnx.state(model, nnx.Param)`` as the
  params) converts to a state in the optimizer's own boxes, ready for ``opt_state``.

  The wrappers both optimizers hold keep their step counts, so their schedules go on:
  ``optax.inject_hyperparams`` (with the values, and the schedules' counts, of the
  hyperparameters both name), ``optax.scale_by_schedule``, and ``optax.MultiSteps``,
  whose optimizer steps become :func:`accumulate_gradients`' applied steps (its
  micro-batches accumulated since the last optimizer step are not carried: migrate
  right after a step; a warning says how many are dropped, outside ``jax.jit``). Such
  states are paired in order, and only where both hold as many of a kind.

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
    ValueError: naming the param, when the two optimizers factor it differently (its
      axes compared, so a square param's too, under ``factor_rules``), or
      when momentum is on in one and off in the other; naming the first differing
      path, when ``params`` does not have the tree of ``optax_state``'s statistics;
      when ``optimizer`` holds no safefactor state to receive the statistics; when
      ``optax_state`` holds no ``optax.FactoredState`` (a checkpoint restored without
      a target: the message says how to build one), or several, or one inside
      ``optax.masked`` (``optax.multi_transform``'s states): one adafactor's state over
      all the params is converted.
  """
  checks.check_transformation(optimizer, "migrate_from_optax", "optimizer")
  # A Linen job's params and both states come boxed (nn.Partitioned): the statistics are
  # converted unboxed and put back in the boxes init gives them.
  boxed_target = optimizer.init(params)
  held_by_nnx_optimizer = _held_by_nnx_optimizer(optax_state)
  params, optax_state, target = map(placement.unboxed_tree,
                                    (params, optax_state, boxed_target))
  factored_states = find_all(optax_state, optax.FactoredState)
  if find_all(optax_state, optax.MaskedState) or len(factored_states) > 1:
    held = ("optax.adafactor's statistics inside optax.masked (as optax.multi_transform "
            "holds each of its transformations' state)"
            if find_all(optax_state, optax.MaskedState) else
            f"{len(factored_states)} optax.FactoredState")
    raise ValueError(
        f"optax_state holds {held}: migrate_from_optax converts the state of one "
        "optax.adafactor over all the params, not the states of optax.masked or "
        "optax.multi_transform"
    )
  factored_state = factored_states[0] if factored_states else None
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
      return node  # skip counters start fresh; the wrappers' counts: _carry_wrapper_counts
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

  for multi_steps in find_all(optax_state, optax.MultiStepsState):
    if not isinstance(multi_steps.mini_step, jax.core.Tracer) and int(multi_steps.mini_step):
      user_warnings.warn(
          f"optax_state's MultiSteps holds {int(multi_steps.mini_step)} micro-batches "
          "accumulated since its last optimizer step, which the migrated state starts again "
          "without: migrate right after an optimizer step to keep them")
  migrated = _carry_wrapper_counts(optax_state,
                                   jax.tree.map(convert, target, is_leaf=is_adafactor_state))
  migrated = placement.boxed_like(boxed_target, migrated)
  if held_by_nnx_optimizer:
    # nnx.Optimizer keeps its state in its own boxes, as its init puts it there.
    from flax import nnx
    return nnx.optimizer.to_opt_state(migrated)
  return migrated


def _held_by_nnx_optimizer(state: Any) -> bool:
  """Whether ``state`` is an ``nnx.Optimizer``'s ``opt_state`` (its leaves in the boxes
  ``nnx.optimizer.to_opt_state`` puts them in), found without importing flax."""
  def is_opt_state(x):
    return any(kind.__name__ == "OptState" and kind.__module__.startswith("flax.nnx")
               for kind in type(x).__mro__)

  return any(is_opt_state(leaf) for leaf in jax.tree.leaves(state, is_leaf=is_opt_state))


def _paired(optax_state: Any, target: Any, optax_kind: type, kind: type, carry) -> Any:
  """``target`` with each ``kind`` node replaced by ``carry(optax_node, node)``, the nodes
  of the two states paired in order, where both hold as many (else they are left as
  ``init`` made them: which optax node was which is not known)."""
  optax_nodes, nodes = find_all(optax_state, optax_kind), find_all(target, kind)
  if not nodes or len(optax_nodes) != len(nodes):
    return target
  pairs = dict(zip(map(id, nodes), optax_nodes, strict=True))

  def replace(node):
    return carry(pairs[id(node)], node) if isinstance(node, kind) else node

  return jax.tree.map(replace, target, is_leaf=lambda x: isinstance(x, kind))


def _carry_injected(old: Any, node: Any) -> Any:
  # What optax.adafactor's and safefactor's arguments of the same name held: the value
  # (one set by hand stays set) and a schedule's own step count.
  def carried(new_values, old_values):
    def carry(name, value):
      if name not in old_values:
        return value
      previous = old_values[name]
      if (jax.tree.structure(previous) != jax.tree.structure(value)
          or list(map(jnp.shape, jax.tree.leaves(previous)))
          != list(map(jnp.shape, jax.tree.leaves(value)))):
        return value
      return jax.tree.map(_placed_like, previous, value)
    return {name: carry(name, value) for name, value in new_values.items()}

  node = node._replace(count=_placed_like(old.count, node.count),
                       hyperparams=carried(node.hyperparams, old.hyperparams))
  if hasattr(node, "hyperparams_states") and hasattr(old, "hyperparams_states"):
    node = node._replace(hyperparams_states=carried(node.hyperparams_states,
                                                    old.hyperparams_states))
  return node


def _carry_multi_steps(old: Any, node: Any) -> Any:
  return node._replace(applied_steps=_placed_like(old.gradient_step, node.applied_steps))


def _carry_wrapper_counts(optax_state: Any, target: Any) -> Any:
  """The step counts of the wrappers both optimizers hold, so that their schedules go
  on: ``optax.inject_hyperparams``'s (and the hyperparameters both name),
  ``optax.scale_by_schedule``'s, and ``optax.MultiSteps``' optimizer steps as
  :func:`accumulate_gradients`' applied steps."""
  # (inject_hyperparams' state is an InjectStatefulHyperparamsState, its subclass
  # InjectHyperparamsState in older optax releases.)
  target = _paired(optax_state, target, optax.InjectStatefulHyperparamsState,
                   optax.InjectStatefulHyperparamsState, _carry_injected)
  target = _paired(optax_state, target, optax.ScaleByScheduleState, optax.ScaleByScheduleState,
                   lambda old, node: node._replace(count=_placed_like(old.count, node.count)))
  return _paired(optax_state, target, optax.MultiStepsState, AccumulationState,
                 _carry_multi_steps)

