"""safefactor against optax.adafactor and the float64 reference, and as an optax citizen."""

import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from tests.helpers import (
  assert_trees_close,
  is_all_zero,
  max_relative_error,
  random_tree,
  run_steps,
  tree_all_finite,
)
from tests.reference import ReferenceAdafactor, reference_plan

SHAPES = {
    "tall": (300, 140),
    "wide": (140, 300),
    "stacked": (3, 130, 150),
    "bias": (150,),
    "small": (5, 7),
    "scalar": (),
}

COMBINATIONS = [
    dict(zip(("momentum", "multiply_by_parameter_scale", "clipping_threshold",
              "weight_decay_rate"), values, strict=True))
    for values in itertools.product((None, 0.9), (True, False), (1.0, None), (None, 1e-2))
]


def _id(config):
  return "-".join(f"{k[:4]}={v}" for k, v in config.items())


def test_signature_is_a_drop_in_for_optax():
  ours = inspect.signature(osf.safefactor).parameters
  theirs = inspect.signature(optax.adafactor).parameters
  assert list(ours)[: len(theirs)] == list(theirs)
  for name, parameter in theirs.items():
    if name == "dtype_momentum":
      assert ours[name].default == "float32"
    else:
      assert ours[name].default == parameter.default, name
  extras = list(ours)[len(theirs):]
  assert all(ours[name].kind is inspect.Parameter.KEYWORD_ONLY for name in extras)
  for parameter in ours.values():
    assert not callable(parameter.default) and not isinstance(parameter.default, np.dtype)


@pytest.mark.parametrize("config", COMBINATIONS, ids=_id)
def test_matches_optax_adafactor_on_healthy_float32(config, rng):
  params = random_tree(rng, SHAPES)
  grads = [random_tree(rng, SHAPES, scale=10.0 ** (step % 3 - 1)) for step in range(12)]
  with jax.numpy_dtype_promotion("standard"):
    _, _, expected = run_steps(optax.adafactor(0.05, **config), params, grads.__getitem__, 12)
  _, _, actual = run_steps(osf.safefactor(0.05, **config), params, grads.__getitem__, 12)
  for step in range(12):
    # Relative to the step's largest update: with momentum and weight decay a
    # scalar leaf's terms can cancel, and a plain relative error would measure the
    # cancellation, not the optimizer.
    step_scale = max(float(jnp.max(jnp.abs(u))) for u in expected[step].values())
    for name in SHAPES:
      error = max_relative_error(actual[step][name], expected[step][name], step_scale)
      assert error < 1e-5, (step, name, error)


@pytest.mark.parametrize("config", COMBINATIONS[::3], ids=_id)
def test_matches_float64_reference_step_by_step(config, rng):
  params = random_tree(rng, SHAPES)
  reference = ReferenceAdafactor(learning_rate=0.05, **config).init_all(params)
  tx = osf.safefactor(0.05, **config)
  state = tx.init(params)
  update = jax.jit(tx.update)
  reference_params = {k: np.asarray(v, np.float64) for k, v in params.items()}
  for step in range(30):
    grads = random_tree(rng, SHAPES, scale=10.0 ** (step % 5 - 2))
    updates, state = update(grads, state, params)
    expected = reference.step(grads, params)
    for name in SHAPES:
      assert max_relative_error(updates[name], expected[name]) < 2e-5, (step, name)
    params = optax.apply_updates(params, updates)
    reference_params = {k: reference_params[k] + expected[k] for k in SHAPES}
  assert tree_all_finite(state)
  # The applied params are the reference's float64 sum of the same updates: no update
  # was dropped, scaled or applied twice on the way (30 float32 roundings of ~1e-7).
  assert_trees_close(params, reference_params, rtol=1e-5)


def test_learning_rate_schedule_and_count(rng):
  params = random_tree(rng, {"w": (4, 3)})
  schedule = optax.linear_schedule(1.0, 0.0, 4)
  tx = osf.safefactor(schedule, multiply_by_parameter_scale=False, clipping_threshold=None)
  grads = {"w": jnp.ones((4, 3))}
  _, state, history = run_steps(tx, params, lambda _: grads, 5)
  # With unit gradients the scaled gradient is exactly 1, so each update is -lr.
  np.testing.assert_allclose([float(u["w"][0, 0]) for u in history], [-1, -0.75, -0.5, -0.25, 0],
                             atol=1e-6)
  assert int(optax.tree_utils.tree_get(state.inner_state, "count")) == 5


def test_jit_equals_eager(rng):
  params = random_tree(rng, SHAPES)
  grads = [random_tree(rng, SHAPES) for _ in range(3)]
  tx = osf.safefactor(0.1, momentum=0.9, weight_decay_rate=1e-3)
  _, eager_state, eager = run_steps(tx, params, grads.__getitem__, 3, jit=False)
  _, jit_state, jitted = run_steps(tx, params, grads.__getitem__, 3, jit=True)
  assert_trees_close((eager, eager_state), (jitted, jit_state), rtol=2e-6)


def test_no_recompilation_after_first_step(rng):
  params = random_tree(rng, SHAPES, dtype=jnp.bfloat16)
  tx = osf.safefactor(0.1, momentum=0.9)
  state = tx.init(params)
  traces = []

  @jax.jit
  def step(params, state, grads):
    traces.append(1)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(3):
    params, state = step(params, state, random_tree(rng, SHAPES, dtype=jnp.bfloat16))
  assert len(traces) == 1


def test_inject_hyperparams_under_jit(rng):
  params = random_tree(rng, SHAPES)
  grads = [random_tree(rng, SHAPES) for _ in range(6)]
  injected = optax.inject_hyperparams(osf.safefactor)(
      learning_rate=0.1, momentum=0.9, weight_decay_rate=1e-3, clipping_threshold=1.0
  )
  plain = osf.safefactor(learning_rate=0.1, momentum=0.9, weight_decay_rate=1e-3)
  _, state, injected_updates = run_steps(injected, params, grads.__getitem__, 6)
  _, _, plain_updates = run_steps(plain, params, grads.__getitem__, 6)
  assert_trees_close(injected_updates, plain_updates, rtol=1e-6)
  assert int(osf.skipped_steps(state)) == 0

  # Changing an injected value changes the result without retracing.
  traces = []

  @jax.jit
  def update(grads, state, params):
    traces.append(1)
    return injected.update(grads, state, params)

  state.hyperparams["learning_rate"] = jnp.asarray(0.0, jnp.float32)
  state.hyperparams["momentum"] = jnp.asarray(0.0, jnp.float32)
  state.hyperparams["weight_decay_rate"] = jnp.asarray(0.0, jnp.float32)
  zero, state = update(grads[0], state, params)
  state.hyperparams["learning_rate"] = jnp.asarray(0.2, jnp.float32)
  nonzero, state = update(grads[1], state, params)
  assert all(is_all_zero(u) for u in jax.tree.leaves(zero))
  assert all(float(jnp.max(jnp.abs(u))) > 0.0 for u in jax.tree.leaves(nonzero))
  assert len(traces) == 1


def test_inject_hyperparams_with_float16_params(rng):
  # inject_hyperparams casts numeric hyperparameters to the params' dtype: eps=1e-30
  # becomes 0 in float16, and the floor must still hold.
  params = random_tree(rng, {"w": (130, 140), "b": (7,)}, dtype=jnp.float16)
  tx = optax.inject_hyperparams(osf.safefactor)(learning_rate=0.01)
  zeros = jax.tree.map(jnp.zeros_like, params)
  _, state, history = run_steps(tx, params, lambda _: zeros, 3)
  assert tree_all_finite((state, history))
  assert int(osf.skipped_steps(state)) == 0


def test_multi_steps(rng):
  params = random_tree(rng, SHAPES)
  grads = [random_tree(rng, SHAPES) for _ in range(6)]
  tx = optax.MultiSteps(osf.safefactor(0.1, momentum=0.9), every_k_schedule=3)
  with jax.numpy_dtype_promotion("standard"):  # MultiSteps itself mixes dtypes
    _, state, history = run_steps(tx, params, grads.__getitem__, 6)
  mean_grads = [jax.tree.map(lambda *g: sum(g) / 3, *grads[i:i + 3]) for i in (0, 3)]
  _, _, expected = run_steps(osf.safefactor(0.1, momentum=0.9), params, mean_grads.__getitem__, 2)
  for k in SHAPES:
    assert is_all_zero(history[0][k])
    np.testing.assert_allclose(history[2][k], expected[0][k], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(history[5][k], expected[1][k], rtol=1e-5, atol=1e-7)
  assert int(osf.skipped_steps(state)) == 0


def test_chain_and_extra_args(rng):
  params = random_tree(rng, SHAPES)
  tx = optax.chain(optax.clip_by_global_norm(1.0), osf.safefactor(0.1))
  state = tx.init(params)
  updates, state = tx.update(random_tree(rng, SHAPES), state, params, unused_extra_arg=1)
  assert tree_all_finite(updates)


def test_weight_decay_mask(rng):
  params = random_tree(rng, {"w": (4, 3), "b": (3,)})
  mask = {"w": True, "b": False}
  config = dict(multiply_by_parameter_scale=False, clipping_threshold=None)
  zeros = jax.tree.map(jnp.zeros_like, params)
  masked = osf.safefactor(1.0, weight_decay_rate=0.5, weight_decay_mask=mask, **config)
  callable_mask = osf.safefactor(1.0, weight_decay_rate=0.5, weight_decay_mask=lambda p: mask,
                                 **config)
  for tx in (masked, callable_mask):
    updates, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.5 * params["w"], rtol=1e-6)
    np.testing.assert_array_equal(updates["b"], jnp.zeros(3))


def test_first_steps_compile_once(rng):
  # Params fresh from an initializer are uncommitted; a state committed to a device
  # would differ from what the step returns, and the second step would compile again.
  params = random_tree(rng, SHAPES)
  tx = osf.safefactor(0.1, momentum=0.9)

  @jax.jit
  def step(params, state):
    updates, state = tx.update(params, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for _ in range(3):
    params, state = step(params, state)
  assert step._cache_size() == 1


def test_state_shapes_follow_the_factoring_rule():
  """Each statistic's shape, from the reference's rule: the two largest axes, both at
  least ``min_dim_size_to_factor``; ``factored=False`` keeps every leaf whole.

  Guards against the rule reading the wrong axis (e.g. factoring a (300, 100) leaf
  because its larger axis passes the minimum) and against ``factored`` being ignored.
  """
  shapes = [(300, 140), (140, 300), (300, 100), (100, 300), (128, 128), (127, 300),
            (3, 130, 150), (150, 3, 130), (5, 7), (150,), ()]
  params = {f"p{i}": jax.ShapeDtypeStruct(shape, jnp.float32) for i, shape in enumerate(shapes)}
  for factored in (True, False):
    state = jax.eval_shape(osf.safefactor(0.1, factored=factored).init, params)
    for name, param in params.items():
      moment = state.inner_state.second_moment[name]
      plan = reference_plan(param.shape, factored, 128)
      if plan is None:
        assert isinstance(moment, osf.FullMoment) and moment.v.shape == param.shape, name
        continue
      row_axes, col_axes = plan
      assert moment.v_row.shape == tuple(
          1 if a in col_axes else s for a, s in enumerate(param.shape)), name
      assert moment.v_col.shape == tuple(
          1 if a in row_axes else s for a, s in enumerate(param.shape)), name
    assert factored or all(isinstance(m, osf.FullMoment)
                           for m in state.inner_state.second_moment.values())


@pytest.mark.parametrize("factory", ["safefactor", "scale_by_safe_factored_rms"])
def test_factored_false_matches_the_unfactored_reference(factory, rng):
  # Guards against factored=False being ignored: these leaves would all be factored.
  shapes = {"w": (24, 20), "stacked": (3, 10, 12), "b": (20,)}
  params = random_tree(rng, shapes)
  # The threshold that would factor them has no effect, and says so.
  with pytest.warns(UserWarning, match=r"min_dim_size_to_factor=4 .* has no effect"):
    if factory == "safefactor":
      tx = osf.safefactor(0.1, factored=False, min_dim_size_to_factor=4, momentum=0.9)
      reference = ReferenceAdafactor(learning_rate=0.1, momentum=0.9)
    else:
      tx = osf.scale_by_safe_factored_rms(factored=False, min_dim_size_to_factor=4)
      reference = ReferenceAdafactor(multiply_by_parameter_scale=False,
                                     clipping_threshold=None)
  reference.init_all(params, factored=False)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(3):
    grads = random_tree(rng, shapes, scale=10.0 ** (step - 1))
    updates, state = update(grads, state, params)
    expected = reference.step(grads, params)
    for name in shapes:
      # scale_by_safe_factored_rms returns the scaled gradient, the reference its negative.
      sign = -1.0 if factory == "scale_by_safe_factored_rms" else 1.0
      assert max_relative_error(updates[name], sign * expected[name]) < 2e-5, (step, name)


def test_complex_params_match_the_reference(rng):
  # Complex leaves: real statistics of |g|**2, a real clipping RMS and parameter scale.
  # Guards against a second moment of Re(g)**2 (or g*g), which keeps the update's phase
  # (the other complex test checks only that) but not its size.
  shapes = {"z": (24, 20), "c": (20,)}

  def complex_tree():
    return {k: jnp.asarray(rng.normal(size=s) + 1j * rng.normal(size=s), jnp.complex64)
            for k, s in shapes.items()}

  params = complex_tree()
  tx = osf.safefactor(0.1, min_dim_size_to_factor=8, momentum=0.9)
  reference = ReferenceAdafactor(learning_rate=0.1, momentum=0.9)
  reference.init_all(params, min_dim_size_to_factor=8)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(3):
    grads = complex_tree()
    updates, state = update(grads, state, params)
    expected = reference.step(grads, params)
    for name in shapes:
      assert updates[name].dtype == jnp.complex64
      # (max_relative_error casts to float64, which would drop the imaginary part.)
      error = np.max(np.abs(np.asarray(updates[name], np.complex128) - expected[name]))
      assert error < 2e-5 * np.max(np.abs(expected[name])), (step, name)
    params = optax.apply_updates(params, updates)
