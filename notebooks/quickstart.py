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
# # safefactor quickstart
#
# `optax_safefactor.safefactor` is Adafactor with the same arguments and results as
# `optax.adafactor`, but safe in float16 and bfloat16, and it skips and counts non-finite
# steps. This notebook trains a small Flax NNX model with it, compares it with
# `optax.adafactor` when the params are float16, and reads the skip counters.

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
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx

import optax_safefactor as osf

print("JAX backend:", jax.default_backend(), "-", len(jax.devices()), "device(s)")

# %% [markdown]
# ## A model and a task
# A two-layer MLP regressing a fixed random function. Half of the hidden units start dead
# (a large negative bias), so their rows of the first weight matrix get zero gradients, which
# is the situation that makes optax's float16 Adafactor divide 0 by 0.

# %%
class MLP(nnx.Module):
    def __init__(self, dtype, rngs):
        self.hidden = nnx.Linear(64, 256, param_dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(256, 8, param_dtype=dtype, rngs=rngs)
        dead = jnp.concatenate([jnp.zeros(128), jnp.full(128, -100.0)]).astype(dtype)
        self.hidden.bias.set_value(dead)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


rng = np.random.default_rng(0)
inputs = jnp.asarray(rng.normal(size=(128, 64)), jnp.float32)
targets = jnp.asarray(np.sin(np.asarray(inputs) @ rng.normal(size=(64, 8)) / 8), jnp.float32)


def train(tx, dtype, steps=100):
    model = MLP(dtype, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(model):
            prediction = model(inputs.astype(dtype)).astype(jnp.float32)
            return jnp.mean((prediction - targets) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer)) for _ in range(steps)], optimizer


# %% [markdown]
# ## float16 params: safefactor against optax.adafactor

# %%
safe_losses, safe_optimizer = train(osf.safefactor(learning_rate=0.05), jnp.float16)
optax_losses, _ = train(optax.adafactor(learning_rate=0.05), jnp.float16)
print(f"safefactor final loss:      {safe_losses[-1]:.4f}")
print(f"optax.adafactor final loss: {optax_losses[-1]:.4f}")

# A NaN ends a line, and optax's loss turns NaN after its first step: its finite steps get
# markers (a lone point draws no line), drawn over safefactor's curve, which starts at the
# same loss, and a dotted line marks its first NaN.
plt.plot(safe_losses, color="C0", label="safefactor")
plt.plot(optax_losses, "o--", color="C3", markersize=7, label="optax.adafactor")
nan_steps = np.flatnonzero(~np.isfinite(optax_losses))
if nan_steps.size:
    plt.axvline(nan_steps[0], color="C3", linestyle=":", label="optax.adafactor: NaN from here")
plt.yscale("log")
plt.xlabel("step")
plt.ylabel("training loss")
plt.title("float16 params")
plt.legend()
plt.show()

# %% [markdown]
# optax's curve is a single point: its loss is NaN from the second step on (the dotted
# line). safefactor keeps its statistics in float32, starts them at an epsilon floor and
# floors every rsqrt.
#
# safefactor's loss jumps after the first step (from about 0.66 to about 9) before it falls.
# That is Adafactor's first step, not a fault: its second-moment decay starts at
# beta2 = 1 - 1**-0.8 = 0, so the first statistics are that step's squared gradient alone
# and the first update is the gradient divided by its own magnitude. Every weight then
# moves by about `learning_rate` times its layer's RMS, however small its gradient was.
# From the second step on the statistics average over steps and the steps shrink to what
# each weight's gradient history supports.

# %% [markdown]
# ## Skipped steps
# A step whose gradient (or anything the optimizer computes from it) is non-finite is
# skipped: the updates are zero, the optimizer state is untouched, and the step is counted.

# %%
params = {"w": jnp.ones((4, 3))}
tx = osf.safefactor(learning_rate=0.1)
state = tx.init(params)
for value in (1.0, jnp.nan, 1.0, jnp.inf):
    updates, state = tx.update({"w": jnp.full((4, 3), value)}, state, params)
    params = optax.apply_updates(params, updates)

print("skipped steps:", int(osf.skipped_steps(state)))
print(osf.nonfinite_summary(state))
print(osf.nonfinite_report(state))
print("safefactor run above:", osf.nonfinite_summary(safe_optimizer.opt_state))
