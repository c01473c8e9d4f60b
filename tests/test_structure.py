"""The codebase's shape, pinned: what a contributor may rely on when changing it."""

import inspect
import pathlib

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec

import optax_safefactor as osf
from optax_safefactor._src import hyperparams, placement

SRC = pathlib.Path(osf.__file__).parent / "_src"


def test_every_option_is_declared_once_in_the_hyperparameters():
  # 0.1 wrote each option out in safefactor, _validate and scale_by_adafactor, then
  # forwarded it again: one new option took five edits. Both factories now fill one
  # Hyperparams, so each of their arguments is a field (or a renamed optax argument).
  fields = set(hyperparams.Hyperparams._fields)
  renamed = {"step_offset": "decay_offset", "epsilon": "eps"}
  for factory in (osf.safefactor, osf.scale_by_safe_factored_rms):
    for name in inspect.signature(factory).parameters:
      assert renamed.get(name, name) in fields, (factory.__name__, name)


def test_compiler_hints_live_in_one_module():
  # In 0.1 optimization_barrier and friends were threaded through the maths.
  for path in SRC.glob("*.py"):
    if path.name != "xla_hints.py":
      assert "optimization_barrier" not in path.read_text(), path.name


def test_factor_rules_run_once_per_leaf():
  # 0.1 read the plan back off the state's shapes, which lost the batch axes, so it
  # called the user's rules again for every leaf on every trace.
  calls = []

  def rules(path, shape):
    calls.append(jax.tree_util.keystr(path))
    return ("batch", None, None) if len(shape) == 3 else None

  tx = osf.safefactor(0.1, factor_rules=rules)
  params = {"stack": jnp.ones((3, 130, 140)), "w": jnp.ones((130, 140))}
  state = tx.init(params)
  for _ in range(2):  # eager, then a jit trace
    _, state = tx.update(params, state, params)
  jax.jit(tx.update)(params, state, params)
  assert sorted(calls) == ["['stack']", "['w']"]


def test_boxes_and_partition_specs_follow_one_placement_rule():
  shapes = [((256, 512), (256, 1)), ((256, 512), (1, 512)), ((4, 1, 8), (4, 1, 1)),
            ((4, 8), (4, 8))]
  for param_shape, state_shape in shapes:
    names = ("data", "model", None)[: len(param_shape)]
    spec = placement.state_spec(PartitionSpec(*names), param_shape, state_shape)
    assert tuple(spec) == placement.fitted_axis_names(names, param_shape, state_shape)
    assert all(name is None for name, size in zip(tuple(spec), state_shape, strict=True)
               if size == 1)


def test_public_surface():
  assert "WitnessedTransformation" not in osf.__all__ and "FactorPlan" not in osf.__all__
  assert not hasattr(osf, "SafeFactoredState") and not hasattr(osf, "SafefactorState")
  assert sorted(osf.__all__) == sorted(set(osf.__all__))
  with pytest.raises(TypeError):
    osf.DEFAULT_LOGICAL_RULES["layers"] = "row"  # read-only: a shared default


def test_both_factories_share_one_state_type():
  params = {"w": jnp.ones((130, 140))}
  for tx in (osf.safefactor(0.1, skip_nonfinite_steps=False),
             osf.scale_by_safe_factored_rms()):
    assert isinstance(tx.init(params), osf.AdafactorState)
  assert isinstance(osf.safefactor(0.1).init(params).inner_state, osf.AdafactorState)
  assert isinstance(optax.tree_utils.tree_get(osf.safefactor(0.1).init(params), "count"),
                    jax.Array)
