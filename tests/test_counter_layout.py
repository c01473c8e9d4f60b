"""The guards' per-leaf counters as one vector (``LeafCounts``), and states of release 0.2.

Release 0.2 kept ``nonfinite_steps`` and ``last_nonfinite_step`` as trees of int32 scalars
shaped like the params. ``osf.state_in_0_2_layout`` and ``osf.migrate_from_0_2`` convert
between the two layouts; a 0.2 state handed to ``update`` is refused with the way out.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from tests.helpers import assert_trees_bitwise_equal, run_steps

PARAMS = {"dense": {"kernel": jnp.ones((3, 2)), "bias": jnp.ones((2,))}, "scale": jnp.ones(())}
# Per step, the leaves whose gradient is NaN.
POISONED = {1: ("kernel",), 3: ("bias", "kernel"), 4: ("scale",), 6: ("kernel",)}
STEPS = 8


def _grads(step):
  bad = POISONED.get(step, ())
  return {"dense": {name: jnp.full(PARAMS["dense"][name].shape,
                                   jnp.nan if name in bad else 0.5) for name in ("kernel", "bias")},
          "scale": jnp.asarray(jnp.nan if "scale" in bad else 0.5)}


def _expected_counts():
  """Per leaf (params' leaf order: bias, kernel, scale), from ``POISONED`` directly."""
  names = ("bias", "kernel", "scale")
  counts = [sum(name in bad for bad in POISONED.values()) for name in names]
  last = [max((step for step, bad in POISONED.items() if name in bad), default=-1)
          for name in names]
  return counts, last


def _nested():
  # A guard around a chain holding safefactor's own guard, after gradient accumulation.
  return osf.accumulate_gradients(
      osf.skip_nonfinite(optax.chain(osf.safefactor(0.1), optax.scale(1.0))), every_k=1)


def test_counts_are_one_vector_in_the_params_leaf_order():
  tx = osf.safefactor(0.1)
  _, state, _ = run_steps(tx, PARAMS, _grads, STEPS)
  counts, last = _expected_counts()
  assert state.nonfinite_steps.counts.shape == (3,)
  np.testing.assert_array_equal(state.nonfinite_steps.counts, counts)
  np.testing.assert_array_equal(state.last_nonfinite_step.counts, last)
  assert state.nonfinite_steps.names() == [
      "params['dense']['bias']", "params['dense']['kernel']", "params['scale']"]
  assert int(state.last_nonfinite_step.per_leaf()["dense"]["kernel"]) == 6
  assert jax.tree.structure(state.nonfinite_steps.per_leaf()) == jax.tree.structure(PARAMS)


def test_the_0_2_layout_round_trips_through_every_guard():
  _, state, _ = run_steps(_nested(), PARAMS, _grads, STEPS)
  old = osf.state_in_0_2_layout(state)
  guards = osf._src.counters.find_counters(old)
  assert len(guards) == 3  # the outer guard, safefactor's guard, the micro-batch counters
  # The accumulation skips the poisoned micro-batches: the guards inside never see them.
  counts, last = _expected_counts()
  seen = [([0, 0, 0], [-1, -1, -1]), ([0, 0, 0], [-1, -1, -1]), (counts, last)]
  for guard, (guard_counts, guard_last) in zip(guards, seen, strict=True):
    assert jax.tree.structure(guard.nonfinite_steps) == jax.tree.structure(PARAMS)
    assert [int(x) for x in jax.tree.leaves(guard.nonfinite_steps)] == guard_counts
    assert [int(x) for x in jax.tree.leaves(guard.last_nonfinite_step)] == guard_last
  assert_trees_bitwise_equal(osf.migrate_from_0_2(old), state)
  # Today's layout is left as it is.
  assert_trees_bitwise_equal(osf.migrate_from_0_2(state), state)


def test_a_migrated_0_2_state_continues_the_run():
  tx = _nested()
  params, state, _ = run_steps(tx, PARAMS, _grads, 4)
  uninterrupted = run_steps(tx, params, lambda step: _grads(step + 4), 4, state=state)
  migrated = osf.migrate_from_0_2(jax.device_get(osf.state_in_0_2_layout(state)))
  resumed = run_steps(tx, params, lambda step: _grads(step + 4), 4, state=migrated)
  assert_trees_bitwise_equal(resumed[:2], uninterrupted[:2])
  assert osf.nonfinite_report(resumed[1]) == osf.nonfinite_report(uninterrupted[1])


def test_update_refuses_a_0_2_state_and_says_how_to_convert_it():
  tx = osf.safefactor(0.1)
  old = osf.state_in_0_2_layout(tx.init(PARAMS))
  with pytest.raises(TypeError, match=r"layout of optax_safefactor 0\.2.*migrate_from_0_2"):
    tx.update(_grads(0), old, PARAMS)


def test_a_state_for_other_params_is_refused():
  tx = osf.skip_nonfinite(optax.sgd(0.1))
  state = tx.init({"a": jnp.ones(2)})
  # Named by the missing path before the wrapped transformation sees the grads (their
  # count was compared only after it had run).
  with pytest.raises(ValueError, match=r"grads do not match the optimizer state: in grads but "
                                       r"not in the optimizer state: params\['b'\]"):
    tx.update({"a": jnp.ones(2), "b": jnp.ones(2)}, state._replace(
        inner_state=optax.sgd(0.1).init({"a": jnp.ones(2), "b": jnp.ones(2)})))


def test_abstract_counts_give_an_abstract_0_2_target():
  tx = osf.safefactor(0.1)
  abstract = osf.state_in_0_2_layout(jax.eval_shape(tx.init, PARAMS))
  scalars = jax.tree.leaves(abstract.nonfinite_steps)
  assert len(scalars) == 3
  assert all(isinstance(x, jax.ShapeDtypeStruct) and x.shape == () and x.dtype == jnp.int32
             for x in scalars)


def test_the_compiled_step_has_one_output_per_counter_not_per_leaf():
  # The point of the vector: 100 leaves add two outputs, not two hundred.
  params = {f"leaf{i}": jnp.ones((4,)) for i in range(100)}
  tx = osf.safefactor(0.1)
  state = tx.init(params)
  out_shapes = jax.eval_shape(tx.update, params, state, params)[1]
  assert out_shapes.nonfinite_steps.counts.shape == (100,)
  # skipped, consecutive, step, the two leaf vectors, the two hyperparameter vectors.
  assert len(jax.tree.leaves(out_shapes)) - len(jax.tree.leaves(out_shapes.inner_state)) == 7


@pytest.mark.parametrize("make,names", [
    (lambda: osf.safefactor(0.1), ("learning_rate", "weight_decay_rate", "decay_rate",
                                   "momentum", "clipping_threshold", "eps",
                                   "min_parameter_scale", "max_parameter_scale")),
    (lambda: osf.skip_nonfinite(optax.inject_hyperparams(optax.adam)(learning_rate=0.1)),
     ("b1", "b2", "eps", "eps_root", "learning_rate")),
])
def test_migrating_fills_the_hyperparameter_counts_0_2_did_not_have(make, names):
  tx = make()
  with jax.numpy_dtype_promotion("standard"):  # optax.adam mixes int32 and float32
    fresh = tx.init(PARAMS)
  assert fresh.nonfinite_hyperparams.names == names
  old = osf.state_in_0_2_layout(fresh)
  assert old.nonfinite_hyperparams is None
  migrated = osf.migrate_from_0_2(old)
  assert_trees_bitwise_equal(migrated, fresh)
  assert migrated.nonfinite_hyperparams.names == names
  with (pytest.raises(TypeError, match=r"nonfinite_hyperparams must be a HyperparamCounts, got "
                                       r"NoneType.*migrate_from_0_2"),
        jax.numpy_dtype_promotion("standard")):
    tx.update(_grads(0), fresh._replace(nonfinite_hyperparams=None), PARAMS)


def test_a_migrated_state_counts_a_nonfinite_learning_rate():
  def learning_rate(count):
    return jnp.where(count == 2, jnp.nan, 0.1)

  tx = osf.safefactor(learning_rate)
  params, state, _ = run_steps(tx, PARAMS, lambda step: _grads(0), 2)
  migrated = osf.migrate_from_0_2(jax.device_get(osf.state_in_0_2_layout(state)))
  _, resumed, _ = run_steps(tx, params, lambda step: _grads(0), 2, state=migrated)
  report = osf.nonfinite_report(resumed)
  # The schedule reads the applied steps: stuck at count 2, both resumed steps are skipped.
  assert report["nonfinite_hyperparam_steps/learning_rate"] == 2
  assert report["last_nonfinite_hyperparam_step/learning_rate"] == 3


def test_a_guard_that_checks_no_hyperparameter_keeps_none_and_migrates_to_none():
  # orbax refuses to save a zero-size array: no empty counts in the state.
  tx = osf.skip_nonfinite(optax.sgd(0.1))
  fresh = tx.init(PARAMS)
  assert fresh.nonfinite_hyperparams is None
  assert osf.migrate_from_0_2(osf.state_in_0_2_layout(fresh)).nonfinite_hyperparams is None
  _, state, _ = run_steps(tx, PARAMS, _grads, STEPS)
  assert state.nonfinite_hyperparams is None and "hyperparam" not in str(
      osf.nonfinite_report(state))


UNGUARDED_INSIDE = {
    "scale_by_safe_factored_rms": lambda: osf.skip_nonfinite(osf.scale_by_safe_factored_rms()),
    "safefactor_guard_off": lambda: osf.skip_nonfinite(
        osf.safefactor(0.1, skip_nonfinite_steps=False)),
}


@pytest.mark.parametrize("name", sorted(UNGUARDED_INSIDE))
def test_a_guard_around_an_unguarded_safefactor_migrates_with_like(name):
  # Such a guard checks no hyperparameter (None), but its state, SkipNonfiniteState around
  # an AdafactorState, is also safefactor's own guard's: migrate_from_0_2 gave it
  # safefactor's counts, which update refused; today's state was not returned as it is.
  tx = UNGUARDED_INSIDE[name]()
  fresh = tx.init(PARAMS)
  assert fresh.nonfinite_hyperparams is None
  assert osf.migrate_from_0_2(fresh).nonfinite_hyperparams is None  # today's: as it is
  old = osf.state_in_0_2_layout(fresh)
  migrated = osf.migrate_from_0_2(old, like=jax.eval_shape(tx.init, PARAMS))
  assert_trees_bitwise_equal(migrated, fresh)
  _, state, _ = run_steps(tx, PARAMS, _grads, 3, state=migrated)
  assert int(osf.skipped_steps(state)) == 1
  # Without like, taken for safefactor's own guard; update says how to migrate it.
  with pytest.raises(ValueError, match=r"checks the hyperparameters \['learning_rate'.*but this "
                                       r"optimizer checks 0.*migrate_from_0_2\(opt_state, "
                                       r"like=tx.init\(params\)\)"):
    tx.update(_grads(0), osf.migrate_from_0_2(old), PARAMS)


def test_like_gives_each_nested_guard_its_own_layout():
  tx = osf.skip_nonfinite(optax.chain(
      osf.safefactor(0.1), osf.skip_nonfinite(osf.scale_by_safe_factored_rms())))
  fresh = tx.init(PARAMS)
  migrated = osf.migrate_from_0_2(osf.state_in_0_2_layout(fresh), like=fresh)
  assert_trees_bitwise_equal(migrated, fresh)
  with pytest.raises(ValueError, match=r"like holds 1 guards \(SkipNonfiniteState\) and "
                                       r"opt_state 3"):
    osf.migrate_from_0_2(osf.state_in_0_2_layout(fresh), like=osf.safefactor(0.1).init(PARAMS))


def test_like_keeps_the_counts_of_a_state_in_todays_layout():
  tx = osf.safefactor(lambda count: jnp.where(count == 0, jnp.nan, 0.1))
  _, state, _ = run_steps(tx, PARAMS, lambda step: _grads(0), 2)
  assert int(state.nonfinite_hyperparams.counts[0]) == 2
  assert_trees_bitwise_equal(osf.migrate_from_0_2(state, like=tx.init(PARAMS)), state)
