"""Another Adafactor's names, a typo, or the params given where a setting belongs: each is
answered with what to write instead, when the optimizer is built."""

from __future__ import annotations

import inspect
import string

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings

import optax_safefactor as osf

PARAMS = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
FACTORIES = {"safefactor": osf.safefactor,
             "scale_by_safe_factored_rms": osf.scale_by_safe_factored_rms,
             "skip_nonfinite": lambda **kw: osf.skip_nonfinite(optax.sgd(0.1), **kw),
             "accumulate_gradients": lambda **kw: osf.accumulate_gradients(optax.sgd(0.1),
                                                                           **kw),
             "with_param_rounding": lambda **kw: osf.with_param_rounding(optax.sgd(0.1), **kw)}
WRAPPED = {"skip_nonfinite": osf.skip_nonfinite, "accumulate_gradients": osf.accumulate_gradients,
           "with_param_rounding": osf.with_param_rounding}


def _refusal(factory, **kwargs):
  with pytest.raises(TypeError) as raised:
    FACTORIES[factory](**kwargs)
  return str(raised.value)


def _python_says(factory, name):
  return f"{factory}() got an unexpected keyword argument {name!r}"


@pytest.mark.parametrize("factory,name,meant", [
    ("safefactor", "lr", "learning_rate"),
    ("safefactor", "beta1", "momentum"),
    ("safefactor", "b1", "momentum"),
    ("safefactor", "weight_decay", "weight_decay_rate"),
    ("safefactor", "clip_threshold", "clipping_threshold"),
    ("safefactor", "d", "clipping_threshold"),
    ("safefactor", "scale_parameter", "multiply_by_parameter_scale"),
    ("safefactor", "beta2_decay", "decay_rate"),
    ("safefactor", "step_offset", "decay_offset"),
    ("safefactor", "epsilon", "eps"),
    ("safefactor", "epsilon1", "eps"),
    ("safefactor", "epsilon2", "min_parameter_scale"),
    ("safefactor", "min_scale", "min_parameter_scale"),
    ("safefactor", "skip_nan_updates", "skip_nonfinite_steps"),
    ("safefactor", "factor_map", "factor_rules"),
    ("safefactor", "logical_factor_rules", "factor_rules"),
    ("safefactor", "mask", "weight_decay_mask"),
    ("scale_by_safe_factored_rms", "eps", "epsilon"),
    ("scale_by_safe_factored_rms", "decay_offset", "step_offset"),
    ("skip_nonfinite", "max_consecutive_errors", "max_consecutive"),
    ("safefactor", "max_consecutive_errors", "max_consecutive_skips"),
    ("accumulate_gradients", "every_k_schedule", "every_k"),
    ("safefactor", "mu_dtype", "dtype_momentum"),
    ("safefactor", "kahan_sum", "param_rounding='kahan'"),
    ("safefactor", "bf16_stochastic_round", "param_rounding='stochastic'"),
    ("safefactor", "stochastic_rounding", "param_rounding='stochastic'"),
    ("safefactor", "write_back", "param_rounding"),
    ("with_param_rounding", "kahan_sum", "mode='kahan'"),
    ("with_param_rounding", "bf16_stochastic_round", "mode='stochastic'"),
    ("with_param_rounding", "write_back", "mode"),
])
def test_another_adafactors_name_is_answered_with_the_one_taken_here(factory, name, meant):
  message = _refusal(factory, **{name: 1})
  assert message.startswith(_python_says(factory, name))
  assert f"here it is {meant} (" in message


@pytest.mark.parametrize("name,advice", [
    ("relative_step", "osf.presets.transformers(relative_step=True)"),
    ("warmup_init", "warmup_init=True"),
    ("maximize", "negate the loss"),
    ("foreach", "nothing to choose"),
    ("beta2", "beta2_cap"),
    ("b2", "beta2_cap"),
    ("global_norm_clip_threshold", "optax.clip_by_global_norm"),
    ("weight_decay_rate_lr_exponent", "osf.presets.t5x"),
    ("params", "init(params)"),
    ("betas", "its beta1 is momentum here"),
    ("max_grad_norm", "chain optax.clip_by_global_norm(max_norm) before this optimizer"),
    ("grad_clip", "optax.clip_by_global_norm"),
    ("clip_grad_norm", "optax.clip_by_global_norm"),
    ("gradient_clipping", "optax.clip_by_global_norm"),
    ("gradient_accumulation_steps", "osf.accumulate_gradients(optimizer, every_k=steps)"),
    ("accumulation_steps", "osf.accumulate_gradients"),
    ("grad_accum_steps", "osf.accumulate_gradients"),
    ("warmup_steps", "learning_rate=optax.warmup_cosine_decay_schedule("),
    ("num_warmup_steps", "optax.linear_schedule(0.0, peak, warmup_steps)"),
])
def test_an_argument_with_no_one_name_here_says_what_to_do(name, advice):
  message = _refusal("safefactor", **{name: 1})
  assert message.startswith(_python_says("safefactor", name)) and advice in message
  # Said to the Adafactors only: skip_nonfinite has no beta2 to bound.
  assert _refusal("skip_nonfinite", **{name: 1}) in (
      _python_says("skip_nonfinite", name),
      _python_says("skip_nonfinite", name) + "; did you mean max_consecutive?")


@pytest.mark.parametrize("factory,typo,meant", [
    ("safefactor", "momentun", "momentum"),
    ("safefactor", "clipping_treshold", "clipping_threshold"),
    ("safefactor", "min_dim_size_to_factr", "min_dim_size_to_factor"),
    ("scale_by_safe_factored_rms", "decay_rat", "decay_rate"),
    ("skip_nonfinite", "max_consecutiv", "max_consecutive"),
    ("with_param_rounding", "mdoe", "mode"),
])
def test_a_typo_is_answered_with_the_nearest_argument(factory, typo, meant):
  assert _refusal(factory, **{typo: 1}) == f"{_python_says(factory, typo)}; did you mean {meant}?"


@pytest.mark.parametrize("factory,name,meant", [
    ("safefactor", "rounding_mode", "param_rounding"),
    ("safefactor", "rounding", "param_rounding"),
    ("safefactor", "seed", "rounding_seed"),
    ("with_param_rounding", "rounding_mode", "mode"),
])
def test_a_name_spelled_near_another_setting_is_answered_with_the_one_it_means(factory, name,
                                                                             meant):
  """difflib answered rounding_mode="stochastic" with rounding_seed, which then refused the
  string: the write-back's names go to the setting they mean."""
  assert _refusal(factory, **{name: 1}) == f"{_python_says(factory, name)}: here it is {meant}"


def test_advice_naming_an_argument_is_said_only_where_it_is_taken():
  """scale_by_safe_factored_rms has no momentum and no learning rate to point Adam's betas
  and a warm-up at; a global-norm clip chains before it as before any optimizer."""
  for name in ("betas", "warmup_steps", "num_warmup_steps"):
    assert (_refusal("scale_by_safe_factored_rms", **{name: 1})
            == _python_says("scale_by_safe_factored_rms", name))
  assert "optax.clip_by_global_norm" in _refusal("scale_by_safe_factored_rms", max_grad_norm=1)
  assert "here it is param_rounding='kahan' (" in _refusal_of(
      lambda: osf.presets.torch(kahan_sum=True))
  assert "optax.clip_by_global_norm" in _refusal_of(
      lambda: osf.presets.transformers(max_grad_norm=1.0))


def _refusal_of(build):
  with pytest.raises(TypeError) as raised:
    build()
  return str(raised.value)


@pytest.mark.parametrize("factory", sorted(set(FACTORIES) - {"with_param_rounding"}))
def test_an_arguments_words_in_another_order_are_answered_with_it(factory):
  """momentum_dtype for dtype_momentum is beyond difflib's reach (a third of the letters
  move); every argument of two or more words, its words reversed, is suggested back."""
  function = WRAPPED.get(factory, FACTORIES[factory])
  arguments = inspect.signature(function).parameters
  asked = 0
  for argument in arguments:
    reversed_name = "_".join(reversed(argument.split("_")))
    if reversed_name == argument or reversed_name in arguments:
      continue
    assert _refusal(factory, **{reversed_name: 1}).endswith(f"; did you mean {argument}?")
    asked += 1
  assert asked >= 1


def test_a_name_near_nothing_gets_pythons_message_alone():
  assert _refusal("safefactor", xyz=1) == _python_says("safefactor", "xyz")
  # Another Adafactor's name for an argument this function does not have either.
  for factory in ("skip_nonfinite", "accumulate_gradients", "with_param_rounding"):
    for name in ("lr", "weight_decay", "epsilon2"):
      assert _refusal(factory, **{name: 1}) == _python_says(factory, name)


@settings(max_examples=60, deadline=None)
@given(factory=st.sampled_from(sorted(FACTORIES)),
       name=st.text(string.ascii_lowercase + "_", min_size=1, max_size=24))
def test_every_unknown_name_is_refused_with_pythons_message_first(factory, name):
  function = WRAPPED.get(factory, FACTORIES[factory])
  if name in inspect.signature(function).parameters:
    return
  message = _refusal(factory, **{name: 1})
  assert message.startswith(_python_says(factory, name))
  suggested = message.rpartition("did you mean ")[2].rstrip("?")
  if suggested != message:
    assert suggested in inspect.signature(function).parameters


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_an_argument_with_a_letter_dropped_is_suggested_back(data):
  """A name of eight or more letters with one dropped is within difflib's reach of its
  original: some argument is suggested, and the original when no other is as near."""
  name = data.draw(st.sampled_from([n for n in inspect.signature(osf.safefactor).parameters
                                    if len(n) >= 8]))
  drop = data.draw(st.integers(0, len(name) - 1))
  typo = name[:drop] + name[drop + 1:]
  if typo in inspect.signature(osf.safefactor).parameters:
    return
  message = _refusal("safefactor", **{typo: 1})
  assert "; did you mean " in message or ": here it is " in message
  if "min_parameter_scale" not in name and "max_parameter_scale" not in name:
    assert message.endswith(f"; did you mean {name}?") or ": here it is " in message


def test_the_checked_functions_keep_their_signatures_and_calls():
  for name, function in (("safefactor", osf.safefactor),
                         ("scale_by_safe_factored_rms", osf.scale_by_safe_factored_rms),
                         *WRAPPED.items()):
    assert function.__name__ == name
    assert inspect.signature(function) == inspect.signature(function.__wrapped__)
  # Positional and keyword calls as before, and optax.inject_hyperparams reads the signature.
  tx = osf.safefactor(1e-2, 128, 0.8, momentum=0.9)
  assert tx.update(PARAMS, tx.init(PARAMS), PARAMS)[0]["w"].shape == (4, 3)
  injected = optax.inject_hyperparams(osf.safefactor)(learning_rate=1e-2, decay_rate=0.5)
  assert float(injected.init(PARAMS).hyperparams["decay_rate"]) == 0.5


@pytest.mark.parametrize("factory", ["safefactor", "scale_by_safe_factored_rms", *WRAPPED])
def test_a_name_bound_to_the_signature_first_is_answered_as_in_a_call(factory):
  # optax.inject_hyperparams(osf.safefactor)(lr=1e-3) binds its arguments to the signature
  # before it calls anything: Python's bare "got an unexpected keyword argument 'lr'" came
  # from there.
  function = osf.safefactor if factory == "safefactor" else (
      osf.scale_by_safe_factored_rms if factory == "scale_by_safe_factored_rms"
      else WRAPPED[factory])
  for bind in (inspect.signature(function).bind, inspect.signature(function).bind_partial):
    with pytest.raises(TypeError) as raised:
      bind(optax.sgd(0.1), mu_dtype="bfloat16")
    assert str(raised.value) == _refusal(factory, mu_dtype="bfloat16")
  # What binds, binds as before.
  assert inspect.signature(function).bind_partial(optax.sgd(0.1)).args[0] is not None
  if factory == "safefactor":
    with pytest.raises(TypeError, match=r"^safefactor\(\) got an unexpected keyword argument "
                                        r"'lr': here it is learning_rate"):
      optax.inject_hyperparams(osf.safefactor)(lr=1e-3)


def test_the_peers_arguments_are_each_taken_or_explained():
  """Every argument of transformers' and PyTorch's Adafactors is one ``safefactor`` takes or
  one it answers with more than Python's message (read from their signatures where they
  install)."""
  peers = []
  torch = pytest.importorskip("torch")
  peers.append(torch.optim.Adafactor)
  hf = pytest.importorskip("transformers.optimization")
  peers.append(hf.Adafactor)
  ours = inspect.signature(osf.safefactor).parameters
  for peer in peers:
    for name in inspect.signature(peer).parameters:
      if name not in ours:
        assert _refusal("safefactor", **{name: 1}) != _python_says("safefactor", name), name


@pytest.mark.parametrize("factory,name,value,advice", [
    ("safefactor", "decay_rate", -0.8, "their -0.8 is 0.8 here"),
    ("scale_by_safe_factored_rms", "decay_rate", -0.5, "their -0.5 is 0.5 here"),
    ("safefactor", "eps", (1e-30, 1e-3),
     "(transformers' eps pair is two settings here: eps=eps[0] and "
     "min_parameter_scale=eps[1]; PyTorch's, eps=eps[0] ** 2 and the same)"),
    ("safefactor", "eps", (None, 1e-3), "PyTorch's, eps=eps[0] ** 2"),
    ("scale_by_safe_factored_rms", "epsilon", (1e-30, 1e-3),
     "epsilon=eps[0] and eps[1] floors the parameter scale, safefactor's "
     "min_parameter_scale; PyTorch's, epsilon=eps[0] ** 2 and the same)"),
])
def test_another_adafactors_convention_for_a_value_is_explained(factory, name, value, advice):
  with pytest.raises((TypeError, ValueError)) as raised:
    FACTORIES[factory](**{name: value})
  assert advice in str(raised.value)
  # A value refused for another reason says nothing of the peers: a decay rate of 0 or
  # Inf, which no sign explains, and an eps of another length than the pair's.
  eps = "eps" if factory == "safefactor" else "epsilon"
  for refused in ({"decay_rate": float("inf")}, {"decay_rate": 0.0}, {eps: (1e-30,)},
                  {eps: (1e-30, 1e-3, 1e-3)}, {eps: ((1e-30, 1e-3),)}):
    with pytest.raises((TypeError, ValueError)) as raised:
      FACTORIES[factory](**refused)
    assert "transformers" not in str(raised.value), refused
  # An array of decay rates is refused by its shape, with or without a sign to explain, and
  # a pair given for another number is not an eps pair.
  with pytest.raises(TypeError, match=r"got an array of shape \(2,\)$"):
    FACTORIES[factory](decay_rate=(-0.8, 0.8))
  with pytest.raises(TypeError, match=r"got an array of shape \(2,\)$"):
    FACTORIES["safefactor"](learning_rate=(1e-3, 1e-4))


def _nnx_model():
  nnx = pytest.importorskip("flax.nnx")  # the core's floor runs without the flax extra
  return nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx


@pytest.mark.parametrize("build,holding", [
    (lambda: osf.safefactor(PARAMS, 1e-3), "a dict holding 2 arrays"),
    (lambda: osf.safefactor([jnp.ones(3), jnp.ones(2)]), "a list holding 2 arrays"),
    # NumPy reads same-shape arrays as one array of shape (2, 3).
    (lambda: osf.safefactor([jnp.ones(3), jnp.ones(3)]), "a list holding 2 arrays"),
    (lambda: osf.safefactor(1e-3, momentum={"w": np.ones((2, 2))}), "a dict holding 1 array"),
    (lambda: osf.presets.transformers(PARAMS), "a dict holding 2 arrays"),
    (lambda: osf.presets.t5x(PARAMS), "a dict holding 2 arrays"),
])
def test_params_given_when_the_optimizer_is_built_are_refused_as_such(build, holding):
  with pytest.raises(TypeError, match="the params, or a model") as raised:
    build()
  assert holding in str(raised.value) and "init(params)" in str(raised.value)


@pytest.mark.parametrize("build", [
    lambda model: osf.safefactor(model),
    lambda model: osf.safefactor(1e-3, weight_decay_rate=model),
    lambda model: osf.presets.torch(model),
    lambda model: osf.presets.big_vision(model),
])
def test_a_flax_model_is_not_taken_for_a_schedule(build):
  """An NNX module is callable with one argument, as a schedule is: it was taken, and the
  first update failed inside the model's matrix product."""
  model, nnx = _nnx_model()
  with pytest.raises(TypeError, match="a Linear holding 2 arrays"):
    build(model)
  with pytest.raises(TypeError, match="a State holding 2 arrays"):
    build(nnx.state(model, nnx.Param))


def test_numbers_and_schedules_are_still_taken():
  for tx in (osf.safefactor(np.float32(1e-3)), osf.safefactor(jnp.asarray(1e-3)),
             osf.safefactor(optax.linear_schedule(1e-3, 0.0, 10)),
             osf.presets.t5x(optax.linear_schedule(1e-3, 0.0, 10))):
    assert tx.update(PARAMS, tx.init(PARAMS), PARAMS)[0]["w"].shape == (4, 3)


@pytest.mark.parametrize("build,says", [
    (lambda: osf.presets.transformers(lr=1e-3, relative_step=False, clip_treshold=1.0),
     "'clip_treshold'; did you mean clip_threshold? Overrides go to osf.safefactor"),
    (lambda: osf.presets.t5x(learning_rate=1e-3, epsilon_1=1e-30),
     "'epsilon_1'; did you mean epsilon1? Overrides go to osf.safefactor"),
    (lambda: osf.presets.big_vision(learning_rate=1e-3, spike_windw=64),
     "'spike_windw'; did you mean spike_window? Overrides go to osf.safefactor"),
    (lambda: osf.presets.transformers(lr=1e-3, relative_step=False, step_offset=3),
     "'step_offset': here it is decay_offset (step_offset is optax.scale_by_factored_rms' and "
     "T5X's name); overrides go to osf.safefactor"),
    (lambda: osf.presets.torch(beta1=0.9), "'beta1': here it is momentum ("),
    (lambda: osf.presets.transformers(lr=1e-3, relative_stpe=False),
     "'relative_stpe'; did you mean relative_step? Overrides go to osf.safefactor"),
    # **overrides is how the preset takes safefactor's arguments, not one of its own.
    (lambda: osf.presets.transformers(overides={}),
     "got an unexpected keyword argument 'overides'; overrides go to osf.safefactor"),
])
def test_a_presets_unknown_argument_is_answered_from_its_own_and_the_free_ones(build, says):
  with pytest.raises(TypeError) as raised:
    build()
  assert says in str(raised.value)
  assert "this preset leaves these free: " in str(raised.value)
