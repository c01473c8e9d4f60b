"""Inside ``jax.shard_map``: the guard decides for the whole step on every device, what a
shard cannot compute is refused by name, and each shard draws its own rounding bits.

Each test compares a step inside ``shard_map`` with the same step under ``jax.jit`` on the
whole arrays (the reference: the guard's rule as written), on the 8 virtual CPU devices of
``tests/conftest.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf
from tests.helpers import assert_trees_close

SPLIT = {"w": P("model", None), "b": P()}          # w's rows over 4 devices; b replicated
REPLICATED = {"w": P(), "b": P()}


def _mesh():
  return jax.make_mesh((2, 4), ("data", "model"))


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, 256 * 128, dtype=jnp.float32).reshape(256, 128),
          "b": jnp.zeros((128,), jnp.float32)}


def _grads(seed, scale=1.0, nan_at=None):
  keys = jax.random.split(jax.random.key(seed))
  grads = {"w": scale * jax.random.normal(keys[0], (256, 128)),
           "b": scale * jax.random.normal(keys[1], (128,))}
  if nan_at is not None:
    grads["w"] = grads["w"].at[nan_at].set(jnp.nan)
  return grads


def _put(mesh, tree, specs):
  return jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), tree, specs)


def _steps(tx, specs, grads_list, *, losses=None, average=False, vary_grads=()):
  """``tx``'s steps inside ``shard_map`` (params and grads placed by ``specs``), then the
  same steps under ``jax.jit`` on the whole arrays: both final (params, state) pairs."""
  mesh = _mesh()
  params = _params()
  state = tx.init(params)
  state_specs = osf.state_partition_specs(tx, params, specs)
  extra = (lambda loss: {}) if losses is None else (lambda loss: {"value": loss})
  losses = [0.0] * len(grads_list) if losses is None else losses

  def inside(grads, state, params, loss):
    if average:
      grads = jax.lax.pmean(grads, "data")
    if vary_grads:  # a different gradient on each device, as a local batch's would be
      index = jax.lax.axis_index(vary_grads)
      grads = jax.tree.map(lambda g: g * (1.0 + index.astype(g.dtype)), grads)
    updates, state = tx.update(grads, state, params, **extra(loss))
    return optax.apply_updates(params, updates), state

  def whole(grads, state, params, loss):
    updates, state = tx.update(grads, state, params, **extra(loss))
    return optax.apply_updates(params, updates), state

  sharded_step = jax.jit(jax.shard_map(inside, mesh=mesh,
                                       in_specs=(specs, state_specs, specs, P()),
                                       out_specs=(specs, state_specs)))
  sharded = (_put(mesh, params, specs), _put(mesh, state, state_specs))
  unsharded = (params, state)
  for grads, loss in zip(grads_list, losses, strict=True):
    sharded = sharded_step(_put(mesh, grads, specs), sharded[1], sharded[0], jnp.float32(loss))
    unsharded = jax.jit(whole)(grads, unsharded[1], unsharded[0], jnp.float32(loss))
  return sharded, unsharded


def _assert_same(sharded, whole):
  assert_trees_close(jax.device_get(sharded[0]), jax.device_get(whole[0]), rtol=1e-6)
  assert int(osf.skipped_steps(sharded[1])) == int(osf.skipped_steps(whole[1]))
  assert osf.nonfinite_report(sharded[1]) == osf.nonfinite_report(whole[1])


@pytest.mark.parametrize("make", [
    lambda: osf.skip_nonfinite(optax.sgd(1e-2, momentum=0.9)),
    lambda: osf.accumulate_gradients(optax.sgd(1e-2, momentum=0.9), 2),
    # safefactor with nothing that reduces over a whole leaf: elementwise, as sgd is.
    lambda: osf.safefactor(1e-2, factored=False, clipping_threshold=None,
                           multiply_by_parameter_scale=False),
], ids=["skip_nonfinite(sgd)", "accumulate_gradients(sgd)", "safefactor, elementwise"])
def test_a_nan_in_one_shard_skips_the_step_on_every_device(make):
  # The NaN lands in rows 0-63: the first of the four shards of w. Deciding per device,
  # that device alone skipped, the others applied the step, and the replicated counters
  # differed between devices (shard_map refused them as out_specs P()).
  grads = [_grads(0), _grads(1, nan_at=(3, 5)), _grads(2), _grads(3)]
  sharded, whole = _steps(make(), SPLIT, grads)
  _assert_same(sharded, whole)
  assert int(osf.skipped_steps(whole[1])) == 1


def test_spikes_are_judged_on_the_whole_trees_gradient_norm_and_the_averaged_loss():
  # One shard's rows spike; on the other devices nothing does. A norm per shard differed
  # between devices, and so did the spike verdict.
  spiky = _grads(9)
  spiky["w"] = spiky["w"].at[:64].multiply(1e3)
  grads = [_grads(i) for i in range(6)] + [spiky, _grads(7)]
  losses = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.02]
  tx = osf.skip_nonfinite(optax.sgd(1e-2, momentum=0.9), skip_spikes=4.0, spike_window=4)
  sharded, whole = _steps(tx, SPLIT, grads, losses=losses)
  _assert_same(sharded, whole)
  assert int(osf.skipped_spikes(whole[1])) == int(osf.skipped_spikes(sharded[1])) == 1


@pytest.mark.parametrize("make", [
    lambda: osf.safefactor(1e-2),
    lambda: osf.safefactor(1e-2, momentum=0.9, skip_spikes=6.0),
    lambda: osf.presets.t5x(1e-2),
])
def test_replicated_params_with_averaged_gradients_step_as_under_jit(make):
  # Data parallelism inside shard_map: the whole arrays on every device.
  grads = [_grads(0), _grads(1, nan_at=(0, 0)), _grads(2)]
  sharded, whole = _steps(make(), REPLICATED, grads, average=True)
  _assert_same(sharded, whole)


@pytest.mark.parametrize("make, reductions", [
    (lambda: osf.safefactor(1e-2),
     "its row and column statistics, its update's RMS clipping and its parameter scale"),
    (lambda: osf.safefactor(1e-2, factored=False, multiply_by_parameter_scale=False),
     "its update's RMS clipping"),
    (lambda: osf.safefactor(1e-2, clipping_threshold=None, multiply_by_parameter_scale=False,
                            skip_spikes=6.0),
     "its row and column statistics and skip_spikes' gradient norm"),
    (lambda: osf.scale_by_safe_factored_rms(), "its row and column statistics"),
])
def test_a_split_leaf_whose_step_reduces_over_the_whole_leaf_is_refused(make, reductions):
  with pytest.raises(ValueError) as error:
    _steps(make(), SPLIT, [_grads(0)])
  message = str(error.value)
  # The whole list between the two fixed phrases: a lone reduction is not joined with "and".
  assert message.startswith("params['w'] is split over mesh axis 'model' inside jax.shard_map, "
                            f"and {reductions} reduce over the whole leaf")
  assert "under jax.jit with the params' shardings" in message


@pytest.mark.parametrize("make", [
    lambda: osf.safefactor(1e-2),
    lambda: osf.skip_nonfinite(optax.sgd(1e-2)),
    lambda: osf.with_param_rounding(optax.sgd(1e-2)),
    lambda: osf.accumulate_gradients(optax.sgd(1e-2), 2),
])
def test_gradients_not_averaged_over_the_devices_of_a_replicated_param_are_refused(make):
  with pytest.raises(ValueError, match=r"params\['b'\]: the gradient differs from device to "
                     r"device inside jax.shard_map \(it varies over mesh axis 'data'\) .* "
                     r"jax.lax.pmean\(grads, 'data'\)"):
    _steps(make(), REPLICATED, [_grads(0)], vary_grads=("data",))


def test_gradients_that_differ_over_two_mesh_axes_are_averaged_over_both():
  with pytest.raises(ValueError, match=r"it varies over mesh axes 'data', 'model'\) .* "
                     r"jax.lax.pmean\(grads, \('data', 'model'\)\)(\n|$)"):
    _steps(osf.skip_nonfinite(optax.sgd(1e-2)), REPLICATED, [_grads(0)],
           vary_grads=("data", "model"))


def test_a_loss_that_differs_between_devices_is_refused():
  tx = osf.skip_nonfinite(optax.sgd(1e-2), skip_spikes=6.0)
  mesh = _mesh()
  params = _params()
  state = tx.init(params)
  state_specs = osf.state_partition_specs(tx, params, REPLICATED)

  def step(grads, state, params):
    loss = jnp.float32(1.0) + jax.lax.axis_index("model").astype(jnp.float32)
    return tx.update(grads, state, params, value=loss)

  sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(REPLICATED, state_specs, REPLICATED),
                                  out_specs=(REPLICATED, state_specs)))
  with pytest.raises(ValueError, match=r"value= differs from device to device .* mesh axis "
                     r"'model'.* jax.lax.pmean\(loss, 'model'\)"):
    sharded(_grads(0), state, params)


def test_the_error_names_every_axis_a_leaf_is_split_over():
  specs = {"w": P(("data", "model"), None), "b": P()}
  with pytest.raises(ValueError, match=r"params\['w'\] is split over mesh axes 'data', 'model'"):
    _steps(osf.safefactor(1e-2), specs, [_grads(0)])


@pytest.mark.parametrize("make", [
    lambda: osf.with_param_rounding(optax.sgd(1e-3)),
    lambda: osf.safefactor(1e-3, factored=False, clipping_threshold=None,
                           multiply_by_parameter_scale=False, param_rounding="stochastic"),
])
def test_each_shard_of_a_stochastically_rounded_param_draws_its_own_bits(make):
  # Four shards of equal values and equal gradients: with the bits of the elements' indices
  # in the shard alone, the four rounded the same way, element for element.
  tx = make()
  mesh = _mesh()
  params = {"w": jnp.ones((256, 128), jnp.bfloat16), "b": jnp.zeros((128,), jnp.bfloat16)}
  grads = {"w": jnp.full((256, 128), 0.3, jnp.bfloat16), "b": jnp.zeros((128,), jnp.bfloat16)}
  state = tx.init(params)
  state_specs = osf.state_partition_specs(tx, params, SPLIT)

  def step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(SPLIT, state_specs, SPLIT),
                                  out_specs=(SPLIT, state_specs)))
  new, _ = sharded(_put(mesh, grads, SPLIT), _put(mesh, state, state_specs),
                   _put(mesh, params, SPLIT))
  shards = np.asarray(new["w"], np.float32).reshape(4, 64, 128)
  below, above = np.float32(1.0 - 2.0 ** -8), np.float32(1.0)  # bfloat16's neighbours
  assert set(np.unique(shards).tolist()) <= {below, above}
  for shard in shards[1:]:
    assert not np.array_equal(shard, shards[0])


def test_under_pmap_each_device_steps_the_whole_arrays_as_under_jit():
  # jax.pmap gives no value a type that differs between devices: nothing is refused, and
  # with averaged gradients every device takes the step jax.jit takes.
  tx = osf.safefactor(1e-2, momentum=0.9)
  params, state = _params(), tx.init(_params())

  def whole_step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def step(grads, state, params):
    return whole_step(jax.lax.pmean(grads, "devices"), state, params)

  def stacked(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)

  pmapped = jax.pmap(step, axis_name="devices", devices=jax.devices()[:4])
  per_device, whole = (stacked([params] * 4), stacked([state] * 4)), (params, state)
  for seed, nan_at in ((0, None), (4, (0, 0)), (8, None)):
    grads = [_grads(seed + i, nan_at=nan_at if i == 1 else None) for i in range(4)]
    per_device = pmapped(stacked(grads), per_device[1], per_device[0])
    mean = jax.tree.map(lambda x: jnp.mean(x, axis=0), stacked(grads))
    whole = jax.jit(whole_step)(mean, whole[1], whole[0])
  for device in range(4):
    on_device = jax.tree.map(lambda x, device=device: x[device], per_device)
    assert_trees_close(on_device[0], whole[0], rtol=1e-6)
    assert int(osf.skipped_steps(on_device[1])) == int(osf.skipped_steps(whole[1])) == 1


# Each leaf's placement: replicated, or split along one of its axes over one mesh axis or both.
_PLACEMENTS = {
    "w": [P(), P("model", None), P(None, "model"), P("data", None), P(("data", "model"), None),
          P("data", "model")],
    "b": [P(), P("model"), P("data"), P(("data", "model"))],
}
_ELEMENTWISE = {
    "skip_nonfinite(sgd)": lambda: osf.skip_nonfinite(optax.sgd(1e-2, momentum=0.9)),
    "skip_nonfinite(sgd), spikes": lambda: osf.skip_nonfinite(
        optax.sgd(1e-2), skip_spikes=3.0, spike_window=2),
    "accumulate_gradients(sgd)": lambda: osf.accumulate_gradients(optax.sgd(1e-2), 2),
    "safefactor, elementwise": lambda: osf.safefactor(
        1e-2, factored=False, clipping_threshold=None, multiply_by_parameter_scale=False,
        momentum=0.9),
}


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(sorted(_ELEMENTWISE)),
    w_spec=st.sampled_from(_PLACEMENTS["w"]),
    b_spec=st.sampled_from(_PLACEMENTS["b"]),
    poisoned=st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["w", "b"]),
                                st.integers(0, 127), st.sampled_from([np.nan, np.inf])),
                      max_size=2),
    spiky_step=st.sampled_from([None, 2, 3]),
)
def test_any_placement_steps_inside_shard_map_as_under_jit(name, w_spec, b_spec, poisoned,
                                                           spiky_step):
  # Whatever is split, over whichever axes, and wherever a step is poisoned or spikes:
  # the same params, the same skipped steps and the same per-leaf report as jax.jit's.
  grads = [_grads(step) for step in range(4)]
  for step, leaf, index, value in poisoned:
    grads[step][leaf] = grads[step][leaf].at[index].set(value)
  if spiky_step is not None:
    grads[spiky_step]["w"] = grads[spiky_step]["w"].at[:32].multiply(1e4)
  sharded, whole = _steps(_ELEMENTWISE[name](), {"w": w_spec, "b": b_spec}, grads)
  _assert_same(sharded, whole)
  if "spikes" in name:
    assert int(osf.skipped_spikes(sharded[1])) == int(osf.skipped_spikes(whole[1]))
