"""Shared test helpers: trees of parameters and running optimizers for several steps."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax


def random_tree(rng: np.random.Generator, shapes: dict, dtype=jnp.float32, scale=1.0) -> dict:
  return {
      name: jnp.asarray(rng.normal(size=shape) * scale, dtype) for name, shape in shapes.items()
  }


def run_steps(
    tx: optax.GradientTransformation,
    params: dict,
    grads_for_step: Callable[[int], dict],
    steps: int,
    jit: bool = True,
):
  """Apply ``steps`` updates; returns (params, state, list of per-step updates)."""
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  history = []
  for step in range(steps):
    updates, state = update(grads_for_step(step), state, params)
    params = optax.apply_updates(params, updates)
    history.append(updates)
  return params, state, history


def max_relative_error(actual, expected, scale: float | None = None) -> float:
  """Largest absolute difference over ``scale`` (default: the largest |expected|)."""
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  if not expected.size:
    return 0.0
  if scale is None:
    scale = float(np.max(np.abs(expected)))
  return float(np.max(np.abs(actual - expected)) / max(scale, 1e-30))


def tree_all_finite(tree) -> bool:
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact))


def assert_trees_close(actual, expected, rtol: float) -> None:
  """Leafwise closeness with an absolute slack of ``rtol`` times the leaf's largest value.

  Weight decay and momentum can cancel an update to near zero, where only an error
  relative to the leaf's scale is meaningful.
  """
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    e = np.asarray(e, np.float64)
    atol = rtol * float(np.max(np.abs(e))) if e.size else 0.0
    np.testing.assert_allclose(np.asarray(a, np.float64), e, rtol=rtol, atol=atol)


def assert_trees_equal(actual, expected) -> None:
  """Bitwise equality, leaf by leaf."""
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def assert_trees_bitwise_equal(actual, expected) -> None:
  """Same structure, dtypes, shapes and bits (NaN payloads and signed zeros included)."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    a, e = np.asarray(a), np.asarray(e)
    assert a.dtype == e.dtype and a.shape == e.shape
    np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), e.reshape(-1).view(np.uint8))


def is_all_zero(x) -> bool:
  """True when every element is exactly 0 (NaN is not)."""
  return bool(np.all(np.asarray(x) == 0))


DEAD_UNITS = 80


def float16_dead_unit_problem(rng: np.random.Generator, batch: int = 32):
  """A float16 MLP whose second half of hidden units is dead (bias -1e3).

  The dead units' rows and bias entries get exactly zero gradients, for ever. Returns
  ``(params, loss)``; ``loss(params, poison)`` replaces the batch by NaN when ``poison``.
  """
  inputs = jnp.asarray(rng.normal(size=(batch, 130)), jnp.float16)
  targets = jnp.asarray(rng.normal(size=(batch, 8)), jnp.float16)
  params = {
      "hidden": jnp.asarray(rng.normal(size=(130, 160)) * 0.1, jnp.float16),
      "bias": jnp.concatenate([jnp.zeros(160 - DEAD_UNITS), jnp.full(DEAD_UNITS, -1e3)])
      .astype(jnp.float16),
      "out": jnp.asarray(rng.normal(size=(160, 8)) * 0.1, jnp.float16),
  }

  def loss(params, poison=False):
    batch_inputs = jnp.where(poison, jnp.asarray(jnp.nan, jnp.float16), inputs)
    hidden = jax.nn.relu(batch_inputs @ params["hidden"] + params["bias"][None, :])
    return jnp.mean((hidden @ params["out"] - targets) ** 2)

  return params, loss


def train_scanned(tx, params, loss, poison_flags):
  """One jitted ``lax.scan`` over the steps; returns (params, state, losses, params_finite)."""

  def step(carry, poison):
    params, state = carry
    value, grads = jax.value_and_grad(loss)(params, poison)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)]))
    return (params, state), (value, finite)

  (params, state), (losses, finite) = jax.jit(
      lambda p, s: jax.lax.scan(step, (p, s), poison_flags))(params, tx.init(params))
  return params, state, losses, finite


def tanh_mlp_regression(dtype, seed: int = 0):
  """A tanh MLP (8-64-1) with params in ``dtype`` fitting a fixed float32 8-32-1 teacher.

  Computation is float32 whatever the params' dtype, so only how updates are written
  back to the params differs between dtypes. Returns ``(params, loss)``.
  """

  def init(key, sizes):
    layers = []
    for fan_in, fan_out in itertools.pairwise(sizes):
      key, sub = jax.random.split(key)
      weight = jax.random.normal(sub, (fan_in, fan_out)) / np.sqrt(fan_in)
      layers.append({"w": weight.astype(dtype), "b": jnp.zeros((1, fan_out), dtype)})
    return layers

  def forward(layers, x):
    for i, layer in enumerate(layers):
      x = x @ layer["w"].astype(jnp.float32) + layer["b"].astype(jnp.float32)
      x = jnp.tanh(x) if i < len(layers) - 1 else x
    return x

  inputs = jax.random.normal(jax.random.key(1), (128, 8))
  teacher = jax.tree.map(lambda a: a.astype(jnp.float32), init(jax.random.key(2), [8, 32, 1]))
  targets = forward(teacher, inputs)

  def loss(params):
    return jnp.mean((forward(params, inputs) - targets) ** 2)

  return init(jax.random.key(seed), [8, 64, 1]), loss


def mean_of_last_losses(tx, params, loss, steps: int, last: int = 20) -> float:
  """Train ``steps`` steps in one jitted ``lax.scan``; the mean loss of the last ``last``."""

  def step(carry, _):
    params, state = carry
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), value

  run = jax.jit(lambda p, s: jax.lax.scan(step, (p, s), None, length=steps)[1])
  return float(jnp.mean(run(params, tx.init(params))[-last:]))


def trained_by_plain_loop(tx, params, loss, steps: int):
  """The params after ``steps`` of the plain optax loop: grad, ``update``, ``apply_updates``.

  What a framework's training state (nnx.Optimizer, linen's TrainState) must reproduce.
  """

  @jax.jit
  def step(params, state):
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for _ in range(steps):
    params, state = step(params, state)
  return params
