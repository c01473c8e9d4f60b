"""Small leaves packed as rows (``pack_small_leaves``): per-leaf semantics, bits and placement.

Packing changes the order of a leaf's reductions (its row's sum against its own), nothing
else: where a step has no reduction the runs are bit-identical, and where it has, each
update is within the float summation bound of the per-leaf step.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf
from optax_safefactor._src import bit_streams, kernel, packing
from optax_safefactor._src.plan import FactorPlan
from tests.helpers import assert_trees_bitwise_equal, max_relative_error, random_tree

# Six vectors of one size (a group of four and one of two), a (16, 16) matrix below the
# factoring size (packed with the vectors of 256), a vector of its own size, a factored
# matrix, and a vector above the packing threshold.
SHAPES = {f"bias{i}": (256,) for i in range(6)} | {
    "small_matrix": (16, 16), "odd": (100,), "w": (256, 192),
    "big": (packing.PACKED_UP_TO + 1,),
}
STEPS = 20


@pytest.fixture(autouse=True)
def pack_any_kind(monkeypatch, request):
  """These small trees pack every kind of two leaves or more (not only kinds of 16)."""
  if "real_minimum" not in request.keywords:
    monkeypatch.setattr(packing, "MIN_LEAVES_TO_PACK", 2)


def _grads(rng, params, steps):
  def one(p, step):
    return jnp.asarray(rng.normal(size=p.shape) * (1 + step % 3), p.dtype)

  return [jax.tree.map(lambda p, step=step: one(p, step), params) for step in range(steps)]


def _run(tx, params, grads, *, apply=True):
  update = jax.jit(tx.update)
  state = tx.init(params)
  all_updates = []
  for step_grads in grads:
    updates, state = update(step_grads, state, params)
    all_updates.append(updates)
    if apply:
      params = optax.apply_updates(params, updates)
  return params, state, all_updates


def _pair(rng, dtype=jnp.float32, steps=STEPS, shapes=SHAPES, packs=(True, False), **settings):
  params = random_tree(rng, shapes, dtype)
  grads = _grads(rng, params, steps)
  return [_run(osf.safefactor(**settings, pack_small_leaves=pack), params, grads)
          for pack in packs]


def summation_bound(size: int, dtype) -> float:
  r"""The relative difference two orders of one sum of ``size`` non-negative terms can
  make, carried through a leaf's multipliers: each sum is within :math:`\gamma_{n-1} =
  (n-1)u / (1 - (n-1)u)` of the exact one, the clipping and the parameter scale take a
  square root of one each, and a few roundings follow (:math:`4u`)."""
  u = float(jnp.finfo(dtype).eps) / 2
  gamma = (size - 1) * u / (1 - (size - 1) * u)
  return 2 * gamma + 4 * u


def test_row_bits_are_each_leafs_own_bits():
  hashes = np.asarray([bit_streams.path_hash(f"['leaf{i}']") for i in range(3)], np.uint32)
  for shape in ((24,), (4, 6), (2, 3, 4)):
    rows = bit_streams.row_bits(7, 11, hashes, (3, 24), bit_streams.STREAM_MOMENTUM)
    for row, path_hash in enumerate(hashes):
      alone = bit_streams.random_bits(7, 11, int(path_hash), shape, bit_streams.STREAM_MOMENTUM)
      np.testing.assert_array_equal(rows[row], np.ravel(alone))
  with pytest.raises(ValueError, match="one path hash per row"):
    bit_streams.row_bits(7, 11, hashes, (2, 24), 0)


def test_which_leaves_are_packed(rng):
  params = random_tree(rng, SHAPES) | {
      "half0": jnp.ones((256,), jnp.bfloat16), "half1": jnp.ones((256,), jnp.bfloat16)}
  names = list(params)
  units = _units(params)
  groups = [sorted(names[i] for i in unit.group.owned) for unit in units if unit.packed]
  assert groups == [["bias0", "bias1", "bias2", "bias3"],
                    ["bias4", "bias5", "small_matrix"], ["half0", "half1"]]
  # The kind's short last group steps bias3 again, to be as many rows as the first; a
  # kind of fewer leaves than a group has nothing to repeat.
  packed = [unit.group for unit in units if unit.packed]
  assert [names[i] for i in packed[1].members] == ["bias3", "bias4", "bias5", "small_matrix"]
  assert [group.repeated for group in packed] == [0, 1, 0]
  alone = sorted(names[unit.group.members[0]] for unit in units if not unit.packed)
  assert alone == ["big", "odd", "w"]
  assert all(not unit.packed for unit in _units(params, enabled=False))
  assert sorted(i for unit in units for i in unit.group.owned) == list(range(len(names)))


def test_leaves_of_up_to_2048_elements_are_packed_and_empty_ones_never(rng):
  # The threshold the step-time measurements chose (packing.PACKED_UP_TO's comment), as a
  # number: a leaf of 2,048 elements is packed, one of 2,049 is stepped alone. A leaf
  # without elements has nothing to step: it is never packed, and the tree still steps.
  shapes = {"at0": (2048,), "at1": (32, 64), "over0": (2049,), "over1": (2049,),
            "empty0": (0,), "empty1": (0, 4)}
  params = random_tree(rng, shapes)
  names = list(params)
  units = _units(params)
  assert [sorted(names[i] for i in unit.group.owned) for unit in units if unit.packed] == [
      ["at0", "at1"]]
  tx = osf.safefactor(1e-3)
  updates, _ = jax.jit(tx.update)(params, tx.init(params), params)
  assert updates["empty0"].shape == (0,) and updates["empty1"].shape == (0, 4)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


@pytest.mark.real_minimum
def test_kinds_of_few_leaves_are_not_packed():
  few = packing.MIN_LEAVES_TO_PACK - 1
  params = ({f"few{i}": jnp.ones((32,)) for i in range(few)}
            | {f"many{i}": jnp.ones((48,)) for i in range(packing.MIN_LEAVES_TO_PACK)})
  tx = osf.safefactor(1e-3, pack_small_leaves=True)
  text = _compiled_text(tx, params)
  # The kind of 16 is read out of its groups; the kind of 15 is stepped leaf by leaf.
  assert re.search(r"f32\[1,48\]\{1,0\} dynamic-slice\(", text)
  # No row of 32 read out of a group, and no group of rows of 32 (a reduction's windows over
  # a padded group of 48s may have 32 columns: older XLA writes them so).
  assert not re.search(r"f32\[1,32\]\{1,0\} dynamic-slice\(", text)
  assert not re.search(r"f32\[\d+,32\]\{1,0\} (?:concatenate|fusion)\(", text)


@pytest.mark.real_minimum
def test_a_tree_of_exactly_the_minimum_is_packed():
  # The tree-wide shortcut (fewer leaves than a kind needs: packing's bookkeeping is not
  # entered) must let a tree of exactly that many through.
  params = {f"many{i}": jnp.ones((48,)) for i in range(packing.MIN_LEAVES_TO_PACK)}
  text = _compiled_text(osf.safefactor(1e-3, pack_small_leaves=True), params)
  assert re.search(r"f32\[1,48\]\{1,0\} dynamic-slice\(", text)


def _units(params, enabled=True):
  """The units ``safefactor(1e-3)`` steps a tree in (float32 arithmetic for every leaf)."""
  state = osf.safefactor(1e-3).init(params).inner_state
  names = list(params)
  leaves = [kernel.Leaf(plan=_plan_of(state, name), compute_dtype=np.dtype("float32"),
                        real_dtype=np.dtype("float32"), floor=None, cap=None, decays=False,
                        decay_mask=True, rounding=None)
            for name in names]
  columns = [[params[n] for n in names], leaves, [state.second_moment[n] for n in names],
             [params[n] for n in names], [None] * len(names), [None] * len(names)]
  return packing.units(*columns, enabled=enabled)


def _plan_of(state, name):
  if isinstance(state.second_moment[name], osf.FactoredMoment):
    return FactorPlan((1,), (0,))
  return FactorPlan((), ())


@pytest.mark.parametrize("settings", [
    dict(learning_rate=1e-2, clipping_threshold=None, multiply_by_parameter_scale=False),
    dict(learning_rate=1e-2, clipping_threshold=None, multiply_by_parameter_scale=False,
         momentum=0.9, weight_decay_rate=1e-2, weight_decay_mask=lambda p: {
             n: (n != "bias1") if n != "bias2" else jnp.arange(256) % 2 == 0 for n in p}),
], ids=["no-reduction", "momentum-decay-mask"])
def test_without_reductions_packing_is_bit_identical(rng, settings):
  packed, alone = _pair(rng, **settings)
  # One-dimensional leaves are the packed rows' own layout, and XLA fuses their ops as it
  # fuses the row's: bit for bit. The (16, 16) matrix alone may be fused otherwise, and
  # XLA's CPU backend lets LLVM contract a multiply and an add that land in one kernel
  # into one FMA (one rounding fewer), so its momentum blend (beta1 * m + ...) may round
  # differently: by at most u of the leaf's scale per step, which the momentum's decay
  # keeps below 10u over any run; 20u is asserted.
  two_d = "small_matrix"
  without = [jax.tree.map(lambda x: x, tree) for tree in (packed[:2], alone[:2])]
  for tree in without:
    tree[0].pop(two_d)
    if tree[1].inner_state.momentum is not None:
      tree[1].inner_state.momentum.pop(two_d)
  assert_trees_bitwise_equal(*without)
  u = float(jnp.finfo(jnp.float32).eps) / 2
  assert max_relative_error(packed[0][two_d], alone[0][two_d]) <= 20 * u
  for step_updates, step_alone in zip(packed[2], alone[2], strict=True):
    assert max_relative_error(step_updates[two_d], step_alone[two_d]) <= 20 * u


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("settings", [
    dict(learning_rate=1e-2),
    dict(learning_rate=1e-2, momentum=0.9, weight_decay_rate=1e-2, clipping_threshold=1.0,
         weight_decay_mask=lambda p: {n: n not in ("bias0", "odd") for n in p}),
    dict(learning_rate=None, min_parameter_scale=1e-2),
], ids=["default", "momentum-decay", "no-learning-rate"])
def test_updates_are_within_the_summation_bound(rng, request, dtype, settings):
  """Step by step from the same state and params: packed updates against per-leaf ones."""
  if dtype == "float64":
    request.getfixturevalue("x64")
  params = random_tree(rng, SHAPES, dtype)
  grads = _grads(rng, params, STEPS)
  packed_tx = osf.safefactor(**settings, pack_small_leaves=True)
  alone_tx = osf.safefactor(**settings, pack_small_leaves=False)
  packed_update, alone_update = jax.jit(packed_tx.update), jax.jit(alone_tx.update)
  state = alone_tx.init(params)
  for step_grads in grads:
    expected, next_state = alone_update(step_grads, state, params)
    actual, _ = packed_update(step_grads, state, params)
    for name in params:
      a, e = np.asarray(actual[name], np.float64), np.asarray(expected[name], np.float64)
      scale = np.max(np.abs(e))
      error = np.max(np.abs(a - e)) / scale if scale else np.max(np.abs(a))
      assert error <= summation_bound(params[name].size, dtype), (name, error)
    state = next_state
    params = optax.apply_updates(params, expected)


@pytest.mark.parametrize("settings", [
    dict(learning_rate=1e-3, param_rounding="stochastic", clipping_threshold=None,
         multiply_by_parameter_scale=False, momentum=0.9, dtype_momentum="bfloat16",
         state_dtype="bfloat16", rounding_seed=5),
    dict(learning_rate=1e-3, param_rounding="kahan", clipping_threshold=None,
         multiply_by_parameter_scale=False),
], ids=["stochastic", "kahan"])
def test_rounding_bits_and_compensation_are_each_leafs_own(rng, settings):
  packed, alone = _pair(rng, jnp.bfloat16, **settings)
  assert_trees_bitwise_equal(packed[:2], alone[:2])
  # The bits were used: the run differs from one with another seed.
  if settings["param_rounding"] == "stochastic":
    # The packed step alone: the pair above already compared it with the unpacked one.
    [(other, _, _)] = _pair(np.random.default_rng(0), jnp.bfloat16, packs=(True,),
                            **(settings | {"rounding_seed": 6}))
    [(again, _, _)] = _pair(np.random.default_rng(0), jnp.bfloat16, packs=(True,), **settings)
    assert any(bool(jnp.any(a != b)) for a, b in zip(
        jax.tree.leaves(other), jax.tree.leaves(again), strict=True))


def test_a_nonfinite_packed_leaf_is_skipped_counted_and_named(rng):
  params = random_tree(rng, SHAPES)
  grads = _grads(rng, params, 8)
  grads[3] = {**grads[3], "bias2": grads[3]["bias2"].at[17].set(jnp.inf)}
  grads[5] = {**grads[5], "bias5": grads[5]["bias5"].at[0].set(jnp.nan)}
  # Leaves whose place among the stepped units is not their place in the tree: the packed
  # groups come first (small_matrix is packed with bias4 and bias5, before odd, which is not).
  grads[6] = {**grads[6], "small_matrix": grads[6]["small_matrix"].at[2, 3].set(jnp.nan)}
  grads[7] = {**grads[7], "odd": grads[7]["odd"].at[99].set(-jnp.inf)}
  settings = dict(learning_rate=1e-2, clipping_threshold=None, multiply_by_parameter_scale=False)
  runs = [_run(osf.safefactor(**settings, pack_small_leaves=pack), params, grads)
          for pack in (True, False)]
  assert_trees_bitwise_equal(runs[0][:2], runs[1][:2])
  state = runs[0][1]
  assert int(osf.skipped_steps(state)) == 4
  nonfinite = state.nonfinite_steps.per_leaf()
  assert {n: int(c) for n, c in nonfinite.items() if c} == {
      "bias2": 1, "bias5": 1, "small_matrix": 1, "odd": 1}
  last = state.last_nonfinite_step.per_leaf()
  assert {n: int(c) for n, c in last.items() if c >= 0} == {
      "bias2": 3, "bias5": 5, "small_matrix": 6, "odd": 7}
  assert all(not bool(jnp.any(u)) for u in jax.tree.leaves(runs[0][2][3]))
  # The summary names the three latest leaves (it stays one line).
  assert all(name in osf.nonfinite_summary(state) for name in ("bias5", "small_matrix", "odd"))


def test_spike_decisions_match(rng):
  params = random_tree(rng, SHAPES)
  grads = _grads(rng, params, 40)
  grads[30] = jax.tree.map(lambda g: g * 50, grads[30])
  runs = [_run(osf.safefactor(1e-2, skip_spikes=6.0, spike_window=16, pack_small_leaves=pack),
               params, grads) for pack in (True, False)]
  for state in (run[1] for run in runs):
    assert int(osf.skipped_spikes(state)) == 1
    assert int(state.spikes.last_spike_step) == 30
  norms = [np.asarray(run[1].spikes.gradient_norms) for run in runs]
  np.testing.assert_allclose(norms[0], norms[1], rtol=1e-6)


def _compiled_text(tx, params, mesh=None):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step).lower(params, tx.init(params), params).compile().as_text()


def _layers(layers, width=64):
  shapes = {}
  for i in range(layers):
    shapes |= {f"l{i}_w": (width, 4 * width), f"l{i}_b": (4 * width,),
               f"l{i}_scale": (width,), f"l{i}_bias": (width,), f"l{i}_out": (width,)}
  return {name: jnp.full(shape, 0.02, jnp.float32) for name, shape in shapes.items()}


def test_packing_removes_fusions():
  """Fewer kernels for the same step: the small leaves' per-leaf machinery is shared."""
  params = _layers(8)
  counts = {pack: _compiled_text(osf.safefactor(1e-3, pack_small_leaves=pack), params)
            .count(" fusion(") for pack in (True, False)}
  assert counts[True] < 0.8 * counts[False], counts


def test_packed_rows_are_read_by_one_kernel():
  """Each leaf is read out of its group at a row index the compiler cannot fold.

  A static slice per row made every row of every output a kernel of its own (on GPT-2
  small with momentum, 24 of the step's 160 distinct kernels); a dynamic slice at a run
  time index is one kernel for all rows (``xla_hints.row_indices``).
  """
  params = {f"b{i}": jnp.full((6,), 0.02 * (i + 1), jnp.float32) for i in range(8)}
  text = _compiled_text(osf.safefactor(1e-3, momentum=0.9, pack_small_leaves=True), params)
  assert "dynamic-slice(" in text
  assert not re.search(r"f32\[1,6\]\{1,0\} slice\(", text)


def test_a_kinds_groups_are_one_shape(rng):
  """A short last group repeats rows of the group before it: one set of kernels per kind.

  Six leaves in groups of four were a group of four and a group of two, each shape
  compiled into kernels of its own (on the 600-leaf tree, 22 of the step's 108 distinct
  kernels). The repeated rows' results are dropped: the results are the unpacked ones.
  """
  params = random_tree(rng, {f"b{i}": (40,) for i in range(6)})
  units = _units(params)
  assert all(unit.packed for unit in units)
  assert [(unit.group.members, unit.group.repeated) for unit in units] == [
      ((0, 1, 2, 3), 0), ((2, 3, 4, 5), 2)]
  text = _compiled_text(osf.safefactor(1e-3, momentum=0.9, pack_small_leaves=True), params)
  assert re.search(r"f32\[4,40\]", text)
  assert not re.search(r"f32\[[23],40\]", text)
  grads = _grads(rng, params, 3)
  packed, alone = [_run(osf.safefactor(1e-3, momentum=0.9, pack_small_leaves=pack), params,
                        grads) for pack in (True, False)]
  for step in range(3):
    for name in params:
      assert (max_relative_error(packed[2][step][name], alone[2][step][name])
              < summation_bound(40, jnp.float32)), (step, name)


_COLLECTIVES = re.compile(r"\s(all-gather|all-to-all|collective-permute|all-reduce|"
                          r"reduce-scatter)(-start)?\(")


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_packing_adds_no_collective_on_a_mesh(rng, axis_type):
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type, axis_type))
  params = random_tree(rng, {"w": (64, 256), "b0": (256,), "b1": (256,), "s0": (64,),
                             "s1": (64,), "s2": (64,)})
  specs = {"w": P("data", "model"), "b0": P("model"), "b1": P("model"), "s0": P(),
           "s1": P(), "s2": P()}
  with jax.set_mesh(mesh):
    params = {n: jax.device_put(p, NamedSharding(mesh, specs[n])) for n, p in params.items()}
    texts = {pack: _compiled_text(osf.safefactor(1e-3, pack_small_leaves=pack), params)
             for pack in (True, False)}
    counts = {pack: sorted(m.group(1) for m in _COLLECTIVES.finditer(text))
              for pack, text in texts.items()}
    assert counts[True] == counts[False]
    runs = [_run(osf.safefactor(1e-3, pack_small_leaves=pack), params,
                 _grads(np.random.default_rng(1), params, 5)) for pack in (True, False)]
  np.testing.assert_allclose(np.asarray(runs[0][0]["s1"]), np.asarray(runs[1][0]["s1"]),
                             rtol=1e-6)
  for name in ("b0", "w"):
    assert runs[0][0][name].sharding.spec == runs[1][0][name].sharding.spec


def test_replicated_leaves_are_packed_under_explicit_axes():
  mesh = jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(AxisType.Explicit, AxisType.Explicit))
  with jax.set_mesh(mesh):
    replicated = jax.device_put(jnp.ones(8), NamedSharding(mesh, P()))
    sharded = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("model")))
    seen = {}

    def look(a, b):
      seen["replicated"], seen["sharded"] = packing.is_replicated(a), packing.is_replicated(b)
      return a + b

    jax.jit(look)(replicated, sharded)
  assert seen == {"replicated": True, "sharded": False}
  assert packing.is_replicated(jnp.ones(3))


def test_auto_axes_under_a_mesh_do_not_say_so_nothing_is_packed():
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
  seen = []
  with jax.set_mesh(mesh):
    jax.jit(lambda x: seen.append(packing.is_replicated(x)) or x)(jnp.ones(8))
  assert seen == [False]


def test_the_switch_is_checked():
  with pytest.raises(TypeError, match="pack_small_leaves must be True or False"):
    osf.safefactor(1e-3, pack_small_leaves="yes")
  tx = optax.inject_hyperparams(osf.safefactor, static_args=("pack_small_leaves",))(
      learning_rate=1e-3, pack_small_leaves=False)
  params = {"a": jnp.ones(4), "b": jnp.ones(4)}
  updates, _ = jax.jit(tx.update)(params, tx.init(params), params)
  assert jax.tree.structure(updates) == jax.tree.structure(params)
