"""The wrapped transformation's ``update``, with a state its ``init`` did not make named.

``skip_nonfinite``, ``with_param_rounding`` and ``accumulate_gradients`` keep the state of
the transformation they wrap inside their own. Handed the state of another optimizer (a
notebook's optimizer cell run again without its ``init`` cell, a checkpoint of another
configuration), the wrapped transformation fails in its own code, far from the mistake:
``'TraceState' object has no attribute 'mu'``, or optax.chain's "Make sure you have called
init first!". When the wrapped update fails and the state it was given is not laid out as
its ``init`` lays one out for these params, the error says so, with the failure as its
cause. The comparison runs only on that failure: a step that works is not traced again.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from optax_safefactor._src import tree_mismatch
from optax_safefactor._src.state_checks import RESTORE


def update(inner: optax.GradientTransformation, wrapper: str, grads: Any, inner_state: Any,
           params: Any, **extra_args: Any) -> tuple[Any, Any]:
  """``inner.update(grads, inner_state, params, **extra_args)``, raising a ``TypeError``
  that names the state's first difference from what ``inner.init`` makes when it fails on
  a state its ``init`` would not make (``wrapper``: the wrapping transformation's name)."""
  try:
    return inner.update(grads, inner_state, params, **extra_args)
  except Exception as error:
    found_def, expected_def = jax.tree.structure(inner_state), _init_layout(inner, grads, params)
    if expected_def is None or found_def == expected_def:
      raise
    where = tree_mismatch.first_node_difference(found_def, expected_def, "its state") or (
        f"its state is {found_def}, where init makes {expected_def}")
    raise TypeError(
        f"the transformation inside {wrapper}(...) failed on a state its init does not make "
        f"for these params ({where}): the state was made by another optimizer, or by this "
        "one in another configuration (in a notebook, an optimizer cell run again without "
        "the cell that calls init). Make the state with this optimizer's init; a checkpoint "
        f"of it must be restored with this optimizer's state as the target ({RESTORE})"
    ) from error


def _init_layout(inner: optax.GradientTransformation, grads: Any, params: Any) -> Any:
  """The tree structure of the state ``inner.init`` makes for ``params`` (``grads`` where
  there are none), without computing it; ``None`` where ``init`` cannot take them."""
  try:
    return jax.tree.structure(jax.eval_shape(inner.init, grads if params is None else params))
  except Exception:
    return None
