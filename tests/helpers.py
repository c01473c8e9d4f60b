"""Shared test helpers: trees of parameters and running optimizers for several steps."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import pathlib
import re
import sys
import types
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_safefactor as osf


def load_module(path: pathlib.Path) -> types.ModuleType:
  """The Python file at ``path`` (a tool or a docs extension, outside any package) as a
  module, registered under its stem so that its dataclasses and pickles resolve."""
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[path.stem] = module
  spec.loader.exec_module(module)
  return module


# The lists that compilations() blocks are filling; the listener is registered once, as JAX
# 0.7.1 (the core floor) has no public way to unregister one.
_COMPILATION_RECORDS: list[list[str]] = []


def _record_compilation(event: str, seconds: float, fun_name: str = "", **kwargs) -> None:
  del seconds, kwargs
  if event == "/jax/core/compile/backend_compile_duration":
    for names in _COMPILATION_RECORDS:
      names.append(fun_name)


@contextlib.contextmanager
def compilations():
  """The names of the programs XLA compiles inside the block, one entry per compilation.

  Counting traces misses a step traced once and compiled again for inputs placed
  elsewhere (Auto mode hands outputs back where XLA chose to put them).
  """
  if not getattr(_record_compilation, "registered", False):
    jax.monitoring.register_event_duration_secs_listener(_record_compilation)
    _record_compilation.registered = True
  names: list[str] = []
  _COMPILATION_RECORDS.append(names)
  try:
    yield names
  finally:
    _COMPILATION_RECORDS.remove(names)


def random_tree(rng: np.random.Generator, shapes: dict, dtype=jnp.float32, scale=1.0) -> dict:
  return {
      name: jnp.asarray(rng.normal(size=shape) * scale, dtype) for name, shape in shapes.items()
  }


def run_steps(
    tx: optax.GradientTransformation,
    params,
    grads: Callable[[int], dict] | Sequence,
    steps: int | None = None,
    jit: bool = True,
    *,
    state=None,
    apply_updates: bool = True,
    dtype_promotion: str | None = None,
):
  """The optax loop: ``update``, then ``apply_updates``; returns (params, state, updates).

  ``grads`` is a sequence of gradient trees, or a function of the step's index (then
  ``steps`` says how many steps). ``state`` continues a run (by default ``tx.init``);
  ``apply_updates=False`` keeps the params as given, every step reading the same ones.
  ``dtype_promotion="standard"`` runs the loop under that promotion (optax's
  ``MultiSteps`` and ``adam`` mix int and float counts).
  """
  if callable(grads):
    if steps is None:
      raise TypeError("run_steps: a function of the step needs `steps`")
    grads = [grads(step) for step in range(steps)]
  elif steps is not None:
    grads = list(grads)[:steps]
  with contextlib.ExitStack() as stack:
    if dtype_promotion is not None:
      stack.enter_context(jax.numpy_dtype_promotion(dtype_promotion))
    state = tx.init(params) if state is None else state
    update = jax.jit(tx.update) if jit else tx.update
    history = []
    for step_grads in grads:
      updates, state = update(step_grads, state, params)
      if apply_updates:
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


# --- the registry: every public transformation, every wrapper, every ecosystem ---------------
#
# The contract test (test_contract.py) runs each transformation inside each wrapper against
# the float64 reference; the ecosystem test (test_ecosystems.py) runs each one through each
# ecosystem; the guard tests take the guarded ones. A new public transformation gets an
# entry here and so reaches every one of those tests.


@dataclasses.dataclass(frozen=True)
class Transformation:
  """How the tests build one public transformation, and the reference update it equals."""

  build: Callable[[], optax.GradientTransformation]
  # tests.reference.ReferenceAdafactor's config for the same update, and its factoring size.
  reference: dict
  min_dim_size_to_factor: int = 128
  # Calls of ``update`` per applied step: the updates of the other calls are zero, and the
  # applied one steps on the mean of the group's gradients.
  every_k: int = 1
  # Skips a non-finite step and counts it (``osf.skipped_steps`` finds a guard).
  guarded: bool = True


TRANSFORMATIONS = {
    "safefactor": Transformation(lambda: osf.safefactor(0.1), dict(learning_rate=0.1)),
    "safefactor_momentum": Transformation(
        lambda: osf.safefactor(0.1, momentum=0.9, weight_decay_rate=1e-4),
        dict(learning_rate=0.1, momentum=0.9, weight_decay_rate=1e-4)),
    # Spike skipping on, with a window short enough to judge within the tests' few steps
    # (their gradients are alike in scale: no step is a spike, the history is state).
    "safefactor_spikes": Transformation(
        lambda: osf.safefactor(0.1, momentum=0.9, skip_spikes=6.0, spike_window=4),
        dict(learning_rate=0.1, momentum=0.9)),
    # scale(-0.02) after the scaling: a learning rate of 0.02 and nothing else.
    "scale_by_safe_factored_rms": Transformation(
        lambda: optax.chain(osf.scale_by_safe_factored_rms(min_dim_size_to_factor=8),
                            optax.scale(-0.02)),
        dict(learning_rate=0.02, multiply_by_parameter_scale=False, clipping_threshold=None),
        min_dim_size_to_factor=8, guarded=False),
    "skip_nonfinite": Transformation(
        lambda: osf.skip_nonfinite(
            optax.chain(osf.scale_by_safe_factored_rms(), optax.scale(-0.02))),
        dict(learning_rate=0.02, multiply_by_parameter_scale=False, clipping_threshold=None)),
    "with_param_rounding": Transformation(
        lambda: osf.with_param_rounding(
            osf.safefactor(0.1, momentum=0.9, min_dim_size_to_factor=8), "kahan"),
        dict(learning_rate=0.1, momentum=0.9), min_dim_size_to_factor=8),
    "accumulate_gradients": Transformation(
        lambda: osf.accumulate_gradients(osf.safefactor(0.1, weight_decay_rate=1e-4), 2),
        dict(learning_rate=0.1, weight_decay_rate=1e-4), every_k=2),
}

# optax's wrappers, each given the transformation of a tree {"w", "b", "frozen"} whose
# "frozen" leaf it must leave alone where it masks, and how many calls it groups into one.
WRAPPERS = {
    "plain": lambda tx: tx,
    "chain": lambda tx: optax.chain(optax.clip_by_global_norm(10.0), tx),
    "multi_transform": lambda tx: optax.multi_transform(
        {"opt": tx, "frozen": optax.set_to_zero()}, {"w": "opt", "b": "opt", "frozen": "frozen"}),
    "masked": lambda tx: optax.chain(
        optax.masked(tx, {"w": True, "b": True, "frozen": False}),
        optax.masked(optax.set_to_zero(), {"w": False, "b": False, "frozen": True})),
    "multi_steps": lambda tx: optax.MultiSteps(tx, every_k_schedule=2),
    "apply_if_finite": lambda tx: optax.apply_if_finite(tx, max_consecutive_errors=3),
}
WRAPPER_EVERY_K = {"multi_steps": 2}

# Where the transformations must work as they do in a plain loop: test_ecosystems.py has
# one test per entry, each run over every transformation. msgpack is Flax's serialization
# (flax.serialization.to_bytes, flax.training.checkpoints).
ECOSYSTEMS = ("orbax", "msgpack", "mesh", "nnx", "linen")


_COMPUTATION = re.compile(r"^(%[\w.\-]+|ENTRY)\b")
_NAME = re.compile(r"%[\w.\-]+")
_LOOP_FUSION = re.compile(r"= \S+ fusion\(.*kind=kLoop, calls=(%[\w.\-]+)")


def distinct_loop_kernels(compiled_text: str) -> int:
  """How many distinct loop kernels a compiled program (``Compiled.as_text()``) has.

  XLA's CPU backend compiles one kernel per distinct fused computation, with LLVM, at
  about 10 ms each on the 2-core machine: most of a many-leaf step's compile time. Two
  fusions are the same kernel when their computations are equal up to names; library
  (XNNPACK) fusions are left out, they are not compiled by LLVM.
  """
  bodies: dict[str, list[str]] = {}
  current = None
  for line in compiled_text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = match.group(1)
      bodies[current] = []
    elif current and line.strip() not in ("", "}"):
      bodies[current].append(re.sub(r", (metadata|backend_config)=.*", "", line.strip()))

  def normalised(name: str, depth: int = 0) -> str:
    names: dict[str, str] = {}

    def rename(match):
      found = match.group(0)
      if found not in names:
        names[found] = (normalised(found, depth + 1) if found in bodies and depth < 3
                        else f"%v{len(names)}")
      return names[found]

    return "{" + ";".join(_NAME.sub(rename, line) for line in bodies[name]) + "}"

  return len({normalised(match.group(1)) for line in bodies.get("ENTRY", [])
              if (match := _LOOP_FUSION.search(line))})


def seed_for(mode: str, seed: int) -> int:
  """``seed`` where ``mode`` draws bits (stochastic rounding), else 0: a seed other than 0
  warns that it has no effect under the other modes."""
  return seed if mode == "stochastic" else 0


def train_with_nnx_optimizer(model, tx, inputs, targets, steps: int):
  """``steps`` jitted steps of ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` on the mean
  squared error of ``model(inputs)`` against ``targets``; returns the optimizer."""
  from flax import nnx  # the flax extra: only the tests that have it call this

  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer):
    grads = nnx.grad(lambda model: jnp.mean((model(inputs) - targets) ** 2))(model)
    optimizer.update(model, grads)

  for _ in range(steps):
    train_step(model, optimizer)
  return optimizer
