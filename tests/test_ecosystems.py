"""Every public transformation in every ecosystem: orbax, Flax's msgpack, a device mesh, Flax
NNX, Flax Linen.

Each test runs one transformation of the registry (``tests/helpers.py``) through one
ecosystem and compares it with the same transformation in the plain optax loop
(``helpers.run_steps``): what the ecosystem adds (a checkpoint, shardings, a training
state) must change nothing. Whether the plain loop's updates are right is for the contract
and differential tests.
"""

import os
import subprocess
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx, serialization
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf
from tests.flax_models import SmallMLP
from tests.helpers import (
    ECOSYSTEMS,
    TRANSFORMATIONS,
    assert_trees_bitwise_equal,
    assert_trees_close,
    run_steps,
    train_with_nnx_optimizer,
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


def _is_plain_state_dict(state_dict) -> bool:
  """Nested dicts with string keys, of arrays and None (a field that is off): what
  ``flax.serialization.to_state_dict`` gives for a type it knows."""
  if isinstance(state_dict, dict):
    return all(isinstance(key, str) and _is_plain_state_dict(value)
               for key, value in state_dict.items())
  return state_dict is None or isinstance(state_dict, (jax.Array, np.ndarray))


def _assert_same_reports(actual_state, expected_state):
  assert osf.nonfinite_report(actual_state) == osf.nonfinite_report(expected_state)
  assert osf.nonfinite_summary(actual_state) == osf.nonfinite_summary(expected_state)
  assert int(osf.skipped_steps(actual_state)) == int(osf.skipped_steps(expected_state)) == 1


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_msgpack_resume_is_bit_identical(name):
  # flax.serialization saves only the types in its own registry: the guards' LeafCounts
  # and HyperparamCounts failed to_bytes with "can not serialize 'LeafCounts' object".
  subject = TRANSFORMATIONS[name]
  tx, _grads = subject.build(), _grads_for(subject)
  saved_after = NAN_STEP + 1  # the skipped step's counts are saved; mid-group when every_k=2
  params, state, _ = run_steps(tx, _params(), _grads, saved_after)
  assert _is_plain_state_dict(serialization.to_state_dict(state))
  target = {"params": _params(), "opt_state": tx.init(_params())}
  restored = serialization.from_bytes(target, serialization.to_bytes(
      {"params": params, "opt_state": state}))
  assert_trees_bitwise_equal(restored, {"params": params, "opt_state": state})
  if subject.guarded:
    _assert_same_reports(restored["opt_state"], state)

  def rest(start_params, start_state):
    return run_steps(tx, start_params, lambda step: _grads(saved_after + step),
                     3 * subject.every_k, state=start_state)[:2]

  assert_trees_bitwise_equal(rest(restored["params"], restored["opt_state"]), rest(params, state))


class _LinenStack(nn.Module):
  """Dense layers of ``widths``, with params in ``param_dtype``."""

  widths: tuple[int, ...]
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    dtypes = dict(dtype=self.param_dtype, param_dtype=self.param_dtype)
    for width in self.widths[:-1]:
      x = jax.nn.relu(nn.Dense(width, **dtypes)(x))
    return nn.Dense(self.widths[-1], **dtypes)(x).astype(jnp.float32)


# States that the registry's transformations do not make, each in a Linen TrainState: the
# transformation, the model's layer widths, its params' dtype and the dtype promotion its
# step needs (optax.adam mixes an int count with float rates). 17 layers of width 8 have 16
# kernels of one shape and 17 biases: two kinds of small leaves, each packed.
MSGPACK_TRAIN_STATES = {
    "inject_hyperparams": (lambda: optax.inject_hyperparams(osf.safefactor)(learning_rate=0.1),
                           (32, 8), jnp.float32, "strict"),
    "kahan_bfloat16": (lambda: osf.safefactor(0.1, momentum=0.9, param_rounding="kahan"),
                       (32, 8), jnp.bfloat16, "strict"),
    "stochastic_bfloat16": (lambda: osf.safefactor(0.1, param_rounding="stochastic"),
                            (32, 8), jnp.bfloat16, "strict"),
    "skip_nonfinite_adam": (lambda: osf.skip_nonfinite(optax.adam(0.01)),
                            (32, 8), jnp.float32, "standard"),
    "packed_small_leaves": (lambda: osf.safefactor(0.1, momentum=0.9),
                            (8,) * 17, jnp.float32, "strict"),
}


@pytest.mark.parametrize("name", sorted(MSGPACK_TRAIN_STATES))
def test_msgpack_saves_a_linen_train_state(name):
  build, widths, param_dtype, promotion = MSGPACK_TRAIN_STATES[name]
  tx, model, (inputs, targets) = build(), _LinenStack(widths, param_dtype), _data()

  def create():
    params = model.init(jax.random.key(0), inputs)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  @jax.jit
  def train_step(state, poison):
    def loss(params):
      outputs = model.apply({"params": params}, jnp.where(poison, jnp.nan, inputs))
      return jnp.mean((outputs - targets) ** 2)

    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  def train(state, first, last):
    with jax.numpy_dtype_promotion(promotion):
      for step in range(first, last):
        state = train_step(state, step == NAN_STEP)
    return state

  state = train(create(), 0, NAN_STEP + 1)
  restored = serialization.from_bytes(create(), serialization.to_bytes(state))
  assert_trees_bitwise_equal(restored, state)
  _assert_same_reports(restored.opt_state, state.opt_state)
  last = NAN_STEP + 4
  assert_trees_bitwise_equal(train(restored, NAN_STEP + 1, last),
                             train(state, NAN_STEP + 1, last))


def test_msgpack_refuses_a_state_dict_of_other_fields():
  state = osf.safefactor(0.1).init(_params())
  state_dict = serialization.to_state_dict(state)
  del state_dict["nonfinite_hyperparams"]["last_step"]
  with pytest.raises(ValueError, match=r"a HyperparamCounts restores from the fields "
                     r"\['counts', 'last_step'\], but the state dict has \['counts'\] at path "
                     r"\./nonfinite_hyperparams"):
    serialization.from_state_dict(state, state_dict)
  # A field more is refused too, not dropped.
  state_dict = serialization.to_state_dict(state)
  state_dict["nonfinite_steps"]["total"] = state_dict["nonfinite_steps"]["counts"]
  with pytest.raises(ValueError, match=r"a LeafCounts restores from the fields \['counts'\], "
                     r"but the state dict has \['counts', 'total'\] at path \./nonfinite_steps"):
    serialization.from_state_dict(state, state_dict)


def test_msgpack_needs_flax_only_when_flax_is_imported():
  # Flax is optional: the package must not import it, and a state made before flax is
  # imported is saved all the same.
  script = """
import sys

import jax.numpy as jnp

import optax_safefactor as osf

assert "flax" not in sys.modules, "importing optax_safefactor imported flax"
tx = osf.safefactor(0.1)
state = tx.init({"w": jnp.ones((4, 8))})

from flax import serialization

# The finder that registered the counters with flax has left the import system.
assert not [finder for finder in sys.meta_path if type(finder).__name__ == "_RegisterOnImport"]
restored = serialization.from_bytes(tx.init({"w": jnp.ones((4, 8))}),
                                    serialization.to_bytes(state))
print(restored.nonfinite_steps.names())
"""
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout == "[\"params['w']\"]\n"


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
  model = SmallMLP(nnx.Rngs(0))
  graphdef, start = nnx.split(SmallMLP(nnx.Rngs(0)), nnx.Param)  # the same init, untrained
  train_with_nnx_optimizer(model, tx, inputs, targets, steps)

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
