"""scale_by_safe_factored_rms: state layout, dtypes, floors, and the float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from optax_safefactor._src.plan import default_plan
from tests.helpers import max_relative_error, random_tree, run_steps, tree_all_finite
from tests.reference import ReferenceAdafactor


def test_state_is_shape_explicit_without_placeholders():
  params = {"w": jnp.ones((300, 200)), "b": jnp.ones((200,)), "stack": jnp.ones((3, 256, 128))}
  state = osf.scale_by_safe_factored_rms().init(params)
  w, b, stack = (state.second_moment[k] for k in ("w", "b", "stack"))
  assert isinstance(w, osf.FactoredMoment) and isinstance(b, osf.FullMoment)
  assert {w.v_row.shape, w.v_col.shape} == {(300, 1), (1, 200)}
  assert b.v.shape == (200,)
  assert stack.v_row.shape == (3, 1, 128) and stack.v_col.shape == (3, 256, 1)
  leaves = jax.tree.leaves(state.second_moment)
  assert sum(leaf.size for leaf in leaves) == 300 + 200 + 200 + 3 * (256 + 128)
  assert all(leaf.dtype == jnp.float32 for leaf in leaves)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_state_is_float32_and_starts_at_the_floor(dtype):
  params = {"w": jnp.ones((130, 140), dtype)}
  state = osf.scale_by_safe_factored_rms(epsilon=1e-30).init(params)
  for leaf in jax.tree.leaves(state.second_moment):
    assert leaf.dtype == jnp.float32
    np.testing.assert_array_equal(leaf, np.float32(1e-30))


def test_state_dtype_option_and_zero_epsilon_floor():
  params = {"w": jnp.ones((130, 140))}
  state = osf.scale_by_safe_factored_rms(epsilon=0.0, state_dtype="bfloat16").init(params)
  for leaf in jax.tree.leaves(state.second_moment):
    assert leaf.dtype == jnp.bfloat16
    assert float(jnp.min(leaf)) > 0.0  # the floor is the dtype's smallest normal, not 0
  zeros = {"w": jnp.zeros((130, 140))}
  tx = osf.scale_by_safe_factored_rms(epsilon=0.0)
  updates, state = tx.update(zeros, tx.init(params), params)
  assert tree_all_finite((updates, state))


@pytest.mark.parametrize("shape,plan", [
    ((140, 130), ((1,), (0,))),
    ((3, 130, 150), ((1,), (2,))),
    ((5, 140, 2, 130), ((3,), (1,))),
    ((17,), None),
])
def test_matches_float64_reference_for_many_steps(shape, plan, rng):
  assert (None if plan is None else tuple(default_plan(shape, True, 128))[:2]) == plan
  reference = ReferenceAdafactor(multiply_by_parameter_scale=False, clipping_threshold=None)
  reference.init("x", shape, plan)
  tx = osf.scale_by_safe_factored_rms()
  params = {"x": jnp.zeros(shape)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(200):
    grads = {"x": jnp.asarray(rng.normal(size=shape) * 10.0 ** (step % 7 - 3), jnp.float32)}
    updates, state = update(grads, state, params)
    expected = reference.step(grads, params)
    assert max_relative_error(updates["x"], -expected["x"]) < 1e-5, step


def test_beta2_cap_and_custom_decay_fn():
  params = {"v": jnp.ones((3,))}
  grads = {"v": jnp.ones((3,))}
  capped = osf.scale_by_safe_factored_rms(beta2_cap=0.5)
  _, state, _ = run_steps(capped, params, lambda s: {"v": grads["v"] * (1.0 if s < 50 else 3.0)},
                          51)
  # With beta2 capped at 0.5, one step at g=3 moves v halfway from 1 to 9.
  np.testing.assert_allclose(state.second_moment["v"].v, 5.0, rtol=1e-6)
  constant = osf.scale_by_safe_factored_rms(decay_rate_fn=lambda step, rate: jnp.float32(0.0))
  _, state, _ = run_steps(constant, params, lambda s: {"v": grads["v"] * (s + 1.0)}, 4)
  np.testing.assert_allclose(state.second_moment["v"].v, 16.0, rtol=1e-6)
  # No leaf, so no beta2 to check: an empty tree steps, with its schedule unused.
  updates, state = constant.update({}, constant.init({}), {})
  assert updates == {} and int(state.count) == 1


@pytest.mark.parametrize("count, step_offset", [(0, -2**31), (2**31 - 10, -1000),
                                                (2**31 - 1, -1)])
def test_a_negative_step_offset_near_int32s_end_keeps_the_history(count, step_offset):
  # count - step_offset wrapped in int32 to a negative step, clamped to 0: beta2 fell to
  # the first step's 0 and the statistics were replaced by this step's g**2 (4 here
  # instead of about 1), at every step for -2**31. The local step saturates instead.
  tx = osf.scale_by_safe_factored_rms(step_offset=step_offset)
  params = {"w": jnp.zeros((130, 140)), "b": jnp.zeros((5,))}
  state = tx.init(params)
  state = state._replace(count=jnp.int32(count),
                         second_moment=jax.tree.map(jnp.ones_like, state.second_moment))
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 2.0), params)
  _, state = tx.update(grads, state, params)
  reference = ReferenceAdafactor(decay_offset=step_offset, count=count)
  beta2 = reference.beta2()
  assert 1 - beta2 < 1e-7  # the local step is past 2**31 - 1 in the reference's ints
  for leaf in jax.tree.leaves(state.second_moment):
    np.testing.assert_allclose(leaf, beta2 + (1 - beta2) * (4 + 1e-30), rtol=1e-6)


def test_matches_optax_scale_by_factored_rms(rng):
  shapes = {"a": (300, 140), "b": (140, 300), "c": (2, 130, 128), "d": (9,)}
  params = random_tree(rng, shapes)
  grads = [random_tree(rng, shapes) for _ in range(20)]
  with jax.numpy_dtype_promotion("standard"):
    _, _, expected = run_steps(optax.scale_by_factored_rms(), params, grads.__getitem__, 20)
  _, _, actual = run_steps(osf.scale_by_safe_factored_rms(), params, grads.__getitem__, 20)
  for step in range(20):
    for k in shapes:
      assert max_relative_error(actual[step][k], expected[step][k]) < 1e-5


def test_float64_params_compute_in_float64(x64, rng):
  params = {"w": jnp.asarray(rng.normal(size=(130, 140)), jnp.float64)}
  grads = {"w": jnp.asarray(rng.normal(size=(130, 140)) * 1e-30, jnp.float64)}
  tx = osf.safefactor(0.1, eps=1e-90)
  updates, state = tx.update(grads, tx.init(params), params)
  assert updates["w"].dtype == jnp.float64
  assert state.inner_state.second_moment["w"].v_row.dtype == jnp.float64
  # 1e-30 squared (and eps=1e-90) underflow float32 but not float64: the update is
  # still the unit-RMS direction of the gradient.
  rms = float(jnp.sqrt(jnp.mean(updates["w"] ** 2)))
  np.testing.assert_allclose(rms, 0.1 * float(jnp.sqrt(jnp.mean(params["w"] ** 2))), rtol=1e-6)


def test_complex_params_get_real_second_moments(rng):
  shape = (130, 140)
  params = {"z": jnp.asarray(rng.normal(size=shape) + 1j * rng.normal(size=shape), jnp.complex64)}
  grads = {"z": jnp.asarray(rng.normal(size=shape) + 1j * rng.normal(size=shape), jnp.complex64)}
  tx = osf.safefactor(0.1, momentum=0.9, weight_decay_rate=1e-3)
  updates, state = tx.update(grads, tx.init(params), params)
  moment = state.inner_state.second_moment["z"]
  assert moment.v_row.dtype == jnp.float32 and updates["z"].dtype == jnp.complex64
  assert state.inner_state.momentum["z"].dtype == jnp.complex64
  # The scaled update is the gradient times a real factor: its phase is the gradient's.
  unscaled = osf.scale_by_safe_factored_rms()
  scaled, _ = unscaled.update(grads, unscaled.init(params), params)
  np.testing.assert_allclose(jnp.angle(scaled["z"]), jnp.angle(grads["z"]), atol=1e-5)
  assert tree_all_finite((updates, state))


def test_tiny_rows_next_to_large_ones_follow_the_reference(rng):
  # 0.1 capped the factored scale at rsqrt(eps) = 1e15, so wherever the estimate fell
  # below eps = 1e-30 (normal float32 values) the update was g * 1e15 instead of
  # g / sqrt(V): rows of gradients around 1e-16 next to rows around 1 were off by 1.4e-2.
  # The cap now sits at the compute dtype's smallest normal, where V really underflows.
  g = rng.standard_normal((300, 200)).astype(np.float32)
  g[150:] *= np.float32(1e-16)
  reference = ReferenceAdafactor(multiply_by_parameter_scale=False, clipping_threshold=None)
  reference.init("w", g.shape, tuple(default_plan(g.shape, True, 128))[:2])
  tx = osf.scale_by_safe_factored_rms()
  params = {"w": jnp.zeros(g.shape)}
  state = tx.init(params)
  for step in range(3):
    grads = {"w": jnp.asarray(g * np.float32(step + 1))}
    updates, state = tx.update(grads, state, params)
    expected = reference.step(grads, params)["w"]
    # Elementwise, relative to each element: the tiny rows are judged on their own scale.
    np.testing.assert_allclose(np.asarray(updates["w"], np.float64), -expected, rtol=1e-5)


def test_float64_beta2_is_computed_in_float64(x64, rng):
  # 0.1 computed beta2 in float32 for float64 params: float64 runs differed from a
  # float64 reference by 3e-8 to 7.5e-8. Computed in the compute dtype, they agree to
  # float64 rounding.
  shape = (140, 130)
  reference = ReferenceAdafactor(multiply_by_parameter_scale=False, clipping_threshold=None)
  reference.init("w", shape, tuple(default_plan(shape, True, 128))[:2])
  tx = osf.scale_by_safe_factored_rms()
  params = {"w": jnp.zeros(shape, jnp.float64)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(30):
    grads = {"w": jnp.asarray(rng.normal(size=shape), jnp.float64)}
    updates, state = update(grads, state, params)
    expected = reference.step(grads, params)["w"]
    assert max_relative_error(updates["w"], -expected) < 1e-12, step


@pytest.mark.parametrize("config", [
    dict(momentum=0.9, weight_decay_rate=1e-3),
    # A narrow momentum is checked element by element; without parameter scale, so are
    # the params that weight decay reads.
    dict(momentum=0.9, dtype_momentum="bfloat16", weight_decay_rate=1e-3,
         multiply_by_parameter_scale=False),
], ids=["default", "narrow_momentum_no_parameter_scale"])
def test_an_empty_leaf_is_no_reason_to_skip(config):
  # A zero-size param (an empty embedding table, say) has nothing to be non-finite: the
  # other leaves must still step.
  params = {"w": jnp.ones((3, 4)), "empty": jnp.ones((0, 5))}
  tx = osf.safefactor(0.1, **config)
  _, state, history = run_steps(tx, params, lambda _: jax.tree.map(jnp.ones_like, params), 3)
  assert int(osf.skipped_steps(state)) == 0
  assert all(bool(jnp.any(u["w"] != 0)) for u in history)
  assert history[0]["empty"].shape == (0, 5)
