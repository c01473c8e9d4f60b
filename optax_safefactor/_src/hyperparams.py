"""Every hyperparameter of the Adafactor step, declared once and validated from one table.

``safefactor`` and ``scale_by_safe_factored_rms`` both build a :class:`Hyperparams`
and hand it to the same transformation; what differs between them is only which
fields are switched on. Adding an option means adding a field here (with its
validation row, if it has one) and reading it where it is used.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_safefactor._src import (
    argument_names,
    checks,
    numerics,
    spikes,
    user_warnings,
    write_back,
)
from optax_safefactor._src.bit_streams import check_seed
from optax_safefactor._src.plan import FactorRulesFn

DecayRateFn = Callable[[jax.Array, jax.typing.ArrayLike], jax.Array]


class Hyperparams(NamedTuple):
  """The Adafactor step's settings; see :func:`optax_safefactor.safefactor` for each."""

  learning_rate: optax.ScalarOrSchedule | None = None
  min_dim_size_to_factor: int = 128
  decay_rate: jax.typing.ArrayLike = 0.8
  decay_offset: jax.typing.ArrayLike = 0
  multiply_by_parameter_scale: bool = True
  clipping_threshold: jax.typing.ArrayLike | None = 1.0
  momentum: jax.typing.ArrayLike | None = None
  dtype_momentum: Any = "float32"
  weight_decay_rate: optax.ScalarOrSchedule | None = None
  eps: jax.typing.ArrayLike = 1e-30
  factored: bool = True
  weight_decay_mask: Any = None
  decay_rate_fn: DecayRateFn | None = None
  state_dtype: str | None = None
  beta2_cap: jax.typing.ArrayLike | None = None
  min_parameter_scale: jax.typing.ArrayLike = 1e-3
  max_parameter_scale: jax.typing.ArrayLike | None = None
  factor_rules: FactorRulesFn | None = None
  param_rounding: str = "nearest"
  rounding_seed: int = 0
  # False for a building block that scales the gradient (scale_by_factored_rms);
  # True for a whole optimizer, whose update is a step down the gradient.
  negate_updates: bool = True
  skip_nonfinite_steps: bool = False
  max_consecutive_skips: int | None = None
  checked: bool = False
  skip_spikes: jax.typing.ArrayLike | None = None
  spike_window: int = 128
  pack_small_leaves: bool = True

  @property
  def needs_params(self) -> bool:
    """Whether ``update`` reads the params."""
    return bool(self.params_read_by)

  @property
  def params_read_by(self) -> list[str]:
    """The settings for which ``update`` reads the params, each with what it reads them for."""
    reasons = []
    if self.multiply_by_parameter_scale:
      reasons.append("multiply_by_parameter_scale=True (the update is scaled by each "
                     "param's RMS)")
    if self.weight_decay_rate is not None:
      reasons.append("weight_decay_rate is set (the decay is a fraction of each param)")
    if write_back.rounds_onto_params(self.param_rounding):
      reasons.append(f"param_rounding={self.param_rounding!r} (the update is rounded onto "
                     "each param)")
    return reasons

  @classmethod
  def of(cls, arguments: dict[str, Any], renamed: dict[str, str] | None = None,
         **fixed: Any) -> Hyperparams:
    """The fields found in ``arguments`` (a factory's ``locals()``), under their field
    names (``renamed`` maps an argument to its field), with ``fixed`` on top.

    >>> Hyperparams.of({"epsilon": 0.5, "unrelated": 1}, {"epsilon": "eps"}).eps
    0.5
    """
    renamed = renamed or {}
    fields = {renamed.get(name, name): value for name, value in arguments.items()}
    return cls(**{name: fields[name] for name in cls._fields if name in fields}, **fixed)


# (field, requirement, predicate): each number that arrives concrete is checked once.
_NUMBER_RULES: tuple[tuple[str, str, Callable[[float], bool]], ...] = (
    ("learning_rate", "finite", math.isfinite),
    ("decay_rate", "positive and finite", lambda x: (x > 0) & (x < math.inf)),
    ("min_dim_size_to_factor", "a whole number of at least 1",
     lambda x: 1 <= x < math.inf and x == int(x)),
    # Any positive threshold clips, as optax's does (torch's d below 1 is refused by its
    # preset, as torch refuses it).
    ("clipping_threshold", "positive and finite (or None for no clipping)",
     lambda x: (x > 0) & (x < math.inf)),
    ("momentum", "in [0, 1) (or None)", lambda x: (x >= 0) & (x < 1)),
    ("eps", "non-negative and finite", lambda x: (x >= 0) & (x < math.inf)),
    ("beta2_cap", "in (0, 1] (or None)", lambda x: 0 < x <= 1),
    ("min_parameter_scale", "non-negative and finite", lambda x: (x >= 0) & (x < math.inf)),
    ("max_parameter_scale", "positive and finite (or None for no maximum)",
     lambda x: (x > 0) & (x < math.inf)),
    ("weight_decay_rate", "finite (or None)", math.isfinite),
    # The step count is int32, and the offset is taken from it in int32.
    ("decay_offset", "a whole number within int32's range",
     lambda x: -2**31 <= x < 2**31 and x == int(x)),
)


#: The hyperparameters whose rule also judges an array at each step (a value that
#: ``optax.inject_hyperparams`` hands over, which may change between steps): their rules
#: are written with ``&``, so that they apply to a traced array as to a number.
RULES_FOR_ARRAYS = ("decay_rate", "momentum", "clipping_threshold", "eps",
                    "min_parameter_scale", "max_parameter_scale")
_RULES_BY_FIELD = {field: rule for field, _, rule in _NUMBER_RULES if field in RULES_FOR_ARRAYS}


def in_range(field: str, value: Any) -> Any:
  """Whether ``value`` (a number, or an array: elementwise) meets ``field``'s rule, one of
  :data:`RULES_FOR_ARRAYS`.

  >>> in_range("momentum", jnp.array([0.0, 0.9, 1.0, jnp.nan])).tolist()
  [True, True, False, False]
  """
  return _RULES_BY_FIELD[field](value)


# Counts and steps: a string here is converted with int(), not float().
_WHOLE_NUMBERS = frozenset({"decay_offset", "min_dim_size_to_factor"})


def as_number(name: str, value: Any, convert: str = "float") -> float | None:
  """The value as a float, or ``None`` when it cannot be judged now (schedule, tracer); a
  ``TypeError`` naming ``name`` for anything but a real scalar (a string, an array, a
  switch, a complex number)."""
  if value is None or callable(value) or isinstance(value, jax.core.Tracer):
    return None
  if isinstance(value, (str, bytes)):
    # YAML and command lines hand numbers over as strings; refuse them by name here
    # rather than failing deep inside the step. Bytes (a file read in binary mode) too:
    # NumPy parsed b"0.1" as 0.1 where "0.1" is refused.
    raise TypeError(
        f"{name} must be a number, an array or a schedule, got the string {value!r}; "
        f"convert it first, e.g. {name}={convert}({value!r})"
    )
  tree = argument_names.params_given_for(name, value)
  if tree:
    raise TypeError(tree)
  try:
    array = np.asarray(value)
  except (TypeError, ValueError):
    array = None
  if array is not None and array.ndim:
    raise TypeError(f"{name} must be a scalar (a number, a 0-d array or a schedule), got an "
                    f"array of shape {array.shape}" + argument_names.for_a_number(name, value))
  if isinstance(value, (bool, np.bool_)) or (array is not None and array.dtype == np.bool_):
    # True would be read as 1: a switch given where a number belongs (momentum=False
    # made a momentum of 0, skip_spikes=True a spike at one standard deviation).
    kind = "a whole number" if convert == "int" else "a number"
    raise TypeError(f"{name} must be {kind} (a switch is not one), got {value!r}")
  try:
    return float(array)
  except (TypeError, ValueError):
    raise TypeError(f"{name} must be a number, an array or a schedule, got {value!r}") from None


def scheduled_value(name: str, value: Any) -> Any:
  """``value``, what the schedule given as ``name`` returned at this step, if it is a real
  scalar; else a ``TypeError`` naming ``name``. None (a schedule with no ``return``) was
  read as no learning rate, and an array broadcast the updates, and so the params, to its
  shape. Judged on the shape and dtype alone, so a traced value is judged too.

  >>> scheduled_value("learning_rate", None)
  Traceback (most recent call last):
  ...
  TypeError: learning_rate: the schedule returned None, where a scalar number belongs ...
  """
  shape = dtype = None
  if value is not None and not isinstance(value, (str, bytes)):
    with contextlib.suppress(TypeError, ValueError):  # not an array: judged below
      shape, dtype = jnp.shape(value), jnp.result_type(value)
  if dtype is None:
    problem = repr(value) if value is None or isinstance(value, (str, bytes)) else (
        f"a value of type {type(value).__name__}")
    hint = " (does it return its value?)" if value is None else ""
    raise TypeError(f"{name}: the schedule returned {problem}, where a scalar number "
                    f"belongs{hint}")
  if shape != ():
    raise TypeError(f"{name}: the schedule returned an array of shape {shape}, where a scalar "
                    "belongs (every leaf's step would be broadcast to its shape)")
  if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
    raise TypeError(f"{name}: the schedule returned a {np.dtype(dtype).name} value, where a "
                    "real number belongs")
  return value


# Mixed-precision flags' short names (accelerate's "bf16" and "fp16"): NumPy knows
# none of them, so each is answered with the dtype's own name.
_SHORT_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16",
                      "fp32": "float32", "f32": "float32", "fp64": "float64", "f64": "float64"}


def _check_float_dtype(name: str, value: Any, *, complex_ok: bool = False) -> None:
  """``value`` names a real floating dtype (or, if ``complex_ok``, a complex one), or is
  ``None``; else a TypeError naming ``name``."""
  if value is None:
    return
  if isinstance(value, (jax.Array, np.ndarray, jax.core.Tracer)):
    # optax.inject_hyperparams hands a dtype class over as a scalar of that dtype.
    dtype = value.dtype
  else:
    try:
      dtype = jnp.dtype(value)
    except TypeError:
      dtype = None
  kind = jnp.inexact if complex_ok else jnp.floating
  if dtype is None or not jnp.issubdtype(dtype, kind):
    also = ", 'complex64'" if complex_ok else ""
    short = _SHORT_DTYPE_NAMES.get(value.lower()) if isinstance(value, str) else None
    raise TypeError(
        f"{name} must be a floating dtype such as 'float32', 'bfloat16'{also} or jnp.float16 "
        f"(or None), got {value!r}" + (f"; did you mean {short!r}?" if short else "")
    )


# The numbers that may be schedules, as optax's ScalarOrSchedule: each is called with the step.
SCHEDULED = ("learning_rate", "weight_decay_rate")


def check_schedule(name: str, value: Callable[..., Any], *, schedule_ok: bool = True,
                   called_with: tuple[str, ...] = ("the step count",)) -> None:
  """A function given as ``name`` is one the step can call: with ``called_with`` (a
  schedule: the step count alone), and only where ``schedule_ok``. A factory passed
  uncalled (``optax.linear_schedule`` for ``optax.linear_schedule(...)``), or a schedule
  given for a number that takes none, failed inside the first update without naming it.

  >>> check_schedule("learning_rate", optax.linear_schedule)
  Traceback (most recent call last):
  ...
  TypeError: learning_rate is called with the step count at each step, and linear_schedule \
takes (init_value, end_value, ...): a factory, it seems; call it to make the function (say \
optax.linear_schedule(...) rather than optax.linear_schedule)
  """
  model = argument_names.params_given_for(name, value)  # an nnx.Module is callable
  if model:
    raise TypeError(model)
  if not schedule_ok:
    raise TypeError(f"{name} must be a number, got the function {_name_of(value)}: only "
                    f"{' and '.join(SCHEDULED)} take a schedule"
                    + ("; for a schedule of beta2 give decay_rate_fn" if name == "decay_rate"
                       else ""))
  try:
    signature = inspect.signature(value)
  except (TypeError, ValueError):
    return  # a builtin without a signature: nothing to judge before it is called
  try:
    signature.bind(*range(len(called_with)))
  except TypeError:
    names = list(signature.parameters)
    shown = f"({', '.join(names[:2])}, ...)" if len(names) > 2 else str(signature)
    required = [p for p in signature.parameters.values() if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    raise TypeError(
        f"{name} is called with {' and '.join(called_with)} at each step, and "
        f"{_name_of(value)} takes {shown}"
        + (": a factory, it seems; call it to make the function (say "
           "optax.linear_schedule(...) rather than optax.linear_schedule)"
           if len(required) > len(called_with) else "")) from None


def _name_of(function: Any) -> str:
  return getattr(function, "__name__", type(function).__name__)


def _check_callable(name: str, value: Any) -> None:
  if value is None or callable(value):
    return
  message = f"{name} must be a function (or None), got a {type(value).__name__}"
  if name == "factor_rules":
    message += ("; for logical axis names per parameter, pass "
                "factor_rules=osf.logical_factor_rules(axis_names)")
  raise TypeError(message)


def validate(hyperparams: Hyperparams, names: dict[str, str] | None = None) -> Hyperparams:
  """Check every concrete number against its rule; returns ``hyperparams`` unchanged.

  Under ``optax.inject_hyperparams`` numbers arrive as arrays, concrete in ``init``
  and traced in ``update``; only concrete ones can be judged. ``names`` maps a field
  to the argument the caller knows it by (``scale_by_safe_factored_rms``'s
  ``epsilon``), so that an error names what the user wrote.

  >>> validate(Hyperparams(momentum=1.5))
  Traceback (most recent call last):
  ...
  ValueError: momentum must be in [0, 1) (or None), got 1.5
  """
  names = names or {}
  for field, requirement, is_valid in _NUMBER_RULES:
    name = names.get(field, field)
    value = getattr(hyperparams, field)
    if callable(value):
      check_schedule(name, value, schedule_ok=field in SCHEDULED)
    number = as_number(name, value, "int" if field in _WHOLE_NUMBERS else "float")
    if number is not None and not is_valid(number):
      raise ValueError(f"{name} must be {requirement}, got {value!r}"
                       + argument_names.for_a_number(name, value))
  for name in ("factor_rules", "decay_rate_fn"):
    _check_callable(name, getattr(hyperparams, name))
  if hyperparams.decay_rate_fn is not None:
    check_schedule(names.get("decay_rate_fn", "decay_rate_fn"), hyperparams.decay_rate_fn,
                   called_with=("the step", "decay_rate"))
  if not (isinstance(hyperparams.dtype_momentum, str)
          and hyperparams.dtype_momentum == numerics.AT_LEAST_FLOAT32):
    _check_float_dtype("dtype_momentum", hyperparams.dtype_momentum, complex_ok=True)
  _check_float_dtype("state_dtype", hyperparams.state_dtype)
  check_seed("rounding_seed", hyperparams.rounding_seed)
  write_back.check_rounding_mode(hyperparams.param_rounding)
  rounds = write_back.rounds_onto_params(hyperparams.param_rounding)
  if rounds and hyperparams.learning_rate is None:
    raise ValueError(
        f"param_rounding={hyperparams.param_rounding!r} rounds the final update onto the "
        "params, so it needs a learning_rate (with learning_rate=None a later "
        "transformation would scale the rounded update)"
    )
  checks.check_positive_int(hyperparams.max_consecutive_skips, "max_consecutive_skips",
                            none_ok=True)
  spikes.check_settings(hyperparams.skip_spikes, hyperparams.spike_window)
  for field in _SWITCHES:
    checks.check_switch(getattr(hyperparams, field), names.get(field, field))
  _check_each_setting_is_used(hyperparams, names)
  return hyperparams


# The settings that are switches: True or False, nothing else.
_SWITCHES = ("multiply_by_parameter_scale", "factored", "skip_nonfinite_steps", "checked",
             "pack_small_leaves")


def _check_each_setting_is_used(hyperparams: Hyperparams, names: dict[str, str]) -> None:
  """Nothing a user passes is silently ignored. A safety setting that the guard's absence
  would turn off is an error; a setting that another leaves without effect (a seed without
  stochastic rounding, a spike window without spikes, a decay mask without a decay, a
  minimum parameter scale above the maximum) warns, since one config swept over the other
  is a fair use. A traced value is judged by its presence alone."""
  def name(field):
    return names.get(field, field)

  if not hyperparams.skip_nonfinite_steps:
    for field, what in (("skip_spikes", "skips steps as the non-finite guard does and counts "
                                        "them in its state"),
                        ("max_consecutive_skips", "stops a run after that many skipped steps "
                                                  "in a row"),
                        ("checked", "raises for the steps the non-finite guard skips")):
      value = getattr(hyperparams, field)
      # An off switch (False or NumPy's False) sets nothing; judged by type, not by truth,
      # as an injected value is an array, traced in update.
      if value is not None and not (isinstance(value, (bool, np.bool_)) and not value):
        raise ValueError(f"{name(field)} {what}, so it needs "
                         f"{name('skip_nonfinite_steps')}=True")
  unused = [write_back.unused_seed(hyperparams.param_rounding, hyperparams.rounding_seed,
                                   name("param_rounding"), name("rounding_seed"))]
  unused += _unused_by_switches(hyperparams, name)
  low = as_number(name("min_parameter_scale"), hyperparams.min_parameter_scale)
  high = as_number(name("max_parameter_scale"), hyperparams.max_parameter_scale)
  if (hyperparams.multiply_by_parameter_scale and low is not None and high is not None
      and low > high):
    # The maximum wins, as in T5X (whose preset passes epsilon2 as the minimum).
    unused.append(f"{name('min_parameter_scale')}={hyperparams.min_parameter_scale!r} is above "
                  f"{name('max_parameter_scale')}={hyperparams.max_parameter_scale!r}: every "
                  "param is scaled by the maximum, and the minimum has no effect")
  unused.append(spikes.unused_window(hyperparams.skip_spikes, hyperparams.spike_window,
                                     name("spike_window"), name("skip_spikes")))
  if hyperparams.weight_decay_mask is not None and hyperparams.weight_decay_rate is None:
    unused.append(f"{name('weight_decay_mask')} selects the params that "
                  f"{name('weight_decay_rate')} decays, and none is set: it has no effect")
  for message in filter(None, unused):
    user_warnings.warn(message)


def _differs_from_default(hyperparams: Hyperparams, field: str) -> bool:
  """A concrete value other than the default. A traced value (optax.inject_hyperparams'
  update) cannot be judged, and was judged concrete in its init: no."""
  value = getattr(hyperparams, field)
  default = Hyperparams._field_defaults[field]
  if isinstance(value, jax.core.Tracer):
    return False
  if value is None or default is None:
    return value is not default
  if field == "dtype_momentum":
    if isinstance(value, str) and value == numerics.AT_LEAST_FLOAT32:
      return True  # a rule, not a dtype: never the default's
    # A dtype given as a name, a type or (injected) an array of that dtype.
    dtype = value.dtype if isinstance(value, (jax.Array, np.ndarray)) else jnp.dtype(value)
    return dtype != jnp.dtype(default)
  return float(np.asarray(value)) != default


def _unused_by_switches(hyperparams: Hyperparams, name: Callable[[str], str]) -> list[str]:
  """The messages for settings that a switch or a missing setting leaves without effect:
  the parameter scale's bounds without it, the momentum's dtype without momentum, the
  factoring threshold without factoring."""
  unused = []
  if not hyperparams.multiply_by_parameter_scale:
    unused += [f"{name(field)}={getattr(hyperparams, field)!r} bounds the parameter scale, "
               f"and {name('multiply_by_parameter_scale')}=False: it has no effect"
               for field in ("min_parameter_scale", "max_parameter_scale")
               if _differs_from_default(hyperparams, field)]
  if hyperparams.momentum is None and _differs_from_default(hyperparams, "dtype_momentum"):
    unused.append(f"{name('dtype_momentum')}={hyperparams.dtype_momentum!r} is the momentum's "
                  f"dtype, and {name('momentum')} is None: it has no effect")
  if not hyperparams.factored and _differs_from_default(hyperparams, "min_dim_size_to_factor"):
    unused.append(f"{name('min_dim_size_to_factor')}={hyperparams.min_dim_size_to_factor!r} "
                  f"decides which params are factored, and {name('factored')}=False: it has "
                  "no effect")
  return unused
