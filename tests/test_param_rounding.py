"""safefactor(param_rounding=...): low-precision params that train like float32 params.

The primitives (bits, stochastic rounding, landing, Kahan) are tested one by one in
``test_rounding.py``; this file tests them wired into the Adafactor step: the update
``safefactor`` returns, its state, its sharding, its checkpoints and its training.
Measured figures quoted below come from this file's own assertions' inputs (jax 0.10.2,
CPU); ``docs/benchmarks.md`` has them with the cost of each mode.
"""

from __future__ import annotations

import functools
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf
from optax_safefactor._src import bit_streams
from tests.helpers import (
  assert_trees_bitwise_equal,
  mean_of_last_losses,
  run_steps,
  seed_for,
  tanh_mlp_regression,
)

MODES = ("nearest", "stochastic", "kahan")
SHAPES = {"w": (128, 256), "b": (256,)}


def _tree(seed, dtype=jnp.bfloat16, scale=1.0, shapes=None):
  rng = np.random.default_rng(seed)
  return {name: jnp.asarray(rng.normal(size=shape) * scale, jnp.float32).astype(dtype)
          for name, shape in (shapes or SHAPES).items()}


def _random_grads(like, step, mean=0.02, scale=0.1):
  """Gradients for ``step`` shaped like ``like``: a small mean (so params drift) plus noise.

  The noise is uniform with unit variance, from the integer hash of ``bit_streams.py`` under a
  seed and stream of its own (independent of the rounding's bits): it compiles to a few
  integer operations, where ``jax.random`` adds about half to the compile time of a run.
  """
  leaves, treedef = jax.tree.flatten(like)
  noise = []
  for index, x in enumerate(leaves):
    bits = bit_streams.random_bits(0x7E57, step, index, x.shape, 99)
    uniform = (bits >> 8).astype(jnp.float32) * 2.0**-24 - 0.5
    noise.append((mean + scale * 12.0**0.5 * uniform).astype(x.dtype))
  return jax.tree.unflatten(treedef, noise)


# Called eagerly by the tests that loop in Python: one compilation per tree instead of
# dispatching the hash's integer operations one by one.
_grads_at = jax.jit(_random_grads, static_argnames=("mean", "scale"))


def _scan(tx, params, steps, grads_for=_random_grads):
  """``steps`` training steps (update and ``apply_updates``) in one jitted ``lax.scan``."""

  def step(carry, index):
    params, state = carry
    updates, state = tx.update(grads_for(params, index), state, params)
    return (optax.apply_updates(params, updates), state), None

  run = jax.jit(lambda p, s: jax.lax.scan(step, (p, s), jnp.arange(steps))[0])
  return run(params, tx.init(params))


def _loop(tx, params, grads_list, state=None):
  """One jitted update per step, ``apply_updates`` outside it; returns (params, state)."""
  return run_steps(tx, params, grads_list, state=state)[:2]


def _inner(state):
  """The Adafactor state, inside the guard's state when the guard is on."""
  return state.inner_state if isinstance(state, osf.SkipNonfiniteState) else state


def _f64(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _ulp(x, dtype=jnp.bfloat16) -> np.ndarray:
  """The spacing of ``dtype`` at ``|x|`` (normal range)."""
  x = np.maximum(np.abs(np.asarray(x, np.float64)), float(jnp.finfo(dtype).tiny))
  return 2.0 ** (np.floor(np.log2(x)) - jnp.finfo(dtype).nmant)


# --- the arguments ------------------------------------------------------------------------


def test_a_bad_mode_is_a_value_error_listing_the_three():
  # One check gives both entry points the same words (0.2 worded them two ways).
  for bad in ("round", "Stochastic", "", None):
    with pytest.raises(ValueError) as from_safefactor:
      osf.safefactor(1e-3, param_rounding=bad)
    with pytest.raises(ValueError) as from_wrapper:
      osf.with_param_rounding(optax.sgd(1e-3), mode=bad)
    for raised, name in ((from_safefactor, "param_rounding"), (from_wrapper, "mode")):
      assert str(raised.value) == (
          f"{name} must be one of 'nearest', 'stochastic' or 'kahan', got {bad!r}")


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_rounding_needs_params_and_a_learning_rate(mode):
  with pytest.raises(ValueError, match="needs a learning_rate"):
    osf.safefactor(param_rounding=mode)
  # Without parameter scale and weight decay only the rounding needs the params.
  settings = dict(multiply_by_parameter_scale=False)
  params = _tree(0)
  nearest = osf.safefactor(1e-3, **settings)
  jax.eval_shape(nearest.update, params, nearest.init(params))  # fine without params
  tx = osf.safefactor(1e-3, param_rounding=mode, **settings)
  with pytest.raises(ValueError, match="needs params"):
    tx.update(params, tx.init(params))


# --- wide params and the default -------------------------------------------------------------


def _lowered(dtype, steps=6, **settings):
  """The text of a jitted run of ``steps`` steps of ``safefactor(1e-2, **settings)``.

  Two runs whose lowered programs are the same text compute the same bits: comparing the
  programs proves bit-identity for every input, and costs a trace instead of a compile.
  """
  tx = osf.safefactor(1e-2, momentum=0.9, weight_decay_rate=1e-2, **settings)

  def step(carry, index):
    params, state = carry
    updates, state = tx.update(_random_grads(params, index), state, params)
    return (optax.apply_updates(params, updates), state), None

  params = _tree(0, dtype)
  run = jax.jit(lambda p, s: jax.lax.scan(step, (p, s), jnp.arange(steps))[0])
  return run.lower(params, tx.init(params)).as_text()


def test_nearest_is_the_default_bit_for_bit():
  # bfloat16 params and momentum: where a mode would change something.
  default = _lowered(jnp.bfloat16, dtype_momentum="bfloat16")
  # A seed changes nothing under round to nearest, and says so.
  with pytest.warns(UserWarning, match=r"rounding_seed=5 .* param_rounding='nearest' does "
                                       r"not draw: it has no effect"):
    seeded = _lowered(jnp.bfloat16, dtype_momentum="bfloat16", param_rounding="nearest",
                      rounding_seed=5)
  assert seeded == default


def _assert_wide_params_are_untouched(dtype):
  nearest = _lowered(dtype)
  assert "f64" in nearest if dtype == jnp.float64 else "f32" in nearest
  for mode in ("stochastic", "kahan"):
    seeded = _lowered(dtype, param_rounding=mode, rounding_seed=seed_for(mode, 3))
    assert seeded == nearest, mode
  # The programs run (the guard is on) and move the params.
  params = _tree(0, dtype)
  moved, state = _scan(osf.safefactor(1e-2, momentum=0.9, weight_decay_rate=1e-2,
                                      param_rounding="kahan"), params, 2)
  assert all(np.any(np.asarray(moved[k]) != np.asarray(params[k])) for k in SHAPES)
  # No buffer for a wide param: Kahan's compensation holds only None.
  assert jax.tree.leaves(state.inner_state.compensation) == []


def test_float32_params_are_the_same_in_every_mode():
  """With momentum and weight decay, every mode compiles the program of "nearest"."""
  _assert_wide_params_are_untouched(jnp.float32)


def test_float64_params_are_the_same_in_every_mode(x64):
  _assert_wide_params_are_untouched(jnp.float64)


def test_a_mixed_tree_keeps_a_buffer_for_its_narrow_params_only():
  params = {"wide": jnp.ones((4, 3), jnp.float32), "narrow": jnp.ones((4, 3), jnp.bfloat16)}
  tx = osf.safefactor(1e-2, param_rounding="kahan")
  compensation = jax.eval_shape(tx.init, params).inner_state.compensation
  assert compensation["wide"] is None
  assert (compensation["narrow"].shape, compensation["narrow"].dtype) == ((4, 3), jnp.bfloat16)
  # "nearest" casts the update to the gradient dtype, as optax does; the other modes give
  # updates in the param dtype (here the same).
  for mode in MODES:
    tx = osf.safefactor(1e-2, param_rounding=mode)
    updates, _ = jax.eval_shape(tx.update, params, tx.init(params), params)
    assert updates["wide"].dtype == jnp.float32 and updates["narrow"].dtype == jnp.bfloat16


# --- landing ---------------------------------------------------------------------------------

LANDING_SHAPES = {"w": (128, 256), "b": (256,), "half": (64, 32)}
LANDING_DTYPES = {"w": jnp.bfloat16, "b": jnp.bfloat16, "half": jnp.float16}


def _landing_params():
  return {name: jnp.asarray(np.random.default_rng(i).normal(size=shape), jnp.float32)
          .astype(LANDING_DTYPES[name]) for i, (name, shape) in enumerate(LANDING_SHAPES.items())}


def _stochastic_target(exact: np.ndarray, bits: np.ndarray, dtype) -> np.ndarray:
  """numpy reference of stochastic rounding: ``up`` with probability ``frac`` of the ulp."""
  if dtype == jnp.bfloat16:
    # The 16 bits bfloat16 drops plus the top 16 random bits carry into the kept bits
    # with probability (dropped bits) / 2**16.
    pattern = exact.view(np.uint32)
    magnitude = (pattern & np.uint32(0x7FFFFFFF)) + (bits >> np.uint32(16))
    rounded = ((magnitude | (pattern & np.uint32(0x80000000))) >> np.uint32(16)).astype(np.uint16)
    return rounded.view(ml_dtypes.bfloat16)
  magnitude = np.abs(exact.astype(np.float64))
  down = magnitude.astype(np.float16)
  down = np.where(down.astype(np.float64) > magnitude, np.nextafter(down, np.float16(0)), down)
  up = np.nextafter(down, np.float16(np.inf))
  frac = (magnitude - down) / (up.astype(np.float64) - down)
  uniform = (bits >> np.uint32(8)).astype(np.float64) * 2.0**-24
  rounded = np.where(uniform >= 1 - frac, up, down)
  return np.where(exact < 0, -rounded, rounded).astype(np.float16)


_param_bits = jax.jit(bit_streams.random_bits, static_argnums=(0, 2, 3, 4))
LANDING_SETTINGS = dict(momentum=0.9, weight_decay_rate=1e-3, min_dim_size_to_factor=32)


@functools.cache
def _exact_update():
  """The float32 update of ``"nearest"``, jitted once for both modes."""
  return jax.jit(osf.safefactor(1e-3, **LANDING_SETTINGS).update)


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_apply_updates_lands_on_the_target(mode):
  """``optax.apply_updates`` lands exactly where the kernel aimed, step after step.

  The exact float32 update is recomputed by ``"nearest"`` on float32 copies of the same
  params, gradients and state (so its update is the float32 value, not a cast of it);
  the target is computed from it in numpy. Measured over 4 steps (bfloat16 and float16
  params): 35,723 moves with stochastic rounding and 39,827 with Kahan, all exact where
  ``target - param`` is representable (Sterbenz); 5 and 3 land an ulp off, at targets
  near zero, as documented.
  """
  tx = osf.safefactor(1e-3, param_rounding=mode, rounding_seed=seed_for(mode, 3),
                      **LANDING_SETTINGS)
  update, exact_update = jax.jit(tx.update), _exact_update()
  params = _landing_params()
  state = tx.init(params)
  moved = off_target = 0
  for step in range(4):
    grads = _grads_at(params, step, mean=0.0)
    updates, new_state = update(grads, state, params)
    landed = optax.apply_updates(params, updates)

    def wide(tree):
      return jax.tree.map(lambda x: x.astype(jnp.float32), tree)

    inner = state.inner_state._replace(compensation=None)
    exact, _ = exact_update(wide(grads), state._replace(inner_state=inner), wide(params))
    for name, param in params.items():
      dtype = LANDING_DTYPES[name]
      p = np.asarray(param.astype(jnp.float32))
      u = np.asarray(exact[name])
      if mode == "stochastic":
        bits = np.asarray(_param_bits(3, step, bit_streams.path_hash(f"['{name}']"),
                                      param.shape, bit_streams.STREAM_PARAMS))
        total = p + u
        target = _stochastic_target(total, bits, dtype)
      else:
        total = p + (u + np.asarray(state.inner_state.compensation[name].astype(jnp.float32)))
        target = total.astype(dtype)
      got = np.asarray(landed[name])
      assert got.dtype == target.dtype
      target64, got64 = target.astype(np.float64), got.astype(np.float64)
      # Sterbenz: target - param is exact in the param dtype.
      representable = (target64 * p >= 0) & (np.abs(target64 - p) <= np.abs(p) / 2)
      np.testing.assert_array_equal(got[representable].view(np.uint16),
                                    target[representable].view(np.uint16), err_msg=name)
      larger = np.maximum(np.abs(p), np.abs(target64))
      assert np.all(np.abs(got64 - target64) <= _ulp(larger, dtype)), name
      moved += int(np.sum(got64 != p))
      off_target += int(np.sum(got64 != target64))
      if mode == "kahan":
        # The compensation is what the landing missed, wherever it landed.
        remainder = (total - got.astype(np.float32)).astype(dtype)
        np.testing.assert_array_equal(
            np.asarray(new_state.inner_state.compensation[name]).view(np.uint16),
            remainder.view(np.uint16), err_msg=name)
    params, state = landed, new_state
  assert moved > 10_000 and off_target <= 1e-3 * moved, (moved, off_target)


def test_kahan_param_and_compensation_track_the_float32_param_run():
  """After 300 steps, ``param + compensation`` in ulps of the float32-param run's value.

  Measured (elements above an eighth of the leaf's RMS; below it an ulp says little), for
  the matrix / the vector: mean 0.26 / 0.28 ulps, 99th percentile 0.73 / 0.72, largest
  1.36 / 0.74; the bfloat16 param alone: mean 0.35 / 0.37. For comparison, round to
  nearest: mean 60 ulps; stochastic rounding, a random walk: mean 5.4 ulps.
  """
  # The guard is tested elsewhere; without it each run compiles a third faster.
  settings = dict(momentum=0.9, weight_decay_rate=1e-3, skip_nonfinite_steps=False)
  steps = 300
  reference, _ = _scan(osf.safefactor(1e-3, **settings), _tree(0, jnp.float32), steps)
  params, state = _scan(osf.safefactor(1e-3, param_rounding="kahan", **settings), _tree(0),
                        steps)
  for name in SHAPES:
    want = np.asarray(reference[name], np.float64)
    kept = np.abs(want) > np.sqrt(np.mean(want**2)) / 8
    ulps = np.abs(_f64(params[name]) + _f64(_inner(state).compensation[name]) - want)
    ulps = (ulps / _ulp(want))[kept]
    assert np.mean(ulps) < 0.5 and np.quantile(ulps, 0.99) < 1.25, (
        name, np.mean(ulps), np.quantile(ulps, 0.99))


# --- many small updates on one value -----------------------------------------------------


def _constant_grads(params, step):
  del step
  return jax.tree.map(jnp.ones_like, params)


def test_many_small_updates_on_one_value():
  """2,000 updates of -1e-4 each, below half an ulp of two bfloat16 starting values.

  Without parameter scale the update depends on the gradients only: -learning_rate *
  g / sqrt(g**2 + eps), the same float32 value for float32 and bfloat16 params. 4,096
  copies of each value draw independent bits.
  """
  steps, copies, learning_rate = 2000, 4096, 1e-4
  starts = {"a": 1.0, "b": -2.5}
  exact = {name: start - steps * float(np.float32(learning_rate))
           for name, start in starts.items()}

  def run(mode, dtype):
    params = {name: jnp.full((copies,), start, dtype) for name, start in starts.items()}
    tx = osf.safefactor(learning_rate, multiply_by_parameter_scale=False, param_rounding=mode,
                        skip_nonfinite_steps=False)
    return _scan(tx, params, steps, _constant_grads)

  runs = {mode: run(mode, jnp.bfloat16) for mode in MODES}
  wide, _ = run("nearest", jnp.float32)
  for name, start in starts.items():
    ulp = float(_ulp(exact[name]))  # the same ulp all the way from the start
    # float32 params: exact but for float32's own rounding (0.013 ulps for -2.5).
    assert abs(float(wide[name][0]) - exact[name]) < 0.05 * ulp
    assert np.all(_f64(runs["nearest"][0][name]) == start)  # round to nearest: stalled
    samples = _f64(runs["stochastic"][0][name])
    standard_error = samples.std() / np.sqrt(copies)
    assert abs(samples.mean() - exact[name]) < 4 * standard_error, (samples.mean(), exact)
    # Each copy is a random walk: variance sum(frac * (1 - frac)) * ulp**2, frac = lr / ulp.
    # Measured 0.99x and 0.98x of this (7.1 and 3.5 ulps) and means 0.27 and 0.04 ulps
    # off; bits shared between copies or steps would change the spread.
    expected_std = np.sqrt(steps * learning_rate * ulp)
    assert 0.8 < samples.std() / expected_std < 1.25, (samples.std(), expected_std)
    kahan, state = runs["kahan"]
    value = _f64(kahan[name])
    compensated = value + _f64(_inner(state).compensation[name])
    # The bfloat16 buffer rounds too, the same way on every step of a constant update, so
    # about an ulp is lost over thousands of steps (see kahan_write_back). Measured: the
    # value 0.2 and 0.8 ulps off, value + compensation 0.32 and 0.37; nearest is 51 and
    # 13 ulps off.
    assert np.all(np.abs(value - exact[name]) <= 1.5 * ulp), (value[0], exact)
    assert np.all(np.abs(compensated - exact[name]) <= ulp), (compensated[0], exact)


# --- determinism, seeds, skipped steps -------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 5, -5, 2**31 - 1, -(2**31)])
def test_a_seed_array_keys_the_bits_of_the_same_int(seed):
  # optax.inject_hyperparams hands rounding_seed to the step as an int32 array.
  args = (3, bit_streams.path_hash("['w']"), bit_streams.STREAM_PARAMS)
  want = bit_streams.stream_key(seed, *args)
  assert int(bit_streams.stream_key(jnp.asarray(seed, jnp.int32), *args)) == int(want)
  assert int(jax.jit(bit_streams.stream_key, static_argnums=(2, 3))(
      jnp.asarray(seed, jnp.int32), *args)) == int(want)


@pytest.mark.parametrize("seed", [2**40 + 7, -(2**40) - 7, -1])
def test_a_64_bit_seed_array_keys_the_bits_of_the_same_int(x64, seed):
  args = (3, bit_streams.path_hash("['w']"), bit_streams.STREAM_PARAMS)
  assert int(bit_streams.stream_key(jnp.asarray(seed, jnp.int64), *args)) == int(
      bit_streams.stream_key(seed, *args))
  # Seeds that differ only above the low word draw different bits.
  assert int(bit_streams.stream_key(jnp.asarray(seed, jnp.int64), *args)) != int(
      bit_streams.stream_key(seed & (2**32 - 1), *args))


def test_an_injected_seed_draws_the_bits_of_the_static_seed():
  """``inject_hyperparams(safefactor)(rounding_seed=-5)`` steps as ``rounding_seed=-5`` does.

  Before the fix a seed array kept only its low word: negative seeds drew other bits than
  the same Python int, and 64-bit seeds that differ only above the low word the same bits.
  """
  params = _tree(0)
  settings = dict(learning_rate=1e-3, momentum=0.9, param_rounding="stochastic",
                  rounding_seed=-5, skip_nonfinite_steps=False)
  static = osf.safefactor(**settings)
  # Float hyperparameters stay float32 (not the params' bfloat16) and the factoring
  # decision stays static, so that only the seed's form differs between the two.
  injected = optax.inject_hyperparams(
      osf.safefactor, static_args=("min_dim_size_to_factor",), hyperparam_dtype=jnp.float32,
  )(**settings)
  assert injected.init(params).hyperparams["rounding_seed"].dtype == jnp.int32
  grads = [_grads_at(params, 0)]
  assert_trees_bitwise_equal(_loop(injected, params, grads)[0], _loop(static, params, grads)[0])


# --- sharding ---------------------------------------------------------------------------------

# Each device holds whole slices of the batch axes, so every reduction of the step
# (statistics, clipping, parameter scale) is local and its float32 arithmetic the same as
# on one device: then the runs can agree bit for bit, and any difference comes from the
# rounding. Slices across reduced axes sum in another order (test_placement.py compares
# those with a tolerance). The bits themselves are checked on 2-D shards in test_rounding.py.
MESH_SHAPES = {"stack": (2, 4, 64, 128), "rows": (8, 256)}
MESH_SPECS = {"stack": P("data", "model", None, None), "rows": P(("data", "model"), None)}


def _batch_rules(path, shape):
  del path
  return ("batch",) * (len(shape) - 2) + (None, None) if len(shape) > 2 else ("batch", None)


def _mesh_params(seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return {name: jnp.asarray(rng.normal(size=shape) * scale, jnp.bfloat16)
          for name, shape in MESH_SHAPES.items()}


def _mesh_tx(mode, seed=11):
  return osf.safefactor(1e-3, momentum=0.9, weight_decay_rate=1e-3, dtype_momentum="bfloat16",
                        state_dtype="bfloat16", min_dim_size_to_factor=32,
                        factor_rules=_batch_rules, param_rounding=mode,
                        rounding_seed=seed_for(mode, seed))


def _mesh_grads():
  return [_mesh_params(step + 1, scale=0.1) for step in range(3)]


@functools.cache
def _single_device_run(mode, seed=11):
  return _loop(_mesh_tx(mode, seed), _mesh_params(0), _mesh_grads())


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
  """Params, bfloat16 momentum and bfloat16 statistics all draw from the seed."""
  first = _single_device_run("stochastic")
  again = _loop(_mesh_tx("stochastic"), _mesh_params(0), _mesh_grads())  # traced anew
  other = _single_device_run("stochastic", seed=12)
  assert_trees_bitwise_equal(again, first)
  start = _mesh_params(0)
  for name in ("stack", "rows"):
    moved = np.mean(np.asarray(first[0][name]) != np.asarray(start[name]))
    differs = np.mean(np.asarray(first[0][name]) != np.asarray(other[0][name]))
    assert moved > 0.1 and differs > 0.1, (name, moved, differs)
  for array in ("momentum", "second_moment"):
    ours = jax.tree.leaves(getattr(first[1].inner_state, array)["stack"])
    theirs = jax.tree.leaves(getattr(other[1].inner_state, array)["stack"])
    for a, b in zip(ours, theirs, strict=True):
      assert np.mean(np.asarray(a) != np.asarray(b)) > 0.1, array


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_a_mesh_run_equals_the_single_device_run_bit_for_bit(mode, axis_type):
  tx = _mesh_tx(mode)
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type, axis_type))

  def place(tree):
    return {k: jax.device_put(v, NamedSharding(mesh, MESH_SPECS[k])) for k, v in tree.items()}

  def assert_placed(tree, names):
    for name in names:
      assert tree[name].sharding.is_equivalent_to(NamedSharding(mesh, MESH_SPECS[name]),
                                                  len(MESH_SHAPES[name])), name

  with jax.set_mesh(mesh):
    params = place(_mesh_params(0))
    state = tx.init(params)
    if mode == "kahan":
      assert_placed(state.inner_state.compensation, MESH_SHAPES)
    sharded = _loop(tx, params, [place(g) for g in _mesh_grads()], state)
    assert_placed(sharded[0], MESH_SHAPES)
    if mode == "kahan":
      assert_placed(sharded[1].inner_state.compensation, MESH_SHAPES)
  assert_trees_bitwise_equal(jax.tree.map(np.asarray, sharded), _single_device_run(mode))


def test_an_explicit_mesh_run_needs_no_current_mesh():
  # Params placed on an Explicit mesh carry it in their types, and the step compiled
  # without jax.set_mesh ran for "nearest" and "kahan"; "stochastic" stopped at placing its
  # bits by a bare PartitionSpec: "Using PartitionSpec when you are not under a mesh context".
  tx = _mesh_tx("stochastic")
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)

  def place(tree):
    return {k: jax.device_put(v, NamedSharding(mesh, MESH_SPECS[k])) for k, v in tree.items()}

  params = place(_mesh_params(0))
  sharded = _loop(tx, params, [place(g) for g in _mesh_grads()], tx.init(params))
  assert sharded[0]["stack"].sharding.spec == MESH_SPECS["stack"]
  assert_trees_bitwise_equal(jax.tree.map(np.asarray, sharded), _single_device_run("stochastic"))


# --- checkpoints --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_resuming_from_an_orbax_checkpoint_is_bit_identical(mode, tmp_path):
  tx = osf.safefactor(1e-3, momentum=0.9, dtype_momentum="bfloat16", state_dtype="bfloat16",
                      param_rounding=mode, rounding_seed=seed_for(mode, 2))
  params = _tree(0)
  grads = [_grads_at(params, step) for step in range(6)]
  grads[4] = jax.tree.map(lambda g: g.at[0].set(jnp.inf), grads[4])  # skipped after the resume
  params, state = _loop(tx, params, grads[:3])
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "step3", {"params": params, "opt_state": state})
  checkpointer.wait_until_finished()
  uninterrupted = _loop(tx, params, grads[3:], state)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          {"params": params, "opt_state": state})
  restored = checkpointer.restore(tmp_path / "step3", abstract)
  resumed = _loop(tx, restored["params"], grads[3:], restored["opt_state"])
  assert_trees_bitwise_equal(resumed, uninterrupted)
  assert int(osf.skipped_steps(resumed[1])) == 1


# --- flax ---------------------------------------------------------------------------------------
#
# A train step applies the update in the same jit that computes it, where XLA may keep
# float32 precision across a float32 -> bfloat16 -> float32 pair of conversions (it does
# on CPU and GPU). The landing must not depend on that rounding: the fused step lands where
# ``optax.apply_updates`` of the same updates lands on its own.


def _away_from_zero(key, shape, dtype):
  """Magnitudes in [1, 2): updates of 1e-3 of the params stay below half an ulp, so round
  to nearest moves none of them (measured: 0 of 1,024 in each of the steps here)."""
  signs, magnitudes = jax.random.split(key)
  return (jax.random.rademacher(signs, shape, jnp.float32)
          * jax.random.uniform(magnitudes, shape, jnp.float32, 1.0, 2.0)).astype(dtype)


class _NnxMLP(nnx.Module):
  def __init__(self, rngs):
    dense = dict(param_dtype=jnp.bfloat16, dtype=jnp.float32, kernel_init=_away_from_zero,
                 rngs=rngs)
    self.up = nnx.Linear(32, 128, **dense)
    self.down = nnx.Linear(128, 8, **dense)

  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x)))


def _regression_batch():
  return (jax.random.normal(jax.random.key(1), (16, 32)),
          jax.random.normal(jax.random.key(2), (16, 8)))


def _tx_for_flax():
  return osf.safefactor(1e-3, momentum=0.9, param_rounding="stochastic", rounding_seed=1,
                        min_dim_size_to_factor=32)


def _assert_moved(before, after, updates):
  """bfloat16 params and updates, and a kernel that moved by updates below half an ulp.

  Measured: 1.8%, 4.2% and 5.8% of the kernel's elements in the three steps (stochastic
  rounding), none with round to nearest.
  """
  for new, update in zip(jax.tree.leaves(after), jax.tree.leaves(updates), strict=True):
    assert new.dtype == update.dtype == jnp.bfloat16
  kernel_before, kernel_after = jax.tree.leaves(before)[1], jax.tree.leaves(after)[1]
  assert np.mean(np.asarray(kernel_before) != np.asarray(kernel_after)) > 0.005


@pytest.mark.skipif(not hasattr(nnx, "as_pure"),
                    reason="reads the updates back with nnx.as_pure, which flax 0.12.4 lacks")
def test_nnx_optimizer_lands_where_apply_updates_lands():
  inputs, targets = _regression_batch()

  def loss_fn(model):
    return jnp.mean((model(inputs) - targets) ** 2)

  @nnx.jit
  def train_step(model, optimizer):
    return optimizer.update(model, nnx.grad(loss_fn)(model))

  model = _NnxMLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, _tx_for_flax(), wrt=nnx.Param)
  for _ in range(3):
    before = nnx.as_pure(nnx.state(model, nnx.Param))
    updates = train_step(model, optimizer)
    after = nnx.as_pure(nnx.state(model, nnx.Param))
    assert_trees_bitwise_equal(after, optax.apply_updates(before, nnx.as_pure(updates)))
    _assert_moved(before, after, nnx.as_pure(updates))
  assert int(nnx.as_pure(optimizer.opt_state).inner_state.count) == 3


class _LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = dict(param_dtype=jnp.bfloat16, dtype=jnp.float32, kernel_init=_away_from_zero)
    return nn.Dense(8, **dense)(jax.nn.relu(nn.Dense(128, **dense)(x)))


def test_linen_train_state_lands_where_apply_updates_lands():
  inputs, targets = _regression_batch()
  model = _LinenMLP()

  def loss_fn(params):
    return jnp.mean((model.apply({"params": params}, inputs) - targets) ** 2)

  @jax.jit
  def train_step(train):
    grads = jax.grad(loss_fn)(train.params)
    updates, _ = train.tx.update(grads, train.opt_state, train.params)
    return train.apply_gradients(grads=grads), updates

  train = train_state.TrainState.create(
      apply_fn=model.apply, params=model.init(jax.random.key(0), inputs)["params"],
      tx=_tx_for_flax())
  for _ in range(3):
    before = train.params
    train, updates = train_step(train)
    assert_trees_bitwise_equal(train.params, optax.apply_updates(before, updates))
    _assert_moved(before, train.params, updates)
  assert int(train.opt_state.inner_state.count) == 3


# --- low-precision state ------------------------------------------------------------------------

STATE_SHAPES = {"w": (64, 128), "b": (128,)}


@functools.cache
def _state_run(steps=2000, **settings):
  """The state after ``steps`` steps on float32 params with gradients that do not depend
  on the params: a mean of 1 plus 30% noise, the scale tripled halfway (a 9x jump of the
  second moment). Without parameter scale the update depends on the gradients and the
  stored state alone, so runs differ only in how their state is stored."""

  def grads_for(params, step):
    scale = jnp.where(step < steps // 2, 1.0, 3.0)
    return jax.tree.map(lambda g: scale * (1.0 + 0.3 * (g - 1.0)),
                        _random_grads(params, step, mean=1.0, scale=1.0))

  params = {name: jnp.ones(shape, jnp.float32) for name, shape in STATE_SHAPES.items()}
  tx = osf.safefactor(1e-3, multiply_by_parameter_scale=False, min_dim_size_to_factor=64,
                      skip_nonfinite_steps=False, **settings)
  return _scan(tx, params, steps, grads_for)[1]


def _relative_error(actual, expected) -> float:
  """``|actual - expected| / |expected|`` in the 2-norm, over the whole tree."""
  pairs = list(zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True))
  difference = sum(np.sum((_f64(a) - _f64(e)) ** 2) for a, e in pairs)
  return float(np.sqrt(difference / sum(np.sum(_f64(e) ** 2) for _, e in pairs)))


def test_bfloat16_momentum_tracks_the_float32_momentum_with_stochastic_rounding():
  """Relative error of the momentum after 2,000 steps against float32 momentum.

  Measured with beta1 = 0.999 (an increment of 1e-3 of the update is below half a
  bfloat16 ulp): round to nearest 0.41 (the momentum stalls near 60% of its value),
  stochastic 0.026. With beta1 = 0.9: 0.0039 and 0.0055; 0.99: 0.011 and 0.015 (both
  track; the stochastic error is the larger there, being noise without bias).
  """
  settings = dict(momentum=0.999)
  reference = _state_run(**settings).momentum
  nearest = _state_run(dtype_momentum="bfloat16", **settings).momentum
  stochastic = _state_run(dtype_momentum="bfloat16", param_rounding="stochastic",
                          **settings).momentum
  assert jax.tree.leaves(stochastic)[0].dtype == jnp.bfloat16
  nearest_error = _relative_error(nearest, reference)
  stochastic_error = _relative_error(stochastic, reference)
  assert nearest_error > 0.25, nearest_error
  assert stochastic_error < 0.06, stochastic_error


def test_bfloat16_statistics_track_the_float32_statistics_with_stochastic_rounding():
  """Relative error of the second moment after 2,000 steps against float32 statistics.

  Measured: round to nearest 0.34 for the factored rows and columns (smooth means:
  after the jump their increments fall below half an ulp), 0.069 for the unfactored
  vector (noisy per element, so it stalls less); stochastic 0.017 and 0.036.
  """
  # The statistics do not depend on the momentum: the momentum test's reference serves.
  settings = dict(momentum=0.999)
  reference = _state_run(**settings).second_moment
  nearest = _state_run(state_dtype="bfloat16", **settings).second_moment
  stochastic = _state_run(state_dtype="bfloat16", param_rounding="stochastic",
                          **settings).second_moment
  assert stochastic["w"].v_row.dtype == jnp.bfloat16
  errors = {}
  for name, run in (("nearest", nearest), ("stochastic", stochastic)):
    errors[name] = {"factored": _relative_error(run["w"], reference["w"]),
                    "full": _relative_error(run["b"], reference["b"])}
  assert errors["nearest"]["factored"] > 0.25, errors
  assert errors["stochastic"]["factored"] < 0.04, errors
  assert errors["stochastic"]["full"] < 0.07, errors


# --- training ----------------------------------------------------------------------------------


def _mlp_loss(dtype, mode, steps=300):
  """Mean loss of the last 20 of ``steps`` steps: a tanh MLP fitting a smaller teacher."""
  params, loss = tanh_mlp_regression(dtype, seed=10)
  tx = osf.safefactor(1e-3, momentum=0.9, param_rounding=mode, min_dim_size_to_factor=8,
                      skip_nonfinite_steps=False)
  return mean_of_last_losses(tx, params, loss, steps)


def test_bfloat16_mlp_trains_like_float32_params():
  """Measured: float32 params 0.0531; bfloat16 nearest 0.177 (3.3x: updates of 1e-3 of
  the params vanish), stochastic 0.0527 (-0.8%), kahan 0.0532 (+0.1%)."""
  reference = _mlp_loss(jnp.float32, "nearest")
  losses = {mode: _mlp_loss(jnp.bfloat16, mode) for mode in MODES}
  assert losses["nearest"] > 2 * reference, (reference, losses)
  for mode in ("stochastic", "kahan"):
    assert abs(losses[mode] / reference - 1) < 0.03, (mode, reference, losses)


F32 = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
MIXED = {"w": jnp.ones((4, 3), jnp.bfloat16), "b": jnp.zeros(3)}


@pytest.mark.parametrize("build,params,warns", [
    (lambda: osf.safefactor(1e-3, param_rounding="kahan"), F32, True),
    (lambda: osf.safefactor(1e-3, param_rounding="stochastic"), F32, True),
    # Kahan compensates params alone; stochastic rounding writes narrow state that way too.
    (lambda: osf.safefactor(1e-3, param_rounding="kahan", momentum=0.9,
                            dtype_momentum="bfloat16"), F32, True),
    (lambda: osf.safefactor(1e-3, param_rounding="stochastic", momentum=0.9,
                            dtype_momentum="bfloat16"), F32, False),
    (lambda: osf.safefactor(1e-3, param_rounding="stochastic", state_dtype="bfloat16"),
     F32, False),
    (lambda: osf.safefactor(1e-3, param_rounding="kahan"), MIXED, False),
    (lambda: osf.safefactor(1e-3, param_rounding="stochastic"), MIXED, False),
    (lambda: osf.safefactor(1e-3), F32, False),
    (lambda: osf.safefactor(1e-3, param_rounding="kahan"), {}, False),
    (lambda: osf.with_param_rounding(optax.sgd(1e-3), "stochastic"), F32, True),
    (lambda: osf.with_param_rounding(optax.sgd(1e-3), "kahan"),
     {**F32, "steps": jnp.zeros((), jnp.int32)}, True),
    (lambda: osf.with_param_rounding(optax.sgd(1e-3), "kahan"), MIXED, False),
    # with_param_rounding's mode rounds params only: a narrow inner state is the inner's.
    (lambda: osf.with_param_rounding(
        osf.safefactor(1e-3, momentum=0.9, dtype_momentum="bfloat16"), "stochastic"),
     F32, True),
])
def test_a_rounding_mode_with_nothing_narrow_to_round_warns_at_init(build, params, warns):
  # On float32 params every mode writes as round to nearest does, and the mode a user
  # chose was dropped without a word.
  tx = build()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tx.init(params)
  messages = [str(w.message) for w in caught
              if re.search(r"rounds what is stored narrower than it is computed", str(w.message))]
  assert len(messages) == int(warns), messages
  if warns:
    assert re.match(r"(param_rounding|mode)='(kahan|stochastic)' rounds .* and nothing here "
                    r"is: it has no effect", messages[0])
    assert caught[0].filename == __file__
