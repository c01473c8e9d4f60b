"""Dtype rules shared by every transform: compute wide, store float32, cast back safely."""

from __future__ import annotations

from typing import Any

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
  resolved = np.dtype(jnp.dtype(state_dtype))
  if not jnp.issubdtype(resolved, jnp.floating):
    raise TypeError(f"state dtype must be a real floating dtype, got {state_dtype!r}")
  return resolved


def smallest_normal(dtype: DTypeLike) -> float:
  """The smallest positive normal number of a dtype's real part."""
  return float(jnp.finfo(real_dtype(dtype)).tiny)


def positive_floor(epsilon: jax.typing.ArrayLike, dtype: DTypeLike) -> jax.Array:
  """``max(epsilon, smallest normal)`` in ``dtype``: the floor under every rsqrt and divisor.

  A user's ``epsilon`` may be zero, or may round to zero in a narrow dtype; the
  floor never does.
  """
  dtype = real_dtype(dtype)
  return jnp.maximum(jnp.asarray(epsilon, dtype), jnp.asarray(smallest_normal(dtype), dtype))


def saturating_cast(x: jax.Array, dtype: DTypeLike) -> jax.Array:
  """Cast ``x`` to ``dtype``, clamping finite values to the dtype's finite range.

  A finite float32 update larger than float16 can hold would otherwise become
  Inf on the way out; clamping keeps every update finite. The clamp fuses into
  the elementwise pass that produces ``x``.

  >>> saturating_cast(jnp.array([1e6, -1e6, 2.0]), jnp.float16).tolist()
  [65504.0, -65504.0, 2.0]
  """
  dtype = np.dtype(dtype)
  if x.dtype == dtype:
    return x
  if jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(x.dtype, jnp.floating):
    dtype_max = float(jnp.finfo(dtype).max)
    if dtype_max < float(jnp.finfo(x.dtype).max):
      x = jnp.clip(x, -dtype_max, dtype_max)
  return x.astype(dtype)


def abs_sq(x: jax.Array) -> jax.Array:
  """``|x|**2`` as a real array (complex numbers get real second moments)."""
  if jnp.iscomplexobj(x):
    return jnp.real(x) ** 2 + jnp.imag(x) ** 2
  return x * x


def mean_abs_sq(x: jax.Array, keep_axes: tuple[int, ...] = ()) -> jax.Array:
  """Mean of ``|x|**2`` over every axis but ``keep_axes`` (keepdims when any are kept).

  Returns a scalar when no axis is kept, and 0 rather than NaN for an empty array.
  """
  if not keep_axes:
    if x.size == 0:
      return jnp.zeros((), real_dtype(x.dtype))
    return jnp.mean(abs_sq(x))
  axes = tuple(a for a in range(x.ndim) if a not in keep_axes)
  if x.size == 0:
    shape = tuple(1 if a in axes else size for a, size in enumerate(x.shape))
    return jnp.zeros(shape, real_dtype(x.dtype))
  return jnp.mean(abs_sq(x), axes, keepdims=True)


def all_finite(x: jax.Array) -> jax.Array:
  """Scalar bool: every element of ``x`` is finite (True for an empty array)."""
  if x.size == 0:
    return jnp.array(True)
  # A reduction of per-element bools: a max would do in IEEE arithmetic, but XLA's
  # CPU backend computes min/max without propagating NaN.
  return jnp.all(jnp.isfinite(x))
