"""Write-back of low-precision params: stochastic rounding, Kahan compensation, landing.

Cost, measured with the script below on a 50M-element bfloat16 tree (see the
module docstring of ``optax_safefactor/_src/write_back.py`` for the formulas)::

  python -c "import tests.test_rounding as t; t.measure_write_back()"
"""

from __future__ import annotations

import functools
import itertools
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf
from optax_safefactor._src import bit_streams, rounding, write_back
from optax_safefactor._src.bit_streams import (
  STREAM_MOMENTUM,
  STREAM_PARAMS,
  STREAM_STATISTICS,
  flat_index_words,
  index_bits,
  path_hash,
  random_bits,
  stream_key,
)
from optax_safefactor._src.param_rounding import ParamRoundingState, with_param_rounding
from optax_safefactor._src.rounding import needs_rounding, round_to_nearest, stochastic_round
from optax_safefactor._src.write_back import (
  Rounding,
  check_rounding_mode,
  kahan_write_back,
  landed,
  landing_update,
  stochastic_write_back,
  store,
)
from tests.helpers import (
  assert_trees_bitwise_equal,
  mean_of_last_losses,
  run_steps,
  seed_for,
  tanh_mlp_regression,
)

NARROW = [jnp.bfloat16, jnp.float16]


def _f64(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _ulp(x, dtype) -> np.ndarray:
  """Spacing of ``dtype`` at ``|x|`` (normal range)."""
  x = np.maximum(np.abs(np.asarray(x, np.float64)), float(jnp.finfo(dtype).tiny))
  return 2.0 ** (np.floor(np.log2(x)) - jnp.finfo(dtype).nmant)


def _bits_of(x) -> np.ndarray:
  x = jnp.asarray(x)
  return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16 if x.dtype.itemsize == 2 else
                                                 jnp.uint32))


# --- modes and dtypes ------------------------------------------------------------------


def test_modes_are_checked():
  modes = write_back.ROUNDING_MODES
  assert [check_rounding_mode(m) for m in modes] == list(modes)
  for bad in ("Nearest", "sr", None, 1):
    with pytest.raises(ValueError, match="'nearest', 'stochastic' or 'kahan'"):
      check_rounding_mode(bad)
  with pytest.raises(ValueError, match=r"^mode must be"):
    with_param_rounding(optax.sgd(0.1), "round")


def test_only_narrow_params_need_rounding():
  assert needs_rounding(jnp.bfloat16, jnp.float32) and needs_rounding(jnp.float16, jnp.float32)
  assert needs_rounding(jnp.bfloat16, jnp.float64)
  for dtype in (jnp.float32, jnp.float64):
    assert not needs_rounding(dtype, jnp.float32) and not needs_rounding(dtype, jnp.float64)
  assert not needs_rounding(jnp.bfloat16, jnp.bfloat16)


# --- random bits -----------------------------------------------------------------------


def test_path_hash_is_a_crc_of_the_key_string():
  path = (jax.tree_util.DictKey("layer"), jax.tree_util.GetAttrKey("kernel"))
  assert path_hash(path) == zlib.crc32(b"['layer'].kernel") == path_hash("['layer'].kernel")
  assert path_hash("['a']") != path_hash("['b']")
  assert 0 <= path_hash(path) < 2**32


def test_bits_are_deterministic_and_depend_on_every_input():
  shape = (33, 65)
  base = dict(seed=0, step=5, path_hash=path_hash("['w']"), shape=shape, stream=STREAM_PARAMS)
  bits = np.asarray(random_bits(**base))
  assert bits.dtype == np.uint32 and bits.shape == shape
  np.testing.assert_array_equal(bits, np.asarray(random_bits(**base)))
  # A traced step gives the same bits as a Python int.
  jitted = jax.jit(lambda step: random_bits(0, step, base["path_hash"], shape, STREAM_PARAMS))
  np.testing.assert_array_equal(bits, np.asarray(jitted(jnp.int32(5))))
  changes = dict(seed=[1, 2**40, -1], step=[4, 6, 2**31 - 1], path_hash=[path_hash("['v']")],
                 stream=[STREAM_MOMENTUM, STREAM_STATISTICS])
  for name, values in changes.items():
    for value in values:
      other = np.asarray(random_bits(**{**base, name: value}))
      assert np.mean(other == bits) < 0.01, (name, value)
  assert len(np.unique(bits)) > 0.99 * bits.size


def test_bits_are_uniform_and_neighbours_uncorrelated():
  bits = np.stack([np.asarray(random_bits(3, step, 0, (1 << 16,), 0)) for step in range(16)])
  uniform = (bits >> 8).astype(np.float64) * 2.0**-24 - 0.5
  n = uniform.size
  assert abs(uniform.mean()) < 5 * np.sqrt(1 / 12 / n)
  for lagged in (uniform[:, 1:] * uniform[:, :-1], uniform[1:] * uniform[:-1]):
    assert abs(lagged.mean() * 12) < 5 / np.sqrt(lagged.size)
  # Every one of the 32 bits is fair.
  ones = np.array([np.mean((bits >> k) & 1) for k in range(32)])
  assert np.all(np.abs(ones - 0.5) < 5 * 0.5 / np.sqrt(n)), ones


def test_flat_index_words_are_exact_beyond_two_to_the_32():
  shape = (3, 2**31 + 5, 7)
  rng = np.random.default_rng(0)
  coords = [rng.integers(0, size, 64, dtype=np.uint64) for size in shape]
  coords[1][:3] = [0, 2**31 + 4, 2**31]
  lo, hi = flat_index_words([jnp.asarray(c.astype(np.uint32)) for c in coords], shape)
  want = [int(a) * shape[1] * shape[2] + int(b) * shape[2] + int(c)
          for a, b, c in zip(*coords, strict=True)]
  got = [int(h) * 2**32 + int(w) for h, w in zip(np.asarray(hi), np.asarray(lo), strict=True)]
  assert got == want
  assert max(want) > 2**33


def test_wide_product_is_exact():
  rng = np.random.default_rng(1)
  values = rng.integers(0, 2**32, 1000, dtype=np.uint64)
  for constant in (1, 7, 2**32 - 1, 2**32 + 7, 3 * 2**40 + 12345, 2**64 - 1):
    lo, hi = bit_streams._mul_words(jnp.asarray(values.astype(np.uint32)), constant)
    got = [int(h) * 2**32 + int(w) for h, w in zip(np.asarray(hi), np.asarray(lo), strict=True)]
    assert got == [int(v) * constant % 2**64 for v in values]


def test_indices_beyond_two_to_the_32_get_their_own_bits():
  key = stream_key(0, 1, 2, STREAM_PARAMS)
  lo = jnp.arange(4096, dtype=jnp.uint32)
  rows = [np.asarray(index_bits(key, lo, jnp.full_like(lo, hi))) for hi in (0, 1, 2, 2**31)]
  for row in rows[1:]:
    assert not np.any(row == rows[0])  # guaranteed: a bijection per row, distinct row keys
  assert len(np.unique(np.concatenate(rows))) > 0.999 * 4 * 4096
  # A scalar high word is the same as a broadcast one.
  np.testing.assert_array_equal(np.asarray(index_bits(key, lo, 1)), rows[1])


def test_one_word_and_two_word_indices_agree():
  shape = (5, 6, 7)
  iotas = [jax.lax.broadcasted_iota(jnp.uint32, shape, axis) for axis in range(3)]
  key = stream_key(9, 4, 3, STREAM_MOMENTUM)
  two_words = index_bits(key, *flat_index_words(iotas, shape))
  np.testing.assert_array_equal(np.asarray(two_words),
                                np.asarray(random_bits(9, 4, 3, shape, STREAM_MOMENTUM)))
  np.testing.assert_array_equal(
      np.asarray(random_bits(9, 4, 3, shape, 1)).ravel(),
      np.asarray(random_bits(9, 4, 3, (5 * 6 * 7,), 1)))  # row-major global index
  assert random_bits(0, 0, 0, (), 0).shape == ()
  with pytest.raises(ValueError, match="2\\*\\*32"):
    random_bits(0, 0, 0, (2**32, 1), 0)


def _mesh(axis_type):
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type, axis_type))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_bits_are_the_same_on_a_mesh(axis_type):
  shape = (16, 24)
  expected = np.asarray(random_bits(7, 3, 11, shape, STREAM_PARAMS))
  mesh = _mesh(axis_type)
  sharding = NamedSharding(mesh, P("data", "model"))
  with jax.set_mesh(mesh):
    placed = jax.jit(lambda step: random_bits(7, step, 11, shape, STREAM_PARAMS),
                     out_shardings=sharding)(jnp.int32(3))
    zeros = jax.device_put(jnp.zeros(shape, jnp.uint32), sharding)
    followed = jax.jit(lambda z, step: z ^ random_bits(7, step, 11, z.shape, 0))(zeros, 3)
  for bits in (placed, followed):
    assert bits.sharding.is_equivalent_to(sharding, 2)
    np.testing.assert_array_equal(np.asarray(bits), expected)
    for shard in bits.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])


# --- stochastic rounding ---------------------------------------------------------------


def _every_top_half(size: int = 1 << 16) -> jax.Array:
  """Bits whose top 16 take every value once: averages over them are exact expectations."""
  return jnp.arange(size, dtype=jnp.uint32) << 16


@pytest.mark.parametrize("dtype", NARROW)
def test_rounding_up_has_exactly_the_probability_of_the_ulp_fraction(dtype, rng):
  bits = _every_top_half()
  nmant = jnp.finfo(dtype).nmant
  extra = 23 - nmant  # float32 bits below the dtype's last one
  for _ in range(20):
    down = np.float32(rng.choice([-1, 1]) * rng.uniform(0.5, 2.0)
                      * 2.0 ** rng.integers(-10, 10)).astype(dtype)
    ulp = _ulp(_f64(down), dtype)
    k = int(rng.integers(0, 2**extra))
    # |x| lies k / 2**extra of an ulp beyond |down| (away from zero).
    x = np.float32(_f64(down) + np.sign(_f64(down)) * k * 2.0**-extra * ulp)
    rounded = _f64(jax.jit(stochastic_round, static_argnums=1)(
        jnp.full(bits.shape, x), dtype, bits))
    magnitudes = np.abs(rounded)
    assert set(np.unique(magnitudes)) <= {abs(float(_f64(down))), abs(float(_f64(down))) + ulp}
    # The 2**16 bit patterns round away from zero exactly k / 2**extra of the time.
    assert np.sum(magnitudes > abs(float(_f64(down)))) == k * 2 ** (16 - extra)
    np.testing.assert_equal(np.mean(rounded), float(x))  # unbiased, exactly


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_float64_values_round_up_with_exactly_the_probability_of_the_ulp_fraction(dtype, rng,
                                                                                 x64):
  # float64 params keep float32 (or narrower) statistics and momentum by name: their
  # rounding takes the generic path, with a uniform made of all 32 bits.
  bits = _every_top_half()
  for _ in range(10):
    down = np.float64(np.asarray(rng.uniform(0.5, 2.0) * 2.0 ** rng.integers(-10, 10),
                                 dtype))
    ulp = float(_ulp(down, dtype))
    k = int(rng.integers(1, 2**16))
    x = down + k * 2.0**-16 * ulp  # exact in float64: 24 + 16 bits of mantissa at most
    rounded = _f64(jax.jit(stochastic_round, static_argnums=1)(
        jnp.full(bits.shape, x, jnp.float64), dtype, bits))
    assert set(np.unique(rounded)) <= {down, down + ulp}, (x, np.unique(rounded))
    # u = j / 2**16 over every j: up exactly when u >= 1 - k / 2**16, k of the 2**16 times.
    assert np.sum(rounded > down) == k


def test_on_grid_rounds_inside_jit_and_leaves_a_wide_enough_dtype_alone(rng):
  # XLA may drop a float32 -> bfloat16 -> float32 pair of conversions inside a jit: the
  # grid must come from the bit pattern there.
  x = jnp.asarray(rng.normal(size=4096) * 10.0 ** rng.uniform(-30, 30, 4096), jnp.float32)
  expected = np.asarray(x).astype(jnp.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(jax.jit(rounding.on_grid, static_argnums=1)(x, jnp.bfloat16),
                                expected)
  np.testing.assert_array_equal(rounding.on_grid(x, jnp.float32), x)


def test_rounding_probability_with_hashed_bits_is_statistically_exact():
  n = 1 << 20
  for fraction in (2**-16, 0.001, 0.3, 0.5, 0.97):
    k = round(fraction * 2**16)
    x = jnp.full((n,), np.float32(1.0 + k * 2.0**-23), jnp.float32)
    up = np.mean([float(jnp.mean(stochastic_round(x, jnp.bfloat16,
                                                  random_bits(0, s, 0, (n,), 0)) != 1.0))
                  for s in range(4)])
    p = k / 2**16
    assert abs(up - p) < 5 * np.sqrt(p * (1 - p) / (4 * n)) + 1e-12, (fraction, up, p)


def test_bfloat16_bit_trick_equals_the_generic_method(rng):
  n = 100_000
  x = np.concatenate([
      rng.normal(size=n) * 10.0 ** rng.uniform(-25, 37, n),
      [0.0, -0.0, 3.3895314e38, -3.3895314e38, 3.39e38, -3.4e38, 1.0, 2.0**-100],
  ]).astype(np.float32)
  x = jnp.asarray(x)
  for step in range(3):
    bits = random_bits(1, step, 0, x.shape, 0)
    trick = jax.jit(rounding._stochastic_round_bfloat16)(x, bits)
    generic = jax.jit(rounding._stochastic_round_generic, static_argnums=1)(x, jnp.bfloat16, bits)
    np.testing.assert_array_equal(_bits_of(trick), _bits_of(generic))


@pytest.mark.parametrize("dtype", NARROW)
def test_stochastic_round_saturates_and_passes_non_finite(dtype):
  largest = float(jnp.finfo(dtype).max)
  # The float32 just above the largest value: with every bit set, a carry would make it Inf.
  just_above = float(np.nextafter(np.float32(largest), np.float32(np.inf)))
  x = jnp.array([largest, -largest, 3.4e38, -3.4e38, largest * 1.001, just_above, jnp.inf,
                 -jnp.inf, jnp.nan, 0.0, -0.0], jnp.float32)
  for bits in (jnp.zeros(x.shape, jnp.uint32), jnp.full(x.shape, 2**32 - 1, jnp.uint32)):
    got = _f64(jax.jit(stochastic_round, static_argnums=1)(x, dtype, bits))
    np.testing.assert_array_equal(got[:6], [largest, -largest, largest, -largest, largest,
                                            largest])
    np.testing.assert_array_equal(got[6:8], [np.inf, -np.inf])
    assert np.isnan(got[8])
    np.testing.assert_array_equal(np.signbit(got[9:]), [False, True])
  # A NaN whose payload lies only in the dropped bits stays NaN.
  nan = jax.lax.bitcast_convert_type(jnp.array([0x7F800001, 0xFF80FFFF], jnp.uint32), jnp.float32)
  assert np.all(np.isnan(_f64(stochastic_round(nan, dtype, jnp.full((2,), 2**32 - 1,
                                                                      jnp.uint32)))))


def test_exact_values_are_unchanged(rng):
  for dtype in NARROW:
    x = jnp.asarray(rng.normal(size=4096), dtype).astype(jnp.float32)
    bits = random_bits(0, 0, 0, x.shape, 0)
    rounded = jax.jit(stochastic_round, static_argnums=1)(x, dtype, bits)
    np.testing.assert_array_equal(_bits_of(rounded),
                                  _bits_of(x.astype(dtype)))


def test_float16_subnormal_targets_are_rounded_without_bias():
  bits = _every_top_half()
  smallest = 2.0**-24  # float16's smallest subnormal: a normal float32
  for x in (0.25 * smallest, 2.5 * smallest, -7.75 * smallest):
    rounded = _f64(jax.jit(stochastic_round, static_argnums=1)(
        jnp.full(bits.shape, x, jnp.float32), jnp.float16, bits))
    np.testing.assert_equal(np.mean(rounded), x)


def test_bfloat16_targets_just_above_the_smallest_normal_keep_their_probability():
  # The bit trick rounds on the float32 pattern and needs no float32 difference below the
  # value: rounded by the generic method, |x| - down is a float32 subnormal there (a
  # fraction of a bfloat16 ulp of 2**-133), flushed inside jit, and every draw went down.
  bits = _every_top_half()
  for x in (2.0**-126 + 0.25 * 2.0**-133, -(2.0**-120 + 0.75 * 2.0**-127)):
    rounded = _f64(jax.jit(stochastic_round, static_argnums=1)(
        jnp.full(bits.shape, x, jnp.float32), jnp.bfloat16, bits))
    np.testing.assert_equal(np.mean(rounded), x)


def test_bfloat16_subnormal_targets_are_flushed_inside_jit():
  # XLA flushes float32 subnormals inside jit on CPU: a param at zero cannot reach a
  # bfloat16 subnormal, but the result is zero (never garbage or non-finite).
  param = jnp.zeros(8, jnp.bfloat16)
  exact = jnp.full(8, 3e-39, jnp.float32)
  update = jax.jit(stochastic_write_back)(param, exact, _every_top_half(8) * 8192)
  assert np.all(_f64(update) == 0.0)


def test_store_rounds_state_only_when_asked():
  x = jnp.full((1 << 16,), 1.0 + 2.0**-10, jnp.float32)  # an eighth of a bfloat16 ulp
  stochastic = Rounding(True, 0, jnp.int32(0), 0)
  kahan = Rounding(False, 0, jnp.int32(0), 0)

  def stored(dtype, how, values=(x,), streams=(STREAM_MOMENTUM,)):
    return store(values, dtype, how, streams)

  np.testing.assert_array_equal(_f64(stored(jnp.bfloat16, None)[0]), 1.0)
  np.testing.assert_array_equal(_f64(stored(jnp.bfloat16, kahan)[0]), 1.0)
  mean = np.mean(_f64(stored(jnp.bfloat16, stochastic)[0]))
  assert abs(mean - (1.0 + 2.0**-10)) < 2.0**-14  # unbiased, within noise
  assert stored(jnp.float32, stochastic)[0] is x
  # Two arrays stored together draw from their own streams: independent bits.
  rows, cols = stored(jnp.bfloat16, stochastic, (x, x), (STREAM_STATISTICS, STREAM_MOMENTUM))
  assert 0.2 < np.mean(_f64(rows) != _f64(cols)) < 0.3  # 2 p (1 - p), p = 1/8


# --- landing ---------------------------------------------------------------------------


def _narrow_values(dtype, lo, hi):
  finfo = jnp.finfo(dtype)
  # An ulp of a bfloat16 param below 2**8 times the smallest normal is a float32
  # subnormal, flushed inside jit; float16's are float32 normals.
  smallest = float(finfo.tiny) * (2.0 ** (finfo.nmant + 1) if dtype == jnp.bfloat16 else 1.0)
  return st.floats(min_value=lo, max_value=hi).map(
      lambda v: float(np.float32(v).astype(dtype))
  ).filter(lambda v: smallest <= abs(v) <= float(finfo.max) / 2)


@pytest.mark.parametrize("dtype", NARROW)
@given(data=st.data())
def test_landing_is_exact_for_updates_up_to_half_the_param(dtype, data):
  limit = float(jnp.finfo(dtype).max) / 4
  params = data.draw(st.lists(_narrow_values(dtype, -limit, limit), min_size=32, max_size=32))
  fractions = data.draw(st.lists(st.floats(-0.5, 0.5), min_size=32, max_size=32))
  param = jnp.asarray(params, jnp.float32).astype(dtype)
  target = (param.astype(jnp.float32) * (1 + jnp.asarray(fractions, jnp.float32))).astype(dtype)
  keep = np.abs(_f64(target) - _f64(param)) <= np.abs(_f64(param)) / 2
  update = jax.jit(landing_update)(param, target)
  assert update.dtype == param.dtype
  np.testing.assert_array_equal(_f64(optax.apply_updates(param, update))[keep],
                                _f64(target)[keep])
  np.testing.assert_array_equal(_f64(landed(param, update)), _f64(optax.apply_updates(param,
                                                                                     update)))


@pytest.mark.parametrize("dtype", NARROW)
def test_landing_is_within_one_ulp_otherwise(dtype, rng):
  n = 200_000
  span = 4 if dtype == jnp.float16 else 30
  param, target = (jnp.asarray(rng.normal(size=n) * 10.0 ** rng.uniform(-span, span, n),
                               jnp.float32).astype(dtype) for _ in range(2))
  update = jax.jit(landing_update)(param, target)
  arrived = optax.apply_updates(param, update)
  np.testing.assert_array_equal(_bits_of(landed(param, update)), _bits_of(arrived))
  larger = np.maximum(np.abs(_f64(param)), np.abs(_f64(target)))
  error = np.abs(_f64(arrived) - _f64(target)) / _ulp(larger, dtype)
  assert np.all(np.isfinite(_f64(arrived))) and np.max(error) <= 1.0
  assert np.mean(error == 0) > 0.45  # every same-sign pair within a factor of 2, and more


@pytest.mark.parametrize("dtype", NARROW)
def test_landing_saturates(dtype):
  largest = float(jnp.finfo(dtype).max)
  # |target - param| above the largest value, but within float32's range: bfloat16
  # shares float32's, so a difference beyond it is Inf in float32 already.
  below = 2.0**119 if dtype == jnp.bfloat16 else largest / 2
  param = jnp.array([-below, below, largest, 0.0], dtype)
  target = jnp.array([largest, -largest, largest, -largest], dtype)
  update = landing_update(param, target)
  arrived = _f64(optax.apply_updates(param, update))
  assert np.all(np.isfinite(_f64(update))) and np.all(np.isfinite(arrived))
  np.testing.assert_array_equal(arrived[2:], [largest, -largest])


def test_round_to_nearest_equals_the_conversion(rng):
  x = jnp.asarray(np.concatenate([
      rng.normal(size=100_000) * 10.0 ** rng.uniform(-30, 37, 100_000),
      [np.inf, -np.inf, 3.3895e38, 3.3963e38, -3.4e38, 0.0, -0.0, 1.0 + 2.0**-8]]), jnp.float32)
  for dtype in NARROW:
    got = jax.jit(round_to_nearest, static_argnums=1, static_argnames="saturating")
    np.testing.assert_array_equal(_bits_of(got(x, dtype, saturating=False)),
                                  _bits_of(jax.jit(lambda x, d=dtype: x.astype(d))(x)))
    saturated = _f64(got(x, dtype))
    assert np.all(np.isfinite(saturated[np.isfinite(_f64(x))]))
  nan = jnp.array([jnp.nan], jnp.float32)
  assert np.isnan(_f64(round_to_nearest(nan, jnp.bfloat16)))
  # A wider dtype is a conversion too: every narrow value is on float32's grid.
  for dtype in NARROW:
    narrow = x.astype(dtype)
    widened = round_to_nearest(narrow, jnp.float32)
    assert widened.dtype == jnp.float32
    np.testing.assert_array_equal(_f64(widened), _f64(narrow))


# --- many small updates on one value ---------------------------------------------------


@functools.partial(jax.jit, static_argnames="copies")
def _drift(start, relative, seed, copies=4096):
  """2,000 updates of ``relative * start`` to a bfloat16 value, four ways.

  float32, bfloat16 with round to nearest, ``copies`` bfloat16 copies with
  stochastic rounding (independent bits per copy) and bfloat16 with Kahan.
  """
  update = start * relative

  def step(count, carry):
    wide, nearest, stochastic, kahan, compensation = carry
    bits = random_bits(seed, count, 0, stochastic.shape, STREAM_PARAMS)
    stochastic = optax.apply_updates(
        stochastic, stochastic_write_back(stochastic, jnp.broadcast_to(update, stochastic.shape),
                                          bits))
    kahan_update, compensation = kahan_write_back(kahan, update, compensation)
    return (wide + update, optax.apply_updates(nearest, update.astype(jnp.bfloat16)),
            stochastic, optax.apply_updates(kahan, kahan_update), compensation)

  narrow = start.astype(jnp.bfloat16)
  carry = (start, narrow, jnp.full((copies,), narrow), narrow, jnp.zeros_like(narrow))
  return jax.lax.fori_loop(0, 2000, step, carry)


@pytest.mark.parametrize("start, relative", [
    (1.0, 1e-4), (1.3, 1e-4), (0.7, 3e-4), (-2.5, 1e-4), (3.140625, -1e-4), (0.01, 3e-4),
    (1.0, 1e-3)])
def test_many_small_updates(start, relative):
  start = float(jnp.asarray(start, jnp.bfloat16).astype(jnp.float32))
  wide, nearest, stochastic, kahan, compensation = _drift(
      jnp.float32(start), jnp.float32(relative), 0)
  exact = start + 2000 * float(np.float32(start) * np.float32(relative))
  ulp = float(_ulp(max(abs(start), abs(exact)), jnp.bfloat16))
  assert abs(float(wide) - exact) < 0.05 * ulp  # float32 params: the reference
  assert float(_f64(nearest)) == start  # below half an ulp: round to nearest stalls
  samples = _f64(stochastic)
  standard_error = samples.std() / np.sqrt(samples.size)
  assert abs(samples.mean() - exact) < 4 * standard_error + 1e-9
  # The bfloat16 compensation rounds too: about an ulp after 2,000 steps (see below).
  assert abs(float(_f64(kahan)) - exact) <= 1.5 * ulp
  assert abs(float(_f64(kahan)) + float(_f64(compensation)) - exact) <= 1.25 * ulp


def test_kahan_error_over_many_step_sizes(rng):
  n = 256
  starts = (rng.choice([-1, 1], n) * 10.0 ** rng.uniform(-3, 3, n)).astype(np.float32)
  starts = _f64(jnp.asarray(starts).astype(jnp.bfloat16)).astype(np.float32)
  relatives = (rng.choice([-1, 1], n) * 10.0 ** rng.uniform(-5, -3, n)).astype(np.float32)
  drift = jax.vmap(functools.partial(_drift, seed=0, copies=1))
  _, _, _, kahan, compensation = drift(jnp.asarray(starts), jnp.asarray(relatives))
  exact = starts + 2000 * (starts * relatives).astype(np.float64)
  ulp = _ulp(np.maximum(np.abs(starts), np.abs(exact)), jnp.bfloat16)
  error = np.abs(_f64(kahan) - exact) / ulp
  assert np.mean(error) < 0.5 and np.max(error) < 1.5, (np.mean(error), np.max(error))
  remaining = np.abs(_f64(kahan) + _f64(compensation) - exact) / ulp
  assert np.quantile(remaining, 0.95) < 1.0 and np.max(remaining) < 1.25


# --- Kahan -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NARROW)
def test_compensation_holds_the_true_remainder_on_sign_changes_and_near_zero(dtype, rng):
  n = 4096
  param = jnp.asarray(rng.normal(size=n), jnp.float32).astype(dtype)
  # Cross zero, land near zero, or jump far beyond the param.
  exact_update = jnp.concatenate([
      -param[: n // 4].astype(jnp.float32) * 2.0,
      -param[n // 4: n // 2].astype(jnp.float32) * (1 + 1e-6),
      jnp.asarray(rng.normal(size=n // 2) * 300, jnp.float32)])
  update, compensation = jax.jit(kahan_write_back)(param, exact_update, jnp.zeros_like(param))
  arrived = optax.apply_updates(param, update)
  exact = _f64(param) + np.asarray(exact_update, np.float64)
  target = _f64(jnp.asarray(exact, jnp.float32).astype(dtype))
  larger = np.maximum(np.abs(_f64(param)), np.abs(target))
  assert np.all(np.abs(_f64(arrived) - target) <= _ulp(larger, dtype))
  remainder = jnp.asarray(np.float32(exact) - np.asarray(_f64(arrived), np.float32))
  np.testing.assert_array_equal(_bits_of(compensation), _bits_of(remainder.astype(dtype)))


def test_compensation_is_right_when_the_step_is_applied_in_the_same_jit(rng):
  # XLA keeps excess precision inside a jit: a float32 -> bfloat16 -> float32 pair of
  # conversions is dropped. Where the landing is inexact the remainder then came out
  # wrong for 98% of the elements; the rounding through reduce_precision keeps it right.
  param = jnp.asarray(rng.normal(size=4096) * 0.01, jnp.bfloat16)
  exact_update = jnp.asarray(rng.normal(size=4096) * 100, jnp.float32)

  @jax.jit
  def step(param, exact_update):
    update, compensation = kahan_write_back(param, exact_update, jnp.zeros_like(param))
    return optax.apply_updates(param, update), compensation

  arrived, compensation = step(param, exact_update)
  exact = (param.astype(jnp.float32) + exact_update)
  want = jax.jit(lambda e, a: e - a.astype(jnp.float32))(exact, arrived).astype(jnp.bfloat16)
  np.testing.assert_array_equal(_bits_of(compensation), _bits_of(want))


def test_kahan_saturates_at_the_largest_value():
  largest = float(jnp.finfo(jnp.bfloat16).max)
  param = jnp.array([largest, -largest, 1.0], jnp.bfloat16)
  # Sums beyond the largest value but within float32's range (bfloat16 shares it).
  update, compensation = kahan_write_back(param, jnp.array([1e36, -1e36, 3e38], jnp.float32),
                                          jnp.zeros_like(param))
  arrived = _f64(optax.apply_updates(param, update))
  np.testing.assert_array_equal(arrived[:2], [largest, -largest])
  assert np.all(np.isfinite(arrived)) and np.all(np.isfinite(_f64(compensation)))
  nan_update, _ = kahan_write_back(param, jnp.array([jnp.nan, jnp.inf, 1.0]),
                                   jnp.zeros_like(param))
  assert np.isnan(_f64(nan_update)[0]) and np.isinf(_f64(nan_update)[1])


@pytest.mark.parametrize("dtype", NARROW)
@given(data=st.data())
def test_kahan_keeps_a_finite_compensation_within_the_range(dtype, data):
  # Params anywhere in the range, float32 updates up to half float32's largest value: wherever
  # the update lands on a finite param, the compensation is finite and within the
  # narrow range, saturated where the true remainder is beyond it (float16's range is
  # far smaller than float32's), and it is the remainder itself everywhere else.
  largest = float(jnp.finfo(dtype).max)
  wide_largest = float(jnp.finfo(jnp.float32).max)
  # Every pair of these edges, then drawn values.
  edge_params = [largest, -largest, largest / 2, 1.0, 0.0]
  edge_updates = [wide_largest / 2, -wide_largest / 2, 1e36, -1e36, 1e6, -1e6, largest]
  params = [p for p in edge_params for _ in edge_updates] + data.draw(
      st.lists(st.floats(-largest, largest, width=32), min_size=16, max_size=16))
  updates = edge_updates * len(edge_params) + data.draw(
      st.lists(st.floats(-wide_largest / 2, wide_largest / 2, width=32), min_size=16,
               max_size=16))
  param = jnp.asarray(params, jnp.float32).astype(dtype)
  exact_update = jnp.asarray(updates, jnp.float32)
  update, compensation = jax.jit(kahan_write_back)(param, exact_update, jnp.zeros_like(param))
  arrived = _f64(optax.apply_updates(param, update))
  landed_finite = np.isfinite(arrived)
  comp = _f64(compensation)[landed_finite]
  assert np.all(np.isfinite(comp)) and np.all(np.abs(comp) <= largest)
  exact = np.asarray(param.astype(jnp.float32) + exact_update, np.float64)[landed_finite]
  remainder = exact - arrived[landed_finite]
  inside = np.abs(remainder) <= largest
  # XLA flushes float32 subnormals inside jit: those remainders are left out.
  flushed = (np.abs(remainder) > 0) & (np.abs(remainder) < float(jnp.finfo(jnp.float32).tiny))
  inside &= ~flushed
  np.testing.assert_array_equal(
      comp[inside], _f64(jnp.asarray(remainder[inside], jnp.float32).astype(dtype)))
  np.testing.assert_array_equal(comp[~inside], np.sign(remainder[~inside]) * largest)


# --- with_param_rounding ---------------------------------------------------------------


SHAPES = {"w": (16, 32), "b": (32,)}
SPECS = {"w": P("data", "model"), "b": P("model")}


def _tree(seed, dtype=jnp.bfloat16, scale=1.0):
  rng = np.random.default_rng(seed)
  return {name: jnp.asarray(rng.normal(size=shape) * scale, jnp.float32).astype(dtype)
          for name, shape in SHAPES.items()}


def _run(tx, params, grads_list):
  # optax.adam mixes int and float counts.
  return run_steps(tx, params, grads_list, dtype_promotion="standard")[:2]


def test_state_and_structure():
  params = _tree(0)
  for mode in write_back.ROUNDING_MODES:
    state = with_param_rounding(optax.adam(1e-3), mode).init(params)
    assert isinstance(state, ParamRoundingState)
    assert state.count.dtype == jnp.int32 and int(state.count) == 0
    # inner sees float32 copies: its state is float32
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.inner_state[0].mu))
    if mode == "kahan":
      assert jax.tree.map(lambda c: (c.dtype, c.shape), state.compensation) == {
          name: (jnp.dtype(jnp.bfloat16), shape) for name, shape in SHAPES.items()}
      assert not any(np.any(np.asarray(c)) for c in jax.tree.leaves(state.compensation))
    else:
      assert state.compensation is None


@pytest.mark.parametrize("mode", write_back.ROUNDING_MODES)
def test_an_empty_tree_steps_to_an_empty_update(mode):
  # A model whose trainable part is empty (every leaf masked away, say) still steps.
  tx = with_param_rounding(optax.sgd(1e-3), mode)
  updates, state = tx.update({}, tx.init({}), {})
  assert updates == {} and int(state.count) == 1


def test_the_default_seed_is_zero():
  # The documented default: a run without a seed draws seed 0's bits, so it is repeatable
  # across releases, and another seed draws others.
  params, grads = _tree(0), [_tree(s) for s in (1, 2)]
  default, _ = _run(with_param_rounding(optax.sgd(2e-3), "stochastic"), params, grads)
  zero, _ = _run(with_param_rounding(optax.sgd(2e-3), "stochastic", seed=0), params, grads)
  one, _ = _run(with_param_rounding(optax.sgd(2e-3), "stochastic", seed=1), params, grads)
  assert_trees_bitwise_equal(default, zero)
  assert np.mean(np.asarray(default["w"]) != np.asarray(one["w"])) > 0.1


def test_kahan_keeps_no_buffer_for_wide_params():
  params = {"narrow": jnp.ones(3, jnp.bfloat16), "wide": jnp.ones(3, jnp.float32)}
  tx = with_param_rounding(optax.sgd(1e-3), "kahan")
  state = tx.init(params)
  assert state.compensation["wide"] is None and state.compensation["narrow"].shape == (3,)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, state = jax.jit(tx.update)(grads, state, params)
  assert state.compensation["wide"] is None
  assert updates["wide"].dtype == jnp.float32 and updates["narrow"].dtype == jnp.bfloat16


def test_params_are_required_except_for_nearest():
  params = _tree(0)
  grads = _tree(1)
  for mode in ("stochastic", "kahan"):
    tx = with_param_rounding(optax.sgd(1e-3), mode)
    with pytest.raises(ValueError, match="needs params"):
      tx.update(grads, tx.init(params))
  tx = with_param_rounding(optax.sgd(1e-3), "nearest")
  updates, _ = tx.update(grads, tx.init(params))
  want = jax.tree.map(lambda g: (-1e-3 * g.astype(jnp.float32)).astype(g.dtype), grads)
  assert_trees_bitwise_equal(updates, want)


@pytest.mark.parametrize("mode", write_back.ROUNDING_MODES)
def test_float32_params_are_untouched(mode):
  params, grads = _tree(0, jnp.float32), [_tree(s, jnp.float32) for s in (1, 2, 3)]
  inner = optax.adamw(1e-2, weight_decay=1e-2)
  tx = with_param_rounding(inner, mode, seed=seed_for(mode, 3))
  got_params, got_state = _run(tx, params, grads)
  want_params, want_state = _run(inner, params, grads)
  assert_trees_bitwise_equal(got_params, want_params)
  assert_trees_bitwise_equal(got_state.inner_state, want_state)


@pytest.mark.parametrize("mode", write_back.ROUNDING_MODES)
def test_float32_params_with_bfloat16_grads_get_inners_updates_bit_for_bit(mode):
  # Their grads reached inner as float32 copies and its float32 updates were cast to the
  # grads' bfloat16: a float32 master weight lost 0.05% of each update.
  params = _tree(0, jnp.float32) | {"narrow": jnp.ones((4, 4), jnp.bfloat16)}
  grads = [jax.tree.map(lambda p, s=s: jnp.full_like(p, 0.1 * s, jnp.bfloat16), params)
           for s in (1, 2, 3)]
  inner = optax.adam(1e-3)
  tx = with_param_rounding(inner, mode, seed=seed_for(mode, 3))
  got_params, _ = _run(tx, params, grads)
  without_narrow = {k: v for k, v in params.items() if k != "narrow"}
  want_params, _ = _run(inner, without_narrow,
                                 [{k: g[k] for k in without_narrow} for g in grads])
  assert_trees_bitwise_equal({k: got_params[k] for k in without_narrow}, want_params)
  assert all(got_params[k].dtype == jnp.float32 for k in without_narrow)
  with jax.numpy_dtype_promotion("standard"):  # optax.adam mixes int and float counts
    updates, _ = tx.update(grads[0], tx.init(params), params)
  assert updates["w"].dtype == jnp.float32, updates["w"].dtype


@pytest.mark.parametrize("inner, still_grad", [
    (lambda: osf.skip_nonfinite(optax.sgd(1.0)), jnp.nan),
    (lambda: optax.apply_if_finite(optax.sgd(1.0), 10), jnp.nan),
    (lambda: optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2), 0.5),
], ids=["skip_nonfinite", "apply_if_finite", "MultiSteps"])
def test_kahan_lands_nothing_on_a_step_with_nothing_to_add(inner, still_grad):
  # An update of 1.49999 ulp lands one ulp and leaves half an ulp exactly in the
  # compensation; a zero update (a step the guard inside skipped, a micro-batch) added to
  # it was a tie that moved the param by another ulp and turned the compensation round.
  ulp = 2.0**-7
  tx = with_param_rounding(inner(), mode="kahan")
  params = {"w": jnp.ones(1, jnp.bfloat16)}
  state = tx.init(params)
  grad = {"w": jnp.asarray([-1.49999 * ulp], jnp.float32)}
  with jax.numpy_dtype_promotion("standard"):  # optax's apply_if_finite mixes int counts
    for _ in range(2 if "MultiSteps" in str(state) else 1):  # a whole group lands
      updates, state = tx.update(grad, state, params)
      params = optax.apply_updates(params, updates)
    assert float(params["w"][0]) == 1 + ulp
    compensation = state.compensation["w"]
    assert float(compensation[0]) == ulp / 2, compensation
    updates, state = tx.update({"w": jnp.asarray([still_grad], jnp.float32)}, state, params)
  assert float(updates["w"][0]) == 0.0
  assert_trees_bitwise_equal(state.compensation["w"], compensation)


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_updates_land_on_the_rounded_targets(mode):
  params, grads = _tree(0), _tree(1)
  tx = with_param_rounding(optax.sgd(1e-3), mode, seed=seed_for(mode, 5))
  state = tx.init(params)
  updates, new_state = jax.jit(tx.update)(grads, state, params)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  for path, param in flat:
    name = path[0].key

    @jax.jit
    def expected(param, grad, path=path):
      exact = -1e-3 * grad.astype(jnp.float32)
      if mode == "stochastic":
        bits = random_bits(5, 0, path_hash(path), param.shape, STREAM_PARAMS)
        return stochastic_write_back(param, exact, bits), None
      return kahan_write_back(param, exact, jnp.zeros_like(param))

    want, compensation = expected(param, grads[name])
    assert_trees_bitwise_equal(updates[name], want)
    if mode == "kahan":
      assert_trees_bitwise_equal(new_state.compensation[name], compensation)
  assert int(new_state.count) == 1


def test_steps_and_seeds_draw_different_bits():
  params, grads = _tree(0), _tree(1)
  results = {}
  for seed in (0, 1):
    tx = with_param_rounding(optax.sgd(2e-3), "stochastic", seed=seed)
    update = jax.jit(tx.update)
    first, state = update(grads, tx.init(params), params)
    second, _ = update(grads, state, params)
    results[seed] = (first, second)
  def differ(a, b):
    return np.mean(np.asarray(a["w"]) != np.asarray(b["w"]))
  assert differ(*results[0]) > 0.1 and differ(results[0][0], results[1][0]) > 0.1
  tx = with_param_rounding(optax.sgd(2e-3), "stochastic", seed=0)
  again, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  assert_trees_bitwise_equal(again, results[0][0])


@pytest.mark.parametrize("mode", write_back.ROUNDING_MODES)
def test_the_count_advances_every_step_and_picks_new_bits(mode):
  # Guards against a count that stays put: "nearest" never reads it, so only its value
  # shows the bug there, and in "stochastic" every step would round with the same bits,
  # a bias that no single step shows. The same grads and params every step, so any
  # difference between two steps' updates comes from the bits.
  params, grads = _tree(0), _tree(1)
  tx = with_param_rounding(optax.sgd(2e-3), mode, seed=seed_for(mode, 3))
  update = jax.jit(tx.update)
  state = tx.init(params)
  history = []
  for _ in range(4):
    updates, state = update(grads, state, params)
    history.append(np.asarray(updates["w"]))
  assert int(state.count) == 4
  if mode == "stochastic":
    assert all(np.mean(a != b) > 0.1 for a, b in itertools.pairwise(history))
  elif mode == "nearest":  # no bits: the same update every step ("kahan" carries a remainder)
    assert all(np.array_equal(a, history[0]) for a in history)


@pytest.mark.parametrize("inner", [
    lambda: osf.safefactor(1e-2),
    lambda: osf.skip_nonfinite(optax.sgd(1e-2, momentum=0.9)),
    lambda: optax.apply_if_finite(optax.sgd(1e-2), 5),
    lambda: osf.accumulate_gradients(optax.sgd(1e-2), 2),
], ids=["safefactor", "skip_nonfinite", "apply_if_finite", "accumulate_gradients"])
def test_a_step_a_guard_inside_skips_draws_no_bits(inner):
  # The count advanced on a step the wrapped guard skipped, so every later step drew other
  # bits than the run without the poisoned step: with the guard outside it did not.
  params = {"w": jnp.linspace(0.5, 1.5, 64, dtype=jnp.bfloat16).reshape(8, 8)}
  grads = [{"w": jnp.cos(params["w"].astype(jnp.float32) * (i + 1)).astype(jnp.bfloat16)}
           for i in range(6)]
  nan = {"w": jnp.full((8, 8), jnp.nan, jnp.bfloat16)}
  with jax.numpy_dtype_promotion("standard"):  # optax's apply_if_finite mixes int counts
    clean, clean_state, _ = run_steps(with_param_rounding(inner(), "stochastic"), params, grads)
    poisoned, state, _ = run_steps(with_param_rounding(inner(), "stochastic"), params,
                                   [*grads[:3], nan, *grads[3:]])
  assert_trees_bitwise_equal(poisoned, clean)
  assert int(state.count) == int(clean_state.count) == 6


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_sharded_runs_equal_single_device_runs_bit_for_bit(axis_type, mode):
  tx = with_param_rounding(optax.adamw(3e-3, weight_decay=1e-2), mode, seed=seed_for(mode, 7))
  grads = [_tree(s, scale=0.1) for s in (1, 2, 3)]
  single_params, single_state = _run(tx, _tree(0), grads)
  mesh = _mesh(axis_type)
  def place(tree):
    return {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in tree.items()}
  with jax.set_mesh(mesh):
    params, state = _run(tx, place(_tree(0)), [place(g) for g in grads])
    for name, spec in SPECS.items():
      assert params[name].sharding.is_equivalent_to(NamedSharding(mesh, spec), len(SHAPES[name]))
      if mode == "kahan":
        assert state.compensation[name].sharding.is_equivalent_to(
            NamedSharding(mesh, spec), len(SHAPES[name]))
  assert_trees_bitwise_equal(jax.tree.map(np.asarray, params), single_params)
  assert_trees_bitwise_equal(jax.tree.map(np.asarray, state), single_state)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_compensation_is_placed_like_its_param(axis_type):
  mesh = _mesh(axis_type)
  tx = with_param_rounding(optax.sgd(1e-3), "kahan")
  with jax.set_mesh(mesh):
    params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in _tree(0).items()}
    eager = tx.init(params)
    jitted = jax.jit(tx.init)(params)
  for name, spec in SPECS.items():
    wanted = NamedSharding(mesh, spec)
    assert eager.compensation[name].sharding.is_equivalent_to(wanted, len(SHAPES[name]))
    if axis_type == AxisType.Explicit:  # Auto-mode tracers carry no sharding to follow
      assert jitted.compensation[name].sharding.is_equivalent_to(wanted, len(SHAPES[name]))


def test_explicit_mode_bits_need_no_full_size_temporary():
  # Each device computes the bits of its own block inside the fusion that uses them.
  mesh = _mesh(AxisType.Explicit)
  tx = with_param_rounding(optax.sgd(1e-3), "stochastic")
  shape = (512, 1024)
  sharding = NamedSharding(mesh, P("data", "model"))
  with jax.set_mesh(mesh):
    params = {"w": jax.device_put(jnp.ones(shape, jnp.bfloat16), sharding)}
    compiled = jax.jit(tx.update).lower(params, tx.init(params), params).compile()
  local_bytes = 512 * 1024 * 2 // 8
  assert compiled.memory_analysis().temp_size_in_bytes < local_bytes


# --- training ---------------------------------------------------------------------------


def _mlp_loss(dtype, mode, learning_rate=1e-3, steps=300):
  """Mean loss of the last 20 steps of a small tanh MLP regression (float32 compute)."""
  params, loss = tanh_mlp_regression(dtype, seed=0)
  tx = optax.adam(learning_rate)
  if mode is not None:
    tx = with_param_rounding(tx, mode)
  with jax.numpy_dtype_promotion("standard"):  # optax.adam mixes int and float counts
    return mean_of_last_losses(tx, params, loss, steps)


def test_bfloat16_training_matches_float32_params():
  reference = _mlp_loss(jnp.float32, None)
  losses = {mode: _mlp_loss(jnp.bfloat16, mode) for mode in write_back.ROUNDING_MODES}
  assert losses["nearest"] > 1.8 * reference, (reference, losses)  # the updates vanish
  for mode in ("stochastic", "kahan"):
    assert abs(losses[mode] / reference - 1) < 0.05, (mode, reference, losses)


# --- measurement (not a test) -------------------------------------------------------------


def measure_write_back(rounds: int = 9, shapes=None) -> dict[str, float]:
  """Step time of ``with_param_rounding(optax.sgd(1e-3), mode)`` relative to ``"nearest"``.

  A 50M-element bfloat16 tree, one jitted training step (update and
  ``apply_updates``) with params and optimizer state donated; modes interleaved,
  medians. Prints and returns the ratios.
  """
  shapes = shapes or {f"w{i}": (3072, 4096) for i in range(4)}
  rng = np.random.default_rng(0)
  grads = {k: jnp.asarray(rng.normal(size=s), jnp.bfloat16) for k, s in shapes.items()}
  steps, carry, times = {}, {}, {}
  for mode in write_back.ROUNDING_MODES:
    tx = with_param_rounding(optax.sgd(1e-3), mode)

    def train_step(params, state, grads, tx=tx):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    params = {k: jnp.asarray(rng.normal(size=s), jnp.bfloat16) for k, s in shapes.items()}
    steps[mode] = jax.jit(train_step, donate_argnums=(0, 1))
    carry[mode] = jax.block_until_ready(steps[mode](params, tx.init(params), grads))
    times[mode] = []
  for _ in range(rounds):
    for mode, run in steps.items():
      start = time.perf_counter()
      carry[mode] = jax.block_until_ready(run(*carry[mode], grads))
      times[mode].append(time.perf_counter() - start)
  base = float(np.median(times["nearest"]))
  ratios = {mode: float(np.median(t)) / base for mode, t in times.items()}
  for mode, t in times.items():
    print(f"{mode:11s} {np.median(t) * 1e3:8.1f} ms  {ratios[mode]:.2f}x nearest")
  return ratios
