"""Bad input gets a clear error naming the parameter path or the argument."""

import jax.numpy as jnp
import optax
import pytest

import optax_safefactor as osf


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
    (dict(clipping_threshold=0.5), "clipping_threshold"),
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


@pytest.mark.parametrize("mistake,error,message", [
    ("optax_state", TypeError, r"optax.adafactor state: convert it with osf.migrate_from_optax"),
    ("swapped", TypeError, r"optimizer state as its first argument"),
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


def test_migrating_a_state_restored_without_target_says_what_to_do():
  params = {"w": jnp.ones((256, 128))}
  restored = [list(x) if isinstance(x, tuple) else x for x in optax.adafactor(0.1).init(params)]
  with pytest.raises(ValueError, match=r"restored without a target.*jax.eval_shape"):
    osf.migrate_from_optax(restored, osf.safefactor(0.1), params)
