"""The factoring plan: the optax heuristic, its round trip through the state's shapes, and
factor rules (per-axis roles, batch axes for stacked layers and experts, logical names)."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf
from optax_safefactor._src.plan import FactorPlan, default_plan, plan_from_stat_shapes
from tests.helpers import assert_trees_close, max_relative_error, random_tree, run_steps
from tests.reference import ReferenceAdafactor


def test_heuristic_matches_optax_choice():
  assert default_plan((300, 200), True, 128) == FactorPlan((1,), (0,))
  assert default_plan((200, 300), True, 128) == FactorPlan((0,), (1,))
  assert default_plan((128, 128), True, 128) == FactorPlan((0,), (1,))
  assert default_plan((127, 300), True, 128) is None
  assert default_plan((300, 200), False, 128) is None
  assert default_plan((300,), True, 1) is None
  assert default_plan((), True, 1) is None
  assert default_plan((0, 300), True, 1) is None


@given(shape=st.lists(st.sampled_from([0, 1, 3, 128, 256]), min_size=0, max_size=4),
       min_size=st.sampled_from([1, 3, 128]))
def test_heuristic_breaks_ties_as_optax_does(shape, min_size):
  # Equal axes are where the two could differ unseen: the states' shapes are the same
  # either way. optax's own choice: (second largest, largest), or None.
  from optax._src.factorized import _factored_dims

  plan = default_plan(tuple(shape), True, min_size)
  optax_dims = _factored_dims(tuple(shape), True, min_size)
  if 0 in shape:  # a zero-size leaf: nothing to factor, whatever either plans
    return
  if optax_dims is None:
    assert plan is None
    return
  second, largest = optax_dims
  assert plan == FactorPlan((second,), (largest,))


@given(shape=st.lists(st.integers(0, 300), min_size=0, max_size=4), min_size=st.integers(1, 200))
def test_plan_round_trips_through_the_stat_shapes(shape, min_size):
  plan = default_plan(shape, True, min_size)
  if plan is None:
    return
  assert min(shape[plan.row_axes[0]], shape[plan.col_axes[0]]) >= min_size
  read_back = plan_from_stat_shapes(shape, plan.row_stat_shape(shape), plan.col_stat_shape(shape))
  # Axes of size 1 carry no role; every other factored axis is read back exactly.
  assert read_back.row_axes == tuple(a for a in plan.row_axes if shape[a] != 1)
  assert read_back.col_axes == tuple(a for a in plan.col_axes if shape[a] != 1)


LAYERS, ROWS, COLS = 4, 130, 140
CONFIG = dict(learning_rate=0.05, momentum=0.9, weight_decay_rate=1e-3)


def _stacked_vs_separate(factor_rules):
  rng = np.random.default_rng(0)
  # Layers of very different scales, so per-layer and whole-stack statistics differ.
  layer_scales = np.array([0.01, 0.1, 1.0, 10.0])[:, None, None]
  stacked = {"w": jnp.asarray(rng.normal(size=(LAYERS, ROWS, COLS)) * layer_scales, jnp.float32)}
  grads = [
      {"w": jnp.asarray(rng.normal(size=(LAYERS, ROWS, COLS)) * layer_scales, jnp.float32)}
      for _ in range(5)
  ]
  _, _, stacked_history = run_steps(osf.safefactor(**CONFIG, factor_rules=factor_rules),
                                    stacked, grads.__getitem__, 5)
  separate = {f"w{i}": stacked["w"][i] for i in range(LAYERS)}
  separate_grads = [{f"w{i}": g["w"][i] for i in range(LAYERS)} for g in grads]
  _, _, separate_history = run_steps(osf.safefactor(**CONFIG), separate,
                                     separate_grads.__getitem__, 5)
  as_stack = [jnp.stack([u[f"w{i}"] for i in range(LAYERS)]) for u in separate_history]
  return [u["w"] for u in stacked_history], as_stack


def test_batch_axis_gives_the_updates_of_separate_params():
  stacked, separate = _stacked_vs_separate(lambda path, shape: ("batch", None, None))
  assert_trees_close(stacked, separate, rtol=1e-6)


def test_without_the_batch_rule_the_stack_shares_clipping_and_scale():
  stacked, separate = _stacked_vs_separate(None)
  assert max_relative_error(stacked[-1], separate[-1]) > 1e-2


def test_logical_names_map_layers_to_batch():
  rules = osf.logical_factor_rules({"w": ("layers", "embed", "mlp")})
  stacked, separate = _stacked_vs_separate(rules)
  assert_trees_close(stacked, separate, rtol=1e-6)
  state = osf.safefactor(factor_rules=rules).init({"w": jnp.ones((LAYERS, ROWS, COLS))})
  moment = state.inner_state.second_moment["w"]
  assert moment.v_row.shape == (LAYERS, ROWS, 1) and moment.v_col.shape == (LAYERS, 1, COLS)


def test_logical_names_given_as_lists_are_names_not_params():
  # A list of names was flattened as a list of params, one name each, which matched no
  # param: "layers" was silently not a batch axis, and the heuristic factored the stack
  # over its two largest axes, layers and embed.
  params = {"w": jnp.ones((300, 200, 150)),
            "blocks": [{"k": jnp.ones((300, 200))}, {"k": jnp.ones((200, 150))}]}
  axis_names = {"w": ["layers", "embed", "mlp"],
                "blocks": [{"k": ["layers", None]}, {"k": ("embed", "mlp")}]}
  state = osf.safefactor(factor_rules=osf.logical_factor_rules(axis_names)).init(params)
  moment = state.inner_state.second_moment["w"]
  assert moment.v_row.shape == (300, 1, 150) and moment.v_col.shape == (300, 200, 1)
  assert isinstance(state.inner_state.second_moment["blocks"][0]["k"], osf.FullMoment)
  as_tuples = jax.tree.map(tuple, axis_names, is_leaf=lambda x: isinstance(x, list)
                           and all(n is None or isinstance(n, str) for n in x))
  expected = osf.safefactor(factor_rules=osf.logical_factor_rules(as_tuples)).init(params)
  assert jax.tree.map(jnp.shape, state) == jax.tree.map(jnp.shape, expected)


@pytest.mark.parametrize("rules", [(("layers", "batch"),), [("layers", "batch")], "standard"],
                         ids=["tuple-of-pairs", "list-of-pairs", "t5x-name"])
def test_logical_rules_that_are_not_a_mapping_are_refused_by_name(rules):
  # Pairs (as flax writes its logical axis rules) or presets.t5x's "standard" were taken,
  # and init failed with "AttributeError: 'tuple' object has no attribute 'get'".
  with pytest.raises(TypeError, match=r"logical_factor_rules: rules must be a mapping from "
                                      r"logical axis name to role, got .*dict\(pairs\)"):
    osf.logical_factor_rules({"w": ("layers", "embed", "mlp")}, rules)


def test_a_short_partition_spec_leaves_the_last_axes_unnamed():
  # flax gives a param with no names (a bias, a norm's scale) the empty P(); read as no
  # roles at all, it failed init with "factor rule gives 0 roles () for a rank-1 param".
  params = {"w": jnp.ones((4, 300, 200)), "b": jnp.ones((200,))}
  rules = osf.logical_factor_rules({"w": P("layers"), "b": P()})
  assert rules((jax.tree_util.DictKey("w"),), (4, 300, 200)) == ("batch", None, None)
  assert rules((jax.tree_util.DictKey("b"),), (200,)) == (None,)
  moment = osf.safefactor(factor_rules=rules).init(params).inner_state.second_moment["w"]
  assert moment.v_row.shape == (4, 1, 200) and moment.v_col.shape == (4, 300, 1)
  # A plain tuple stays exact: names of another rank are a mistake, named.
  with pytest.raises(ValueError, match=r"params\['w'\]: factor rule gives 1 roles"):
    osf.safefactor(factor_rules=osf.logical_factor_rules({"w": ("layers",)})).init(params)


def test_a_misspelt_logical_name_warns_and_names_the_param_it_meant():
  # A path in the names' tree that matched no param was dropped without a word: the
  # stacked param it meant was factored over its layers axis by the heuristic.
  params = {"blocks": {"kernel": jnp.ones((4, 300, 200))}, "bias": jnp.ones((200,))}
  misspelt = {"blocks": {"kernal": ("layers", "embed", "mlp")}}
  with pytest.warns(UserWarning, match=r"params\['blocks'\]\['kernal'\] \(closest unnamed "
                    r"param: params\['blocks'\]\['kernel'\]\)"):
    osf.safefactor(factor_rules=osf.logical_factor_rules(misspelt)).init(params)
  with pytest.warns(UserWarning, match="param_logical_axes names params .* blocks/kernal"):
    osf.presets.t5x(1e-2, logical_factor_rules="standard",
                    param_logical_axes=misspelt).init(params)


@pytest.mark.parametrize("unnamed, listed", [
    (3, "params['k0'], params['k1'], params['k2'])"),
    (4, "params['k0'], params['k1'], params['k2'], ...)")])
def test_the_misspelling_warning_counts_matrices_and_lists_at_most_three(unnamed, listed):
  # Matrices (rank 2) go unnamed as stacks do; the list of them stops at three.
  params = {f"k{i}": jnp.ones((300, 200)) for i in range(unnamed)}
  rules = osf.logical_factor_rules({"kk0": ("embed", "mlp")})
  with pytest.warns(UserWarning, match=rf"and {unnamed} param\(s\) of two or more axes have "
                    rf"no names, so the heuristic factors them \({re.escape(listed)}"):
    osf.safefactor(factor_rules=rules).init(params)


def test_names_for_params_elsewhere_or_for_some_params_only_do_not_warn():
  # One names' tree for a whole model, split by optax.multi_transform; or names for the
  # stacked params only. Neither is a misspelling.
  params = {"blocks": {"kernel": jnp.ones((4, 300, 200))}, "head": jnp.ones((300, 200))}
  axis_names = {"blocks": {"kernel": ("layers", "embed", "mlp")}, "head": ("embed", "vocab")}
  rules = osf.logical_factor_rules(axis_names)
  tx = optax.multi_transform({"stack": osf.safefactor(factor_rules=rules),
                              "head": osf.safefactor(factor_rules=rules)},
                             {"blocks": "stack", "head": "head"})
  stacked_only = osf.logical_factor_rules({"blocks": axis_names["blocks"]})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tx.init(params)
    osf.safefactor(factor_rules=stacked_only).init(params)
    # The stack's names, and the head unnamed, in the head's part: the stack is left out
    # there (an optax.MaskedNode, of the subtree or of the leaf), not misspelt.
    for labels in ({"blocks": "stack", "head": "head"},
                   {"blocks": {"kernel": "stack"}, "head": "head"}):
      optax.multi_transform({"stack": osf.safefactor(factor_rules=stacked_only),
                             "head": osf.safefactor(factor_rules=stacked_only)},
                            labels).init(params)
    optax.masked(osf.safefactor(factor_rules=stacked_only),
                 {"blocks": False, "head": True}).init(params)


def test_explicit_roles_factor_a_conv_kernel_like_the_reference(rng):
  shape = (3, 3, 16, 32)
  roles = ("row", "row", "row", "column")
  params = random_tree(rng, {"k": shape})
  tx = osf.safefactor(0.1, factor_rules=lambda path, s: roles)
  state = tx.init(params)
  assert state.inner_state.second_moment["k"].v_row.shape == (3, 3, 16, 1)
  reference = ReferenceAdafactor(learning_rate=0.1)
  reference.init("k", shape, ((0, 1, 2), (3,)))
  update = jax.jit(tx.update)
  for _ in range(10):
    grads = random_tree(rng, {"k": shape})
    updates, state = update(grads, state, params)
    assert max_relative_error(updates["k"], reference.step(grads, params)["k"]) < 2e-5


def test_batch_axes_on_an_unfactored_leaf(rng):
  # Expert biases: (experts, width) with nothing to factor, still clipped per expert.
  shape = (4, 16)
  params = random_tree(rng, {"b": shape})
  tx = osf.safefactor(0.1, factor_rules=lambda path, s: ("batch", None))
  reference = ReferenceAdafactor(learning_rate=0.1)
  reference.init("b", shape, None, batch_axes=(0,))
  state = tx.init(params)
  assert isinstance(state.inner_state.second_moment["b"], osf.FullMoment)
  for _ in range(5):
    grads = random_tree(rng, {"b": shape}, scale=10.0)
    updates, state = tx.update(grads, state, params)
    assert max_relative_error(updates["b"], reference.step(grads, params)["b"]) < 2e-5


@pytest.mark.parametrize("roles,message", [
    (("batch", None), r"params\['w'\]: factor rule gives 2 roles .* rank-3"),
    (("batch", "rows", None), "unknown factor roles"),
    (("batch", "row", None), "rows without columns"),
])
def test_bad_rules_name_the_param(roles, message):
  tx = osf.safefactor(factor_rules=lambda path, shape: roles)
  with pytest.raises(ValueError, match=message):
    tx.init({"w": jnp.ones((LAYERS, ROWS, COLS))})
