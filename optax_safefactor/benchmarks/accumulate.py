"""``python -m optax_safefactor bench-accumulate``: accumulate_gradients against optax.MultiSteps.

:func:`optax_safefactor.accumulate_gradients` runs ``inner.update`` only on the
micro-batch that completes a group, and leaves a non-finite micro-batch out;
``optax.MultiSteps`` computes ``inner.update`` on every micro-batch and selects its
outputs. This script measures both around the same ``safefactor``, and ``safefactor``
alone (a step on every micro-batch), on one of the benchmarks' trees (:mod:`.trees`), in
one process with interleaved rounds:

- time per micro-batch: each call of the compiled train step (update and
  ``apply_updates``, params and state donated) is timed on its own; the table gives
  the median over the rounds of the calls that accumulate, of the call that steps,
  and of a whole group divided by its size;
- temporary bytes: ``compiled.memory_analysis().temp_size_in_bytes``, exact;
- compile time: lowering and compiling the train step once.

Every figure is also given as a ratio to ``optax.MultiSteps``'s.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import jax
import numpy as np
import optax

import optax_safefactor as osf
from optax_safefactor.benchmarks import common, trees
from optax_safefactor.benchmarks.common import plural

# The candidate that steps on every call: a group of one.
ALONE = "safefactor alone"


def candidates(every_k: int) -> dict[str, optax.GradientTransformation]:
  """The transformations compared: both accumulations around the same ``safefactor``, and it."""

  def inner():
    return osf.safefactor(1e-3)

  return {
      "accumulate_gradients": osf.accumulate_gradients(inner(), every_k),
      "optax.MultiSteps": optax.MultiSteps(inner(), every_k),
      ALONE: inner(),
  }


def measure(tree: str = "600-leaves", scale: float = 1.0, every_k: int = 4,
            repetitions: int = 5, dtype: str = "float32") -> list[dict]:
  """One row per candidate: times in seconds, temporary bytes, compile seconds."""
  params, grads = trees.params_and_grads(tree, scale, dtype)
  rows, compiled = {}, {}
  for name, tx in candidates(every_k).items():
    # A round runs one whole group of every candidate, interleaved.
    group = 1 if name == ALONE else every_k
    compiled[name] = common.compile_step(common.train_step(tx), params, tx.init(params), grads,
                                         calls_per_round=group)
    rows[name] = {
        "optimizer": name, "tree": tree, "dtype": dtype, "every_k": every_k,
        "params": common.count(params), "leaves": len(jax.tree.leaves(params)),
        "compile_s": compiled[name].compile_s, "temp_bytes": compiled[name].temp_bytes,
    }
    print(f"  compiled {name} in {compiled[name].compile_s:.1f} s", file=sys.stderr, flush=True)
  for name, groups in common.time_rounds(compiled, grads, repetitions).items():
    row = rows[name]
    row["accumulate_s"] = float(np.median(
        [np.median(calls[:-1]) if len(calls) > 1 else np.nan for calls in groups]))
    row["step_s"] = float(np.median([calls[-1] for calls in groups]))
    row["group_s"] = float(np.median([sum(calls) / len(calls) for calls in groups]))
  base = rows["optax.MultiSteps"]
  for row in rows.values():
    for key in ("accumulate_s", "step_s", "group_s", "compile_s", "temp_bytes"):
      if row[key] is not None and base[key]:
        row[f"{key}_ratio"] = row[key] / base[key]
  return list(rows.values())


def _cell(row: dict, key: str, unit: str, factor: float, digits: int) -> str:
  value = row[key]
  if value is None or value != value:  # None or NaN: not applicable
    return "n/a"
  ratio = row.get(f"{key}_ratio")
  suffix = f" ({ratio:.2f}x)" if ratio is not None else ""
  return f"{value * factor:.{digits}f} {unit}{suffix}"


def markdown(rows: Sequence[dict]) -> str:
  lines = ["| optimizer | accumulating micro-batch | stepping micro-batch | "
           "per micro-batch (group mean) | temp bytes | compile |",
           "|---|---|---|---|---|---|"]
  for row in rows:
    lines.append(
        f"| {row['optimizer']} | {_cell(row, 'accumulate_s', 'ms', 1e3, 1)} "
        f"| {_cell(row, 'step_s', 'ms', 1e3, 1)} | {_cell(row, 'group_s', 'ms', 1e3, 1)} "
        f"| {_cell(row, 'temp_bytes', 'MB', 1e-6, 1)} | {_cell(row, 'compile_s', 's', 1, 1)} |")
  return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m optax_safefactor bench-accumulate",
      description="accumulate_gradients against optax.MultiSteps and against safefactor "
                  "alone, each around the same safefactor: time per micro-batch, temporary "
                  "bytes and compile time, with ratios to optax.MultiSteps.")
  parser.add_argument("--tree", choices=sorted(trees.TREES), default="600-leaves",
                      help="the parameter tree, one of the benchmark's (600-leaves)")
  parser.add_argument("--scale", type=common.SCALE, default=1.0,
                      help="widths multiplied by this, in (0, 4] (1.0)")
  parser.add_argument("--every-k", type=common.number_in(int, 2), default=4, metavar="K",
                      help="micro-batches per step, at least 2 (4)")
  parser.add_argument("--repetitions", type=common.REPETITIONS, default=5, metavar="N",
                      help="timed groups per candidate after one warm-up group (5)")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                      help="dtype of the params and gradients (float32)")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  print(common.backend_summary(), file=sys.stderr)
  rows = measure(args.tree, args.scale, args.every_k, args.repetitions, args.dtype)
  first = rows[0]
  print(f"{first['tree']} ({first['params'] / 1e6:.3g}M params, {first['leaves']} leaves), "
        f"{first['dtype']}, every_k={first['every_k']}, "
        f"median of {plural(args.repetitions, 'group')}; ratios to optax.MultiSteps in brackets")
  print(markdown(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
