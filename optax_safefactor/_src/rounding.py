"""Rounding wide values onto a narrow dtype: to nearest or stochastically, one clamping rule.

Every function here is pure and elementwise, so it fuses into the pass that produces
its input. The one clamping rule (:func:`saturate`): a finite value beyond the narrow
dtype's range becomes its largest finite value, of the same sign; NaN and Inf pass
through unchanged, so that a non-finite guard still sees them. Every conversion from
a wide value to a narrow dtype in the package goes through it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_safefactor._src import compat, xla_hints

DTypeLike = Any

_NARROW_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def needs_rounding(param_dtype: DTypeLike, compute_dtype: DTypeLike) -> bool:
  """Whether the write-back of a ``param_dtype`` param from ``compute_dtype`` rounds.

  True only for bfloat16 and float16 params computed in a wider dtype. float32 and
  float64 params are left alone by every mode, so they are bit-identical to
  ``"nearest"``.

  >>> needs_rounding(jnp.bfloat16, jnp.float32), needs_rounding(jnp.float32, jnp.float32)
  (True, False)
  """
  param_dtype, compute_dtype = np.dtype(param_dtype), np.dtype(compute_dtype)
  return param_dtype in _NARROW_DTYPES and compute_dtype.itemsize > param_dtype.itemsize


def saturate(x: jax.Array, dtype: DTypeLike) -> jax.Array:
  """The one clamping rule: finite ``x`` clamped to ``dtype``'s finite range; NaN and Inf pass.

  The result stays in ``x``'s (wide) dtype. A finite value never becomes Inf on its
  way into a narrow dtype, and a non-finite one stays visible to a guard (or, with the
  guard off, to the user) rather than turning into a plausible large number.

  >>> saturate(jnp.array([1e6, -jnp.inf, 2.0]), jnp.float16).tolist()
  [65504.0, -inf, 2.0]
  """
  largest = jnp.asarray(jnp.finfo(dtype).max, x.dtype)
  # A select rather than a bare clip: XLA's CPU clamp does not propagate NaN, and a
  # clip would turn Inf into the largest finite value.
  return jnp.where(jnp.isfinite(x), jnp.clip(x, -largest, largest), x)


def saturating_cast(x: jax.Array, dtype: DTypeLike) -> jax.Array:
  """``x.astype(dtype)`` under :func:`saturate`'s rule when ``dtype`` has the smaller range.

  >>> saturating_cast(jnp.array([1e6, -jnp.inf, 2.0]), jnp.float16).tolist()
  [65504.0, -inf, 2.0]
  >>> saturating_cast(jnp.array([2.0], jnp.float16), jnp.float32).dtype  # widening: a cast
  dtype('float32')
  """
  dtype = np.dtype(dtype)
  if x.dtype == dtype:
    return x
  if (jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(x.dtype, jnp.floating)
      and jnp.finfo(dtype).max < jnp.finfo(x.dtype).max):
    x = saturate(x, dtype)
  return x.astype(dtype)


def _uniform(bits: jax.Array, wide: DTypeLike) -> jax.Array:
  """``bits`` as a uniform number in [0, 1): 24 bits in float32 and 32 bits in float64, exact."""
  if np.dtype(wide).itemsize >= 8:
    return bits.astype(wide) * jnp.asarray(2.0**-32, wide)
  return (bits >> 8).astype(wide) * jnp.asarray(2.0**-24, wide)


def _stochastic_round_generic(x: jax.Array, dtype: DTypeLike, bits: jax.Array) -> jax.Array:
  """Round ``|x|`` toward zero and one ulp up, take the upper with probability ``frac``.

  ``down = |x|`` rounded toward zero in ``dtype``, ``up`` the next value above it,
  ``frac = (|x| - down) / (up - down)`` (exact: ``up - down`` is a power of two),
  and the result is ``sign(x) * (up if u >= 1 - frac else down)`` for ``u`` uniform
  from ``bits``: probability ``frac`` exactly whenever ``frac`` is a multiple of
  ``2**-24``, which it is for every float32 ``x``. Used for float16 targets and
  float64 inputs; for float32 to bfloat16 it would need ``|x| - down`` as a float32
  normal, which fails below about 1e-31 (the bit trick has no such limit).
  """
  wide = x.dtype
  # Saturated once, and cast from there where x is not finite: a finite x past the range
  # cast as it is would be an Inf (unused, but what jax_debug_infs stops at).
  clamped = saturate(x, dtype)
  magnitude = jnp.abs(clamped)
  nearest = magnitude.astype(dtype)
  down = jnp.where(nearest.astype(wide) > magnitude,
                   jax.lax.nextafter(nearest, jnp.zeros_like(nearest)), nearest)
  # Toward the largest finite value, not toward Inf: an Inf constant is what
  # jax_debug_infs stops at. Where down is that value, up is too, and the gap is taken as
  # 1 so that frac is 0 / 1 = 0 (magnitude is saturated): never up to Inf.
  up = jax.lax.nextafter(down, jnp.full_like(down, jnp.finfo(dtype).max))
  down_wide = down.astype(wide)
  gap = up.astype(wide) - down_wide
  frac = (magnitude - down_wide) / jnp.where(gap > 0, gap, jnp.ones([], wide))
  rounded = jnp.where(_uniform(bits, wide) >= 1 - frac, up, down)
  signed = jnp.where(jnp.signbit(x), -rounded, rounded)
  return jnp.where(jnp.isfinite(x), signed, clamped.astype(dtype))


_BF16_MAX_PATTERN = np.uint32(0x7F7F0000)  # the largest finite bfloat16, as float32 bits
_F32_INF_PATTERN = np.uint32(0x7F800000)


def _stochastic_round_bfloat16(x: jax.Array, bits: jax.Array) -> jax.Array:
  """float32 to bfloat16: add ``bits >> 16`` to the 16 bits bfloat16 drops, keep the top 16.

  The sum carries into the kept bits with probability (dropped bits) / 2**16, the
  fraction of the ulp, so the magnitude is rounded up with exactly that
  probability: the same event as the generic method's ``u >= 1 - frac`` on the
  same bits. Integer operations only (a float32 to bfloat16 conversion is a
  software rounding on most CPUs): magnitudes above the largest finite bfloat16
  are set to it and get no carry, Inf gets no carry, and NaN keeps a quiet bit so
  that truncating its payload cannot make it Inf.
  """
  pattern = jax.lax.bitcast_convert_type(x, jnp.uint32)
  magnitude = pattern & np.uint32(0x7FFFFFFF)
  in_range = magnitude <= _BF16_MAX_PATTERN
  too_large = (magnitude > _BF16_MAX_PATTERN) & (magnitude < _F32_INF_PATTERN)
  magnitude = jnp.where(too_large, _BF16_MAX_PATTERN, magnitude)
  magnitude = magnitude + jnp.where(in_range, bits >> 16, np.uint32(0))
  quiet_nan = jnp.where(magnitude > _F32_INF_PATTERN, np.uint32(0x00400000), np.uint32(0))
  rounded = (magnitude | quiet_nan | (pattern & np.uint32(0x80000000))) >> 16
  return jax.lax.bitcast_convert_type(rounded.astype(jnp.uint16), jnp.bfloat16)


_ROUNDING_BIAS = np.uint32(0x7FFF)
_HIGH_HALF = np.uint32(0xFFFF0000)
_SIGN = np.uint32(0x80000000)
_F32_QUIET_NAN = np.uint32(0x7FC00000)


def _bfloat16_grid(x: jax.Array, saturating: bool) -> jax.Array:
  """float32 ``x`` rounded to nearest even on the bfloat16 grid, as float32.

  In integer operations on the CPU, XLA's ``reduce_precision`` elsewhere
  (:func:`xla_hints.bit_pattern_rounding`): a rounding no compiler may skip either way.
  """
  def plain(v):
    if saturating:
      v = saturate(v, jnp.bfloat16)
    return jax.lax.reduce_precision(v, exponent_bits=8, mantissa_bits=7)

  return xla_hints.bit_pattern_rounding(lambda v: _bfloat16_grid_bits(v, saturating), plain,
                                        x, jnp.float32)


def _bfloat16_grid_bits(x: jax.Array, saturating: bool) -> jax.Array:
  """float32 ``x`` rounded to nearest even on the bfloat16 grid, as float32, in integer ops.

  ``pattern + 0x7FFF + (bit 16 of pattern)`` with the low 16 bits cleared is IEEE
  round to nearest even (subnormals included); a finite magnitude that carries past
  the largest bfloat16 becomes Inf, or the largest value when ``saturating``. Inf
  stays Inf and NaN stays NaN (a payload in the cleared bits alone would otherwise
  read as Inf).
  """
  pattern = jax.lax.bitcast_convert_type(x, jnp.uint32)
  magnitude = pattern & np.uint32(0x7FFFFFFF)
  rounded = magnitude + (_ROUNDING_BIAS + ((magnitude >> 16) & np.uint32(1)))
  if saturating:
    finite = magnitude < _F32_INF_PATTERN
    rounded = jnp.where(finite, jnp.minimum(rounded, _BF16_MAX_PATTERN), rounded)
  rounded = jnp.where(magnitude > _F32_INF_PATTERN, _F32_QUIET_NAN, rounded)
  return jax.lax.bitcast_convert_type((rounded & _HIGH_HALF) | (pattern & _SIGN), jnp.float32)


def on_grid(x: jax.Array, dtype: DTypeLike, *, saturating: bool = True) -> jax.Array:
  """``x`` rounded to nearest (even) on ``dtype``'s grid, kept in ``x``'s (wide) dtype.

  ``saturating`` clamps finite values to the largest finite value of ``dtype``; NaN
  and Inf pass either way. float32 to bfloat16 is computed on the bit pattern: a
  rounding that no compiler may skip, unlike a ``float32 -> bfloat16 -> float32``
  pair of conversions, which XLA drops inside a jit when it allows excess
  precision (the default on CPU and GPU), and a few integer operations that
  vectorise where the float conversion is a library call per element (CPUs
  without bfloat16 instructions). Other pairs use that pair of conversions (XLA's
  ``reduce_precision`` flushes float16 subnormals), so where XLA keeps excess
  precision a float16 value is only rounded where it is stored.

  >>> on_grid(jnp.array([1.0 + 2.0**-8 + 2.0**-20, 3.4e38]), jnp.bfloat16).tolist()
  [1.0078125, 3.3895313892515355e+38]
  """
  dtype = np.dtype(dtype)
  if dtype == np.dtype(jnp.bfloat16) and x.dtype == np.dtype(jnp.float32):
    return _bfloat16_grid(x, saturating)
  if saturating:
    x = saturate(x, dtype)
  return x.astype(dtype).astype(x.dtype)


def exact_cast(x: jax.Array, dtype: DTypeLike) -> jax.Array:
  """``x.astype(dtype)`` for values already on ``dtype``'s grid (see :func:`on_grid`).

  float32 to bfloat16 keeps the top 16 bits of the pattern (exact on the grid, and
  a shift where the float conversion is a library call per element on CPUs
  without bfloat16 instructions); other pairs convert.
  """
  dtype = np.dtype(dtype)
  if dtype == np.dtype(jnp.bfloat16) and x.dtype == np.dtype(jnp.float32):
    return xla_hints.bit_pattern_rounding(_top_half, lambda v: v.astype(jnp.bfloat16), x,
                                          jnp.bfloat16)
  return x.astype(dtype)


def _top_half(x: jax.Array) -> jax.Array:
  high = (jax.lax.bitcast_convert_type(x, jnp.uint32) >> 16).astype(jnp.uint16)
  return jax.lax.bitcast_convert_type(high, jnp.bfloat16)


def round_to_nearest(x: jax.Array, dtype: DTypeLike, *, saturating: bool = True) -> jax.Array:
  """``x`` rounded to nearest (even) in ``dtype``; finite values saturate unless told not to.

  ``exact_cast(on_grid(x, dtype))``: with ``saturating=False`` it is
  ``x.astype(dtype)`` value for value (values beyond the range become Inf).

  >>> round_to_nearest(jnp.array([1.0 + 2.0**-8, 3.4e38, -jnp.inf]), jnp.bfloat16).tolist()
  [1.0, 3.3895313892515355e+38, -inf]
  """
  dtype = np.dtype(dtype)
  if x.dtype == dtype:
    return x
  return exact_cast(on_grid(x, dtype, saturating=saturating), dtype)


def stochastic_round(x: jax.Array, dtype: DTypeLike, bits: jax.Array) -> jax.Array:
  """``x`` rounded to ``dtype`` up or down at random: ``E[result] = x`` (unbiased).

  With ``down`` and ``up`` the neighbours of ``x`` in ``dtype``, the result is
  ``up`` with probability ``(x - down) / (up - down)`` (measured on the magnitude),
  decided by the uint32 ``bits`` (one word per element, e.g. from
  :func:`bit_streams.random_bits`). float32 to bfloat16 uses an exact integer trick on the
  float32 pattern; other pairs round through ``nextafter``; both make the same
  choice on the same bits. Values exactly representable in ``dtype`` are
  returned unchanged.

  Finite values saturate at the largest finite value of ``dtype`` (a finite value
  never becomes Inf); NaN and Inf pass through. XLA flushes subnormals to zero
  inside jit on CPU and TPU, so bfloat16 subnormal targets (below about 1.2e-38,
  float32's subnormals too) are out of reach; float16 subnormals are float32
  normals and are rounded like any other value.

  >>> x = jnp.full((4096,), 1.0 + 2.0**-9, jnp.float32)  # a quarter of an ulp above 1.0
  >>> from optax_safefactor._src.bit_streams import random_bits
  >>> bits = random_bits(0, 0, 0, x.shape, stream=0)
  >>> r = stochastic_round(x, jnp.bfloat16, bits)
  >>> sorted(set(r.astype(jnp.float32).tolist()))
  [1.0, 1.0078125]
  >>> abs(float(jnp.mean(r.astype(jnp.float32) == 1.0078125)) - 0.25) < 0.03
  True

  Args:
    x: float32 or float64 values.
    dtype: the narrower floating dtype to round to (bfloat16 or float16).
    bits: uint32 random bits of ``x``'s shape.

  Returns:
    An array of ``dtype``.
  """
  dtype = np.dtype(dtype)
  if x.dtype == dtype:
    return x
  return _stochastic_round(x, dtype, compat.match_sharding(bits, x))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _stochastic_round(x: jax.Array, dtype: np.dtype, bits: jax.Array) -> jax.Array:
  if dtype == np.dtype(jnp.bfloat16) and x.dtype == np.dtype(jnp.float32):
    return _stochastic_round_bfloat16(x, bits)
  return _stochastic_round_generic(x, dtype, bits)


@_stochastic_round.defjvp
def _stochastic_round_jvp(dtype, primals, tangents):
  # The derivative of a cast, as rounding to nearest has in JAX: the rounding is unbiased
  # (E[result] = x). Its integer operations alone would give 0 for every element, and
  # code differentiating through update (learned optimizers, hyperparameter gradients)
  # a zero gradient without a word.
  x, bits = primals
  return _stochastic_round(x, dtype, bits), tangents[0].astype(dtype)


