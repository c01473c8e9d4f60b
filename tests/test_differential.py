"""Differential tests: random configurations, step by step against the float64 reference.

Hypothesis draws every setting of ``safefactor`` (and of ``scale_by_safe_factored_rms``
for ``decay_rate_fn``), a tree whose leaf names repeat in different subtrees, and
gradients with dead (zero) and faint (underflowing) slices; each example runs 100
steps of the jitted update and compares every step's update, leaf by leaf, with
``tests/reference.py``. The same draws check, step by step against the same reference,
bfloat16 and float16 params landing as their ``param_rounding`` promises (safefactor's
own and ``with_param_rounding``'s around ``optax.sgd`` or safefactor), ``checked=True``
against the unchecked step, and ``accumulate_gradients`` on the mean of each group.
What each drawn setting guards against is said where it is drawn.
"""

from __future__ import annotations

import functools
import itertools
import types
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

import optax_safefactor as osf
from tests.helpers import assert_trees_bitwise_equal
from tests.reference import ReferenceAdafactor, reference_plan_from_roles

STEPS = 100

# "kernel" and "bias" repeat under "enc" and "dec" with the same shapes, so anything
# keyed by a leaf's last name (its plan, its roles, its mask) gives the second one the
# first one's answer; "blocks" has a third axis for batch and "none" roles.
TREE_SHAPES = {
    "enc": {"kernel": (6, 5), "bias": (5,)},
    "dec": {"kernel": (6, 5), "bias": (5,)},
    "blocks": {"kernel": (3, 4, 5)},
    "norm": {"scale": (7,)},
}

# A faint slice's squares underflow the compute dtype's smallest normal, so its
# statistic sits on the floor and its factored scale can reach the cap.
FAINT = {np.dtype(np.float32): 1e-21, np.dtype(np.float64): 1e-156}

# Largest error of an update, relative to the largest element of the reference's update
# of the same leaf and step, by the leaf's real compute dtype. Over three times these
# tests' examples the largest errors seen were 1.4e-6 and 1.4e-14; float32 arithmetic in
# a float64 leaf (1e-7) is far above the float64 tolerance.
TOLERANCE = {np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-10}
# With statistics stored narrower than they are computed, a blend near a rounding boundary
# may be stored as either neighbour by the two sides: one bfloat16 ulp (2**-8) in a
# statistic is about 2**-9 in the update, a few of them (row, column, their mean) a few
# times that; float32 statistics of float64 leaves agree to float32's tolerance.
STORED_STATISTICS_TOLERANCE = {np.dtype(ml_dtypes.bfloat16): 1e-2, np.dtype(np.float32): 2e-5}


def _paths_and_shapes():
  flat, _ = jax.tree_util.tree_flatten_with_path(
      TREE_SHAPES, is_leaf=lambda x: isinstance(x, tuple))
  return [(jax.tree_util.keystr(path), shape) for path, shape in flat]


PATHS_AND_SHAPES = _paths_and_shapes()


def _tree_of(values_by_path: dict):
  """A tree shaped like ``TREE_SHAPES`` from values keyed by each leaf's path."""
  _, treedef = jax.tree_util.tree_flatten(TREE_SHAPES, is_leaf=lambda x: isinstance(x, tuple))
  return jax.tree_util.tree_unflatten(treedef, [values_by_path[p] for p, _ in PATHS_AND_SHAPES])


def _by_path(tree) -> dict:
  return {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _compute_real_dtype(dtype) -> np.dtype:
  """float64 for float64 and complex128 leaves, float32 for the rest."""
  real = np.finfo(np.dtype(dtype)).dtype
  return np.dtype(np.float64 if real.itemsize >= 8 else np.float32)


def _examples(count: int):
  """``count`` examples, not shrunk: each one compiles a step and runs it 100 times, so
  shrinking a failure would take many minutes; the failing example is printed whole.

  The ``x64`` fixture is meant to stay on across the examples of a test, so
  Hypothesis's warning about function-scoped fixtures does not apply.
  """
  return settings(max_examples=count, phases=(Phase.explicit, Phase.generate),
                  suppress_health_check=[HealthCheck.function_scoped_fixture])


# Strategies ---------------------------------------------------------------------------

ROLE = st.sampled_from([None, "row", "column", "batch", "none"])


def _roles(shape):
  """One role per axis (rows only with columns), or None for the heuristic on the leaf."""
  per_axis = st.tuples(*[ROLE] * len(shape)).filter(
      lambda roles: ("row" in roles) == ("column" in roles))
  return st.none() | per_axis


# Roles by full path: drawn independently for enc and dec, so the two same-shape
# "kernel"s (and "bias"es) usually get different roles. Guards against plans or roles
# keyed by the last name, and against a "none" axis being offered to the heuristic.
ROLES_BY_PATH = st.fixed_dictionaries({path: _roles(shape) for path, shape in PATHS_AND_SHAPES})
FACTOR_ROLES = st.none() | ROLES_BY_PATH


def _rules_from(roles_by_path):
  if roles_by_path is None:
    return None
  return lambda path, shape: roles_by_path[jax.tree_util.keystr(tuple(path))]


def _as_float(step):
  # The default float: float64 under x64. Schedules computed in float32 (optax's, given
  # an int32 count) round differently under jit (x / 20 as x * 0.05) than in the
  # reference's eager call, by one float32 ulp: far above the float64 tolerance.
  return jnp.asarray(step, float)


def _linear_decay(value):
  return lambda count: value * (1 - 0.9 * jnp.minimum(_as_float(count), 80) / 80)


def _halving(value):
  return lambda count: value * 0.5 ** (_as_float(count) / 25)


def _warmup(value):
  return lambda count: value * jnp.minimum(1.0, (_as_float(count) + 1) / 20)


SCHEDULES = {"linear_decay": _linear_decay, "halving": _halving, "warmup": _warmup}


@st.composite
def scalar_or_schedule(draw, low, high):
  """A number in ``[low, high]`` or one of SCHEDULES from it: guards against a schedule
  called with something other than the count (the local step of beta2, say)."""
  value = draw(st.floats(low, high))
  kind = draw(st.sampled_from(["number", *SCHEDULES]))
  return value if kind == "number" else SCHEDULES[kind](value)


# decay_rate_fn by name (the name shows in a failing example). Each but "constant"
# depends on the step, so calling it with the count instead of the local step (the
# decay offset ignored) changes beta2.
DECAY_RATE_FNS = {
    "constant": lambda step, rate: 0.9,
    "shifted_power": lambda step, rate: 1 - (_as_float(step) + 2) ** -rate,
    "rsqrt": lambda step, rate: 1 - jax.lax.rsqrt(_as_float(step) + 1),
    "ramp": lambda step, rate: jnp.minimum(_as_float(step) / 50, 0.99),
}

# The settings of the second moment that safefactor and scale_by_safe_factored_rms share.
SECOND_MOMENT = dict(
    decay_rate=st.floats(0.1, 2.0),
    # Negative, zero, within the run and past it (beta2 then stays at its first value).
    decay_offset=st.integers(-5, 130),
    # Up to and including 1, which must be accepted (it caps nothing).
    beta2_cap=st.sampled_from([None, 0.5, 0.9, 0.999, 1.0]),
    # 0: the floor is the smallest normal and dead slices' statistics sit on it.
    eps=st.sampled_from([0.0, 1e-30, 1e-10, 1e-3]),
    factored=st.booleans(),
    min_dim_size_to_factor=st.sampled_from([1, 2, 3, 4, 5, 6, 128]),
)

SAFEFACTOR = dict(
    SECOND_MOMENT,
    # None: the update is the unscaled direction, for a later transformation to scale.
    learning_rate=st.none() | scalar_or_schedule(1e-3, 0.1),
    # Thresholds other than 1 (a threshold multiplied instead of divided shows there), below
    # 1 too, as optax takes.
    clipping_threshold=st.sampled_from([None, 1.0, 0.5, 1.5, 10.0]),
    multiply_by_parameter_scale=st.booleans(),
    # A minimum of 0 lets zero params stay put; a minimum above the maximum: the maximum.
    min_parameter_scale=st.sampled_from([0.0, 1e-3, 0.1]),
    max_parameter_scale=st.sampled_from([None, 0.01, 1.0]),
    # 0: the first moment is the update itself.
    momentum=st.sampled_from([None, 0.0, 0.5, 0.9]),
    # bfloat16: the stored moment is rounded (not the step's update); None: the
    # param's dtype, complex for complex params.
    dtype_momentum=st.sampled_from(["float32", "bfloat16", "complex64", None,
                                    "at_least_float32"]),
    weight_decay_rate=st.none() | scalar_or_schedule(1e-3, 0.2),
    # On finite steps the guard must change nothing.
    skip_nonfinite_steps=st.booleans(),
    # bfloat16: the step reads its statistics as stored, rounded (float32's range: the drawn
    # scales fit); the reference rounds its own (float64 blends: a 1-ulp choice can differ).
    state_dtype=st.sampled_from([None, "float32", "bfloat16"]),
)


@st.composite
def weight_decay_masks(draw, allow_none=True):
  """``(mask as given to safefactor, mask per leaf path for the reference)``.

  Kinds: a boolean prefix tree (subtrees decided whole or leaf by leaf), a tree of
  boolean arrays (per element; an inverted array mask decays the wrong elements), and
  a callable of the tree returning either. Guards against masks read by last name,
  prefix masks expanded wrongly, and array masks applied inverted or not at all.
  """
  kinds = ["prefix", "arrays", "callable_prefix", "callable_arrays"]
  kind = draw(st.sampled_from(["none", *kinds] if allow_none else kinds))
  if kind == "none":
    return None, None
  if kind.endswith("arrays"):
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    per_leaf = {path: rng.random(shape) < 0.5 for path, shape in PATHS_AND_SHAPES}
    # One leaf decays whole, so bool leaves and array leaves mix in one tree.
    per_leaf["['norm']['scale']"] = draw(st.booleans())
    tree = _tree_of(per_leaf)
  else:
    prefix = {}
    for top, subtree in TREE_SHAPES.items():
      if draw(st.booleans()):
        prefix[top] = draw(st.booleans())
      else:
        prefix[top] = {name: draw(st.booleans()) for name in subtree}
    per_leaf = {}
    for path, _ in PATHS_AND_SHAPES:
      top, name = path[2:-2].split("']['")
      value = prefix[top]
      per_leaf[path] = value if isinstance(value, bool) else value[name]
    tree = prefix
  if kind.startswith("callable"):
    # Called with a tree like the params (under jit, of tracers): the answer may only
    # depend on the structure, which these do.
    return (lambda _: tree), per_leaf
  return tree, per_leaf


# Problems -----------------------------------------------------------------------------


class Problem:
  """Params and per-step gradients for one example, from a seed.

  Each leaf gets its own scale (10**-3 to 10**``max_log_scale``: at the default 10**5, a
  normaliser divided by the floor eps=1e-30 passes float32's largest number; float16
  gradients take 10**3, their largest value being 65504), up to two dead (zero) or faint
  (``FAINT``) slices along random axes, and a per-step factor; now and then a whole
  leaf's gradient is zero. Some params start at zero (the parameter scale's minimum).
  """

  def __init__(self, seed: int, dtypes: dict, max_log_scale: float = 5):
    self.rng = np.random.default_rng(seed)
    self.dtypes = dtypes
    self.scales, self.dead, self.faint = {}, {}, {}
    params = {}
    for path, shape in PATHS_AND_SHAPES:
      self.scales[path] = 10.0 ** self.rng.uniform(-3, max_log_scale)
      self.dead[path] = np.zeros(shape, bool)
      self.faint[path] = np.zeros(shape, bool)
      for _ in range(self.rng.integers(0, 3)):
        index = [slice(None)] * len(shape)
        axis = self.rng.integers(len(shape))
        index[axis] = self.rng.integers(shape[axis])
        kind = self.dead if self.rng.random() < 0.5 else self.faint
        kind[path][tuple(index)] = True
      param_scale = 0.0 if self.rng.random() < 0.15 else 10.0 ** self.rng.uniform(-3, 1)
      params[path] = self._normal(path, shape) * param_scale
    self.params = _tree_of({p: jnp.asarray(x, dtypes[p]) for p, x in params.items()})

  def _normal(self, path, shape):
    values = self.rng.normal(size=shape)
    if np.issubdtype(self.dtypes[path], np.complexfloating):
      values = values + 1j * self.rng.normal(size=shape)
    return values

  def grads(self):
    grads = {}
    for path, shape in PATHS_AND_SHAPES:
      factor = 0.0 if self.rng.random() < 0.03 else 10.0 ** self.rng.uniform(-0.5, 0.5)
      values = self._normal(path, shape)
      # Faint values get neither scale nor factor: their squares must stay far below
      # the smallest normal, where flushing subnormals to zero changes nothing.
      faint = values * FAINT[_compute_real_dtype(self.dtypes[path])]
      values = np.where(self.faint[path], faint, values * self.scales[path] * factor)
      values = np.where(self.dead[path], 0.0, values)
      grads[path] = jnp.asarray(values, self.dtypes[path])
    return _tree_of(grads)


def stored_momentum_dtype(dtype_momentum, param_dtype) -> np.dtype:
  """The dtype the first moment is kept in: the named one, or the param's for ``None``;
  a complex param keeps a complex moment whose parts are at least that wide, and a
  complex name means its parts' precision (complex64: float32 for a real param)."""
  if dtype_momentum is None:
    return np.dtype(param_dtype)
  if dtype_momentum == "at_least_float32":  # PyTorch's rule: the param's, widened
    return np.promote_types(param_dtype, np.float32)
  dtype = np.dtype(jnp.dtype(dtype_momentum))
  if np.issubdtype(dtype, np.complexfloating):
    dtype = np.dtype(np.float32 if dtype.itemsize == 8 else np.float64)
  if np.issubdtype(param_dtype, np.complexfloating):
    return np.dtype(np.complex128 if dtype.itemsize >= 8 else np.complex64)
  return dtype


def _inner(state):
  """The Adafactor state: inside the guard's, or first in a chain's."""
  if isinstance(state, osf.SkipNonfiniteState):
    state = state.inner_state
  return state[0] if type(state) is tuple else state


def _wide(x) -> np.ndarray:
  x = np.asarray(x)
  return x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)


def _adopt_rounding_of_narrow_momentum(reference, state, momentum_dtypes, compute_dtypes):
  """Check the stored first moment against the reference's; where it is kept narrower
  than it is computed (bfloat16 for float32 leaves), let the reference go on from the
  library's value.

  A blend that lies within the compute dtype's rounding of a bfloat16 rounding boundary
  can land on either neighbour, and one bfloat16 ulp would then stay in the moment for
  many steps; the two must differ by at most that one ulp.
  """
  stored = _by_path(_inner(state).momentum)
  for path, dtype in momentum_dtypes.items():
    actual = _wide(stored[path])
    assert np.dtype(stored[path].dtype) == dtype, (path, stored[path].dtype, dtype)
    if jnp.finfo(dtype).bits >= jnp.finfo(compute_dtypes[path]).bits:
      continue
    expected = reference.first[path]
    # One ulp of the stored dtype, plus what the updates it blends may differ by: their
    # tolerance, relative to the leaf's largest value (a faint element's update, whose
    # square float32 flushes, differs relatively more than the leaf's).
    ulp = (float(jnp.finfo(dtype).eps) * np.maximum(np.abs(actual), np.abs(expected))
           + _tolerance(reference, compute_dtypes[path]) * np.max(np.abs(expected))
           + _spacing(0, dtype))  # a float16 moment's subnormal spacing
    assert np.all(np.abs(actual - expected) <= ulp), path
    reference.first[path] = actual


def _tolerance(reference, compute_dtype) -> float:
  """The relative error allowed in a leaf's update: its compute dtype's, or, with
  statistics stored narrower, theirs."""
  tolerance = TOLERANCE[compute_dtype]
  stored = reference.statistics_dtype
  if stored is not None and jnp.finfo(stored).bits < jnp.finfo(compute_dtype).bits:
    tolerance = max(tolerance, STORED_STATISTICS_TOLERANCE[np.dtype(stored)])
  return tolerance


def _adopt_rounding_of_narrow_statistics(reference, state, compute_dtypes):
  """Check the stored statistics against the reference's, where they are kept narrower
  than they are computed (``state_dtype="bfloat16"``): in that dtype, within one ulp (a
  float32 blend and the reference's float64 one can round to neighbours); the reference
  then goes on from the library's values."""
  moments = jax.tree_util.tree_flatten_with_path(
      _inner(state).second_moment,
      is_leaf=lambda x: isinstance(x, (osf.FactoredMoment, osf.FullMoment)))[0]
  for path, moment in moments:
    path = jax.tree_util.keystr(path)
    pairs = ([(reference.row, moment.v_row), (reference.col, moment.v_col)]
             if isinstance(moment, osf.FactoredMoment) else [(reference.full, moment.v)])
    for kept, stored in pairs:
      assert stored.dtype == np.dtype(reference.statistics_dtype), (path, stored.dtype)
      if jnp.finfo(stored.dtype).bits >= jnp.finfo(compute_dtypes[path]).bits:
        continue  # stored as computed: nothing to adopt
      actual, expected = _wide(stored), kept[path]
      ulp = float(jnp.finfo(stored.dtype).eps) * np.maximum(np.abs(actual), np.abs(expected))
      assert actual.shape == expected.shape, (path, actual.shape, expected.shape)
      assert np.all(np.abs(actual - expected) <= ulp), path
      kept[path] = actual


def _poisoned_steps(tx_guarded: bool, seed: int, steps: int = STEPS) -> frozenset:
  """Up to 3 of the ``steps``, drawn from ``seed``, whose gradient a guarded run poisons."""
  if not tx_guarded:
    return frozenset()
  rng = np.random.default_rng(seed + 1)
  return frozenset(rng.choice(steps, size=rng.integers(0, 4), replace=False).tolist())


def _poison(grads, step: int):
  """``grads`` with one element of one leaf NaN, +Inf or -Inf (by ``step``)."""
  by_path = _by_path(grads)
  path = sorted(by_path)[step % len(by_path)]
  bad = (np.nan, np.inf, -np.inf)[step % 3]
  return _tree_of({p: g.reshape(-1).at[step % g.size].set(bad).reshape(g.shape) if p == path
                   else g for p, g in by_path.items()})


def run_against_reference(tx, reference, problem, *, sign=1.0, momentum_dtypes=None,
                          poisoned=frozenset(), update=None, steps=STEPS):
  """``steps`` jitted updates from ``problem``, each leaf checked against ``reference``.

  ``sign`` is -1 for scale_by_safe_factored_rms, whose update is the scaled gradient
  where the reference's is a step down it. At the ``poisoned`` steps one gradient element
  is non-finite: the guarded step must be skipped whole (zero updates, the state as it
  was but its counters) and the reference does not step, so every schedule, offset and
  moving average after it must go on as if the step had never come. ``update`` stands in
  for the jitted ``tx.update`` (one that checks more on each call).
  """
  params = problem.params
  state = tx.init(params)
  update = jax.jit(tx.update) if update is None else update
  compute_dtypes = {p: _compute_real_dtype(problem.dtypes[p]) for p, _ in PATHS_AND_SHAPES}
  for step in range(steps):
    grads = problem.grads()
    if step in poisoned:
      updates, skipped_state = update(_poison(grads, step), state, params)
      assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates)), step
      before, after = jax.tree.leaves(state.inner_state), jax.tree.leaves(
          skipped_state.inner_state)
      assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(before, after,
                                                                      strict=True)), step
      state = skipped_state
      continue
    updates, state = update(grads, state, params)
    expected = reference.step({p: np.asarray(g) for p, g in _by_path(grads).items()},
                              {p: np.asarray(x) for p, x in _by_path(params).items()})
    for path, actual in _by_path(updates).items():
      assert actual.dtype == problem.dtypes[path], (path, actual.dtype)
      want = sign * expected[path]
      scale = max(float(np.max(np.abs(want))), np.finfo(np.float64).tiny)
      error = float(np.max(np.abs(_wide(actual) - want))) / scale
      assert error <= _tolerance(reference, compute_dtypes[path]), (step, path, error)
    if momentum_dtypes:
      _adopt_rounding_of_narrow_momentum(reference, state, momentum_dtypes, compute_dtypes)
    if reference.statistics_dtype is not None:
      _adopt_rounding_of_narrow_statistics(reference, state, compute_dtypes)
    params = optax.apply_updates(params, updates)
  if isinstance(state, osf.SkipNonfiniteState):
    assert int(osf.skipped_steps(state)) == len(poisoned)


def _reference_for(config, problem, roles_by_path, decay_masks=None):
  """The reference for a safefactor ``config`` (its keyword arguments) on ``problem``."""
  names = ("learning_rate", "decay_rate", "decay_offset", "multiply_by_parameter_scale",
           "clipping_threshold", "momentum", "weight_decay_rate", "eps",
           "min_parameter_scale", "max_parameter_scale", "beta2_cap")
  statistics_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}.get(
      config.get("state_dtype"))
  reference = ReferenceAdafactor(**{name: config[name] for name in names},
                                 weight_decay_mask=decay_masks, statistics_dtype=statistics_dtype)
  momentum_dtypes = {}
  for path, shape in PATHS_AND_SHAPES:
    roles = None if roles_by_path is None else roles_by_path[path]
    plan = reference_plan_from_roles(shape, roles, config["factored"],
                                     config["min_dim_size_to_factor"])
    reference.init(path, shape, plan, dtype=problem.dtypes[path])
    if config["momentum"] is not None:
      momentum_dtypes[path] = stored_momentum_dtype(config["dtype_momentum"],
                                                    problem.dtypes[path])
  reference.momentum_dtype = momentum_dtypes
  return reference, momentum_dtypes


def _dtypes(kinds, choice):
  """Each leaf's dtype: all of one kind, or alternating through ``kinds``."""
  if choice == "mixed":
    return {path: np.dtype(kinds[i % len(kinds)]) for i, (path, _) in enumerate(PATHS_AND_SHAPES)}
  return {path: np.dtype(choice) for path, _ in PATHS_AND_SHAPES}


def _check_safefactor(config, roles_by_path, masks, dtypes, seed):
  mask, decay_masks = masks
  problem = Problem(seed, dtypes)
  with warnings.catch_warnings():
    # The draws include settings that others leave without effect (a mask without a decay,
    # a minimum scale above the maximum, a decay whose mask is False for every param: the
    # last warns in init): they warn, and the reference follows them too.
    warnings.filterwarnings("ignore", ".* has no effect", UserWarning)
    tx = osf.safefactor(**config, weight_decay_mask=mask,
                        factor_rules=_rules_from(roles_by_path))
    reference, momentum_dtypes = _reference_for(config, problem, roles_by_path, decay_masks)
    run_against_reference(tx, reference, problem, momentum_dtypes=momentum_dtypes,
                          poisoned=_poisoned_steps(config["skip_nonfinite_steps"], seed))


# Tests --------------------------------------------------------------------------------


@_examples(15)
@given(config=st.fixed_dictionaries(SAFEFACTOR), roles_by_path=FACTOR_ROLES,
       masks=weight_decay_masks(), dtype=st.sampled_from(["float32", "complex64", "mixed"]),
       seed=st.integers(0, 2**16))
def test_safefactor_float32_and_complex64_follow_the_reference(
    config, roles_by_path, masks, dtype, seed):
  """Every setting at once on float32 and complex64 leaves (mixed in one tree too).

  Guards against any setting ignored or misread (schedules, offsets, caps, bounds,
  momentum storage, masks, roles by path, the "none" role), against the cap on the
  factored scale missing or wrong where the estimate underflows (eps=0 with dead and
  faint slices), and against complex leaves getting statistics of anything but |g|**2.
  """
  _check_safefactor(config, roles_by_path, masks,
                    _dtypes(["float32", "complex64"], dtype), seed)


@_examples(12)
@given(config=st.fixed_dictionaries(SAFEFACTOR), roles_by_path=FACTOR_ROLES,
       masks=weight_decay_masks(),
       dtype=st.sampled_from(["float64", "complex128", "mixed"]),
       seed=st.integers(0, 2**16))
def test_safefactor_float64_and_complex128_follow_the_reference(
    x64, config, roles_by_path, masks, dtype, seed):
  """The same on float64 and complex128 leaves (mixed with float32 ones), to 1e-10.

  Guards against a wide leaf computed in a narrower dtype anywhere (complex128 in
  complex64, beta2 or a floor in float32): float32 rounding is 1e-7, far above the
  tolerance; and against float64's own floor and cap, below float32's range.
  """
  _check_safefactor(config, roles_by_path, masks,
                    _dtypes(["float64", "complex128", "float32"], dtype), seed)


@_examples(15)
@given(config=st.fixed_dictionaries({**SAFEFACTOR, "min_dim_size_to_factor": st.integers(1, 5)}),
       roles_by_path=ROLES_BY_PATH, dtype=st.sampled_from(["float32", "complex64", "mixed"]),
       seed=st.integers(0, 2**16))
def test_factor_rules_by_path_follow_the_reference(config, roles_by_path, dtype, seed):
  """Roles for every leaf by its full path, and a size threshold the heuristic can meet.

  Guards against plans or roles keyed by the leaf's last name (enc's and dec's kernels,
  and biases, have the same shapes and usually different roles), a "none" axis offered
  to the heuristic like an open one, explicit rows and columns overridden by
  ``factored=False`` or the threshold, and batch axes that do not separate clipping and
  the parameter scale per slice.
  """
  _check_safefactor(config, roles_by_path, (None, None),
                    _dtypes(["float32", "complex64"], dtype), seed)


@_examples(12)
@given(config=st.fixed_dictionaries(
           {**SAFEFACTOR, "weight_decay_rate": scalar_or_schedule(1e-3, 0.2)}),
       masks=weight_decay_masks(allow_none=False),
       dtype=st.sampled_from(["float32", "complex64"]), seed=st.integers(0, 2**16))
def test_weight_decay_masks_follow_the_reference(config, masks, dtype, seed):
  """Weight decay always on, with each kind of mask: prefix trees, per-element arrays
  and callables. Guards against an array mask inverted or ignored, a prefix mask
  expanded to the wrong leaves, and masks matched by the leaf's last name."""
  _check_safefactor(config, None, masks, _dtypes([], dtype), seed)


@_examples(15)
@given(config=st.fixed_dictionaries(SECOND_MOMENT),
       decay_rate_fn=st.sampled_from([None, *DECAY_RATE_FNS]), roles_by_path=FACTOR_ROLES,
       skip_nonfinite_steps=st.booleans(), dtype=st.sampled_from(["float32", "complex64"]),
       seed=st.integers(0, 2**16))
def test_scale_by_safe_factored_rms_follows_the_reference(
    config, decay_rate_fn, roles_by_path, skip_nonfinite_steps, dtype, seed):
  """The building block with its own ``decay_rate_fn``, ``step_offset`` and ``epsilon``.

  Guards against ``decay_rate_fn`` called with the count instead of the local step
  (the offset ignored), the cap on beta2 skipped for a ``decay_rate_fn``, and the
  second moment's settings lost under their renamed arguments.
  """
  problem = Problem(seed, _dtypes([], dtype))
  with warnings.catch_warnings():
    # A size threshold drawn with factored=False warns that it has no effect; the
    # reference follows it too.
    warnings.filterwarnings("ignore", ".* has no effect", UserWarning)
    tx = osf.scale_by_safe_factored_rms(
        factored=config["factored"], decay_rate=config["decay_rate"],
        step_offset=config["decay_offset"],
        min_dim_size_to_factor=config["min_dim_size_to_factor"], epsilon=config["eps"],
        decay_rate_fn=None if decay_rate_fn is None else DECAY_RATE_FNS[decay_rate_fn],
        beta2_cap=config["beta2_cap"], factor_rules=_rules_from(roles_by_path),
        skip_nonfinite_steps=skip_nonfinite_steps)
  reference = ReferenceAdafactor(
      decay_rate=config["decay_rate"], decay_offset=config["decay_offset"],
      eps=config["eps"], beta2_cap=config["beta2_cap"],
      decay_rate_fn=None if decay_rate_fn is None else DECAY_RATE_FNS[decay_rate_fn],
      multiply_by_parameter_scale=False, clipping_threshold=None)
  for path, shape in PATHS_AND_SHAPES:
    roles = None if roles_by_path is None else roles_by_path[path]
    reference.init(path, shape, reference_plan_from_roles(
        shape, roles, config["factored"], config["min_dim_size_to_factor"]),
        dtype=problem.dtypes[path])
  run_against_reference(tx, reference, problem, sign=-1.0,
                        poisoned=_poisoned_steps(skip_nonfinite_steps, seed))


@pytest.mark.parametrize("roles", [("none", None), (None, "none")])
def test_a_none_role_keeps_its_axis_out_of_the_heuristic(roles):
  """A "none" axis is not offered to the heuristic: the one open axis of a (6, 5) leaf
  cannot be factored on its own, so the leaf keeps a full statistic. Guards against
  "none" read like None (the leaf would be factored over both axes)."""
  tx = osf.safefactor(0.1, min_dim_size_to_factor=1, factor_rules=lambda path, shape: roles)
  state = tx.init({"w": jnp.ones((6, 5))})
  assert isinstance(state.inner_state.second_moment["w"], osf.FullMoment)


@pytest.mark.parametrize("faint_axis", [1, 0])
@pytest.mark.parametrize("eps,large,faint", [(1e-30, 1e5, 1e-16), (0.0, 3.0, 1e-20)])
def test_faint_columns_next_to_large_gradients_follow_the_reference(eps, large, faint,
                                                                    faint_axis):
  """Columns (or rows) of faint gradients, their statistic on the floor, next to large ones.

  Guards against a factor computed as ``sqrt(normaliser / statistic)``: the quotient
  overflowed float32 once the normaliser passed ``max / floor`` (3.4e8 with eps=1e-30,
  4 with eps=0), and the cap then stood in for a scale it should not have bounded:
  with eps=1e-30 and gradients around 1e5 the faint columns' updates were 4,000 times
  the reference's, with eps=0 and gradients around 3, up to twice. Either statistic may
  carry the normaliser's root, so both orientations are tried.
  """
  rng = np.random.default_rng(0)
  shape = (6, 5)
  # Lines of different scales, so that some statistics exceed the normaliser.
  scales = np.array([1.0, 3.0, 0.3, 2.0, 0.5, 4.0])
  if faint_axis == 1:
    grads = rng.normal(size=shape) * large * scales[:, None]
    grads[:, 2] = rng.normal(size=shape[0]) * faint
  else:
    grads = rng.normal(size=shape) * large * scales[None, :5]
    grads[2, :] = rng.normal(size=shape[1]) * faint
  tx = osf.scale_by_safe_factored_rms(min_dim_size_to_factor=2, epsilon=eps)
  params = {"w": jnp.zeros(shape)}
  reference = ReferenceAdafactor(eps=eps, multiply_by_parameter_scale=False,
                                 clipping_threshold=None)
  reference.init("w", shape, reference_plan_from_roles(shape, None, True, 2))
  state = tx.init(params)
  for step in range(3):
    step_grads = {"w": jnp.asarray(grads * (step + 1.0), jnp.float32)}
    updates, state = tx.update(step_grads, state, params)
    expected = -reference.step({"w": np.asarray(step_grads["w"])}, params)["w"]
    error = np.max(np.abs(np.asarray(updates["w"], np.float64) - expected))
    assert error <= 2e-5 * np.max(np.abs(expected)), (step, error)


# Narrow params: the write-back of each rounding mode ----------------------------------

ROUNDING_MODES = ("nearest", "stochastic", "kahan")
# Steps of a run with narrow params: Kahan's compensation is followed over all of them.
NARROW_STEPS = 30
# A float32 sum's relative rounding (the write-back adds param, update and compensation
# in float32, once or twice).
FLOAT32_SUM = 2.0**-23


def _is_narrow(dtype) -> bool:
  """bfloat16 and float16: the params that the rounding modes write back to."""
  return np.dtype(dtype).itemsize == 2


def _spacing(x, dtype) -> np.ndarray:
  """The spacing of ``dtype``'s values at ``|x|`` (the larger one at a power of two), never
  below the finest that XLA keeps: float16's subnormal spacing, bfloat16's smallest normal
  (XLA computes bfloat16 in float32 and flushes its subnormals)."""
  info = jnp.finfo(dtype)
  floor = float(info.smallest_subnormal if info.maxexp < jnp.finfo(jnp.float32).maxexp
                else info.smallest_normal)
  x = np.maximum(np.abs(np.asarray(x, np.float64)), floor)
  return np.maximum(2.0 ** (np.floor(np.log2(x)) - info.nmant), floor)


def _next_value(values: np.ndarray, direction: int) -> np.ndarray:
  """The neighbour of each 16-bit float of ``values`` towards +Inf (1) or -Inf (-1), as
  float64: one step of the magnitude's bit pattern, away from or towards zero."""
  bits = values.view(np.uint16).astype(np.int32)
  sign, magnitude = bits & 0x8000, bits & 0x7FFF
  away = np.where(sign != 0, -1, 1) == direction
  moved = np.where(magnitude == 0, 0x0001 | (0x8000 if direction < 0 else 0),
                   sign | np.where(away, magnitude + 1, magnitude - 1))
  return moved.astype(np.uint16).view(values.dtype).astype(np.float64)


def _neighbours(x, dtype) -> tuple[np.ndarray, np.ndarray]:
  """The largest value of ``dtype`` at most ``x`` and the smallest at least ``x`` (both
  ``x`` where ``dtype`` holds it), in float64."""
  x = np.asarray(x, np.float64)
  nearest = x.astype(dtype)
  wide = nearest.astype(np.float64)
  return (np.where(wide > x, _next_value(nearest, -1), wide),
          np.where(wide < x, _next_value(nearest, 1), wide))


def _lands_exactly(param, low, high) -> np.ndarray:
  """Where ``optax.apply_updates`` lands ``param`` exactly on any target between ``low``
  and ``high`` (values of the param's dtype): its difference from the param is
  representable (Sterbenz: the same sign, within half the param), or the param is zero."""
  return (param == 0) | ((low * param >= 0) & (high * param >= 0)
                         & (np.maximum(np.abs(low - param), np.abs(high - param))
                            <= np.abs(param) / 2))


class LandingChecks:
  """What each ``param_rounding`` mode promises a narrow param, step by step, against the
  float64 update ``exact`` of the reference (``slack``: the error allowed to the float32
  computation of it, per element).

  * ``"nearest"``: the update is the exact one rounded to nearest in the param's dtype,
    and ``optax.apply_updates`` lands within one ulp of ``param + exact``.
  * ``"stochastic"``: the param lands on one of the two values bracketing ``param +
    exact`` (within an ulp of the larger of param and target where the difference is not
    representable), away from zero as often as the fraction of the ulp says: over a run,
    the landings away from zero of the negative and positive elements whose fraction is
    below and above one half are each within 5 standard deviations of the sum of the
    fractions.
  * ``"kahan"``: the param lands on ``param + compensation + exact`` rounded to nearest
    (within an ulp of the larger value, where not representable) and the new compensation
    holds what that missed, up to its own rounding, so that ``param + compensation``
    tracks the float64 sum of the updates from the first param over the whole run.
  """

  def __init__(self, mode: str, params_by_path: dict):
    self.mode = mode
    self.fractions: list[np.ndarray] = []
    self.went_up: list[np.ndarray] = []
    self.negative: list[np.ndarray] = []
    # How far the float32 fraction may be from the float64 one, per judged element.
    self.uncertain: list[np.ndarray] = []
    self.tracked = {path: _wide(x) for path, x in params_by_path.items()}
    self.drift = {path: 0.0 for path in params_by_path}

  def step(self, path, dtype, param, update, landed, exact, slack, compensation=None,
           new_compensation=None):
    """One leaf's step: ``param`` before, the ``update`` returned, the param ``landed``
    after ``optax.apply_updates``, all float64; the compensation before and after."""
    where = (path, self.mode)
    if self.mode == "nearest":
      allowed = _spacing(np.abs(exact) + slack, dtype) / 2 + slack
      assert np.all(np.abs(update - exact) <= allowed), where
      near = np.abs(param) + 2 * (np.abs(exact) + slack)
      assert np.all(np.abs(landed - (param + exact)) <= _spacing(near, dtype) + slack), where
      return
    if self.mode == "stochastic":
      target = param + exact
      slack = slack + FLOAT32_SUM * np.abs(target)
      low, high = _neighbours(target - slack, dtype)[0], _neighbours(target + slack, dtype)[1]
      exactly = _lands_exactly(param, low, high)
      miss = np.where(exactly, 0.0, _spacing(np.maximum.reduce(
          [np.abs(param), np.abs(low), np.abs(high)]), dtype))
      assert np.all((landed >= low - miss) & (landed <= high + miss)), where
      # Rounded on the magnitude: down toward zero, up away from it.
      below, above = _neighbours(np.abs(target), dtype)
      gap = above - below
      fraction = np.divide(np.abs(target) - below, gap, out=np.zeros_like(gap), where=gap > 0)
      # Elements whose float32 value may round differently (near a value of the grid) or
      # may land off the target say nothing of the probability.
      judged = exactly & (slack < 0.01 * gap) & (fraction > 0.02) & (fraction < 0.98)
      magnitude = np.abs(landed[judged])
      assert np.all((magnitude == below[judged]) | (magnitude == above[judged])), where
      self.fractions.append(fraction[judged])
      self.uncertain.append(slack[judged] / gap[judged])
      self.went_up.append(magnitude == above[judged])
      self.negative.append(target[judged] < 0)
      return
    self.tracked[path] = self.tracked[path] + exact
    # Where there is nothing to add, nothing lands and the compensation stays as it was.
    still = exact == 0
    assert np.all(landed[still] == param[still]), where
    assert np.all(new_compensation[still] == compensation[still]), where
    target = param + compensation + exact
    slack = slack + FLOAT32_SUM * (np.abs(param) + np.abs(compensation) + np.abs(exact))
    low, high = _neighbours(target - slack, dtype)[0], _neighbours(target + slack, dtype)[1]
    nearest = _spacing(np.abs(target) + slack, dtype) / 2
    # Off the target: half an ulp to the target, and the landing's ulp of the larger.
    off = 2.5 * _spacing(np.maximum(np.abs(param), np.abs(target) + slack), dtype)
    allowed = np.where(_lands_exactly(param, low, high), nearest, off) + slack
    assert np.all((np.abs(landed - target) <= allowed) | still), where
    remainder = target - landed
    carried = slack + _spacing(new_compensation, dtype) + FLOAT32_SUM * np.abs(remainder)
    assert np.all(np.abs(new_compensation - remainder) <= carried), where
    self.drift[path] = self.drift[path] + carried
    assert np.all(np.abs(landed + new_compensation - self.tracked[path])
                  <= self.drift[path]), where

  def finish(self):
    """Stochastic rounding: the landings' frequency of going up against the fractions."""
    if self.mode != "stochastic" or not self.fractions:
      return
    fraction, went_up = np.concatenate(self.fractions), np.concatenate(self.went_up)
    negative, uncertain = np.concatenate(self.negative), np.concatenate(self.uncertain)
    # Each sign and half apart: a bias one way in one of them may be undone in another.
    for sign, half in itertools.product((negative, ~negative), (fraction < 0.5, fraction >= 0.5)):
      group = sign & half
      variance = float(np.sum(fraction[group] * (1 - fraction[group])))
      if variance < 10:
        continue  # too few elements to judge
      off = abs(float(np.sum(went_up[group])) - float(np.sum(fraction[group])))
      assert off <= 5 * np.sqrt(variance) + float(np.sum(uncertain[group])), (
          off, np.sqrt(variance), int(np.sum(group)))


def run_narrow_against_reference(tx, reference_step, problem, mode, *, compensation, kept,
                                 tolerance, adopt=None, poisoned=frozenset()):
  """``NARROW_STEPS`` jitted updates from ``problem``: wide leaves against
  ``reference_step``'s update as :func:`run_against_reference` compares them, narrow ones
  (bfloat16, float16) by what ``mode`` promises (:class:`LandingChecks`), from the same
  params and gradients.

  ``compensation(state)`` is the tree of Kahan's compensations (``None`` elsewhere);
  ``kept(state)`` the part of the state that a skipped step (at the ``poisoned`` steps)
  leaves as it was; ``adopt(state)`` lets the reference go on from what the state keeps
  narrower than it computes; ``tolerance(path)`` is a leaf's relative error.
  """
  params = problem.params
  state = tx.init(params)
  update = jax.jit(tx.update)
  checks = LandingChecks(mode, {p: x for p, x in _by_path(params).items()
                                if _is_narrow(problem.dtypes[p])})
  for step in range(NARROW_STEPS):
    grads = problem.grads()
    if step in poisoned:
      updates, skipped_state = update(_poison(grads, step), state, params)
      assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates)), step
      assert_trees_bitwise_equal(kept(skipped_state), kept(state))
      state = skipped_state
      continue
    updates, new_state = update(grads, state, params)
    expected = reference_step({p: np.asarray(g) for p, g in _by_path(grads).items()},
                              {p: np.asarray(x) for p, x in _by_path(params).items()})
    new_params = optax.apply_updates(params, updates)
    before, after = _by_path(params), _by_path(new_params)
    compensations, new_compensations = (_by_path(compensation(state)),
                                        _by_path(compensation(new_state)))
    for path, actual in _by_path(updates).items():
      dtype = problem.dtypes[path]
      assert actual.dtype == dtype, (path, actual.dtype)
      want = expected[path]
      scale = max(float(np.max(np.abs(want))), np.finfo(np.float64).tiny)
      if not _is_narrow(dtype):
        error = float(np.max(np.abs(_wide(actual) - want))) / scale
        assert error <= tolerance(path), (step, path, error)
        continue
      if mode == "kahan":
        assert compensations[path].dtype == dtype, (path, compensations[path].dtype)
      checks.step(path, dtype, _wide(before[path]), _wide(actual), _wide(after[path]), want,
                  tolerance(path) * scale,
                  *([_wide(compensations[path]), _wide(new_compensations[path])]
                    if mode == "kahan" else []))
    if adopt is not None:
      adopt(new_state)
    params, state = new_params, new_state
  checks.finish()


def _narrow_dtypes(choice):
  return _dtypes(["bfloat16", "float16", "float32"], choice)


@pytest.mark.parametrize("mode", ROUNDING_MODES)
@_examples(4)
@given(config=st.fixed_dictionaries(
           {**SAFEFACTOR, "learning_rate": scalar_or_schedule(1e-3, 0.1)}),
       roles_by_path=FACTOR_ROLES, masks=weight_decay_masks(),
       dtype=st.sampled_from(["bfloat16", "float16", "mixed"]),
       rounding_seed=st.integers(-(2**31), 2**31 - 1), seed=st.integers(0, 2**16))
def test_narrow_params_land_as_their_rounding_mode_promises(
    mode, config, roles_by_path, masks, dtype, rounding_seed, seed):
  """bfloat16 and float16 params (mixed with float32 ones) with every setting drawn, each
  step's landing checked against the float64 reference's update by what ``mode`` promises
  (:class:`LandingChecks`); float32 leaves follow the reference as they do alone.

  Guards against a mode wired to another's write-back (round to nearest for stochastic
  rounding: no small update lands; stochastic where nearest is asked for), a landing off
  its target, stochastic rounding biased (rounding up with the wrong probability), a Kahan
  compensation dropped, not added to the next update or holding the wrong remainder, and
  a narrow param's update computed from anything but the float32 update of the step (its
  momentum, statistics, parameter scale and weight decay drawn).
  """
  mask, decay_masks = masks
  problem = Problem(seed, _narrow_dtypes(dtype), max_log_scale=3)
  with warnings.catch_warnings():
    # A seed of a mode that draws no bits, and the settings others leave without effect.
    warnings.filterwarnings("ignore", ".* has no effect", UserWarning)
    tx = osf.safefactor(**config, weight_decay_mask=mask, param_rounding=mode,
                        rounding_seed=rounding_seed, factor_rules=_rules_from(roles_by_path))
    reference, momentum_dtypes = _reference_for(config, problem, roles_by_path, decay_masks)
    compute_dtypes = dict.fromkeys(problem.dtypes, np.dtype(np.float32))

    def adopt(state):
      _adopt_rounding_of_narrow_momentum(reference, state, momentum_dtypes, compute_dtypes)
      if reference.statistics_dtype is not None:
        _adopt_rounding_of_narrow_statistics(reference, state, compute_dtypes)

    run_narrow_against_reference(
        tx, reference.step, problem, mode, compensation=lambda state: _inner(state).compensation,
        kept=_inner, adopt=adopt,
        poisoned=_poisoned_steps(config["skip_nonfinite_steps"], seed, NARROW_STEPS),
        tolerance=lambda path: _tolerance(reference, np.dtype(np.float32)))


# Checked mode ---------------------------------------------------------------------------

# Steps of a checked run: each one is stepped twice, checked and unchecked.
CHECKED_STEPS = 40


def _checked_and_unchecked(checked_tx, unchecked_tx):
  """An ``update`` that steps ``checked_tx`` under ``checkify.checkify`` and ``unchecked_tx``
  alone, from the same state, and returns the checked step's results once both agree bit
  for bit (updates and the whole state, counters included). The checked step must raise
  exactly on a step whose gradients are not finite, naming the (one) poisoned leaf's path
  and the guard's step (``skip_nonfinite`` around a chain charged the chain's Adafactor
  statistics to every leaf, and named the first)."""
  checked = jax.jit(checkify.checkify(checked_tx.update))
  unchecked = jax.jit(unchecked_tx.update)

  def update(grads, state, params):
    error, (updates, new_state) = checked(grads, state, params)
    assert_trees_bitwise_equal((updates, new_state), unchecked(grads, state, params))
    message = error.get()
    poisoned = [path for path, grad in _by_path(grads).items()
                if not np.all(np.isfinite(np.asarray(grad)))]
    if not poisoned:
      assert message is None, message
    else:
      assert message is not None, poisoned
      assert message.startswith(f"params{poisoned[0]}: non-finite gradient"), message
      assert f" at step {int(state.step)};" in message, (int(state.step), message)
    return updates, new_state

  return update


@_examples(5)
@given(config=st.fixed_dictionaries({**SAFEFACTOR, "skip_nonfinite_steps": st.just(True)}),
       guard=st.sampled_from(["safefactor", "skip_nonfinite"]),
       learning_rate=st.floats(1e-3, 0.1), dtype=st.sampled_from(["float32", "complex64"]),
       seed=st.integers(0, 2**16))
def test_checked_mode_steps_as_unchecked_and_raises_on_the_poisoned_steps(
    config, guard, learning_rate, dtype, seed):
  """``checked=True`` under ``checkify``, for safefactor with every setting drawn and for
  ``skip_nonfinite`` around a chain: the same updates and state as ``checked=False`` bit
  for bit, the float64 reference's updates, and a raise on each poisoned step (at least
  one per run) naming its leaf and step, and on no other.

  Guards against ``checked`` ignored (no raise), a check of the wrong flag (a raise on a
  healthy step, or naming another leaf), a step number off by one, and a checked step that
  computes, skips or counts anything unlike the unchecked one.
  """
  problem = Problem(seed, _dtypes([], dtype))
  poisoned = _poisoned_steps(True, seed, CHECKED_STEPS) or frozenset({seed % CHECKED_STEPS})
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", ".* has no effect", UserWarning)
    if guard == "safefactor":
      build = functools.partial(osf.safefactor, **config)
      reference, momentum_dtypes = _reference_for(config, problem, None)
    else:
      def build(checked):
        return osf.skip_nonfinite(optax.chain(
            osf.scale_by_safe_factored_rms(
                config["factored"], config["decay_rate"], config["decay_offset"],
                config["min_dim_size_to_factor"], config["eps"],
                beta2_cap=config["beta2_cap"], state_dtype=config["state_dtype"]),
            optax.scale(-learning_rate)), checked=checked)
      reference, _ = _reference_for({**config, "learning_rate": learning_rate,
                                     "multiply_by_parameter_scale": False,
                                     "clipping_threshold": None, "momentum": None,
                                     "weight_decay_rate": None}, problem, None)
      momentum_dtypes = {}
    run_against_reference(
        build(checked=True), reference, problem, momentum_dtypes=momentum_dtypes,
        poisoned=poisoned, steps=CHECKED_STEPS,
        update=_checked_and_unchecked(build(checked=True), build(checked=False)))


# The wrappers -----------------------------------------------------------------------------


class ReferenceSgd:
  """``optax.sgd`` (after ``optax.add_decayed_weights``) in float64: ``g + weight_decay * p``
  into a trace ``t = g + momentum * t``, whose step is ``t`` (Nesterov: ``g + momentum *
  t``) times ``-learning_rate`` (a number, or a schedule of the count)."""

  def __init__(self, learning_rate, momentum=None, nesterov=False, weight_decay=None):
    self.learning_rate, self.momentum, self.nesterov = learning_rate, momentum, nesterov
    self.weight_decay = weight_decay
    self.trace: dict = {}
    self.count = 0

  def step(self, grads: dict, params: dict) -> dict:
    learning_rate = self.learning_rate
    if callable(learning_rate):
      learning_rate = float(learning_rate(self.count))
    updates = {}
    for name, grad in grads.items():
      g = np.asarray(grad, np.float64)
      if self.weight_decay is not None:
        g = g + self.weight_decay * np.asarray(params[name], np.float64)
      if self.momentum is not None:
        self.trace[name] = g + self.momentum * self.trace.get(name, 0.0)
        g = g + self.momentum * self.trace[name] if self.nesterov else self.trace[name]
      updates[name] = -learning_rate * g
    self.count += 1
    return updates


SGD = dict(
    learning_rate=scalar_or_schedule(1e-3, 0.1),
    momentum=st.sampled_from([None, 0.0, 0.5, 0.9]),
    nesterov=st.booleans(),
    weight_decay=st.sampled_from([None, 1e-3, 0.1]),
)


def _sgd(learning_rate, momentum, nesterov, weight_decay):
  sgd = optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov)
  return sgd if weight_decay is None else optax.chain(optax.add_decayed_weights(weight_decay),
                                                      sgd)


@pytest.mark.parametrize("mode", ROUNDING_MODES)
@_examples(3)
@given(inner=st.sampled_from(["sgd", "safefactor"]), sgd=st.fixed_dictionaries(SGD),
       config=st.fixed_dictionaries({**SAFEFACTOR, "skip_nonfinite_steps": st.just(True)}),
       dtype=st.sampled_from(["bfloat16", "float16", "mixed"]),
       rounding_seed=st.integers(-(2**31), 2**31 - 1), seed=st.integers(0, 2**16))
def test_with_param_rounding_lands_the_inner_update_as_its_mode_promises(
    mode, inner, sgd, config, dtype, rounding_seed, seed):
  """``with_param_rounding`` around ``optax.sgd`` (momentum, Nesterov, weight decay, a
  schedule: against its float64 formula, :class:`ReferenceSgd`) or around safefactor with
  every setting drawn (against the float64 reference, with up to 3 poisoned steps, at
  least one, that its guard skips): each narrow param lands as ``mode`` promises
  (:class:`LandingChecks`), each float32 param gets the inner update as it is.

  Guards against the inner transformation fed anything but float32 copies of the narrow
  gradients and params (its weight decay and parameter scale read them), its float32
  update rounded before the write-back, a mode wired to another's write-back, biased
  stochastic rounding, a compensation dropped or not carried, and a step the inner guard
  skipped that lands something, draws bits or moves the compensation.
  """
  problem = Problem(seed, _narrow_dtypes(dtype), max_log_scale=3)
  # The inner transformation sees float32 copies of the narrow params.
  wide = types.SimpleNamespace(dtypes=dict.fromkeys(problem.dtypes, np.dtype(np.float32)))
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", ".* has no effect", UserWarning)
    if inner == "sgd":
      tx = osf.with_param_rounding(_sgd(**sgd), mode, seed=rounding_seed)
      reference, tolerance = ReferenceSgd(**sgd), TOLERANCE[np.dtype(np.float32)]
      adopt, poisoned = None, frozenset()
    else:
      tx = osf.with_param_rounding(osf.safefactor(**config), mode, seed=rounding_seed)
      reference, momentum_dtypes = _reference_for(config, wide, None)
      tolerance = _tolerance(reference, np.dtype(np.float32))

      def adopt(state):
        _adopt_rounding_of_narrow_momentum(reference, state.inner_state, momentum_dtypes,
                                           wide.dtypes)
        if reference.statistics_dtype is not None:
          _adopt_rounding_of_narrow_statistics(reference, state.inner_state, wide.dtypes)

      # At least one step that the inner guard skips.
      poisoned = (_poisoned_steps(True, seed, NARROW_STEPS)
                  or frozenset({seed % NARROW_STEPS}))
    run_narrow_against_reference(
        tx, reference.step, problem, mode, compensation=lambda state: state.compensation,
        kept=lambda state: (state.count, state.compensation, _inner(state.inner_state)),
        adopt=adopt, poisoned=poisoned, tolerance=lambda path: tolerance)


# Micro-batches an accumulation run calls update with.
MICRO_BATCHES = 32


def _alternating_group_size(applied_steps):
  """An ``every_k`` schedule of the applied steps: groups of 1, 2, 3, 1, 2, 3..."""
  return 1 + applied_steps % 3


@_examples(8)
@given(inner=st.sampled_from(["sgd", "safefactor"]), sgd=st.fixed_dictionaries(SGD),
       config=st.fixed_dictionaries(SAFEFACTOR), every_k=st.sampled_from(["schedule", 2, 3, 4, 1]),
       seed=st.integers(0, 2**16))
def test_accumulate_gradients_steps_the_inner_on_the_mean_of_each_group(
    inner, sgd, config, every_k, seed):
  """``accumulate_gradients`` around ``optax.sgd`` (:class:`ReferenceSgd`) or safefactor with
  every setting drawn (the float64 reference), ``every_k`` an int or a schedule of the
  applied steps, and up to 3 poisoned micro-batches: the micro-batch that completes a group
  of ``every_k`` finite ones returns the reference's update on the float64 mean of the
  group; every other one returns zeros and leaves the inner state as it was, bit for bit.

  Guards against a sum not divided by the group's size (or by one that counts a left-out
  micro-batch), a group that a poisoned micro-batch completes or joins, a group that starts
  from the last one's sum, a schedule called with anything but the applied steps, and an
  inner state that moves between steps.
  """
  problem = Problem(seed, _dtypes([], "float32"))
  every_k = _alternating_group_size if every_k == "schedule" else every_k
  rng = np.random.default_rng(seed + 1)
  poisoned = frozenset(rng.choice(MICRO_BATCHES, size=rng.integers(0, 4),
                                  replace=False).tolist())
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", ".* has no effect", UserWarning)
    if inner == "sgd":
      inner_tx, reference = _sgd(**sgd), ReferenceSgd(**sgd)
      momentum_dtypes = {}
    else:
      inner_tx = osf.safefactor(**config)
      reference, momentum_dtypes = _reference_for(config, problem, None)
    tx = osf.accumulate_gradients(inner_tx, every_k)
    params = problem.params
    state = tx.init(params)
  update = jax.jit(tx.update)
  compute_dtypes = dict.fromkeys(problem.dtypes, np.dtype(np.float32))
  tolerance = (_tolerance(reference, np.dtype(np.float32)) if inner == "safefactor"
               else TOLERANCE[np.dtype(np.float32)])
  group, applied = [], 0
  for call in range(MICRO_BATCHES):
    grads = problem.grads()
    if call in poisoned:
      grads = _poison(grads, call)
    else:
      group.append({p: _wide(g) for p, g in _by_path(grads).items()})
    updates, new_state = update(grads, state, params)
    if call not in poisoned and len(group) >= (every_k(applied) if callable(every_k)
                                               else every_k):
      # Given in float32, the leaves' dtype, from which the reference takes its floor.
      mean = {p: (sum(g[p] for g in group) / len(group)).astype(problem.dtypes[p])
              for p in group[0]}
      expected = reference.step(mean, {p: np.asarray(x) for p, x in _by_path(params).items()})
      for path, actual in _by_path(updates).items():
        want = expected[path]
        scale = max(float(np.max(np.abs(want))), np.finfo(np.float64).tiny)
        error = float(np.max(np.abs(_wide(actual) - want))) / scale
        assert error <= tolerance, (call, path, error)
      if momentum_dtypes:
        _adopt_rounding_of_narrow_momentum(reference, new_state.inner_state, momentum_dtypes,
                                           compute_dtypes)
      if inner == "safefactor" and reference.statistics_dtype is not None:
        _adopt_rounding_of_narrow_statistics(reference, new_state.inner_state, compute_dtypes)
      group, applied = [], applied + 1
    else:
      assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates)), call
      assert_trees_bitwise_equal(new_state.inner_state, state.inner_state)
    params, state = optax.apply_updates(params, updates), new_state
  assert int(state.applied_steps) == applied and int(state.accumulated) == len(group)
  assert int(osf.skipped_steps(state)) == len(poisoned)
