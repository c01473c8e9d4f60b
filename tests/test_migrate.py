"""Migration: optax.adafactor for N steps, convert, safefactor for M steps == N + M optax steps."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_safefactor as osf
from tests.helpers import (
    assert_trees_close,
    max_relative_error,
    random_tree,
    run_steps,
    tree_all_finite,
)

SHAPES = {"tall": (300, 140), "wide": (140, 300), "stacked": (3, 130, 150), "bias": (150,)}


def _continue(optax_tx, safe_tx, n, m, rng):
  params = random_tree(rng, SHAPES)
  grads = [random_tree(rng, SHAPES, scale=10.0 ** (step % 3 - 1)) for step in range(n + m)]
  with jax.numpy_dtype_promotion("standard"):
    _, _, expected = run_steps(optax_tx, params, grads.__getitem__, n + m)
    params, optax_state, _ = run_steps(optax_tx, params, grads.__getitem__, n)
  state = osf.migrate_from_optax(optax_state, safe_tx, params)
  update = jax.jit(safe_tx.update)
  for step in range(n, n + m):
    updates, state = update(grads[step], state, params)
    scale = max(float(jnp.max(jnp.abs(u))) for u in expected[step].values())
    for name in SHAPES:
      assert max_relative_error(updates[name], expected[step][name], scale) < 1e-5, (step, name)
    params = optax.apply_updates(params, updates)
  return state


@pytest.mark.parametrize("momentum", [None, 0.9])
def test_adafactor_job_continues_with_safefactor(momentum, rng):
  config = dict(momentum=momentum, weight_decay_rate=1e-3)
  state = _continue(optax.adafactor(0.05, **config), osf.safefactor(0.05, **config), 6, 6, rng)
  assert int(osf.skipped_steps(state)) == 0
  assert int(optax.tree_utils.tree_get(state, "count")) == 12


def test_scale_by_factored_rms_continues(rng):
  state = _continue(optax.scale_by_factored_rms(), osf.scale_by_safe_factored_rms(), 5, 5, rng)
  assert int(state.count) == 10


def test_mismatched_factoring_is_refused(rng):
  params = random_tree(rng, SHAPES)
  optax_state = optax.adafactor(0.1, min_dim_size_to_factor=200).init(params)
  with pytest.raises(ValueError, match=r"params\['\w+'\]: optax and safefactor factor"):
    osf.migrate_from_optax(optax_state, osf.safefactor(0.1), params)
  with pytest.raises(ValueError, match="momentum"):
    osf.migrate_from_optax(optax.adafactor(0.1).init(params), osf.safefactor(0.1, momentum=0.9),
                           params)


def _shapes_and_dtypes(state):
  return jax.tree.structure(state), [(x.shape, x.dtype) for x in jax.tree.leaves(state)]


@pytest.mark.parametrize("momentum", [None, 0.9])
@pytest.mark.parametrize("param_rounding", ["nearest", "stochastic", "kahan"])
def test_migrated_state_has_the_structure_of_init(param_rounding, momentum):
  # A bfloat16 param gets a Kahan compensation buffer, which optax has no counterpart for.
  params = {"w": jnp.ones((256, 128), jnp.bfloat16), "b": jnp.ones((128,), jnp.float32)}
  tx = osf.safefactor(1e-3, param_rounding=param_rounding, momentum=momentum)
  optax_state = optax.adafactor(1e-3, momentum=momentum).init(params)
  state = osf.migrate_from_optax(optax_state, tx, params)
  assert _shapes_and_dtypes(state) == _shapes_and_dtypes(tx.init(params))
  if param_rounding == "kahan":
    assert not jnp.any(state.inner_state.compensation["w"])
  grads = jax.tree.map(jnp.ones_like, params)
  updates, state = jax.jit(tx.update)(grads, state, params)
  assert tree_all_finite(updates) and tree_all_finite(state)
  assert int(osf.skipped_steps(state)) == 0


@pytest.mark.parametrize("optimizer", [optax.adam(1e-3), optax.adafactor(1e-3)])
def test_optimizer_without_safefactor_is_refused(optimizer):
  params = {"w": jnp.ones((256, 128))}
  with pytest.raises(ValueError, match=r"optimizer has no safefactor state to receive the "
                                       r"optax.adafactor statistics"):
    osf.migrate_from_optax(optax.adafactor(1e-3).init(params), optimizer, params)


@pytest.mark.parametrize("change,message", [
    ("missing", r"missing from params: params\['b'\]"),
    ("extra", r"in params but not in optax_state's second-moment statistics: params\['a'\]"),
], ids=["missing", "extra"])
def test_params_not_matching_the_optax_state_are_named(change, message):
  params = {"w": jnp.ones((256, 128)), "b": jnp.ones((128,))}
  optax_state = optax.adafactor(1e-3).init(params)
  wrong = {"w": params["w"]} if change == "missing" else {**params, "a": jnp.ones((4,))}
  with pytest.raises(ValueError, match=r"^params do not match .*" + message + r".*pass the params"):
    osf.migrate_from_optax(optax_state, osf.safefactor(1e-3), wrong)


def test_params_in_other_containers_are_named_by_the_first_that_differs():
  # The same leaves in other nodes (flax's Param boxes against the OptVariables an
  # nnx.Optimizer's state holds; here a tuple against a list) printed both whole trees.
  params = {"layers": [jnp.ones((256, 128)), jnp.ones((128,))]}
  optax_state = optax.adafactor(1e-3).init(params)
  as_tuple = {"layers": tuple(params["layers"])}
  with pytest.raises(ValueError, match=r"^params do not match optax_state's second-moment "
                                       r"statistics: at params\['layers'\], a tuple where the "
                                       r"other holds a list; pass the params"):
    osf.migrate_from_optax(optax_state, osf.safefactor(1e-3), as_tuple)


def test_params_not_matching_the_optax_momentum_are_named():
  params = {"w": jnp.ones((256, 128)), "b": jnp.ones((128,))}
  optax_state = optax.adafactor(1e-3, momentum=0.9).init(params)
  ema = optax.tree_utils.tree_get(optax_state, "ema")
  # A state spliced together from two jobs: the momentum lost a leaf.
  optax_state = optax.tree_utils.tree_set(optax_state, ema={"w": ema["w"]})
  with pytest.raises(ValueError, match=r"^params do not match optax_state's momentum: in params "
                                       r"but not in optax_state's momentum: params\['b'\]"):
    osf.migrate_from_optax(optax_state, osf.safefactor(1e-3, momentum=0.9), params)


@pytest.mark.parametrize("shape", [(300, 200), (200, 300)])
def test_factor_rules_that_swap_optaxs_axes_are_refused(shape):
  # optax factors a matrix one way; factor rules can make safefactor factor it the other
  # way, and then optax's row statistic is not safefactor's: refused, never reshaped.
  params = {"w": jnp.ones(shape)}
  optax_state = optax.adafactor(0.1).init(params)
  outcomes = {}
  for roles in [("row", "column"), ("column", "row")]:
    tx = osf.safefactor(0.1, factor_rules=lambda path, s, r=roles: r)
    try:
      osf.migrate_from_optax(optax_state, tx, params)
      outcomes[roles] = "migrated"
    except ValueError as error:
      assert "params['w']: optax and safefactor factor this param differently" in str(error)
      outcomes[roles] = "refused"
  assert sorted(outcomes.values()) == ["migrated", "refused"]


@pytest.mark.parametrize("shape", [(1, 300), (300, 1)])
def test_a_factored_axis_of_size_one_is_refused_by_name(shape):
  # Both factor a (1, 300) param at min_dim_size_to_factor=1, but a size-1 axis carries
  # no role in safefactor's state: the migration is refused with the param's path (not
  # an IndexError from deep inside).
  params = {"w": jnp.ones(shape)}
  optax_state = optax.adafactor(0.1, min_dim_size_to_factor=1).init(params)
  with pytest.raises(ValueError, match=r"params\['w'\]: optax and safefactor factor"):
    osf.migrate_from_optax(optax_state, osf.safefactor(0.1, min_dim_size_to_factor=1), params)


# --- the step counts of the wrappers around it ---------------------------------------------
# migrate_from_optax converted the Adafactor state and left every wrapper's state as init
# made it: a schedule under inject_hyperparams or scale_by_schedule started its warm-up again,
# and a learning rate set by hand in inject_hyperparams' state went back to its first value.

SCHEDULE = optax.linear_schedule(0.0, 0.05, 12)


def test_a_schedule_injected_goes_on_from_the_optax_step(rng):
  optax_tx = optax.inject_hyperparams(optax.adafactor, static_args=("min_dim_size_to_factor",))(
      learning_rate=SCHEDULE)
  safe_tx = optax.inject_hyperparams(
      osf.safefactor, static_args=("min_dim_size_to_factor", "spike_window"))(
          learning_rate=SCHEDULE)
  state = _continue(optax_tx, safe_tx, 5, 4, rng)
  assert int(state.count) == 9


def test_a_scale_by_schedule_goes_on_from_the_optax_step(rng):
  optax_tx = optax.chain(optax.scale_by_factored_rms(), optax.scale_by_schedule(SCHEDULE))
  safe_tx = optax.chain(osf.scale_by_safe_factored_rms(), optax.scale_by_schedule(SCHEDULE))
  state = _continue(optax_tx, safe_tx, 5, 4, rng)
  assert int(state[1].count) == 9


def test_a_learning_rate_set_by_hand_stays_set():
  params = {"w": jnp.ones((300, 140))}
  optax_state = optax.inject_hyperparams(optax.adafactor)(learning_rate=0.05).init(params)
  optax_state.hyperparams["learning_rate"] = jnp.asarray(0.002)
  tx = optax.inject_hyperparams(
      osf.safefactor, static_args=("min_dim_size_to_factor", "spike_window"))(learning_rate=0.05)
  state = osf.migrate_from_optax(optax_state, tx, params)
  assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.002)
  assert float(state.hyperparams["decay_rate"]) == pytest.approx(0.8)  # optax's, and ours


class _CountingSchedule:
  """A stateful schedule (optax.StatefulSchedule) whose state is a dict, not optax's
  WrappedScheduleState: the same leaves in another tree."""

  def init(self):
    return {"steps": jnp.zeros([], jnp.int32)}

  def update(self, state, **extra_args):
    return {"steps": state["steps"] + 1}

  def __call__(self, state, **extra_args):
    return SCHEDULE(state["steps"])


def test_a_schedule_state_of_another_tree_starts_afresh():
  # The optax job's schedule state (a WrappedScheduleState) does not fit safefactor's
  # schedule's (a dict): safefactor's starts as its init makes it; the value both name is
  # carried.
  params = {"w": jnp.ones((300, 140))}
  optax_tx = optax.inject_hyperparams(optax.adafactor)(learning_rate=SCHEDULE)
  optax_state = optax_tx.init(params)
  for _ in range(3):
    _, optax_state = optax_tx.update(params, optax_state, params)
  tx = optax.inject_hyperparams(
      osf.safefactor, static_args=("min_dim_size_to_factor", "spike_window"))(
          learning_rate=_CountingSchedule())
  state = osf.migrate_from_optax(optax_state, tx, params)
  assert jax.tree.structure(state.hyperparams_states["learning_rate"]) == jax.tree.structure(
      {"steps": 0})
  assert int(state.hyperparams_states["learning_rate"]["steps"]) == 0
  assert int(state.count) == 3
  assert float(state.hyperparams["learning_rate"]) == float(
      optax_state.hyperparams["learning_rate"])


def test_multi_steps_optimizer_steps_become_the_applied_steps():
  params = {"w": jnp.ones((300, 140))}
  grads = {"w": jnp.full((300, 140), 0.1)}
  multi = optax.MultiSteps(optax.adafactor(0.05), every_k_schedule=2)
  tx = osf.accumulate_gradients(osf.safefactor(0.05), every_k=2)
  with jax.numpy_dtype_promotion("standard"):
    _, optax_state, _ = run_steps(multi, params, [grads] * 6, apply_updates=False)
    _, mid_group, _ = run_steps(multi, params, [grads] * 7, apply_updates=False)
  state = osf.migrate_from_optax(optax_state, tx, params)
  assert int(state.applied_steps) == 3
  assert int(osf.skipped_steps(state)) == 0
  # A micro-batch accumulated since the last step is not carried, and the warning says so.
  with pytest.warns(UserWarning, match="holds 1 micro-batches accumulated since its last "
                                       "optimizer step"):
    osf.migrate_from_optax(mid_group, tx, params)


@pytest.mark.parametrize("shape", [(290, 200), (310, 200), (300, 190), (300, 210)])
def test_params_of_another_size_than_the_optax_jobs_are_refused(shape):
  # Factored the same way round, the statistics of a (300, 200) job do not fit params one
  # row or column smaller or larger: refused, never cut or padded into the state.
  optax_state = optax.adafactor(0.1).init({"w": jnp.ones((300, 200))})
  with pytest.raises(ValueError, match="^" + re.escape(
      f"params['w']: optax and safefactor factor this param differently (optax's statistics "
      f"have shape (200,) and (300,), the param {shape})")):
    osf.migrate_from_optax(optax_state, osf.safefactor(0.1), {"w": jnp.ones(shape)})


@pytest.mark.parametrize("rules", [("row", "column"), ("column", "row")])
def test_factor_rules_on_a_square_param_are_checked_by_axis(rules):
  # A square param's statistics have the same shapes whichever way it is factored: the
  # shape check let optax's row means in as safefactor's column means, transposed.
  params = {"w": jnp.ones((128, 128))}
  grads = {"w": jnp.outer(jnp.arange(1.0, 129.0), jnp.ones(128))}
  optax_tx = optax.adafactor(1e-2)
  _, optax_state = optax_tx.update(grads, optax_tx.init(params), params)
  tx = osf.safefactor(1e-2, factor_rules=lambda path, shape: rules)
  plain = osf.migrate_from_optax(optax_state, osf.safefactor(1e-2), params)
  if rules == ("row", "column"):  # optax's way round: the same state as without rules
    state = osf.migrate_from_optax(optax_state, tx, params)
    assert_trees_close(state.inner_state, plain.inner_state, rtol=0)
    return
  with pytest.raises(ValueError, match=r"params\['w'\]: optax and safefactor factor this param "
                                       r"differently \(optax's statistics have shape \(128,\) "
                                       r"and \(128,\), the param \(128, 128\)\)"):
    osf.migrate_from_optax(optax_state, tx, params)


@pytest.mark.parametrize("wrap", ["masked", "multi_transform"])
def test_a_state_of_part_of_the_params_is_refused_as_such(wrap):
  # Refused before: as params that did not match the statistics, which blamed the params.
  params = {"kernel": jnp.ones((256, 128)), "bias": jnp.zeros(128)}
  labels = {"kernel": "a", "bias": "b"}
  if wrap == "masked":
    old = optax.masked(optax.adafactor(1e-3), {"kernel": True, "bias": False})
    new = optax.masked(osf.safefactor(1e-3), {"kernel": True, "bias": False})
  else:
    old = optax.multi_transform({"a": optax.adafactor(1e-3), "b": optax.adafactor(1e-2)}, labels)
    new = optax.multi_transform({"a": osf.safefactor(1e-3), "b": osf.safefactor(1e-2)}, labels)
  with pytest.raises(ValueError, match=r"^optax_state holds optax.adafactor's statistics inside "
                                       r"optax.masked .*not the states of optax.masked or "
                                       r"optax.multi_transform$"):
    osf.migrate_from_optax(old.init(params), new, params)


def test_several_adafactor_states_are_refused():
  params = {"w": jnp.ones((256, 128))}
  old = optax.chain(optax.scale_by_factored_rms(), optax.scale_by_factored_rms())
  with pytest.raises(ValueError, match=r"^optax_state holds 2 optax.FactoredState: "):
    osf.migrate_from_optax(old.init(params), osf.safefactor(1e-3), params)


def test_a_resized_param_is_named_with_both_shapes():
  params = {"kernel": jnp.ones((256, 128)), "bias": jnp.zeros(128)}
  state = optax.adafactor(1e-3).init(params)
  with pytest.raises(ValueError, match=r"params\['bias'\]: .*optax's statistics have shape "
                                       r"\(128,\), the param \(130,\)\).*pass the params"):
    osf.migrate_from_optax(state, osf.safefactor(1e-3), {**params, "bias": jnp.zeros(130)})


def test_a_migrated_state_is_placed_as_init_places_it_and_migrates_under_jit():
  # The statistics go where init puts them: on a mesh, sharded like the param's state.
  mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
  params = {"w": jax.device_put(jnp.ones((256, 128)), sharding)}
  tx = osf.safefactor(1e-3)
  optax_state = optax.adafactor(1e-3).init({"w": jnp.ones((256, 128))})  # one device
  state = osf.migrate_from_optax(optax_state, tx, params)
  fresh = tx.init(params)
  for migrated, made in zip(jax.tree.leaves(state), jax.tree.leaves(fresh), strict=True):
    assert migrated.sharding.is_equivalent_to(made.sharding, migrated.ndim)
  jitted = jax.jit(osf.migrate_from_optax, static_argnums=1)(optax_state, tx, params)
  assert_trees_close(jitted, state, rtol=0)
