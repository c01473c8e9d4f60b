"""What the presets share: overrides checked by name, and the chain around ``safefactor``."""

from __future__ import annotations

import contextlib
import inspect
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from optax_safefactor._src import (
    argument_names,
    hyperparams,
    transform,
    user_warnings,
    write_back,
)
from optax_safefactor._src.alias import safefactor
from optax_safefactor._src.guard import skip_nonfinite
from optax_safefactor._src.hyperparams import Hyperparams

Schedule = Callable[[jax.Array], ArrayLike]

SAFEFACTOR_ARGUMENTS = tuple(inspect.signature(safefactor).parameters)
# What the guard of a chain with steps after safefactor's takes over.
_GUARD_SETTINGS = ("max_consecutive_skips", "checked", "skip_spikes", "spike_window")
_SAFEFACTOR_DEFAULTS = {name: parameter.default for name, parameter
                        in inspect.signature(safefactor).parameters.items()}


def given(overrides: Mapping[str, Any]) -> dict[str, Any]:
  """The overrides a user gave. ``optax.inject_hyperparams`` binds a preset's signature, which
  gathers them into ``**overrides``, and then passes that on by its name, as
  ``overrides={...}`` (``{}`` where none were given): its entries are the overrides.

  >>> given({"overrides": {"eps": 1e-30}})
  {'eps': 1e-30}
  >>> given({"overrides": {}}), given({"eps": 1e-30})
  ({}, {'eps': 1e-30})
  """
  bound = overrides.get("overrides")
  if not isinstance(bound, dict):
    return dict(overrides)
  return {**{name: value for name, value in overrides.items() if name != "overrides"}, **bound}


def injected(value: Any) -> bool:
  """An array: what ``optax.inject_hyperparams`` hands over for a number, concrete in init
  and traced in update, where Python's ``or`` and ``if`` cannot test it."""
  return isinstance(value, (jax.Array, jax.core.Tracer))


def is_set(value: Any) -> bool:
  """Whether a preset's number turns its step on: a nonzero number (the originals' ``or``:
  0 is off), or any array. ``optax.inject_hyperparams`` hands numbers over as arrays,
  concrete in init and traced in update; both must build the same chain, so an array is
  on (a zero one steps by zero).

  >>> is_set(0.0), is_set(0.1), is_set(None), is_set(jnp.zeros([]))
  (False, True, False, True)
  """
  return injected(value) or bool(value)


def check_switches(preset: str, **switches: Any) -> None:
  """Each of a preset's own switches is ``True`` or ``False``: a string ``"False"`` from a
  config file read as True (``torch(maximize="False")`` maximised). Under
  ``optax.inject_hyperparams`` a switch arrives as an array: it belongs in ``static_args``.

  >>> check_switches("torch", maximize="False")
  Traceback (most recent call last):
  ...
  TypeError: presets.torch(): maximize must be True or False, got 'False'
  """
  for name, value in switches.items():
    if isinstance(value, (jax.Array, jax.core.Tracer)):
      raise TypeError(f"presets.{preset}(): {name} is a switch, got an array; under "
                      f"optax.inject_hyperparams pass it in static_args=({name!r},)")
    if not isinstance(value, (bool, np.bool_)):
      raise TypeError(f"presets.{preset}(): {name} must be True or False, got {value!r}")


def check_number(preset: str, name: str, value: Any, requirement: str,
                 rule: Callable[[float], bool], *, none_ok: bool = False,
                 schedule_ok: bool = False) -> None:
  """One of a preset's own numbers (those it does not hand to ``safefactor`` as they are,
  which ``safefactor`` judges): a real scalar meeting ``rule``, else an error naming it and
  the preset. ``None`` or a schedule passes where allowed; a traced value
  (``optax.inject_hyperparams``' update) cannot be judged and passes.

  >>> check_number("t5x", "global_norm_clip_threshold", -1.0, "positive", lambda x: x > 0)
  Traceback (most recent call last):
  ...
  ValueError: presets.t5x(): global_norm_clip_threshold must be positive, got -1.0
  """
  if callable(value) and schedule_ok:
    hyperparams.check_schedule(f"presets.{preset}(): {name}", value)
    return
  if (value is None and none_ok) or isinstance(value, jax.core.Tracer):
    return
  tree = argument_names.params_given_for(f"presets.{preset}(): {name}", value)
  if tree:
    raise TypeError(tree)
  number = None
  if value is not None and not callable(value):
    # safefactor's own parsing, with the preset's name and what the preset takes in the
    # message rather than safefactor's.
    with contextlib.suppress(TypeError):
      number = hyperparams.as_number(name, value)
  if number is None:
    kinds = "a number" + (" or a schedule" if schedule_ok else "") + (
        " (or None)" if none_ok else "")
    raise TypeError(f"presets.{preset}(): {name} must be {kinds}, got {value!r}")
  if not rule(number):
    raise ValueError(f"presets.{preset}(): {name} must be {requirement}, got {value!r}")


def warn_unused(preset: Callable[..., Any], values: Mapping[str, Any], why: str) -> None:
  """Warn of each of ``preset``'s own arguments in ``values`` (name -> value) that differs
  from the preset's default, which ``why`` leaves without effect: the preset drops it as
  the original does (T5X's ``epsilon2`` without the parameter scale, say), but a value the
  user chose is not silently ignored.

  >>> def t5x(epsilon2=1e-3): ...
  >>> with warnings.catch_warnings():
  ...   warnings.simplefilter("error")
  ...   warn_unused(t5x, {"epsilon2": 1e-4}, "multiply_by_parameter_scale is False")
  Traceback (most recent call last):
  ...
  UserWarning: presets.t5x(): epsilon2=0.0001 has no effect: multiply_by_parameter_scale is ...
  """
  defaults = inspect.signature(preset).parameters
  for name, value in values.items():
    if not _same(value, defaults[name].default):
      user_warnings.warn(f"presets.{preset.__name__}(): {name}={value!r} has no effect: {why}")


def _same(value: Any, default: Any) -> bool:
  """Whether ``value`` is the default (a dtype by any of its names; an injected array, which
  cannot be judged here, counts as the default)."""
  if value is None or default is None or isinstance(value, (jax.Array, jax.core.Tracer)):
    return value is default or isinstance(value, (jax.Array, jax.core.Tracer))
  if isinstance(default, str):  # a dtype's name: the value is the default by any name
    try:
      return np.dtype(jnp.dtype(value)) == np.dtype(jnp.dtype(default))
    except TypeError:  # no dtype at all, so not the default one
      return False
  return value == default


def check_overrides(preset_function: Callable[..., Any], overrides: Mapping[str, Any],
                    taken: Mapping[str, str]) -> dict[str, Any]:
  """The overrides the user gave (:func:`given`); a TypeError for one ``safefactor`` does
  not know or the preset already sets.

  ``taken`` maps a ``safefactor`` argument to the preset's own argument(s) it comes from,
  or to the reason it is fixed, in parentheses. A name that is neither is answered with the
  nearest of the preset's own arguments and the overrides it leaves free.
  """
  preset = preset_function.__name__
  overrides = given(overrides)
  for name in overrides:
    if name in taken:
      if taken[name].startswith("("):
        raise TypeError(f"presets.{preset}(): {name} is fixed by this preset {taken[name]}")
      raise TypeError(
          f"presets.{preset}(): {name} is set from this preset's own {taken[name]}; "
          f"pass that instead of {name}=")
    if name not in SAFEFACTOR_ARGUMENTS:
      free = [n for n in SAFEFACTOR_ARGUMENTS if n not in taken]
      own = [n for n in inspect.signature(preset_function).parameters if n != "overrides"]
      near = argument_names.unknown_argument(f"presets.{preset}", name, [*own, *free])
      then = " Overrides" if near.endswith("?") else "; overrides"
      raise TypeError(f"{near}{then} go to osf.safefactor, and this preset leaves these "
                      f"free: {', '.join(free)}")
  return overrides


def own_names(taken: Mapping[str, str]) -> dict[str, str]:
  """The preset's own name for each ``safefactor`` setting in ``taken`` (as
  :func:`check_overrides` takes it) that comes from its arguments: the first one named.

  >>> own_names({"eps": "eps[0]", "weight_decay_rate": "weight_decay and lr",
  ...            "learning_rate": "lr, relative_step and warmup_init", "factored": "(fixed)"})
  {'eps': 'eps[0]', 'weight_decay_rate': 'weight_decay', 'learning_rate': 'lr'}
  """
  return {field: re.split(r"[ ,]", own)[0] for field, own in taken.items()
          if not own.startswith("(")}


def build(preset: str, settings: dict[str, Any], overrides: Mapping[str, Any],
          *, taken: Mapping[str, str], before: Sequence[optax.GradientTransformation] = (),
          after: Sequence[optax.GradientTransformation] = ()
          ) -> optax.GradientTransformationExtraArgs:
  """``safefactor(**settings, **overrides)``, between stateless ``before`` steps and
  ``after`` steps that change its update; ``overrides`` as :func:`check_overrides`
  returns them.

  ``safefactor``'s errors and warnings call a setting by the preset's own argument it comes
  from (``taken``, as :func:`check_overrides` takes it) and name the preset, and its
  warnings point at the line that called it, where the user can act on them.
  """
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      tx = _assembled(preset, {**_without_unused(settings), **overrides},
                      own_names(taken), before, after)
    except (TypeError, ValueError) as error:
      said = f"presets.{preset}(): "
      if type(error) not in (TypeError, ValueError) or str(error).startswith(said):
        raise
      raise type(error)(f"{said}{error}") from None
  # The guard's own checks may repeat a warning the settings' checks gave: once is enough.
  for message, category in dict.fromkeys((str(w.message), w.category) for w in caught):
    user_warnings.warn(f"presets.{preset}(): {message}", category)
  return tx


def _assembled(preset: str, arguments: dict[str, Any], names: Mapping[str, str],
               before: Sequence[optax.GradientTransformation],
               after: Sequence[optax.GradientTransformation]
               ) -> optax.GradientTransformationExtraArgs:
  """The chain of :func:`build`. With ``after`` steps, ``safefactor``'s own guard would skip
  its part only, so the guard moves out and judges the whole chain (``skip_nonfinite`` with
  the same settings), and a rounding write-back, which must be the final step, is refused."""
  # Every setting judged as safefactor judges it, the guard's included.
  settings = hyperparams.validate(Hyperparams.of({**_SAFEFACTOR_DEFAULTS, **arguments}),
                                  dict(names))
  if not after:
    tx = transform.adafactor(settings)
    return optax.with_extra_args_support(optax.chain(*before, tx)) if before else tx
  rounding = settings.param_rounding
  if write_back.rounds_onto_params(rounding):
    # Only stochastic rounding draws bits: the seed is offered with it alone.
    seed = arguments.get("rounding_seed")
    seed = "" if seed is None or not write_back.draws_bits(rounding) else f", seed={seed!r}"
    raise ValueError(
        f"presets.{preset}(): param_rounding={rounding!r} rounds safefactor's update onto "
        "the params, so it must be the final update, and this preset scales it afterwards, "
        "as the original does. Round the preset's final update instead: "
        f"osf.with_param_rounding(osf.presets.{preset}(...), {rounding!r}{seed}), with this "
        "preset's param_rounding left at 'nearest'")
  unguarded = settings._replace(
      skip_nonfinite_steps=False,
      **{name: Hyperparams._field_defaults[name] for name in _GUARD_SETTINGS})
  inner = optax.chain(*before, transform.adafactor(unguarded), *after)
  if not settings.skip_nonfinite_steps:
    return optax.with_extra_args_support(inner)
  return skip_nonfinite(inner, settings.max_consecutive_skips, checked=settings.checked,
                        skip_spikes=settings.skip_spikes, spike_window=settings.spike_window)


def _without_unused(settings: dict[str, Any]) -> dict[str, Any]:
  """``settings`` less those the preset's other settings leave without effect, which the
  originals ignore (T5X's ``epsilon2`` without the parameter scale, a momentum dtype
  without momentum): passed on, safefactor would warn of them under its own names."""
  unused = set()
  if not settings.get("multiply_by_parameter_scale", True):
    unused |= {"min_parameter_scale", "max_parameter_scale"}
  if settings.get("momentum") is None:
    unused.add("dtype_momentum")
  if not settings.get("factored", True):
    unused.add("min_dim_size_to_factor")
  return {name: value for name, value in settings.items() if name not in unused}


def value_at(value: optax.ScalarOrSchedule, count: jax.Array) -> jax.Array:
  """A number, or a schedule's value at ``count``."""
  return value(count) if callable(value) else value


def one_based_step(count: jax.Array) -> jax.Array:
  """The 1-based step of a 0-based count, in the default float dtype (float64 with x64)."""
  return jnp.asarray(count, float) + 1


def times(factor: float, value: optax.ScalarOrSchedule) -> optax.ScalarOrSchedule:
  """``factor * value``, a schedule when ``value`` is one."""
  if callable(value):
    return lambda count: factor * value(count)
  return factor * value


def path_name(path: Any) -> str:
  """A leaf's path joined with ``/``, as big_vision and T5X name parameters."""
  parts = []
  for key in path:
    for attribute in ("key", "name", "idx"):
      if hasattr(key, attribute):
        parts.append(str(getattr(key, attribute)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)
