"""Dtype rules shared by every transform: compute wide, store float32, floor every divisor."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

DTypeLike = Any


def compute_dtype(dtype: DTypeLike) -> np.dtype:
  """The dtype arithmetic runs in: at least float32, float64 (or complex128) when given.

  >>> compute_dtype(jnp.bfloat16)
  dtype('float32')
  >>> compute_dtype(jnp.complex64)
  dtype('complex64')
  """
  dtype = np.dtype(dtype)
  # Written out rather than promote_types, which strict dtype promotion refuses for bf16.
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return np.dtype(jnp.complex128) if dtype.itemsize >= 16 else np.dtype(jnp.complex64)
  return np.dtype(jnp.float64) if dtype.itemsize >= 8 else np.dtype(jnp.float32)


def real_dtype(dtype: DTypeLike) -> np.dtype:
  """The real counterpart of a (possibly complex) dtype: statistics are always real."""
  return np.dtype(jnp.finfo(dtype).dtype)


def resolve_state_dtype(state_dtype: DTypeLike | None, param_dtype: DTypeLike) -> np.dtype:
  """The dtype second-moment statistics are stored in.

  ``None`` means float32, or float64 for float64 (and complex128) parameters: the
  state is never narrower than float32 unless the caller asks for it by name.

  >>> resolve_state_dtype(None, jnp.float16)
  dtype('float32')
  >>> resolve_state_dtype("bfloat16", jnp.float32)
  dtype(bfloat16)
  """
  if state_dtype is None:
    return real_dtype(compute_dtype(param_dtype))
  if isinstance(state_dtype, (jax.Array, np.ndarray, jax.core.Tracer)):
    # A dtype class arrives from optax.inject_hyperparams as a scalar of that dtype, as
    # dtype_momentum does (momentum_dtype); converting the array itself is deprecated.
    state_dtype = state_dtype.dtype
  resolved = np.dtype(jnp.dtype(state_dtype))
  if not jnp.issubdtype(resolved, jnp.floating):
    raise TypeError(f"state dtype must be a real floating dtype, got {state_dtype!r}")
  return resolved


# dtype_momentum's name for the param's dtype widened to float32 (float64 stays float64):
# the rule by which PyTorch's Adafactors keep their first moment.
AT_LEAST_FLOAT32 = "at_least_float32"


def momentum_dtype(dtype_momentum: Any, param_dtype: Any) -> np.dtype:
  """The first moment's dtype: ``dtype_momentum`` by name, the param's for ``None``, or
  the param's widened to float32 for ``"at_least_float32"`` (:func:`compute_dtype`).

  A name gives a precision, real or complex as the param is (a complex param's
  momentum is complex): ``"float32"`` and ``"complex64"`` both mean complex64 for a
  complex param and float32 for a real one.

  >>> momentum_dtype(None, jnp.bfloat16), momentum_dtype("float32", jnp.bfloat16)
  (dtype(bfloat16), dtype('float32'))
  >>> momentum_dtype("complex64", jnp.complex64), momentum_dtype("complex64", jnp.float32)
  (dtype('complex64'), dtype('float32'))
  >>> momentum_dtype("at_least_float32", jnp.bfloat16), momentum_dtype("at_least_float32",
  ...                                                                  jnp.float64)
  (dtype('float32'), dtype('float64'))
  >>> momentum_dtype(np.dtype(np.float16).str, jnp.bfloat16)  # NumPy's own name, "<f2"
  dtype('float16')
  """
  if dtype_momentum is None:
    return np.dtype(param_dtype)
  if isinstance(dtype_momentum, str) and dtype_momentum == AT_LEAST_FLOAT32:
    return compute_dtype(param_dtype)
  if isinstance(dtype_momentum, (jax.Array, np.ndarray, jax.core.Tracer)):
    # optax.inject_hyperparams calls every callable argument as a schedule, and a dtype
    # class such as jnp.bfloat16 is callable: it arrives as a scalar of that dtype.
    dtype_momentum = dtype_momentum.dtype
  dtype = np.dtype(jnp.dtype(dtype_momentum))
  if jnp.issubdtype(dtype, jnp.complexfloating):
    dtype = np.dtype(jnp.finfo(dtype).dtype)  # the precision: float32 for complex64
  if jnp.issubdtype(param_dtype, jnp.complexfloating):
    return np.dtype(jnp.complex128) if dtype.itemsize >= 8 else np.dtype(jnp.complex64)
  return dtype


def smallest_normal(dtype: DTypeLike) -> float:
  """The smallest positive normal number of a dtype's real part."""
  return float(jnp.finfo(dtype).tiny)  # a complex dtype's finfo is its real part's


def positive_floor(epsilon: jax.typing.ArrayLike, dtype: DTypeLike) -> jax.Array:
  """``max(epsilon, smallest normal)`` in ``dtype``: the floor under every rsqrt and divisor.

  A user's ``epsilon`` may be zero, or may round to zero in a narrow dtype; the
  floor never does.
  """
  info = jnp.finfo(dtype)  # of the real part, for a complex dtype
  return jnp.maximum(jnp.asarray(epsilon, info.dtype), jnp.asarray(info.tiny, info.dtype))


class LeafNumbers(NamedTuple):
  """The dtype rules for one gradient dtype, worked out once per dtype and trace.

  Attributes:
    compute: the dtype arithmetic runs in (:func:`compute_dtype`).
    real: its real counterpart, the dtype of the statistics' arithmetic.
    floor: :func:`positive_floor` of epsilon in ``real``: under every rsqrt and divisor.
    cap: :math:`1/\\sqrt{\\text{tiny}}` in ``real``: the largest factored scale.
  """

  compute: np.dtype
  real: np.dtype
  floor: jax.Array
  cap: jax.Array


def leaf_numbers(dtype: DTypeLike, epsilon: jax.typing.ArrayLike) -> LeafNumbers:
  """The :class:`LeafNumbers` of a gradient of ``dtype``.

  >>> numbers = leaf_numbers(jnp.bfloat16, 0.0)  # epsilon 0: the floor is the smallest normal
  >>> numbers.compute, numbers.real, float(numbers.floor)
  (dtype('float32'), dtype('float32'), 1.1754943508222875e-38)
  """
  compute = compute_dtype(dtype)
  real = real_dtype(compute)
  cap = jax.lax.rsqrt(jnp.asarray(smallest_normal(real), real))
  return LeafNumbers(compute, real, positive_floor(epsilon, real), cap)


def all_finite(*xs: jax.Array, per_row: bool = False) -> jax.Array:
  """Scalar bool: every element of every ``x`` is finite (True for empty arrays).

  With ``per_row``, one bool per index of the leading axis, which every ``x`` shares
  (leaves packed as rows: ``_src/packing.py``).

  >>> bool(all_finite(jnp.ones(3), jnp.array([1.0, jnp.nan])))
  False
  >>> all_finite(jnp.array([[1.0, 2.0], [jnp.inf, 0.0]]), per_row=True).tolist()
  [True, False]
  """
  flags = [
      # A reduction of per-element bools: a max would do in IEEE arithmetic, but XLA's
      # CPU backend computes min/max without propagating NaN.
      jnp.all(jnp.isfinite(x), axis=tuple(range(1, x.ndim)) if per_row else None)
      for x in xs if x.size
  ]
  if not flags:
    return jnp.array(True)
  finite = flags[0]
  for flag in flags[1:]:
    finite = finite & flag
  return finite


# Roots with derivatives that stay finite where the step's values are. ----------------
# Both are lax's own roots, with only the derivative rule replaced: the forward program
# is unchanged. They matter to code that differentiates through ``update`` (learned
# optimizers, hyperparameter gradients), where lax's rules give NaN at values the step
# itself handles.

#: ``rsqrt`` of a statistic floored above zero. Its derivative :math:`-r/(2x)` is formed
#: as ``(t * -r/2) / x``: for a statistic on the floor (1e-30, where a gradient element
#: is exactly 0), ``r / x`` is 1e45, past float32's range, and lax's rule multiplies the
#: zero cotangent such an element sends back by that inf: NaN.
rsqrt_of_floored = jax.custom_jvp(jax.lax.rsqrt)


@rsqrt_of_floored.defjvp
def _rsqrt_of_floored_jvp(primals, tangents):
  x, t = primals[0], tangents[0]  # (an older lax.rsqrt also takes ``accuracy``)
  root = jax.lax.rsqrt(x)
  return root, (t * (-0.5 * root)) / x


#: ``sqrt`` of a sum (or mean) of squares. It is 0 only where every square is, and the
#: sum's derivative is 0 there too: so is the root's (lax's rule gives 0 / 0, NaN: all-
#: zero params under the parameter scale, an all-zero gradient under clipping).
root_of_squares = jax.custom_jvp(jax.lax.sqrt)


@root_of_squares.defjvp
def _root_of_squares_jvp(primals, tangents):
  x, t = primals[0], tangents[0]
  root = jax.lax.sqrt(x)
  zero = root == 0
  # The inner where keeps the reverse pass's cotangent off a division by 0.
  divisor = jnp.where(zero, jnp.ones_like(root), root)
  return root, jnp.where(zero, jnp.zeros_like(t), (t * 0.5) / divisor)
