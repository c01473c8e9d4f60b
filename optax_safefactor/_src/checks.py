"""Static checks run while tracing ``init`` and ``update``: free under jit.

Every message names the parameter path (``params['dense']['kernel']``) so that a
mismatch in a tree of hundreds of leaves is found at once.
"""

from __future__ import annotations

import inspect
import reprlib
import sys
from collections.abc import Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_safefactor._src import (
    argument_names,
    manual_axes,
    placement,
    state_checks,
    tree_mismatch,
)
from optax_safefactor._src.tree_mismatch import path_name
from optax_safefactor._src.write_back import is_narrow

KeyPath = tuple[Any, ...]


def check_same_structure(tree: Any, reference: Any, reference_name: str, *,
                         name: str = "grads", hint: str = "") -> None:
  """``ValueError`` when the trees' structures differ, saying why
  (:func:`tree_mismatch.mismatch_error`). ``name`` is what the user passed as ``tree``;
  ``hint``, if any, ends the message."""
  if jax.tree.structure(tree) != jax.tree.structure(reference):
    raise tree_mismatch.mismatch_error(tree, reference, reference_name, name=name, hint=hint)


# Equinox's examples init with eqx.filter(model, eqx.is_array), which keeps integer arrays
# (optax's own transformations then fail at the first update, at the gradient's None).
OR_LEAVE_OUT = ("or leave it out of the params (Equinox: eqx.filter(model, "
                "eqx.is_inexact_array), not eqx.is_array, which keeps integer arrays)")
_EXCLUDE = f"exclude it with optax.masked or optax.multi_transform, {OR_LEAVE_OUT}"
_PARAMS_ALONE = ("an optimizer takes the params alone, nnx.state(model, nnx.Param) "
                 "(nnx.Optimizer(model, tx, wrt=nnx.Param) hands it those)")


# The collections flax.linen's own modules keep beside "params" in a model's variables:
# running statistics, a decoder's cache, sown values, perturbations.
_LINEN_STATE_COLLECTIONS = ("batch_stats", "cache", "intermediates", "perturbations")


def check_not_a_state(params: Any) -> None:
  """An optimizer state given to ``init`` as the params (``tx.init(opt_state)``) is refused.

  >>> import optax
  >>> check_not_a_state({"w": jnp.ones(2)})
  >>> check_not_a_state(optax.sgd(0.1, momentum=0.9).init({"w": jnp.ones(2)}))
  Traceback (most recent call last):
  TypeError: params hold an optimizer state (a TraceState), not params: init takes the ...
  """
  state = tree_mismatch.optimizer_state_in(params)
  if state:
    raise TypeError(f"params hold an optimizer state ({state_checks.with_article(state)}), not "
                    "params: init takes the params the optimizer is to train, opt_state = "
                    "optimizer.init(params)")


def check_init_arguments(misplaced: tuple) -> None:
  """``tx.init(grads, params)`` is refused naming the call to fix, not an inner ``init_fn``.

  >>> check_init_arguments(())
  >>> check_init_arguments((jnp.ones(2),))
  Traceback (most recent call last):
  TypeError: init takes the params only, opt_state = optimizer.init(params); it got 2 ...
  """
  if misplaced:
    raise TypeError(f"init takes the params only, opt_state = optimizer.init(params); it got "
                    f"{1 + len(misplaced)} arguments (the gradients go to "
                    "update(grads, opt_state, params))")


def check_not_linen_variables(params: Any) -> None:
  """A linen model's whole ``variables`` (``{"params": ..., "batch_stats": ...}``) is refused.

  Its float statistics pass every check of a param: ``TrainState.create(params=variables)``
  then trains them (with weight decay, shrinks them), or the first update finds no
  gradient for them. A collection whose leaves ``optax.masked`` or
  ``optax.multi_transform`` left out holds no array, and is taken.

  >>> check_not_linen_variables({"params": {"w": jnp.ones(2)}})
  >>> check_not_linen_variables({"params": {"w": jnp.ones(2)},
  ...                            "batch_stats": {"mean": jnp.zeros(2)}})
  Traceback (most recent call last):
  TypeError: params['batch_stats'] is linen's batch_stats collection, the model's state, ...
  """
  if not isinstance(params, Mapping) or "params" not in params:
    return
  for collection in _LINEN_STATE_COLLECTIONS:
    if collection in params and jax.tree.leaves(params[collection]):
      raise TypeError(
          f"params[{collection!r}] is linen's {collection} collection, the model's state, "
          "not params: an optimizer takes variables['params'] alone (TrainState.create("
          f"params=variables['params'], ...), with the {collection} in a field of their own)")


def check_param_leaf(path: KeyPath, leaf: Any, what: str = "param", *,
                     any_dtype: bool = False, exclude: str = _EXCLUDE,
                     stepped: bool = False, box: Any = None) -> None:
  """A leaf must be a floating or complex array: no Python numbers, no integers or bools.

  ``any_dtype`` accepts integer and bool arrays too: the wrappers around any optax
  transformation leave dtypes to it (an integer leaf under ``optax.set_to_zero``, say)
  and only need arrays. ``exclude`` says how to leave an integer leaf out. A leaf
  ``stepped`` by ``update`` must have values: a ``jax.ShapeDtypeStruct`` has the shape
  and dtype of an array and none (``init`` needs only those, and takes one). ``box`` is
  the flax box the leaf came in, if any: an nnx Variable that holds the model's state (its
  batch statistics or RNG counts, from ``nnx.state(model)`` whole) is refused, with the
  params' filter named.
  """
  if stepped and isinstance(leaf, jax.ShapeDtypeStruct):
    raise TypeError(
        f"{path_name(path)}: {what} is a jax.ShapeDtypeStruct, a shape with no values; "
        "update steps arrays. For the shapes and dtypes of its results, trace it with "
        "jax.eval_shape(optimizer.update, grads, opt_state, params)")
  if not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
    kind = type(leaf).__name__
    found = f"{path_name(path)}: {what} is {state_checks.with_article(kind)}"
    if isinstance(leaf, (float, complex)):
      raise TypeError(
          f"{found} ({leaf!r}), not an array; make it one with jnp.asarray (a Python number "
          "has no dtype or shape to keep statistics for)")
    # An int, a bool, a string, a function: a model's setting or part, not a param.
    raise TypeError(
        f"{found} ({reprlib.repr(leaf)}), not an array: the tree an optimizer is given holds "
        "the arrays to train alone, so leave a model's settings and functions out (Equinox: "
        "eqx.filter(model, eqx.is_inexact_array); NNX: nnx.state(model, nnx.Param)); a "
        "number to train goes in as a float array, jnp.asarray(3.0)")
  if not any_dtype and not jnp.issubdtype(leaf.dtype, jnp.inexact):
    kind = placement.nnx_kind_other_than_param(box)
    if kind:
      exclude = f"it is an nnx {kind}, not a Param: {_PARAMS_ALONE}"
    raise TypeError(
        f"{path_name(path)}: {what} dtype {leaf.dtype} is not floating or complex; "
        + exclude
    )
  if box is not None and (state_kind := placement.nnx_state_kind(box)):
    # Float batch statistics pass every other check, and the first update then finds no
    # gradient for them (or, with wrt=nnx.Variable, weight decay shrinks them).
    raise TypeError(f"{path_name(path)}: {what} is an nnx {state_kind}, the model's state, "
                    f"not a Param: {_PARAMS_ALONE}")


def check_state_dtype(path: KeyPath, what: str, found: Any, expected: Any, setting: str) -> None:
  """A floating state leaf must be in the dtype this optimizer keeps it in: ``TypeError``.

  A state cast to another dtype would otherwise stay there, and a bfloat16 second
  moment cannot follow a decay rate of 0.999 (its resolution near 1 is 2**-8).
  ``setting`` is the argument that sets the dtype (``state_dtype``, ``dtype_momentum``).
  """
  if np.dtype(found) != np.dtype(expected):
    # The state was made, or cast, for the other setting: either side may be the wrong one.
    argument = setting.split("=", 1)[0]
    raise TypeError(
        f"{path_name(path)}: the {what} in the optimizer state is {np.dtype(found).name}, "
        f"but this optimizer keeps it in {np.dtype(expected).name} (its {setting}); to go "
        f"on with this state, build the optimizer with {argument}="
        f"{np.dtype(found).name!r}, or start from this optimizer's init"
    )


def check_has_momentum(state_momentum: Any, momentum: Any) -> None:
  """The state holds a momentum exactly when the optimizer has one: ``ValueError``."""
  if (state_momentum is None) == (momentum is None):
    return
  if momentum is None:
    raise ValueError(
        "the optimizer state holds a momentum (one per param), but this optimizer has "
        "momentum=None and would drop it: build the optimizer with the momentum the state "
        "was made with (momentum=0.9, say), or make the state with this optimizer's init"
    )
  raise ValueError(
      f"this optimizer has momentum={momentum!r}, but the optimizer state holds none "
      "(it was made with momentum=None): make the state with this optimizer's init, or "
      "build the optimizer with momentum=None"
  )


# Where safefactor's compensation is, for the messages of check_has_compensation.
_ADAFACTOR_STATE = "the AdafactorState (opt_state.inner_state with the guard on)"


def check_has_compensation(state_compensation: Any, keeps: bool, param_rounding: str,
                           params: Any, holder: str = _ADAFACTOR_STATE,
                           setting: str = "param_rounding") -> None:
  """The state holds a Kahan compensation exactly when the optimizer ``keeps`` one (its
  ``param_rounding`` is Kahan) and ``params`` has a narrow (bfloat16, float16) leaf:
  ``ValueError``.

  A state made with another ``param_rounding`` would otherwise fail inside the
  write-back (no compensation to add) or have its compensation carried along unused.
  Without a narrow param there is nothing to compensate: init's compensation of a single
  float32 array is ``None`` itself. ``holder`` says which state the fix replaces the
  compensation of, ``setting`` names the argument that picks the rounding.
  """
  if (state_compensation is not None) == keeps:
    return
  if keeps and not any(is_narrow(leaf.dtype) for leaf in jax.tree.leaves(params)):
    return
  if not keeps and not jax.tree.leaves(state_compensation):
    return  # Kahan's compensation of params none of which is narrow: None for each
  if keeps:
    raise ValueError(
        f"this optimizer has {setting}='kahan', but the optimizer state holds no "
        f"compensation (it was made with {setting}='nearest' or 'stochastic', or for params "
        "without a bfloat16 or float16 leaf): make the "
        "state with this optimizer's init, or keep its statistics and start the compensation "
        "at zero, as init does: state = state._replace(compensation=jax.tree.map(lambda p: "
        f"jnp.zeros_like(p) if p.dtype in (jnp.bfloat16, jnp.float16) else None, params)) "
        f"on {holder}"
    )
  raise ValueError(
      f"the optimizer state holds a Kahan compensation (it was made with "
      f"{setting}='kahan'), but this optimizer has {setting}={param_rounding!r} "
      f"and would carry it unused: build the optimizer with {setting}='kahan', or "
      "drop the compensation (what rounding has lost so far, under half a unit in the last "
      f"place per param, is then lost): state = state._replace(compensation=None) on {holder}"
  )


def check_leaf_compensation(path: KeyPath, grad: Any, compensation: Any) -> None:
  """Under Kahan, a bfloat16 or float16 param has a compensation of its shape and dtype,
  and a wider one has none (``None``): ``ValueError`` or ``TypeError`` naming the path."""
  narrow = is_narrow(grad.dtype)
  if compensation is None:
    if narrow:
      raise ValueError(
          f"{path_name(path)}: the optimizer state holds no Kahan compensation for this "
          f"{np.dtype(grad.dtype).name} param (the state was made for a wider param): make "
          "the state with this optimizer's init for these params"
      )
    return
  if not narrow:
    raise ValueError(
        f"{path_name(path)}: the optimizer state holds a Kahan compensation for this "
        f"{np.dtype(grad.dtype).name} param, which is never rounded (the state was made for a "
        "bfloat16 or float16 param): make the state with this optimizer's init for these "
        "params"
    )
  if tuple(compensation.shape) != tuple(grad.shape):
    raise ValueError(
        f"{path_name(path)}: Kahan compensation shape {tuple(compensation.shape)} != param "
        f"shape {tuple(grad.shape)}; was the state made for other parameters?"
    )
  if np.dtype(compensation.dtype) != np.dtype(grad.dtype):
    raise TypeError(
        f"{path_name(path)}: the Kahan compensation in the optimizer state is "
        f"{np.dtype(compensation.dtype).name}, but it is kept in the param's dtype, "
        f"{np.dtype(grad.dtype).name}: make the state with this optimizer's init for these "
        "params, and do not cast the optimizer state"
    )


def check_shaped_params(params: Any, function: str) -> None:
  """``params`` given to ``function``, which reads their shapes and dtypes alone, must hold
  arrays or ``jax.ShapeDtypeStruct``s (in flax boxes or not): the params' specs or
  shardings given in their place are named as such.

  >>> from jax.sharding import PartitionSpec as P
  >>> check_shaped_params({"w": P("data")}, "state_partition_specs")
  Traceback (most recent call last):
  TypeError: state_partition_specs: params['w'] is a PartitionSpec, not a param: pass the ...
  """
  def check(path, leaf):
    leaf = placement.unbox(leaf)
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      return
    # PartitionSpec's class is called P in newer JAX releases.
    spec = isinstance(leaf, jax.sharding.PartitionSpec)
    kind = "PartitionSpec" if spec else type(leaf).__name__
    advice = (f"pass the params (arrays or jax.ShapeDtypeStructs) and then their specs, "
              f"{function}(optimizer, params, param_specs)"
              if spec or isinstance(leaf, jax.sharding.Sharding) else
              "pass arrays or jax.ShapeDtypeStructs")
    raise TypeError(f"{function}: {path_name(path)} is {state_checks.with_article(kind)}, "
                    f"not a param: {advice}")

  jax.tree_util.tree_map_with_path(check, params, is_leaf=placement.is_box)


def check_init_params(params: Any, *, any_dtype: bool = False, exclude: str = _EXCLUDE) -> None:
  """Static checks of ``init``'s params (flax boxes unboxed), naming the parameter path."""
  check_not_a_state(params)
  jax.tree_util.tree_map_with_path(
      lambda path, param: check_param_leaf(path, placement.unbox(param), any_dtype=any_dtype,
                                           exclude=exclude, box=param),
      params, is_leaf=placement.is_box,
  )


def check_update_inputs(grads: Any, params: Any | None, *, any_dtype: bool = False,
                        name: str = "grads") -> None:
  """Static checks of ``update``'s grads (and params), naming the parameter path.

  ``any_dtype`` (for wrappers of any optax transformation) checks that every leaf is
  an array and that shapes agree, and leaves dtypes to the wrapped transformation.
  ``name`` is what the user knows ``grads`` as, in the structure error.
  """
  if params is not None:
    # The structure first: a pair of the gradients and a loss or aux is a whole mistake,
    # which a leaf of it that is no array (aux's Python float) would hide.
    check_same_structure(grads, params, "params", name=name)
  jax.tree_util.tree_map_with_path(
      partial(check_param_leaf, what="grad", any_dtype=any_dtype, stepped=True), grads)
  if params is not None:
    jax.tree_util.tree_map_with_path(
        partial(check_grad_matches_param, any_dtype=any_dtype),
        grads, params)


def check_leaf_state(path: KeyPath, grad: Any, moment: Any, stat_shapes: dict, momentum: Any,
                     statistics_dtype: tuple[Any, str], momentum_dtype: tuple[Any, str],
                     whole_leaf: list[str] | None = None) -> None:
  """A leaf's state as this optimizer keeps it: statistics of the shapes its plan gives
  (``FactorPlan.stat_shapes``, keepdims) and, like its momentum, in the dtype it keeps them
  in (:func:`check_state_dtype`; each dtype with the argument that sets it).

  The state's shapes record the plan ``init`` used; a mismatch means the state was made
  for other params or with other factoring settings. Before them: a grad split over
  ``jax.shard_map``'s mesh axes, refused when the leaf's step reduces over the whole leaf
  (``whole_leaf`` names those reductions: its row and column statistics, its clipping, ...).
  """
  if whole_leaf and isinstance(grad, jax.core.Tracer):
    axes = manual_axes.varying_axes(grad)
    if axes:
      raise manual_axes.shard_statistics_error(path_name(path), axes, whole_leaf)
  found = dict(zip(moment._fields, map(np.shape, moment), strict=True))
  if found != stat_shapes:
    raise ValueError(
        f"{path_name(path)}: optimizer state {found} does not fit grad shape "
        f"{tuple(grad.shape)} (expected {stat_shapes}); was the state made for other "
        "parameters, or with other factored / min_dim_size_to_factor / factor_rules?"
    )
  for stat in moment:
    check_state_dtype(path, "second moment", stat.dtype, *statistics_dtype)
  if momentum is not None:
    check_state_dtype(path, "momentum", momentum.dtype, *momentum_dtype)


def check_grad_shape(path: KeyPath, grad: Any, param: Any) -> None:
  """The grad must have its param's shape (``param`` may be anything shaped like it)."""
  if tuple(grad.shape) != tuple(param.shape):
    raise ValueError(
        f"{path_name(path)}: grad shape {tuple(grad.shape)} != param shape {tuple(param.shape)}"
    )


def check_grad_matches_param(path: KeyPath, grad: Any, param: Any, *,
                             any_dtype: bool = False) -> None:
  """Shapes must be equal and, unless ``any_dtype``, dtypes identical."""
  check_param_leaf(path, param, any_dtype=any_dtype, stepped=True)
  check_grad_shape(path, grad, param)
  if isinstance(grad, jax.core.Tracer):  # (only a traced value can differ between devices)
    unaveraged = sorted(set(manual_axes.varying_axes(grad)) - set(manual_axes.varying_axes(param)))
    if unaveraged:
      raise manual_axes.unaveraged_grads_error(path_name(path), tuple(unaveraged))
  if not any_dtype and grad.dtype != param.dtype:
    raise TypeError(
        f"{path_name(path)}: grad dtype {grad.dtype} != param dtype {param.dtype}; "
        "cast the gradients to the parameters' dtype"
    )


def _public_name(fn: Any) -> str:
  """``optax.sgd`` for ``optax._src.alias.sgd``: the name users import it under."""
  name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
  package_name = (getattr(fn, "__module__", None) or "").split(".")[0]
  package = sys.modules.get(package_name)
  if package is not None and getattr(package, name, None) is fn:
    return f"{'osf' if package_name == 'optax_safefactor' else package_name}.{name}"
  return name


def _call_example(fn: Any) -> str:
  """``optax.sgd(learning_rate)``: the call with its required (else its first) argument."""
  name = _public_name(fn)
  try:
    parameters = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):
    return f"{name}(...)"
  positional = [p for p in parameters
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  required = [p.name for p in positional if p.default is p.empty]
  return f"{name}({', '.join(required or [p.name for p in positional[:1]])})"


def is_transformation(x: Any) -> bool:
  """Whether ``x`` is an optax transformation: an object (no class) with callable ``init``
  and ``update``, as optax accepts one."""
  return not inspect.isclass(x) and all(callable(getattr(x, method, None))
                                        for method in ("init", "update"))


def check_transformation(inner: Any, wrapper: str, name: str = "inner") -> None:
  """``inner`` must be an optax transformation: raise ``TypeError`` at construction.

  Anything with callable ``init`` and ``update`` is accepted, as optax accepts it
  (``optax.MultiSteps``, say). The usual mistake is the factory itself
  (``optax.sgd`` for ``optax.sgd(1e-3)``), which only fails deep inside optax at
  ``init``; the message says how to call it.

  >>> import optax
  >>> check_transformation(optax.sgd, "skip_nonfinite")
  Traceback (most recent call last):
  ...
  TypeError: skip_nonfinite: inner must be an optax GradientTransformation ..., got the
  function optax.sgd; call it: optax.sgd(learning_rate)
  """
  if is_transformation(inner):
    return
  expected = (f"{wrapper}: {name} must be an optax GradientTransformation (an object with "
              "init and update, e.g. optax.adamw(1e-3))")
  if callable(inner):
    kind = "class" if inspect.isclass(inner) else "function"
    raise TypeError(f"{expected}, got the {kind} {_public_name(inner)}; call it: "
                    f"{_call_example(inner)}")
  holding = argument_names.tree_of_arrays(inner)
  if holding:
    raise TypeError(f"{expected}, got {holding}: the params, or an optimizer's state, in "
                    f"{name}'s place?")
  kind = type(inner).__name__
  raise TypeError(f"{expected}, got {state_checks.with_article(kind)} "
                  f"({reprlib.repr(inner)})")


def check_switch(value: Any, name: str) -> None:
  """``value`` must be ``True`` or ``False``: a string such as ``"no"`` from a config file
  would otherwise read as True, and 0 or 1 is a count, not a switch."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be True or False, got {value!r}")


def check_positive_int(value: Any, name: str, *, none_ok: bool = False, meaning: str = "",
                       minimum: int = 1) -> None:
  """``value`` must be an int of at least ``minimum`` (or ``None`` when ``none_ok``): else
  ``ValueError``, which names the least value taken whatever was wrong.

  Bools and floats are refused: ``True`` or ``2.5`` steps is a mistake, not a count. A
  traced value passes. ``meaning`` ends the message, saying what the number is for.

  >>> check_positive_int(0, "max_consecutive", meaning=" (a count of steps)")
  Traceback (most recent call last):
  ValueError: max_consecutive must be a positive int, got 0 (a count of steps)
  """
  if (value is None and none_ok) or isinstance(value, jax.core.Tracer):
    return
  integral = ((isinstance(value, (int, np.integer)) and not isinstance(value, bool))
              or (hasattr(value, "dtype") and np.ndim(value) == 0
                  and jnp.issubdtype(value.dtype, jnp.integer)))
  if not integral or value < minimum:
    allowed = "a positive int" if minimum == 1 else f"an int of at least {minimum}"
    allowed += " or None" if none_ok else ""
    raise ValueError(f"{name} must be {allowed}, got {value!r}{meaning}")


def traced_shape_setting(name: str, decides: str) -> TypeError:
  """The error for ``name``, a setting that decides the state's shapes, found traced: under
  ``optax.inject_hyperparams`` it arrives as an array, traced under ``jax.jit`` and
  ``jax.eval_shape`` (a checkpoint's restore target), where ``int()`` of it failed with
  JAX's bare ``ConcretizationTypeError``, naming no setting.

  >>> raise traced_shape_setting("spike_window", "the spike history's length")
  Traceback (most recent call last):
  ...
  TypeError: spike_window is traced; it decides the spike history's length, so give it ...
  """
  return TypeError(
      f"{name} is traced; it decides {decides}, so give it as a Python int (with "
      f"optax.inject_hyperparams pass static_args=({name!r},) or call init outside "
      "jax.jit and jax.eval_shape)")


def check_update_against_state(grads: Any, params: Any | None, moments: Any,
                               moment_types: tuple[type, ...]) -> None:
  """The grads against the state's per-leaf moments (one node of ``moment_types`` per
  grad leaf), then :func:`check_update_inputs`: the structure before the leaves."""
  try:
    per_leaf = jax.tree.structure(grads).flatten_up_to(moments)
  except (ValueError, TypeError):
    per_leaf = None
  if per_leaf is None or not all([isinstance(m, moment_types) for m in per_leaf]):
    # Not one moment per grad leaf: say where the two trees differ.
    check_same_structure(
        grads, jax.tree.map(lambda _: 0, moments, is_leaf=lambda x: isinstance(x, moment_types)),
        "the optimizer state",
    )
  check_update_inputs(grads, params)
