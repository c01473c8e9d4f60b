"""Statistical tests of the random bits: what must not share bits draws independent ones.

Every element that is rounded stochastically draws its bits from ``(seed, step, leaf
path, stream, element index)``. Two roundings that should be independent but read the
same bits are correlated: a bfloat16 moving average and the param it scales rounding up
together, or two leaves that happen to share a last name moving in lockstep. Nothing in
the values looks wrong, so these tests look at the bits, and at the rounding decisions the
public API makes with them, with chi-square and correlation tests.

Each test runs on fixed seeds, so it is deterministic; its comment states the false-alarm
rate, the chance that a correct generator fails it on a random seed: every p-value is
compared with ``ALPHA = 1e-6``, and a test running ``k`` of them fails a correct generator
with probability at most ``k * 1e-6`` (Bonferroni).

Samples are of about 2**16 words. Over much longer runs of consecutive indices the top
byte of the bits is measurably uneven (over 2**22 consecutive indices its chi-square
averages about 490 for 255 degrees of freedom, where mixing the word a second time gives
255): larger samples would see that weakness of the hash, not the sharing these tests are
about, and would fail a correct generator far more often than their stated rate.

The primitives' exactness (flat indices, wide products, one- and two-word indices agreeing)
is tested in ``test_rounding.py``.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

import optax_safefactor as osf
from optax_safefactor._src import bit_streams, write_back
from optax_safefactor._src.bit_streams import (
    STREAM_COLUMN_STATISTICS,
    STREAM_MOMENTUM,
    STREAM_PARAMS,
    STREAM_STATISTICS,
    index_bits,
    path_hash,
    random_bits,
    stream_key,
)

ALPHA = 1e-6
SEED = 0x5EED
STEP = 3
SHAPE = (256, 256)  # 2**16 words per sample: 256 expected per cell of a 16 x 16 table
STREAMS = {
    "params": STREAM_PARAMS,
    "momentum": STREAM_MOMENTUM,
    "statistics": STREAM_STATISTICS,
    "column statistics": STREAM_COLUMN_STATISTICS,
}
# A leaf of 2**32 + 2**19 elements: the flat index of its last rows needs the high word.
BIG_SHAPE = (2**16, 2**16 + 8)
TWO_TO_THE_32 = 2**32


def _keystr(*names: str) -> str:
  return jax.tree_util.keystr(tuple(jax.tree_util.DictKey(name) for name in names))


# --- the statistics ------------------------------------------------------------------------


def _assert_uniform(words: np.ndarray, what: str) -> None:
  """Each of the four bytes of the words takes its 256 values equally often (one test).

  A chi-square over the 4 x 256 byte counts, 1020 degrees of freedom (each byte position's
  total is fixed). The pair tests below take fair bits for granted (an agreement rate of
  1/2 needs them), so a skewed stream fails here, named as such.
  """
  as_bytes = np.ascontiguousarray(words.ravel()).view(np.uint8).reshape(-1, 4)
  counts = np.stack([np.bincount(as_bytes[:, k], minlength=256) for k in range(4)])
  p = stats.chisquare(counts.ravel(), ddof=3).pvalue
  assert p >= ALPHA, f"{what}: bytes not uniform, p = {p:.2e}"


def _assert_independent(a: np.ndarray, b: np.ndarray, what: str) -> None:
  """Words ``a`` and ``b``, element by element, are independent (three tests).

  * the joint distribution of their top 4 bits is uniform over the 16 x 16 cells
    (chi-square, 255 degrees of freedom): shared or related bits fill the diagonal or a
    pattern. The top bits are those that decide a rounding (bfloat16 reads the top 16);
  * at each of the 32 bit positions they agree half the time: the sum of the 32 squared
    z-scores of the agreement counts is chi-square with 32 degrees of freedom;
  * the 24-bit uniforms made from them are uncorrelated (Pearson).
  """
  a, b = a.ravel(), b.ravel()
  n = a.size
  joint = np.bincount((a >> 28).astype(np.int64) * 16 + (b >> 28), minlength=256)
  p_joint = stats.chisquare(joint).pvalue
  differing = np.unpackbits(np.ascontiguousarray(a ^ b).view(np.uint8)).reshape(n, 32)
  agreement = n - differing.sum(axis=0, dtype=np.int64)
  z_squared = (2 * agreement - n) ** 2 / n
  p_agreement = stats.chi2.sf(z_squared.sum(), df=32)
  p_correlation = stats.pearsonr((a >> 8).astype(np.float64), (b >> 8).astype(np.float64)).pvalue
  p_values = {"joint top bits": p_joint, "bit agreement": p_agreement,
              "correlation": p_correlation}
  failed = {name: f"{p:.2e}" for name, p in p_values.items() if p < ALPHA}
  assert not failed, (f"{what}: dependent bits, p = {failed}; "
                      f"agreement rate {agreement.sum() / (32 * n):.4f}")


def _assert_independent_decisions(a: np.ndarray, b: np.ndarray, what: str) -> None:
  """Two arrays of rounding decisions (True: rounded up), element by element, are
  independent: the chi-square test of the 2 x 2 table (one degree of freedom).

  Each array must hold one decision probability for all of its elements, so that the
  table's margins estimate it; both outcomes must be common, so the test has power.
  """
  a, b = a.ravel(), b.ravel()
  for side, decisions in (("first", a), ("second", b)):
    assert 0.05 < decisions.mean() < 0.95, (what, side, decisions.mean())
  table = np.array([[np.sum(a & b), np.sum(a & ~b)], [np.sum(~a & b), np.sum(~a & ~b)]])
  p = stats.chi2_contingency(table, correction=False).pvalue
  agreement = np.mean(a == b)
  assert p >= ALPHA, (f"{what}: dependent roundings, p = {p:.2e}, table {table.tolist()}, "
                     f"agreement {agreement:.4f}")


def _rounded_up(values: jax.Array) -> np.ndarray:
  """Which elements of ``values``, each a rounding of the same wide number, went up."""
  values = np.asarray(values.astype(jnp.float32))
  assert len(np.unique(values)) == 2, np.unique(values)  # the two neighbours
  return values == values.max()


# --- the bits function ---------------------------------------------------------------------


def test_the_four_streams_of_one_leaf_draw_independent_bits():
  # Guards against the statistics, column statistics, momentum and params of one leaf
  # drawing one stream (equal STREAM_* constants): their roundings would be correlated.
  # False alarm: 4 uniformity tests and 6 pairs x 3 tests, 22 at p < 1e-6: at most 2.2e-5.
  assert len(set(STREAMS.values())) == len(STREAMS)
  leaf = path_hash(_keystr("enc", "kernel"))
  bits = {name: np.asarray(random_bits(SEED, STEP, leaf, SHAPE, stream))
          for name, stream in STREAMS.items()}
  for name, words in bits.items():
    _assert_uniform(words, name)
  for (name_a, a), (name_b, b) in itertools.combinations(bits.items(), 2):
    _assert_independent(a, b, f"{name_a} vs {name_b}")


def test_leaves_with_the_same_last_name_draw_independent_bits():
  # Guards against a path hash of the leaf's last key only: ['enc']['kernel'] and
  # ['dec']['kernel'] (and a top-level ['kernel']) would round in lockstep.
  # False alarm: 3 uniformity tests and 3 pairs x 3 tests, 12 at p < 1e-6: at most 1.2e-5.
  tree = {"enc": {"kernel": 0}, "dec": {"kernel": 0}, "kernel": 0}
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  hashes = {jax.tree_util.keystr(path): path_hash(path) for path in paths}
  assert len(set(hashes.values())) == len(paths), hashes
  bits = {name: np.asarray(random_bits(SEED, STEP, leaf, SHAPE, STREAM_PARAMS))
          for name, leaf in hashes.items()}
  for name, words in bits.items():
    _assert_uniform(words, name)
  for (name_a, a), (name_b, b) in itertools.combinations(bits.items(), 2):
    _assert_independent(a, b, f"{name_a} vs {name_b}")


@pytest.mark.parametrize("first_step", [0, 1, 2**31 - 2])
def test_consecutive_steps_draw_independent_bits(first_step):
  # Guards against bits that repeat or follow from one applied step to the next (the
  # step not absorbed into the key, or absorbed as an offset of the element index): a
  # param would round the same way every step and drift by a bias instead of noise.
  # Each pair is also compared shifted by one element either way.
  # False alarm per step pair: 2 uniformity tests and 3 comparisons x 3 tests, 11 at
  # p < 1e-6: at most 1.1e-5.
  leaf = path_hash(_keystr("dec", "kernel"))
  now, then = (np.asarray(random_bits(SEED, step, leaf, SHAPE, STREAM_PARAMS)).ravel()
               for step in (first_step, first_step + 1))
  _assert_uniform(now, f"step {first_step}")
  _assert_uniform(then, f"step {first_step + 1}")
  _assert_independent(now, then, "same element")
  _assert_independent(now[1:], then[:-1], "next step, previous element")
  _assert_independent(now[:-1], then[1:], "next step, next element")


@pytest.mark.parametrize("high_words", [(0, 1), (1, 2), (0, 2**31), (0, 2**32 - 1)])
def test_elements_two_to_the_32_apart_draw_independent_bits(high_words):
  # Guards against index_bits dropping (or mis-mixing) the high word of the element
  # index: elements 2**32 apart in one leaf would round identically. Shifted by one
  # element it also catches a high word folded into the low word as an offset.
  # False alarm per pair: 2 uniformity tests and 2 comparisons x 3 tests, 8 at p < 1e-6:
  # at most 8e-6.
  key = stream_key(SEED, STEP, path_hash(_keystr("enc", "kernel")), STREAM_PARAMS)
  low = jnp.arange(np.prod(SHAPE), dtype=jnp.uint32)
  a, b = (np.asarray(index_bits(key, low, jnp.full_like(low, high))) for high in high_words)
  _assert_uniform(a, f"high word {high_words[0]}")
  _assert_uniform(b, f"high word {high_words[1]}")
  _assert_independent(a, b, f"high words {high_words}, same low word")
  _assert_independent(a[1:], b[:-1], f"high words {high_words}, low words one apart")


def _big_leaf_partners():
  """Flat indices of the last row of a ``BIG_SHAPE`` leaf (all beyond 2**32), and of the
  elements 2**32 before them, which lie in its first 8 rows."""
  width = BIG_SHAPE[1]
  last = (BIG_SHAPE[0] - 1) * width + np.arange(width, dtype=np.uint64)
  partners = last - TWO_TO_THE_32
  assert last.min() >= TWO_TO_THE_32 and partners.max() < 8 * width
  return last, partners.astype(np.int64)


def test_random_bits_of_a_leaf_beyond_two_to_the_32_elements_use_the_high_word():
  # Guards against the flat index losing its high word on the way into the bits
  # (flat_index_words or the one-word shortcut): in a leaf of 2**32 + 2**19 elements the
  # last row would draw the bits of the elements 2**32 before it. The leaf is never built:
  # under jit only the sliced rows are computed (the bits are elementwise in the iotas).
  # One row, 65544 words, like the other tests' samples (the module docstring says why).
  # False alarm: 2 uniformity tests and 3 independence tests, 5 at p < 1e-6: at most 5e-6
  # (the exact comparison cannot fail a correct generator).
  leaf = path_hash(_keystr("enc", "kernel"))

  @jax.jit
  def first_and_last_rows(step):
    bits = random_bits(SEED, step, leaf, BIG_SHAPE, STREAM_PARAMS)
    return bits[:8], bits[-1:]

  first, last_row = (np.asarray(rows).ravel() for rows in first_and_last_rows(STEP))
  last, partners = _big_leaf_partners()
  key = stream_key(SEED, STEP, leaf, STREAM_PARAMS)
  exact = index_bits(key, jnp.asarray((last % TWO_TO_THE_32).astype(np.uint32)),
                     jnp.asarray((last // TWO_TO_THE_32).astype(np.uint32)))
  np.testing.assert_array_equal(last_row, np.asarray(exact))  # the 64-bit index, both words
  _assert_uniform(first[partners], "their partners 2**32 before")
  _assert_uniform(last_row, "the last row")
  _assert_independent(last_row, first[partners], "elements 2**32 apart")


# --- the write-back ------------------------------------------------------------------------


def test_write_back_of_a_leaf_beyond_two_to_the_32_elements_rounds_with_the_high_word():
  # Guards against the param write-back dropping the high word of a huge leaf's element
  # index (its own index arithmetic, or a shape other than the param's handed to the
  # bits): elements 2**32 apart would round together. The param and its update are built
  # inside jit and only the sliced rows are computed, without a 2**32-element buffer.
  # An update of half a bfloat16 ulp rounds up exactly when the top bit of the element's
  # params bits is set (the rounding adds the top 16 bits to the 16 that bfloat16 drops).
  # False alarm: one test at p < 1e-6: 1e-6 (the exact comparisons cannot fail).
  path = (jax.tree_util.DictKey("enc"), jax.tree_util.DictKey("kernel"))

  @jax.jit
  def first_and_last_rows(step):
    param = jnp.ones(BIG_SHAPE, jnp.bfloat16)
    half_ulp = jnp.full(BIG_SHAPE, 2.0**-8, jnp.float32)
    how = write_back.rounding_for("stochastic", SEED, step, path)
    update, _ = write_back.write_back(half_ulp, param, jnp.bfloat16, how, None)
    top_bit_set = random_bits(SEED, step, path_hash(path), BIG_SHAPE, STREAM_PARAMS) >> 31 == 1
    rounded_up = update != 0
    return rounded_up[:8], rounded_up[-1:], top_bit_set[:8], top_bit_set[-1:]

  first, last_row, first_top_bit, last_top_bit = (
      np.asarray(rows).ravel() for rows in first_and_last_rows(jnp.int32(STEP)))
  np.testing.assert_array_equal(first, first_top_bit)
  np.testing.assert_array_equal(last_row, last_top_bit)
  _, partners = _big_leaf_partners()
  _assert_independent_decisions(last_row, first[partners], "elements 2**32 apart")


def test_safefactor_draws_a_huge_leafs_bits_over_its_whole_shape_and_path(monkeypatch):
  # Guards against safefactor handing the bits functions anything but each array's full
  # global shape (so the high word of a 2**32-element leaf's index), its own stream and
  # the hash of the whole path. The update is traced, not run (jax.eval_shape), and every
  # key computed (path hash and stream) and every array of bits drawn is recorded (the
  # keys of every stochastically rounded array are computed together, as a vector); the
  # bits of exactly this shape are checked above to use the high word. Deterministic: no
  # false alarms.
  keys, draws = [], []
  real_stream_key, real_bits_from_key = bit_streams.stream_key, bit_streams.bits_from_key

  def recording_stream_key(seed, step, leaf_hash, stream):
    hashes = np.ravel(leaf_hash)
    keys.extend(zip(hashes.tolist(), np.broadcast_to(stream, hashes.shape).tolist(),
                    strict=True))
    return real_stream_key(seed, step, leaf_hash, stream)

  def recording_bits_from_key(key, shape):
    draws.append(tuple(shape))
    return real_bits_from_key(key, shape)

  monkeypatch.setattr(bit_streams, "stream_key", recording_stream_key)
  monkeypatch.setattr(bit_streams, "bits_from_key", recording_bits_from_key)
  tx = osf.safefactor(1e-3, momentum=0.9, dtype_momentum="bfloat16", state_dtype="bfloat16",
                      param_rounding="stochastic", rounding_seed=SEED)
  params = {"enc": {"kernel": jax.ShapeDtypeStruct(BIG_SHAPE, jnp.bfloat16)}}
  state = jax.eval_shape(tx.init, params)
  updates, _ = jax.eval_shape(tx.update, params, state, params)
  assert updates["enc"]["kernel"].shape == BIG_SHAPE
  leaf = path_hash(_keystr("enc", "kernel"))
  assert sorted(keys) == sorted([(leaf, stream) for stream in (
      STREAM_STATISTICS, STREAM_COLUMN_STATISTICS, STREAM_MOMENTUM, STREAM_PARAMS)])
  assert sorted(draws) == sorted([(BIG_SHAPE[0], 1), (1, BIG_SHAPE[1]), BIG_SHAPE, BIG_SHAPE])


def test_each_array_rounds_with_the_bits_of_its_own_stream(monkeypatch):
  # The keys of every stochastically rounded array of every leaf are computed together, as
  # one vector (write_back.with_stream_keys), and each array then looks its key up by its
  # stream. Each array's bits, recorded as a real step draws them (run eagerly), must be
  # exactly random_bits of its own leaf, stream and shape: a momentum rounded with the
  # params' bits, or a leaf with another leaf's, fails here.
  # Every stochastic rounding in write_back goes through stochastic_round, the params'
  # landing too.
  drawn = []
  real_round = write_back.stochastic_round

  def recording_round(x, dtype, bits):
    drawn.append(np.asarray(bits))
    return real_round(x, dtype, bits)

  monkeypatch.setattr(write_back, "stochastic_round", recording_round)
  tx = osf.safefactor(1e-3, momentum=0.9, dtype_momentum="bfloat16", state_dtype="bfloat16",
                      param_rounding="stochastic", rounding_seed=SEED, min_dim_size_to_factor=8)
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(24, 20)), jnp.bfloat16),
            "b": jnp.asarray(rng.normal(size=(20,)), jnp.bfloat16)}
  grads = jax.tree.map(lambda p: p * 0.1, params)
  state = tx.init(params)
  tx.update(grads, state, params)
  moments = optax.tree_utils.tree_get(state, "second_moment")
  streams = {"w": {STREAM_STATISTICS: moments["w"].v_row.shape,
                   STREAM_COLUMN_STATISTICS: moments["w"].v_col.shape,
                   STREAM_MOMENTUM: (24, 20), STREAM_PARAMS: (24, 20)},
             "b": {STREAM_STATISTICS: (20,), STREAM_MOMENTUM: (20,), STREAM_PARAMS: (20,)}}
  expected = [np.asarray(random_bits(SEED, 0, path_hash(_keystr(name)), shape, stream))
              for name, shapes in streams.items() for stream, shape in shapes.items()]
  assert sorted(bits.tobytes() for bits in drawn) == sorted(bits.tobytes() for bits in expected)


# --- through the public API ----------------------------------------------------------------


def _one_step(params, **options):
  """The params and state after one stochastic-rounding step of safefactor on gradients of
  1.0625 everywhere: every element of an array gets the same wide value, so each array's
  roundings share one probability (and, at this first step, beta2 = 0 makes the statistics
  g**2 = 1.12890625, half a bfloat16 ulp above 1.125)."""
  tx = osf.safefactor(learning_rate=6e-3, param_rounding="stochastic", rounding_seed=SEED,
                      **options)
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 1.0625, p.dtype), params)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  return optax.apply_updates(params, updates), state.inner_state


def test_leaves_named_kernel_in_different_subtrees_round_independently():
  # Guards against the rounding keying its bits by the leaf's last name: two bfloat16
  # kernels with equal params and gradients would land on equal values, step after step.
  # False alarm: one test at p < 1e-6: 1e-6.
  kernel = jnp.ones(SHAPE, jnp.bfloat16)
  new_params, _ = _one_step({"enc": {"kernel": kernel}, "dec": {"kernel": kernel}})
  enc, dec = new_params["enc"]["kernel"], new_params["dec"]["kernel"]
  assert np.any(np.asarray(enc != dec))
  _assert_independent_decisions(_rounded_up(enc), _rounded_up(dec), "enc vs dec kernel")


def test_narrow_state_rounds_independently_of_the_params_and_of_each_other():
  # Guards against bfloat16 statistics, column statistics or momentum rounding with the
  # params' bits or with each other's (equal stream constants, or store ignoring the
  # stream it is given). In one run a rounded statistic would feed the update that the
  # momentum and params round, making them dependent whatever the bits; so each array
  # comes from a run in which its wide value is the same for every element (the
  # statistics from runs without momentum, the momentum and params from a run with
  # float32 statistics). With the same seed, step and path, only the stream sets the bits
  # apart, and the decisions are compared at equal flat indices.
  # False alarm: 9 tests at p < 1e-6: at most 9e-6 (the control cannot fail).
  params = {"w": jnp.ones(SHAPE, jnp.bfloat16)}
  _, full = _one_step(params, factored=False, state_dtype="bfloat16")
  _, factored = _one_step({"w": jnp.ones((64, 128, 128), jnp.bfloat16)}, state_dtype="bfloat16")
  after, with_momentum = _one_step(params, momentum=0.9, dtype_momentum="bfloat16")
  decisions = {
      "statistics": _rounded_up(full.second_moment["w"].v).ravel(),
      "row statistics": _rounded_up(factored.second_moment["w"].v_row).ravel(),
      "column statistics": _rounded_up(factored.second_moment["w"].v_col).ravel(),
      "momentum": _rounded_up(with_momentum.momentum["w"]).ravel(),
      "params": _rounded_up(after["w"]).ravel(),
  }
  # The control: an unfactored statistic and a row statistic share their stream by
  # design, and at the same flat index they round alike, so the alignment sees sharing.
  rows = decisions["row statistics"]
  np.testing.assert_array_equal(decisions["statistics"][:rows.size], rows)
  for name_a, name_b in itertools.combinations(decisions, 2):
    if {name_a, name_b} == {"statistics", "row statistics"}:
      continue
    a, b = decisions[name_a], decisions[name_b]
    n = min(a.size, b.size)
    _assert_independent_decisions(a[:n], b[:n], f"{name_a} vs {name_b}")


def test_absorbing_a_value_keeps_distinct_keys_distinct():
  # Each absorb multiplies the key by an odd constant, a bijection on uint32: keys that
  # differ in any bit (the top one included) must stay distinct, or two streams whose
  # keys differ there would draw the same bits from then on.
  keys = jnp.asarray(np.random.default_rng(0).integers(0, 2**32, 4096, dtype=np.uint64)
                     .astype(np.uint32))
  value = jnp.uint32(12345)
  for flip in (1, 2**16, 2**31):
    absorbed = np.asarray(bit_streams.absorb(keys, value))
    flipped = np.asarray(bit_streams.absorb(keys ^ np.uint32(flip), value))
    assert not np.any(absorbed == flipped), flip


def test_a_seed_takes_any_64_bit_word_signed_or_not():
  for seed in (-(2**63), -1, 0, 2**63, 2**64 - 1):
    bit_streams.check_seed("rounding_seed", seed)
    osf.safefactor(1e-3, param_rounding="stochastic", rounding_seed=seed)
  for seed in (-(2**63) - 1, 2**64):
    with pytest.raises(ValueError, match="rounding_seed must fit in 64 bits"):
      osf.safefactor(1e-3, param_rounding="stochastic", rounding_seed=seed)


# The hash as bit_streams' docstrings state it, in Python integers: the lowbias32
# finaliser, a key absorbing each value as mix32(key * golden ^ value), and an element's
# bits mix32(absorb(key, index_hi) ^ index_lo). Pinning it pins the bits of every element
# from one release to the next: a checkpoint resumed with a later release rounds as it would
# have, and a change to a shift or a constant that keeps the bits uniform still fails here.
_MASK = 2**32 - 1


def _mix32_reference(x: int) -> int:
  x ^= x >> 16
  x = (x * 0x7FEB352D) & _MASK
  x ^= x >> 15
  x = (x * 0x846CA68B) & _MASK
  return x ^ (x >> 16)


def _absorb_reference(key: int, value: int) -> int:
  return _mix32_reference(((key * 0x9E3779B1) & _MASK) ^ (value & _MASK))


def _element_bits_reference(seed: int, step: int, path: int, stream: int, index: int) -> int:
  key = 0x5AFEFAC7
  for value in (seed >> 32, seed, step, path, stream):  # a seed's two 64-bit words
    key = _absorb_reference(key, value)
  return _mix32_reference((index & _MASK) ^ _absorb_reference(key, index >> 32))


@pytest.mark.parametrize("seed", [0, 7, -1, 2**63 - 1, -(2**63), 2**64 - 1])
def test_the_bits_are_the_stated_hash_of_seed_step_path_stream_and_index(seed):
  path = path_hash("['layer']['kernel']")
  shape = (3, 4, 5)
  for step, stream in ((0, STREAM_PARAMS), (123456, STREAM_MOMENTUM)):
    got = np.asarray(random_bits(seed, step, path, shape, stream)).ravel().tolist()
    want = [_element_bits_reference(seed, step, path, stream, index)
            for index in range(int(np.prod(shape)))]
    assert got == want
  # An element of a leaf of 2**32 elements or more: its index's high word is absorbed.
  key = stream_key(seed, 9, path, STREAM_PARAMS)
  index = 5 * 2**32 + 17
  got = int(index_bits(key, np.uint32(index & _MASK), np.uint32(index >> 32)))
  assert got == _element_bits_reference(seed, 9, path, STREAM_PARAMS, index)
