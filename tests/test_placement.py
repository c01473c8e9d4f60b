"""State sharding follows the params; the sharded update needs no parameter-sized communication."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf
from tests.helpers import assert_trees_close, compilations

SPECS = {
    "w": P("data", "model"), "tall": P("model", "data"), "b": P("model"), "e": P(None, "model"),
}
SHAPES = {"w": (256, 512), "tall": (512, 256), "b": (512,), "e": (4, 512)}
EXPECTED_STAT_SPECS = {
    # v_row keeps the rows (the smaller factored axis), v_col the columns.
    "w": osf.FactoredMoment(v_row=P("data", None), v_col=P(None, "model")),
    "tall": osf.FactoredMoment(v_row=P(None, "data"), v_col=P("model", None)),
}


def _mesh(axis_type):
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type, axis_type))


def _params(mesh, seed=0):
  rng = np.random.default_rng(seed)
  return {
      name: jax.device_put(jnp.asarray(rng.normal(size=shape), jnp.float32),
                           NamedSharding(mesh, SPECS[name]))
      for name, shape in SHAPES.items()
  }


def _specs(tree):
  return jax.tree.map(lambda x: x.sharding.spec, tree)


def _assert_stat_specs(state):
  moments = state.inner_state.second_moment
  for name, expected in EXPECTED_STAT_SPECS.items():
    moment = moments[name]
    for wanted, stat in ((expected.v_row, moment.v_row), (expected.v_col, moment.v_col)):
      assert stat.sharding.is_equivalent_to(NamedSharding(stat.sharding.mesh, wanted), stat.ndim), (
          name, stat.sharding.spec, wanted)
  for name in ("b", "e"):
    assert moments[name].v.sharding.is_equivalent_to(
        NamedSharding(moments[name].v.sharding.mesh, SPECS[name]), len(SHAPES[name]))
  for name, spec in SPECS.items():
    momentum = state.inner_state.momentum[name]
    assert momentum.sharding.is_equivalent_to(NamedSharding(momentum.sharding.mesh, spec),
                                              momentum.ndim)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_state_follows_param_shardings_and_is_a_fixed_point(axis_type):
  mesh = _mesh(axis_type)
  tx = osf.safefactor(0.1, momentum=0.9)
  with jax.set_mesh(mesh):
    params = _params(mesh)
    eager = tx.init(params)
    _assert_stat_specs(eager)
    specs = osf.state_partition_specs(tx, params)
    assert jax.tree.structure(specs) == jax.tree.structure(eager)
    jitted = jax.jit(tx.init, out_shardings=specs)(params)
    _assert_stat_specs(jitted)
    if axis_type == AxisType.Explicit:  # Auto-mode tracers carry no sharding to follow
      _assert_stat_specs(jax.jit(tx.init)(params))
    update = jax.jit(tx.update)
    state = eager
    for step in range(3):
      _, new_state = update(_params(mesh, seed=step + 1), state, params)
      for old, new in zip(jax.tree.leaves(state), jax.tree.leaves(new_state), strict=True):
        assert new.sharding.is_equivalent_to(old.sharding, new.ndim)
      state = new_state


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_sharded_steps_equal_single_device_steps(axis_type):
  mesh = _mesh(axis_type)
  tx = osf.safefactor(0.1, momentum=0.9, weight_decay_rate=1e-3)
  grads = [jax.tree.map(np.asarray, _params(mesh, seed=s)) for s in range(1, 5)]
  single_params = jax.tree.map(np.asarray, _params(mesh))
  single_state = tx.init(jax.tree.map(jnp.asarray, single_params))
  with jax.set_mesh(mesh):
    params = _params(mesh)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for g in grads:
      sharded_g = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in g.items()}
      updates, state = update(sharded_g, state, params)
      params = optax.apply_updates(params, updates)
  single_update = jax.jit(tx.update)
  single_params = jax.tree.map(jnp.asarray, single_params)
  for g in grads:
    updates, single_state = single_update(jax.tree.map(jnp.asarray, g), single_state, single_params)
    single_params = optax.apply_updates(single_params, updates)
  assert_trees_close(jax.tree.map(np.asarray, params), single_params, rtol=1e-5)
  assert_trees_close(jax.tree.map(np.asarray, state), single_state, rtol=1e-5)


def _collectives(hlo_text):
  found = []
  for line in hlo_text.splitlines():
    match = re.search(r"= (.*?) (all-gather|all-reduce|all-to-all|collective-permute|"
                      r"reduce-scatter)(-start)?\(", line)
    if match:
      sizes = [int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
               for dims in re.findall(r"\[([0-9,]*)\]", match.group(1))]
      found.append((match.group(2), sizes))
  return found


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("settings", [{}, {"skip_spikes": 6.0}], ids=["default", "spikes"])
def test_update_needs_only_small_all_reduces(axis_type, settings):
  # The spike rule sums every leaf's squares: a sharded leaf summed with the others (as
  # one concatenation) was gathered whole onto every device under Auto axes.
  mesh = _mesh(axis_type)
  tx = osf.safefactor(0.1, momentum=0.9, **settings)
  with jax.set_mesh(mesh):
    params = _params(mesh)
    state = tx.init(params)
    hlo = jax.jit(tx.update).lower(params, state, params).compile().as_text()
  collectives = _collectives(hlo)
  assert collectives, "a sharded update must all-reduce its statistics"
  assert {kind for kind, _ in collectives} == {"all-reduce"}, collectives
  # The largest operand is a local row or column statistic (512 / 4 devices = 128).
  assert max(max(sizes) for _, sizes in collectives) <= 128, collectives


def test_an_eager_update_leaves_replicated_leaves_replicated_under_auto_axes():
  # Eager, the update around the inner step is traced (accumulate_gradients' lax.cond):
  # the spike rule's sums once moved every replicated leaf's state and update onto the
  # axis of a sharded one.
  mesh = _mesh(AxisType.Auto)
  tx = osf.accumulate_gradients(osf.safefactor(0.1, skip_spikes=4.0, momentum=0.9), 1)
  with jax.set_mesh(mesh):
    params = {"b": jax.device_put(jnp.ones(512), NamedSharding(mesh, P("model"))),
              "z": jax.device_put(jnp.ones(32), NamedSharding(mesh, P()))}
    state = tx.init(params)
    updates, new_state = tx.update(jax.tree.map(lambda p: p * 0.5, params), state, params)
  assert updates["z"].sharding.is_fully_replicated, updates["z"].sharding
  assert updates["b"].sharding.is_equivalent_to(params["b"].sharding, 1)
  for old, new in zip(jax.tree.leaves(state), jax.tree.leaves(new_state), strict=True):
    assert new.sharding.is_equivalent_to(old.sharding, new.ndim), (old.sharding, new.sharding)


def test_per_device_state_bytes_shrink_with_the_mesh():
  mesh = _mesh(AxisType.Explicit)
  tx = osf.safefactor(0.1, momentum=0.9)
  with jax.set_mesh(mesh):
    state = tx.init(_params(mesh))
  per_device = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state))
  replicated = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
  # Momentum is split 8 ways (or 4 for the leaves sharded over "model" only); counters are
  # replicated scalars. Measured: 1/7.78 of the replicated bytes (README: "about 1/8").
  # These are byte counts, not timings: the margin to 1/7.7 is ~350 more replicated
  # int32 scalars, while replicating the factored statistics gives 1/7.55 and one
  # momentum replicated over "model" 1/7.44.
  assert per_device < replicated / 7.7, (replicated / per_device, per_device, replicated)


def test_partition_specs_for_abstract_params_and_wrappers():
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  for tx in (
      osf.safefactor(0.1, momentum=0.9),
      # min_dim_size_to_factor decides shapes, so a traced init needs it static.
      optax.inject_hyperparams(osf.safefactor, static_args="min_dim_size_to_factor")(0.1),
      optax.MultiSteps(osf.safefactor(0.1), every_k_schedule=2),
  ):
    specs = osf.state_partition_specs(tx, params, SPECS)
    abstract = jax.eval_shape(tx.init, params)
    assert jax.tree.structure(specs) == jax.tree.structure(abstract)
    for spec, leaf in zip(jax.tree.leaves(specs), jax.tree.leaves(abstract), strict=True):
      assert isinstance(spec, P) and len(spec) in (0, leaf.ndim)
  specs = osf.state_partition_specs(osf.safefactor(0.1), params, SPECS)
  assert specs.inner_state.second_moment["w"] == EXPECTED_STAT_SPECS["w"]
  assert specs.inner_state.count == P() and specs.skipped_steps == P()


def _normalised(spec):
  """A spec's entries without trailing ``None``s: ``P('data', None)`` places as ``P('data')``."""
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return tuple(entries)


def _placed_specs(tx, params):
  """The specs of the state that eager init places on sharded ``params`` by itself."""
  return jax.tree.map(lambda x: P(*x.sharding.spec) if isinstance(x.sharding, NamedSharding)
                      else P(), tx.init(params))


def test_partition_specs_of_tuple_params_in_a_chain_are_where_init_places_the_state():
  # A chain's states are a tuple as long as a tuple of two params: each member's state
  # got one param's spec, and the kernel's statistics and momentum came back replicated,
  # stored whole on every device under jit's out_shardings.
  mesh = _mesh(AxisType.Auto)
  specs = (P("data", "model"), P("model"))
  params = tuple(jax.device_put(jnp.ones(shape), NamedSharding(mesh, spec))
                 for shape, spec in zip([(256, 512), (512,)], specs, strict=True))
  tx = optax.chain(optax.clip_by_global_norm(1.0), osf.safefactor(1e-3, momentum=0.9))
  computed = osf.state_partition_specs(tx, params, specs)
  assert computed[1].inner_state.momentum[0] == P("data", "model")
  assert jax.tree.map(_normalised, computed) == jax.tree.map(
      _normalised, _placed_specs(tx, params))


@pytest.mark.parametrize("size, options", [(8, {}), (16, dict(skip_spikes=6.0,
                                                               spike_window=16))])
def test_partition_specs_leave_the_counters_of_a_single_param_replicated(size, options):
  # A single array param is a prefix of any state: every counter of its length (8 counted
  # hyperparameters, a spike window of its size) took the param's spec, which the step's
  # selects then refused on an explicit mesh.
  mesh = _mesh(AxisType.Explicit)
  param = jax.device_put(jnp.ones(size), NamedSharding(mesh, P("model")))
  tx = osf.safefactor(1e-3, **options)
  computed = osf.state_partition_specs(tx, param, P("model"))
  assert jax.tree.map(_normalised, computed) == jax.tree.map(
      _normalised, _placed_specs(tx, param))
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init, out_shardings=computed)(param)
    jax.jit(tx.update)(param, state, param)


@pytest.mark.parametrize("spec, error, message", [
    (P("data", "model", None), ValueError,
     r"param_specs\['w'\] is .* with 3 entries, for a param of shape \(256, 512\) \(rank 2\)"),
    (P("dta", None), ValueError, r"param_specs\['w'\] .* the mesh has no axis 'dta'"),
    (P(("data", "modle"), None), ValueError, r"param_specs\['w'\] .* no axis 'modle'"),
    ("data", TypeError, r"param_specs\['w'\] must be a PartitionSpec, got str"),
    # A plain tuple was read as a tuple of params: "param_specs['w'][0], ... not in params".
    (("data", "model"), TypeError, r"param_specs\['w'\] must be a PartitionSpec, got the "
                                   r"tuple \('data', 'model'\): write PartitionSpec"),
    # JAX's DuplicateSpecError, from inside, named no param.
    (P("model", "model"), ValueError, r"param_specs\['w'\] is .*: it names mesh axis 'model' "
                                      r"more than once"),
], ids=["too-long", "unknown-axis", "unknown-axis-in-tuple", "not-a-spec", "plain-tuple",
        "axis-twice"])
def test_partition_specs_refuse_a_spec_that_cannot_place_its_param(spec, error, message):
  # Each failed deep inside (a zip in the traced init, JAX's mesh lookup) without a path.
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  with pytest.raises(error, match=message):
    osf.state_partition_specs(osf.safefactor(0.1, momentum=0.9), params, SPECS | {"w": spec},
                              mesh=_mesh(AxisType.Explicit))


@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
def test_a_state_placed_unlike_its_params_steps_on_an_explicit_mesh(jitted):
  # A state committed to one replicated sharding (restored without state shardings) with
  # sharded params: optax.adafactor steps, and safefactor stopped in the guard's select,
  # "select cases must have the same shardings", naming no param.
  mesh = _mesh(AxisType.Explicit)
  host = {"kernel": jnp.ones((256, 512)), "bias": jnp.zeros((512,))}
  specs = {"kernel": P("data", "model"), "bias": P("model")}
  tx = osf.safefactor(1e-3, momentum=0.9)
  state = jax.device_put(tx.init(host), NamedSharding(mesh, P()))
  with jax.set_mesh(mesh):
    params = jax.tree.map(lambda p, s: jax.device_put(p, NamedSharding(mesh, s)), host, specs)
    update = jax.jit(tx.update) if jitted else tx.update
    updates, new_state = update(params, state, params)
  expected, _ = tx.update(host, tx.init(host), host)
  assert_trees_close(updates, expected, rtol=1e-5)
  assert new_state.inner_state.momentum["kernel"].sharding.spec == P("data", "model")


@pytest.mark.parametrize("init_under_mesh", [False, True], ids=["init-outside", "init-inside"])
def test_spike_skipping_on_an_explicit_mesh_steps_without_a_current_mesh(init_under_mesh):
  # Params placed on an Explicit mesh, stepped without jax.set_mesh: the spike history's
  # ring and the step's norm were on different meshes, and dynamic_update_slice refused
  # the pair ("operand sharding must be equal to update sharding").
  mesh = _mesh(AxisType.Explicit)
  tx = osf.safefactor(1e-3, skip_spikes=6.0, spike_window=4)
  params = {name: _params(mesh)[name] for name in ("w", "b")}
  update = jax.jit(tx.update)
  grads = [jax.tree.map(lambda p, s=scale: p * s, params) for scale in (1.0, 1.1, 0.9, 50.0)]
  if init_under_mesh:  # as a state restored onto the mesh is placed
    with jax.set_mesh(mesh):
      state = tx.init(params)
  else:
    state = tx.init(params)
  for grad in grads:
    _, state = update(grad, state, params)
  host = jax.tree.map(np.asarray, params)
  expected_state = tx.init(host)
  for grad in grads:
    _, expected_state = update(jax.tree.map(np.asarray, grad), expected_state, host)
  assert int(osf.skipped_spikes(state)) == int(osf.skipped_spikes(expected_state)) == 1
  assert_trees_close(state.spikes.gradient_norms, expected_state.spikes.gradient_norms,
                     rtol=1e-6)


def test_partition_specs_check_axis_names_against_the_current_mesh():
  # Without mesh=, inside jax.set_mesh (as the sharding guide writes it), a misspelt axis
  # passed, and JAX's error later quoted a statistic's spec the user never wrote.
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  tx = osf.safefactor(0.1)
  with (jax.set_mesh(_mesh(AxisType.Explicit)),
        pytest.raises(ValueError, match=r"param_specs\['w'\] is .*: the mesh has no axis "
                                        r"'mdl' \(its axes: 'data', 'model'\)")):
    osf.state_partition_specs(tx, params, SPECS | {"w": P("data", "mdl")})
  # With no mesh current, names are not checked (the specs may be for a mesh made later).
  osf.state_partition_specs(tx, params, SPECS | {"w": P("data", "mdl")})


def test_partition_specs_and_migration_refuse_what_is_no_optimizer_or_mesh():
  # An AttributeError ('function' object has no attribute 'init') from deep inside.
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  called = r"optimizer must be an optax GradientTransformation .*call it: osf.safefactor\("
  with pytest.raises(TypeError, match="state_partition_specs: " + called):
    osf.state_partition_specs(osf.safefactor, params, SPECS)
  with pytest.raises(TypeError, match=r"state_partition_specs: mesh must be a "
                                      r"jax.sharding.Mesh \(or None\), got 'x'"):
    osf.state_partition_specs(osf.safefactor(0.1), params, SPECS, mesh="x")
  concrete = {k: jnp.ones(s) for k, s in SHAPES.items()}
  with pytest.raises(TypeError, match="migrate_from_optax: " + called):
    osf.migrate_from_optax(optax.adafactor(0.1).init(concrete), osf.safefactor, concrete)
  # The params or a state in the optimizer's place: named so, not printed whole.
  in_place = (r"optimizer must be an optax GradientTransformation .*, got a {} holding \d+ "
              r"arrays: the params, or an optimizer's state, in optimizer's place\?$")
  with pytest.raises(TypeError, match="migrate_from_optax: " + in_place.format("dict")):
    osf.migrate_from_optax(optax.adafactor(0.1).init(concrete), concrete, osf.safefactor(0.1))
  with pytest.raises(TypeError, match="state_partition_specs: " + in_place.format(
      "SkipNonfiniteState")):
    osf.state_partition_specs(osf.safefactor(0.1).init(concrete), params, SPECS)


@pytest.mark.parametrize("given,says", [
    (lambda params: SPECS, "is a PartitionSpec, not a param: pass the params (arrays or "
                           "jax.ShapeDtypeStructs) and then their specs, "
                           "state_partition_specs(optimizer, params, param_specs)"),
    (lambda params: {k: jax.sharding.SingleDeviceSharding(jax.devices()[0]) for k in params},
     "is a SingleDeviceSharding, not a param: pass the params (arrays or "
     "jax.ShapeDtypeStructs) and then their specs"),
    (lambda params: {k: float(i) for i, k in enumerate(params)},
     "is a float, not a param: pass arrays or jax.ShapeDtypeStructs"),
])
def test_partition_specs_name_what_was_given_for_the_params(given, says):
  # The params' specs given second (the params left out) failed with "AttributeError: 'P'
  # object has no attribute 'shape'", from inside.
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  with pytest.raises(TypeError, match=r"^state_partition_specs: params\['\w+'\] "
                                      + re.escape(says)):
    osf.state_partition_specs(osf.safefactor(0.1), given(params))


def test_an_auto_mode_step_with_pinned_out_shardings_compiles_once_and_keeps_them():
  # Under jit in Auto mode XLA picks the outputs' shardings; the README's set-up pins
  # them with out_shardings from state_partition_specs, and the step then compiles once
  # and hands every state leaf back where it was.
  mesh = _mesh(AxisType.Auto)
  tx = osf.safefactor(0.1, momentum=0.9, weight_decay_rate=1e-3)
  traces = []

  def loss(params):
    return sum(jnp.sum(jnp.tanh(p) ** 2) for p in jax.tree.leaves(params))

  def train_step(params, state):
    traces.append(1)
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(mesh):
    params = _params(mesh)
    param_shardings = jax.tree.map(lambda p: p.sharding, params)
    state_shardings = osf.state_partition_specs(tx, params, mesh=mesh)
    state = jax.jit(tx.init, out_shardings=state_shardings)(params)
    step = jax.jit(train_step, out_shardings=(param_shardings, state_shardings))
    # Counted as compilations: a step traced once compiles again for inputs placed elsewhere.
    with compilations() as compiled:
      for _ in range(4):
        params, state = step(params, state)
  assert len(traces) == 1 and compiled.count("jit(train_step)") == 1, compiled
  for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(state_shardings),
                            strict=True):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
  for name, spec in SPECS.items():
    assert params[name].sharding.is_equivalent_to(NamedSharding(mesh, spec), params[name].ndim)
