# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Switch a running optax.adafactor job to safefactor
#
# A job trained with `optax.adafactor` saves a checkpoint. We restore it, convert the optimizer
# state with `osf.migrate_from_optax`, and continue with safefactor. On healthy float32
# inputs the continued run matches what optax would have done.

# %%
import sys

if "google.colab" in sys.modules:  # only in Colab: install the package
    import subprocess

    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "optax-safefactor[demo]"],
                   check=True)

# %%
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import optax_safefactor as osf

rng = np.random.default_rng(0)
params = {"w": jnp.asarray(rng.normal(size=(256, 128)), jnp.float32),
          "b": jnp.zeros((128,), jnp.float32)}


def grads_at(step):
    step_rng = np.random.default_rng(step)
    return {k: jnp.asarray(step_rng.normal(size=v.shape), jnp.float32) for k, v in params.items()}


# %% [markdown]
# ## The running job: 20 steps of optax.adafactor, then a checkpoint

# %%
old_tx = optax.adafactor(learning_rate=0.01, momentum=0.9)
old_state = old_tx.init(params)
job_params = params
for step in range(20):
    updates, old_state = old_tx.update(grads_at(step), old_state, job_params)
    job_params = optax.apply_updates(job_params, updates)

directory = pathlib.Path(tempfile.mkdtemp()) / "step20"
checkpointer = ocp.StandardCheckpointer()
checkpointer.save(directory, {"params": job_params, "opt_state": old_state})
checkpointer.wait_until_finished()
print("saved", directory)

# %% [markdown]
# ## Restore, convert, continue with safefactor

# %%
restored = checkpointer.restore(directory, jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                                        {"params": job_params,
                                                         "opt_state": old_state}))
tx = osf.safefactor(learning_rate=0.01, momentum=0.9)
state = osf.migrate_from_optax(restored["opt_state"], tx, restored["params"])
print("count carried over:", int(optax.tree_utils.tree_get(state, "count")))

new_params = restored["params"]
for step in range(20, 30):
    updates, state = tx.update(grads_at(step), state, new_params)
    new_params = optax.apply_updates(new_params, updates)

# %% [markdown]
# ## Check: the same 10 steps with optax

# %%
reference_params, reference_state = job_params, old_state
for step in range(20, 30):
    updates, reference_state = old_tx.update(grads_at(step), reference_state, reference_params)
    reference_params = optax.apply_updates(reference_params, updates)

for name in params:
    difference = float(jnp.max(jnp.abs(new_params[name] - reference_params[name])))
    print(f"{name}: max |safefactor - optax| = {difference:.2e}")
    assert difference < 1e-5
print(osf.nonfinite_summary(state))
