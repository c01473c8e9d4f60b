"""Property tests: any shape, dtype and magnitude keeps params and state finite."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_safefactor as osf
from tests.helpers import tree_all_finite

DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}


@settings(max_examples=25)
@given(
    shape=st.lists(st.sampled_from([0, 1, 2, 3, 5, 8]), min_size=0, max_size=4),
    dtype=st.sampled_from(sorted(DTYPES)),
    log_magnitude=st.floats(-8, 3),
    zero_fraction=st.sampled_from([0.0, 0.5, 1.0]),
    momentum=st.sampled_from([None, 0.9]),
    seed=st.integers(0, 2**16),
)
def test_params_and_state_stay_finite(shape, dtype, log_magnitude, zero_fraction, momentum, seed):
  rng = np.random.default_rng(seed)
  dtype = DTYPES[dtype]
  shape = tuple(shape)
  params = {"x": jnp.asarray(rng.normal(size=shape), dtype)}
  tx = osf.safefactor(0.01, min_dim_size_to_factor=2, momentum=momentum)
  state = tx.init(params)
  update = jax.jit(tx.update)  # one compile per example, not one per operation and shape
  for _ in range(3):
    values = np.asarray(rng.normal(size=shape) * 10.0**log_magnitude)
    values = np.where(rng.random(size=shape) < zero_fraction, 0.0, values)
    updates, state = update({"x": jnp.asarray(values, dtype)}, state, params)
    assert updates["x"].dtype == dtype and updates["x"].shape == shape
    params = optax.apply_updates(params, updates)
  assert tree_all_finite((params, state))
  assert int(osf.skipped_steps(state)) == 0
  for leaf in jax.tree.leaves(state.inner_state.second_moment):
    assert leaf.dtype == jnp.float32
