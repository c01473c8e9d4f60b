"""Is the state handed to ``update`` this optimizer's? Its kind and its counters.

A state of the wrong kind fails deep inside the step otherwise, far from the mistake
that made it; each message names the usual mistakes (arguments swapped, an
``optax.adafactor`` state, a checkpoint restored without a target, a state made by an
optimizer of another configuration, a state cast whole to bfloat16).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_safefactor._src import trees

#: What to do with a checkpoint restored without a target (its states are plain dicts).
RESTORE = ("restore with the state of optimizer.init(params) (or "
           "jax.eval_shape(optimizer.init, params)) as the target")


def check_state_type(state: Any, expected: type, grads: Any, wrapper: str | None = None,
                     *, inner: type | None = None) -> None:
  """``update`` must get the state this transformation's ``init`` made (around an
  ``inner`` state of that type, when given).

  The usual mistakes are an ``optax.adafactor`` state (to be converted with
  ``migrate_from_optax``), arguments in the wrong order, and a checkpoint restored
  without a target (plain lists and dicts). A ``wrapper`` (its name) is usually
  handed the state of the transformation it wraps, made by that one's own ``init``.
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    if isinstance(leaf, jax.ShapeDtypeStruct):
      # jax.eval_shape(optimizer.init, params): a checkpoint's restore target.
      raise TypeError(
          f"opt_state{jax.tree_util.keystr(path)} is a jax.ShapeDtypeStruct, a shape with "
          "no values: a state from jax.eval_shape(optimizer.init, params) is the target to "
          "restore a checkpoint into, not a state to step. Restore the checkpoint with it "
          "as the target, or make the state with optimizer.init(params)")
  if isinstance(state, expected):
    if inner is not None and not isinstance(state.inner_state, inner):
      # A guard's state around another transformation's (skip_nonfinite(optax.adam)).
      raise TypeError(
          f"update expected {with_article(expected.__name__)} around "
          f"{with_article(inner.__name__)} from this optimizer's init, got one around "
          f"{with_article(type(state.inner_state).__name__)}: the state of a guard around "
          "another transformation; make the state with this optimizer's init")
    return
  if isinstance(grads, expected):
    raise TypeError(
        "update got the optimizer state as its first argument; call "
        "update(grads, opt_state, params)"
    )
  kind = type(state).__name__
  hint = ""
  if _shaped_like(state, grads):
    hint = ("; it has the structure of the gradients: are the arguments swapped? call "
            "update(grads, opt_state, params)")
  elif isinstance(state, (list, dict)):
    hint = f"; a checkpoint restored without a target gives plain lists and dicts: {RESTORE}"
  elif kind in _MADE_BY and wrapper is None:
    hint = (f"; {_MADE_BY[kind]}: the state was made by an optimizer of another "
            "configuration. Make the state with this optimizer's init, or build this "
            "optimizer with the settings of the one whose init made it")
  elif held := trees.find_all_with_paths(state, expected):
    # optax.chain's tuple, optax.MultiSteps' or optax.inject_hyperparams' state: a
    # transformation around this one made it, and its update is the one to call.
    # Every one: an optax.multi_transform of two safefactors holds one per part, and
    # this optimizer's may be any of them.
    where = [f"opt_state{jax.tree_util.keystr(path)}" for path, _ in held]
    if len(where) == 1:
      hint = (f"; it holds this optimizer's {expected.__name__} at {where[0]}: it is the "
              "state of a transformation around this optimizer. Pass it to that "
              f"transformation's update, or only {where[0]} to this optimizer's")
    else:
      hint = (f"; it holds {len(where)} states of this optimizer's kind "
              f"({expected.__name__}), at {', '.join(where)}: it is the state of a "
              "transformation around this optimizer. Pass it to that transformation's "
              "update, or only the one this optimizer's init made to this optimizer's")
  elif wrapper is not None:
    # Checked before the optax.adafactor hint: the inner transformation's state may
    # well hold one, and migrate_from_optax does not make a wrapper's state.
    hint = (f"; the state of the transformation it wraps (or of another optimizer) does "
            f"not fit: make the state with the init of the {wrapper}(...) transformation")
  elif _holds_optax_factored_state(state):
    hint = ("; it looks like an optax.adafactor state: convert it with "
            "osf.migrate_from_optax(optax_state, optimizer, params)")
  raise TypeError(f"update expected {with_article(expected.__name__)} from this optimizer's "
                  f"init, got {with_article(kind)}{hint}")


# This package's states, by type name, with what makes each: the likely cause when one
# reaches an optimizer of another configuration.
_MADE_BY = {
    "AdafactorState": "safefactor(..., skip_nonfinite_steps=False) and "
                      "scale_by_safe_factored_rms make an AdafactorState",
    "SkipNonfiniteState": "safefactor makes a SkipNonfiniteState with its guard on "
                          "(skip_nonfinite_steps=True, the default), as skip_nonfinite(...) does",
    "AccumulationState": "accumulate_gradients(...) makes an AccumulationState (pass it to "
                         "that transformation's update, not to the optimizer it wraps)",
    "ParamRoundingState": "with_param_rounding(...) makes a ParamRoundingState",
}


def with_article(noun: str) -> str:
  """``noun`` with its indefinite article: an AdafactorState, a SkipNonfiniteState."""
  return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _shaped_like(state: Any, grads: Any) -> bool:
  """The state argument has the gradients' tree structure (the params passed as the state)."""
  try:
    return jax.tree.structure(state) == jax.tree.structure(grads) and bool(jax.tree.leaves(grads))
  except Exception:  # a tree that jax cannot flatten is no params tree
    return False


# How to keep a state narrow, for the messages below: the optimizer's own dtype settings.
_NARROW_STATE_HINT = (
    "to keep the statistics in bfloat16, build the optimizer with state_dtype='bfloat16' "
    "(and dtype_momentum='bfloat16' for the momentum) instead of casting its state"
)


def check_counters(state: Any, fields: tuple[str, ...], safefactors: bool = False) -> None:
  """The counters of a state (its ``fields``, each a scalar or a tree of scalars) must be
  int32: ``TypeError`` naming the counter.

  A counter cast to bfloat16 with the rest of a state stops at 256 (bfloat16 has 8 bits
  of precision), and every report built on it says too little; float32 stops at 2**24.
  ``safefactors``: the state is safefactor's own, so its dtype settings are the advice
  (a wrapper's inner transformation may have no such settings).

  >>> import jax.numpy as jnp
  >>> from optax_safefactor._src.transform import AdafactorState
  >>> state = AdafactorState(jnp.zeros([], jnp.bfloat16), {})
  >>> check_counters(state, ("count",), safefactors=True)
  Traceback (most recent call last):
  ...
  TypeError: AdafactorState.count: a counter must stay int32, got bfloat16 (a bfloat16
  count stops at 256); ...
  """
  for field in fields:
    for path, counter in jax.tree_util.tree_flatten_with_path(getattr(state, field))[0]:
      dtype = getattr(counter, "dtype", None)
      if dtype is not None and np.dtype(dtype) != np.int32:
        where = f"{type(state).__name__}.{field}{jax.tree_util.keystr(path)}"
        stops = (f" (a {np.dtype(dtype).name} count stops at "
                 f"{2 ** (jnp.finfo(dtype).nmant + 1)})" if jnp.issubdtype(dtype, jnp.floating)
                 else "")
        raise TypeError(f"{where}: a counter must stay int32, got {np.dtype(dtype).name}"
                        f"{stops}; cast only the floating leaves of a state (jax.tree.map("
                        "lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, "
                        "jnp.floating) else x, opt_state))"
                        + (f", or, {_NARROW_STATE_HINT}" if safefactors else ""))


def _holds_optax_factored_state(state: Any) -> bool:
  import optax

  def is_factored(x):
    return isinstance(x, optax.FactoredState)

  return any(is_factored(x) for x in jax.tree.leaves(state, is_leaf=is_factored))
