"""The wrappers (with_param_rounding, accumulate_gradients, skip_nonfinite) name the mistake.

safefactor's own update turns swapped arguments, a foreign state, a Python number for a
leaf and a grad of the wrong shape into messages that name the argument or the
parameter path; the wrappers used to fail with a raw AttributeError or a broadcasting
error instead. They share safefactor's checks (``_src/checks.py``), so the messages are
the same across the library.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf

MODES = ("nearest", "stochastic", "kahan")


def _params():
  return {"w": jnp.ones((4, 3), jnp.bfloat16)}


def _grads():
  return {"w": jnp.full((4, 3), 0.5, jnp.bfloat16)}


# --- with_param_rounding -------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_with_param_rounding_names_swapped_arguments(mode):
  tx = osf.with_param_rounding(optax.sgd(1e-3), mode=mode)
  state = tx.init(_params())
  with pytest.raises(TypeError, match=r"first argument; call update\(grads, opt_state, params\)"):
    tx.update(state, _grads(), _params())


def test_with_param_rounding_names_a_foreign_state():
  # The wrapped transformation's own state is the usual slip.
  tx = osf.with_param_rounding(optax.sgd(1e-3))
  with pytest.raises(TypeError, match=r"got a tuple.*init of the with_param_rounding"):
    tx.update(_grads(), optax.sgd(1e-3).init(_params()), _params())


@pytest.mark.parametrize("mode", MODES)
def test_with_param_rounding_names_a_python_number_leaf(mode):
  tx = osf.with_param_rounding(optax.sgd(1e-3), mode=mode)
  with pytest.raises(TypeError, match=r"params\['w'\]: param is a float \(1.0\), not an array"):
    tx.init({"w": 1.0})
  state = tx.init(_params())
  with pytest.raises(TypeError, match=r"params\['w'\]: grad is a float \(1.0\), not an array"):
    tx.update({"w": 1.0}, state, _params())


@pytest.mark.parametrize("mode", MODES)
def test_with_param_rounding_names_a_grad_of_the_wrong_shape(mode):
  tx = osf.with_param_rounding(optax.sgd(1e-3), mode=mode)
  state = tx.init(_params())
  grads = {"w": jnp.ones((3, 4), jnp.bfloat16)}
  message = r"params\['w'\]: grad shape \(3, 4\) != param shape \(4, 3\)"
  with pytest.raises(ValueError, match=message):
    tx.update(grads, state, _params())
  # Checked on shapes while tracing: the same message under jit.
  with pytest.raises(ValueError, match=message):
    jax.jit(tx.update)(grads, state, _params())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reshape, shape", [
    (lambda u: u[:2], r"\(2, 3\)"), (lambda u: jnp.concatenate([u, u]), r"\(8, 3\)")],
    ids=["smaller", "larger"])
def test_with_param_rounding_names_an_inner_update_of_the_wrong_shape(mode, reshape, shape):
  # It broadcast in the write-back, or failed there with a bare "incompatible shapes".
  reshaped = optax.GradientTransformation(
      lambda params: optax.EmptyState(),
      lambda updates, state, params=None: (jax.tree.map(reshape, updates), state))
  tx = osf.with_param_rounding(reshaped, mode=mode)
  with pytest.raises(ValueError, match=r"params\['w'\]: the inner transformation's update "
                                       rf"has shape {shape}, its param \(4, 3\)"):
    tx.update(_params(), tx.init(_params()), _params())


@pytest.mark.parametrize("mode", MODES)
def test_with_param_rounding_leaves_dtypes_to_the_inner_transformation(mode):
  # The checks refuse non-arrays and wrong shapes only: float32 grads for bfloat16
  # params and an integer leaf that the inner transformation zeroes still work.
  inner = optax.multi_transform({"sgd": optax.sgd(1e-3), "zero": optax.set_to_zero()},
                                {"w": "sgd", "n": "zero"})
  tx = osf.with_param_rounding(inner, mode=mode)
  params = {"w": jnp.ones((4, 3), jnp.bfloat16), "n": jnp.arange(3, dtype=jnp.int32)}
  grads = {"w": jnp.full((4, 3), -1.0, jnp.float32), "n": jnp.zeros(3, jnp.int32)}
  updates, _ = tx.update(grads, tx.init(params), params)
  assert updates["n"].dtype == jnp.int32 and not np.any(np.asarray(updates["n"]))


# --- accumulate_gradients and skip_nonfinite ------------------------------------------------


def test_accumulate_gradients_names_a_grad_of_the_wrong_shape():
  tx = osf.accumulate_gradients(osf.safefactor(1e-3), 2)
  state = tx.init(_params())
  message = r"params\['w'\]: grad shape \(3, 4\) != param shape \(4, 3\)"
  with pytest.raises(ValueError, match=message):
    tx.update({"w": jnp.ones((3, 4), jnp.bfloat16)}, state, _params())
  with pytest.raises(ValueError, match=message):
    jax.jit(tx.update)({"w": jnp.ones((3, 4), jnp.bfloat16)}, state, _params())
  # A grad that would broadcast into the accumulator is refused too, without params.
  with pytest.raises(ValueError, match=r"params\['w'\]: grad shape \(1, 3\) != param shape"):
    tx.update({"w": jnp.ones((1, 3), jnp.bfloat16)}, state)


def test_skip_nonfinite_names_a_python_number_leaf():
  tx = osf.skip_nonfinite(optax.sgd(1e-3))
  state = tx.init(_params())
  with pytest.raises(TypeError, match=r"params\['w'\]: grad is a float \(1.0\), not an array"):
    tx.update({"w": 1.0}, state, _params())
  with pytest.raises(TypeError, match=r"params\['w'\]: param is a float \(1.0\), not an array"):
    tx.init({"w": 1.0})


def test_skip_nonfinite_names_a_grad_of_the_wrong_shape():
  tx = osf.skip_nonfinite(optax.sgd(1e-3))
  with pytest.raises(ValueError, match=r"params\['w'\]: grad shape \(3, 4\) != param shape"):
    tx.update({"w": jnp.ones((3, 4), jnp.bfloat16)}, tx.init(_params()), _params())


def test_skip_nonfinite_names_an_optax_adafactor_state_as_a_wrapped_state():
  # Not the safefactor hint (migrate_from_optax makes no skip_nonfinite state).
  tx = osf.skip_nonfinite(optax.adafactor(1e-3))
  with pytest.raises(TypeError, match=r"SkipNonfiniteState.*init of the skip_nonfinite") as caught:
    tx.update(_grads(), optax.adafactor(1e-3).init(_params()), _params())
  assert "migrate_from_optax" not in str(caught.value)


# --- construction: not a transformation -----------------------------------------------------


class _Factories:
  @staticmethod
  def adamw(learning_rate):
    return optax.adamw(learning_rate)


@pytest.mark.parametrize("build, message", [
    (lambda: osf.skip_nonfinite(optax.sgd),
     r"skip_nonfinite: inner must be an optax GradientTransformation.*got the function "
     r"optax\.sgd; call it: optax\.sgd\(learning_rate\)"),
    (lambda: osf.accumulate_gradients(osf.safefactor, 2),
     r"accumulate_gradients: inner must be .*got the function osf\.safefactor; call it: "
     r"osf\.safefactor\(learning_rate\)"),
    (lambda: osf.with_param_rounding(1e-3),
     r"with_param_rounding: inner must be .*got a float \(0\.001\)"),
    (lambda: osf.skip_nonfinite(optax.MultiSteps),
     r"got the class optax\.MultiSteps; call it: optax\.MultiSteps\("),
    # A tree of arrays was printed whole, burying the message; a long list too.
    (lambda: osf.accumulate_gradients({"w": jnp.ones((300, 200)), "b": jnp.ones(200)}, 2),
     r"inner must be .*got a dict holding 2 arrays: the params, or an optimizer's state, in "
     r"inner's place\?$"),
    (lambda: osf.skip_nonfinite(list(range(1000))),
     r"got a list \(\[0, 1, 2, 3, 4, 5, \.\.\.\]\)$"),
    (lambda: osf.skip_nonfinite(3), r"got an int \(3\)$"),
    # A user's factory is named where it is defined: a bare "adamw" would read as optax's.
    (lambda: osf.skip_nonfinite(_Factories.adamw),
     r"got the function _Factories\.adamw; call it: _Factories\.adamw\(learning_rate\)$"),
], ids=["factory", "safefactor_factory", "number", "class", "params", "long", "int",
        "users_factory"])
def test_wrappers_refuse_what_is_not_a_transformation_at_construction(build, message):
  with pytest.raises(TypeError, match=message):
    build()


def test_wrappers_accept_any_object_with_init_and_update():
  # optax accepts optax.MultiSteps itself (not a GradientTransformation): so do they.
  params = {"w": jnp.ones((4, 3))}
  for tx in (osf.skip_nonfinite(optax.MultiSteps(optax.sgd(0.1), 2)),
             osf.with_param_rounding(optax.MultiSteps(optax.sgd(0.1), 2)),
             osf.accumulate_gradients(optax.MultiSteps(optax.sgd(0.1), 2), 2)):
    with jax.numpy_dtype_promotion("standard"):  # MultiSteps mixes int and float counts
      tx.update(params, tx.init(params), params)


@pytest.mark.parametrize("seed,error", [
    ("0", TypeError), (1.5, TypeError), (2**70, ValueError),
    # An array must be an integer scalar, as optax.inject_hyperparams hands an int over.
    (np.array(1.5, np.float32), TypeError), (np.array([1, 2]), TypeError)])
def test_with_param_rounding_checks_its_seed_as_safefactor_does(seed, error):
  # A string or float seed failed inside the first update with JAX's own dtype errors, and
  # 2**70 silently drew the bits of seed 0.
  with pytest.raises(error, match=r"^seed must (be an int|fit in 64 bits)"):
    osf.with_param_rounding(optax.sgd(1e-3), seed=seed)
  with pytest.raises(error, match=r"^rounding_seed must (be an int|fit in 64 bits)"):
    osf.safefactor(1e-3, param_rounding="stochastic", rounding_seed=seed)


def test_skip_nonfinite_leaves_dtypes_to_the_inner_transformation():
  # An integer leaf (a step counter kept with the params, say) is the inner
  # transformation's business: optax.set_to_zero takes it, so the guard must too.
  params = {"w": jnp.ones((3,)), "step": jnp.zeros((), jnp.int32)}
  tx = osf.skip_nonfinite(optax.set_to_zero())
  state = tx.init(params)
  grads = {"w": jnp.full((3,), jnp.nan), "step": jnp.zeros((), jnp.int32)}
  updates, state = jax.jit(tx.update)(grads, state, params)
  assert int(osf.skipped_steps(state)) == 0
  assert updates["step"].dtype == jnp.int32


def test_skip_nonfinite_takes_its_settings_as_safefactor_does():
  # checked="no" read as True (and then raised CheckedWithoutCheckifyError under jit); a
  # spike window without the spike rule passed silently, where safefactor warns of it.
  with pytest.raises(TypeError, match=r"checked must be True or False, got 'no'"):
    osf.skip_nonfinite(optax.sgd(0.1), checked="no")
  with pytest.warns(UserWarning, match=r"spike_window=16 sets the spike rule's history, and "
                                       r"skip_spikes is not set: it has no effect") as caught:
    osf.skip_nonfinite(optax.sgd(0.1), spike_window=16)
  assert [warning.filename for warning in caught] == [__file__]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    osf.skip_nonfinite(optax.sgd(0.1), spike_window=16, skip_spikes=6.0)


def test_safefactor_names_a_guard_state_around_another_transformation():
  # It failed with AttributeError: 'tuple' object has no attribute 'momentum'.
  params = {"w": jnp.ones(3)}
  state = osf.skip_nonfinite(optax.sgd(0.1)).init(params)
  with pytest.raises(TypeError, match=r"update expected a SkipNonfiniteState around an "
                                      r"AdafactorState from this optimizer's init, got one "
                                      r"around a tuple"):
    osf.safefactor(1e-3).update(params, state, params)


def test_skip_nonfinite_names_grads_of_other_params_than_its_states():
  # The wrapped transformation failed first, with JAX's "pytree structure error: different
  # numbers of pytree children".
  tx = osf.skip_nonfinite(optax.sgd(0.1, momentum=0.9))
  state = tx.init({"w": jnp.ones(3)})
  more = {"w": jnp.ones(3), "b": jnp.ones(2)}
  with pytest.raises(ValueError, match=r"grads do not match the optimizer state: in grads but "
                                       r"not in the optimizer state: params\['b'\]"):
    tx.update(more, state, more)


def test_skip_nonfinite_names_grads_of_other_leaves_than_the_params():
  # Grads that do not match the params go to the wrapped transformation (optax.lookahead
  # takes such grads); one that refuses them, or returns updates not shaped like the
  # params, gets the grads' error, with what it raised or returned as the cause.
  params = {"w": jnp.ones(3), "b": jnp.ones(2)}
  for inner in (optax.sgd(0.1, momentum=0.9), optax.sgd(0.1)):
    tx = osf.skip_nonfinite(inner)
    with pytest.raises(ValueError, match=r"grads do not match params: missing from grads: "
                                         r"params\['b'\]$") as caught:
      tx.update({"w": jnp.ones(3)}, tx.init(params), params)
    assert caught.value.__cause__ is not None


# --- a state the wrapped transformation's init does not make -------------------------------

WRAPPERS = {
    "skip_nonfinite": osf.skip_nonfinite,
    "with_param_rounding": osf.with_param_rounding,
    "accumulate_gradients": lambda inner: osf.accumulate_gradients(inner, 1),
}


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_wrappers_name_a_wrapped_state_of_another_configuration(wrapper, jitted):
  # A notebook's optimizer cell run again with sgd in adam's place, and the old state kept:
  # optax failed with "'TraceState' object has no attribute 'mu'".
  params, grads = {"w": jnp.ones((4, 3))}, {"w": jnp.full((4, 3), 0.5)}
  old = WRAPPERS[wrapper](optax.chain(optax.clip(1.0), optax.sgd(1e-3, momentum=0.9)))
  tx = WRAPPERS[wrapper](optax.chain(optax.clip(1.0), optax.adam(1e-3)))
  update = jax.jit(tx.update) if jitted else tx.update
  with pytest.raises(TypeError) as error:
    update(grads, old.init(params), params)
  assert str(error.value).startswith(
      f"the transformation inside {wrapper}(...) failed on a state its init does not make "
      "for these params (at its state[1][0], a TraceState where the other holds a "
      "ScaleByAdamState): the state was made by another optimizer")
  assert "Make the state with this optimizer's init" in str(error.value)
  assert isinstance(error.value.__cause__, AttributeError)  # optax's own, kept as the cause


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_wrappers_name_a_wrapped_state_with_a_member_fewer(wrapper):
  params, grads = {"w": jnp.ones((4, 3))}, {"w": jnp.full((4, 3), 0.5)}
  old = WRAPPERS[wrapper](optax.adam(1e-3))
  tx = WRAPPERS[wrapper](optax.chain(optax.clip(1.0), optax.adam(1e-3)))
  with pytest.raises(TypeError, match=r"\(at its state\[0\], a ScaleByAdamState where the "
                     r"other holds an EmptyState\)"):
    tx.update(grads, old.init(params), params)


class _Failing(optax.GradientTransformation):
  """sgd whose update fails (``error``) or whose init cannot take the params (``init_fails``)."""

  def __new__(cls, error, init_fails=False):
    sgd = optax.sgd(1e-3, momentum=0.9)  # a state shaped by the params

    def init(params):
      if init_fails and isinstance(params["w"], jax.core.Tracer):  # as under jax.eval_shape
        raise KeyError("only concrete params")
      return sgd.init(params)

    def update(updates, state, params=None):
      raise error

    return super().__new__(cls, init, update)


@pytest.mark.parametrize("init_fails", [False, True], ids=["own-layout", "init-fails"])
@pytest.mark.parametrize("wrapper, with_params", [
    *[(wrapper, True) for wrapper in WRAPPERS],
    # Without params (with_param_rounding needs them), init lays the state out by the grads:
    # given None, it would lay out none.
    ("skip_nonfinite", False), ("accumulate_gradients", False),
])
def test_a_wrapped_update_that_fails_on_its_own_state_raises_its_own_error(
    wrapper, with_params, init_fails):
  params, grads = {"w": jnp.ones((4, 3))}, {"w": jnp.full((4, 3), 0.5)}
  tx = WRAPPERS[wrapper](_Failing(ValueError("the inner transformation's own"), init_fails))
  state = tx.init(params)
  params = params if with_params else None
  # (Under accumulate_gradients' lax.cond, JAX adds a line on its traceback filtering.)
  with pytest.raises(ValueError, match=r"^the inner transformation's own(\n|$)"):
    tx.update(grads, state, params)
