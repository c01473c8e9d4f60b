"""The problem the multi-host test solves, shared by its worker processes and the reference."""

import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec as P

import optax_safefactor as osf

SPECS = {"w": P("data", "model"), "tall": P("model", "data"), "b": P("model"),
         "stack": P(None, "data", "model")}
SHAPES = {"w": (256, 512), "tall": (512, 256), "b": (512,), "stack": (3, 256, 512)}
STEPS = 6
POISONED_STEP = 2
# A finite spike (50 times the gradient) once the spike rule has half a window of history.
SPIKE_STEP = 4
# The one bfloat16 leaf, written back by stochastic rounding: its bits must come from each
# element's global index, whichever process holds the element.
NARROW = "tall"


def make_optimizer():
  return osf.safefactor(
      0.05, momentum=0.9, weight_decay_rate=1e-3, skip_spikes=6.0, spike_window=4,
      param_rounding="stochastic",
      factor_rules=lambda path, shape: ("batch", None, None) if len(shape) == 3 else None,
  )


def host_arrays():
  """Params and per-step grads as NumPy arrays, identical in every process; one step is
  poisoned with a NaN and another is a finite spike, so that both skip decisions must
  agree across processes."""
  rng = np.random.default_rng(0)
  dtypes = {k: ml_dtypes.bfloat16 if k == NARROW else np.float32 for k in SHAPES}
  params = {k: rng.normal(size=s).astype(dtypes[k]) for k, s in SHAPES.items()}
  grads = {k: rng.normal(size=(STEPS, *s)).astype(dtypes[k]) for k, s in SHAPES.items()}
  grads["w"][POISONED_STEP, 3, 5] = np.nan
  for grad in grads.values():
    grad[SPIKE_STEP] *= 50
  return params, grads
