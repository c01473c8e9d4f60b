"""Passes and temporaries of a guarded step whose leaves are all unfactored, compiled only.

``python tools/unfactored_step.py --target h100`` compiles, without a device, one train
step (update and ``apply_updates``, params and state donated) of
``safefactor(1e-3, factored=False, ...)`` and of ``optax.adafactor(1e-3, factored=False)``
on 4 leaves of 2048 x 4096 and 4 of 4096, in float32 and bfloat16, and prints each one's
passes (bytes moved over the params' bytes) and temporaries (over the params' bytes).
Run at two commits, it compares them (docs/benchmarks.md, "Unfactored leaves computed
again on H100"). Needs the ``accel`` extra; for a GPU target, ``JAX_PLATFORMS=cpu``.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import optax

import optax_safefactor as osf
from optax_safefactor.benchmarks import common, compiled, targets

CONFIGS = {
    "default": {},
    "momentum 0.9": {"momentum": 0.9},
    "kahan": {"param_rounding": "kahan"},
    "stochastic statistics": {"state_dtype": "bfloat16", "param_rounding": "stochastic"},
}


def shapes(dtype: str) -> dict:
  tree = {f"w{i}": jax.ShapeDtypeStruct((2048, 4096), jnp.dtype(dtype)) for i in range(4)}
  tree.update({f"b{i}": jax.ShapeDtypeStruct((4096,), jnp.dtype(dtype)) for i in range(4)})
  return tree


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", choices=sorted(targets.TARGETS), default="h100")
  target = targets.TARGETS[parser.parse_args().target]
  print("| dtype | optimizer | config | passes | temporaries |\n|---|---|---|---|---|")
  for dtype in ("float32", "bfloat16"):
    tree = shapes(dtype)
    candidates = {("optax.adafactor", "default"): optax.adafactor(1e-3, factored=False)}
    candidates.update({("safefactor", name): osf.safefactor(1e-3, factored=False, **config)
                       for name, config in CONFIGS.items()})
    for (optimizer, config), tx in candidates.items():
      program, _ = compiled.compile_for(target, tx, tree)
      param_bytes = common.nbytes(tree)
      passes = targets.traffic_bytes(target, program) / param_bytes
      temp = program.memory_analysis().temp_size_in_bytes / param_bytes
      print(f"| {dtype} | {optimizer} | {config} | {passes:.2f} | {temp:.3f}x |", flush=True)


if __name__ == "__main__":
  main()
