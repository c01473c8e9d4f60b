"""Packing as a differential property: trees of small leaves whose settings differ, packed
and stepped alone, compared step by step.

Hypothesis draws trees of 16 to 24 small leaves, each with settings of its own: its shape
(vectors, and rank-2 and rank-3 leaves of the same size), its factor rule (the heuristic,
every axis ``"none"``, a ``"batch"`` axis, or factored slices), its dtype (float32 or
bfloat16) and its weight-decay mask (True, False or an array of its own, given as a tree,
a prefix tree or a callable); and for the whole tree momentum (float32 or bfloat16),
``param_rounding``, the reductions (clipping, the parameter scale), spike skipping and a
poison (a NaN put into one leaf's gradient, second moment or momentum at one step).

Both optimizers step from the same state and params at every step (the unpacked run's),
so that each step's results are compared on their own. The order of a row's sums is the
only difference ``pack_small_leaves`` allows ("its last bits"). Where no sum feeds the
update (no clipping, no parameter scale), packing changes nothing, bit for bit: updates,
every array of the state, the reports; but for one rounding of the momentum blend, which
XLA:CPU contracts into an FMA in one program and not in the other (seen with bfloat16
momentum on float32 leaves, as ``tests/test_packing.py`` saw it on a matrix), and the
spike rule's gradient norms, which are sums. Where one feeds it, a leaf's float results
are within the float summation bound of its size, plus an ulp of their dtype where a
narrow value is rounded. The second moment, the counters and every count and path of the
reports stay identical.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings

import optax_safefactor as osf
from optax_safefactor._src import packing

STEPS = 4
SIZE = 24
# Shapes of SIZE elements (packed together when their settings agree) and of another size.
SHAPES = [(SIZE,), (4, 6), (6, 4), (2, 3, 4), (10,), (2, 5)]
# The leaves that every tree has, so that one group of four always packs: vectors of
# float32, each with a weight-decay mask of its own (they differ within the group).
FIXED = 4
FIXED_BLOCK = "blk1"


def _summation_bound(size: int) -> float:
  r"""Two orders of a float32 sum of ``size`` non-negative terms, carried through the
  clipping's and the parameter scale's square roots and a few roundings
  (``tests/test_packing.py``'s bound): :math:`2\gamma_{n-1} + 4u`."""
  u = float(jnp.finfo(jnp.float32).eps) / 2
  gamma = (size - 1) * u / (1 - (size - 1) * u)
  return 2 * gamma + 4 * u


@st.composite
def _roles(draw, shape):
  """A factor rule's roles for one leaf: ``None`` (the heuristic: small leaves are not
  factored), every axis ``"none"``, a ``"batch"`` axis, or batch slices factored."""
  kinds = ["heuristic", "none"]
  if len(shape) >= 2:
    kinds.append("batch")
  if len(shape) == 3:
    kinds.append("factored")
  kind = draw(st.sampled_from(kinds))
  if kind == "heuristic":
    return None
  if kind == "none":
    return ("none",) * len(shape)
  if kind == "factored":
    return ("batch", "row", "column")
  batch_axis = draw(st.integers(0, len(shape) - 1))
  return tuple("batch" if axis == batch_axis else "none" for axis in range(len(shape)))


@st.composite
def _leaf(draw, dtypes):
  shape = draw(st.sampled_from(SHAPES))
  return dict(shape=shape, roles=draw(_roles(shape)), dtype=draw(st.sampled_from(dtypes)),
              mask=draw(st.sampled_from(["true", "false", "array"])))


@st.composite
def _configuration(draw, reductions: bool):
  dtypes = draw(st.sampled_from([("float32",), ("bfloat16",), ("float32", "bfloat16")]))
  count = draw(st.integers(16, 24))
  fixed = dict(shape=(SIZE,), roles=None, dtype="float32", mask="array")
  leaves = [fixed] * FIXED + [draw(_leaf(dtypes)) for _ in range(count - FIXED)]
  momentum = draw(st.sampled_from([None, 0.9]))
  clipping = draw(st.sampled_from([None, 1.0])) if reductions else None
  scale = draw(st.booleans()) if reductions else False
  if reductions and clipping is None and not scale:
    scale = True
  poison = draw(st.sampled_from(
      ["none", "grad", "second_moment"] + (["momentum"] if momentum else [])))
  return dict(
      leaves=leaves,
      seed=draw(st.integers(0, 2**16)),
      settings=dict(
          learning_rate=1e-2,
          momentum=momentum,
          # A momentum's dtype only with a momentum: elsewhere it warns that it has no effect.
          dtype_momentum=draw(st.sampled_from(["float32", "bfloat16"])) if momentum else "float32",
          clipping_threshold=clipping,
          multiply_by_parameter_scale=scale,
          weight_decay_rate=draw(st.sampled_from([None, 1e-2])),
          param_rounding=(rounding := draw(st.sampled_from(["nearest", "stochastic", "kahan"]))),
          # A seed only where it draws bits: elsewhere it warns that it has no effect.
          rounding_seed=draw(st.integers(0, 2**31 - 1)) if rounding == "stochastic" else 0,
          skip_spikes=(spikes := draw(st.sampled_from([None, 3.0]))),
          # A window only with spikes on: without them it warns that it has no effect.
          spike_window=4 if spikes else 128,
      ),
      mask_form=draw(st.sampled_from(["tree", "prefix", "callable"])),
      poison=poison,
      poison_leaf=draw(st.integers(0, count - 1)),
      poison_step=draw(st.integers(0, STEPS - 1)),
  )


def _place(count: int) -> list[tuple[str, str]]:
  """Each leaf's ``(block, name)``: the fixed leaves first in ``FIXED_BLOCK``, the rest
  alternating, so that names repeat under both blocks (the rounding bits are keyed by the
  whole path)."""
  places = [(FIXED_BLOCK, f"p{i:02d}") for i in range(FIXED)]
  places += [("blk0" if i % 2 else FIXED_BLOCK, f"p{FIXED + i // 2:02d}")
             for i in range(count - FIXED)]
  return places


def _nested(places, values):
  tree: dict = {}
  for (block, name), value in zip(places, values, strict=True):
    tree.setdefault(block, {})[name] = value
  return tree


def _path(block: str, name: str) -> str:
  return f"['{block}']['{name}']"


def _problem(config):
  """Params, gradients, factor rules and the weight-decay mask of one configuration."""
  rng = np.random.default_rng(config["seed"])
  leaves = config["leaves"]
  places = _place(len(leaves))
  # Each leaf at a scale of its own, and each slice too: a slice's RMS differs from its
  # leaf's, so a clipping or parameter scale not taken per slice shows.
  params = _nested(places, [
      jnp.asarray(rng.normal(size=leaf["shape"]) * rng.uniform(0.2, 2.0, size=leaf["shape"][:1]
                  + (1,) * (len(leaf["shape"]) - 1)), leaf["dtype"]) for leaf in leaves])
  grads = []
  for step in range(STEPS):
    # A jump at the last step: a spike for the spike rule, once it has seen the others.
    gain = 30.0 if step == STEPS - 1 else 1.0 + step % 2
    grads.append(_nested(places, [
        jnp.asarray(rng.normal(size=leaf["shape"]) * gain, leaf["dtype"]) for leaf in leaves]))
  roles_by_path = {_path(*place): leaf["roles"] for place, leaf in zip(places, leaves,
                                                                      strict=True)}

  def factor_rules(path, shape):
    del shape
    return roles_by_path[jax.tree_util.keystr(tuple(path))]

  def mask_of(leaf):
    if leaf["mask"] == "array":
      return jnp.asarray(rng.random(leaf["shape"]) < 0.5)
    return leaf["mask"] == "true"

  masks = {_path(*place): mask_of(leaf) for place, leaf in zip(places, leaves, strict=True)}
  mask = _nested(places, [masks[_path(*place)] for place in places])
  if config["mask_form"] == "prefix" and "blk0" in mask:
    mask["blk0"] = bool(rng.random() < 0.5)
  elif config["mask_form"] == "callable":
    # Called on the params in init and on the updates in update: it reads paths only.
    def mask(tree):
      return jax.tree_util.tree_map_with_path(
          lambda path, _: masks[jax.tree_util.keystr(tuple(path))], tree)
  return params, grads, factor_rules, mask, places


def _poisoned(config, state, grads, places, step):
  """The state and gradients of ``step``, with this configuration's NaN put in."""
  if config["poison"] == "none" or step != config["poison_step"]:
    return state, grads
  block, name = places[config["poison_leaf"]]

  def poison(x):
    return x.reshape(-1).at[x.size // 2].set(jnp.nan).reshape(x.shape)

  if config["poison"] == "grad":
    grads = jax.tree.map(lambda x: x, grads)
    grads[block][name] = poison(grads[block][name])
    return state, grads
  inner = state.inner_state
  field = config["poison"]
  tree = jax.tree.map(lambda x: x, getattr(inner, field), is_leaf=lambda x: x is None)
  value = tree[block][name]
  if value is None:  # a leaf of another dtype than its momentum's: still there
    return state, grads
  tree[block][name] = (type(value)(poison(value[0]), *value[1:])
                       if isinstance(value, tuple) else poison(value))
  return state._replace(inner_state=inner._replace(**{field: tree})), grads


class Tolerance(NamedTuple):
  """How far a run's float results may be from the other's, by what its settings do.

  ``blend``: the momentum blend :math:`\beta_1 m + (1-\beta_1) u` may be contracted into
  an FMA by XLA:CPU in one program and not in the other (a fusion of its own for a leaf
  alone, one for the packed rows), which is one rounding of the blend: :math:`4u` of the
  leaf's largest value, plus an ulp of the value's dtype where it is narrow.
  ``reduction``: the clipping's and the parameter scale's sums are in another order: the
  summation bound, plus an ulp of the value's dtype, or of the param a rounded update
  lands on (``param_rounding`` ``"stochastic"`` or ``"kahan"``: the update is then the
  difference of two params, and a last-bit difference can round it the other way).
  """

  blend: bool
  reduction: bool
  onto_params: bool


def _float_allowance(expected: np.ndarray, param_magnitude, tolerance: Tolerance, size: int):
  """Per element, how far a packed float result may be from the unpacked one."""
  if not (tolerance.blend or tolerance.reduction):
    return np.zeros(expected.shape)
  e = np.asarray(expected, np.float64)
  scale = float(np.max(np.abs(e))) if e.size else 0.0
  u = float(jnp.finfo(jnp.float32).eps) / 2
  relative = _summation_bound(size) if tolerance.reduction else 4 * u
  magnitude = np.abs(e)
  if tolerance.reduction and tolerance.onto_params:
    magnitude = magnitude + param_magnitude
  ulp = np.spacing(magnitude.astype(expected.dtype)).astype(np.float64)
  return relative * scale + ulp


def _compare_arrays(where, actual, expected, allowance):
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
  if not np.any(allowance) or not jnp.issubdtype(expected.dtype, jnp.floating):
    np.testing.assert_array_equal(actual.reshape(-1).view(np.uint8),
                                  expected.reshape(-1).view(np.uint8), err_msg=where)
    return
  a, e = actual.astype(np.float64), expected.astype(np.float64)
  assert np.array_equal(np.isnan(a), np.isnan(e)), where
  finite = ~np.isnan(e)
  excess = np.abs(a - e)[finite] - np.asarray(allowance)[finite]
  assert not np.any(excess > 0), (where, float(np.max(excess)))


def _by_path(tree):
  return {jax.tree_util.keystr(path): leaf for path, leaf in
          jax.tree_util.tree_flatten_with_path(tree)[0]}


def _compare_step(actual, expected, params, tolerance: Tolerance):
  """Updates and every array of the state: bit for bit, but for the floats that the
  momentum blend or a reduction feeds (``Tolerance``)."""
  (updates, state), (expected_updates, expected_state) = actual, expected
  magnitudes = {path: np.abs(np.asarray(p, np.float64)) for path, p in _by_path(params).items()}
  updates = _by_path(updates)
  for path, e in _by_path(expected_updates).items():
    e = np.asarray(e)
    _compare_arrays(f"update{path}", updates[path], e,
                    _float_allowance(e, magnitudes[path], tolerance, e.size))
  state = _by_path(state)
  for path, e in _by_path(expected_state).items():
    e = np.asarray(e)
    if not jnp.issubdtype(e.dtype, jnp.floating) or ".second_moment" in path:
      # Counters, flags, and statistics that no reduction or blend feeds: exact.
      allowance = np.zeros(e.shape)
    elif ".spikes" in path:
      allowance = _spike_allowance(e)
    else:  # the momentum and the compensation
      leaf_path = re.sub(r"^\.inner_state\.(momentum|compensation)", "", path)
      allowance = _float_allowance(e, magnitudes[leaf_path], tolerance, e.size)
    _compare_arrays(f"state{path}", state[path], e, allowance)


def _spike_allowance(expected):
  """The spike rule keeps gradient norms, from each leaf's sum of squares: a packed row's
  sum is in another order than its leaf's own, which moves a norm in its last bits."""
  return 1e-6 * np.abs(expected.astype(np.float64)) + np.finfo(np.float32).tiny


def _compare_reports(actual_state, expected_state):
  """The reports agree: every count and path exactly, a spike's norms (floats, from sums)
  to their last bits; the summary line exactly where it quotes no norm."""
  actual, expected = osf.nonfinite_report(actual_state), osf.nonfinite_report(expected_state)
  assert actual.keys() == expected.keys()
  for key, value in expected.items():
    if isinstance(value, float):
      assert actual[key] == pytest.approx(value, rel=1e-6), key
    else:
      assert actual[key] == value, key
  if not any(isinstance(value, float) for value in expected.values()):
    assert osf.nonfinite_summary(actual_state) == osf.nonfinite_summary(expected_state)


def _check_packed_against_alone(config, reduced: bool):
  params, grads, factor_rules, mask, places = _problem(config)
  # The mask is drawn with or without a decay rate: without one it warns that it has no
  # effect, and the two steps compared both leave it so.
  if config["settings"]["weight_decay_rate"] is None:
    mask = None
  settings_ = dict(config["settings"], factor_rules=factor_rules, weight_decay_mask=mask)
  steps = {}
  tolerance = Tolerance(
      blend=settings_["momentum"] is not None, reduction=reduced,
      onto_params=settings_["param_rounding"] != "nearest")
  alone_tx = osf.safefactor(**settings_, pack_small_leaves=False)
  state = alone_tx.init(params)
  for pack in (True, False):
    tx = osf.safefactor(**settings_, pack_small_leaves=pack)
    lowered = jax.jit(tx.update).lower(grads[0], state, params)
    if pack:
      # The fixed leaves are packed as one group of four rows (the premise of the test).
      assert re.search(rf"tensor<4x{SIZE}xf32>", lowered.as_text())
    steps[pack] = lowered.compile()
  for step in range(STEPS):
    state, step_grads = _poisoned(config, state, grads[step], places, step)
    expected = steps[False](step_grads, state, params)
    actual = steps[True](step_grads, state, params)
    _compare_step(actual, expected, params, tolerance)
    _compare_reports(actual[1], expected[1])
    state = expected[1]
    params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, expected[0])
  return state


def _examples(count: int):
  """``count`` examples, each compiling two steps of a tree of 16-24 leaves: not shrunk
  (the failing example is printed whole)."""
  return settings(max_examples=count, deadline=None, phases=(Phase.explicit, Phase.generate),
                  suppress_health_check=[HealthCheck.too_slow])


@_examples(4)
@given(config=_configuration(reductions=False))
def test_without_reductions_packing_keeps_every_bit_but_the_blends(config):
  with pytest.MonkeyPatch.context() as patch:
    # Every kind of two leaves or more is packed (not only kinds of 16): more groups,
    # groups whose last rows repeat, and leaves whose place among the units is not theirs.
    patch.setattr(packing, "MIN_LEAVES_TO_PACK", 2)
    _check_packed_against_alone(config, reduced=False)


@_examples(4)
@given(config=_configuration(reductions=True))
def test_with_reductions_packing_changes_only_their_last_bits(config):
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(packing, "MIN_LEAVES_TO_PACK", 2)
    _check_packed_against_alone(config, reduced=True)
