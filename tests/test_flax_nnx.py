"""Flax NNX: nnx.Optimizer over partitioned params on a mesh (test_ecosystems.py: the rest)."""


import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf
from tests.helpers import compilations, trained_by_plain_loop


class MLP(nnx.Module):
  def __init__(self, rngs, partitioned=False, explicit=False):
    def init(names):
      base = nnx.initializers.lecun_normal()
      return nnx.with_partitioning(base, names) if partitioned else base

    # Explicit axes need the output sharding of a sharded contraction spelled out.
    self.explicit = explicit
    self.up = nnx.Linear(256, 512, kernel_init=init(("data", "model")), rngs=rngs)
    self.down = nnx.Linear(512, 128, kernel_init=init(("model", None)), rngs=rngs)

  def __call__(self, x):
    hidden = jax.nn.relu(self.up(x, out_sharding=P(None, "model") if self.explicit else None))
    return self.down(hidden, out_sharding=P() if self.explicit else None)


def _loss_and_update(model, optimizer, inputs, targets):
  def loss_fn(model):
    return jnp.mean((model(inputs) - targets) ** 2)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


_train_step = nnx.jit(_loss_and_update)


def _keep_shardings(*nodes):
  """Constrains the nodes' state to their annotations' specs (none: replicated)."""
  state = nnx.state(nodes)
  nnx.update(nodes, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))


@nnx.jit
def _pinned_train_step(model, optimizer, inputs, targets):
  loss = _loss_and_update(model, optimizer, inputs, targets)
  _keep_shardings(model, optimizer)
  return loss


STEPS = 8


def _data():
  return (jax.random.normal(jax.random.PRNGKey(1), (16, 256)),
          jax.random.normal(jax.random.PRNGKey(2), (16, 128)))


def _train(model, optimizer, steps=STEPS):
  inputs, targets = _data()
  return [float(_train_step(model, optimizer, inputs, targets)) for _ in range(steps)]


def _plain_params(tx, steps=STEPS):
  """The params after ``steps`` of the optax loop (update, apply_updates) on a pure dict.

  The same model and data as ``_train``, without nnx.Optimizer, a mesh or partitioning
  metadata: what nnx.Optimizer must reproduce (the loop's numerics are checked against
  the float64 reference in test_kernel.py and test_alias.py).
  """
  graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
  inputs, targets = _data()

  def loss(params):
    return jnp.mean((nnx.merge(graphdef, params)(inputs) - targets) ** 2)

  return trained_by_plain_loop(tx, nnx.to_pure_dict(params), loss, steps)


def _assert_matches_plain_loop(model, tx, rtol):
  trained = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  chex.assert_trees_all_close(trained, _plain_params(tx), rtol=rtol, atol=rtol * 1e-2)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_nnx_optimizer_over_partitioned_params(axis_type):
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type, axis_type))
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0), partitioned=True, explicit=axis_type == AxisType.Explicit)
    # optax.adafactor's state copies the 2-D annotation onto (d,) statistics and fails.
    with pytest.raises(Exception):  # noqa: B017  (the message differs between modes)
      nnx.Optimizer(model, optax.adafactor(1e-2), wrt=nnx.Param)
    optimizer = nnx.Optimizer(model, osf.safefactor(1e-2, momentum=0.9), wrt=nnx.Param)
    moments = optimizer.opt_state.inner_state.second_moment
    up, down = moments["up"]["kernel"], moments["down"]["kernel"]
    # up: (256, 512) rows=axis 0, cols=axis 1; down: (512, 128) rows=axis 1, cols=axis 0.
    def names(variable):
      return variable.get_metadata()["out_sharding"]

    assert up.v_row.get_value().shape == (256, 1) and down.v_row.get_value().shape == (1, 128)
    assert names(up.v_row) == ("data", None) and names(up.v_col) == (None, "model")
    assert names(down.v_row) == (None, None) and names(down.v_col) == ("model", None)
    assert up.v_row.get_value().sharding.spec[0] == "data"
    assert names(optimizer.opt_state.inner_state.momentum["up"]["kernel"]) == ("data", "model")
    losses = _train(model, optimizer)
  assert losses[-1] < 0.7 * losses[0]
  # Sharded sums add in another order: equal to float32 rounding, not bit for bit.
  _assert_matches_plain_loop(model, osf.safefactor(1e-2, momentum=0.9), rtol=1e-5)


def test_an_auto_mode_step_that_pins_the_state_compiles_once_and_keeps_it():
  # In Auto mode XLA's propagation places the step's outputs: it shards up's replicated bias
  # over "model", its statistics follow, and a step that hands them back so compiles again
  # on the second call (the sharding guide's set-up; the jaxpr is traced once either way).
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  inputs, targets = _data()
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0), partitioned=True)
    optimizer = nnx.Optimizer(model, osf.safefactor(1e-2, momentum=0.9), wrt=nnx.Param)
    placed = [leaf.sharding for leaf in jax.tree.leaves(nnx.state((model, optimizer)))]
    with compilations() as compiled:
      for _ in range(3):
        _pinned_train_step(model, optimizer, inputs, targets)
  assert compiled.count("jit(_pinned_train_step)") == 1, compiled
  kept = jax.tree.leaves(nnx.state((model, optimizer)))
  for leaf, sharding in zip(kept, placed, strict=True):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.shape, leaf.sharding)


def test_state_partition_specs_of_nnx_params_are_where_init_places_the_state():
  # 0.2 gave P() for the factored statistics of nnx.Param leaves (a factored moment holds
  # two boxes where its param is one), while init placed them by the param's axes.
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  tx = osf.safefactor(1e-2, momentum=0.9)
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0), partitioned=True)
    params = nnx.state(model, nnx.Param)
    placed = jax.tree.leaves(tx.init(params))
    for specs in (osf.state_partition_specs(tx, params),
                  osf.state_partition_specs(tx, params, nnx.get_partition_spec(params))):
      specs = jax.tree.leaves(specs)
      assert len(specs) == len(placed)
      for leaf, spec in zip(placed, specs, strict=True):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (
            leaf.shape, leaf.sharding.spec, spec)
      assert any(spec != P() for spec in specs if len(spec) == 2)
