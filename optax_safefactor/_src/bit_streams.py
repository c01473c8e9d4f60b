"""Counter-based random bits: one word per element, the same on any device, mesh or process.

The bits of an element are a hash of ``(seed, step, leaf path, stream, global element
index)``: a few rounds of multiply and xor-shift mixing on uint32, no state and no
``jax.random`` key. Under ``jax.jit`` on a sharded array each device computes the bits
of its own elements from their global indices, so one device, any mesh (Auto or
Explicit axes) and several processes draw the same bits.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

KeyPath = tuple[Any, ...]

# Streams keep the bits of different arrays of one leaf independent of each other.
STREAM_PARAMS = 0
STREAM_MOMENTUM = 1
STREAM_STATISTICS = 2
STREAM_COLUMN_STATISTICS = 3

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


def absorb(key: jax.Array, value: jax.Array) -> jax.Array:
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
    key = absorb(key, _uint32(value))
  return key


def index_bits(key: jax.Array, index_lo: jax.Array, index_hi: jax.Array | int = 0) -> jax.Array:
  """Random uint32 bits of the element with flat index ``index_hi * 2**32 + index_lo``.

  ``bits = mix32(absorb(key, index_hi) ^ index_lo)``. For a fixed key the map from
  the 64-bit index to ``bits`` is a bijection on each ``index_hi`` word and
  ``absorb`` gives distinct words distinct row keys, so elements 2**32 apart
  get different bits. A scalar ``index_hi`` (0 for leaves under 2**32 elements)
  costs nothing per element.
  """
  row_key = absorb(key, _uint32(index_hi))
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
  return bits_from_key(stream_key(seed, step, path_hash, stream), shape)


def bits_from_key(key: jax.Array, shape: Sequence[int]) -> jax.Array:
  """:func:`random_bits` of ``shape`` from a :func:`stream_key` computed beforehand.

  >>> key = stream_key(0, 3, path_hash("['w']"), STREAM_PARAMS)
  >>> bool(jnp.all(bits_from_key(key, (2, 3))
  ...              == random_bits(0, 3, path_hash("['w']"), (2, 3), STREAM_PARAMS)))
  True
  """
  shape = tuple(int(size) for size in shape)
  _check_axes(shape)
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




def row_bits(seed: Any, step: Any, path_hashes: np.ndarray, shape: Sequence[int],
             stream: Any) -> jax.Array:
  """:func:`random_bits` of several flattened leaves stacked as the rows of ``shape``.

  Row ``k`` holds the bits of a leaf with path hash ``path_hashes[k]`` and as many
  elements as a row, indexed by their position in the row: the leaf's row-major flat
  index. So a leaf's bits are the same whether it is stepped alone or packed with others
  (``_src/packing.py``).

  >>> hashes = np.array([path_hash("['a']"), path_hash("['b']")], np.uint32)
  >>> rows = row_bits(0, 3, hashes, (2, 6), STREAM_PARAMS)
  >>> alone = random_bits(0, 3, path_hash("['b']"), (2, 3), STREAM_PARAMS)
  >>> bool(jnp.all(rows[1] == alone.reshape(-1)))
  True
  """
  return row_bits_from_keys(stream_key(seed, step, np.asarray(path_hashes, np.uint32), stream),
                            shape)


def row_bits_from_keys(keys: jax.Array, shape: Sequence[int]) -> jax.Array:
  """:func:`row_bits` of ``shape`` from the rows' :func:`stream_key` vector computed beforehand."""
  shape = tuple(int(size) for size in shape)
  if len(shape) != 2 or keys.shape != shape[:1]:
    raise ValueError(f"row bits need one path hash per row of a 2-D shape (a key each), got "
                     f"{keys.size} for shape {shape}")
  _check_axes(shape)
  return index_bits(keys[:, None], jax.lax.broadcasted_iota(jnp.uint32, shape, 1), 0)
