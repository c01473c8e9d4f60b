"""A small deterministic training run shared by the crash worker and the resume test."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_safefactor as osf

SAVE_EVERY = 3
TOTAL_STEPS = 12
POISONED_STEPS = (2, 7)
TX = osf.safefactor(0.05, momentum=0.9)


def initial():
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(130, 140)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(140,)), jnp.float32)}
  return params, TX.init(params)


def grads_for(step):
  rng = np.random.default_rng(1000 + step)
  grads = {"w": jnp.asarray(rng.normal(size=(130, 140)), jnp.float32),
           "b": jnp.asarray(rng.normal(size=(140,)), jnp.float32)}
  if step in POISONED_STEPS:
    grads["b"] = grads["b"].at[3].set(jnp.nan)
  return grads


@jax.jit
def _update(params, state, grads):
  updates, state = TX.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def train_step(params, state, step):
  return _update(params, state, grads_for(step))
