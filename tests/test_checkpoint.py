"""orbax-checkpoint: resume bit-identically; restore onto another mesh from abstract targets."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf
from tests.helpers import assert_trees_equal, run_steps

SHAPES = {"w": (256, 512), "b": (512,), "stack": (3, 256, 128)}
SPECS = {"w": P("data", "model"), "b": P("model"), "stack": P(None, "data", "model")}


def _tx():
  return osf.safefactor(0.05, momentum=0.9, weight_decay_rate=1e-3,
                        factor_rules=lambda path, shape: ("batch", None, None)
                        if len(shape) == 3 else None)


def _grads(step):
  rng = np.random.default_rng(100 + step)
  grads = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}
  if step == 4:  # a skipped step must survive the checkpoint too
    grads["w"] = grads["w"].at[0, 0].set(jnp.nan)
  return grads


def _steps(tx, params, state, start, stop, place=lambda tree: tree):
  return run_steps(tx, params, lambda step: place(_grads(start + step)), stop - start,
                   state=state)[:2]


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _trained(tx, steps):
  """Params and state after ``steps`` steps from a seeded start."""
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}
  return _steps(tx, params, tx.init(params), 0, steps)


def _saved(path, tree):
  """A checkpointer that has finished writing ``tree`` at ``path``."""
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, tree)
  checkpointer.wait_until_finished()
  return checkpointer


def test_resume_from_checkpoint_is_bit_identical(tmp_path):
  tx = _tx()
  params, state = _trained(tx, 3)
  checkpointer = _saved(tmp_path / "step3", {"params": params, "opt_state": state})

  uninterrupted = _steps(tx, params, state, 3, 8)
  restored = checkpointer.restore(tmp_path / "step3",
                                  _abstract({"params": params, "opt_state": state}))
  resumed = _steps(tx, restored["params"], restored["opt_state"], 3, 8)
  assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(state)
  assert_trees_equal(resumed, uninterrupted)
  assert int(osf.skipped_steps(resumed[1])) == 1


def test_a_0_2_checkpoint_restores_and_migrates(tmp_path):
  # Release 0.2 wrote the per-leaf counters as trees shaped like the params: restore into
  # that layout's target, migrate, and the run goes on bit for bit.
  tx = _tx()
  params, state = _trained(tx, 5)
  checkpointer = _saved(tmp_path / "step5",
                        {"params": params, "opt_state": osf.state_in_0_2_layout(state)})

  uninterrupted = _steps(tx, params, state, 5, 8)
  target = {"params": params, "opt_state": osf.state_in_0_2_layout(tx.init(params))}
  restored = checkpointer.restore(tmp_path / "step5", _abstract(target))
  migrated = osf.migrate_from_0_2(restored["opt_state"])
  assert jax.tree.structure(migrated) == jax.tree.structure(state)
  resumed = _steps(tx, restored["params"], migrated, 5, 8)
  assert_trees_equal(resumed, uninterrupted)
  assert osf.nonfinite_report(resumed[1])["nonfinite_steps/params['w']"] == 1


def test_restore_onto_another_mesh(tmp_path):
  tx = _tx()
  rng = np.random.default_rng(0)
  values = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
  # Axis types spelled out: the default changed from Auto to Explicit in JAX 0.9.
  save_mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  with jax.set_mesh(save_mesh):
    params = {k: jax.device_put(v, NamedSharding(save_mesh, SPECS[k])) for k, v in values.items()}
    params, state = _steps(tx, params, tx.init(params), 0, 3)
  checkpointer = _saved(tmp_path / "ckpt", {"params": params, "opt_state": state})

  restore_mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  abstract_params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  state_shardings = osf.state_partition_specs(tx, abstract_params, SPECS, mesh=restore_mesh)
  target = {
      "params": {k: jax.ShapeDtypeStruct(s, jnp.float32,
                                         sharding=NamedSharding(restore_mesh, SPECS[k]))
                 for k, s in SHAPES.items()},
      "opt_state": jax.tree.map(
          lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
          jax.eval_shape(tx.init, abstract_params), state_shardings),
  }
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  v_row = restored["opt_state"].inner_state.second_moment["w"].v_row
  assert v_row.sharding.mesh.shape == {"data": 4, "model": 2}
  assert v_row.sharding.spec == P("data", None)
  assert_trees_equal(jax.tree.map(np.asarray, restored),
                     jax.tree.map(np.asarray, {"params": params, "opt_state": state}))
  def on(mesh):
    placed = {k: NamedSharding(mesh, SPECS[k]) for k in SHAPES}
    return lambda grads: {k: jax.device_put(g, placed[k]) for k, g in grads.items()}

  with jax.set_mesh(restore_mesh):
    resumed = _steps(tx, restored["params"], restored["opt_state"], 3, 6, place=on(restore_mesh))
  with jax.set_mesh(save_mesh):
    continued = _steps(tx, params, state, 3, 6, place=on(save_mesh))
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(continued), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_a_state_restored_without_a_target_is_named_as_such_by_the_reports(tmp_path):
  # orbax's restore without a target gives the guard's counts as plain dicts: the reports
  # asked whether the optimizer was built with skip_nonfinite at all.
  for tx in (_tx(), optax.inject_hyperparams(osf.safefactor)(learning_rate=0.05),
             osf.accumulate_gradients(osf.safefactor(0.05), 2),
             optax.chain(optax.clip_by_global_norm(1.0), osf.safefactor(0.05))):  # a list
    _, state = _trained(tx, 1)
    raw = _saved(tmp_path / str(id(tx)), state).restore(tmp_path / str(id(tx)))
    for report in (osf.skipped_steps, osf.nonfinite_summary, osf.nonfinite_report):
      with pytest.raises(ValueError, match=re.escape(
          "no skip_nonfinite state found in opt_state: it holds a guard's counts (skipped_steps, "
          "consecutive_skips, step, nonfinite_steps, last_nonfinite_step) as a dict's items, as "
          "a checkpoint restored without a target does (it keeps the arrays, not their "
          "types); restore with the state of optimizer.init(params) (or "
          "jax.eval_shape(optimizer.init, params)) as the target")):
        report(raw)
  # A state with no guard keeps the question, restored or not.
  tx = osf.safefactor(0.05, skip_nonfinite_steps=False)
  _, state = _trained(tx, 1)
  raw = _saved(tmp_path / "unguarded", state).restore(tmp_path / "unguarded")
  with pytest.raises(ValueError, match="was the optimizer built with skip_nonfinite"):
    osf.skipped_steps(raw)
