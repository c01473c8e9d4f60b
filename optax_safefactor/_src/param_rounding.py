"""``with_param_rounding``: any optax transformation, its updates written back onto narrow params.

The wrapped transformation sees float32 copies of bfloat16/float16 gradients and
params; its float32 updates go through the same write-back as safefactor's own
(:func:`write_back.write_back`), one leaf at a time.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_safefactor._src import (
    bit_streams,
    checks,
    counters,
    numerics,
    placement,
    state_checks,
    user_warnings,
    wrapped_update,
    write_back,
)
from optax_safefactor._src.argument_names import explain_unknown_arguments
from optax_safefactor._src.trees import find_all, unzip_leaf_results


class ParamRoundingState(NamedTuple):
  """State of :func:`with_param_rounding`.

  Attributes:
    inner_state: the wrapped transformation's state (built from float32 params).
    count: applied steps (int32; a step a guard inside skipped is not one); with the
      seed and the leaf path it picks the bits.
    compensation: ``"kahan"`` only (else ``None``): per narrow param, what rounding
      lost, in the param dtype and placed like the param; ``None`` for other leaves.
  """

  inner_state: Any
  count: jax.Array
  compensation: Any


def _dtype(x: Any) -> np.dtype:
  # Every leaf has one: init and update refuse a leaf that is not an array first.
  return np.dtype(x.dtype)


def _is_narrow(x: Any) -> bool:
  return write_back.is_narrow(_dtype(x))


def _widen(tree: Any) -> Any:
  """float32 copies of the narrow leaves; every other leaf as it is."""
  return jax.tree.map(
      lambda x: x.astype(numerics.compute_dtype(_dtype(x))) if _is_narrow(x) else x, tree
  )


def _widen_grads(grads: Any, params: Any) -> Any:
  """The grads ``inner`` sees: float32 copies where the param is narrow (or, without
  params, where the grad is); the grad of a wide param as it is, so that ``inner`` steps
  that param exactly as it would unwrapped."""
  if params is None:
    return _widen(grads)
  return jax.tree.map(lambda grad, param: _widen(grad) if _is_narrow(param) else grad,
                      grads, params)


def _skipped_inside(old_inner: Any, new_inner: Any) -> jax.Array:
  """Whether a guard inside the wrapped transformation skipped this step: one of this
  package's counted a skip, or an ``optax.apply_if_finite`` found the step non-finite."""
  guards = (counters.COUNTER_TYPES, optax.ApplyIfFiniteState)
  skipped = [~new.last_finite if isinstance(new, optax.ApplyIfFiniteState)
             else new.skipped_steps > old.skipped_steps
             for old, new in zip(find_all(old_inner, guards), find_all(new_inner, guards),
                                 strict=True)]
  return jnp.any(jnp.stack(skipped)) if skipped else jnp.asarray(False)


@explain_unknown_arguments
def with_param_rounding(
    inner: optax.GradientTransformation, mode: str = "stochastic", seed: int = 0
) -> optax.GradientTransformationExtraArgs:
  """Any optax transformation, with updates that land bfloat16/float16 params precisely.

  ``inner`` sees float32 copies of the gradients and params (so its own state is
  float32) and its float32 update ``u`` is written back so that
  ``optax.apply_updates(params, updates)`` lands on the rounded value of
  ``param + u`` (exactly whenever the difference is representable in the param
  dtype, which holds for updates up to half the param):

  * ``"nearest"``: the update is cast to the gradient dtype, as optax does (finite
    values clamped to its range); small updates to narrow params vanish. ``params``
    are optional.
  * ``"stochastic"``: rounded up with probability equal to the fraction of the ulp
    (unbiased), bits from ``(seed, applied step, leaf path, global element
    index)``: the same on one device, any mesh and any number of processes.
  * ``"kahan"``: rounded to nearest, with a compensation buffer per narrow param
    (2 bytes per bfloat16 param) carrying what rounding lost. The buffer is made
    with ``jnp.zeros_like(param)``: placed like its param by an eager ``init`` and
    under ``jax.jit`` with Explicit mesh axes; with Auto axes a jitted ``init``
    needs ``out_shardings`` (the first jitted update places it like the param).

  ``inner`` steps float32 copies, so its own write-back has nothing narrow to round: a
  ``safefactor(..., param_rounding=...)`` inside rounds only its narrow momentum or
  statistics that way, and this transformation's ``mode`` decides the params'.

  float32 and float64 params are untouched by every mode (``init`` warns where no param
  is narrow, as the mode has no effect there): their gradients reach
  ``inner`` as they come (bfloat16 ones included) and their updates are ``inner``'s, bit
  for bit, in ``inner``'s dtype. A narrow param's update is in the param dtype, or with
  ``"nearest"`` in the gradient dtype, as optax casts it.

  Nothing after this transformation in a chain may change a non-zero update (no
  scaling, clipping or weight decay after it): the update is only right as given.
  :func:`optax_safefactor.skip_nonfinite` may wrap it, since a skip zeroes the
  updates and restores the whole state, the rounding state included, so a skipped
  step consumes no bits and leaves the compensation alone. A step that a guard inside
  ``inner`` skips (this package's, or ``optax.apply_if_finite``) draws no bits either:
  the count stays, and the run equals the run without that step.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_safefactor as osf
    >>> tx = osf.with_param_rounding(optax.sgd(1e-3), mode="kahan")
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> for _ in range(10):
    ...   updates, state = tx.update({"w": -jnp.ones(3, jnp.bfloat16)}, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params["w"]  # round to nearest would stay at 1.0
    Array([1.00781, 1.00781, 1.00781], dtype=bfloat16)

  Args:
    inner: any optax transformation (a chain, ``optax.adamw``, ...).
    mode: ``"nearest"``, ``"stochastic"`` or ``"kahan"``.
    seed: the seed of the stochastic rounding (a Python int).

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` whose state is a
    :class:`ParamRoundingState`: ``inner_state`` (``inner``'s state, built from float32
    copies of the params), ``count`` (the applied steps, int32: with the seed and the
    leaf path it picks the random bits) and ``compensation`` (``"kahan"`` only, else
    ``None``: per narrow param, what rounding lost, in the param dtype; ``None`` for
    other leaves).

  Raises:
    TypeError: at construction, when ``inner`` is not a transformation (the factory
      ``optax.sgd`` rather than ``optax.sgd(1e-3)``, say); in ``init`` and ``update``,
      when a param or grad leaf is not an array; in ``update``, when the state is not
      this transformation's.
    ValueError: when ``mode`` is not one of the three; in ``update``, when params are
      missing (every mode but ``"nearest"`` needs them), or grads and params differ in
      structure or in a leaf's shape.
  """
  checks.check_transformation(inner, "with_param_rounding")
  mode = write_back.check_rounding_mode(mode, "mode")
  bit_streams.check_seed("seed", seed)
  unused = write_back.unused_seed(mode, seed, "mode", "seed")
  if unused:
    user_warnings.warn(unused)
  inner = optax.with_extra_args_support(inner)
  keeps_compensation = write_back.keeps_compensation(mode)

  def init_fn(params, *misplaced):
    checks.check_init_arguments(misplaced)
    params = placement.numpy_as_jax(params)
    # Any dtype: inner decides about integer leaves; the rounding skips them.
    checks.check_init_params(params, any_dtype=True)
    unrounded = write_back.nothing_to_round(
        mode, [(_dtype(p), numerics.compute_dtype(_dtype(p))) for p in jax.tree.leaves(params)
               if jnp.issubdtype(_dtype(p), jnp.floating)], "mode")
    if unrounded:
      user_warnings.warn(unrounded)
    compensation = None
    if keeps_compensation:
      # zeros_like keeps a concrete param's sharding (and an Explicit-axes tracer's).
      compensation = jax.tree.map(lambda p: jnp.zeros_like(p) if _is_narrow(p) else None, params)
    return ParamRoundingState(
        inner_state=inner.init(_widen(params)),
        count=jnp.zeros([], jnp.int32),
        compensation=compensation,
    )

  def update_fn(updates, state, params=None, **extra_args):
    state_checks.check_state_type(state, ParamRoundingState, updates, "with_param_rounding")
    state_checks.check_counters(state, ("count",))
    checks.check_has_compensation(state.compensation, keeps_compensation, mode,
                                  updates if params is None else params,
                                  "the with_param_rounding state", "mode")
    if write_back.rounds_onto_params(mode) and params is None:
      raise ValueError(
          f"with_param_rounding(mode={mode!r}) needs params: call update(grads, state, params)"
      )
    # Any dtype: float32 grads for bfloat16 params are fine (the update takes the
    # param's dtype); shapes and structure must agree, leaf by leaf.
    checks.check_update_inputs(updates, params, any_dtype=True)
    none_tree = jax.tree.map(lambda _: None, updates)
    # Without a narrow param the compensation may be None itself (init's, for one float32
    # array): None for every leaf.
    stored = none_tree if state.compensation is None else state.compensation
    if keeps_compensation:
      # A compensation for each narrow param of init's: a state made before the params
      # were cast to bfloat16 has none (and the reverse carries one never used).
      flat_params, params_def = jax.tree_util.tree_flatten_with_path(params)
      for (path, param), compensation in zip(
          flat_params, params_def.flatten_up_to(stored), strict=True):
        checks.check_leaf_compensation(path, param, compensation)
    inner_updates, inner_state = wrapped_update.update(
        inner, "with_param_rounding", _widen_grads(updates, params), state.inner_state,
        None if params is None else _widen(params), **extra_args,
    )
    checks.check_same_structure(updates, inner_updates, "the inner transformation's updates")
    # A wrong shape would broadcast in the write-back, or fail there without a path.
    for (path, grad), update in zip(jax.tree_util.tree_flatten_with_path(updates)[0],
                                    jax.tree.leaves(inner_updates), strict=True):
      if tuple(update.shape) != tuple(grad.shape):
        raise ValueError(
            f"{checks.path_name(path)}: the inner transformation's update has shape "
            f"{tuple(update.shape)}, its param {tuple(grad.shape)}")

    # A wide param is never rounded: no bits, no compensation.
    narrow_params = jax.tree.map(lambda p: p if _is_narrow(p) else None,
                                 none_tree if params is None else params)
    flat_updates, treedef = jax.tree_util.tree_flatten_with_path(updates)
    paths = [path for path, _ in flat_updates]
    grads = [grad for _, grad in flat_updates]
    flat_params = treedef.flatten_up_to(narrow_params)
    roundings = write_back.with_stream_keys(
        [None if param is None else write_back.rounding_for(mode, seed, state.count, path)
         for path, param in zip(paths, flat_params, strict=True)],
        [write_back.streams_to_round(param) for param in flat_params])
    wide = [params is not None and param is None for param in flat_params]
    written = jax.tree.unflatten(treedef, [
        # A wide param's update is inner's as it is.
        (update, compensation) if is_wide
        else write_back.write_back(update, param, _dtype(grad), how, compensation)
        for grad, update, param, how, compensation, is_wide in zip(
            grads, treedef.flatten_up_to(inner_updates), flat_params,
            roundings, treedef.flatten_up_to(stored if keeps_compensation else none_tree), wide,
            strict=True)])
    new_updates, new_compensation = unzip_leaf_results(updates, written, 2)
    return new_updates, ParamRoundingState(
        inner_state=inner_state,
        # A step a guard inside ``inner`` skipped lands nothing and draws no bits, so a
        # run with it is the run without it, as with the guard outside.
        count=jnp.where(_skipped_inside(state.inner_state, inner_state), state.count,
                        optax.safe_increment(state.count)),
        # (The state's own structure: None stays None.)
        compensation=(new_compensation if keeps_compensation and state.compensation is not None
                      else state.compensation),
    )

  return optax.GradientTransformationExtraArgs(init_fn, placement.through_boxes(update_fn))
