"""Seconds to compile GPT-2 small's step with a bfloat16 momentum, per write-back mode.

``python tools/write_back_compile.py LABEL MODE [MODE ...]`` builds the train step (update +
``apply_updates``, params and state donated) of ``safefactor(1e-3, momentum=0.9,
dtype_momentum="bfloat16", param_rounding=MODE)`` on GPT-2 small's tree in bfloat16, and
compiles it for this machine's default device (its GPU, where it has one) from shapes
alone (nothing is allocated), one mode after the other in this process, printing
``LABEL MODE SECONDS s DEVICE`` for each. Run it in fresh processes, alternating the order
of the modes, and compare the times within a process; point ``PYTHONPATH`` at two checkouts
to compare two versions (the label names which). ``SCALE`` (an environment variable, 1.0 by
default) shrinks the tree's widths as the benchmark's ``--scale`` does. ``TARGET`` (another,
unset by default) names an accelerator of ``python -m optax_safefactor bench --target`` to
compile for without one instead (the accel extra); the line then also gives the program's
fusions and its traffic in passes over the params, as the bench counts them.
"""

from __future__ import annotations

import os
import sys
import time

import jax

import optax_safefactor as osf
from optax_safefactor.benchmarks import common, compiled, targets, trees


def main(label: str, modes: list[str]) -> None:
  scale = float(os.environ.get("SCALE", "1.0"))
  target = targets.TARGETS.get(os.environ.get("TARGET", ""))
  device = jax.devices()[0] if target is None else targets.devices(target.name)[0]
  shapes = trees.shape_structs("gpt2-small", scale, "bfloat16")
  params = compiled._placed(shapes, device)
  for mode in modes:
    tx = osf.safefactor(1e-3, momentum=0.9, dtype_momentum="bfloat16", param_rounding=mode)
    state = compiled._placed(jax.eval_shape(tx.init, params), device)
    start = time.perf_counter()
    program = jax.jit(common.train_step(tx), donate_argnums=(0, 1)).trace(
        params, state, params).lower().compile()
    seconds = time.perf_counter() - start
    figures = "" if target is None else (
        f", {targets.fusions(program.as_text())} fusions, "
        f"{targets.traffic_bytes(target, program) / common.nbytes(shapes):.2f} passes")
    print(f"{label} {mode} {seconds:.2f} s {device.device_kind}{figures}", flush=True)


if __name__ == "__main__":
  if len(sys.argv) < 3:
    sys.exit(__doc__)
  main(sys.argv[1], sys.argv[2:])
