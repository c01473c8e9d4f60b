"""A name that is not one of a function's arguments, answered with the one it takes.

Most users come to ``safefactor`` from another Adafactor and write that one's names:
``lr`` and ``beta1`` (transformers), ``beta2_decay`` (PyTorch), ``step_offset`` (optax's
``scale_by_factored_rms``), ``epsilon1`` (T5X), ``kahan_sum`` (optimi), or a training loop's
``max_grad_norm``. Python's own error names the argument and stops there; these messages say
what it is called here, or which preset or wrapper takes it, and suggest the nearest name
for a typo (or the same words in another order).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar

import jax
import numpy as np

# Another implementation's name -> (the arguments here it means, the first one the function
# takes wins; whose name it is).
_NAMES_ELSEWHERE: dict[str, tuple[tuple[str, ...], str]] = {
    "lr": (("learning_rate",), "PyTorch's and transformers' name"),
    "beta1": (("momentum",), "transformers' and T5X's name"),
    "b1": (("momentum",), "optax.adam's name"),
    "weight_decay": (("weight_decay_rate",), "PyTorch's and transformers' name"),
    "clip_threshold": (("clipping_threshold",), "transformers' name"),
    "d": (("clipping_threshold",), "PyTorch's name"),
    "scale_parameter": (("multiply_by_parameter_scale",), "transformers' name"),
    "beta2_decay": (("decay_rate",), "PyTorch's name, negated there: its -0.8 is 0.8 here"),
    "step_offset": (("decay_offset",), "optax.scale_by_factored_rms' and T5X's name"),
    "decay_offset": (("step_offset",), "optax.adafactor's name"),
    "epsilon": (("eps",), "optax.scale_by_factored_rms' name"),
    "eps": (("epsilon",), "optax.adafactor's name"),
    "epsilon1": (("eps",), "T5X's name"),
    "epsilon2": (("min_parameter_scale",), "T5X's name"),
    "min_scale": (("min_parameter_scale",), "optax.scale_by_param_block_rms' name"),
    "skip_nan_updates": (("skip_nonfinite_steps",), "T5X's name; it skips a non-finite step "
                                                    "as a whole, and is on by default"),
    "factor_map": (("factor_rules",), "T5X's name"),
    "logical_factor_rules": (("factor_rules",), "T5X's name; give it as "
                                                "factor_rules=osf.logical_factor_rules(...)"),
    "max_consecutive_errors": (("max_consecutive", "max_consecutive_skips"),
                               "optax.apply_if_finite's name"),
    "every_k_schedule": (("every_k",), "optax.MultiSteps' name"),
    "mask": (("weight_decay_mask",), "optax.add_decayed_weights' name"),
    "mu_dtype": (("dtype_momentum",), "optax.adam's name"),
    # The write-back's switches elsewhere: a meaning with a value names the setting it
    # takes (the part before "=") and the value that does what the switch turns on.
    "kahan_sum": (("param_rounding='kahan'", "mode='kahan'"), "optimi's switch for it"),
    "bf16_stochastic_round": (("param_rounding='stochastic'", "mode='stochastic'"),
                              "torchao's switch for it"),
    "stochastic_rounding": (("param_rounding='stochastic'", "mode='stochastic'"),
                            "the switch for it in several PyTorch optimizers"),
    "write_back": (("param_rounding", "mode"), "the guides' word for its modes"),
    # Nearer, letter for letter, to rounding_seed than to the setting they mean.
    "rounding": (("param_rounding", "mode"), ""),
    "rounding_mode": (("param_rounding", "mode"), ""),
    "seed": (("rounding_seed",), ""),
}

# Where the params go, said both to params=... and to params given for a setting.
_PARAMS_GO_TO_INIT = ("an optax optimizer is built from its settings alone and takes the params "
                      "in init(params), which nnx.Optimizer(model, optimizer, wrt=nnx.Param) "
                      "calls")

# Other Adafactors' arguments with no one argument here, and what to do instead; said only
# to the functions that take a decay_rate (the Adafactors).
_NOT_ARGUMENTS_HERE = {
    "relative_step": "transformers' relative step size is a learning-rate schedule: "
                     "osf.presets.transformers(relative_step=True) builds it",
    "warmup_init": "transformers' warm-up of the relative step size is a learning-rate "
                   "schedule: osf.presets.transformers(relative_step=True, warmup_init=True) "
                   "builds it",
    "maximize": "PyTorch's: negate the loss, or use osf.presets.torch(maximize=True)",
    "foreach": "PyTorch's choice of kernel; XLA compiles the whole step, there is nothing to "
               "choose",
    "beta2": "Adafactor's beta2 follows the schedule 1 - (t + 1) ** -decay_rate: set "
             "decay_rate, or bound it with beta2_cap",
    "global_norm_clip_threshold": "T5X's: chain optax.clip_by_global_norm(threshold) before "
                                  "this optimizer",
    "weight_decay_rate_lr_exponent": "T5X's: osf.presets.t5x takes it",
    "betas": "Adam's pair: its beta1 is momentum here, and Adafactor's beta2 follows the "
             "schedule 1 - (t + 1) ** -decay_rate: set decay_rate, or bound it with beta2_cap",
    "params": _PARAMS_GO_TO_INIT,
}
_NOT_ARGUMENTS_HERE["b2"] = _NOT_ARGUMENTS_HERE["beta2"]
# A training loop's settings, which a chain or a schedule takes here.
_GLOBAL_NORM = ("chain optax.clip_by_global_norm(max_norm) before this optimizer to clip the "
                "gradients' global norm (which is not Adafactor's clipping of each update's "
                "RMS)")
_ACCUMULATION = ("accumulation wraps the optimizer: osf.accumulate_gradients(optimizer, "
                 "every_k=steps)")
_WARMUP = ("a warm-up is a learning-rate schedule: "
           "learning_rate=optax.warmup_cosine_decay_schedule(0.0, peak, warmup_steps, "
           "decay_steps) or optax.linear_schedule(0.0, peak, warmup_steps)")
_NOT_ARGUMENTS_HERE.update({
    **dict.fromkeys(("max_grad_norm", "grad_clip", "clip_grad_norm", "gradient_clipping"),
                    _GLOBAL_NORM),
    **dict.fromkeys(("gradient_accumulation_steps", "accumulation_steps", "grad_accum_steps"),
                    _ACCUMULATION),
    **dict.fromkeys(("warmup_steps", "num_warmup_steps"), _WARMUP),
})
# Advice that names an argument is said only to the functions that take it
# (scale_by_safe_factored_rms has no momentum and no learning rate).
_ADVICE_NAMES = {"betas": "momentum", "warmup_steps": "learning_rate",
                 "num_warmup_steps": "learning_rate"}


def unknown_argument(function: str, name: str, arguments: Iterable[str]) -> str:
  """The message for ``name``, which ``function`` (taking ``arguments``) does not take.

  >>> unknown_argument("safefactor", "lr", ["learning_rate", "decay_rate"])
  "safefactor() got an unexpected keyword argument 'lr': here it is learning_rate (lr is \
PyTorch's and transformers' name)"
  >>> unknown_argument("safefactor", "momentun", ["learning_rate", "momentum"])
  "safefactor() got an unexpected keyword argument 'momentun'; did you mean momentum?"
  """
  arguments = tuple(arguments)
  message = f"{function}() got an unexpected keyword argument {name!r}"
  meanings, whose = _NAMES_ELSEWHERE.get(name, ((), ""))
  meant = [meaning for meaning in meanings if meaning.partition("=")[0] in arguments]
  if meant:
    return f"{message}: here it is {meant[0]}" + (f" ({name} is {whose})" if whose else "")
  if (name in _NOT_ARGUMENTS_HERE and "decay_rate" in arguments
      and _ADVICE_NAMES.get(name, "decay_rate") in arguments):
    return f"{message}: {_NOT_ARGUMENTS_HERE[name]}"
  # The same words in another order (momentum_dtype) are further than difflib reaches.
  words = sorted(name.split("_"))
  reordered = [argument for argument in arguments if sorted(argument.split("_")) == words]
  near = reordered or difflib.get_close_matches(name, arguments, n=1, cutoff=0.75)
  return f"{message}; did you mean {near[0]}?" if near else message


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _refuse_unknown(function: str, kwargs: Iterable[str], arguments: tuple[str, ...]) -> None:
  for name in kwargs:
    if name not in arguments:
      raise TypeError(unknown_argument(function, name, arguments))


def _answering_signature(function: str, signature: inspect.Signature) -> inspect.Signature:
  """``signature``, whose ``bind`` answers an unknown keyword as ``function`` does.

  ``optax.inject_hyperparams(osf.safefactor)(lr=1e-3)`` binds its arguments to the
  signature before anything calls the function, and got Python's bare message there.
  """

  class Answering(inspect.Signature):
    __slots__ = ()

    def bind(self, /, *args, **kwargs):
      _refuse_unknown(function, kwargs, tuple(self.parameters))
      return super().bind(*args, **kwargs)

    def bind_partial(self, /, *args, **kwargs):
      _refuse_unknown(function, kwargs, tuple(self.parameters))
      return super().bind_partial(*args, **kwargs)

  return Answering(list(signature.parameters.values()),
                   return_annotation=signature.return_annotation)


def explain_unknown_arguments(function: Callable[_P, _R]) -> Callable[_P, _R]:
  """``function``, raising :func:`unknown_argument`'s message for a keyword it does not take
  (before it runs) instead of Python's bare one, also where its signature is bound first
  (``optax.inject_hyperparams``)."""
  signature = inspect.signature(function)
  arguments = tuple(signature.parameters)

  @functools.wraps(function)
  def explained(*args: _P.args, **kwargs: _P.kwargs) -> _R:
    _refuse_unknown(function.__name__, kwargs, arguments)
    return function(*args, **kwargs)

  explained.__signature__ = _answering_signature(function.__name__, signature)  # type: ignore[attr-defined]
  return explained


def for_a_number(name: str, value: Any) -> str:
  """What another convention explains about ``value``, given as the number ``name`` and
  refused: a clause to end the refusal with, or ``""``.

  >>> for_a_number("decay_rate", -0.8)
  " (transformers' decay_rate and PyTorch's beta2_decay are negated: their -0.8 is 0.8 \
here, as in optax)"
  """
  if name in ("decay_rate", "beta2_decay"):
    with_sign = np.asarray(value)
    if with_sign.ndim == 0 and np.issubdtype(with_sign.dtype, np.number) and with_sign < 0:
      return (f" (transformers' decay_rate and PyTorch's beta2_decay are negated: their "
              f"{value!r} is {-with_sign.item()!r} here, as in optax)")
  if name in ("eps", "epsilon") and np.shape(value) == (2,):
    second = ("min_parameter_scale=eps[1]" if name == "eps" else
              "eps[1] floors the parameter scale, safefactor's min_parameter_scale")
    return (f" (transformers' eps pair is two settings here: {name}=eps[0] and {second}; "
            f"PyTorch's, {name}=eps[0] ** 2 and the same)")
  return ""


def params_given_for(name: str, value: Any) -> str | None:
  """The refusal of a tree holding arrays (not itself one), given as the number ``name``, or
  ``None`` for any other value: params passed when the optimizer is built, as PyTorch's
  optimizers take them (``osf.safefactor(params, 1e-3)``), or a Flax NNX model, which is
  callable and was taken for a schedule (``osf.safefactor(model)``). NumPy read a list of
  same-shape arrays as one array, a Flax ``State`` as the array of its keys, and a dict as
  an object.

  >>> params_given_for("learning_rate", [1e-2]) is None
  True
  >>> params_given_for("learning_rate", {"w": np.ones((2, 3))})
  'learning_rate must be a number, an array or a schedule, got a dict holding 1 array (the \
params, or a model?): an optax optimizer is built from its settings alone and takes the \
params in init(params), which nnx.Optimizer(model, optimizer, wrt=nnx.Param) calls'
  """
  holding = tree_of_arrays(value)
  if holding is None:
    return None
  return (f"{name} must be a number, an array or a schedule, got {holding} (the params, or a "
          f"model?): {_PARAMS_GO_TO_INIT}")


def tree_of_arrays(value: Any) -> str | None:
  """``value`` described by its type and number of arrays (``"a dict holding 2 arrays"``)
  where it is a tree holding arrays but not an array itself, else ``None``: printed whole,
  such a value buries the message around it.

  >>> tree_of_arrays({"w": np.ones(3), "b": np.ones(2)}), tree_of_arrays(np.ones(3))
  ('a dict holding 2 arrays', None)
  """
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    return None
  arrays = sum(1 for leaf in jax.tree.leaves(value) if np.ndim(leaf))
  if not arrays:
    return None
  return f"a {type(value).__name__} holding {arrays} array{'s' if arrays > 1 else ''}"
