"""Every public transformation in every ecosystem: orbax, a device mesh, Flax NNX, Flax Linen.

Each test runs one transformation of the registry (``tests/helpers.py``) through one
ecosystem and compares it with the same transformation in the plain optax loop
(``helpers.run_steps``): what the ecosystem adds (a checkpoint, shardings, a training
state) must change nothing. Whether the plain loop's updates are right is for the contract
and differential tests.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf
from tests.helpers import (
    ECOSYSTEMS,
    TRANSFORMATIONS,
    assert_trees_bitwise_equal,
    assert_trees_close,
    run_steps,
    trained_by_plain_loop,
)

SHAPES = {"w": (16, 32), "b": (32,), "v": (8,)}
SPECS = {"w": P("data", "model"), "b": P("model"), "v": P()}
NAN_STEP = 4


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}


def _grads_for(subject):
  def grads(step):
    grads = _params(100 + step)
    if subject.guarded and step == NAN_STEP:  # a skipped step must survive every ecosystem
      grads["w"] = grads["w"].at[0, 0].set(jnp.nan)
    return grads

  return grads


def _steps(subject):
  """Steps to run: every transformation applies at least five updates."""
  return 6 * subject.every_k


def test_every_ecosystem_has_its_test():
  tested = {name.removeprefix("test_").split("_", 1)[0] for name in globals()
            if name.startswith("test_") and name != "test_every_ecosystem_has_its_test"}
  assert tested == set(ECOSYSTEMS)


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_orbax_resume_is_bit_identical(name, tmp_path):
  subject = TRANSFORMATIONS[name]
  tx, steps, _grads = subject.build(), _steps(subject), _grads_for(subject)
  middle = steps // 2 - 1  # mid-group for accumulate_gradients: its sums are saved too
  params, state, _ = run_steps(tx, _params(), _grads, middle)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
  checkpointer.wait_until_finished()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          {"params": params, "opt_state": state})
  restored = checkpointer.restore(tmp_path / "ckpt", abstract)
  assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(state)

  def rest(start_params, start_state):
    return run_steps(tx, start_params, lambda step: _grads(middle + step), steps - middle,
                     state=start_state)[:2]

  resumed = rest(restored["params"], restored["opt_state"])
  assert_trees_bitwise_equal(resumed, rest(params, state))
  if subject.guarded and subject.every_k == 1:
    assert int(osf.skipped_steps(resumed[1])) == 1


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_mesh_steps_equal_one_device_steps_and_keep_the_state_shardings(name):
  subject = TRANSFORMATIONS[name]
  tx, steps, _grads = subject.build(), _steps(subject), _grads_for(subject)
  # Explicit axes: the shardings are part of the types, so none can drift silently.
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)

  def place(tree):
    return {k: jax.device_put(x, NamedSharding(mesh, SPECS[k])) for k, x in tree.items()}

  one_device = run_steps(tx, _params(), _grads, steps)[:2]
  with jax.set_mesh(mesh):
    params = place(_params())
    expected = osf.state_partition_specs(tx, params, mesh=mesh)
    sharded = run_steps(tx, params, lambda step: place(_grads(step)), steps)[:2]
    for leaf, sharding in zip(jax.tree.leaves(sharded[1]), jax.tree.leaves(expected),
                              strict=True):
      assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.sharding, sharding)
  assert_trees_close(jax.tree.map(np.asarray, sharded), one_device, rtol=1e-5)


class _NnxModel(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(16, 32, rngs=rngs)
    self.down = nnx.Linear(32, 8, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x)))


class _LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8)(jax.nn.relu(nn.Dense(32)(x)))


def _data():
  return (jax.random.normal(jax.random.key(1), (8, 16)),
          jax.random.normal(jax.random.key(2), (8, 8)))


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_nnx_optimizer_equals_the_plain_loop(name):
  subject = TRANSFORMATIONS[name]
  tx, steps = subject.build(), _steps(subject)
  inputs, targets = _data()
  model = _NnxModel(nnx.Rngs(0))
  graphdef, start = nnx.split(_NnxModel(nnx.Rngs(0)), nnx.Param)  # the same init, untrained
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer):
    grads = nnx.grad(lambda model: jnp.mean((model(inputs) - targets) ** 2))(model)
    optimizer.update(model, grads)

  for _ in range(steps):
    train_step(model, optimizer)

  def loss(params):
    return jnp.mean((nnx.merge(graphdef, params)(inputs) - targets) ** 2)

  expected = trained_by_plain_loop(tx, nnx.to_pure_dict(start), loss, steps)
  chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(model, nnx.Param)), expected,
                              rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_linen_train_state_equals_the_plain_loop(name):
  subject = TRANSFORMATIONS[name]
  tx, steps = subject.build(), _steps(subject)
  inputs, targets = _data()
  model = _LinenModel()
  params = model.init(jax.random.key(0), inputs)["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  def loss(params):
    return jnp.mean((model.apply({"params": params}, inputs) - targets) ** 2)

  @jax.jit
  def train_step(state):
    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  for _ in range(steps):
    state = train_step(state)
  assert int(state.step) == steps
  chex.assert_trees_all_close(state.params, trained_by_plain_loop(tx, params, loss, steps),
                              rtol=1e-6, atol=1e-8)
