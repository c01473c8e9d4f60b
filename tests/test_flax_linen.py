"""Flax Linen: logical partitioning, eval_shape to jit(init); a TrainState of boxed params
trained as it is (unboxed params: test_ecosystems.py)."""

import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import serialization
from flax.training import train_state
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf
from tests.helpers import TRANSFORMATIONS, assert_trees_bitwise_equal, trained_by_plain_loop

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


@pytest.mark.parametrize("boxed", [False, True], ids=["unboxed", "boxed"])
def test_logical_partitioning_flow_names_the_reduced_axes_none(boxed):
  # Linen's Dense spells no output sharding, so its logical flow runs with Auto axes.
  # The state is trained unboxed, or as jit(init) made it, boxes and all.
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
    if not boxed:
      state = nn.meta.unbox(state)
    v_row = nn.meta.unbox(state.opt_state).inner_state.second_moment["Dense_0"]["kernel"].v_row
    assert v_row.shape == (256, 1) and v_row.sharding.spec == P("data", None)
    with nn.logical_axis_rules(RULES):
      state, losses = _train(state, 6)
  assert losses[-1] < 0.8 * losses[0]
  if boxed:  # still boxed, each name where init put it
    assert nn.get_partition_spec(state.opt_state) == logical_specs.opt_state
  state = nn.meta.unbox(state)
  # Sharded sums add in another order: equal to float32 rounding, not bit for bit.
  chex.assert_trees_all_close(state.params, _plain_params(tx, 6), rtol=1e-5, atol=1e-7)
  new_row = state.opt_state.inner_state.second_moment["Dense_0"]["kernel"].v_row
  assert new_row.sharding.is_equivalent_to(v_row.sharding, 2)


# A TrainState of logically partitioned params, trained as it is: the grads come boxed as
# the params are, and the updates must come back so.


def _boxed_dense(dtype):
  return nn.Dense(256, param_dtype=dtype,
                  kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                           ("embed", "mlp")),
                  bias_init=nn.with_logical_partitioning(nn.initializers.normal(0.1), ("mlp",)))


def _dense_state(tx, dtype, boxed):
  model = _boxed_dense(dtype)
  params = model.init(jax.random.key(0), jnp.ones((1, 128), dtype))["params"]
  return train_state.TrainState.create(apply_fn=model.apply,
                                       params=params if boxed else nn.meta.unbox(params), tx=tx)


@jax.jit
def _dense_step(state, poisoned):
  dtype = nn.meta.unbox(state.params)["bias"].dtype
  inputs = jax.random.normal(jax.random.key(1), (8, 128)).astype(dtype)

  def loss(params):
    out = state.apply_fn({"params": params}, inputs).astype(jnp.float32)
    return jnp.mean((out - 1.0) ** 2)

  grads = jax.grad(loss)(state.params)
  # A NaN in the kernel's grad (in its box, when boxed) on the poisoned step.
  grads = jax.tree.map(lambda g: g.at[0, 0].set(jnp.where(poisoned, jnp.nan, g[0, 0]))
                       if g.ndim == 2 else g, grads)
  return state.apply_gradients(grads=grads)


def _boxed_and_unboxed(tx, dtype, steps, nan_step=None):
  """The boxed TrainState and the unboxed one after ``steps`` of ``_dense_step``; the boxed
  one's params and state keep their boxes, and equal the unboxed ones bit for bit."""
  boxed, unboxed = (_dense_state(tx, dtype, boxed) for boxed in (True, False))
  specs = nn.get_partition_spec((boxed.params, boxed.opt_state))
  assert specs[0] == {"kernel": P("embed", "mlp"), "bias": P("mlp")}
  for step in range(steps):
    boxed, unboxed = (_dense_step(state, step == nan_step) for state in (boxed, unboxed))
  assert nn.get_partition_spec((boxed.params, boxed.opt_state)) == specs
  assert_trees_bitwise_equal(nn.meta.unbox(boxed.params), unboxed.params)
  assert_trees_bitwise_equal(nn.meta.unbox(boxed.opt_state), unboxed.opt_state)
  return boxed, unboxed


NAN_STEP = 3


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_a_boxed_train_state_trains_as_the_unboxed_one(name):
  # 0.3's update refused the boxed grads as not matching its state.
  subject = TRANSFORMATIONS[name]
  boxed, _ = _boxed_and_unboxed(subject.build(), jnp.float32, 6 * subject.every_k,
                                NAN_STEP if subject.guarded else None)
  if subject.guarded:
    assert int(osf.skipped_steps(boxed.opt_state)) == 1


# The modes that draw bits or keep a compensation per param, on bfloat16 params: a leaf's
# bits come from its path, which must be the param's, not the path into its box.
ROUNDING = {
    "stochastic": lambda: osf.safefactor(1e-2, momentum=0.9, param_rounding="stochastic",
                                         rounding_seed=1),
    "kahan": lambda: osf.safefactor(1e-2, momentum=0.9, param_rounding="kahan"),
    "with_param_rounding": lambda: osf.with_param_rounding(optax.sgd(1e-2, momentum=0.9),
                                                           "stochastic", seed=1),
}


@pytest.mark.parametrize("mode", sorted(ROUNDING))
def test_a_boxed_bfloat16_train_state_is_rounded_as_the_unboxed_one(mode):
  boxed, _ = _boxed_and_unboxed(ROUNDING[mode](), jnp.bfloat16, 5)
  assert nn.meta.unbox(boxed.params)["kernel"].dtype == jnp.bfloat16


def test_a_nan_in_a_boxed_grad_is_skipped_and_named_by_its_param():
  boxed, _ = _boxed_and_unboxed(osf.safefactor(1e-2), jnp.float32, 5, nan_step=NAN_STEP)
  report = osf.nonfinite_report(boxed.opt_state)
  assert report["skipped_steps"] == 1
  assert report["nonfinite_steps/params['kernel']"] == 1
  assert report.get("nonfinite_steps/params['bias']", 0) == 0


def test_a_boxed_param_left_out_by_multi_transform_keeps_no_state():
  tx = optax.multi_transform({"train": osf.safefactor(1e-2), "frozen": optax.set_to_zero()},
                             {"kernel": "train", "bias": "frozen"})
  boxed, unboxed = _boxed_and_unboxed(tx, jnp.float32, 3)
  assert len(jax.tree.leaves(boxed.opt_state)) == len(jax.tree.leaves(unboxed.opt_state))
  assert_trees_bitwise_equal(nn.meta.unbox(boxed.params)["bias"],
                             nn.meta.unbox(_dense_state(tx, jnp.float32, True).params)["bias"])


def test_a_boxed_optax_job_migrates_and_goes_on_as_the_unboxed_one():
  # migrate_from_optax read the boxed params' shapes off the boxes: an AttributeError.
  boxed, unboxed = (_dense_state(optax.adafactor(1e-2), jnp.float32, b) for b in (True, False))
  for _ in range(3):
    boxed, unboxed = (_dense_step(state, False) for state in (boxed, unboxed))
  tx = osf.safefactor(1e-2)
  migrated = osf.migrate_from_optax(boxed.opt_state, tx, boxed.params)
  reference = osf.migrate_from_optax(unboxed.opt_state, tx, unboxed.params)
  # Boxed as init boxes the state, holding what the unboxed migration holds.
  assert jax.tree.structure(migrated) == jax.tree.structure(tx.init(boxed.params))
  assert_trees_bitwise_equal(nn.meta.unbox(migrated), reference)
  boxed = boxed.replace(tx=tx, opt_state=migrated)
  unboxed = unboxed.replace(tx=tx, opt_state=reference)
  for _ in range(3):
    boxed, unboxed = (_dense_step(state, False) for state in (boxed, unboxed))
  assert_trees_bitwise_equal(nn.meta.unbox(boxed.params), unboxed.params)
  assert int(boxed.opt_state.inner_state.count) == 6


def test_a_msgpack_checkpoint_of_other_params_is_refused_naming_the_counts():
  # flax's from_bytes drops the saved keys its target lacks and returns arrays as saved:
  # a TrainState saved before a param was removed came back with a count too many under
  # the target's names, and the reports failed later with "zip() argument 2 is longer".
  def create(model):
    params = model.init(jax.random.key(0), jnp.ones((1, 8)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=osf.safefactor(1e-3))

  saved = serialization.to_bytes(create(nn.Dense(4)))
  with pytest.raises(ValueError, match=(
      r"opt_state/nonfinite_steps/counts: the saved LeafCounts has shape \(2,\), but the "
      r"restore's target has \(1,\) \(one count per param leaf of its params: "
      r"params\['kernel'\]\)")):
    serialization.from_bytes(create(nn.Dense(4, use_bias=False)), saved)


class _Normalised(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    x = nn.BatchNorm(use_running_average=not train)(nn.Dense(4)(x))
    return nn.Dense(1)(x)


@pytest.mark.parametrize("name", TRANSFORMATIONS)
def test_a_linen_models_whole_variables_are_refused_at_init(name):
  # TrainState.create(params=variables) was taken: the batch statistics are floats, and
  # they were trained as params (shrunk by weight decay; in eval mode moved by their
  # gradients), or the first update of the params' grads found none for them.
  model = _Normalised()
  variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
  with pytest.raises(TypeError, match=re.escape(
      "params['batch_stats'] is linen's batch_stats collection, the model's state, not "
      "params: an optimizer takes variables['params'] alone (TrainState.create("
      "params=variables['params'], ...), with the batch_stats in a field of their own)")):
    train_state.TrainState.create(apply_fn=model.apply, params=variables,
                                  tx=TRANSFORMATIONS[name].build())
  # The params alone train.
  state = train_state.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                        tx=TRANSFORMATIONS[name].build())
  state = state.apply_gradients(grads=jax.tree.map(jnp.ones_like, state.params))
  assert int(state.step) == 1


@pytest.mark.parametrize("collection", ["batch_stats", "cache", "intermediates",
                                        "perturbations"])
def test_each_linen_state_collection_is_refused_and_a_params_key_alone_is_taken(collection):
  params = {"dense": {"kernel": jnp.ones((3, 2))}}
  tx = osf.presets.t5x(1e-3)
  with pytest.raises(TypeError, match=re.escape(f"params[{collection!r}] is linen's")):
    tx.init({"params": params, collection: {"x": jnp.zeros(2)}})
  # A tree whose "params" key is its only one, whose other keys are no collection of
  # linen's, or which has no "params" key, is a user's own grouping: taken.
  for tree in ({"params": params}, {"params": params, "encoder": params},
               {"encoder": params, collection: params}):
    updates, _ = tx.update(tree, tx.init(tree), tree)
    assert jax.tree.structure(updates) == jax.tree.structure(tree)


def test_a_linen_collection_left_out_by_multi_transform_is_taken():
  # optax.multi_transform hands each transformation the whole variables with the leaves
  # of the others' labels masked out: the batch statistics arrive holding no array.
  model = _Normalised()
  variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
  labels = {"params": "train", "batch_stats": "frozen"}
  labels = {key: jax.tree.map(lambda _, label=label: label, variables[key])
            for key, label in labels.items()}
  tx = optax.multi_transform({"train": osf.safefactor(1e-2, weight_decay_rate=0.1),
                              "frozen": optax.set_to_zero()}, labels)
  state = tx.init(variables)
  updates, _ = tx.update(jax.tree.map(jnp.ones_like, variables), state, variables)
  trained = optax.apply_updates(variables, updates)
  assert_trees_bitwise_equal(trained["batch_stats"], variables["batch_stats"])
  assert not jnp.array_equal(trained["params"]["Dense_0"]["kernel"],
                             variables["params"]["Dense_0"]["kernel"])
