"""The reports name the right statistic and the right leaf: checked by value.

A spike where the gradient norm and the loss both rise is reported as the gradient norm's,
with its value and limit; a NaN put in the optimizer state of one of many small leaves,
stepped packed as the rows of one array, is charged to that leaf alone, at that step, and
not to the leaves it is packed with. The expected dicts and lines are written out, or come
from ``tests.reference.ReferenceSpikeRule``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from optax_safefactor._src import guard_records, spikes
from tests.reference import ReferenceSpikeRule

HELD = "Params and optimizer state hold the last finite step."
SPIKING = {
    "safefactor": lambda: osf.safefactor(0.1, momentum=0.9, skip_spikes=6.0, spike_window=8),
    "skip_nonfinite": lambda: osf.skip_nonfinite(optax.sgd(0.1, momentum=0.9),
                                                 skip_spikes=6.0, spike_window=8),
}


def _constant_grads(scale, largest="b"):
  """Norm ``scale``: ``largest`` holds 0.64 of the squares, the other leaf the rest."""
  other = "a" if largest == "b" else "b"
  return {largest: jnp.full(4, scale * 0.4), other: jnp.full(4, scale * 0.3)}


def _spiking_run(name, spike_grads, spike_loss, history_loss=2.0):
  """Eight steps of norm 1 and loss ``history_loss``, then the spike step; the state and
  the restatement's rule after it."""
  tx = SPIKING[name]()
  params = {"a": jnp.zeros(4), "b": jnp.zeros(4)}
  state = tx.init(params)
  rule = ReferenceSpikeRule(6.0, 8, ["params['a']", "params['b']"])
  steps = [(_constant_grads(1.0), history_loss)] * 8 + [(spike_grads, spike_loss)]
  for grads, loss in steps:
    _, state = tx.update(grads, state, params, value=jnp.float32(loss))
    rule.step({f"params['{k}']": np.asarray(v) for k, v in grads.items()}, loss)
  return state, rule


@pytest.mark.parametrize("name", sorted(SPIKING))
def test_both_statistics_spiking_is_reported_as_the_gradient_norm(name):
  # A constant history: the floor (2% of the mean) sets each limit at 1.12 times its
  # mean, 1.12 for the norm and 2.24 for the loss; both the norm (10) and the loss (20)
  # are above theirs.
  state, rule = _spiking_run(name, _constant_grads(10.0, largest="a"), 20.0)
  report = osf.nonfinite_report(state)
  assert report == {
      "skipped_steps": 1, "consecutive_skips": 0, "steps": 9, "skipped_spikes": 1,
      "consecutive_spikes": 1, "last_spike_step": 8,
      "last_spike_gradient_norm": pytest.approx(10.0, rel=1e-6),
      "last_spike_limit": pytest.approx(1.12, rel=1e-6),
      "last_spike_largest_gradient/params['a']": pytest.approx(8.0, rel=1e-6),
      "total_skipped_steps": 1,
  } == pytest.approx(rule.report(), rel=1e-6)
  assert osf.nonfinite_summary(state) == (
      "skipped 1 of 9 steps; 1 spike (last at step 8: gradient norm 10 > limit 1.12, "
      "largest in params['a'])")


@pytest.mark.parametrize("name", sorted(SPIKING))
def test_a_loss_spike_alone_is_reported_as_the_loss_with_its_limit(name):
  state, rule = _spiking_run(name, _constant_grads(1.0), 20.0)
  report = osf.nonfinite_report(state)
  assert report == {
      "skipped_steps": 1, "consecutive_skips": 0, "steps": 9, "skipped_spikes": 1,
      "consecutive_spikes": 1, "last_spike_step": 8,
      "last_spike_loss": pytest.approx(20.0, rel=1e-6),
      "last_spike_limit": pytest.approx(2.24, rel=1e-6),
      "last_spike_largest_gradient/params['b']": pytest.approx(0.8, rel=1e-6),
      "total_skipped_steps": 1,
  } == pytest.approx(rule.report(), rel=1e-6)
  assert osf.nonfinite_summary(state) == (
      "skipped 1 of 9 steps; 1 spike (last at step 8: loss 20 > limit 2.24, "
      "largest in params['b'])")


# 18 leaves of 4 elements: packed four to a group (p00-p03, ..., p12-p15), the last group
# p14-p17 repeating p14 and p15, whose results come from the group before.
PACKED = [f"p{i:02d}" for i in range(18)]


def _packed_params():
  return {name: jnp.full(4, 1.0 + i / 8) for i, name in enumerate(PACKED)}


def _packed_grads(scale=1.0):
  return {name: jnp.full(4, scale * (1.0 + i / 16)) for i, name in enumerate(PACKED)}


def _poison(state, part, leaf):
  """``state`` with one element of ``leaf``'s ``part`` of the optimizer state set to NaN."""
  inner = state.inner_state
  if part == "second_moment":
    moment = inner.second_moment[leaf]
    poisoned = {**inner.second_moment, leaf: moment._replace(v=moment.v.at[1].set(jnp.nan))}
    return state._replace(inner_state=inner._replace(second_moment=poisoned))
  if part == "momentum":
    poisoned = {**inner.momentum, leaf: inner.momentum[leaf].at[1].set(jnp.nan)}
    return state._replace(inner_state=inner._replace(momentum=poisoned))
  trace, rest = inner  # skip_nonfinite around optax.sgd with momentum: its trace
  poisoned = {**trace.trace, leaf: trace.trace[leaf].at[1].set(jnp.nan)}
  return state._replace(inner_state=(trace._replace(trace=poisoned), rest))


POISONED = {"second_moment": "safefactor", "momentum": "safefactor", "trace": "sgd"}


@functools.cache
def _jitted(name):
  """The optimizer and its jitted update, compiled once for every test that uses it."""
  tx = {"safefactor": lambda: osf.safefactor(0.1, momentum=0.9),
        "sgd": lambda: osf.skip_nonfinite(optax.sgd(0.1, momentum=0.9)),
        "spikes": lambda: osf.safefactor(0.1, momentum=0.9, min_dim_size_to_factor=2,
                                         skip_spikes=6.0, spike_window=4)}[name]()
  return tx, jax.jit(tx.update)


@pytest.mark.parametrize("leaf", ["p05", "p13", "p14", "p16"])
@pytest.mark.parametrize("part", sorted(POISONED))
def test_a_nan_in_one_packed_leafs_state_is_charged_to_that_leaf_alone(part, leaf):
  # p05 is inside a group, p13 beside p14 and p15, p14 is also a repeated row of the last
  # group, p16 is owned by the last group only.
  tx, update = _jitted(POISONED[part])
  params = _packed_params()
  state = tx.init(params)
  for _ in range(3):
    _, state = update(_packed_grads(), state, params)
  state = _poison(state, part, leaf)
  for _ in range(2):  # the NaN stays in the kept state: the next step is skipped too
    updates, state = update(_packed_grads(), state, params)
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  name = f"params['{leaf}']"
  assert osf.nonfinite_report(state) == {
      "skipped_steps": 2, "consecutive_skips": 2, "steps": 5,
      f"nonfinite_steps/{name}": 2, f"last_nonfinite_step/{name}": 4,
      "total_skipped_steps": 2,
  }
  assert osf.nonfinite_summary(state) == (
      f"skipped 2 of 5 steps (2 in a row); non-finite: {name} x2 (last at step 4)")
  with pytest.raises(osf.NonFiniteStepsError) as caught:
    osf.check_nonfinite_steps(state, max_consecutive=2)
  assert str(caught.value) == (
      "2 consecutive optimizer steps were non-finite and skipped (max_consecutive=2); at "
      f"step 4 the non-finite leaves were: {name}. {HELD}")


@pytest.mark.parametrize("largest", ["p00", "p13", "p14", "p17", "w"])
def test_the_spike_names_the_packed_leaf_with_the_largest_gradient(largest):
  tx, update = _jitted("spikes")
  params = {**_packed_params(), "w": jnp.ones((3, 2))}
  names = [f"params['{k}']" for k in sorted(params)]
  state = tx.init(params)
  rule = ReferenceSpikeRule(6.0, 4, names)
  spike = {**_packed_grads(20.0), "w": jnp.full((3, 2), 20.0)}
  spike[largest] = spike[largest] * 4
  for grads in [{**_packed_grads(), "w": jnp.ones((3, 2))}] * 4 + [spike]:
    _, state = update(grads, state, params)
    rule.step({f"params['{k}']": np.asarray(v) for k, v in grads.items()})
  report = osf.nonfinite_report(state)
  assert report == pytest.approx(rule.report(), rel=1e-5)
  leaf_norm = 80.0 * np.sqrt(np.size(params[largest])) * (
      1 if largest == "w" else 1 + PACKED.index(largest) / 16)
  assert report[f"last_spike_largest_gradient/params['{largest}']"] == pytest.approx(
      leaf_norm, rel=1e-6)
  assert osf.nonfinite_summary(state).endswith(f", largest in params['{largest}'])")


def test_check_nonfinite_steps_names_the_last_nonfinite_step_after_a_spike():
  # Two NaN steps, then a spike: the error named the spike's step (6) and "(optimizer state
  # only)", where the non-finite leaf was params['b'], at step 5.
  tx = osf.safefactor(0.1, skip_spikes=6.0, spike_window=4)
  params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
  state, update = tx.init(params), jax.jit(tx.update)
  for b in [1.0] * 4 + [np.nan] * 2:
    _, state = update({"w": jnp.ones((4, 3)), "b": jnp.ones(3).at[0].set(b)}, state, params)
  _, state = update({"w": jnp.full((4, 3), 100.0), "b": jnp.full(3, 100.0)}, state, params)
  assert int(osf.skipped_spikes(state)) == 1
  with pytest.raises(osf.NonFiniteStepsError, match=r"2 consecutive optimizer steps were "
                                                    r"non-finite .* at step 5 the non-finite "
                                                    r"leaves were: params\['b'\]\."):
    osf.check_nonfinite_steps(state, 2)


def test_finite_gradients_whose_norm_overflows_are_a_spike():
  # skip_nonfinite's spike rule read a norm that overflowed float32 (finite gradients of
  # 1e20) as a step it could not judge: the update of -1e19 was applied, nothing counted.
  tx = osf.skip_nonfinite(optax.sgd(0.1), skip_spikes=6.0, spike_window=4)
  params = {"w": jnp.ones((4, 3))}
  state, update = tx.init(params), jax.jit(tx.update)
  for scale in (1.0, 1.1, 0.9, 1.0, 1e20):
    updates, state = update({"w": jnp.full((4, 3), scale)}, state, params)
  assert not np.any(np.asarray(updates["w"]))
  assert int(osf.skipped_spikes(state)) == 1 and int(osf.skipped_steps(state)) == 1
  assert "gradient norm inf > limit" in osf.nonfinite_summary(state)
  # Before the rule judges (half the window), such a step is not a spike: it is applied.
  state = tx.init(params)
  updates, state = update({"w": jnp.full((4, 3), 1e20)}, state, params)
  assert int(osf.skipped_steps(state)) == 0 and float(updates["w"][0, 0]) == pytest.approx(-1e19)


@pytest.mark.parametrize("leaf", [-1, 2])
def test_a_spike_leaf_index_outside_the_tree_names_no_leaf(leaf):
  # The index is read from the state, which a user may have edited or built: one outside
  # the tree's leaves (here two) names none, rather than failing or naming another leaf.
  history = spikes.init_history(4)._replace(
      skipped_spikes=jnp.int32(1), last_spike_step=jnp.int32(3),
      last_spike_statistic=jnp.int32(spikes.GRADIENT_NORM), last_spike_leaf=jnp.int32(leaf),
      last_spike_value=jnp.float32(9.0), last_spike_limit=jnp.float32(2.0),
      last_spike_leaf_norm=jnp.float32(8.0))
  record = guard_records._spike_record(history, ["params['b']", "params['w']"])
  assert record.skipped == 1 and record.last_step == 3
  assert record.last_leaf is None
