"""This step's values of the scheduled hyperparameters: beta2, the learning rate, weight decay.

Worked out once per step for the whole tree (``step_values``), by real compute dtype for
beta2; the kernel reads them from :class:`StepValues`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_safefactor._src import hyperparams as rules
from optax_safefactor._src import xla_hints
from optax_safefactor._src.hyperparams import Hyperparams


def power_decay(step: jax.Array, exponent: jax.typing.ArrayLike, dtype: Any) -> jax.Array:
  """Adafactor's second-moment decay :math:`1 - (t + 1)^{-c}`, in ``dtype``."""
  t = jnp.asarray(step, dtype) + jnp.asarray(1, dtype)
  return 1 - t ** (-jnp.asarray(exponent, dtype))


def second_moment_decay(
    count: jax.Array,
    dtype: Any,
    *,
    decay_rate: jax.typing.ArrayLike,
    decay_offset: jax.typing.ArrayLike,
    decay_rate_fn: Any,
    beta2_cap: jax.typing.ArrayLike | None,
) -> jax.Array:
  r""":math:`\beta_t = \min(\mathrm{decay}(\max(t - t_0, 0)), \beta_{\max})` in ``dtype``.

  The local step :math:`t - t_0` is clamped at 0: with a large offset the power
  schedule would otherwise raise a negative base to a fractional power (NaN). It
  saturates at int32's largest value, as the count does: a negative offset (a schedule
  resumed further on) takes the difference past it once the count is within ``|t_0|`` of
  it (for ``-2**31``, at every count), where int32 would wrap it to a negative step,
  clamped to 0, and beta2 would fall back to the first step's 0, forgetting the history.
  """
  count = jnp.asarray(count, jnp.int32)
  offset = jnp.asarray(decay_offset, jnp.int32)
  largest = jnp.iinfo(jnp.int32).max
  # largest + min(offset, 0) does not wrap: the offset is at least -2**31.
  local_step = jnp.where(count > largest + jnp.minimum(offset, 0), largest,
                         jnp.maximum(count - offset, 0))
  if decay_rate_fn is None:
    beta2 = power_decay(local_step, decay_rate, dtype)
  else:
    beta2 = jnp.asarray(
        rules.scheduled_value("decay_rate_fn", decay_rate_fn(local_step, decay_rate)), dtype)
  if beta2_cap is not None:
    beta2 = jnp.minimum(beta2, jnp.asarray(beta2_cap, dtype))
  return beta2


class Decay(NamedTuple):
  r"""This step's second-moment decay in one real dtype: :math:`\beta_2` and its
  complement :math:`1 - \beta_2`, each worked out once for the whole tree."""

  beta2: jax.Array
  complement: jax.Array


class StepValues(NamedTuple):
  """This step's values of the scheduled hyperparameters, worked out once per step.

  Attributes:
    decay: the second-moment decay, by real compute dtype (float32, float64).
    learning_rate: this step's learning rate, or ``None`` when there is none.
    weight_decay_rate: this step's weight-decay rate, or ``None`` when off.
    hyperparams_finite: per name in :data:`CHECKED_HYPERPARAMS`, whether its value this
      step is finite in every real compute dtype: a Python bool where that is known when
      the step is traced (a number checked at construction), else a bool scalar.
  """

  decay: dict[np.dtype, Decay]
  learning_rate: Any | None
  weight_decay_rate: Any | None
  hyperparams_finite: tuple[jax.Array | bool, ...]

  def traced_flags(self) -> list[jax.Array]:
    """The flags the skip decision reads: all but those known to be True when the step is
    traced (a constant True added to the decision changed the TPU's fusions: measured
    temporaries of 2-7% of the params on one large leaf)."""
    return [jnp.asarray(flag) for flag in self.hyperparams_finite if flag is not True]

  def flag_vector(self) -> jax.Array:
    """All the flags as one bool vector, in the order of :data:`CHECKED_HYPERPARAMS`."""
    return jnp.stack([jnp.asarray(flag) for flag in self.hyperparams_finite])


# The hyperparameters whose values the step reads and the guard checks, each counted in the
# guard's state under its name. A number given at construction was checked there; a
# schedule's value, or a value optax.inject_hyperparams passes as an array, is checked at
# each step. "decay_rate" stands for this step's beta2, whatever it was made from
# (decay_rate, decay_offset, decay_rate_fn, beta2_cap).
CHECKED_HYPERPARAMS = ("learning_rate", "weight_decay_rate", "decay_rate", "momentum",
                       "clipping_threshold", "eps", "min_parameter_scale",
                       "max_parameter_scale")


def _finite_flags(values: dict[str, Any], real_dtypes: set[np.dtype]) -> dict[str, Any]:
  """Per name, whether its value (a number, an array or ``None``) is finite in every real
  dtype the step computes in (1e39 is not, in float32), and an array within the range
  that construction requires of a number (an injected ``eps=-1`` or ``momentum=1.5``
  would train on silently): a plain bool where that is known now, else a bool scalar.
  Plain loops: this runs at every step, for every hyperparameter."""
  dtypes = sorted(real_dtypes, key=str)
  flags = {}
  for name, value in values.items():
    if value is None:
      flags[name] = True
    elif isinstance(value, (jax.Array, jax.core.Tracer)):
      checked = []
      for dtype in dtypes or [np.dtype(np.float32)]:  # float32 for a tree of no leaves
        checked.append(jnp.all(jnp.isfinite(value.astype(dtype))))
      if name in rules.RULES_FOR_ARRAYS:
        checked.append(jnp.all(rules.in_range(name, value)))
      flags[name] = jnp.all(jnp.stack(checked))
    else:
      finite = True
      with np.errstate(over="ignore", invalid="ignore"):
        for dtype in dtypes:
          finite = finite and bool(np.all(np.isfinite(np.asarray(value).astype(dtype))))
      flags[name] = finite
  return flags


def _value_at(name: str, value: optax.ScalarOrSchedule, count: jax.Array
              ) -> jax.typing.ArrayLike:
  """A hyperparameter's value at ``count``: a schedule is called (its value must be a real
  scalar), a number is kept."""
  return rules.scheduled_value(name, value(count)) if callable(value) else value


def step_values(hp: Hyperparams, count: jax.Array, real_dtypes: set[np.dtype]) -> StepValues:
  """This step's scheduled values, each schedule called once for the whole tree."""
  beta2 = {
      dtype: second_moment_decay(
          count, dtype, decay_rate=hp.decay_rate, decay_offset=hp.decay_offset,
          decay_rate_fn=hp.decay_rate_fn, beta2_cap=hp.beta2_cap,
      )
      for dtype in sorted(real_dtypes, key=str)
  }
  learning_rate = (None if hp.learning_rate is None
                   else _value_at("learning_rate", hp.learning_rate, count))
  weight_decay_rate = (None if hp.weight_decay_rate is None
                       else _value_at("weight_decay_rate", hp.weight_decay_rate, count))
  values = {"learning_rate": learning_rate, "weight_decay_rate": weight_decay_rate}
  for name in CHECKED_HYPERPARAMS[3:]:
    values[name] = getattr(hp, name)
  finite = _finite_flags(values, real_dtypes)
  finite["decay_rate"] = _beta2_finite(hp, beta2)
  decay = {}
  for dtype, value in beta2.items():
    decay[dtype] = Decay(value, 1 - value)
  # Eager there is nothing to schedule (step_scalars would hand the values back as they
  # are); not calling it keeps an eager update's path within its budget of calls.
  if isinstance(count, jax.core.Tracer):
    decay, learning_rate, weight_decay_rate = _read_by_every_leaf(
        decay, learning_rate, weight_decay_rate)
  return StepValues(
      decay=decay,
      learning_rate=learning_rate,
      weight_decay_rate=weight_decay_rate,
      hyperparams_finite=tuple([finite[name] for name in CHECKED_HYPERPARAMS]),
  )


def _read_by_every_leaf(*values: Any) -> Any:
  """``values`` with their traced scalars through :func:`xla_hints.step_scalars` (numbers
  and ``None`` as they are); their finiteness is checked on the values before it."""
  leaves, treedef = jax.tree.flatten(values)
  traced = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.core.Tracer)]
  scalars = xla_hints.step_scalars(*[leaves[i] for i in traced])
  for i, value in zip(traced, scalars, strict=True):
    leaves[i] = value
  return jax.tree.unflatten(treedef, leaves)


def _beta2_finite(hp: Hyperparams, beta2: dict[np.dtype, jax.Array]) -> jax.Array | bool:
  """Whether this step's beta2 is finite and in [0, 1] (a moving average's weight), and an
  injected ``decay_rate`` positive; True when it is made from numbers checked at
  construction by the power schedule, which is in [0, 1) for every step."""
  made_of_numbers = hp.decay_rate_fn is None and not any([
      isinstance(value, (jax.Array, jax.core.Tracer))
      for value in (hp.decay_rate, hp.decay_offset, hp.beta2_cap)])
  if made_of_numbers or not beta2:
    return True
  flags = [jnp.isfinite(value) & (value >= 0) & (value <= 1) for value in beta2.values()]
  if isinstance(hp.decay_rate, (jax.Array, jax.core.Tracer)):
    flags.append(rules.in_range("decay_rate", hp.decay_rate))
  return jnp.all(jnp.stack(flags))
