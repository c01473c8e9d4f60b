"""Differentiating through ``update`` (learned optimizers, hyperparameter gradients):
finite where the step is, and equal to the float64 reference's finite differences.

The forward step handles exact zeros (a gradient element, a dead row, a whole leaf's
gradient, all-zero params) by its floors; lax's derivative rules for the roots do not:
``rsqrt``'s forms ``r / x`` (1e45 at the 1e-30 floor, past float32's range) and ``sqrt``'s
divides by a zero root, and a zero cotangent times either is NaN.
"""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from optax_safefactor._src import rounding
from optax_safefactor._src.bit_streams import random_bits
from tests.helpers import TRANSFORMATIONS
from tests.reference import ReferenceAdafactor

SHAPES = {"kernel": (6, 5), "bias": (5,), "idle": (4, 3), "zeros": (5,)}


def _params(dtype):
  rng = np.random.default_rng(1)
  params = {name: rng.normal(size=shape) for name, shape in SHAPES.items()}
  params["zeros"] = np.zeros(SHAPES["zeros"])  # a bias initialised at zero
  return {name: jnp.asarray(value, dtype) for name, value in params.items()}


def _grads(seed, dtype, zeros):
  """Random gradients; with ``zeros``, a dead row of the kernel, a zero element of the
  bias and an all-zero gradient for ``idle``."""
  rng = np.random.default_rng(seed)
  grads = {name: rng.normal(size=shape) for name, shape in SHAPES.items()}
  if zeros:
    grads["kernel"][2] = 0.0
    grads["bias"][1] = 0.0
    grads["idle"][...] = 0.0
  return {name: jnp.asarray(value, dtype) for name, value in grads.items()}


def _weights():
  rng = np.random.default_rng(7)
  return {name: rng.normal(size=shape) for name, shape in SHAPES.items()}


def _meta_loss(tx, state, weights):
  """A loss of the params after one step, as a function of its grads and params."""
  def loss(grads, params):
    updates, _ = tx.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    return sum(jnp.sum(jnp.asarray(weights[name], jnp.float32) * new[name].astype(jnp.float32))
               for name in new)
  return loss


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_gradients_through_a_first_step_at_exact_zeros_are_finite(name):
  # The first step's statistics sit on the 1e-30 floor where the gradient is 0: every
  # transformation gave NaN there (and optax.adafactor does), which poisons the whole
  # meta-gradient.
  params = _params(jnp.float32)
  tx = TRANSFORMATIONS[name].build()
  loss = jax.jit(jax.grad(_meta_loss(tx, tx.init(params), _weights()), argnums=(0, 1)))
  for tree in loss(_grads(0, jnp.float32, zeros=True), params):
    for leaf_name, leaf in tree.items():
      assert bool(jnp.all(jnp.isfinite(leaf))), (name, leaf_name)


CONFIGS = {
    "default": ({}, {}),
    "momentum_and_decay": (dict(momentum=0.9, weight_decay_rate=1e-2),
                           dict(momentum=0.9, weight_decay_rate=1e-2)),
    "unclipped_unscaled": (dict(clipping_threshold=None, multiply_by_parameter_scale=False),
                           dict(clipping_threshold=None, multiply_by_parameter_scale=False)),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_gradients_through_update_follow_finite_differences_of_the_reference(x64, config):
  # After three steps of history the loss is smooth at the zeros, so central differences
  # of the float64 reference give its derivative to ~1e-9: a derivative rule off by any
  # factor, or NaN at a zero root (the zero params' scale, the idle leaf's clipping), fails.
  options, reference_options = CONFIGS[config]
  params = _params(jnp.float64)
  tx = osf.safefactor(0.1, min_dim_size_to_factor=2, **{"clipping_threshold": 0.5, **options})
  reference = ReferenceAdafactor(learning_rate=0.1,
                                 **{"clipping_threshold": 0.5, **reference_options})
  reference.init_all({k: np.asarray(v) for k, v in params.items()}, min_dim_size_to_factor=2)
  state = tx.init(params)
  numpy_params = {k: np.asarray(v) for k, v in params.items()}
  # Compiled: run eagerly, the steps and their derivative compiled some 300 operations one by
  # one, most of this test's time.
  update = jax.jit(tx.update)
  for seed in range(3):
    grads = _grads(seed, jnp.float64, zeros=False)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    step = reference.step({k: np.asarray(v) for k, v in grads.items()}, numpy_params)
    numpy_params = {k: numpy_params[k] + step[k] for k in numpy_params}
  weights = _weights()
  grads = _grads(3, jnp.float64, zeros=True)
  by_grads, by_params = jax.jit(jax.grad(_meta_loss(tx, state, weights), argnums=(0, 1)))(
      grads, params)

  def reference_loss(grads, params):
    step = copy.deepcopy(reference).step(grads, params)
    return sum(np.sum(weights[k] * (params[k] + step[k])) for k in params)

  numpy_grads = {k: np.asarray(v) for k, v in grads.items()}
  for which, point, computed in (("grads", numpy_grads, by_grads),
                                 ("params", numpy_params, by_params)):
    for name in SHAPES:
      expected = np.zeros(SHAPES[name])
      for index in np.ndindex(*SHAPES[name]):
        values = []
        for sign in (1, -1):
          moved = {k: v.copy() for k, v in point.items()}
          moved[name][index] += sign * 1e-6
          args = (moved, numpy_params) if which == "grads" else (numpy_grads, moved)
          values.append(reference_loss(*args))
        expected[index] = (values[0] - values[1]) / 2e-6
      np.testing.assert_allclose(np.asarray(computed[name]), expected, rtol=1e-5, atol=1e-7,
                                 err_msg=f"d loss / d {which}[{name!r}]")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_stochastic_rounding_differentiates_as_a_cast(dtype):
  # Built of integer operations on the bits, it gave a zero derivative for every element,
  # so a meta-gradient through a stochastic write-back was 0 without a word. It is
  # unbiased (E[result] = x): its derivative is a cast's, as rounding to nearest's is.
  x = jnp.linspace(-3.0, 3.0, 64, dtype=jnp.float32)
  bits = random_bits(0, 0, 0, x.shape, stream=0)
  weights = jnp.linspace(0.5, 1.5, 64, dtype=jnp.float32)

  def loss(x):
    return jnp.sum(weights * rounding.stochastic_round(x, dtype, bits).astype(jnp.float32))

  np.testing.assert_array_equal(jax.grad(loss)(x), weights.astype(dtype).astype(jnp.float32))


def test_a_stochastic_write_back_differentiates_as_the_nearest_one():
  params = _params(jnp.bfloat16)
  grads = _grads(0, jnp.bfloat16, zeros=False)
  derivatives = []
  for mode in ("nearest", "stochastic"):
    tx = osf.safefactor(0.1, min_dim_size_to_factor=2, param_rounding=mode)
    derivatives.append(jax.jit(jax.grad(_meta_loss(tx, tx.init(params), _weights()),
                                        argnums=(0, 1)))(grads, params))
  nearest, stochastic = derivatives
  assert any(bool(jnp.any(leaf != 0)) for leaf in jax.tree.leaves(stochastic))
  jax.tree.map(np.testing.assert_array_equal, stochastic, nearest)
