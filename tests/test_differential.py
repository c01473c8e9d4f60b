"""Differential tests: random configurations, step by step against the float64 reference.

Hypothesis draws every setting of ``safefactor`` (and of ``scale_by_safe_factored_rms``
for ``decay_rate_fn``), a tree whose leaf names repeat in different subtrees, and
gradients with dead (zero) and faint (underflowing) slices; each example runs 100
steps of the jitted update and compares every step's update, leaf by leaf, with
``tests/reference.py``. What each drawn setting guards against is said where it is drawn.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import optax_safefactor as osf
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

  Each leaf gets its own scale (10**-3 to 10**5; at the top, a normaliser divided by
  the floor eps=1e-30 passes float32's largest number), up to two dead (zero) or faint
  (``FAINT``) slices along random axes, and a per-step factor; now and then a whole
  leaf's gradient is zero. Some params start at zero (the parameter scale's minimum).
  """

  def __init__(self, seed: int, dtypes: dict):
    self.rng = np.random.default_rng(seed)
    self.dtypes = dtypes
    self.scales, self.dead, self.faint = {}, {}, {}
    params = {}
    for path, shape in PATHS_AND_SHAPES:
      self.scales[path] = 10.0 ** self.rng.uniform(-3, 5)
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
  return state.inner_state if isinstance(state, osf.SkipNonfiniteState) else state


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
           + _tolerance(reference, compute_dtypes[path]) * np.max(np.abs(expected)))
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


def _poisoned_steps(tx_guarded: bool, seed: int) -> frozenset:
  """Up to 3 of the steps, drawn from ``seed``, whose gradient a guarded run poisons."""
  if not tx_guarded:
    return frozenset()
  rng = np.random.default_rng(seed + 1)
  return frozenset(rng.choice(STEPS, size=rng.integers(0, 4), replace=False).tolist())


def _poison(grads, step: int):
  """``grads`` with one element of one leaf NaN, +Inf or -Inf (by ``step``)."""
  by_path = _by_path(grads)
  path = sorted(by_path)[step % len(by_path)]
  bad = (np.nan, np.inf, -np.inf)[step % 3]
  return _tree_of({p: g.reshape(-1).at[step % g.size].set(bad).reshape(g.shape) if p == path
                   else g for p, g in by_path.items()})


def run_against_reference(tx, reference, problem, *, sign=1.0, momentum_dtypes=None,
                          poisoned=frozenset()):
  """``STEPS`` jitted updates from ``problem``, each leaf checked against ``reference``.

  ``sign`` is -1 for scale_by_safe_factored_rms, whose update is the scaled gradient
  where the reference's is a step down it. At the ``poisoned`` steps one gradient element
  is non-finite: the guarded step must be skipped whole (zero updates, the state as it
  was but its counters) and the reference does not step, so every schedule, offset and
  moving average after it must go on as if the step had never come.
  """
  params = problem.params
  state = tx.init(params)
  update = jax.jit(tx.update)
  compute_dtypes = {p: _compute_real_dtype(problem.dtypes[p]) for p, _ in PATHS_AND_SHAPES}
  for step in range(STEPS):
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
