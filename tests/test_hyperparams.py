"""Arguments a user gets wrong are refused when the optimizer is built, by their own name."""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf
from tests.helpers import assert_trees_bitwise_equal

PARAMS = {"dense": {"kernel": jnp.ones((4, 3)), "bias": jnp.ones(3)}}


@pytest.mark.parametrize("kwargs,error,message", [
    # int32 momentum was accepted and truncated every update to 0.
    ({"momentum": 0.9, "dtype_momentum": "int32"}, TypeError,
     r"dtype_momentum must be a floating dtype .*got 'int32'"),
    # Unknown names failed in init with numpy's "data type 'foo' not understood".
    ({"dtype_momentum": "foo"}, TypeError, r"dtype_momentum must be a floating dtype"),
    ({"state_dtype": "bf16"}, TypeError, r"state_dtype must be a floating dtype .*got 'bf16'"),
    ({"decay_offset": "5"}, TypeError, r"decay_offset .* string '5'.*decay_offset=int\('5'\)"),
    ({"decay_offset": 1.5}, ValueError, r"decay_offset must be a whole number.*, got 1.5"),
    # 2**31 passed, then failed in the first update with numpy's int32 OverflowError.
    ({"decay_offset": 2**31}, ValueError,
     r"decay_offset must be a whole number within int32's range, got 2147483648"),
    # inf failed with "cannot convert float infinity to integer"; True was read as 1.
    ({"min_dim_size_to_factor": float("inf")}, ValueError,
     r"min_dim_size_to_factor must be a whole number of at least 1, got inf"),
    ({"min_dim_size_to_factor": True}, TypeError, r"min_dim_size_to_factor must be a whole "
     r"number \(a switch is not one\), got True"),
    ({"decay_offset": False}, TypeError, r"decay_offset must be a whole number \(a switch is "
     r"not one\), got False"),
    # A switch where a number belongs was read as 0 or 1: momentum=False made a momentum
    # of 0 (a buffer to no purpose), skip_spikes=True skipped 83 of 200 ordinary steps as
    # spikes of one standard deviation.
    ({"momentum": False}, TypeError, r"momentum must be a number \(a switch is not one\), "
     r"got False"),
    ({"clipping_threshold": True}, TypeError, r"clipping_threshold must be a number \(a"),
    ({"decay_rate": np.True_}, TypeError, r"decay_rate must be a number \(a switch"),
    ({"weight_decay_rate": jnp.array(True)}, TypeError, r"weight_decay_rate must be a number"),
    ({"skip_spikes": True}, TypeError, r"skip_spikes must be a number of standard deviations "
     r"such as 6.0 \(or None\), got True"),
    # Each of these infinities was accepted, then every step was skipped as a non-finite
    # hyperparameter (a number given at construction is checked there, not at each step).
    ({"clipping_threshold": float("inf")}, ValueError,
     r"clipping_threshold must be positive and finite \(or None for no clipping\), got inf"),
    ({"max_parameter_scale": float("inf")}, ValueError,
     r"max_parameter_scale must be positive and finite \(or None for no maximum\), got inf"),
    ({"min_parameter_scale": float("inf")}, ValueError,
     r"min_parameter_scale must be non-negative and finite, got inf"),
    ({"eps": float("inf")}, ValueError, r"eps must be non-negative and finite, got inf"),
    ({"decay_rate": float("inf")}, ValueError, r"decay_rate must be positive and finite"),
    ({"clipping_threshold": 0.0}, ValueError, r"clipping_threshold must be positive"),
    # An array of learning rates was "not a number, an array or a schedule".
    ({"momentum": np.array([0.9, 0.9])}, TypeError,
     r"momentum must be a scalar \(a number, a 0-d array or a schedule\), got an array of "
     r"shape \(2,\)"),
    # A string seed failed at the first bfloat16 step inside JAX's dtype code.
    ({"param_rounding": "stochastic", "rounding_seed": "0"}, TypeError,
     r"rounding_seed must be an int \(or an integer array\), got '0'"),
    ({"rounding_seed": 0.5}, TypeError, r"rounding_seed must be an int"),
    ({"rounding_seed": 2**64}, ValueError, r"rounding_seed must fit in 64 bits"),
    # int() let 1.5 and True through as counts.
    ({"max_consecutive_skips": 1.5}, ValueError, r"max_consecutive_skips must be a positive int"),
    ({"max_consecutive_skips": True}, ValueError, r"max_consecutive_skips must be a positive int"),
    ({"factor_rules": {"kernel": ("row", "column")}}, TypeError,
     r"factor_rules must be a function \(or None\), got a dict.*logical_factor_rules"),
    # A switch given as a string read as True ("no" scaled by the param's RMS), or as 0/1.
    ({"multiply_by_parameter_scale": "no"}, TypeError,
     r"multiply_by_parameter_scale must be True or False, got 'no'"),
    ({"factored": "yes"}, TypeError, r"factored must be True or False, got 'yes'"),
    ({"skip_nonfinite_steps": 0}, TypeError, r"skip_nonfinite_steps must be True or False"),
    ({"checked": 1}, TypeError, r"checked must be True or False, got 1"),
    # A size of 2.5 was accepted where decay_offset=1.5 was refused.
    ({"min_dim_size_to_factor": 2.5}, ValueError,
     r"min_dim_size_to_factor must be a whole number of at least 1, got 2.5"),
    # Without the guard these checked nothing and stopped nothing, silently.
    ({"checked": True, "skip_nonfinite_steps": False}, ValueError,
     r"checked raises for the steps the non-finite guard skips, so it needs "
     r"skip_nonfinite_steps=True"),
    ({"max_consecutive_skips": 3, "skip_nonfinite_steps": False}, ValueError,
     r"max_consecutive_skips stops a run .* needs skip_nonfinite_steps=True"),
])
def test_safefactor_names_the_bad_argument(kwargs, error, message):
  with pytest.raises(error, match=message):
    osf.safefactor(1e-3, **kwargs)


@pytest.mark.parametrize("off", [False, np.False_], ids=["False", "np.False_"])
def test_an_off_switch_needs_no_guard(off):
  # checked=np.False_, a switch the checks take as False, was refused without the guard
  # as if it were on: "checked raises for the steps the non-finite guard skips".
  tx = osf.safefactor(1e-3, skip_nonfinite_steps=False, checked=off)
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS)
  plain = osf.safefactor(1e-3, skip_nonfinite_steps=False)
  assert_trees_bitwise_equal(updates, plain.update(grads, plain.init(PARAMS), PARAMS)[0])
  with pytest.raises(ValueError, match=r"checked raises .* needs skip_nonfinite_steps=True"):
    osf.safefactor(1e-3, skip_nonfinite_steps=False, checked=np.True_)


@pytest.mark.parametrize("kwargs,error,message", [
    # The building block's own argument names, not safefactor's (it said "eps").
    ({"epsilon": "1e-30"}, TypeError, r"^epsilon must be a number.*epsilon=float\('1e-30'\)"),
    # Bytes were parsed where the string is refused.
    ({"epsilon": b"1e-30"}, TypeError, r"^epsilon must be a number.*epsilon=float\(b'1e-30'\)"),
    ({"epsilon": -1.0}, ValueError, r"^epsilon must be non-negative"),
    ({"step_offset": "3"}, TypeError, r"^step_offset .*step_offset=int\('3'\)"),
    ({"decay_rate_fn": 0.8}, TypeError, r"^decay_rate_fn must be a function"),
])
def test_scale_by_safe_factored_rms_names_its_own_arguments(kwargs, error, message):
  with pytest.raises(error, match=message):
    osf.scale_by_safe_factored_rms(**kwargs)


def test_a_factor_rule_returning_a_string_is_refused_with_the_path():
  # "batch" used to be read as five roles, one per character.
  tx = osf.safefactor(1e-3, factor_rules=lambda path, shape: "batch")
  with pytest.raises(TypeError, match=r"params\['dense'\]\['bias'\]: factor rule gives 'batch'"):
    tx.init(PARAMS)


def test_a_weight_decay_mask_that_misses_a_param_fails_in_init_with_its_path():
  tx = osf.safefactor(1e-3, weight_decay_rate=0.1, weight_decay_mask={"dense": {"kernel": True}})
  with pytest.raises(ValueError, match=r"weight_decay_mask does not match params .*"
                                       r"nothing for params\['dense'\]\['bias'\]"):
    tx.init(PARAMS)


def test_a_weight_decay_mask_with_none_for_a_param_says_none_is_no_leaf():
  mask = {"dense": {"kernel": True, "bias": None}}
  tx = osf.safefactor(1e-3, weight_decay_rate=0.1, weight_decay_mask=mask)
  with pytest.raises(ValueError, match=r"nothing for params\['dense'\]\['bias'\] "
                                       r"\(weight_decay_mask\['dense'\]\['bias'\] is None, "
                                       r"which JAX reads as an empty subtree, not a leaf: write "
                                       r"False for a param not decayed\)$"):
    tx.init(PARAMS)
  # Nothing of it where no None is to blame.
  tx = osf.safefactor(1e-3, weight_decay_rate=0.1, weight_decay_mask={"dense": {"kernel": True}})
  with pytest.raises(ValueError, match=r"nothing for params\['dense'\]\['bias'\]$"):
    tx.init(PARAMS)


def test_a_weight_decay_mask_may_still_be_a_prefix_or_a_function():
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  for mask in ({"dense": False}, lambda params: jax.tree.map(lambda _: False, params)):
    tx = osf.safefactor(1e-3, weight_decay_rate=0.5, weight_decay_mask=mask)
    with pytest.warns(UserWarning, match="weight_decay_mask is False for every param"):
      state = tx.init(PARAMS)
    masked, _ = tx.update(grads, state, PARAMS)
    plain = osf.safefactor(1e-3)
    expected, _ = plain.update(grads, plain.init(PARAMS), PARAMS)
    assert jax.tree.all(jax.tree.map(jnp.array_equal, masked, expected))


def test_state_partition_specs_names_a_param_without_a_spec():
  with pytest.raises(ValueError, match=r"param_specs does not match params .*"
                                       r"nothing for params\['dense'\]\['bias'\]"):
    osf.state_partition_specs(osf.safefactor(), PARAMS, {"dense": {"kernel": P()}})
  with pytest.raises(ValueError, match=r"param_specs must hold one PartitionSpec per param"):
    osf.state_partition_specs(osf.safefactor(), PARAMS, P())
  # None for a replicated param, as jax.jit's shardings take it, is no leaf to a tree.
  with pytest.raises(ValueError, match=r"nothing for params\['dense'\]\['bias'\] "
                                       r"\(param_specs\['dense'\]\['bias'\] is None, which "
                                       r"JAX reads as an empty subtree, not a leaf: write "
                                       r"PartitionSpec\(\) for a replicated param\)$"):
    osf.state_partition_specs(osf.safefactor(), PARAMS, {"dense": {"kernel": P(),
                                                                   "bias": None}})


def test_inject_hyperparams_still_passes_dtypes_and_seeds_as_arrays():
  # inject_hyperparams hands a dtype class over as a scalar of that dtype, and an int as
  # an int32 array: both must pass the checks above.
  tx = optax.inject_hyperparams(osf.safefactor)(
      learning_rate=1e-3, momentum=0.9, dtype_momentum=jnp.bfloat16,
      param_rounding="stochastic", rounding_seed=7)
  params = {"w": jnp.ones((4, 3), jnp.bfloat16)}
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(params, state, params)
  assert updates["w"].dtype == jnp.bfloat16
  assert state.inner_state.inner_state.momentum["w"].dtype == jnp.bfloat16


def test_a_complex_momentum_dtype_names_a_precision():
  # optax accepts a complex mu_dtype, and a complex param's momentum is complex: 0.2
  # refused "complex64". It gives complex64 momentum to complex64 params and float32
  # momentum to real ones, the same run as "float32".
  params = {"z": jnp.full((3, 2), 1.0 + 2.0j, jnp.complex64), "w": jnp.ones((4,))}
  grads = {"z": jnp.full((3, 2), 0.5 - 1.0j, jnp.complex64), "w": jnp.full((4,), 0.3)}
  runs = {}
  for name in ("complex64", "float32"):
    tx = osf.safefactor(0.1, momentum=0.9, dtype_momentum=name)
    state = tx.init(params)
    momentum = state.inner_state.momentum
    assert (momentum["z"].dtype, momentum["w"].dtype) == (jnp.complex64, jnp.float32)
    runs[name] = tx.update(grads, state, params)
  for a, b in zip(jax.tree.leaves(runs["complex64"]), jax.tree.leaves(runs["float32"]),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(TypeError, match=r"state_dtype must be a floating dtype"):
    osf.safefactor(0.1, state_dtype="complex64")


@pytest.mark.parametrize("name,accepted,refused", [
    ("momentum", [0.0, 0.5, 0.999], [1.0, 1.5, -0.1]),
    ("min_dim_size_to_factor", [1, 128], [0, -1]),
    ("max_parameter_scale", [0.5, 1e-3, 10.0], [0.0, -1.0, float("inf")]),
    ("clipping_threshold", [0.25, 1.0, 1e6], [0.0, -1.0, float("inf")]),
    ("eps", [0.0, 1e-30, 1.0], [-1e-30, float("inf")]),
    ("min_parameter_scale", [0.0, 1e-3, 5.0], [-1e-3, float("inf")]),
    ("decay_offset", [-2**31, 0, 2**31 - 1], [-2**31 - 1, 2**31]),
])
def test_each_range_is_checked_at_both_ends(name, accepted, refused):
  # Each bound, from inside and outside: a range checked one-sided passes half its errors.
  for value in accepted:
    osf.safefactor(0.1, **{name: value})
  for value in refused:
    with pytest.raises(ValueError, match=name):
      osf.safefactor(0.1, **{name: value})


def test_the_settings_defaults_are_the_factories_defaults():
  # Hyperparams(...) built directly (its doctests, a tool) must mean what the factories
  # mean; only the guard's default differs, on purpose, between the two factories.
  import inspect

  from optax_safefactor._src.hyperparams import Hyperparams

  differ = set()
  for factory in (osf.safefactor, osf.scale_by_safe_factored_rms):
    parameters = inspect.signature(factory).parameters
    for name, default in Hyperparams._field_defaults.items():
      if name in parameters and parameters[name].default != default:
        differ.add((factory.__name__, name))
  assert differ == {("safefactor", "skip_nonfinite_steps")}


@pytest.mark.parametrize("kwargs,used,message", [
    ({"rounding_seed": 3}, {"param_rounding": "stochastic"},
     r"rounding_seed=3 seeds stochastic rounding's bits, which param_rounding='nearest' "
     r"does not draw: it has no effect"),
    ({"rounding_seed": 3, "param_rounding": "kahan"}, {"param_rounding": "stochastic"},
     r"rounding_seed=3 .* param_rounding='kahan' does not draw"),
    ({"spike_window": 64}, {"skip_spikes": 6.0},
     r"spike_window=64 sets the spike rule's history, and skip_spikes is not set"),
    ({"weight_decay_mask": {"dense": True}}, {"weight_decay_rate": 0.1},
     r"weight_decay_mask selects the params that weight_decay_rate decays, and none is set"),
    # The maximum wins (as in T5X, and as the float64 reference has it): every param is
    # scaled by 0.1, whatever the minimum says.
    ({"min_parameter_scale": 1.0, "max_parameter_scale": 0.1}, {"max_parameter_scale": 2.0},
     r"min_parameter_scale=1.0 is above max_parameter_scale=0.1: every param is scaled by the "
     r"maximum, and the minimum has no effect"),

    # Bounds of a scale that is off, a momentum's dtype without momentum, and a factoring
    # threshold without the factoring heuristic changed nothing, silently.
    ({"multiply_by_parameter_scale": False, "max_parameter_scale": 3.0},
     {"multiply_by_parameter_scale": True},
     r"max_parameter_scale=3.0 bounds the parameter scale, and "
     r"multiply_by_parameter_scale=False: it has no effect"),
    ({"multiply_by_parameter_scale": False, "min_parameter_scale": 0.5},
     {"multiply_by_parameter_scale": True}, r"min_parameter_scale=0.5 bounds the parameter"),
    ({"dtype_momentum": "bfloat16"}, {"momentum": 0.9},
     r"dtype_momentum='bfloat16' is the momentum's dtype, and momentum is None: it has no "
     r"effect"),
    # Exempt for the presets, which now drop it themselves: it passed silently.
    ({"dtype_momentum": "at_least_float32"}, {"momentum": 0.9},
     r"dtype_momentum='at_least_float32' is the momentum's dtype, and momentum is None"),
    ({"factored": False, "min_dim_size_to_factor": 2}, {"factored": True},
     r"min_dim_size_to_factor=2 decides which params are factored, and factored=False: it "
     r"has no effect"),
])
def test_an_argument_that_another_leaves_without_effect_warns(kwargs, used, message):
  # Accepted (a config swept over the other argument is a fair use), never silently: the
  # warning points at the line that built the optimizer.
  with pytest.warns(UserWarning, match=message) as caught:
    osf.safefactor(1e-3, **kwargs)
  assert [warning.filename for warning in caught] == [__file__]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    osf.safefactor(1e-3, **{**kwargs, **used})


def test_with_param_rounding_warns_of_a_seed_its_mode_does_not_draw():
  with pytest.warns(UserWarning, match=r"seed=3 .* mode='kahan' does not draw"):
    osf.with_param_rounding(optax.sgd(0.1), mode="kahan", seed=3)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    osf.with_param_rounding(optax.sgd(0.1), mode="stochastic", seed=3)
    osf.with_param_rounding(optax.sgd(0.1), mode="kahan")


def test_only_factor_rules_gets_the_logical_rules_hint():
  # The hint is for factor_rules alone: a wrong decay_rate_fn is told what it is, no more.
  with pytest.raises(TypeError) as caught:
    osf.scale_by_safe_factored_rms(decay_rate_fn=0.8)
  assert str(caught.value) == "decay_rate_fn must be a function (or None), got a float"


@pytest.mark.parametrize("kwargs", [
    # optax's defaults spelt out, as a drop-in config would: nothing to warn of.
    {"multiply_by_parameter_scale": False, "min_parameter_scale": 1e-3},
    {"dtype_momentum": jnp.float32}, {"dtype_momentum": np.float32}, {"dtype_momentum": "float32"},
    {"factored": False, "min_dim_size_to_factor": 128},
])
def test_a_default_spelt_out_does_not_warn(kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    osf.safefactor(1e-3, **kwargs)


def test_an_injected_setting_warns_once_at_init_and_not_at_each_traced_update():
  tx = optax.inject_hyperparams(osf.safefactor)(learning_rate=1e-3, min_parameter_scale=0.5,
                                                multiply_by_parameter_scale=False)
  with pytest.warns(UserWarning, match=r"min_parameter_scale=.* has no effect"):
    state = tx.init(PARAMS)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.jit(tx.update)(PARAMS, state, PARAMS)


def test_any_positive_clipping_threshold_clips_as_optax_does():
  # Below 1 was refused, where optax.adafactor takes it: a config of theirs failed.
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": jnp.arange(3.0)}
  grads = jax.tree.map(lambda p: jnp.cos(3 * p) + 0.1, params)
  for threshold in (0.25, 0.5):
    ours = osf.safefactor(1e-2, clipping_threshold=threshold, min_dim_size_to_factor=2)
    theirs = optax.adafactor(1e-2, clipping_threshold=threshold, min_dim_size_to_factor=2)
    updates, _ = ours.update(grads, ours.init(params), params)
    expected, _ = theirs.update(grads, theirs.init(params), params)
    for name in params:
      np.testing.assert_allclose(updates[name], expected[name], rtol=1e-6)
    # Clipped: a threshold of 1 gives larger updates here.
    looser, _ = osf.safefactor(1e-2, min_dim_size_to_factor=2).update(
        grads, osf.safefactor(1e-2, min_dim_size_to_factor=2).init(params), params)
    assert float(jnp.abs(updates["w"]).max()) < float(jnp.abs(looser["w"]).max())


@pytest.mark.parametrize("mask,error,message", [
    # Each failed in the first update inside JAX's broadcasting or dtype code, naming
    # neither the argument nor the param.
    ({"dense": {"kernel": jnp.ones((2, 2), bool), "bias": True}}, ValueError,
     r"weight_decay_mask for params\['dense'\]\['kernel'\]: a bool array of shape \(2, 2\) "
     r"does not broadcast to the param's shape \(4, 3\)"),
    ("foo", TypeError,
     r"weight_decay_mask for params\['dense'\]\['bias'\]: a mask is True, False or a bool "
     r"array, got str 'foo'"),
    # A float mask was read as True wherever it was not 0.
    ({"dense": {"kernel": jnp.full((4, 3), 0.5), "bias": False}}, TypeError,
     r"weight_decay_mask for params\['dense'\]\['kernel'\]: .* got a float32 array"),
])
def test_a_wrong_weight_decay_mask_is_named_at_init(mask, error, message):
  tx = osf.safefactor(1e-3, weight_decay_rate=0.1, weight_decay_mask=mask)
  with pytest.raises(error, match=message):
    tx.init(PARAMS)


def test_a_bool_array_mask_that_broadcasts_decays_where_it_is_true():
  mask = {"dense": {"kernel": np.array([[True, False, True]]), "bias": np.bool_(False)}}
  tx = osf.safefactor(1.0, weight_decay_rate=0.5, weight_decay_mask=mask,
                      multiply_by_parameter_scale=False, skip_nonfinite_steps=False)
  zeros = jax.tree.map(jnp.zeros_like, PARAMS)
  updates, _ = jax.jit(tx.update)(zeros, tx.init(PARAMS), PARAMS)
  np.testing.assert_array_equal(updates["dense"]["kernel"],
                                np.where(mask["dense"]["kernel"], -0.5, 0.0) * np.ones((4, 3)))
  np.testing.assert_array_equal(updates["dense"]["bias"], np.zeros(3))


def test_a_mask_function_left_out_of_inject_hyperparams_static_args_warns():
  # optax.inject_hyperparams calls a function-valued hyperparameter with the step count:
  # the mask came back False for every param, and weight decay was silently off.
  mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731
  tx = optax.inject_hyperparams(osf.safefactor)(
      learning_rate=1e-2, weight_decay_rate=0.1, weight_decay_mask=mask)
  with pytest.warns(UserWarning, match=r"weight_decay_mask is False for every param, so "
                                       r"no param is decayed .*static_args"):
    tx.init(PARAMS)
  for decaying in ({"dense": {"kernel": False, "bias": False}}, False):
    with pytest.warns(UserWarning, match="weight_decay_mask is False for every param"):
      osf.safefactor(1e-2, weight_decay_rate=0.1, weight_decay_mask=decaying).init(PARAMS)
  # In static_args the mask is the params' and decays the kernel, silently.
  tx = optax.inject_hyperparams(osf.safefactor, static_args=("weight_decay_mask",))(
      learning_rate=1e-2, weight_decay_rate=0.1, weight_decay_mask=mask)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    state = tx.init(PARAMS)
  zeros = jax.tree.map(jnp.zeros_like, PARAMS)
  updates, _ = jax.jit(tx.update)(zeros, state, PARAMS)
  assert float(jnp.max(jnp.abs(updates["dense"]["kernel"]))) > 0
  assert float(jnp.max(jnp.abs(updates["dense"]["bias"]))) == 0


def _forgets_to_return(count):
  rate = 1e-3 * jnp.minimum(1.0, count / 100)  # noqa: F841 (the bug: no return)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("schedule,message", [
    (_forgets_to_return, r"returned None, where a scalar number belongs \(does it return"),
    (lambda count: jnp.full((4, 3), 1e-2), r"returned an array of shape \(4, 3\), where a "
                                            r"scalar belongs"),
    (lambda count: count < 3, "returned a bool value, where a real number belongs"),
    (lambda count: "1e-3", "returned '1e-3', where a scalar number belongs"),
])
def test_a_schedule_must_return_a_real_scalar(schedule, message, jit):
  # A learning-rate schedule returning None trained with no learning rate (updates 1000x
  # too large at 1e-3), and one returning a (4, 3) array broadcast the (3,) bias's update,
  # so apply_updates gave the param the shape (4, 3).
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
  grads = jax.tree.map(jnp.ones_like, params)
  for name, tx in [("learning_rate", osf.safefactor(schedule)),
                   ("weight_decay_rate", osf.safefactor(1e-3, weight_decay_rate=schedule)),
                   ("decay_rate_fn", osf.scale_by_safe_factored_rms(
                       decay_rate_fn=lambda step, rate: schedule(step)))]:
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(TypeError, match=rf"^{name}: the schedule {message}"):
      update(grads, tx.init(params), params)
  tx = osf.accumulate_gradients(optax.sgd(0.1), schedule)
  with pytest.raises(TypeError, match=rf"^every_k: the schedule {message}"):
    tx.update(grads, tx.init(params), params)


@pytest.mark.parametrize("schedule", [lambda count: 1e-3, lambda count: jnp.int32(1),
                                      optax.linear_schedule(1e-3, 0.0, 10)])
def test_a_schedule_of_numbers_and_scalar_arrays_is_taken(schedule):
  params = {"w": jnp.ones((4, 3))}
  tx = osf.safefactor(schedule)
  updates, _ = jax.jit(tx.update)(params, tx.init(params), params)
  assert updates["w"].shape == (4, 3)


@pytest.mark.parametrize("kwargs", [{"state_dtype": "float64"},
                                    {"momentum": 0.9, "dtype_momentum": "float64"},
                                    {"momentum": 0.9, "dtype_momentum": jnp.complex128}])
def test_a_64_bit_state_without_64_bit_jax_is_refused_at_init(kwargs, x64):
  # Without jax_enable_x64, JAX made the state float32, and the first update refused it as
  # a state "made for another optimizer": start from this optimizer's init, it said, which
  # it was.
  tx = osf.safefactor(1e-2, **kwargs)
  params = {"w": jnp.ones((4, 3), jnp.float64)}
  state = tx.init(params)  # with 64-bit JAX: a 64-bit state that steps
  tx.update(params, state, params)
  jax.config.update("jax_enable_x64", False)  # the fixture restores the setting after
  name, value = next((k, v) for k, v in kwargs.items() if k != "momentum")
  with pytest.raises(ValueError, match=rf"^{name}={re.escape(repr(value))} needs 64-bit JAX, "
                                       r"which is off"):
    tx.init({"w": jnp.ones((4, 3))})


def test_an_injected_max_consecutive_skips_below_one_is_named_not_read_as_skips():
  # Injected as 0 after init, it stopped a healthy jitted step with "0 consecutive
  # optimizer steps were non-finite and skipped ... (optimizer state only)".
  params = {"w": jnp.ones((4, 3))}
  tx = optax.inject_hyperparams(osf.safefactor)(learning_rate=0.1, max_consecutive_skips=2)
  state = tx.init(params)
  state.hyperparams["max_consecutive_skips"] = jnp.asarray(0)
  with pytest.raises(Exception, match=r"max_consecutive_skips must be an int of at least 1, "
                                      r"got 0 \(injected\)"):
    jax.block_until_ready(jax.jit(tx.update)(params, state, params))


@pytest.mark.parametrize("build,error", [
    # A schedule's factory passed uncalled failed at the first update, inside optax's
    # schedule: "linear_schedule() missing 2 required positional arguments".
    (lambda: osf.safefactor(optax.linear_schedule),
     r"^learning_rate is called with the step count at each step, and linear_schedule takes "
     r"\(init_value, end_value, \.\.\.\): a factory, it seems; call it to make the function"),
    (lambda: osf.safefactor(1e-2, weight_decay_rate=optax.cosine_decay_schedule),
     r"^weight_decay_rate is called with the step count .* cosine_decay_schedule takes "
     r"\(init_value, decay_steps, \.\.\.\): a factory"),
    (lambda: osf.safefactor(lambda: 1e-2),
     r"^learning_rate is called with the step count at each step, and <lambda> takes \(\)$"),
    # A function given for a number that takes no schedule failed at the first update with
    # "float() argument must be a string or a real number, not 'function'", naming nothing.
    (lambda: osf.safefactor(1e-2, decay_rate=lambda count: 0.8),
     r"^decay_rate must be a number, got the function <lambda>: only learning_rate and "
     r"weight_decay_rate take a schedule; for a schedule of beta2 give decay_rate_fn$"),
    (lambda: osf.safefactor(1e-2, clipping_threshold=optax.constant_schedule(1.0)),
     r"^clipping_threshold must be a number, got the function <lambda>: only learning_rate"),
    (lambda: osf.safefactor(1e-2, eps=lambda count: 1e-30), r"^eps must be a number"),
    (lambda: osf.safefactor(1e-2, momentum=lambda count: 0.9), r"^momentum must be a number"),
    (lambda: osf.safefactor(1e-2, max_parameter_scale=lambda count: 1.0),
     r"^max_parameter_scale must be a number"),
    (lambda: osf.safefactor(1e-2, decay_offset=lambda count: 10),
     r"^decay_offset must be a number"),
    (lambda: osf.scale_by_safe_factored_rms(epsilon=lambda count: 1e-30),
     r"^epsilon must be a number"),
    (lambda: osf.scale_by_safe_factored_rms(decay_rate_fn=lambda step: 0.9),
     r"^decay_rate_fn is called with the step and decay_rate at each step, and <lambda> "
     r"takes \(step\)$"),
    (lambda: osf.presets.big_vision(optax.cosine_decay_schedule),
     r"^presets.big_vision\(\): learning_rate is called with the step count .* a factory"),
    (lambda: osf.presets.transformers(lr=optax.linear_schedule, relative_step=False),
     r"^presets.transformers\(\): lr is called with the step count .* a factory"),
], ids=["lr-factory", "decay-factory", "lr-without-argument", "decay_rate", "clipping", "eps",
        "momentum", "max_parameter_scale", "decay_offset", "epsilon", "decay_rate_fn",
        "big_vision", "transformers"])
def test_a_function_the_step_cannot_call_is_refused_at_construction(build, error):
  with pytest.raises(TypeError, match=error):
    build()


def test_schedules_and_functions_the_step_can_call_are_taken():
  params = {"w": jnp.ones((4, 3))}
  decay = functools.partial(lambda count, rate: rate, rate=0.1)
  for tx in (osf.safefactor(optax.linear_schedule(0.0, 1e-2, 10), weight_decay_rate=decay),
             osf.safefactor(lambda count, *more: 1e-2),
             osf.scale_by_safe_factored_rms(decay_rate_fn=lambda step, rate, *more: 0.9),
             osf.presets.big_vision(optax.linear_schedule(1e-2, 0.0, 100))):
    updates, _ = tx.update(params, tx.init(params), params)
    assert bool(jnp.all(jnp.isfinite(updates["w"])))


@pytest.mark.parametrize("name", ["dtype_momentum", "state_dtype"])
@pytest.mark.parametrize("short, meant", [("bf16", "bfloat16"), ("BF16", "bfloat16"),
                                          ("fp16", "float16"), ("f32", "float32"),
                                          ("fp64", "float64")])
def test_a_mixed_precision_flags_short_name_is_answered_with_the_dtypes_own(name, short,
                                                                           meant):
  # accelerate's "bf16" and "fp16" are no NumPy dtype names: the refusal listed examples and
  # left the mapping to the reader.
  with pytest.raises(TypeError, match=re.escape(f"got {short!r}; did you mean {meant!r}?")):
    osf.safefactor(0.1, momentum=0.9, **{name: short})
  # A name NumPy does not know and no flag uses keeps the plain refusal.
  with pytest.raises(TypeError, match=r"got 'bfloat'$"):
    osf.safefactor(0.1, momentum=0.9, **{name: "bfloat"})
