"""Flax NNX: nnx.Optimizer over partitioned params on a mesh, and over params that optax's
masks leave out (test_ecosystems.py: the rest)."""


import warnings

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf
from tests.flax_models import SmallMLP
from tests.helpers import (
    TRANSFORMATIONS,
    compilations,
    train_with_nnx_optimizer,
    trained_by_plain_loop,
)


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


def test_logical_factor_rules_read_nnx_partition_specs():
  # nnx.get_partition_spec gives each param's names inside its Variable: the paths, ending
  # in .value, matched no param (a warning, and the heuristic for every param), and an
  # unannotated bias's empty P() was read as no roles at all (init failed).
  with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)):
    model = MLP(nnx.Rngs(0), partitioned=True)
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    rules = osf.logical_factor_rules(specs, {"model": "none"})
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      optimizer = nnx.Optimizer(model, osf.safefactor(1e-2, factor_rules=rules), wrt=nnx.Param)
  moments = optimizer.opt_state.inner_state.second_moment
  # The "model" axis has no role, so neither kernel is factored (the heuristic would).
  assert isinstance(moments["up"]["kernel"], osf.FullMoment)
  assert isinstance(moments["down"]["kernel"], osf.FullMoment)


def test_the_reports_on_an_nnx_state_say_to_pass_the_optimizers_state():
  # nnx.state((model, optimizer)), what the checkpoints guide saves and restores, keeps the
  # arrays but not the state's types: the reports said the optimizer had no guard at all.
  model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, osf.safefactor(1e-2), wrt=nnx.Param)
  optimizer.update(model, jax.tree.map(lambda p: jnp.full_like(p, jnp.nan),
                                       nnx.state(model, nnx.Param)))
  assert int(osf.skipped_steps(optimizer.opt_state)) == 1
  # The nnx.Optimizer itself, a flax.nnx type holding the guard, is read as its state.
  assert int(osf.skipped_steps(optimizer)) == 1
  state = nnx.state((model, optimizer))
  for tree in (state, state[1]["opt_state"]):
    for report in (osf.skipped_steps, osf.nonfinite_summary, osf.nonfinite_report):
      with pytest.raises(ValueError, match=r"this is a flax State .* pass optimizer.opt_state"):
        report(tree)


@pytest.mark.parametrize("has_aux", [False, True])
def test_nnx_value_and_grads_pair_given_to_the_optimizer_is_named(has_aux):
  # nnx.Optimizer.update hands the pair on as an nnx.State keyed 1 (the loss, no param,
  # filtered out): the error listed params[1]['bias'] as missing and unexpected at once.
  model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, osf.safefactor(1e-2), wrt=nnx.Param)

  def loss_fn(model):
    loss = jnp.mean(model(jnp.ones((2, 8))) ** 2)
    return (loss, {"accuracy": jnp.ones(())}) if has_aux else loss

  pair = nnx.value_and_grad(loss_fn, has_aux=has_aux)(model)
  with pytest.raises(ValueError, match=r"grads do not match the optimizer state: grads is the "
                                       r"pair \(value, grads\) that jax.value_and_grad returns "
                                       r"\(nnx.value_and_grad alike\)"):
    optimizer.update(model, pair)
  optimizer.update(model, pair[1])
  assert int(optimizer.opt_state.inner_state.count) == 1


@pytest.mark.parametrize("make", [lambda: osf.safefactor(1e-2),
                                  lambda: osf.accumulate_gradients(osf.safefactor(1e-2), 2)],
                         ids=["safefactor", "accumulate_gradients"])
def test_the_whole_nnx_state_given_to_init_names_the_params_filter(make):
  # nnx.state(model) holds the RNG streams' counts and the batch statistics beside the
  # params: the first integer count was refused with the advice to mask it out.
  class WithDropout(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(8, 4, rngs=rngs)
      self.dropout = nnx.Dropout(0.1, rngs=rngs)

  model = WithDropout(nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"\['count'\]: param dtype uint32 is not floating or "
                                      r"complex; it is an nnx Rng\w+, not a Param: an optimizer "
                                      r"takes the params alone, nnx.state\(model, nnx.Param\)"):
    make().init(nnx.state(model))
  make().init(nnx.state(model, nnx.Param))
  # An integer Param is a param: the advice to leave it out stays.
  with pytest.raises(TypeError, match=r"\['step'\]: param dtype int32 is not floating or "
                                      r"complex; (exclude it|accumulate_gradients sums)"):
    make().init({"step": nnx.Param(jnp.zeros((), jnp.int32))})


class _WithBatchNorm(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(8, 16, rngs=rngs)
    self.norm = nnx.BatchNorm(16, rngs=rngs)

  def __call__(self, x):
    return self.norm(self.linear(x))


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_batch_statistics_given_as_params_are_refused_at_init(name):
  # Float batch statistics passed every check: tx.init(nnx.state(model)) and
  # nnx.Optimizer(model, tx, wrt=nnx.Variable) built, and the first update listed them as
  # missing from the grads (had the grads held them, weight decay would have shrunk them).
  model = _WithBatchNorm(nnx.Rngs(0))
  refusal = (r"params\['norm'\]\['mean'\]: param is an nnx BatchStat, the model's state, "
             r"not a Param: an optimizer takes the params alone, nnx.state\(model, nnx.Param\) "
             r"\(nnx.Optimizer\(model, tx, wrt=nnx.Param\) hands it those\)")
  with pytest.raises(TypeError, match=refusal):
    TRANSFORMATIONS[name].build().init(nnx.state(model))
  with pytest.raises(TypeError, match=refusal):
    nnx.Optimizer(model, TRANSFORMATIONS[name].build(), wrt=nnx.Variable)
  optimizer = nnx.Optimizer(model, TRANSFORMATIONS[name].build(), wrt=nnx.Param)
  model.train()
  optimizer.update(model, nnx.grad(lambda m: jnp.mean(m(jnp.ones((4, 8))) ** 2))(model))


def test_a_models_other_state_is_refused_and_a_variable_kind_of_ones_own_is_taken():
  class Trainable(nnx.Variable):  # a kind of the user's own, trained with wrt=Trainable
    pass

  tx = osf.safefactor(1e-2)
  for variable, kind in ((nnx.Cache(jnp.ones(3)), "Cache"),
                         (nnx.Intermediate(jnp.ones(3)), "Intermediate"),
                         (nnx.BatchStat(jnp.ones((2, 3), jnp.bfloat16)), "BatchStat")):
    with pytest.raises(TypeError, match=rf"params\['x'\]: param is an nnx {kind}, "):
      tx.init({"x": variable})
  tx.init({"x": Trainable(jnp.ones(3)), "lora": nnx.LoRAParam(jnp.ones(3))})
  # The RNG counts keep their message, which their dtype gives first.
  with pytest.raises(TypeError, match=r"param dtype uint32 is not floating or complex; it is "
                                      r"an nnx RngCount"):
    tx.init({"x": nnx.RngCount(jnp.zeros((), jnp.uint32))})


def test_an_nnx_optimizers_optax_state_migrates_into_its_opt_state():
  # The converted state came out in the params' boxes, not the optimizer's: assigned to
  # optimizer.opt_state, the next update failed inside flax ("Cannot set key
  # 'consecutive_skips' on immutable node"). N optax steps then M safefactor steps equal
  # N + M optax steps (float32, healthy gradients).
  def loss_fn(model, x):
    return jnp.mean(model(x) ** 2)

  def train(optimizer, model, steps):
    for i in range(steps):
      x = jax.random.normal(jax.random.key(i), (4, 64))
      optimizer.update(model, nnx.grad(loss_fn)(model, x))

  reference_model = nnx.Linear(64, 8, rngs=nnx.Rngs(0))
  train(nnx.Optimizer(reference_model, optax.adafactor(1e-2), wrt=nnx.Param),
        reference_model, 4)
  model = nnx.Linear(64, 8, rngs=nnx.Rngs(0))
  old = nnx.Optimizer(model, optax.adafactor(1e-2), wrt=nnx.Param)
  train(old, model, 2)
  tx = osf.safefactor(1e-2)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  optimizer.opt_state = osf.migrate_from_optax(old.opt_state, tx, nnx.state(model, nnx.Param))
  for i in range(2, 4):
    x = jax.random.normal(jax.random.key(i), (4, 64))
    optimizer.update(model, nnx.grad(loss_fn)(model, x))
  chex.assert_trees_all_close(nnx.state(model, nnx.Param), nnx.state(reference_model,
                                                                      nnx.Param), rtol=1e-5)
  assert osf.nonfinite_summary(optimizer.opt_state) == "no skipped steps in 2 steps"


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


# optax's two ways of leaving params out, here the biases: each gets the transformation for
# the kernels. Under nnx.Optimizer the MaskedNode that stands for a bias comes in its Param.
def _is_kernel(param):
  return param.ndim == 2


LEAVING_OUT = {
    "masked": lambda tx: optax.masked(tx, lambda params: jax.tree.map(_is_kernel, params)),
    "multi_transform": lambda tx: optax.multi_transform(
        {"train": tx, "frozen": optax.set_to_zero()},
        lambda params: jax.tree.map(lambda p: "train" if _is_kernel(p) else "frozen", params)),
}


def _small_data():
  return (jax.random.normal(jax.random.key(1), (8, 16)),
          jax.random.normal(jax.random.key(2), (8, 8)))


def _train_small(model, tx, steps):
  return train_with_nnx_optimizer(model, tx, *_small_data(), steps)


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
@pytest.mark.parametrize("leaving_out", sorted(LEAVING_OUT))
def test_params_left_out_by_optax_keep_no_state_and_the_rest_trains_as_in_the_plain_loop(
    leaving_out, name):
  # 0.3 took the Param around a MaskedNode for a param and refused it as no array.
  subject = TRANSFORMATIONS[name]
  tx = LEAVING_OUT[leaving_out](subject.build())
  steps = 6 * subject.every_k
  model = SmallMLP(nnx.Rngs(0))
  graphdef, start = nnx.split(SmallMLP(nnx.Rngs(0)), nnx.Param)
  optimizer = _train_small(model, tx, steps)
  start = nnx.to_pure_dict(start)
  # As many state arrays as optax keeps for the pure dict: none for the biases.
  assert len(jax.tree.leaves(optimizer.opt_state)) == len(jax.tree.leaves(tx.init(start)))
  inputs, targets = _small_data()

  def loss(params):
    return jnp.mean((nnx.merge(graphdef, params)(inputs) - targets) ** 2)

  chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                              trained_by_plain_loop(tx, start, loss, steps),
                              rtol=1e-6, atol=1e-8)


def test_params_frozen_by_multi_transform_leave_the_kernels_trained_as_alone():
  tx = osf.safefactor(0.1, momentum=0.9, weight_decay_rate=1e-4)
  model = SmallMLP(nnx.Rngs(0))
  graphdef, start = nnx.split(SmallMLP(nnx.Rngs(0)), nnx.Param)
  _train_small(model, LEAVING_OUT["multi_transform"](tx), 5)
  start, trained = nnx.to_pure_dict(start), nnx.to_pure_dict(nnx.state(model, nnx.Param))
  inputs, targets = _small_data()

  def loss(kernels):
    params = {layer: dict(start[layer], kernel=kernels[layer]) for layer in start}
    return jnp.mean((nnx.merge(graphdef, params)(inputs) - targets) ** 2)

  kernels = {layer: start[layer]["kernel"] for layer in start}
  expected = trained_by_plain_loop(tx, kernels, loss, 5)
  for layer in start:
    chex.assert_trees_all_equal(trained[layer]["bias"], start[layer]["bias"])
    chex.assert_trees_all_close(trained[layer]["kernel"], expected[layer], rtol=1e-6, atol=1e-8)


class _WithIndices(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(4, 3, rngs=rngs)
    self.offsets = nnx.Param(jnp.arange(3, dtype=jnp.int32))

  def __call__(self, x):
    return self.linear(x) + self.offsets.astype(jnp.float32)[None]


@pytest.mark.parametrize("leaving_out", sorted(LEAVING_OUT))
def test_an_integer_param_left_out_as_the_error_advises_trains_under_nnx(leaving_out):
  model = _WithIndices(nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"params\['offsets'\]: .* exclude it with optax.masked "
                                      "or optax.multi_transform"):
    nnx.Optimizer(model, osf.safefactor(0.1), wrt=nnx.Param)

  def is_floating(params):
    return jax.tree.map(lambda p: jnp.issubdtype(p.dtype, jnp.floating), params)

  excluded = {
      "masked": optax.masked(osf.safefactor(0.1), is_floating),
      "multi_transform": optax.multi_transform(
          {"train": osf.safefactor(0.1), "frozen": optax.set_to_zero()},
          lambda params: jax.tree.map(lambda floating: "train" if floating else "frozen",
                                      is_floating(params))),
  }[leaving_out]
  optimizer = nnx.Optimizer(model, excluded, wrt=nnx.Param)
  before = nnx.to_pure_dict(nnx.state(model, nnx.Param))

  @nnx.jit
  def train_step(model, optimizer):
    grads = nnx.grad(lambda model: jnp.sum(model(jnp.ones((2, 4))) ** 2), allow_int=True)(model)
    # An integer's gradient is float0, which optax.apply_updates cannot add (for any
    # optimizer): the frozen offsets get a zero of their own dtype.
    optimizer.update(model, jax.tree.map(
        lambda g: jnp.zeros(g.shape, jnp.int32) if g.dtype == jax.dtypes.float0 else g, grads))

  train_step(model, optimizer)
  after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  chex.assert_trees_all_equal(after["offsets"], before["offsets"])
  assert not jnp.array_equal(after["linear"]["kernel"], before["linear"]["kernel"])


def _linear_pair():
  model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
  return model, nnx.Optimizer(model, osf.safefactor(1e-3), wrt=nnx.Param)


def test_the_0_2_layout_of_an_nnx_optimizer_keeps_its_boxes_both_ways():
  # nnx.Optimizer keeps every state array in an OptArray; the conversions took the
  # counters out of theirs, so the converted state could not go back into the optimizer.
  model, optimizer = _linear_pair()
  optimizer.update(model, jax.tree.map(lambda p: jnp.full_like(p, jnp.nan),
                                       nnx.state(model, nnx.Param)))
  today = optimizer.opt_state
  old = osf.state_in_0_2_layout(today)
  assert {type(count).__name__ for count in old.nonfinite_steps.values()} == {"OptArray"}
  for migrated in (osf.migrate_from_0_2(old), osf.migrate_from_0_2(old, like=today)):
    assert jax.tree.structure(migrated) == jax.tree.structure(today)
    optimizer.opt_state = migrated
    optimizer.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))
    assert osf.nonfinite_report(optimizer.opt_state)["nonfinite_steps/params['bias']"] == 1
  abstract = osf.state_in_0_2_layout(nnx.eval_shape(_linear_pair)[1].opt_state)
  assert {type(count).__name__ for count in abstract.last_nonfinite_step.values()} == {"OptArray"}


@pytest.mark.parametrize("convert", [osf.state_in_0_2_layout, osf.migrate_from_0_2])
def test_the_0_2_conversions_refuse_the_pairs_nnx_state_and_say_what_to_convert(convert):
  # nnx.state flattens the guard into a mapping, in which nothing was found to convert:
  # the tree came back unchanged, and orbax failed later on a path of its own.
  model, optimizer = _linear_pair()
  with pytest.raises(TypeError, match=r"guard's fields .* mapping .* optimizer\.opt_state = "
                                      rf"osf\.{convert.__name__}\(optimizer\.opt_state\)"):
    convert(nnx.state((model, optimizer)))
