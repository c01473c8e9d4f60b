"""accumulate_gradients: the mean of every_k finite micro-batches; a bad one is left out, counted.

The trap it replaces: ``optax.MultiSteps`` resets its accumulator with
``(1 - emit) * acc``, so one NaN micro-batch stays in it for ever (``0 * NaN`` is NaN)
and, around safefactor, every later step is skipped while the run looks alive.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf
from tests.helpers import assert_trees_close, assert_trees_equal, run_steps, tree_all_finite

K = 4
SHAPES = {"w": (8, 6), "b": (6,)}


def _params(dtype=jnp.float32):
  return {name: jnp.linspace(-1.0, 1.0, int(np.prod(shape))).reshape(shape).astype(dtype)
          for name, shape in SHAPES.items()}


def _grads(index, dtype=jnp.float32):
  """Finite, different gradients for every micro-batch ``index``."""
  return {name: jnp.sin(p * (index + 1) + index).astype(dtype) for name, p in _params().items()}


def _poisoned(index, kind, leaf="w"):
  grads = _grads(index)
  value = {"nan": jnp.nan, "inf": -jnp.inf, "overflow": 3e38}[kind]
  grads[leaf] = grads[leaf].at[0, 0].set(value) if leaf == "w" else grads[leaf].at[1].set(value)
  return grads


def _inner():
  return osf.safefactor(0.1, momentum=0.9, min_dim_size_to_factor=4)


@functools.cache
def _transformation(name):
  """One transformation per configuration, shared by the tests (and so its compiled update)."""
  return {
      "safefactor": lambda: osf.accumulate_gradients(_inner(), K),
      "sgd": lambda: osf.accumulate_gradients(optax.sgd(1e-3), K),
      "identity": lambda: osf.accumulate_gradients(optax.identity(), K),
  }[name]()


def _run(name, grads_sequence, params=None, state=None):
  # The same tx each time: jax.jit(tx.update) finds the update compiled before.
  return run_steps(_transformation(name), _params() if params is None else params,
                   grads_sequence, state=state)


def _without_counters(state):
  return state._replace(micro_batches=None)


@pytest.mark.parametrize("name", ["identity", "safefactor"])
def test_steps_inner_on_the_float32_mean_of_every_k_micro_batches(name):
  # The mean handed to inner is exact (identity returns it bit for bit); inner's own
  # step, compiled inside the accumulation's, may fuse differently by an ulp.
  grads = [_grads(i) for i in range(2 * K)]
  params, state, history = _run(name, grads)
  inner = optax.identity() if name == "identity" else _inner()
  expected_params, inner_state = _params(), inner.init(_params())
  inner_update = jax.jit(inner.update)
  for group in range(2):
    summed = functools.reduce(
        lambda acc, g: jax.tree.map(jnp.add, acc, g), grads[group * K:(group + 1) * K])
    mean = jax.tree.map(lambda s: s * (1 / jnp.float32(K)), summed)
    updates, inner_state = inner_update(mean, inner_state, expected_params)
    expected_params = optax.apply_updates(expected_params, updates)
    if name == "identity":
      assert_trees_equal(history[group * K + K - 1], mean)
    else:
      assert_trees_close(history[group * K + K - 1], updates, rtol=1e-6)
    for quiet in history[group * K:group * K + K - 1]:
      assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(quiet))
  assert_trees_close(params, expected_params, rtol=1e-6)
  assert_trees_close(state.inner_state, inner_state, rtol=1e-6)
  assert int(state.applied_steps) == 2 and int(state.accumulated) == 0
  assert int(osf.skipped_steps(state)) == 0


def test_inner_state_is_untouched_between_steps():
  _, state, _ = _run("safefactor", [_grads(i) for i in range(K - 1)])
  fresh = _inner().init(_params())
  assert_trees_equal(state.inner_state, fresh)
  assert int(state.accumulated) == K - 1


@pytest.mark.parametrize("position", range(K))
@pytest.mark.parametrize("kind", ["nan", "inf", "overflow"])
def test_a_poisoned_micro_batch_equals_the_run_without_it(kind, position):
  # Groups of K; the poisoned micro-batch comes before the ``position``-th finite one of
  # the second group. An overflow needs a non-empty accumulator to overflow, so for it
  # every finite micro-batch holds 8e37 at the poisoned element (a clean group sums to
  # 3.2e38, still finite; with the poison's 3e38 in, it overflows), and position 0 (an
  # empty accumulator, where 3e38 is a legitimate gradient) is not a poison.
  if kind == "overflow" and position == 0:
    pytest.skip("3e38 added to an empty accumulator is finite, and is accumulated")
  name = "sgd" if kind == "overflow" else "safefactor"

  def clean(index):
    grads = _grads(index)
    if kind == "overflow":
      grads["w"] = grads["w"].at[0, 0].set(8e37)
    return grads

  finite = [clean(i) for i in range(3 * K)]
  bad = _poisoned(99, kind)
  if kind == "overflow":
    bad["w"] = bad["w"].at[0, 0].set(3e38)
  cut = K + position
  poisoned_params, poisoned_state, poisoned_history = _run(
      name, [*finite[:cut], bad, *finite[cut:]])
  clean_params, clean_state, clean_history = _run(name, finite)
  assert_trees_equal(poisoned_params, clean_params)
  assert_trees_equal(_without_counters(poisoned_state), _without_counters(clean_state))
  assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(poisoned_history[cut]))
  assert_trees_equal(poisoned_history[:cut] + poisoned_history[cut + 1:], clean_history)
  assert tree_all_finite(poisoned_state.accumulator)
  counters = poisoned_state.micro_batches
  assert int(osf.skipped_steps(poisoned_state)) == 1
  assert int(counters.step) == 3 * K + 1
  assert counters.nonfinite_steps.host_values() == {"params['b']": 0, "params['w']": 1}
  assert int(counters.last_nonfinite_step.per_leaf()["w"]) == cut
  assert int(counters.last_nonfinite_step.per_leaf()["b"]) == -1
  assert int(poisoned_state.applied_steps) == 3


def test_bfloat16_contributions_below_bfloat16_resolution_are_kept():
  # 1 + 2**-9 is 1 in bfloat16 (8 significant bits), so a bfloat16 accumulator would
  # drop every small micro-batch and hand over 1/16; the float32 one keeps them.
  small, k = 2.0**-9, 16
  params = {"w": jnp.zeros((3, 2), jnp.bfloat16)}
  tx = osf.accumulate_gradients(optax.identity(), k)
  state = tx.init(params)
  assert state.accumulator["w"].dtype == jnp.float32
  update = jax.jit(tx.update)
  for value in [1.0] + [small] * (k - 1):
    updates, state = update({"w": jnp.full((3, 2), value, jnp.bfloat16)}, state, params)
  exact_mean = (1.0 + (k - 1) * small) / k
  assert updates["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(updates["w"], np.full((3, 2), exact_mean, jnp.bfloat16))
  assert float(updates["w"][0, 0]) != 1.0 / k
  bf16_sum = functools.reduce(lambda acc, v: (acc + jnp.bfloat16(v)).astype(jnp.bfloat16),
                              [small] * (k - 1), jnp.bfloat16(1.0))
  assert float(bf16_sum) == 1.0  # what a bfloat16 accumulator would have held


def test_float64_gradients_accumulate_in_float64(x64):
  params = {"w": jnp.zeros((2, 2), jnp.float64)}
  tx = osf.accumulate_gradients(optax.identity(), 2)
  state = tx.init(params)
  assert state.accumulator["w"].dtype == jnp.float64
  # 1 + 2**-30 is 1 in float32; a float64 accumulator keeps it.
  _, state = tx.update({"w": jnp.full((2, 2), 2.0**-30, jnp.float64)}, state, params)
  updates, _ = tx.update({"w": jnp.full((2, 2), 1.0, jnp.float64)}, state, params)
  assert updates["w"].dtype == jnp.float64
  assert float(updates["w"][0, 0]) == (1.0 + 2.0**-30) / 2 != 0.5


MICRO_BATCHES = 2000
POISON_K = 5
_POISON_VALUES = jnp.asarray([0.0, jnp.nan, jnp.inf, -jnp.inf], jnp.float32)


def _scan_run(kinds_w, kinds_b):
  """2,000 micro-batches in one ``lax.scan``; kinds: 0 finite, 1 NaN, 2 Inf, 3 -Inf."""
  tx = osf.accumulate_gradients(_inner(), POISON_K)
  params = _params()

  def body(carry, xs):
    params, state = carry
    index, kind_w, kind_b = xs
    grads = jax.tree.map(lambda p: jnp.cos(p * (index.astype(jnp.float32) + 1.0)), params)
    grads = {"w": grads["w"].at[0, 0].add(_POISON_VALUES[kind_w]),
             "b": grads["b"].at[0].add(_POISON_VALUES[kind_b])}
    updates, state = tx.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), None

  indices = jnp.arange(MICRO_BATCHES, dtype=jnp.int32)
  (params, state), _ = jax.lax.scan(body, (params, tx.init(params)), (indices, kinds_w, kinds_b))
  return params, state


_scan_run_jitted = jax.jit(_scan_run)


@settings(max_examples=3)
@given(seed=st.integers(0, 2**31 - 1), rate=st.sampled_from([0.01, 0.2, 0.6]))
def test_counts_are_exact_over_2000_micro_batches(seed, rate):
  rng = np.random.default_rng(seed)
  kinds = np.where(rng.random((2, MICRO_BATCHES)) < rate,
                   rng.integers(1, 4, size=(2, MICRO_BATCHES)), 0).astype(np.int32)
  params, state = _scan_run_jitted(jnp.asarray(kinds[0]), jnp.asarray(kinds[1]))
  bad = (kinds != 0).any(axis=0)
  finite = MICRO_BATCHES - int(bad.sum())
  report = osf.nonfinite_report(state)
  assert int(osf.skipped_steps(state)) == int(bad.sum()) == report["skipped_micro_batches"]
  assert report["micro_batches"] == MICRO_BATCHES
  for row, leaf in enumerate(("w", "b")):
    poisoned_at = np.flatnonzero(kinds[row])
    assert report[f"nonfinite_micro_batches/params['{leaf}']"] == poisoned_at.size
    assert report[f"last_nonfinite_micro_batch/params['{leaf}']"] == (
        int(poisoned_at[-1]) if poisoned_at.size else -1)
  trailing = len(bad) - int(np.flatnonzero(~bad)[-1]) - 1 if (~bad).any() else len(bad)
  assert report["consecutive_skipped_micro_batches"] == trailing
  assert int(state.applied_steps) == finite // POISON_K == report["steps"]
  assert int(state.accumulated) == finite % POISON_K
  assert report["skipped_steps"] == 0  # every mean handed to safefactor was finite
  assert tree_all_finite((params, state))


def _issue_trap(tx):
  """The issue's snippet: good, bad, then 14 good micro-batches into a (130, 140) weight."""
  params = {"w": jnp.ones((130, 140))}
  good = {"w": jnp.full((130, 140), 0.1)}
  bad = {"w": good["w"].at[0, 0].set(jnp.nan)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  with jax.numpy_dtype_promotion("standard"):  # MultiSteps mixes int and float counts
    for grads in [good, bad] + [good] * 14:
      updates, state = update(grads, state, params)
      params = optax.apply_updates(params, updates)
  return params, state


def test_multi_steps_trap_is_gone():
  # optax.MultiSteps keeps the NaN in its accumulator: all 4 steps are skipped and the
  # params never move; nothing but safefactor's skip counter says so.
  trapped_params, trapped_state = _issue_trap(optax.MultiSteps(osf.safefactor(0.1), 4))
  assert int(osf.skipped_steps(trapped_state)) == 4
  np.testing.assert_array_equal(trapped_params["w"], np.ones((130, 140), np.float32))
  assert not bool(jnp.all(jnp.isfinite(trapped_state.acc_grads["w"])))

  params, state = _issue_trap(osf.accumulate_gradients(osf.safefactor(0.1), 4))
  report = osf.nonfinite_report(state)
  assert report["skipped_micro_batches"] == 1 and report["skipped_steps"] == 0
  assert int(osf.skipped_steps(state)) == 1
  assert int(state.applied_steps) == 3 and int(state.accumulated) == 3
  assert not np.array_equal(params["w"], np.ones((130, 140), np.float32))
  assert tree_all_finite((params, state))


def _temp_bytes(tx, params):
  def train_step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  with jax.numpy_dtype_promotion("standard"):  # MultiSteps mixes int and float counts
    compiled = jax.jit(train_step, donate_argnums=(0, 1)).lower(
        params, tx.init(params), params).compile()
  memory = compiled.memory_analysis()
  if memory is None:
    pytest.skip("this backend reports no memory analysis")
  return memory.temp_size_in_bytes


@pytest.mark.xla_memory_layout
def test_temporary_bytes_are_at_most_multi_steps():
  # The verdict is one fused float reduction (an all(isfinite) would write a boolean
  # array), and the step reads the accumulator just written in place (clearing it
  # after the step would make XLA copy it first). So the compiled train step keeps no
  # more than optax.MultiSteps does: the updates and the mean safefactor reads; with
  # identity inside, the updates alone.
  params = {"w": jnp.ones((256, 512))}
  size = 256 * 512 * 4
  ours = _temp_bytes(osf.accumulate_gradients(osf.safefactor(0.1), K), params)
  # Up to a few kilobytes of scalars and small statistics.
  assert ours <= _temp_bytes(optax.MultiSteps(osf.safefactor(0.1), K), params) + 4096
  assert ours <= 2.1 * size
  assert _temp_bytes(osf.accumulate_gradients(optax.identity(), K), params) <= 1.1 * size


def test_every_k_schedule_of_the_applied_step():
  # Two steps of 2 micro-batches, then steps of 3, as MultiSteps' every_k_schedule.
  def schedule(step):
    return jnp.where(step < 2, 2, 3)

  params = {"w": jnp.zeros((3,))}
  grads = [{"w": jnp.full((3,), float(i + 1))} for i in range(10)]
  tx = osf.accumulate_gradients(optax.identity(), schedule)
  state = tx.init(params)
  update = jax.jit(tx.update)
  emitted = []
  for i, g in enumerate([*grads[:5], {"w": jnp.full((3,), jnp.nan)}, *grads[5:]]):
    updates, state = update(g, state, params)
    emitted.append((i, float(updates["w"][0])))
  steps = [(i, value) for i, value in emitted if value != 0]
  # Finite micro-batches 1..10, the NaN after the fifth: groups {1,2}, {3,4}, {5,6,7}, {8,9,10}.
  assert steps == [(1, 1.5), (3, 3.5), (7, 6.0), (10, 9.0)]
  assert int(state.applied_steps) == 4 and int(osf.skipped_steps(state)) == 1

  multi = optax.MultiSteps(optax.identity(), schedule)
  multi_state = multi.init(params)
  with jax.numpy_dtype_promotion("standard"):
    multi_steps = []
    for g in grads:
      updates, multi_state = multi.update(g, multi_state, params)
      if float(updates["w"][0]) != 0:
        multi_steps.append(float(updates["w"][0]))
  assert multi_steps == [value for _, value in steps]


@pytest.mark.parametrize("value,group", [(2.5, 2), (float("nan"), 1), (float("inf"), 1)])
def test_a_schedule_value_that_is_no_whole_number_is_truncated_or_one(value, group):
  # Documented as "floored at 1" alone: 2.5 grouped 2, silently, and a NaN's cast to int32
  # is left undefined by XLA.
  params = {"w": jnp.zeros((3,))}
  # Computed from the traced step, as a real schedule's value is: XLA casts it, not NumPy.
  tx = osf.accumulate_gradients(optax.identity(),
                                lambda step: jnp.float32(value) + 0 * step.astype(jnp.float32))
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(6):
    _, state = update({"w": jnp.ones((3,))}, state, params)
  assert int(state.applied_steps) == 6 // group


def test_an_injected_every_k_groups_as_the_int_does_and_changes_without_recompiling():
  # optax.inject_hyperparams hands every_k over as an int32 array, a tracer under jit:
  # 0.2 refused it ("every_k must be a positive int or a schedule").
  params = _params()
  grads = [_grads(i) for i in range(12)]
  injected = optax.inject_hyperparams(osf.accumulate_gradients)(_inner(), every_k=2)
  traces = []

  def update(grads, state, params):
    traces.append(1)
    return injected.update(grads, state, params)

  update = jax.jit(update)
  state = injected.init(params)
  with_two = []
  for g in grads[:6]:
    updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
    with_two.append(updates)
  plain_params, _, plain_history = run_steps(osf.accumulate_gradients(_inner(), 2), _params(),
                                             grads[:6])
  assert_trees_equal(with_two, plain_history)
  assert_trees_equal(params, plain_params)
  state.hyperparams["every_k"] = jnp.full_like(state.hyperparams["every_k"], 3)
  applied = []
  for g in grads[6:]:
    updates, state = update(g, state, params)
    applied.append(bool(jnp.any(updates["w"] != 0)))
  assert applied == [False, False, True, False, False, True]  # groups of three now
  assert len(traces) == 1
  with pytest.raises(ValueError, match="every_k must be a positive int"):
    optax.inject_hyperparams(osf.accumulate_gradients)(_inner(), every_k=0).init(params)


def test_a_group_size_injected_below_the_count_emits_at_once():
  # The count of a group can pass a smaller every_k injected mid-group: the next finite
  # micro-batch completes it (a test for `count == every_k` would wait for ever).
  params = _params()
  tx = optax.inject_hyperparams(osf.accumulate_gradients)(optax.sgd(1.0), every_k=4)
  state = tx.init(params)
  applied = []
  for i in range(7):
    if i == 3:
      state.hyperparams["every_k"] = jnp.full_like(state.hyperparams["every_k"], 2)
    updates, state = tx.update(_grads(i), state, params)
    applied.append(bool(jnp.any(updates["w"] != 0)))
  assert applied == [False, False, False, True, False, True, False]
  # The first group is the mean of the four micro-batches it holds.
  assert int(state.inner_state.applied_steps) == 2


@pytest.mark.parametrize("every_k", [1, lambda applied_steps: 0], ids=["one", "schedule_at_0"])
def test_a_group_of_one_steps_on_every_micro_batch(every_k):
  # every_k=1, and a schedule's 0 floored at 1: each call is the inner step itself.
  grads = [_grads(i) for i in range(5)]
  alone = run_steps(_inner(), _params(), grads)
  accumulated = run_steps(osf.accumulate_gradients(_inner(), every_k), _params(), grads)
  # Equal up to the fusion of a step compiled inside lax.cond (an ulp).
  assert_trees_close(accumulated[2], alone[2], rtol=1e-6)
  assert int(accumulated[1].applied_steps) == 5


def test_bfloat16_grads_of_float32_params_are_averaged_in_float32():
  # Mixed precision: float32 master params, bfloat16 gradients. The inner transformation
  # decides about dtypes (optax.sgd takes them): the mean is cast to the grads' dtype.
  params = _params()
  grads = [_grads(i, jnp.bfloat16) for i in range(2)]
  _, state, history = run_steps(osf.accumulate_gradients(optax.sgd(1.0), 2), params, grads,
                                dtype_promotion="standard")  # float32 params + bfloat16
  mean = jax.tree.map(lambda a, b: ((a.astype(jnp.float32) + b.astype(jnp.float32)) / 2)
                      .astype(jnp.bfloat16), *grads)
  assert_trees_equal(history[1], jax.tree.map(lambda m: -m, mean))
  assert int(state.applied_steps) == 1


def test_params_that_do_not_match_the_grads_are_named_whatever_the_inner():
  # optax.sgd never reads the params: accumulate_gradients checks them itself.
  tx = osf.accumulate_gradients(optax.sgd(0.1), 2)
  params = _params()
  with pytest.raises(ValueError, match=r"grads do not match params: missing from grads: "
                                       r"params\['extra'\]"):
    tx.update(_grads(0), tx.init(params), {**params, "extra": jnp.ones(3)})


def test_every_k_must_be_a_positive_int_or_a_schedule():
  for every_k in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match="every_k"):
      osf.accumulate_gradients(optax.sgd(0.1), every_k)
  # Past int32, the count it is compared with: refused here, not by the first update's
  # OverflowError.
  for every_k in (2**31, np.int64(2**40)):
    with pytest.raises(ValueError, match=r"every_k must be at most 2\*\*31 - 1"):
      osf.accumulate_gradients(optax.sgd(0.1), every_k)
  osf.accumulate_gradients(optax.sgd(0.1), 2**31 - 1)
  tx = osf.accumulate_gradients(optax.sgd(0.1), 2)
  params = _params()
  with pytest.raises(TypeError, match="AccumulationState"):
    tx.update(_grads(0), optax.sgd(0.1).init(params), params)


def test_reports_count_micro_batches_under_their_own_keys():
  # Micro-batch 1 is NaN in b (left out); the second group's mean overflows when
  # safefactor squares it (1e30), so safefactor's own guard skips that step.
  tx = osf.accumulate_gradients(osf.safefactor(0.1), 2)
  params = _params()
  state = tx.init(params)
  big = _grads(3)
  big["w"] = big["w"].at[0, 0].set(1e30)
  sequence = [_grads(0), _poisoned(1, "nan", leaf="b"), _grads(2), big, _grads(4),
              _poisoned(5, "inf"), _poisoned(6, "nan", leaf="b")]
  for grads in sequence:
    _, state = tx.update(grads, state, params)
  report = osf.nonfinite_report(state)
  expected = {
      "skipped_steps": 1, "consecutive_skips": 1, "steps": 2,
      "nonfinite_steps/params['w']": 1, "last_nonfinite_step/params['w']": 1,
      "skipped_micro_batches": 3, "consecutive_skipped_micro_batches": 2,
      "micro_batches": 7,
      "nonfinite_micro_batches/params['w']": 1, "nonfinite_micro_batches/params['b']": 2,
      "last_nonfinite_micro_batch/params['w']": 5, "last_nonfinite_micro_batch/params['b']": 6,
      "total_skipped_steps": 4,
  }
  # Exactly these keys: b was never non-finite in a step, so it has no step keys.
  assert report == expected
  assert int(osf.skipped_steps(state)) == report["total_skipped_steps"]
  summary = osf.nonfinite_summary(state)
  assert summary == (
      "4 skipped in total; guard0 (opt_state.inner_state): skipped 1 of 2 steps (1 in a "
      "row); non-finite: params['w'] x1 (last at step 1); accumulation "
      "(opt_state.micro_batches): skipped 3 of 7 micro-batches (2 in a "
      "row); non-finite: params['b'] x2 (last at micro-batch 6), params['w'] x1 (last at "
      "micro-batch 5)"), summary
  with pytest.raises(osf.NonFiniteStepsError, match=r"2 consecutive micro-batches.*"
                     r"at micro-batch 6 .*params\['b'\]"):
    osf.check_nonfinite_steps(state, max_consecutive=2)


@pytest.mark.parametrize("where", ["inner", "outer"])
def test_inject_hyperparams_and_chain(where):
  injected = optax.inject_hyperparams(osf.safefactor, static_args=("min_dim_size_to_factor",))(
      learning_rate=0.1, momentum=0.9, min_dim_size_to_factor=4)
  def build(safefactor):
    clip = optax.clip_by_global_norm(10.0)
    if where == "inner":
      return osf.accumulate_gradients(optax.chain(clip, safefactor), 2)
    return optax.chain(clip, osf.accumulate_gradients(safefactor, 2))

  tx, reference = build(injected), build(_inner())
  sequence = [_grads(0), _poisoned(1, "nan"), _grads(2), _grads(3), _grads(4)]
  results = []
  for candidate in (tx, reference):
    params, state = _params(), candidate.init(_params())
    update = jax.jit(candidate.update)
    with jax.numpy_dtype_promotion("standard"):  # inject_hyperparams' float count
      for grads in sequence:
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    results.append((params, int(osf.skipped_steps(state))))
  assert results[0][1] == results[1][1] == 1
  for a, b in zip(jax.tree.leaves(results[0][0]), jax.tree.leaves(results[1][0]), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_resume_mid_group_from_orbax_is_bit_identical(tmp_path):
  sequence = [_grads(i) for i in range(3 * K)]
  sequence[5] = _poisoned(5, "nan")
  cut = K + 3  # two finite micro-batches (and the NaN) into the second group
  params, state, _ = _run("safefactor", sequence[:cut])
  assert int(state.accumulated) == 2
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "mid_group", {"params": params, "opt_state": state})
  checkpointer.wait_until_finished()
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        {"params": params, "opt_state": state})
  restored = checkpointer.restore(tmp_path / "mid_group", target)
  assert isinstance(restored["opt_state"], osf.AccumulationState)
  resumed = _run("safefactor", sequence[cut:], restored["params"], restored["opt_state"])
  uninterrupted = _run("safefactor", sequence[cut:], params, state)
  assert_trees_equal(resumed[:2], uninterrupted[:2])
  assert int(osf.skipped_steps(resumed[1])) == 1


MESH_SPECS = {"w": P("data", "model"), "b": P("model")}
MESH_SHAPES = {"w": (16, 32), "b": (32,)}


def _mesh_grads(index, poison=False):
  rng = np.random.default_rng(index)
  grads = {k: rng.normal(size=s).astype(np.float32) for k, s in MESH_SHAPES.items()}
  if poison:  # one element, so on the mesh only one device's shard sees it
    grads["w"][15, 31] = np.nan
  return grads


_MESH_INNERS = {
    # The mean itself: the whole run is bit-identical on the mesh.
    "identity": optax.identity,
    # Inner arithmetic compiles per shard shape: safefactor's row and column means are
    # summed in another order (and XLA may contract a multiply-add differently), so its
    # steps agree to an ulp; the accumulation itself is still bit-identical.
    "safefactor": lambda: osf.safefactor(0.1, momentum=0.9, min_dim_size_to_factor=8),
}


@pytest.mark.parametrize(("axis_type", "inner"), [
    (AxisType.Auto, "identity"), (AxisType.Explicit, "identity"),
    (AxisType.Explicit, "safefactor"),
], ids=["auto-identity", "explicit-identity", "explicit-safefactor"])
def test_sharded_mesh_is_bit_identical_to_one_device(axis_type, inner):
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type, axis_type))
  tx = osf.accumulate_gradients(_MESH_INNERS[inner](), 3)
  sequence = [_mesh_grads(i, poison=i == 4) for i in range(8)]
  values = {k: np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s)
            for k, s in MESH_SHAPES.items()}

  def run(place):
    params = place(values)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for grads in sequence:
      updates, state = update(place(grads), state, params)
      params = optax.apply_updates(params, updates)
    return params, state

  single_params, single_state = run(lambda tree: jax.tree.map(jnp.asarray, tree))
  with jax.set_mesh(mesh):
    sharded_params, sharded_state = run(
        lambda tree: {k: jax.device_put(v, NamedSharding(mesh, MESH_SPECS[k]))
                      for k, v in tree.items()})
    for name, spec in MESH_SPECS.items():
      accumulator = sharded_state.accumulator[name]
      assert accumulator.sharding.is_equivalent_to(NamedSharding(mesh, spec), accumulator.ndim)
  # The NaN on one device's shard is skipped on all of them: one global decision.
  assert int(osf.skipped_steps(sharded_state)) == int(osf.skipped_steps(single_state)) == 1
  assert int(sharded_state.applied_steps) == 2 and int(sharded_state.accumulated) == 1
  sharded = jax.tree.map(np.asarray, (sharded_params, sharded_state))
  if inner == "identity":
    assert_trees_equal(sharded, (single_params, single_state))
  else:
    assert_trees_equal(sharded[1].accumulator, single_state.accumulator)
    assert_trees_close(sharded, (single_params, single_state), rtol=1e-6)


class _MLP(nnx.Module):
  def __init__(self, rngs, partitioned=False):
    def init(names):
      base = nnx.initializers.lecun_normal()
      return nnx.with_partitioning(base, names) if partitioned else base

    self.up = nnx.Linear(16, 32, kernel_init=init(("data", "model")), rngs=rngs)
    self.down = nnx.Linear(32, 4, kernel_init=init(("model", None)), rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x)))


def _batches():
  inputs = jax.random.normal(jax.random.PRNGKey(1), (8, 16))
  targets = jax.random.normal(jax.random.PRNGKey(2), (8, 4))
  return inputs, targets


def test_nnx_optimizer_over_partitioned_params():
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

  @nnx.jit
  def train_step(model, optimizer, inputs, targets, poison):
    def loss_fn(model):
      return jnp.mean((model(inputs) - targets) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    grads = jax.tree.map(lambda g: jnp.where(poison, jnp.nan, g), grads)
    optimizer.update(model, grads)
    return loss

  with jax.set_mesh(mesh):
    model = _MLP(nnx.Rngs(0), partitioned=True)
    optimizer = nnx.Optimizer(model, osf.accumulate_gradients(osf.safefactor(1e-2), 2),
                              wrt=nnx.Param)
    accumulator = optimizer.opt_state.accumulator["up"]["kernel"]
    assert accumulator.get_metadata()["out_sharding"] == ("data", "model")
    inputs, targets = _batches()
    losses = [float(train_step(model, optimizer, inputs, targets, i == 3)) for i in range(9)]
  assert int(osf.skipped_steps(optimizer.opt_state)) == 1
  # nnx.Optimizer counts update calls, which are micro-batches here (as the README says):
  # the applied steps are the state's.
  assert int(optimizer.step[...]) == 9
  assert int(optimizer.opt_state.applied_steps[...]) == 4
  assert losses[-1] < losses[0]


def test_linen_train_state():
  model = nn.Dense(4)
  inputs, targets = _batches()
  params = model.init(jax.random.PRNGKey(0), inputs)["params"]
  state = train_state.TrainState.create(
      apply_fn=model.apply, params=params,
      tx=osf.accumulate_gradients(osf.safefactor(1e-2), 2))

  @jax.jit
  def train_step(state, poison):
    def loss_fn(params):
      return jnp.mean((state.apply_fn({"params": params}, inputs) - targets) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    grads = jax.tree.map(lambda g: jnp.where(poison, jnp.inf, g), grads)
    return state.apply_gradients(grads=grads), loss

  losses = []
  for i in range(9):
    state, loss = train_step(state, i == 2)
    losses.append(float(loss))
  assert int(osf.skipped_steps(state.opt_state)) == 1
  assert int(state.opt_state.applied_steps) == 4
  assert osf.nonfinite_report(state.opt_state)["nonfinite_micro_batches/params['kernel']"] == 1
  assert losses[-1] < losses[0]
