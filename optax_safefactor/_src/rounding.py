"""Write-back for low-precision params: round to nearest, stochastically, or with Kahan.

``optax.apply_updates`` adds an update to a bfloat16 param in bfloat16 and rounds
to nearest, so an update below half an ulp (``lr = 1e-3`` with an update relative
to the param's scale, say) vanishes. The primitives here choose the update so
that ``apply_updates`` lands on a better value ``target`` of ``param +
exact_update``:

* ``"stochastic"``: ``target`` is rounded up with probability equal to the
  fraction of the ulp, so it is unbiased; the random bits are a counter-based
  hash of ``(seed, step, leaf path, global element index, stream)``, the same on
  one device, on any mesh and on any number of processes.
* ``"kahan"``: ``target`` is rounded to nearest and a compensation buffer in the
  param dtype carries what the rounding lost into the next step.

Every function is pure and elementwise (but for the index arithmetic of
:func:`random_bits`), so it fuses into the pass that produces the update.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_safefactor._src import checks, compat, numerics

DTypeLike = Any
KeyPath = tuple[Any, ...]

ROUNDING_MODES = ("nearest", "stochastic", "kahan")

# Streams keep the bits of different arrays of one leaf independent of each other.
STREAM_PARAMS = 0
STREAM_MOMENTUM = 1
STREAM_STATISTICS = 2
STREAM_COLUMN_STATISTICS = 3

_NARROW_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_WORD = 2**32
_WORD_MASK = _WORD - 1

# Odd multipliers: multiplying by one is a bijection on uint32, so a key that
# absorbs a value stays distinct for distinct values. The first is 2**32 over the
# golden ratio; the other two are the constants of the "lowbias32" integer hash
# found by Chris Wellons' hash prospector.
_GOLDEN = np.uint32(0x9E3779B1)
_MIX_1 = np.uint32(0x7FEB352D)
_MIX_2 = np.uint32(0x846CA68B)
_KEY_START = np.uint32(0x5AFEFAC7)


def check_rounding_mode(mode: str, name: str = "param_rounding") -> str:
  """``mode`` if it is one of :data:`ROUNDING_MODES`, else a ``ValueError`` listing them.

  >>> check_rounding_mode("kahan")
  'kahan'
  >>> check_rounding_mode("up")
  Traceback (most recent call last):
  ...
  ValueError: param_rounding must be one of 'nearest', 'stochastic' or 'kahan', got 'up'
  """
  if not isinstance(mode, str) or mode not in ROUNDING_MODES:
    raise ValueError(
        f"{name} must be one of 'nearest', 'stochastic' or 'kahan', got {mode!r}"
    )
  return mode


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


def path_hash(path: KeyPath | str) -> int:
  """A stable 32-bit hash of a key path: CRC-32 of ``jax.tree_util.keystr(path)``.

  Unlike Python's ``hash`` of a string it is the same in every process.

  >>> path_hash((jax.tree_util.DictKey("w"),)) == path_hash("['w']")
  True
  """
  text = path if isinstance(path, str) else jax.tree_util.keystr(path)
  return zlib.crc32(text.encode("utf-8")) & _WORD_MASK


def _mix32(x: jax.Array) -> jax.Array:
  """An integer finaliser on uint32, a bijection with full avalanche:

  ``x ^= x >> 16; x *= M1; x ^= x >> 15; x *= M2; x ^= x >> 16``.
  """
  x = x ^ (x >> 16)
  x = x * _MIX_1
  x = x ^ (x >> 15)
  x = x * _MIX_2
  return x ^ (x >> 16)


def _absorb(key: jax.Array, value: jax.Array) -> jax.Array:
  """``mix32(key * GOLDEN ^ value)``: for a fixed key, distinct values give distinct keys."""
  return _mix32((key * _GOLDEN) ^ value)


def _uint32(value: Any) -> jax.Array:
  """A uint32 scalar or array; ints wrap modulo 2**32, int32 arrays keep their bits."""
  if isinstance(value, (int, np.integer)):
    return jnp.asarray(np.uint32(int(value) & _WORD_MASK))
  value = jnp.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.integer):
    raise TypeError(f"expected an integer, got dtype {value.dtype}")
  return value.astype(jnp.uint32)


# A 64-bit word, signed or not: the most the rounding hash keys from.
_SEED_RANGE = (-(2**63), 2**64)


def check_seed(name: str, seed: Any) -> None:
  """``seed`` is an int (or an integer array) that fits 64 bits, else an error naming ``name``.

  >>> check_seed("rounding_seed", "0")
  Traceback (most recent call last):
  ...
  TypeError: rounding_seed must be an int (or an integer array), got '0'
  """
  if isinstance(seed, (jax.Array, np.ndarray, jax.core.Tracer)):
    # optax.inject_hyperparams hands an int over as an int32 array.
    if jnp.issubdtype(seed.dtype, jnp.integer) and seed.ndim == 0:
      return
  elif isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
    if _SEED_RANGE[0] <= int(seed) < _SEED_RANGE[1]:
      return
    raise ValueError(f"{name} must fit in 64 bits, got {seed!r}")
  raise TypeError(f"{name} must be an int (or an integer array), got {seed!r}")


def _seed_words(seed: Any) -> tuple[Any, Any]:
  """``seed`` as the high and low 32-bit words of a 64-bit two's-complement integer.

  An integer array gives the words of the Python int of the same value: the seed
  arrives as an int32 array under ``optax.inject_hyperparams``, and it must draw the
  bits of the int (a negative seed included; a 64-bit array keeps its high word).
  """
  if isinstance(seed, (int, np.integer)):
    return int(seed) >> 32, int(seed)
  seed = jnp.asarray(seed)
  if not jnp.issubdtype(seed.dtype, jnp.integer):
    raise TypeError(f"expected an integer seed, got dtype {seed.dtype}")
  if seed.dtype.itemsize == 8:
    return seed >> 32, seed
  if jnp.issubdtype(seed.dtype, jnp.signedinteger):
    # An arithmetic shift: all ones for a negative seed, as Python's ``-1 >> 32``.
    seed = seed.astype(jnp.int32)
    return seed >> 31, seed
  return 0, seed


def stream_key(seed: Any, step: Any, path_hash: Any, stream: Any) -> jax.Array:
  """The uint32 scalar key of one array of one leaf at one step.

  ``seed`` (a Python int of up to 64 bits, or an integer array of the same value),
  ``step`` (traced or not), ``path_hash`` and ``stream`` are absorbed in turn; each
  absorption is a bijection in the absorbed value, so two keys that differ in one
  input differ.
  """
  seed_words = _seed_words(seed)
  key = jnp.asarray(_KEY_START)
  for value in (*seed_words, step, path_hash, stream):
    key = _absorb(key, _uint32(value))
  return key


def index_bits(key: jax.Array, index_lo: jax.Array, index_hi: jax.Array | int = 0) -> jax.Array:
  """Random uint32 bits of the element with flat index ``index_hi * 2**32 + index_lo``.

  ``bits = mix32(absorb(key, index_hi) ^ index_lo)``. For a fixed key the map from
  the 64-bit index to ``bits`` is a bijection on each ``index_hi`` word and
  ``absorb`` gives distinct words distinct row keys, so elements 2**32 apart
  get different bits. A scalar ``index_hi`` (0 for leaves under 2**32 elements)
  costs nothing per element.
  """
  row_key = _absorb(key, _uint32(index_hi))
  return _mix32(_uint32(index_lo) ^ row_key)


def _mul_words(a: jax.Array, constant: int) -> tuple[jax.Array, jax.Array]:
  """``a * constant mod 2**64`` as (low, high) uint32 words; ``a`` is uint32.

  uint32 arithmetic only (64-bit integers need ``jax_enable_x64``): the 32x32-bit
  product from 16-bit halves, with explicit carries.
  """
  c_lo, c_hi = constant & _WORD_MASK, (constant >> 32) & _WORD_MASK
  a_lo, a_hi = a & np.uint32(0xFFFF), a >> 16
  b_lo, b_hi = np.uint32(c_lo & 0xFFFF), np.uint32(c_lo >> 16)
  low = a_lo * b_lo
  cross = a_lo * b_hi
  cross_2 = a_hi * b_lo
  middle = cross + cross_2
  middle_carry = (middle < cross).astype(jnp.uint32)
  word_lo = low + (middle << 16)
  low_carry = (word_lo < low).astype(jnp.uint32)
  word_hi = a_hi * b_hi + (middle >> 16) + (middle_carry << 16) + low_carry
  return word_lo, word_hi + a * np.uint32(c_hi)


def flat_index_words(
    indices: Sequence[jax.Array], shape: Sequence[int]
) -> tuple[jax.Array, jax.Array]:
  """Row-major flat index of per-axis ``indices`` into ``shape``, as (low, high) uint32 words.

  ``flat = sum_k indices[k] * prod(shape[k + 1:])``, exact modulo 2**64. Each axis
  must be shorter than 2**32.

  >>> lo, hi = flat_index_words([jnp.array([1], jnp.uint32), jnp.array([3], jnp.uint32)],
  ...                           (5, 2**32 + 7))
  >>> int(hi[0]) * 2**32 + int(lo[0]) == 1 * (2**32 + 7) + 3
  True
  """
  word_lo = word_hi = None
  stride = 1
  for index, size in zip(reversed(indices), reversed(tuple(shape)), strict=True):
    term_lo, term_hi = _mul_words(_uint32(index), stride)
    if word_lo is None:
      word_lo, word_hi = term_lo, term_hi
    else:
      total = word_lo + term_lo
      word_hi = word_hi + term_hi + (total < word_lo).astype(jnp.uint32)
      word_lo = total
    stride = (stride * size) % 2**64
  if word_lo is None:  # a scalar
    return jnp.zeros([], jnp.uint32), jnp.zeros([], jnp.uint32)
  return word_lo, word_hi


def _check_axes(shape: Sequence[int]) -> None:
  if any(size >= _WORD for size in shape):
    raise ValueError(f"random_bits supports axes shorter than 2**32, got shape {tuple(shape)}")


def random_bits(
    seed: Any, step: Any, path_hash: Any, shape: Sequence[int], stream: Any
) -> jax.Array:
  """uint32 random bits of shape ``shape``, one word per element, counter-based.

  ``bits[i] = index_bits(stream_key(seed, step, path_hash, stream), i)`` for the
  row-major global index ``i`` of each element: a few rounds of multiply and
  xor-shift mixing, no state and no ``jax.random`` key. The index comes from
  ``jax.lax.broadcasted_iota`` over the full shape, so under ``jax.jit`` on a
  sharded array each device computes the bits of its own elements and the result
  is the same on one device, on any mesh (Auto or Explicit axes) and on several
  processes. Leaves of 2**32 elements or more take a 64-bit index (two words);
  smaller ones pay for one word only.

  >>> a = random_bits(0, 3, path_hash("['w']"), (2, 3), STREAM_PARAMS)
  >>> a.dtype, bool(jnp.all(a == random_bits(0, 3, path_hash("['w']"), (2, 3), 0)))
  (dtype('uint32'), True)
  >>> bool(jnp.any(a != random_bits(0, 4, path_hash("['w']"), (2, 3), 0)))
  True

  Args:
    seed: a Python int (up to 64 bits) or an integer array.
    step: the applied-step counter; may be traced.
    path_hash: :func:`path_hash` of the leaf's key path.
    shape: the leaf's global shape.
    stream: which array the bits round, e.g. :data:`STREAM_PARAMS`.

  Returns:
    A uint32 array of shape ``shape``.
  """
  shape = tuple(int(size) for size in shape)
  _check_axes(shape)
  key = stream_key(seed, step, path_hash, stream)
  iotas = [jax.lax.broadcasted_iota(jnp.uint32, shape, axis) for axis in range(len(shape))]
  if int(np.prod(shape, dtype=object)) < _WORD:
    # The flat index fits one word: plain wrapping uint32 arithmetic is exact.
    flat = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
      flat = flat + iotas[axis] * np.uint32(stride)
      stride *= shape[axis]
    return index_bits(key, flat, 0)
  index_lo, index_hi = flat_index_words(iotas, shape)
  return index_bits(key, index_lo, index_hi)


def _largest(dtype: DTypeLike, wide: DTypeLike) -> jax.Array:
  return jnp.asarray(jnp.finfo(dtype).max, wide)


def saturate(x: jax.Array, dtype: DTypeLike) -> jax.Array:
  """``x`` clamped to the finite range of ``dtype`` (still in ``x``'s dtype); NaN and Inf pass.

  >>> saturate(jnp.array([1e6, -jnp.inf, 2.0]), jnp.float16).tolist()
  [65504.0, -inf, 2.0]
  """
  largest = _largest(dtype, x.dtype)
  # The select keeps NaN and Inf visible to a non-finite guard (XLA's CPU clamp
  # does not propagate NaN).
  return jnp.where(jnp.isfinite(x), jnp.clip(x, -largest, largest), x)


def _uniform(bits: jax.Array, wide: DTypeLike) -> jax.Array:
  """``bits`` as a uniform number in [0, 1): 24 bits in float32 and 32 bits in float64, exact."""
  if np.dtype(wide).itemsize >= 8:
    return bits.astype(wide) * jnp.asarray(2.0**-32, wide)
  return (bits >> 8).astype(wide) * jnp.asarray(2.0**-24, wide)


def _stochastic_round_generic(x: jax.Array, dtype: DTypeLike, bits: jax.Array) -> jax.Array:
  """Round ``|x|`` toward zero and one ulp up, take the upper with probability ``frac``.

  ``down = |x|`` rounded toward zero in ``dtype``, ``up = nextafter(down, inf)``,
  ``frac = (|x| - down) / (up - down)`` (exact: ``up - down`` is a power of two),
  and the result is ``sign(x) * (up if u >= 1 - frac else down)`` for ``u`` uniform
  from ``bits``: probability ``frac`` exactly whenever ``frac`` is a multiple of
  ``2**-24``, which it is for every float32 ``x``. Used for float16 targets and
  float64 inputs; for float32 to bfloat16 it would need ``|x| - down`` as a float32
  normal, which fails below about 1e-31 (the bit trick has no such limit).
  """
  wide = x.dtype
  magnitude = jnp.abs(saturate(x, dtype))
  nearest = magnitude.astype(dtype)
  down = jnp.where(nearest.astype(wide) > magnitude,
                   jax.lax.nextafter(nearest, jnp.zeros_like(nearest)), nearest)
  up = jax.lax.nextafter(down, jnp.full_like(down, jnp.inf))
  down_wide = down.astype(wide)
  frac = (magnitude - down_wide) / (up.astype(wide) - down_wide)
  # Where down is the largest finite value, frac is 0 / inf = 0: never up to Inf.
  rounded = jnp.where(_uniform(bits, wide) >= 1 - frac, up, down)
  signed = jnp.where(jnp.signbit(x), -rounded, rounded)
  return jnp.where(jnp.isfinite(x), signed, x.astype(dtype))


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
    high = (jax.lax.bitcast_convert_type(x, jnp.uint32) >> 16).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(high, jnp.bfloat16)
  return x.astype(dtype)


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
  :func:`random_bits`). float32 to bfloat16 uses an exact integer trick on the
  float32 pattern; other pairs round through ``nextafter``; both make the same
  choice on the same bits. Values exactly representable in ``dtype`` are
  returned unchanged.

  Finite values saturate at the largest finite value of ``dtype`` (a finite value
  never becomes Inf); NaN and Inf pass through. XLA flushes subnormals to zero
  inside jit on CPU and TPU, so bfloat16 subnormal targets (below about 1.2e-38,
  float32's subnormals too) are out of reach; float16 subnormals are float32
  normals and are rounded like any other value.

  >>> x = jnp.full((4096,), 1.0 + 2.0**-9, jnp.float32)  # a quarter of an ulp above 1.0
  >>> bits = random_bits(0, 0, 0, x.shape, STREAM_PARAMS)
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
  bits = compat.match_sharding(bits, x)
  if dtype == np.dtype(jnp.bfloat16) and x.dtype == np.dtype(jnp.float32):
    return _stochastic_round_bfloat16(x, bits)
  return _stochastic_round_generic(x, dtype, bits)


def _landing_update_wide(param_wide: jax.Array, target_wide: jax.Array, dtype: DTypeLike):
  return on_grid(target_wide - param_wide, dtype)


def _landed_wide(param_wide: jax.Array, update_wide: jax.Array, dtype: DTypeLike):
  return on_grid(param_wide + update_wide, dtype, saturating=False)


def landing_update(param: jax.Array, target: jax.Array) -> jax.Array:
  """The update in ``param.dtype`` that moves ``param`` onto ``target`` under ``apply_updates``.

  ``update = nearest(target - param)`` (computed wide, saturated at the largest
  finite value; bfloat16 shares float32's range, so opposite-sign values so large
  that their difference overflows float32 give Inf).
  ``optax.apply_updates`` computes ``(param + update)`` in the param dtype, which
  equals ``target`` whenever ``target - param`` is representable there; by
  Sterbenz's lemma ``|target - param| <= |param| / 2`` (with ``target`` of the same
  sign) suffices. Otherwise (sign changes, targets near zero, jumps beyond twice
  the param) the param lands within one ulp of the larger of ``|param|`` and
  ``|target|``: see :func:`landed`. Inside jit XLA flushes float32 subnormals, so a
  bfloat16 difference below the smallest normal (about 1.2e-38) becomes 0.

  >>> param = jnp.array([1.0, 3.0], jnp.bfloat16)
  >>> target = jnp.array([1.0078125, 2.984375], jnp.bfloat16)
  >>> bool(jnp.all(optax.apply_updates(param, landing_update(param, target)) == target))
  True
  """
  wide = numerics.compute_dtype(param.dtype)
  update = _landing_update_wide(param.astype(wide), target.astype(wide), param.dtype)
  return exact_cast(update, param.dtype)


def landed(param: jax.Array, update: jax.Array) -> jax.Array:
  """Where ``optax.apply_updates`` puts ``param``: ``(param + update)`` in the param dtype.

  The sum of two bfloat16 (or float16) values is exact in float32 unless they are
  more than 16 binades apart, and then the update is far below half an ulp and
  both roundings give ``param``; so rounding the wide sum once (with
  :func:`on_grid`, which no compiler skips) equals the narrow addition.
  """
  wide = numerics.compute_dtype(param.dtype)
  return exact_cast(_landed_wide(param.astype(wide), update.astype(wide), param.dtype),
                    param.dtype)


def stochastic_write_back(param: jax.Array, exact_update: jax.Array, bits: jax.Array) -> jax.Array:
  """Update that lands ``param`` on ``stochastic_round(param + exact_update)``.

  ``target = stochastic_round(param_wide + exact_update, param.dtype, bits)``, then
  :func:`landing_update`. The wide sum is itself rounded to nearest in float32
  first: a bias below 2**-24 relative, far under the 2**-8 of a bfloat16 ulp.

  Args:
    param: the (narrow) param.
    exact_update: the update in float32 (or float64).
    bits: uint32 random bits of the param's shape (stream :data:`STREAM_PARAMS`).

  Returns:
    The update, in ``param.dtype``.
  """
  wide = numerics.compute_dtype(exact_update.dtype)
  exact = param.astype(wide) + exact_update.astype(wide)
  return landing_update(param, stochastic_round(exact, param.dtype, bits))


def kahan_write_back(
    param: jax.Array, exact_update: jax.Array, compensation: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Compensated write-back: round to nearest and carry what was lost into the next step.

  With ``y = exact_update + compensation`` (wide) and ``exact = param + y``:
  ``target = nearest(exact)`` (saturated), ``update = landing_update(param, target)``
  and ``new_compensation = exact - landed(param, update)``, in the param dtype. The
  compensation holds the true remainder even where the landing misses the target
  (near zero, on a sign change), so nothing is lost but the rounding of the
  compensation itself: a bfloat16 buffer keeps about 8 more bits, so updates below
  about 2**-17 of the param still vanish, and after thousands of equal small
  steps the param can drift by about an ulp from the exact sum.

  >>> param, comp = jnp.array(1.0, jnp.bfloat16), jnp.zeros([], jnp.bfloat16)
  >>> for _ in range(100):
  ...   update, comp = kahan_write_back(param, jnp.array(1e-4), comp)
  ...   param = optax.apply_updates(param, update)
  >>> float(param), round(float(param) + float(comp), 4)  # exact: 1.01
  (1.0078125, 1.0103)

  Args:
    param: the (narrow) param.
    exact_update: the update in float32 (or float64).
    compensation: last step's remainder, in ``param.dtype``.

  Returns:
    ``(update, new_compensation)``, both in ``param.dtype``.
  """
  wide = numerics.compute_dtype(exact_update.dtype)
  dtype = param.dtype
  param_wide = param.astype(wide)
  exact = param_wide + (exact_update.astype(wide) + compensation.astype(wide))
  # Everything stays wide, on the param dtype's grid, until it is stored: one
  # rounding per step of the formula and no conversion pair for a compiler to drop.
  update = _landing_update_wide(param_wide, on_grid(exact, dtype), dtype)
  remainder = exact - _landed_wide(param_wide, update, dtype)
  return exact_cast(update, dtype), round_to_nearest(remainder, dtype)


def store(
    x: jax.Array, dtype: DTypeLike, mode: str = "nearest", bits: jax.Array | None = None
) -> jax.Array:
  """Write a wide value into (low-precision) state: ``x`` cast to ``dtype``.

  Round to nearest, or with :func:`stochastic_round` when ``mode == "stochastic"``
  and ``dtype`` is narrower than ``x`` (bits from the momentum or statistics
  stream), so that a bfloat16 moving average keeps moving in expectation.
  """
  dtype = np.dtype(dtype)
  if mode == "stochastic" and needs_rounding(dtype, x.dtype):
    if bits is None:
      raise ValueError("stochastic rounding needs random bits")
    return stochastic_round(x, dtype, bits)
  return x.astype(dtype)


class ParamRoundingState(NamedTuple):
  """State of :func:`with_param_rounding`.

  Attributes:
    inner_state: the wrapped transformation's state (built from float32 params).
    count: applied steps (int32); with the seed and the leaf path it picks the bits.
    compensation: ``"kahan"`` only (else ``None``): per narrow param, what rounding
      lost, in the param dtype and placed like the param; ``None`` for other leaves.
  """

  inner_state: Any
  count: jax.Array
  compensation: Any


def _dtype(x: Any) -> np.dtype:
  return np.dtype(x.dtype) if hasattr(x, "dtype") else np.dtype(jnp.asarray(x).dtype)


def _is_narrow(x: Any) -> bool:
  dtype = _dtype(x)
  return needs_rounding(dtype, numerics.compute_dtype(dtype))


def _widen(tree: Any) -> Any:
  """float32 copies of the narrow leaves; every other leaf as it is."""
  return jax.tree.map(
      lambda x: x.astype(numerics.compute_dtype(_dtype(x))) if _is_narrow(x) else x, tree
  )


def _is_none(x: Any) -> bool:
  return x is None


def with_param_rounding(
    inner: optax.GradientTransformation, mode: str = "stochastic", seed: int = 0
) -> optax.GradientTransformationExtraArgs:
  """Any optax transformation, with updates that land bfloat16/float16 params precisely.

  ``inner`` sees float32 copies of the gradients and params (so its own state is
  float32) and its float32 update ``u`` is written back so that
  ``optax.apply_updates(params, updates)`` lands on the rounded value of
  ``param + u`` (exactly whenever the difference is representable in the param
  dtype, which holds for updates up to half the param):

  * ``"nearest"``: the update is cast to the gradient dtype, as optax does; small
    updates to narrow params vanish. ``params`` are optional.
  * ``"stochastic"``: rounded up with probability equal to the fraction of the ulp
    (unbiased), bits from ``(seed, applied step, leaf path, global element
    index)``: the same on one device, any mesh and any number of processes.
  * ``"kahan"``: rounded to nearest, with a compensation buffer per narrow param
    (2 bytes per bfloat16 param) carrying what rounding lost. The buffer is made
    with ``jnp.zeros_like(param)``: placed like its param by an eager ``init`` and
    under ``jax.jit`` with Explicit mesh axes; with Auto axes a jitted ``init``
    needs ``out_shardings`` (the first jitted update places it like the param).

  float32 and float64 params are untouched by every mode: their updates are
  ``inner``'s, bit for bit. Updates are in the gradient dtype for them and in the
  param dtype for narrow params.

  Nothing after this transformation in a chain may change a non-zero update (no
  scaling, clipping or weight decay after it): the update is only right as given.
  :func:`optax_safefactor.skip_nonfinite` may wrap it, since a skip zeroes the
  updates and restores the whole state, the rounding state included, so a skipped
  step consumes no bits and leaves the compensation alone.

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
    A :class:`optax.GradientTransformationExtraArgs`. Its state is a named tuple of
    ``inner_state`` (``inner``'s state, built from float32 copies of the params),
    ``count`` (the applied steps, int32: with the seed and the leaf path it picks the
    random bits) and ``compensation`` (``"kahan"`` only, else ``None``: per narrow
    param, what rounding lost, in the param dtype; ``None`` for other leaves).

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
  mode = check_rounding_mode(mode, "mode")
  check_seed("seed", seed)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    # Any dtype: inner decides about integer leaves; the rounding skips them.
    checks.check_init_params(params, any_dtype=True)
    compensation = None
    if mode == "kahan":
      # zeros_like keeps a concrete param's sharding (and an Explicit-axes tracer's).
      compensation = jax.tree.map(lambda p: jnp.zeros_like(p) if _is_narrow(p) else None, params)
    return ParamRoundingState(
        inner_state=inner.init(_widen(params)),
        count=jnp.zeros([], jnp.int32),
        compensation=compensation,
    )

  def update_fn(updates, state, params=None, **extra_args):
    checks.check_state_type(state, ParamRoundingState, updates, "with_param_rounding")
    if mode != "nearest" and params is None:
      raise ValueError(
          f"with_param_rounding(mode={mode!r}) needs params: call update(grads, state, params)"
      )
    # Any dtype: float32 grads for bfloat16 params are fine (the update takes the
    # param's dtype); shapes and structure must agree, leaf by leaf.
    checks.check_update_inputs(updates, params, any_dtype=True)
    inner_updates, inner_state = inner.update(
        _widen(updates), state.inner_state, None if params is None else _widen(params),
        **extra_args,
    )
    if mode == "nearest":
      new_updates = jax.tree.map(lambda u, g: u.astype(_dtype(g)), inner_updates, updates)
      return new_updates, state._replace(inner_state=inner_state,
                                         count=optax.safe_increment(state.count))

    flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_updates, updates_def = jax.tree.flatten(inner_updates)
    flat_grads = jax.tree.leaves(updates)
    if not len(flat_params) == len(flat_updates) == len(flat_grads):
      raise ValueError(
          f"grads ({len(flat_grads)} leaves), params ({len(flat_params)}) and the inner "
          f"updates ({len(flat_updates)}) must have the same leaves"
      )
    if mode == "kahan":
      flat_compensation = jax.tree.leaves(state.compensation, is_leaf=_is_none)
    else:
      flat_compensation = [None] * len(flat_params)

    new_updates, new_compensation = [], []
    for (path, param), update, grad, compensation in zip(
        flat_params, flat_updates, flat_grads, flat_compensation, strict=True
    ):
      if not _is_narrow(param):
        new_updates.append(update.astype(_dtype(grad)))
        new_compensation.append(compensation)
      elif mode == "stochastic":
        bits = random_bits(seed, state.count, path_hash(path), param.shape, STREAM_PARAMS)
        new_updates.append(stochastic_write_back(param, update, bits))
      else:
        update, compensation = kahan_write_back(param, update, compensation)
        new_updates.append(update)
        new_compensation.append(compensation)

    if mode == "kahan":
      compensation = jax.tree.unflatten(
          jax.tree.structure(state.compensation, is_leaf=_is_none), new_compensation
      )
    else:
      compensation = state.compensation
    return jax.tree.unflatten(updates_def, new_updates), ParamRoundingState(
        inner_state=inner_state,
        count=optax.safe_increment(state.count),
        compensation=compensation,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
