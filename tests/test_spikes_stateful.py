"""The spike rule driven by random sequences of steps, against its float64 restatement.

A ``RuleBasedStateMachine`` steps safefactor (plain, and with its small leaves packed) and
``skip_nonfinite`` around ``optax.sgd`` with steps given ``value=`` or not, gradient-norm
spikes, loss spikes, both at once, NaN gradients and NaN losses, runs of spikes up to and
past the bound, and checkpoint round trips. After every step it compares the verdict, the
counters, the recorded history and the reports with ``tests.reference.ReferenceSpikeRule``:
a rule that judges the wrong steps after a restart or after a step without a loss changes
the verdicts that follow, and the comparison names the first step where they part.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import optax_safefactor as osf
from tests.reference import ReferenceSpikeRule

THRESHOLD = 6.0
# A statistic this close to its limit (relative) is moved away from it: float32 and
# float64 may judge it differently, and that is rounding, not the rule.
AMBIGUOUS = 2e-3
NORMAL_LOSS = 2.0


def _small_params():
  # "w" is factored (min_dim_size_to_factor=2): its norm is read off the row statistics.
  return {"b": jnp.zeros(3), "c": jnp.zeros(2), "w": jnp.zeros((4, 3))}


def _packed_params():
  # 18 leaves of 2 elements: packed four to a group, the last group repeating two rows.
  return {**{f"p{i:02d}": jnp.zeros(2) for i in range(18)}, "w": jnp.zeros((4, 3))}


CONFIGURATIONS = {
    "safefactor": (lambda window: osf.safefactor(
        1e-2, momentum=0.9, min_dim_size_to_factor=2, skip_spikes=THRESHOLD,
        spike_window=window), _small_params, 4),
    "safefactor_packed": (lambda window: osf.safefactor(
        1e-2, momentum=0.9, min_dim_size_to_factor=2, skip_spikes=THRESHOLD,
        spike_window=window), _packed_params, 6),
    "skip_nonfinite": (lambda window: osf.skip_nonfinite(
        optax.sgd(1e-2, momentum=0.9), skip_spikes=THRESHOLD, spike_window=window),
        _small_params, 5),
}


@functools.cache
def _subject(name):
  """The optimizer, its params and its jitted update: compiled once, for every example."""
  make, params, window = CONFIGURATIONS[name]
  tx = make(window)
  return tx, params(), jax.jit(tx.update), window


def _leaf_names(params):
  return [f"params{jax.tree_util.keystr(path)}"
          for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def _direction(params, seed, largest):
  """A unit-norm gradient of random signs, ``largest``'s leaf clearly the largest part."""
  rng = np.random.default_rng(seed)
  names = sorted(params)
  weights = rng.uniform(0.3, 1.0, len(names))
  weights[largest % len(names)] = 3.0
  parts = {}
  for name, weight in zip(names, weights, strict=True):
    part = rng.normal(size=params[name].shape)
    parts[name] = part / np.linalg.norm(part) * weight
  total = np.sqrt(sum(np.sum(p ** 2) for p in parts.values()))
  return {name: part / total for name, part in parts.items()}


STEP_KINDS = ("normal", "norm_spike", "loss_spike", "both", "nan_gradient", "nan_loss")


class SpikeRuleMachine(RuleBasedStateMachine):
  """One optimizer stepped as hypothesis chooses, and the restatement beside it."""

  @initialize(name=st.sampled_from(sorted(CONFIGURATIONS)))
  def start(self, name):
    self.tx, self.params, self.update, self.window = _subject(name)
    self.names = _leaf_names(self.params)
    self.state = self.tx.init(self.params)
    self.rule = ReferenceSpikeRule(THRESHOLD, self.window, self.names)

  def _away_from_limit(self, scale, limit):
    """``scale`` moved until it is not within ``AMBIGUOUS`` of ``limit``."""
    while np.isfinite(limit) and abs(scale / limit - 1) < AMBIGUOUS:
      scale *= 1 - AMBIGUOUS
    return scale

  def _inputs(self, kind, with_value, seed, largest, noise):
    """This step's gradients and loss (``None``: no ``value=``)."""
    norm_limit, loss_limit = self.rule.limits()
    # The history restarts from a spike: a normal step then starts from any scale.
    scale = 50.0 * (1 + noise) if kind in ("norm_spike", "both") else 1 + noise
    direction = _direction(self.params, seed, largest)
    # The direction has norm 1: the gradient's norm is the scale (to float32's rounding).
    scale = self._away_from_limit(scale, norm_limit)
    grads = {k: (v * scale).astype(np.float32) for k, v in direction.items()}
    if kind == "nan_gradient":
      bad = sorted(grads)[largest % len(grads)]
      grads[bad].flat[seed % grads[bad].size] = np.nan
    loss = None
    if with_value or kind in ("loss_spike", "both", "nan_loss"):
      loss = 20.0 * (1 + noise) if kind in ("loss_spike", "both") else NORMAL_LOSS + noise
      loss = np.nan if kind == "nan_loss" else float(np.float32(self._away_from_limit(
          loss, loss_limit)))
    return grads, loss

  def _step(self, kind, with_value, seed, largest, noise):
    grads, loss = self._inputs(kind, with_value, seed, largest, noise)
    extra = {} if loss is None else {"value": jnp.float32(loss)}
    updates, self.state = self.update(grads, self.state, self.params, **extra)
    verdict = self.rule.step({f"params['{k}']": v for k, v in grads.items()}, loss)
    skipped = all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
    assert skipped == (verdict in ("nonfinite", "spike")), (verdict, self.rule.steps - 1)
    self._compare()

  def _compare(self):
    history = self.state.spikes
    rule = self.rule
    assert (int(history.length), int(history.position)) == (rule.length, rule.position)
    np.testing.assert_allclose(np.asarray(history.gradient_norms)[:rule.length],
                               rule.recorded_norms(), rtol=1e-5)
    # The state marks a step without a loss with the lowest float32 (never NaN, which
    # jax_debug_nans stops at); the reference with NaN.
    no_loss = np.float32(np.finfo(np.float32).min)
    np.testing.assert_allclose(np.asarray(history.losses)[:rule.length],
                               np.nan_to_num(rule.recorded_losses(), nan=no_loss), rtol=1e-6)
    assert not np.isnan(np.asarray(history.losses)).any()
    report = osf.nonfinite_report(self.state)
    expected = rule.report()
    assert sorted(report) == sorted(expected)
    for key, value in expected.items():
      if isinstance(value, float):
        np.testing.assert_allclose(report[key], value, rtol=1e-4, err_msg=key)
      else:
        assert report[key] == value, key
    assert int(osf.skipped_spikes(self.state)) == rule.skipped_spikes
    assert int(osf.skipped_steps(self.state)) == rule.skipped_steps
    summary = osf.nonfinite_summary(self.state)
    assert summary.startswith(rule.summary_start()), (summary, rule.summary_start())
    if rule.last_spike is not None:
      statistic = rule.last_spike.statistic.replace(" ", "_")
      clause = rule.spike_clause(report[f"last_spike_{statistic}"], report["last_spike_limit"])
      assert summary.endswith(clause), (summary, clause)
      if rule.skipped_steps == rule.skipped_spikes:
        assert summary == rule.summary_start() + clause

  @rule(kind=st.sampled_from(STEP_KINDS), with_value=st.booleans(),
        seed=st.integers(0, 2**16), largest=st.integers(0, 20),
        noise=st.floats(-0.1, 0.1))
  def step(self, kind, with_value, seed, largest, noise):
    self._step(kind, with_value, seed, largest, noise)

  @rule(kind=st.sampled_from(("norm_spike", "loss_spike", "both")), extra=st.integers(0, 2),
        with_value=st.booleans(), seed=st.integers(0, 2**16), largest=st.integers(0, 20))
  def spikes_in_a_row(self, kind, extra, with_value, seed, largest):
    # Up to the bound (window // 2 skips) and past it: the history restarts.
    for offset in range(self.window // 2 + extra):
      self._step(kind, with_value, seed + offset, largest + offset, 0.05 * (offset % 3 - 1))

  @rule(count=st.integers(1, 4), with_value=st.booleans(), seed=st.integers(0, 2**16))
  def normal_steps(self, count, with_value, seed):
    for offset in range(count):
      self._step("normal", with_value, seed + offset, seed + offset, 0.1 * np.sin(seed + offset))

  @precondition(lambda self: self.rule.steps > 0)
  @rule(layout=st.sampled_from(("device_get", "0.2 layout")))
  def checkpoint(self, layout):
    # What a checkpoint holds is host arrays: the run goes on from them as it was.
    state = jax.device_get(self.state)
    if layout == "0.2 layout":
      state = osf.migrate_from_0_2(osf.state_in_0_2_layout(state))
    self.state = state
    self._compare()


SpikeRuleMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25,
                                              deadline=None)
TestSpikeRule = SpikeRuleMachine.TestCase
