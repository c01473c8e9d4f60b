"""skip_nonfinite and skipped_steps, around safefactor and around any optax transform."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from optax_safefactor._src import guard
from tests.helpers import assert_trees_bitwise_equal, assert_trees_equal, run_steps


def _nan_at(steps):
  def grads(step):
    value = jnp.nan if step in steps else 1.0
    return {"a": jnp.full((3,), value), "b": jnp.ones((2, 2))}

  return grads


def test_wraps_a_plain_optax_transform():
  params = {"a": jnp.ones((3,)), "b": jnp.ones((2, 2))}
  tx = osf.skip_nonfinite(optax.adam(0.1))
  with jax.numpy_dtype_promotion("standard"):  # optax.adam mixes int and float counts
    _, state, history = run_steps(tx, params, _nan_at({1, 2, 4}), 6)
    _, expected_state, _ = run_steps(optax.adam(0.1), params, _nan_at(set()), 3)
  assert int(osf.skipped_steps(state)) == 3
  assert int(state.consecutive_skips) == 0 and int(state.step) == 6
  assert state.nonfinite_steps.host_values() == {"params['a']": 3, "params['b']": 0}
  assert int(state.last_nonfinite_step.per_leaf()["a"]) == 4
  assert int(state.inner_state[0].count) == 3
  assert_trees_equal(state.inner_state, expected_state)
  for step in (1, 2, 4):
    assert all(float(jnp.sum(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(history[step]))


def test_consecutive_counter():
  params = {"a": jnp.ones((3,)), "b": jnp.ones((2, 2))}
  _, state, _ = run_steps(osf.safefactor(0.1), params, _nan_at({3, 4, 5}), 6)
  assert int(state.consecutive_skips) == 3 and int(state.skipped_steps) == 3


def test_max_consecutive_raises_with_leaf_names():
  # Under jax.jit the error is raised on the host through a callback, and JAX delivers
  # it wrapped in JaxRuntimeError, whose message carries the original.
  params = {"a": jnp.ones((3,)), "b": jnp.ones((2, 2))}
  tx = osf.safefactor(0.1, max_consecutive_skips=2)
  state = tx.init(params)
  update = jax.jit(tx.update)
  grads = _nan_at({1, 2})
  _, state = update(grads(0), state, params)
  _, state = update(grads(1), state, params)
  jax.block_until_ready(state)
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"NonFiniteStepsError.*2 consecutive optimizer steps.*params\['a'\]"):
    _, state = update(grads(2), state, params)
    jax.block_until_ready(state)


def test_max_consecutive_raises_its_own_type_eagerly():
  # 0.1 raised it from a host callback even eagerly, so it arrived as JaxRuntimeError
  # and ``except osf.NonFiniteStepsError`` never caught it.
  params = {"a": jnp.ones((3,)), "b": jnp.ones((2, 2))}
  grads = _nan_at({1, 2})
  for tx in (osf.safefactor(0.1, max_consecutive_skips=2),
             osf.skip_nonfinite(optax.sgd(0.1), max_consecutive=2)):
    state = tx.init(params)
    _, state = tx.update(grads(0), state, params)
    _, state = tx.update(grads(1), state, params)
    with pytest.raises(osf.NonFiniteStepsError) as caught:
      tx.update(grads(2), state, params)
    assert type(caught.value) is osf.NonFiniteStepsError
    assert "params['a']" in str(caught.value) and "params['b']" not in str(caught.value)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_run_already_past_max_consecutive_stops_at_its_next_skip(jit):
  # The count can be past the bound without passing through it: a state resumed under a
  # smaller max_consecutive than it ran with. The next skipped step must stop the run.
  params = {"a": jnp.ones((3,)), "b": jnp.ones((2, 2))}
  grads = _nan_at({0, 1, 2, 3, 4})
  _, state, _ = run_steps(osf.safefactor(0.1), params, grads, 4)  # no bound: 4 in a row
  assert int(state.consecutive_skips) == 4
  tx = osf.safefactor(0.1, max_consecutive_skips=2)
  update = jax.jit(tx.update) if jit else tx.update
  error = jax.errors.JaxRuntimeError if jit else osf.NonFiniteStepsError
  with pytest.raises(error, match=r"5 consecutive optimizer steps"):
    jax.block_until_ready(update(grads(4), state, params))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_injected_bound_stops_the_run_as_a_static_one_does(jit):
  # optax.inject_hyperparams makes max_consecutive_skips an array, traced under jax.jit: the
  # host callback closed over it and every step after the first failed with JAX's
  # UnexpectedTracerError instead of running (or raising this library's error).
  params = {"a": jnp.ones((3,)), "b": jnp.ones((2, 2))}
  grads = _nan_at({1, 2, 3})
  tx = optax.inject_hyperparams(osf.safefactor)(learning_rate=0.1, max_consecutive_skips=3)
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  for step in range(3):
    _, state = update(grads(step), state, params)
    jax.block_until_ready(state)
  assert int(osf.skipped_steps(state)) == 2
  error = jax.errors.JaxRuntimeError if jit else osf.NonFiniteStepsError
  with pytest.raises(error, match=r"3 consecutive optimizer steps.*params\['a'\]"):
    jax.block_until_ready(update(grads(3), state, params))


def test_a_sharded_step_over_its_bound_calls_the_host_once(monkeypatch):
  # In one process the host callback runs once per step, not once per device of a mesh
  # (which logged the error once per device): only several processes partition it, so
  # that each of them stops (tests/test_multihost.py).
  calls = []
  monkeypatch.setattr(guard, "_raise_if_over", lambda *flags, **names: calls.append(flags))
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  params = {"w": jax.device_put(jnp.ones((64, 256)), sharding)}
  grads = {"w": jax.device_put(jnp.full((64, 256), jnp.nan), sharding)}
  tx = osf.safefactor(0.1, max_consecutive_skips=1)
  jax.block_until_ready(jax.jit(tx.update)(grads, tx.init(params), params))
  jax.effects_barrier()
  assert len(calls) == 1


def test_a_guard_over_an_empty_tree_with_a_bound_steps():
  # A masked-out subset can leave a guard no leaves at all.
  for tx in (osf.safefactor(0.1, max_consecutive_skips=2),
             osf.skip_nonfinite(optax.sgd(0.1), max_consecutive=2)):
    _, state, history = run_steps(tx, {}, [{}, {}], jit=False)
    assert int(osf.skipped_steps(state)) == 0 and history == [{}, {}]


def test_host_side_check_raises_its_own_type_between_jitted_steps():
  params = {"a": jnp.ones((3,)), "b": jnp.ones((2, 2))}
  tx = osf.safefactor(0.1)
  state = tx.init(params)
  update = jax.jit(tx.update)
  grads = _nan_at({1, 2})
  for step in range(3):
    _, state = update(grads(step), state, params)
    if step < 2:
      osf.check_nonfinite_steps(state, max_consecutive=2)
  with pytest.raises(osf.NonFiniteStepsError, match=r"at step 2 .*params\['a'\]"):
    osf.check_nonfinite_steps(state, max_consecutive=2)


@pytest.mark.parametrize("inner", ["safefactor", "chain"])
def test_a_guard_inside_another_guard_is_counted(inner):
  # The search stopped at the first guard: skip_nonfinite around a chain holding
  # safefactor (whose own guard zeroes the NaN step, so the outer one sees a finite
  # update) reported 0 skipped steps, and check_nonfinite_steps saw nothing.
  params = {"w": jnp.ones((4, 3))}
  wrapped = osf.safefactor(0.1)
  if inner == "chain":
    wrapped = optax.chain(optax.clip_by_global_norm(1.0), wrapped)
  tx = osf.skip_nonfinite(wrapped)
  state = tx.init(params)
  for value in (1.0, jnp.nan, jnp.nan, 1.0):
    _, state = tx.update({"w": jnp.full((4, 3), value)}, state, params)
  assert int(osf.skipped_steps(state)) == 2
  report = osf.nonfinite_report(state)
  assert report["total_skipped_steps"] == 2 and report["guard1/skipped_steps"] == 2
  assert report["skipped_steps"] == 0  # the outer guard's own
  where = "opt_state.inner_state[1]" if inner == "chain" else "opt_state.inner_state"
  assert (f"guard1 ({where}): skipped 2 of 4 steps (0 in a row)"
          in osf.nonfinite_summary(state))
  with pytest.raises(osf.NonFiniteStepsError):
    # Two in a row after the third step.
    mid = tx.init(params)
    for value in (1.0, jnp.nan, jnp.nan):
      _, mid = tx.update({"w": jnp.full((4, 3), value)}, mid, params)
    osf.check_nonfinite_steps(mid, max_consecutive=2)


# optax.scale(1e39) overflows float32 on purpose: that is the non-finite step.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_reports_agree_over_several_guards():
  # 0.1's summary re-parsed the report's keys and ignored every guard but the first:
  # after one step of this chain it said "no non-finite steps" while skipped_steps was 1.
  params = {"a": jnp.ones((3,))}
  tx = optax.chain(osf.skip_nonfinite(optax.identity()),
                   osf.skip_nonfinite(optax.scale(1e39)))
  _, state = tx.update(params, tx.init(params), params)
  report = osf.nonfinite_report(state)
  assert int(osf.skipped_steps(state)) == 1 == report["total_skipped_steps"]
  assert report["skipped_steps"] == 0 and report["guard1/skipped_steps"] == 1
  summary = osf.nonfinite_summary(state)
  assert summary.startswith("1 skipped in total;"), summary
  assert "guard1 (opt_state[1]): skipped 1 of 1 step (" in summary, summary
  assert "params['a'] x1" in summary


def test_max_consecutive_must_be_positive():
  with pytest.raises(ValueError, match="max_consecutive"):
    osf.skip_nonfinite(optax.sgd(0.1), max_consecutive=0)


@pytest.mark.parametrize("value", [0, -1, 1.5, 2.0, True, "3"])
def test_max_consecutive_must_be_a_positive_int_in_both_places(value):
  # check_nonfinite_steps(max_consecutive=0) raised a false "0 consecutive optimizer
  # steps were non-finite ... at step -1" on a fresh, healthy state; skip_nonfinite
  # took int(value), so 1.5 and True passed and "3" failed later with its own error.
  state = osf.safefactor(0.1).init({"a": jnp.ones(3)})
  with pytest.raises(ValueError, match=rf"max_consecutive must be a positive int, got "
                     rf"{re.escape(repr(value))} \(check_nonfinite_steps raises once"):
    osf.check_nonfinite_steps(state, max_consecutive=value)
  with pytest.raises(ValueError, match=r"max_consecutive must be a positive int or None, got"):
    osf.skip_nonfinite(optax.sgd(0.1), max_consecutive=value)


def test_max_consecutive_accepts_ints_of_any_kind():
  state = osf.safefactor(0.1).init({"a": jnp.ones(3)})
  for value in (1, np.int32(2), jnp.asarray(3)):
    osf.check_nonfinite_steps(state, max_consecutive=value)
    osf.skip_nonfinite(optax.sgd(0.1), max_consecutive=value)


def test_messages_count_in_good_english():
  # "skipped 1 of 1 steps", "no skipped steps in 0 steps" and "1 consecutive optimizer
  # steps were non-finite" before.
  params = {"a": jnp.ones(3)}
  tx = osf.safefactor(0.1)
  state = tx.init(params)
  assert osf.nonfinite_summary(state) == "no steps yet"
  _, state = tx.update({"a": jnp.full(3, jnp.nan)}, state, params)
  assert osf.nonfinite_summary(state) == (
      "skipped 1 of 1 step (1 in a row); non-finite: params['a'] x1 (last at step 0)")
  with pytest.raises(osf.NonFiniteStepsError,
                     match=r"^1 optimizer step was non-finite and skipped \(max_consecutive=1\); "
                     r"at step 0 "):
    osf.check_nonfinite_steps(state, max_consecutive=1)
  eager = osf.skip_nonfinite(optax.sgd(0.1), max_consecutive=1)
  with pytest.raises(osf.NonFiniteStepsError, match=r"^1 optimizer step was non-finite"):
    eager.update({"a": jnp.full(3, jnp.nan)}, eager.init(params), params)

  accumulate = osf.accumulate_gradients(osf.safefactor(0.1), 2)
  state = accumulate.init(params)
  assert osf.nonfinite_summary(state) == (
      "0 skipped in total; guard0 (opt_state.inner_state): no steps yet; accumulation "
      "(opt_state.micro_batches): no micro-batches yet")
  _, state = accumulate.update({"a": jnp.full(3, jnp.inf)}, state, params)
  assert ("accumulation (opt_state.micro_batches): skipped 1 of 1 micro-batch (1 in a row)"
          in osf.nonfinite_summary(state))
  with pytest.raises(osf.NonFiniteStepsError, match=r"^1 micro-batch was non-finite and skipped"):
    osf.check_nonfinite_steps(state, max_consecutive=1)


def test_skipped_steps_is_found_through_wrappers():
  params = {"a": jnp.ones((3,)), "b": jnp.ones((2, 2))}
  tx = optax.chain(
      optax.inject_hyperparams(osf.safefactor)(learning_rate=0.1),
      osf.skip_nonfinite(optax.scale(1.0)),
  )
  with jax.numpy_dtype_promotion("standard"):
    _, state, _ = run_steps(tx, params, _nan_at({0, 2}), 3)
  # The outer guard sees zeros from the inner one: only the inner guard skips.
  assert int(osf.skipped_steps(state)) == 2
  with pytest.raises(ValueError, match=r"no skip_nonfinite state.*accumulate_gradients\?$"):
    osf.skipped_steps(optax.sgd(0.1).init(params))


@pytest.mark.parametrize("report", [osf.skipped_steps, osf.nonfinite_report,
                                    osf.nonfinite_summary])
def test_the_reports_on_optax_apply_if_finite_say_where_its_counts_are(report):
  # optax's own guard around safefactor without its guard: the reports found nothing and
  # said only that.
  params = {"w": jnp.ones((3,))}
  tx = optax.chain(optax.clip(1.0), optax.apply_if_finite(
      osf.safefactor(0.1, skip_nonfinite_steps=False), 3))
  with pytest.raises(ValueError, match=r"no skip_nonfinite state .* It holds "
                                       r"optax.apply_if_finite's state, which counts in its "
                                       r"own fields: opt_state\[1\]\.total_notfinite "):
    report(tx.init(params))


def test_the_reports_name_every_optax_apply_if_finite_they_find():
  # Each part of a multi_transform under its own apply_if_finite counts its own steps: the
  # error named the first part's counts only.
  params = {"a": jnp.ones((3,)), "b": jnp.ones((2,))}
  parts = {part: optax.apply_if_finite(osf.safefactor(0.1, skip_nonfinite_steps=False), 3)
           for part in ("x", "y")}
  tx = optax.multi_transform(parts, {"a": "x", "b": "y"})
  with pytest.raises(ValueError, match=re.escape(
      " It holds optax.apply_if_finite's states, which count in their own fields: "
      "opt_state.inner_states['x'].inner_state.total_notfinite, "
      "opt_state.inner_states['y'].inner_state.total_notfinite (and .notfinite_count, in a "
      "row)")):
    osf.skipped_steps(tx.init(params))


def test_state_nonfinite_is_caught_for_plain_transforms():
  # An inner transform whose state goes non-finite while its updates stay finite.
  def init(params):
    return {"acc": jnp.zeros(())}

  def update(updates, state, params=None):
    return jax.tree.map(jnp.zeros_like, updates), {"acc": state["acc"] + jnp.inf}

  tx = osf.skip_nonfinite(optax.GradientTransformation(init, update))
  params = {"a": jnp.ones(3)}
  _, state = tx.update(params, tx.init(params), params)
  assert int(state.skipped_steps) == 1 and float(state.inner_state["acc"]) == 0.0


def test_a_state_leaf_that_changes_dtype_is_kept_in_the_wider():
  # optax.adam's moments of bfloat16 params take float32 grads' dtype: lax.select of the
  # new and old moments failed on their dtypes. The run equals adam's alone, and a skipped
  # step keeps the old moments exactly (in float32, which holds every bfloat16 value).
  params = {"w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.bfloat16).reshape(4, 3)}
  grads = [{"w": jnp.cos(jnp.arange(12.0) * (step + 1)).reshape(4, 3)} for step in range(4)]
  poisoned = [*grads[:2], {"w": jnp.full((4, 3), jnp.nan)}, *grads[2:]]
  with jax.numpy_dtype_promotion("standard"):  # bfloat16 params, float32 grads
    _, bare_state, bare_updates = run_steps(optax.sgd(0.1, momentum=0.9), params, grads,
                                            apply_updates=False)
    _, state, updates = run_steps(osf.skip_nonfinite(optax.sgd(0.1, momentum=0.9)), params,
                                  poisoned, apply_updates=False)
  assert_trees_bitwise_equal(state.inner_state, bare_state)
  assert_trees_bitwise_equal(updates[:2] + updates[3:], bare_updates)
  assert int(osf.skipped_steps(state)) == 1


@pytest.mark.parametrize("key", [0, "typed"])
def test_a_prng_key_in_the_wrapped_state_is_kept(key):
  # A key's dtype is no number type: it is selected as it is, never promoted.
  key = jax.random.key(0) if key == "typed" else key
  params = {"w": jnp.ones(3)}
  tx = osf.skip_nonfinite(optax.noisy_sgd(0.1, key=key))
  state = tx.init(params)
  with jax.numpy_dtype_promotion("standard"):  # noisy_sgd mixes Python floats and int32
    _, state = jax.jit(tx.update)({"w": jnp.ones(3)}, state, params)
    _, skipped = jax.jit(tx.update)({"w": jnp.full(3, jnp.nan)}, state, params)
  assert int(osf.skipped_steps(skipped)) == 1

  def key_bits(guard_state):
    found = optax.tree_utils.tree_get(guard_state.inner_state, "rng_key")
    return (jax.random.key_data(found) if jnp.issubdtype(found.dtype, jax.dtypes.prng_key)
            else found)

  assert_trees_bitwise_equal(key_bits(skipped), key_bits(state))
