"""``checked=True`` needs ``checkify``: an error that says so, where JAX's would not.

A ``checkify.check`` staged by ``jax.jit`` without ``checkify.checkify`` around it fails
when the caller's step is compiled, with JAX's "Cannot abstractly evaluate a
checkify.check which was not functionalized", which names neither ``checked=True`` nor
what to do. The guard therefore routes each checked predicate through
:func:`needs_checkify`, an identity that ``checkify.checkify`` removes (its rule below)
and whose compilation otherwise raises :class:`CheckedWithoutCheckifyError`, naming the
setting and the fix. Eagerly and under ``jax.eval_shape`` nothing is compiled, so nothing
is raised, exactly as for the check itself. With JAX's
``jax_experimental_unsafe_xla_runtime_errors`` on, the checks compile to runtime errors
and the identity compiles to nothing.

Where JAX's checkify module lacks the table of rules this extends, the marker is left out
and the predicate passes through untouched (JAX's own error stands).
"""

from __future__ import annotations

import jax
from jax.interpreters import batching, mlir

try:  # The checkify rules' table is private: its absence only turns the marker off.
  from jax._src.checkify import error_checks as _checkify_rules
  from jax.extend.core import Primitive
except ImportError:  # pragma: no cover - depends on the installed JAX
  _checkify_rules = None


class CheckedWithoutCheckifyError(ValueError):
  """Raised when a step built with ``checked=True`` is compiled without ``checkify``."""


CheckedWithoutCheckifyError.__module__ = "optax_safefactor"

MESSAGE = (
    "checked=True raises through jax.experimental.checkify, so the jitted training step "
    "must be wrapped in it: err, out = checkify.checkify(step)(...) then err.throw() "
    "(jax.jit(checkify.checkify(step)) or checkify.checkify(jax.jit(step)) both work), or "
    "chex.chexify(step); or build the optimizer with checked=False (the default: non-finite "
    "steps are still skipped and counted)"
)

def _lower(ctx, predicate):
  if getattr(jax.config, "jax_experimental_unsafe_xla_runtime_errors", False):
    return [predicate]
  raise CheckedWithoutCheckifyError(MESSAGE)


def _batch(args, dims):
  return _needs_checkify_p.bind(*args), dims[0]


def _under_checkify(error, enabled_errors, predicate):
  del enabled_errors
  return error, predicate


if _checkify_rules is not None:
  _needs_checkify_p = Primitive("safefactor_checked_needs_checkify")
  _needs_checkify_p.def_impl(lambda predicate: predicate)
  _needs_checkify_p.def_abstract_eval(lambda predicate: predicate)
  mlir.register_lowering(_needs_checkify_p, _lower)
  batching.primitive_batchers[_needs_checkify_p] = _batch
  _checkify_rules[_needs_checkify_p] = _under_checkify


def needs_checkify(predicate: jax.Array) -> jax.Array:
  """``predicate``, unchanged; compiling it outside ``checkify.checkify`` raises
  :class:`CheckedWithoutCheckifyError`.

  >>> import jax.numpy as jnp
  >>> needs_checkify(jnp.array(True))
  Array(True, dtype=bool)
  """
  if _checkify_rules is None:
    return predicate
  return _needs_checkify_p.bind(jax.numpy.asarray(predicate))
