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
# # safefactor on a mesh
#
# The optimizer state follows the params' sharding: each factored statistic keeps the
# param's `PartitionSpec` with its reduced axes set to `None`, so a step only all-reduces
# row- and column-sized statistics. On a CPU this notebook makes 8 virtual devices; on a
# TPU or GPU host it uses the real ones.

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
import jax

# Only the CPU backend reads this, so it is harmless on TPU and GPU hosts; it must run
# before JAX starts its backends.
jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf

devices = jax.devices()
print(jax.default_backend(), len(devices), "devices")
model_axis = 4 if len(devices) % 4 == 0 else 1
mesh = jax.make_mesh((len(devices) // model_axis, model_axis), ("data", "model"))
print(mesh)

# %% [markdown]
# ## A partitioned param and its optimizer state

# %%
with jax.set_mesh(mesh):
    params = {
        "kernel": jax.device_put(jnp.ones((512, 1024)), NamedSharding(mesh, P("data", "model"))),
        "bias": jax.device_put(jnp.zeros((1024,)), NamedSharding(mesh, P("model"))),
    }
    tx = osf.safefactor(learning_rate=1e-3, momentum=0.9)
    opt_state = tx.init(params)

moment = opt_state.inner_state.second_moment["kernel"]
print("kernel  ", params["kernel"].shape, params["kernel"].sharding.spec)
print("v_row   ", moment.v_row.shape, moment.v_row.sharding.spec)
print("v_col   ", moment.v_col.shape, moment.v_col.sharding.spec)
print("momentum", opt_state.inner_state.momentum["kernel"].sharding.spec)

# %%
jax.debug.visualize_array_sharding(params["kernel"])

# %%
jax.debug.visualize_array_sharding(moment.v_row)

# %%
jax.debug.visualize_array_sharding(moment.v_col)

# %% [markdown]
# ## The same specs without materialising anything
# `state_partition_specs` gives the `PartitionSpec` tree of the state, for
# `jax.jit(tx.init, out_shardings=...)` and for checkpoint restore targets.

# %%
abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in params.items()}
specs = osf.state_partition_specs(tx, abstract, {"kernel": P("data", "model"), "bias": P("model")})
print(specs.inner_state.second_moment)

# %% [markdown]
# ## A sharded step and its communication

# %%
with jax.set_mesh(mesh):
    update = jax.jit(tx.update)
    grads = jax.tree.map(lambda p: p * 0.01 + 0.001, params)
    updates, new_state = update(grads, opt_state, params)
    hlo = update.lower(grads, opt_state, params).compile().as_text()

collectives = [line.strip()[:110] for line in hlo.splitlines()
               if "all-reduce(" in line or "all-gather(" in line or "all-reduce-start(" in line]
print(len(collectives), "collectives; all-gathers:", sum("all-gather" in c for c in collectives))
for line in collectives:
    print(" ", line)

# %% [markdown]
# ## Several hosts
# On a TPU pod or a multi-host GPU cluster, call `jax.distributed.initialize()` in every
# process first, build the mesh over `jax.devices()` (all hosts' devices), and create global
# arrays, for example with `jax.make_array_from_callback`. Nothing about safefactor changes:
# the skip decision is a global all-reduce, so every host skips the same steps. The test
# suite runs two processes over gloo on one machine to check this.
