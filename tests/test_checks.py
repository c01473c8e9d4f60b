"""Bad input gets a clear error naming the parameter path or the argument."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_safefactor as osf
from optax_safefactor._src import checks, kernel
from tests.helpers import TRANSFORMATIONS, run_steps


def _params():
  return {"dense": {"kernel": jnp.ones((130, 130)), "bias": jnp.ones((130,))}}


def test_grad_shape_mismatch_names_the_path():
  params = _params()
  tx = osf.safefactor(0.1)
  grads = {"dense": {"kernel": jnp.ones((130, 129)), "bias": jnp.ones((130,))}}
  with pytest.raises(ValueError, match=r"params\['dense'\]\['kernel'\]: grad shape \(130, 129\) "
                                       r"!= param shape \(130, 130\)"):
    tx.update(grads, tx.init(params), params)


def test_grad_dtype_mismatch_names_the_path():
  params = _params()
  tx = osf.safefactor(0.1)
  grads = {"dense": {"kernel": jnp.ones((130, 130), jnp.bfloat16), "bias": jnp.ones((130,))}}
  with pytest.raises(TypeError, match=r"params\['dense'\]\['kernel'\]: grad dtype bfloat16"):
    tx.update(grads, tx.init(params), params)


def test_missing_and_extra_leaves_are_listed():
  params = _params()
  tx = osf.safefactor(0.1)
  grads = {"dense": {"kernel": jnp.ones((130, 130)), "scale": jnp.ones((130,))}}
  with pytest.raises(ValueError, match=r"missing from grads: params\['dense'\]\['bias'\].*"
                                       r"params\['dense'\]\['scale'\]"):
    tx.update(grads, tx.init(params), params)


def test_state_for_other_params_is_refused():
  tx = osf.scale_by_safe_factored_rms()
  state = tx.init(_params())
  grads = {"dense": {"kernel": jnp.ones((140, 130)), "bias": jnp.ones((130,))}}
  with pytest.raises(ValueError, match=r"params\['dense'\]\['kernel'\]: optimizer state"):
    tx.update(grads, state)


def test_grads_with_a_leaf_the_state_lacks_are_named():
  # Without params to compare with, the state's own tree is what the grads must match.
  tx = osf.scale_by_safe_factored_rms()
  state = tx.init({"w": jnp.ones((4, 3))})
  with pytest.raises(ValueError, match=r"in grads but not in the optimizer state: "
                                       r"params\['v'\]"):
    tx.update({"w": jnp.ones((4, 3)), "v": jnp.ones(3)}, state)


def test_accumulation_refuses_integer_params_at_init():
  # The accumulator sums gradients in the param's floating compute dtype: an integer param has
  # none.
  # A mask inside does not help (every leaf reaches the accumulator): the message said to
  # use one, which the user had; it says to put the mask around the accumulation.
  params = {"w": jnp.ones(3), "step": jnp.zeros((), jnp.int32)}
  mask = {"w": True, "step": False}
  tx = osf.accumulate_gradients(optax.masked(optax.sgd(0.1), mask), 2)
  with pytest.raises(TypeError, match=r"params\['step'\]: param dtype int32 is not floating "
                                      r"or complex; accumulate_gradients sums every leaf it is "
                                      r"given, so leave it out around it: optax.masked\("
                                      r"osf.accumulate_gradients\(tx, every_k\), mask\)"):
    tx.init(params)
  around = optax.masked(osf.accumulate_gradients(optax.sgd(0.1), 2), mask)
  updates, _ = around.update(jax.tree.map(jnp.ones_like, params), around.init(params), params)
  assert int(updates["step"]) == 1  # optax.masked passes a left-out leaf's grad through


def test_integer_params_are_refused_at_init():
  with pytest.raises(TypeError, match=r"params\['step'\]: param dtype int32"):
    osf.safefactor(0.1).init({"w": jnp.ones(3), "step": jnp.zeros((), jnp.int32)})


def test_missing_params_are_refused_when_needed():
  tx = osf.safefactor(0.1)
  params = _params()
  with pytest.raises(ValueError, match="needs params"):
    tx.update(params, tx.init(params))
  # Without parameter scale or weight decay, params are not needed.
  tx = osf.safefactor(0.1, multiply_by_parameter_scale=False)
  tx.update(params, tx.init(params))


@pytest.mark.parametrize("kwargs,name", [
    (dict(decay_rate=0.0), "decay_rate"),
    (dict(decay_rate=-0.8), "decay_rate"),
    (dict(clipping_threshold=0.0), "clipping_threshold"),
    (dict(min_dim_size_to_factor=0), "min_dim_size_to_factor"),
    (dict(momentum=1.0), "momentum"),
    (dict(momentum=-0.1), "momentum"),
    (dict(eps=-1e-30), "eps"),
    (dict(beta2_cap=1.5), "beta2_cap"),
    (dict(learning_rate=float("nan")), "learning_rate"),
])
def test_invalid_hyperparameters_are_rejected_at_construction(kwargs, name):
  with pytest.raises(ValueError, match=name):
    osf.safefactor(**kwargs)


def test_traced_min_dim_size_in_init_has_a_clear_error():
  import jax

  tx = optax.inject_hyperparams(osf.safefactor)(learning_rate=0.1)
  with pytest.raises(TypeError, match="static_args"):
    jax.jit(tx.init)(_params())


@pytest.mark.parametrize("injected", [
    optax.inject_hyperparams(osf.safefactor, static_args=("min_dim_size_to_factor",))(
        learning_rate=0.1, skip_spikes=6.0, spike_window=4),
    optax.inject_hyperparams(osf.skip_nonfinite)(optax.sgd(0.1), skip_spikes=6.0,
                                                 spike_window=4),
], ids=["safefactor", "skip_nonfinite"])
def test_traced_spike_window_in_init_has_a_clear_error(injected):
  # jax.eval_shape(tx.init, params), a checkpoint's restore target: int() of the injected
  # window failed with JAX's bare ConcretizationTypeError, naming no setting.
  with pytest.raises(TypeError, match=r"spike_window is traced.*static_args=\('spike_window',\)"):
    jax.eval_shape(injected.init, _params())


@pytest.mark.parametrize("mistake,error,message", [
    ("optax_state", TypeError, r"optax.adafactor state: convert it with osf.migrate_from_optax"),
    ("swapped", TypeError, r"optimizer state as its first argument"),
    # update(grads, params, state): the state argument has the params' structure.
    ("params_as_state", TypeError, r"structure of the gradients: are the arguments swapped\? "
                                   r"call update\(grads, opt_state, params\)"),
    ("restored_without_target", TypeError, r"restored without a target"),
])
def test_wrong_state_is_named(mistake, error, message):
  # 0.1 answered each of these with "AttributeError: 'tuple' object has no attribute
  # 'inner_state'".
  params = _params()
  tx = osf.safefactor(0.1)
  state = tx.init(params)
  args = {
      "optax_state": (params, optax.adafactor(0.1).init(params), params),
      "swapped": (state, params, params),
      "params_as_state": (params, params, state),
      "restored_without_target": (params, list(state), params),
  }[mistake]
  with pytest.raises(error, match=message):
    tx.update(*args)


def test_learning_rate_given_as_a_string_is_named():
  # What a YAML config hands over; 0.1 failed deep inside with a format error.
  with pytest.raises(TypeError, match=r"learning_rate .* string '1e-3'.*float\('1e-3'\)"):
    osf.safefactor("1e-3")


def test_python_float_leaf_is_named():
  with pytest.raises(TypeError, match=r"params\['scale'\]: param is a float"):
    osf.safefactor(0.1).init({"w": jnp.ones(3), "scale": 1.0})
  # The dtype itself where a value of it was meant: it has a dtype and no shape.
  with pytest.raises(TypeError, match=r"params\['scale'\]: param is a .* not an array"):
    osf.safefactor(0.1).init({"w": jnp.ones(3), "scale": jnp.float32})


def test_migrating_a_state_restored_without_target_says_what_to_do():
  params = {"w": jnp.ones((256, 128))}
  restored = [list(x) if isinstance(x, tuple) else x for x in optax.adafactor(0.1).init(params)]
  with pytest.raises(ValueError, match=r"restored without a target.*jax.eval_shape"):
    osf.migrate_from_optax(restored, osf.safefactor(0.1), params)


def _cast(tree, dtype, floating_only=False):
  def cast(x):
    if floating_only and not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    return x.astype(dtype)

  return jax.tree.map(cast, tree)


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_a_state_cast_whole_is_refused_naming_its_counter(name):
  # Cast to bfloat16 with the rest of the state, a counter stops at 256: 0.2 accepted
  # that and, after 300 updates, reported "no skipped steps in 256 steps".
  tx = TRANSFORMATIONS[name].build()
  params = _params()
  with pytest.raises(TypeError, match=r"(State|History)\.\w+(\[.*\])?: a counter must stay "
                                      r"int32, got bfloat16 \(a bfloat16 count stops at 256\); "
                                      r"cast only the floating leaves"):
    tx.update(params, _cast(tx.init(params), jnp.bfloat16), params)


@pytest.mark.parametrize("wrapper", ["with_param_rounding", "skip_nonfinite",
                                     "accumulate_gradients"])
def test_a_wrappers_cast_counter_gets_no_advice_for_settings_its_inner_lacks(wrapper):
  # A wrapper's cast counter was told to build the optimizer with state_dtype='bfloat16'
  # and dtype_momentum=..., settings of safefactor's that optax.adam (inside) has not.
  wrappers = {"with_param_rounding": lambda tx: osf.with_param_rounding(tx, "kahan"),
              "skip_nonfinite": osf.skip_nonfinite,
              "accumulate_gradients": lambda tx: osf.accumulate_gradients(tx, 2)}
  tx = wrappers[wrapper](optax.adam(1e-3))
  params = {"w": jnp.ones((4,), jnp.bfloat16)}
  with pytest.raises(TypeError, match="cast only the floating leaves") as refused:
    tx.update(params, _cast(tx.init(params), jnp.bfloat16), params)
  assert "state_dtype" not in str(refused.value) and "momentum" not in str(refused.value)
  # safefactor's own state, cast whole, is told of its settings.
  tx = osf.safefactor(0.1)
  with pytest.raises(TypeError, match=r"cast only the floating leaves.*state_dtype='bfloat16'"):
    tx.update(params, _cast(tx.init(params), jnp.bfloat16), params)


@pytest.mark.parametrize("guard", ["safefactor", "skip_nonfinite", "accumulate_gradients"])
def test_a_cast_guard_counter_is_refused_before_any_leaf_is_stepped(guard, monkeypatch):
  # The guards' counters were checked only when they were counted, after every leaf's
  # step had been traced (seconds on a large tree) or, eager, run.
  def stepped(*args, **kwargs):
    raise AssertionError("a leaf was stepped before the state's counters were checked")

  params = _params()
  if guard == "safefactor":
    monkeypatch.setattr(kernel, "leaf_scaling", stepped)
    tx = osf.safefactor(0.1)
  elif guard == "skip_nonfinite":
    tx = osf.skip_nonfinite(optax.GradientTransformation(optax.sgd(0.1).init, stepped))
  else:
    tx = osf.accumulate_gradients(optax.GradientTransformation(optax.sgd(0.1).init, stepped),
                                  2)
  state = tx.init(params)
  if guard == "accumulate_gradients":
    state = state._replace(micro_batches=state.micro_batches._replace(
        skipped_steps=state.micro_batches.skipped_steps.astype(jnp.float32)))
    where = "MicroBatchCounters.skipped_steps"
  else:
    state = state._replace(skipped_steps=state.skipped_steps.astype(jnp.float32))
    where = "SkipNonfiniteState.skipped_steps"
  with pytest.raises(TypeError, match=rf"{where}: a counter must stay int32, got float32"):
    tx.update(params, state, params)


def test_a_state_with_only_its_floating_leaves_cast_counts_exactly():
  # What the counter's message says to do, around an inner transformation whose state
  # may be narrower (optax.adam casts its moments back): the counters stay exact.
  tx = osf.skip_nonfinite(optax.adam(1e-3))
  params = {"w": jnp.ones((4,), jnp.bfloat16)}
  state = _cast(tx.init(params), jnp.bfloat16, floating_only=True)
  grads = [{"w": jnp.full((4,), jnp.nan if step % 100 == 0 else 1.0, jnp.bfloat16)}
           for step in range(300)]
  _, state, _ = run_steps(tx, params, grads, state=state, dtype_promotion="standard")
  assert int(state.step) == 300 and int(osf.skipped_steps(state)) == 3


@pytest.mark.parametrize("what,narrow", [("second moment", False), ("momentum", False),
                                         ("second moment", True), ("momentum", True)])
def test_a_statistic_in_another_dtype_is_refused(what, narrow):
  # A cast statistic would stay in the cast dtype, where a bfloat16 second moment cannot
  # follow beta2 = 0.999; the message names the setting that would take the state as it
  # is (it advised state_dtype='bfloat16' to an optimizer that had it, for a float32
  # state).
  argument = "state_dtype" if what == "second moment" else "dtype_momentum"
  narrow_settings = {argument: "bfloat16"}
  maker = osf.safefactor(0.1, momentum=0.9, **(narrow_settings if narrow else {}))
  tx = osf.safefactor(0.1, momentum=0.9, **({} if narrow else narrow_settings))
  params = _params()
  state = maker.init(params)
  found, kept = ("bfloat16", "float32") if narrow else ("float32", "bfloat16")
  # The refusing optimizer's own setting, as the message quotes it.
  defaults = {"state_dtype": None, "dtype_momentum": "float32"}
  setting = f"{argument}={(defaults if narrow else narrow_settings)[argument]!r}"
  with pytest.raises(TypeError, match=rf"params\['dense'\]\['(bias|kernel)'\]: the {what} in "
                                      rf"the optimizer state is {found}, but this optimizer "
                                      rf"keeps it in {kept} \(its {setting}\); to go on with "
                                      rf"this state, build the optimizer with {argument}="
                                      rf"'{found}', or start from this optimizer's init"):
    tx.update(params, state, params)


def test_a_narrow_state_asked_for_by_name_is_accepted():
  tx = osf.safefactor(0.1, momentum=0.9, state_dtype="bfloat16", dtype_momentum="bfloat16")
  params = _params()
  updates, state = tx.update(params, tx.init(params), params)
  assert {x.dtype for x in jax.tree.leaves(state.inner_state.second_moment)} == {
      np.dtype(jnp.bfloat16)}
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("state_momentum,momentum,message", [
    (0.9, None, r"holds a momentum \(one per param\), but this optimizer has momentum=None "
                r"and would drop it"),
    (None, 0.9, r"this optimizer has momentum=0.9, but the optimizer state holds none"),
])
def test_a_momentum_mismatch_is_refused(state_momentum, momentum, message):
  # 0.2 dropped a momentum the optimizer did not have, silently.
  params = _params()
  state = osf.safefactor(0.1, momentum=state_momentum).init(params)
  with pytest.raises(ValueError, match=message):
    osf.safefactor(0.1, momentum=momentum).update(params, state, params)


def test_a_weight_decay_mask_that_does_not_fit_fails_at_init():
  # At init, not at the first step inside a jitted training loop.
  params = _params()
  tx = osf.safefactor(0.1, weight_decay_rate=1e-3, weight_decay_mask={"other": True})
  with pytest.raises(ValueError, match="weight_decay_mask"):
    tx.init(params)


def _bf16_params():
  return {"w": jnp.ones((130, 130), jnp.bfloat16), "b": jnp.ones((130,), jnp.float32)}


@pytest.mark.parametrize("jitted", [False, True])
def test_a_state_without_compensation_is_refused_by_kahan(jitted):
  # 0.2 failed inside the write-back: "'NoneType' object has no attribute 'astype'".
  params = _bf16_params()
  state = osf.safefactor(0.1).init(params)
  update = osf.safefactor(0.1, param_rounding="kahan").update
  update = jax.jit(update) if jitted else update
  with pytest.raises(ValueError, match=r"param_rounding='kahan', but the optimizer state "
                                       r"holds no compensation"):
    update(params, state, params)


def test_the_fix_a_missing_compensation_error_names_works():
  # The message's fix keeps the statistics and starts the compensation at zero, as init does.
  params = _bf16_params()
  tx = osf.safefactor(0.1)
  _, state = tx.update(params, tx.init(params), params)
  kahan = osf.safefactor(0.1, param_rounding="kahan")
  with pytest.raises(ValueError) as raised:
    kahan.update(params, state, params)
  fix = str(raised.value).split("state = ", 1)[1].split(" on the AdafactorState")[0]
  inner = eval(fix, {"jax": jax, "jnp": jnp, "state": state.inner_state, "params": params})
  state = state._replace(inner_state=inner)
  fresh = kahan.init(params).inner_state.compensation
  assert jax.tree.structure(inner.compensation) == jax.tree.structure(fresh)
  _, stepped = kahan.update(params, state, params)
  assert int(stepped.inner_state.count) == 2


def test_a_kahan_state_is_refused_by_an_optimizer_without_kahan():
  # 0.2 carried the compensation along unused.
  params = _bf16_params()
  state = osf.safefactor(0.1, param_rounding="kahan").init(params)
  for rounding in ("nearest", "stochastic"):
    with pytest.raises(ValueError, match=rf"holds a Kahan compensation \(it was made with "
                                         rf"param_rounding='kahan'\), but this optimizer has "
                                         rf"param_rounding='{rounding}'"):
      osf.safefactor(0.1, param_rounding=rounding).update(params, state, params)


@pytest.mark.parametrize("made_with, stepped_with", [("nearest", "kahan"),
                                                     ("kahan", "nearest")])
def test_kahan_on_or_off_over_float32_params_steps_as_nearest(made_with, stepped_with):
  # Kahan keeps nothing for float32 params (a None per param), so its state and another
  # mode's differ only by that: a nearest state stepped with Kahan failed on a bare pytree
  # structure error, and a Kahan state with nearest was refused as carrying a compensation.
  params = _params()
  state = osf.safefactor(0.1, param_rounding=made_with).init(params)
  updates, _ = osf.safefactor(0.1, param_rounding=stepped_with).update(params, state, params)
  expected, _ = osf.safefactor(0.1).update(params, osf.safefactor(0.1).init(params), params)
  jax.tree.map(np.testing.assert_array_equal, updates, expected)


@pytest.mark.parametrize("make", [
    lambda: osf.safefactor(0.1, param_rounding="kahan"),
    # with_param_rounding's failed inside the write-back with AttributeError: 'NoneType'
    # object has no attribute 'astype' (a state made before the params were cast).
    lambda: osf.with_param_rounding(optax.sgd(1e-3), "kahan"),
], ids=["safefactor", "with_param_rounding"])
def test_a_kahan_state_made_for_wider_params_names_the_param(make):
  wide = {"w": jnp.ones((130, 130)), "b": jnp.ones((130,))}
  narrow = {"w": jnp.ones((130, 130), jnp.bfloat16), "b": jnp.ones((130,))}
  tx = make()
  with pytest.raises(ValueError, match=r"params\['w'\]: the optimizer state holds no Kahan "
                                       r"compensation for this bfloat16 param"):
    tx.update(narrow, tx.init(wide), narrow)
  with pytest.raises(ValueError, match=r"params\['w'\]: the optimizer state holds a Kahan "
                                       r"compensation for this float32 param"):
    tx.update(wide, tx.init(narrow), wide)


@pytest.mark.parametrize("cast_to", ["float32", "float16"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["safefactor", "with_param_rounding"])
def test_a_compensation_cast_to_another_dtype_is_named(wrapped, cast_to):
  # A state cast whole (to float32 for a checkpoint, say) keeps a wider compensation than
  # the bfloat16 param it compensates; a float16 one a narrower range.
  params = {"w": jnp.ones((4, 3), jnp.bfloat16), "b": jnp.ones((3,))}
  tx = (osf.with_param_rounding(optax.sgd(0.1), "kahan") if wrapped
        else osf.safefactor(0.1, param_rounding="kahan"))
  state = tx.init(params)
  holder = state if wrapped else state.inner_state
  cast = holder._replace(compensation={"w": holder.compensation["w"].astype(cast_to), "b": None})
  state = cast if wrapped else state._replace(inner_state=cast)
  with pytest.raises(TypeError, match=re.escape(
      f"params['w']: the Kahan compensation in the optimizer state is {cast_to}, but it is "
      "kept in the param's dtype, bfloat16: make the state with this optimizer's init for "
      "these params, and do not cast the optimizer state")):
    tx.update(params, state, params)


@pytest.mark.parametrize("made,used", [("nearest", "kahan"), ("kahan", "nearest")])
def test_with_param_rounding_refuses_a_state_of_another_mode(made, used):
  params = _bf16_params()
  state = osf.with_param_rounding(optax.sgd(0.1), made).init(params)
  with pytest.raises(ValueError, match=r"mode='kahan'.*on the with_param_rounding state"):
    osf.with_param_rounding(optax.sgd(0.1), used).update(params, state, params)


@pytest.mark.parametrize("kwargs,condition", [
    ({}, r"this optimizer has multiply_by_parameter_scale=True \(the update is scaled by each "
         r"param's RMS\)$"),
    (dict(multiply_by_parameter_scale=False, weight_decay_rate=1e-3),
     r"this optimizer has weight_decay_rate is set \(the decay is a fraction of each param\)$"),
    (dict(multiply_by_parameter_scale=False, param_rounding="stochastic"),
     r"this optimizer has param_rounding='stochastic' \(the update is rounded onto each "
     r"param\)$"),
])
def test_the_missing_params_error_names_the_setting_that_reads_them(kwargs, condition):
  params = _params()
  tx = osf.safefactor(0.1, **kwargs)
  with pytest.raises(ValueError, match=r"needs params in update\(grads, state, params\): "
                                       + condition):
    tx.update(params, tx.init(params))


@pytest.mark.parametrize("made,used,message", [
    (dict(skip_nonfinite_steps=False), {},
     r"expected a SkipNonfiniteState from this optimizer's init, got an AdafactorState; "
     r"safefactor\(\.\.\., skip_nonfinite_steps=False\)"),
    ({}, dict(skip_nonfinite_steps=False),
     r"expected an AdafactorState from this optimizer's init, got a SkipNonfiniteState; .*"
     r"skip_nonfinite_steps=True, the default"),
])
def test_a_state_of_another_configuration_says_so(made, used, message):
  params = _params()
  state = osf.safefactor(0.1, **made).init(params)
  with pytest.raises(TypeError, match=message + r".*another configuration"):
    osf.safefactor(0.1, **used).update(params, state, params)


def test_an_accumulation_state_given_to_the_optimizer_it_wraps_says_so():
  params = _params()
  state = osf.accumulate_gradients(osf.safefactor(0.1), 2).init(params)
  with pytest.raises(TypeError, match=r"got an AccumulationState; accumulate_gradients\(\.\.\.\) "
                                      r"makes an AccumulationState \(pass it to that "
                                      r"transformation's update"):
    osf.safefactor(0.1).update(params, state, params)


@pytest.mark.parametrize("wrap,where,part", [
    pytest.param(lambda tx: optax.chain(optax.clip_by_global_norm(1.0), tx), "opt_state[1]",
                 lambda state: state[1], id="chain"),
    pytest.param(lambda tx: optax.MultiSteps(tx, 2), "opt_state.inner_opt_state",
                 lambda state: state.inner_opt_state, id="MultiSteps"),
    pytest.param(lambda tx: optax.inject_hyperparams(lambda learning_rate: tx)(learning_rate=0.1),
                 "opt_state.inner_state", lambda state: state.inner_state,
                 id="inject_hyperparams"),
    pytest.param(lambda tx: optax.chain(optax.chain(tx)), "opt_state[0][0]",
                 lambda state: state[0][0], id="chain-in-chain"),
])
@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_a_wrappers_state_given_to_the_optimizer_it_wraps_names_the_part_to_pass(
    wrap, where, part, guarded):
  # A linen TrainState's opt_state of tx=optax.chain(clip, safefactor), handed to the
  # safefactor alone, was named only by its type: "got a tuple".
  params = _params()
  tx = osf.safefactor(0.1, skip_nonfinite_steps=guarded)
  state = wrap(tx).init(params)
  kind = "SkipNonfiniteState" if guarded else "AdafactorState"
  with pytest.raises(TypeError, match=re.escape(
      f"it holds this optimizer's {kind} at {where}: it is the state of a transformation "
      f"around this optimizer. Pass it to that transformation's update, or only {where} to "
      "this optimizer's") + "$"):
    tx.update(params, state, params)
  updates, _ = tx.update(params, part(state), params)  # the part it names is the one to pass
  assert jax.tree.structure(updates) == jax.tree.structure(params)


def test_a_state_holding_several_of_the_optimizers_kind_names_every_one():
  # An optax.multi_transform of two safefactors, its whole state handed to one of them:
  # the message named the first part's state only, the other part's optimizer's included.
  params = {"w": jnp.ones((3, 4)), "v": jnp.ones((5,))}
  first, second = osf.safefactor(0.1), osf.safefactor(0.01)
  tx = optax.multi_transform({"first": first, "second": second}, {"w": "first", "v": "second"})
  state = tx.init(params)
  where = ["opt_state.inner_states['first'].inner_state",
           "opt_state.inner_states['second'].inner_state"]
  with pytest.raises(TypeError, match=re.escape(
      f"it holds 2 states of this optimizer's kind (SkipNonfiniteState), at {where[0]}, "
      f"{where[1]}: it is the state of a transformation around this optimizer. Pass it to "
      "that transformation's update, or only the one this optimizer's init made to this "
      "optimizer's") + "$"):
    second.update(params, state, params)


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
@pytest.mark.parametrize("abstract", ["grads", "params"])
def test_grads_or_params_with_no_values_are_named(name, abstract):
  # A jax.ShapeDtypeStruct has a shape and a dtype, so it passed the leaf checks and
  # failed deep in the step: "'ShapeDtypeStruct' object has no attribute 'astype'".
  params = _params()
  tx = TRANSFORMATIONS[name].build()
  grads = _abstract(params) if abstract == "grads" else params
  given = params if abstract == "grads" else _abstract(params)
  what = abstract[:-1]
  with pytest.raises(TypeError, match=rf"params\['dense'\]\['bias'\]: {what} is a "
                                      r"jax.ShapeDtypeStruct, a shape with no values.*"
                                      r"jax.eval_shape\(optimizer.update"):
    tx.update(grads, tx.init(params), given)


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_a_restore_target_passed_as_the_state_is_named(name):
  # jax.eval_shape(optimizer.init, params) is orbax's restore target; stepped by mistake
  # it failed on "int() argument must be ... not 'ShapeDtypeStruct'".
  params = _params()
  tx = TRANSFORMATIONS[name].build()
  target = jax.eval_shape(tx.init, params)
  with pytest.raises(TypeError, match=r"opt_state\S*count is a jax.ShapeDtypeStruct.*restore "
                                      r"a checkpoint into"):
    tx.update(params, target, params)


# The pairs jax's differentiation returns, given whole where the gradients belong.
_PAIRS = {
    "value_and_grad": (lambda loss, params: jax.value_and_grad(loss)(params),
                       r"grads is the pair \(value, grads\) that jax.value_and_grad returns.*"
                       r"loss, grads = jax.value_and_grad\(loss_fn\)\(params\)"),
    "value_and_grad_has_aux": (
        lambda loss, params: jax.value_and_grad(lambda p: (loss(p), {"accuracy": 0.5}),
                                                has_aux=True)(params),
        r"grads is the pair \(\(value, aux\), grads\) that jax.value_and_grad returns.*"
        r"\(loss, aux\), grads = jax.value_and_grad\(loss_fn, has_aux=True\)\(params\)"),
    # A Python float in aux: a leaf that is no array, whose error would hide the pair's.
    "grad_has_aux": (
        lambda loss, params: jax.grad(lambda p: (loss(p), {"accuracy": 0.5}),
                                      has_aux=True)(params),
        r"grads is the pair \(grads, aux\) that jax.grad\(..., has_aux=True\) returns.*"
        r"grads, aux = jax.grad\(loss_fn, has_aux=True\)\(params\)"),
}


@pytest.mark.parametrize("pair", sorted(_PAIRS))
@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_a_pair_from_value_and_grad_or_has_aux_is_named(name, pair):
  params = _params()
  tx = TRANSFORMATIONS[name].build()
  make_pair, message = _PAIRS[pair]
  grads = make_pair(lambda p: sum(jnp.sum(leaf ** 2) for leaf in jax.tree.leaves(p)), params)
  with pytest.raises(ValueError, match=message):
    tx.update(grads, tx.init(params), params)


def test_a_pair_whose_first_item_has_more_leaves_than_the_params_is_no_grad_aux_pair():
  # (grads of a larger model, aux): its first item is not these params' gradients, so
  # "step with its first item alone" would only lead to the next mismatch.
  params = _params()
  tx = osf.safefactor(0.1)
  larger = {**jax.tree.map(jnp.ones_like, params), "head": {"kernel": jnp.ones((130, 2))}}
  with pytest.raises(ValueError) as error:
    tx.update((larger, {"accuracy": jnp.float32(0.5)}), tx.init(params), params)
  assert "jax.grad(..., has_aux=True)" not in str(error.value)
  assert "missing from grads: params['dense']['bias']" in str(error.value)


@pytest.mark.parametrize("pair", sorted(_PAIRS))
def test_a_pair_is_named_without_params_too(pair):
  """No params given: the grads are checked against the optimizer state's moments."""
  params = _params()
  tx = osf.safefactor(0.1, multiply_by_parameter_scale=False)
  make_pair, message = _PAIRS[pair]
  grads = make_pair(lambda p: sum(jnp.sum(leaf ** 2) for leaf in jax.tree.leaves(p)), params)
  with pytest.raises(ValueError, match="grads do not match the optimizer state: " + message):
    tx.update(grads, tx.init(params))


def test_a_two_param_tuple_is_no_pair_and_other_mismatches_are_listed():
  """Params that are themselves a pair step; grads that match neither item are listed."""
  params = (jnp.ones((3,)), jnp.ones((2,)))
  tx = osf.safefactor(0.1)
  state = tx.init(params)
  tx.update(params, state, params)
  with pytest.raises(ValueError, match=r"missing from grads: params\[1\]") as error:
    tx.update((jnp.ones((3,)),), state, params)
  assert "pair" not in str(error.value)
  # Both items the params' shape: which is the gradient cannot be told.
  nested = {"w": jnp.ones((3,))}
  with pytest.raises(ValueError, match=r"missing from grads: params\['w'\]; in grads but "
                                       r"not in the optimizer state: params\[0\]\['w'\]"):
    tx.update((nested, nested), tx.init(nested), nested)
  # Three items, the gradients second: no pair, whatever its items hold.
  with pytest.raises(ValueError, match=r"missing from grads: params\['w'\]") as error:
    tx.update((jnp.ones(()), nested, jnp.ones(())), tx.init(nested), nested)
  assert "pair" not in str(error.value)


_TREES = st.recursive(
    st.just(None),
    lambda children: (st.dictionaries(st.sampled_from("abc"), children, min_size=1, max_size=3)
                      | st.lists(children, min_size=1, max_size=2).map(tuple)),
    max_leaves=5,
).filter(lambda tree: tree is not None)


@settings(max_examples=40, deadline=None)
@given(shape_tree=_TREES, pair=st.sampled_from(sorted(_PAIRS)))
def test_any_params_tree_given_as_such_a_pair_is_named(shape_tree, pair):
  """Params of any nesting of dicts and tuples (a tuple of two among them)."""
  leaves, treedef = jax.tree.flatten(shape_tree, is_leaf=lambda x: x is None)
  params = treedef.unflatten([jnp.full((2,), float(i + 1)) for i in range(len(leaves))])
  tx = osf.safefactor(0.1)
  state = tx.init(params)
  tx.update(params, state, params)
  make_pair, message = _PAIRS[pair]
  grads = make_pair(lambda p: sum(jnp.sum(leaf ** 2) for leaf in jax.tree.leaves(p)), params)
  with pytest.raises(ValueError, match=message):
    tx.update(grads, state, params)


@pytest.mark.parametrize("pair", sorted(_PAIRS))
def test_a_pair_is_refused_around_a_transformation_that_would_step_it(pair):
  """optax.sgd steps any tree, a (value, grads) pair included: its updates would then
  fail in optax.apply_updates, far from the cause."""
  params = _params()
  tx = osf.skip_nonfinite(optax.sgd(0.1))
  make_pair, message = _PAIRS[pair]
  grads = make_pair(lambda p: sum(jnp.sum(leaf ** 2) for leaf in jax.tree.leaves(p)), params)
  with pytest.raises(ValueError, match=message):
    tx.update(grads, tx.init(params), params)


@pytest.mark.parametrize("name", TRANSFORMATIONS)
def test_an_optimizer_state_given_for_the_params_or_the_grads_is_named(name):
  # tx.init(opt_state) was refused at the state's int32 count as a param "not floating"
  # (the wrappers of any optax transformation took it and made a state of the state), and
  # a state given for the grads or the params got both trees' leaves listed.
  params = _params()
  tx = TRANSFORMATIONS[name].build()
  state = tx.init(params)
  # optax.chain's state is a plain tuple of its parts' states: the first is named.
  kind = type(state[0] if type(state) is tuple else state).__name__
  article = "an" if kind[0] in "AEIOU" else "a"
  for given_state, holding in ((state, f"{article} {kind}"),
                               (optax.adam(1e-3).init(params), "a ScaleByAdamState")):
    with pytest.raises(TypeError, match=re.escape(
        f"params hold an optimizer state ({holding}), not params: init takes the params the "
        "optimizer is to train, opt_state = optimizer.init(params)")):
      tx.init(given_state)
  with pytest.raises(ValueError, match=re.escape(
      f"grads hold an optimizer state ({article} {kind}), not gradients: call update(grads, "
      "opt_state, params)")):
    tx.update(state, state, params)
  with pytest.raises(ValueError, match=re.escape(
      f"grads do not match params: params hold an optimizer state ({article} {kind}), not "
      "params: call update(grads, opt_state, params)")):
    tx.update(params, state, state)


@pytest.mark.parametrize("name", [name for name in TRANSFORMATIONS
                                  if name != "scale_by_safe_factored_rms"])  # optax.chain's init
def test_init_given_the_grads_too_names_the_call_to_fix(name):
  # Python's message named an inner function: "adafactor.<locals>.init_fn() takes 1
  # positional argument but 2 were given".
  params = _params()
  tx = TRANSFORMATIONS[name].build()
  with pytest.raises(TypeError, match=re.escape(
      "init takes the params only, opt_state = optimizer.init(params); it got 2 arguments "
      "(the gradients go to update(grads, opt_state, params))")):
    tx.init(params, params)


def test_a_state_compared_outside_update_is_not_told_to_call_update():
  # migrate_from_optax compares its params with the optax statistics: "call update(grads,
  # opt_state, params)" would be no advice there.
  from optax_safefactor._src import tree_mismatch
  params = _params()
  state = optax.sgd(0.1, momentum=0.9).init(params)
  message = str(tree_mismatch.mismatch_error(state, params, "optax_state's statistics",
                                             name="params"))
  assert message.startswith("params do not match optax_state's statistics: ")
  assert "update(" not in message


def _variables():
  """A linen model's variables: the params under 'params', the batch statistics beside."""
  params = _params()
  return params, {"params": params,
                  "batch_stats": {"norm": {"mean": jnp.zeros(130), "var": jnp.ones(130)}}}


@pytest.mark.parametrize("name", ["safefactor", "accumulate_gradients", "skip_nonfinite"])
def test_a_larger_trees_state_params_or_grads_are_named(name):
  params, variables = _variables()
  tx = TRANSFORMATIONS[name].build()
  made_by = "the accumulator" if name == "accumulate_gradients" else "the optimizer state"
  if name == "skip_nonfinite":
    # A wrapper of any transformation inits whole variables (an optax.multi_transform
    # inside may train the params and freeze the rest); the first update names the part.
    tx = osf.skip_nonfinite(optax.sgd(0.1))
    with pytest.raises(ValueError, match=re.escape(
        f"grads do not match {made_by}: {made_by} was made for a larger tree, which holds "
        "the grads' leaves under ['params'] (beside 'batch_stats'): make it with init of "
        "that part alone (for linen, init(variables['params']), not init(variables))")):
      tx.update(params, tx.init(variables), params)
  else:
    # safefactor's own init refuses them (tests/test_flax_linen.py).
    with pytest.raises(TypeError, match=re.escape("params['batch_stats'] is linen's")):
      tx.init(variables)
  with pytest.raises(ValueError, match=re.escape(
      "grads do not match params: params hold the grads' leaves under params['params'] "
      "(beside 'batch_stats'): pass params['params']")):
    tx.update(params, tx.init(params), variables)
  with pytest.raises(ValueError, match=r"grads hold the leaves of [a-z ]+ under "
                                       r"grads\['params'\]: step with grads\['params'\] "
                                       r"\(the gradient of linen's whole variables\?\)"):
    tx.update({"params": params}, tx.init(params), params)


def test_a_larger_tree_under_any_dict_key_is_named_without_linen_and_ambiguity_is_listed():
  params = _params()
  tx = osf.safefactor(0.1)
  with pytest.raises(ValueError, match=re.escape(
      "params hold the grads' leaves under params['student']: pass params['student']")
      + "$"):
    tx.update(params, tx.init(params), {"student": params})
  # Under two keys: which one the grads belong to cannot be told.
  with pytest.raises(ValueError, match=r"missing from grads: params\['a'\]"):
    tx.update(params, tx.init(params), {"a": params, "b": params})


def test_a_pair_with_a_first_item_of_three_is_the_plain_value_and_grad():
  """Only has_aux makes the value a pair ((value, aux), grads): three values are a value."""
  params = _params()
  tx = osf.safefactor(0.1)
  values = (jnp.ones(()), jnp.ones(()), jnp.ones(()))
  with pytest.raises(ValueError, match=re.escape(
      "grads is the pair (value, grads) that jax.value_and_grad returns")):
    tx.update((values, params), tx.init(params), params)


@pytest.mark.parametrize("leaf, found", [
    (3, "an int (3)"), (True, "a bool (True)"), ("relu", "a str ('relu')"),
    (object(), "an object (<object objec"),
])
def test_a_models_setting_or_function_among_the_params_is_named_as_such(leaf, found):
  """A whole model given as the params (an Equinox module, a dict with its settings): the
  advice to make such a leaf an array with jnp.asarray, right for a float, was wrong here."""
  tx = osf.safefactor(0.1)
  with pytest.raises(TypeError, match=re.escape(
      f"params['act']: param is {found}") + r".*, not an array: the tree an optimizer is given "
      r"holds the arrays to train alone, .*eqx.filter\(model, eqx.is_inexact_array\); NNX: "
      r"nnx.state\(model, nnx.Param\)"):
    tx.init({"w": jnp.ones((3,)), "act": leaf})


@pytest.mark.parametrize("leaf", [1.0, 2j])
def test_a_python_number_among_the_params_is_told_to_become_an_array(leaf):
  tx = osf.safefactor(0.1)
  with pytest.raises(TypeError, match=re.escape(
      f"params['scale']: param is a {type(leaf).__name__} ({leaf!r}), not an array; make it "
      "one with jnp.asarray (a Python number has no dtype or shape to keep statistics for)")):
    tx.init({"w": jnp.ones((3,)), "scale": leaf})


@pytest.mark.parametrize("make", [lambda: osf.safefactor(0.1),
                                  lambda: osf.accumulate_gradients(optax.sgd(0.1), 2)],
                         ids=["safefactor", "accumulate_gradients"])
def test_an_integer_array_from_an_is_array_filter_names_the_inexact_filter(make):
  """Equinox's examples filter the params with eqx.is_array, which keeps an integer array
  (a step count, indices); the advice named optax's masks alone."""
  with pytest.raises(TypeError, match=re.escape(
      "params['step']: param dtype int32 is not floating or complex; ") + r".*" + re.escape(
      "or leave it out of the params (Equinox: eqx.filter(model, eqx.is_inexact_array), not "
      "eqx.is_array, which keeps integer arrays)")):
    make().init({"w": jnp.ones((3,)), "step": jnp.zeros((), jnp.int32)})


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "3"])
def test_a_count_that_may_be_none_is_still_refused_when_it_is_no_positive_int(value):
  """none_ok lets None through, and nothing else: max_consecutive_skips=0 is no setting."""
  checks.check_positive_int(None, "max_consecutive_skips", none_ok=True)
  checks.check_positive_int(3, "max_consecutive_skips", none_ok=True)
  with pytest.raises(ValueError, match=re.escape(
      f"max_consecutive_skips must be a positive int or None, got {value!r}")):
    checks.check_positive_int(value, "max_consecutive_skips", none_ok=True)
  with pytest.raises(ValueError, match=re.escape(
      f"max_consecutive_skips must be a positive int or None, got {value!r}")):
    osf.safefactor(0.1, max_consecutive_skips=value)


def test_an_equinox_models_integer_array_is_told_the_filter_that_leaves_it_out():
  eqx = pytest.importorskip("equinox")  # the test extra's; not at the core's floors

  class WithCount(eqx.Module):
    linear: eqx.nn.Linear
    count: jax.Array

  model = WithCount(eqx.nn.Linear(3, 4, key=jax.random.key(0)), jnp.zeros((), jnp.int32))
  tx = osf.safefactor(0.1)
  with pytest.raises(TypeError, match=re.escape(
      "params.count: param dtype int32 is not floating or complex; exclude it with "
      "optax.masked or optax.multi_transform, or leave it out of the params (Equinox: "
      "eqx.filter(model, eqx.is_inexact_array)")):
    tx.init(eqx.filter(model, eqx.is_array))
  # The advice works: the count stays out, and filter_grad's None for it is no leaf.
  params = eqx.filter(model, eqx.is_inexact_array)
  grads = eqx.filter_grad(lambda m: jnp.sum(m.linear(jnp.ones(3)) ** 2))(model)
  updates, _ = tx.update(grads, tx.init(params), params)
  stepped = eqx.apply_updates(model, updates)
  assert int(stepped.count) == 0
  assert not np.array_equal(stepped.linear.weight, model.linear.weight)
