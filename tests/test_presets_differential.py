"""Presets as differential properties: random arguments of each peer's own signature.

``tests/test_presets.py`` runs each peer at a few settings on healthy params; here
Hypothesis draws each preset's arguments, on trees with an all-zero and a near-zero
leaf (where the smallest parameter scale, T5X's ``epsilon2``, HF's and torch's
``eps[1]``, decides the step), against the peer itself (transformers, torch) or the
float64 restatement (big_vision, T5X; ``tests/preset_references.py``). big_vision's
default weight-decay rule runs on names around its pattern ``.*/kernel``. Every guard
argument a preset passes on (``skip_spikes``, ``spike_window``,
``max_consecutive_skips``), whether ``safefactor`` guards itself or the preset wraps its
chain in ``skip_nonfinite``, is read back from the state and from what the guard does.
Runs are a few steps on small leaves.
"""

from __future__ import annotations

import warnings

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings

import optax_safefactor as osf
from tests.preset_references import BigVisionAdafactor, T5XAdafactor
from tests.test_presets import BOUND, _largest_difference, _run_preset, _run_reference, _run_torch

STEPS = 4
# A matrix, a vector, a stacked leaf, and leaves whose parameter scale is the smallest
# one: all zero, near zero (an RMS of about 1e-5, below every drawn minimum), and small
# (about 2e-3: between the drawn minima, and large enough that a weight decay scaled by
# the parameter scale shows).
SHAPES = {"m": (12, 10), "v": (7,), "s": (2, 6, 5), "zero": (6, 5), "tiny": (8,),
          "small": (4, 6)}


def _problem(seed: int, shapes=SHAPES):
  rng = np.random.default_rng(seed)
  params = {name: (rng.standard_normal(shape) * (0.5 + i / 4)).astype(np.float32)
            for i, (name, shape) in enumerate(shapes.items())}
  params["zero"] = np.zeros(shapes["zero"], np.float32)
  params["tiny"] = (rng.standard_normal(shapes["tiny"]) * 1e-5).astype(np.float32)
  params["small"] = (rng.standard_normal(shapes["small"]) * 2e-3).astype(np.float32)
  grads = [{name: (rng.standard_normal(shape) * (1 + 2 * (step % 2))).astype(np.float32)
            for name, shape in shapes.items()} for step in range(STEPS)]
  return params, grads


# T5X -------------------------------------------------------------------------------------


# Hypothesis tries the first of each list first: the values that tell a wrong mapping.
@settings(max_examples=7)
@given(epsilon2=st.sampled_from([0.2, 1e-2, 1e-3]), epsilon1=st.sampled_from([1e-30, 1e-20]),
       beta1=st.sampled_from([None, 0.9]), weight_decay_rate=st.sampled_from([None, 1e-3]),
       clipping_threshold=st.sampled_from([None, 1.0, 2.0]),
       max_parameter_scale=st.sampled_from([None, 0.5]), decay_rate=st.sampled_from([0.8, 0.6]),
       multiply_by_parameter_scale=st.sampled_from([True, True, False]),
       global_norm_clip_threshold=st.sampled_from([None, 5.0]), factored=st.booleans(),
       seed=st.integers(0, 2**16))
def test_t5x_follows_its_restatement_near_zero_params(seed, **kwargs):
  params, grads = _problem(seed)
  with warnings.catch_warnings():  # settings T5X ignores, as drawn: it ignores them too
    warnings.filterwarnings("ignore", ".* has no effect", UserWarning)
    tx = osf.presets.t5x(1e-2, min_dim_size_to_factor=4, **kwargs)
  ours, _ = _run_preset(tx, params, grads)
  reference = T5XAdafactor(1e-2, min_dim_size_to_factor=4, compute_dtype=np.float32, **kwargs)
  assert _largest_difference(ours, _run_reference(reference, params, grads)) <= BOUND[np.float32]


# big_vision ------------------------------------------------------------------------------

# Leaf names around big_vision's rule ``.*/kernel`` (a full match), and whether it decays.
BIG_VISION_NAMES = {
    "dense/kernel": True, "block/mlp/kernel": True, "dense/kernel_extra": False,
    "conv/kernel/x": False, "kernelish": False, "kernel": False, "head/my_kernel": False,
    "dense/bias": False,
}
BIG_VISION_SHAPES = [(12, 10), (7,), (10, 12), (6, 5), (8,), (2, 6, 5), (9,), (5,)]


def _nested(flat: dict) -> dict:
  tree: dict = {}
  for name, value in flat.items():
    *parents, leaf = name.split("/")
    node = tree
    for parent in parents:
      node = node.setdefault(parent, {})
    node[leaf] = value
  return tree


def _flat(tree: dict, prefix: str = "") -> dict:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat |= _flat(value, f"{prefix}{key}/")
    else:
      flat[prefix + key] = value
  return flat


@settings(max_examples=7)
@given(wd=st.sampled_from([1e-3, 1e-2]), min_dim_size_to_factor=st.sampled_from([4, 32]),
       decay_rate=st.sampled_from([0.8, 0.6]), beta2_cap=st.sampled_from([0.999, 0.9]),
       clipping_threshold=st.sampled_from([None, 1.0]), momentum=st.sampled_from([None, 0.9]),
       eps=st.sampled_from([1e-30, 1e-20]), scheduled=st.booleans(),
       seed=st.integers(0, 2**16))
def test_big_vision_decays_by_its_default_rule(scheduled, seed, **kwargs):
  """The preset's own ``.*/kernel`` mask (no override) against the restatement given
  each name's decision: names that only begin or end like the pattern do not decay."""
  rng = np.random.default_rng(seed)
  shapes = dict(zip(BIG_VISION_NAMES, BIG_VISION_SHAPES, strict=True))
  params = {name: (rng.standard_normal(shape) * 0.5).astype(np.float32)
            for name, shape in shapes.items()}
  grads = [{name: rng.standard_normal(shape).astype(np.float32)
            for name, shape in shapes.items()} for _ in range(STEPS)]

  def schedule(count):
    return jnp.minimum((jnp.asarray(count, jnp.float32) + 1) / 3, 1.0)

  with warnings.catch_warnings():  # a float32 momentum dtype with momentum drawn off
    warnings.filterwarnings("ignore", ".* has no effect", UserWarning)
    tx = osf.presets.big_vision(1e-2, schedule=schedule if scheduled else None,
                                dtype_momentum="float32", **kwargs)
  p = _nested({name: jnp.asarray(value) for name, value in params.items()})
  state = tx.init(p)
  update = jax.jit(tx.update)
  ours = []
  for g in grads:
    u, state = update(_nested({name: jnp.asarray(value) for name, value in g.items()}),
                      state, p)
    new = optax.apply_updates(p, u)
    ours.append({name: (np.asarray(before), np.asarray(_flat(new)[name]))
                 for name, before in _flat(p).items()})
    p = new
  reference = BigVisionAdafactor(
      1e-2, schedule=(lambda c: float(schedule(c))) if scheduled else None,
      wd_mask=BIG_VISION_NAMES, momentum_dtype=np.float32, compute_dtype=np.float32,
      **kwargs)
  assert _largest_difference(ours, _run_reference(reference, params, grads)) <= BOUND[np.float32]


# transformers and torch ------------------------------------------------------------------


@settings(max_examples=7)
@given(eps1=st.sampled_from([1e-30, 1e-20]), eps2=st.sampled_from([0.2, 1e-2, 1e-3]),
       clip_threshold=st.sampled_from([1.0, 2.0]), decay_rate=st.sampled_from([-0.8, -0.5]),
       beta1=st.sampled_from([None, 0.9]), weight_decay=st.sampled_from([0.3, 0.01, 0.0]),
       scale_parameter=st.sampled_from([True, True, False]), relative_step=st.booleans(),
       warmup_init=st.booleans(), seed=st.integers(0, 2**16))
def test_transformers_follows_hf_near_zero_params(eps1, eps2, relative_step, warmup_init, seed,
                                                  **kwargs):
  torch = pytest.importorskip("torch")
  hf = pytest.importorskip("transformers.optimization")
  kwargs |= dict(eps=(eps1, eps2), relative_step=relative_step,
                 warmup_init=warmup_init and relative_step,
                 lr=None if relative_step else 3e-3)
  params, grads = _problem(seed)
  with warnings.catch_warnings():  # eps[1] drawn without scale_parameter: HF ignores it too
    warnings.filterwarnings("ignore", ".* has no effect", UserWarning)
    tx = osf.presets.transformers(**kwargs)
  ours, _ = _run_preset(tx, params, grads)
  theirs = _run_torch(lambda ps: hf.Adafactor(ps, **kwargs), params, grads, torch)
  assert _largest_difference(ours, theirs) <= BOUND[np.float32]


@settings(max_examples=7)
@given(lr=st.sampled_from([1e-2, 0.3]), beta2_decay=st.sampled_from([-0.8, -0.5]),
       eps1=st.sampled_from([None, 1e-10]), eps2=st.sampled_from([0.2, 1e-2, 1e-3]),
       d=st.sampled_from([1.0, 3.0]), weight_decay=st.sampled_from([0.3, 0.05, 0.0]),
       maximize=st.booleans(), seed=st.integers(0, 2**16))
def test_torch_follows_torch_near_zero_params(eps1, eps2, seed, **kwargs):
  torch = pytest.importorskip("torch")
  kwargs["eps"] = (eps1, eps2)
  params, grads = _problem(seed)
  ours, _ = _run_preset(osf.presets.torch(**kwargs), params, grads)
  theirs = _run_torch(lambda ps: torch.optim.Adafactor(ps, **kwargs), params, grads, torch)
  assert _largest_difference(ours, theirs) <= BOUND[np.float32]


# The guard's arguments -------------------------------------------------------------------

# Each preset as built with and without steps after safefactor (big_vision always has the
# learning rate after it; transformers has its decay after it with the parameter scale):
# the guard is then skip_nonfinite around the chain, else safefactor's own.
GUARDED_PRESETS = {
    "big_vision": lambda **kw: osf.presets.big_vision(1e-2, **kw),
    "transformers_decay_after": lambda **kw: osf.presets.transformers(weight_decay=0.01, **kw),
    "transformers": lambda **kw: osf.presets.transformers(**kw),
    "torch": lambda **kw: osf.presets.torch(**kw),
    "t5x": lambda **kw: osf.presets.t5x(1e-2, **kw),
}
GUARD_PARAMS = {"dense": {"kernel": jnp.full((6, 4), 0.5), "bias": jnp.full((4,), 0.1)}}


def _spike_run(update, state, grads, healthy: int, factor: float):
  """``healthy`` steps of ``grads``, then one of ``grads * factor``: the final state."""
  for _ in range(healthy):
    _, state = update(grads, state, GUARD_PARAMS)
  _, state = update(jax.tree.map(lambda g: g * factor, grads), state, GUARD_PARAMS)
  return state


@settings(max_examples=7)
@given(preset=st.sampled_from(sorted(GUARDED_PRESETS)), spike_window=st.sampled_from([4, 6, 8]),
       skip_spikes=st.sampled_from([2.0, 5.0]), max_consecutive_skips=st.sampled_from([2, 3]))
def test_guard_arguments_reach_the_guard(preset, spike_window, skip_spikes,
                                         max_consecutive_skips):
  """The window is the state's, the rule decides once half of it is there, at
  ``skip_spikes`` floored standard deviations (2% of the mean: the healthy steps here
  have one norm), and the ``max_consecutive_skips``-th skip in a row raises."""
  tx = GUARDED_PRESETS[preset](skip_spikes=skip_spikes, spike_window=spike_window,
                               max_consecutive_skips=max_consecutive_skips)
  state = tx.init(GUARD_PARAMS)
  assert state.spikes.gradient_norms.shape == (spike_window,)
  update = jax.jit(tx.update)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.3), GUARD_PARAMS)
  above, below = 1 + 0.03 * skip_spikes, 1 + 0.01 * skip_spikes
  half = spike_window // 2
  # One healthy step short of half the window: no verdict yet, even far above.
  assert int(osf.skipped_spikes(_spike_run(update, state, grads, half - 1, 10.0))) == 0
  skipped = _spike_run(update, state, grads, half, above)
  assert int(osf.skipped_spikes(skipped)) == 1
  assert int(skipped.spikes.last_spike_step) == half
  assert int(osf.skipped_spikes(_spike_run(update, state, grads, half, below))) == 0
  # Called eagerly, the step that makes max_consecutive_skips skips in a row raises.
  poisoned = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads)
  for _ in range(max_consecutive_skips - 1):
    _, state = tx.update(poisoned, state, GUARD_PARAMS)
  with pytest.raises(osf.NonFiniteStepsError):
    tx.update(poisoned, state, GUARD_PARAMS)


def test_t5x_applies_the_rule_of_a_leaf_above_rank_2_without_batch_axes():
  """T5X ignores the factor rule of a matrix without batch axes, not of a rank-3 leaf: a
  rule that factors other axes than the heuristic's is followed there."""
  params = {"w": jnp.ones((3, 40, 48)), "m": jnp.ones((40, 48)), "b": jnp.ones((48,))}
  factor_map = [("w", ("row", "none", "column")), ("m", ("column", "row")), ("b", ("row",))]
  state = osf.presets.t5x(1e-2, min_dim_size_to_factor=4, factor_map=factor_map).init(params)
  moments = state.inner_state.second_moment
  assert (moments["w"].v_row.shape, moments["w"].v_col.shape) == ((3, 40, 1), (1, 40, 48))
  # The matrix's rule is ignored: the heuristic's rows (40) and columns (48).
  assert (moments["m"].v_row.shape, moments["m"].v_col.shape) == ((40, 1), (1, 48))
  # A vector's rule (a row without a column, which safefactor's own factor_rules refuse)
  # leaves it unfactored, as the heuristic does.
  assert moments["b"].v.shape == (48,)
