"""Drop-in gaps against optax.adafactor: what an optax user may pass and expect."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf


def _params(dtype=jnp.float32):
  return {"w": jnp.full((130, 140), 0.5, dtype), "b": jnp.full((140,), 0.5, dtype)}


def test_weight_decay_rate_may_be_a_schedule():
  # 0.1 accepted a schedule and then crashed inside update with a TypeError.
  params = _params()
  schedule = optax.linear_schedule(0.0, 0.2, 4)
  tx = osf.safefactor(0.0, weight_decay_rate=schedule, multiply_by_parameter_scale=False)
  state = tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  for step in range(3):
    updates, state = tx.update(zeros, state, params)
    # learning rate 0: the update is the decay alone, -rate(step) * param.
    np.testing.assert_allclose(updates["w"], -float(schedule(step)) * 0.5, rtol=1e-6)


def test_dtype_momentum_none_means_the_params_dtype():
  # optax: dtype_momentum=None keeps the params' dtype; 0.1 made it float32 (or float64).
  for dtype in (jnp.bfloat16, jnp.float32):
    state = osf.safefactor(0.1, momentum=0.9, dtype_momentum=None).init(_params(dtype))
    assert state.inner_state.momentum["w"].dtype == dtype


@pytest.mark.skipif(
    tuple(int(part) for part in optax.__version__.split(".")[:3]) < (0, 2, 8),
    reason="optax before 0.2.8 hands inject_hyperparams' dtype arguments over as float32 "
    "arrays, so the class cannot be recovered",
)
@pytest.mark.parametrize(("argument", "stored"), [
    ("dtype_momentum", lambda state: state.momentum["w"]),
    ("state_dtype", lambda state: jax.tree.leaves(state.second_moment)[0]),
])
def test_injected_dtype_class_needs_no_conversion_warning(argument, stored):
  # inject_hyperparams calls a dtype class as a schedule (jnp.bfloat16(count)), so it
  # arrives as a bfloat16 scalar. Converting that array back to a dtype raised a
  # DeprecationWarning (an error in a later JAX): dtype_momentum's in 0.1, state_dtype's
  # until 0.4.
  params = _params()
  tx = optax.inject_hyperparams(osf.safefactor, static_args=("min_dim_size_to_factor",))(
      learning_rate=0.1, momentum=0.9, **{argument: jnp.bfloat16})
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    with jax.numpy_dtype_promotion("standard"):
      state = tx.init(params)
      _, state = jax.jit(tx.update)(params, state, params)
  assert stored(state.inner_state.inner_state).dtype == jnp.bfloat16


def test_map_params_casts_the_float_state_and_keeps_the_counters():
  # The supported way to cast an optimizer state with optax.tree.map_params: a function
  # that casts floating leaves only. The guard's counters are int32 and stay so.
  params = _params()
  tx = osf.safefactor(0.1, momentum=0.9)
  state = tx.init(params)

  def to_bfloat16(x):
    return x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x

  cast = optax.tree.map_params(tx, to_bfloat16, state)
  assert cast.inner_state.second_moment["w"].v_row.dtype == jnp.bfloat16
  assert cast.inner_state.momentum["w"].dtype == jnp.bfloat16
  assert cast.nonfinite_steps.per_leaf()["w"].dtype == jnp.int32
  assert cast.skipped_steps.dtype == jnp.int32


def test_map_params_with_a_params_shaped_tree_says_why_it_cannot():
  # The statistics of a leaf are a FactoredMoment(v_row, v_col) or FullMoment(v), not an
  # array shaped like the param, so a second params-shaped tree cannot be zipped with
  # them. optax raises its structure error; this pins that it does not pass silently.
  params = _params()
  tx = osf.safefactor(0.1)
  with pytest.raises(ValueError, match=r"(?i)structure|named tuple"):
    optax.tree.map_params(tx, lambda x, p: x, tx.init(params), params)
