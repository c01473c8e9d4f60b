# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
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
# Installs optax-safefactor when it is not installed yet (as on Colab): from a wheel uploaded
# to the working folder if there is one (the newest optax_safefactor-*.whl), else from PyPI.
# Does nothing when the package is already importable.
import importlib.util

if importlib.util.find_spec("optax_safefactor") is None:
    import pathlib
    import subprocess
    import sys

    # A second upload of the same file is saved as "name (1).whl", which pip refuses.
    wheels = [p for p in pathlib.Path().glob("optax_safefactor-*.whl") if " " not in p.name]
    wheels.sort(key=lambda p: p.stat().st_mtime)
    source = f"{wheels[-1].resolve()}[demo]" if wheels else "optax-safefactor[demo]"
    print("Installing", source)
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", source])
    importlib.invalidate_caches()
    if installed.returncode != 0 or importlib.util.find_spec("optax_safefactor") is None:
        print(
            f"Could not install {source}.\n"
            "To get a wheel: clone the repository, run `pip install build && python -m build`\n"
            "in it, and upload dist/optax_safefactor-*.whl to this notebook's working folder\n"
            "(on Colab: the folder icon on the left, then the upload button). Then run this\n"
            "cell again."
        )
        raise ModuleNotFoundError("optax_safefactor is not installed: see the message above")

# %%
import pathlib
import shutil
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

# %% [markdown]
# ## Clean up: remove the demonstration checkpoint

# %%
shutil.rmtree(directory.parent)
