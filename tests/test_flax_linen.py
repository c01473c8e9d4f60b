"""Flax Linen: logical partitioning, eval_shape to jit(init); TrainState: test_ecosystems.py."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.training import train_state
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf
from tests.helpers import trained_by_plain_loop

RULES = (("embed", "data"), ("mlp", "model"), ("layers", None))


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    kernel_init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
    hidden = nn.Dense(512, kernel_init=kernel_init, use_bias=False)(x)
    out_init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
    return nn.Dense(256, kernel_init=out_init, use_bias=False)(jax.nn.relu(hidden))


def _inputs():
  return (jax.random.normal(jax.random.PRNGKey(1), (16, 256)),
          jax.random.normal(jax.random.PRNGKey(2), (16, 256)))


@jax.jit
def _train_step(state, inputs, targets):
  def loss_fn(params):
    return jnp.mean((state.apply_fn({"params": params}, inputs) - targets) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


MODEL = Block()


def _train(state, steps):
  inputs, targets = _inputs()
  losses = []
  for _ in range(steps):
    state, loss = _train_step(state, inputs, targets)
    losses.append(float(loss))
  return state, losses


def _plain_params(tx, steps):
  """The params after ``steps`` of the optax loop (update, apply_updates) on plain arrays.

  The same model and data as ``_train``, without TrainState, a mesh or logical metadata:
  what TrainState must reproduce (the loop's numerics are checked against the float64
  reference in test_kernel.py and test_alias.py).
  """
  params = nn.meta.unbox(MODEL.init(jax.random.PRNGKey(0), jnp.ones((1, 256)))["params"])
  inputs, targets = _inputs()

  def loss(params):
    return jnp.mean((MODEL.apply({"params": params}, inputs) - targets) ** 2)

  return trained_by_plain_loop(tx, params, loss, steps)


def _create(rng, tx):
  variables = MODEL.init(rng, jnp.ones((1, 256)))
  return train_state.TrainState.create(apply_fn=MODEL.apply, params=variables["params"], tx=tx)


def test_logical_partitioning_flow_names_the_reduced_axes_none():
  # Linen's Dense spells no output sharding, so its logical flow runs with Auto axes.
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  tx = osf.safefactor(5e-2, momentum=0.9)

  def init(rng):
    return _create(rng, tx)

  rng = jax.random.PRNGKey(0)
  abstract = jax.eval_shape(init, rng)
  logical_specs = nn.get_partition_spec(abstract)
  moment = logical_specs.opt_state.inner_state.second_moment["Dense_0"]["kernel"]
  # (256, 512) kernel: rows are axis 0 ('embed'), columns axis 1 ('mlp').
  assert moment.v_row == P("embed", None) and moment.v_col == P(None, "mlp")
  assert logical_specs.opt_state.inner_state.momentum["Dense_0"]["kernel"] == P("embed", "mlp")
  assert logical_specs.opt_state.skipped_steps == P()

  with jax.set_mesh(mesh):
    shardings = nn.logical_to_mesh_sharding(logical_specs, mesh, RULES)
    state = jax.jit(init, out_shardings=shardings)(rng)
    state = nn.meta.unbox(state)
    v_row = state.opt_state.inner_state.second_moment["Dense_0"]["kernel"].v_row
    assert v_row.shape == (256, 1) and v_row.sharding.spec == P("data", None)
    with nn.logical_axis_rules(RULES):
      state, losses = _train(state, 6)
  assert losses[-1] < 0.8 * losses[0]
  # Sharded sums add in another order: equal to float32 rounding, not bit for bit.
  chex.assert_trees_all_close(state.params, _plain_params(tx, 6), rtol=1e-5, atol=1e-7)
  new_row = state.opt_state.inner_state.second_moment["Dense_0"]["kernel"].v_row
  assert new_row.sharding.is_equivalent_to(v_row.sharding, 2)
