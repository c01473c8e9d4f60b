"""NumPy arrays given to init and update are taken as ``jax.jit`` takes them.

Params made with NumPy (``np.ones``, ``np.random.randn``, a ``.npz`` file, a checkpoint
restored without a target) are float64, which JAX holds as float32 unless 64-bit JAX
is on. A jitted step sees them so; an eager step used to work out float64 statistics
for them, refuse the float32 state ``init`` had made ("the second moment in the
optimizer state is float32, but this optimizer keeps it in float64"), and warn at
``init`` that float64 was truncated.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_safefactor as osf
from tests.helpers import assert_trees_bitwise_equal
from tests.test_differential import SAFEFACTOR

# "scale" is a NumPy scalar (``np.float64(2.0)``), which is no ``np.ndarray``.
SHAPES = {"w": (6, 5), "b": (5,), "scale": ()}

# Every public transformation, and the safefactor settings that take their own path
# (momentum and its dtype, the write-back modes, no guard, spikes, the presets).
TRANSFORMS = {
    "safefactor": lambda: osf.safefactor(1e-2),
    "momentum": lambda: osf.safefactor(1e-2, momentum=0.9, dtype_momentum=None),
    "unguarded": lambda: osf.safefactor(1e-2, skip_nonfinite_steps=False),
    "spikes": lambda: osf.safefactor(1e-2, skip_spikes=6.0),
    "scale_by_safe_factored_rms": lambda: osf.scale_by_safe_factored_rms(),
    "accumulate_gradients": lambda: osf.accumulate_gradients(osf.safefactor(1e-2), 2),
    "skip_nonfinite": lambda: osf.skip_nonfinite(optax.sgd(1e-2, momentum=0.9)),
    "t5x": lambda: osf.presets.t5x(1e-2),
    "torch": lambda: osf.presets.torch(1e-2),
    "transformers": lambda: osf.presets.transformers(),
    "big_vision": lambda: osf.presets.big_vision(1e-2),
}

# The write-back modes round narrow params: bfloat16 NumPy arrays (ml_dtypes).
NARROW_TRANSFORMS = {
    "stochastic": lambda: osf.safefactor(1e-2, param_rounding="stochastic"),
    "kahan": lambda: osf.safefactor(1e-2, param_rounding="kahan"),
    "with_param_rounding": lambda: osf.with_param_rounding(optax.sgd(1e-2, momentum=0.9)),
}


def _numpy_tree(seed: int, dtype=np.float64) -> dict:
  rng = np.random.default_rng(seed)
  tree = {name: rng.standard_normal(shape).astype(dtype) for name, shape in SHAPES.items()}
  tree["scale"] = np.dtype(dtype).type(tree["scale"])
  assert isinstance(tree["scale"], np.generic)
  return tree


def _steps(tx, params, grads, steps: int = 2, *, strict: bool = True):
  """Eager init and ``steps`` updates: the updates and the state. Every warning is an
  error, or with ``strict=False`` only JAX's about float64 (what a setting warns about it
  warns about whichever arrays it is given)."""
  history = []
  with warnings.catch_warnings():
    if strict:
      warnings.simplefilter("error")
    else:
      warnings.simplefilter("ignore", UserWarning)
      warnings.filterwarnings("error", message=".*float64.*")
    state = tx.init(params)
    for _ in range(steps):
      updates, state = tx.update(grads, state, params)
      history.append(updates)
  return history, state


def _as_jax(tree):
  return jax.tree.map(jnp.asarray, tree)


@pytest.mark.parametrize("dtype, transforms", [(np.float64, TRANSFORMS),
                                                (ml_dtypes.bfloat16, NARROW_TRANSFORMS)],
                         ids=["float64", "bfloat16"])
def test_numpy_params_and_grads_step_as_their_jax_arrays(dtype, transforms):
  params, grads = _numpy_tree(0, dtype), _numpy_tree(1, dtype)
  for name, make in transforms.items():
    expected = _steps(make(), _as_jax(params), _as_jax(grads))
    actual = _steps(make(), params, grads)
    assert_trees_bitwise_equal(actual, expected), name
    for updates in actual[0]:
      for leaf in jax.tree.leaves(updates):
        assert isinstance(leaf, jax.Array), name
        assert leaf.dtype == jnp.asarray(np.zeros((), dtype)).dtype, name


@pytest.mark.parametrize("name", ["safefactor", "momentum", "accumulate_gradients", "torch"])
def test_numpy_params_step_eagerly_as_the_jitted_step_does(name):
  """The gradients of NumPy params come from ``jax.grad`` as float32 JAX arrays: the
  common case, a float32 gradient beside a float64 param, in an eager loop and a jitted one."""
  params = _numpy_tree(0)

  def loss(p):
    return jnp.sum(jnp.sin(p["w"]) @ p["b"]) + jnp.sum(p["b"] ** 2)

  def train(update):
    tx = TRANSFORMS[name]()
    state, current = tx.init(params), params
    for _ in range(4):
      updates, state = update(tx)(jax.grad(loss)(current), state, current)
      current = optax.apply_updates(current, updates)
    return current, state

  eager, jitted = train(lambda tx: tx.update), train(lambda tx: jax.jit(tx.update))
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               rtol=1e-6, atol=1e-7)


def test_a_state_restored_as_numpy_arrays_steps_as_the_state_it_was():
  """A checkpoint restored without a target (``orbax``, ``np.load``) gives NumPy arrays."""
  tx = osf.safefactor(1e-2, momentum=0.9)
  params, grads = _as_jax(_numpy_tree(0)), _as_jax(_numpy_tree(1))
  _, state = tx.update(grads, tx.init(params), params)
  restored = jax.tree.map(np.asarray, state)
  assert isinstance(jax.tree.leaves(restored)[0], np.ndarray)
  assert_trees_bitwise_equal(tx.update(grads, restored, params), tx.update(grads, state, params))


def test_a_python_number_is_still_refused_with_its_path():
  tx = osf.safefactor(1e-2)
  with pytest.raises(TypeError, match=r"params\['b'\]: param is a float \(1.0\), not an array"):
    tx.init({"w": np.ones((6, 5)), "b": 1.0})


def test_numpy_float64_stays_float64_with_64_bit_jax(x64):
  tx = osf.safefactor(1e-2, momentum=0.9, dtype_momentum=None)
  params = _numpy_tree(0)
  updates, state = tx.update(_numpy_tree(1), tx.init(params), params)
  assert updates["w"].dtype == jnp.float64
  kept = jax.tree.leaves((state.inner_state.second_moment, state.inner_state.momentum))
  assert {leaf.dtype for leaf in kept} == {np.dtype(np.float64)}


@settings(max_examples=20, deadline=None)
@given(options=st.fixed_dictionaries(SAFEFACTOR), seed=st.integers(0, 2**16))
def test_every_setting_steps_numpy_params_as_their_jax_arrays(options, seed):
  params, grads = _numpy_tree(seed), _numpy_tree(seed + 1)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # a drawn setting that has no effect
    tx = osf.safefactor(**options)
  expected = _steps(tx, _as_jax(params), _as_jax(grads), strict=False)
  actual = _steps(tx, params, grads, strict=False)
  assert_trees_bitwise_equal(actual, expected)


@pytest.mark.parametrize("leaf, message", [
    (np.array([1, 2], np.int64), "param dtype int64 is not floating or complex"),
    (np.array([True]), "param dtype bool is not floating or complex"),
    (np.array(["a", "b"]), "param dtype <U1 is not floating or complex"),
])
def test_a_numpy_leaf_of_no_floating_dtype_is_refused_as_it_was_given(leaf, message):
  """Only floating and complex NumPy arrays are taken as JAX arrays: an integer array keeps
  its dtype for the message, and a string array gets the package's error, not JAX's."""
  tx = osf.safefactor(1e-2)
  with pytest.raises(TypeError, match=re.escape(f"params['x']: {message}")):
    tx.init({"w": np.ones((6, 5)), "x": leaf})
