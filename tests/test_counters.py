"""Several skip_nonfinite guards in one state: counts are exact sums, reports keep them apart.

``osf.skipped_steps`` promises the total over every guard found anywhere in a state
(inside ``chain``, ``inject_hyperparams``, ``MultiSteps``, ...). A total that read only
the first guard found passes every single-guard test, so each test here has guards
that skip on different steps, and some steps where both skip.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from optax_safefactor._src.counters import _listed
from tests.helpers import run_steps

PARAMS = {"w": jnp.ones((3, 2)), "v": jnp.ones((4,))}


def _filled(value_for):
  """Gradients shaped like ``PARAMS``; ``value_for(name)`` gives each leaf's value."""
  return {name: jnp.full(p.shape, value_for(name), jnp.float32) for name, p in PARAMS.items()}


def _run(tx, grads_sequence, params=PARAMS):
  # Every step reads the same params; MultiSteps mixes int and float counts.
  _, state, history = run_steps(tx, params, grads_sequence, apply_updates=False,
                                dtype_promotion="standard")
  return state, history


# First guard: skips when the gradient is NaN (and then passes zeros on). Second guard:
# 1e30 times a gradient of 1e10 overflows, so it skips exactly the steps with 1e10.
_CHAIN_VALUES = [1.0, 1e10, np.nan, 1e10, 1.0]


def _two_guard_chain():
  return optax.chain(osf.skip_nonfinite(optax.identity()), osf.skip_nonfinite(optax.scale(1e30)))


def test_skipped_steps_sums_guards_in_a_chain():
  # Guards against a total that counts only the first guard found (2 of 3 skips lost).
  state, history = _run(_two_guard_chain(), [_filled(lambda _, v=v: v) for v in _CHAIN_VALUES])
  assert int(osf.skipped_steps(state)) == 1 + 2
  for step in (1, 2, 3):
    assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(history[step]))
  np.testing.assert_array_equal(history[4]["w"], np.full((3, 2), 1e30, np.float32))


def test_both_guards_skipping_the_same_step_count_twice():
  # Scaling by Inf: the second guard skips every step, and the NaN step is skipped by
  # both (the first passes zeros on, and 0 * Inf is NaN).
  tx = optax.chain(osf.skip_nonfinite(optax.identity()), osf.skip_nonfinite(optax.scale(np.inf)))
  state, _ = _run(tx, [_filled(lambda _: 1.0), _filled(lambda _: np.nan), _filled(lambda _: 1.0)])
  report = osf.nonfinite_report(state)
  assert (report["skipped_steps"], report["guard1/skipped_steps"]) == (1, 3)
  assert int(osf.skipped_steps(state)) == 4


def test_report_prefixes_every_later_guard():
  """Each guard's counters, under ``guard<i>/`` for the second and later ones.

  Guards against a report whose later guards overwrite the first one's keys.
  """
  state, _ = _run(_two_guard_chain(), [_filled(lambda _, v=v: v) for v in _CHAIN_VALUES])
  first = {"skipped_steps": 1, "consecutive_skips": 0, "steps": 5,
           "nonfinite_steps/params['v']": 1, "nonfinite_steps/params['w']": 1,
           "last_nonfinite_step/params['v']": 2, "last_nonfinite_step/params['w']": 2}
  second = {"skipped_steps": 2, "consecutive_skips": 0, "steps": 5,
            "nonfinite_steps/params['v']": 2, "nonfinite_steps/params['w']": 2,
            "last_nonfinite_step/params['v']": 3, "last_nonfinite_step/params['w']": 3}
  expected = {**first, **{f"guard1/{k}": v for k, v in second.items()}}
  report = osf.nonfinite_report(state)
  assert {key: report.get(key) for key in expected} == expected


def test_a_third_guard_gets_a_prefix_of_its_own():
  # The labels count the guards of a kind: with two, guard1 is the only prefix, and a count
  # that went wrong at the third (guard1 again, or no prefix) overwrote another's keys.
  tx = optax.chain(osf.skip_nonfinite(optax.identity()), osf.skip_nonfinite(optax.scale(1e30)),
                   osf.skip_nonfinite(optax.scale(np.inf)))  # the third skips every step
  state, _ = _run(tx, [_filled(lambda _, v=v: v) for v in _CHAIN_VALUES])
  report = osf.nonfinite_report(state)
  assert [report.get(key) for key in (
      "skipped_steps", "guard1/skipped_steps", "guard2/skipped_steps")] == [1, 2, 5]
  assert not any(key.startswith(("guard0/", "guard3/")) for key in report)
  assert int(osf.skipped_steps(state)) == 1 + 2 + 5


def test_a_bare_array_as_the_params_is_counted_as_one_leaf():
  # A tree of one node is a bare array here, not the leafless object optax.tree.map_params
  # inits with: its counts are a leaf's, named "params".
  params = jnp.ones((4, 3))
  tx = osf.safefactor(0.1)
  state, _ = _run(tx, [jnp.full((4, 3), v) for v in (0.5, np.nan, 0.5)], params)
  assert osf.nonfinite_report(state) == {
      "skipped_steps": 1, "consecutive_skips": 0, "steps": 3, "nonfinite_steps/params": 1,
      "last_nonfinite_step/params": 1, "total_skipped_steps": 1}


def test_counts_of_another_length_than_the_leaves_are_refused_by_name():
  # Another model's count vector in this state: the report raised zip's "argument 2 is
  # longer than argument 1", or, had zip not been strict, dropped the extra counts.
  state = osf.safefactor(0.1).init(PARAMS)
  counts = state.nonfinite_steps
  for length in (1, 3):
    wrong = state._replace(nonfinite_steps=type(counts)(jnp.zeros([length], jnp.int32),
                                                        counts.treedef))
    message = re.escape(
        f"this optimizer state holds {length} per-leaf counts for params of 2 leaves: it was "
        "not made for these params; restore with the state of optimizer.init(params)")
    with pytest.raises(ValueError, match=message):
      osf.nonfinite_report(wrong)
    with pytest.raises(ValueError, match=message):  # cut short or clamped before
      wrong.nonfinite_steps.per_leaf()


def test_guards_inside_multi_steps_and_inject_hyperparams():
  """Two safefactors (one under ``inject_hyperparams``), each on its own leaf, in MultiSteps.

  Guards against a total that loses every guard but the first. A finite gradient
  whose square overflows (1e20) poisons an accumulation window without staying in
  MultiSteps' accumulator (a NaN would: it is reset by multiplying with 0).
  """
  inner = optax.multi_transform(
      {"a": optax.inject_hyperparams(osf.safefactor)(learning_rate=0.1),
       "b": osf.safefactor(0.1)},
      {"w": "a", "v": "b"},
  )
  tx = optax.MultiSteps(inner, every_k_schedule=2)
  big = {3: {"w"}, 5: {"w", "v"}}  # mini-steps; windows end at 1, 3, 5 and 7
  grads = [_filled(lambda name, s=s: 1e20 if name in big.get(s, ()) else 1.0) for s in range(8)]
  state, history = _run(tx, grads)
  report = osf.nonfinite_report(state)
  # Window 1: only w's guard skips; window 2: both do.
  assert (report["skipped_steps"], report["guard1/skipped_steps"]) == (2, 1)
  assert (report["steps"], report["guard1/steps"]) == (4, 4)
  assert report["last_nonfinite_step/params['w']"] == 2
  assert report["guard1/last_nonfinite_step/params['v']"] == 2
  assert int(osf.skipped_steps(state)) == 3
  # The windows that were not skipped moved their leaf; skipped ones did not.
  moved = [{k: bool(jnp.any(u[k] != 0)) for k in ("w", "v")} for u in history[1::2]]
  assert moved == [{"w": True, "v": True}, {"w": False, "v": True},
                   {"w": False, "v": False}, {"w": True, "v": True}]


def test_summary_agrees_with_skipped_steps_for_several_guards():
  # 0.1's summary read the first guard only: "skipped 1 of 5 steps" here.
  state, _ = _run(_two_guard_chain(), [_filled(lambda _, v=v: v) for v in _CHAIN_VALUES])
  total = int(osf.skipped_steps(state))
  assert total == 3
  # "skipped 3 of ..." or "3 skipped ...": the summary states the same total.
  summary = osf.nonfinite_summary(state)
  assert re.search(rf"\bskipped {total}\b|\b{total} skipped\b", summary), summary


def test_an_ensembles_counts_are_refused_not_mislabelled():
  # Under jax.vmap the counts are (members, leaves): per_leaf gave each member's row to a
  # leaf name (the NaN of member 1's "b" was put on "w"), and host_values failed in zip.
  tx = osf.safefactor(0.1)
  params = {"b": jnp.zeros((3, 3)), "w": jnp.ones((3, 4, 3))}
  grads = {"b": jnp.ones((3, 3)).at[1, 0].set(jnp.nan), "w": jnp.ones((3, 4, 3))}
  _, state = jax.vmap(tx.update)(grads, jax.vmap(tx.init)(params), params)
  batch = r"holds counts of shape \(3, {}\): a batch of \(3,\) optimizers \(made under jax.vmap\)"
  for read in (state.nonfinite_steps.per_leaf, state.nonfinite_steps.host_values):
    with pytest.raises(ValueError, match="this LeafCounts " + batch.format(2)):
      read()
  with pytest.raises(ValueError, match="this HyperparamCounts " + batch.format(8)):
    state.nonfinite_hyperparams.host_values()
  member = jax.tree.map(lambda x: x[1], state)
  assert member.nonfinite_steps.host_values() == {"params['b']": 1, "params['w']": 0}
  assert {name: int(count) for name, count in member.nonfinite_steps.per_leaf().items()} == {
      "b": 1, "w": 0}


def test_a_list_of_names_past_four_says_how_many_there_are():
  # Five names show four and the count: at exactly five, a boundary one off dropped the
  # fifth unsaid.
  assert _listed(["a", "b", "c", "d"]) == "a, b, c, d"
  assert _listed(["a", "b", "c", "d", "e"]) == "a, b, c, d, ... (5 in all)"
