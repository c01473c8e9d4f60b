"""``python -m optax_safefactor bench --target tpu-v5e|tpu-v6e|h100|a100``: compiled only.

On an accelerator target the train step (update + ``apply_updates``, params and state
donated) is compiled for that accelerator on this machine, without one, and never run:
its figures are the compiler's, not measured times. Per tree, dtype and configuration,
against ``optax.adafactor`` compiled alike:

* passes: bytes the program moves to and from device memory (``targets.traffic_bytes``)
  / the params' bytes. ``p - lr * g`` moves 3 (any step reads g and p and writes p);
  Adafactor's exact floor and the guarded step's floor are printed beside it
  (:func:`floors`).
* temporaries: XLA's temporary buffers / the params' bytes (``temp_size_in_bytes``; on TPU
  the compiler's buffer assignment shows them to be mostly the handles of on-chip prefetches,
  docs/benchmarks.md, "What XLA:TPU's temporaries are").
* fusions: fused kernels in the optimised program.
* compile: seconds to trace, lower and compile (one compile, in this process).

Nothing is allocated: params, gradients and state are ``jax.ShapeDtypeStruct``s placed on
one device of the target (``targets.devices``).
"""

from __future__ import annotations

import statistics
import textwrap
import time
from collections.abc import Callable, Sequence

import jax
import optax

import optax_safefactor as osf
from optax_safefactor.benchmarks import common, targets, trees

#: safefactor's configurations on an accelerator target, each against optax.adafactor's
#: at the same learning rate and momentum where optax has one.
CONFIGS: dict[str, dict] = {
    "default": {},
    "momentum": {"momentum": 0.9},
    "guard off": {"skip_nonfinite_steps": False},
    "momentum, guard off": {"momentum": 0.9, "skip_nonfinite_steps": False},
    "stochastic": {"param_rounding": "stochastic"},
    "kahan": {"param_rounding": "kahan"},
    "spikes": {"skip_spikes": 6.0},
    "unpacked": {"pack_small_leaves": False},
}

#: The configurations a run measures by default (--configs).
DEFAULT_CONFIGS = ("default", "momentum", "guard off", "momentum, guard off", "stochastic",
                   "kahan")

# The optax configuration each of safefactor's is compared with.
_OPTAX_MOMENTUM = {name: config.get("momentum") for name, config in CONFIGS.items()}


def _placed(tree, device) -> dict:
  sharding = jax.sharding.SingleDeviceSharding(device)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def compile_for(target: targets.Target, tx: optax.GradientTransformation, shapes: dict):
  """``(compiled, seconds)``: the train step of ``tx`` on ``shapes`` compiled for ``target``."""
  device = targets.devices(target.name)[0]
  params = _placed(shapes, device)
  state = _placed(jax.eval_shape(tx.init, params), device)
  start = time.perf_counter()
  compiled = jax.jit(common.train_step(tx), donate_argnums=(0, 1)).trace(
      params, state, params).lower().compile()
  return compiled, time.perf_counter() - start


def floors(shapes: dict, momentum: bool, guarded: bool) -> dict[str, float]:
  """The least traffic, in passes over the params' bytes, of steps on ``shapes``.

  ``copy``: any step that reads g and p and writes p (3). ``adafactor``: the exact
  Adafactor step (``bench.minimum_traffic_bytes``: a factored leaf's gradient read for
  its statistics, its clipping and its update, its param read for its scale and its
  update and written; momentum read and written once). ``guarded``: with the skip guard,
  whose verdict reads every leaf's statistics before any leaf is written, the old
  momentum is read once more for its finiteness check (numerics rule 5: a NaN in the
  state must skip the step).
  """
  from optax_safefactor.benchmarks import bench

  param_bytes = common.nbytes(shapes)
  exact = bench.minimum_traffic_bytes(shapes, momentum) / param_bytes
  momentum_read = 4 * common.count(shapes) / param_bytes if momentum and guarded else 0.0
  return {"copy": 3.0, "adafactor": exact, "guarded": exact + momentum_read}


def measure(target_name: str, tree: str, dtype_name: str, scale: float,
            configs: Sequence[str], progress: Callable[[str], None] = lambda _: None
            ) -> list[dict]:
  """One row per optimizer and configuration: see the module's docstring."""
  from optax_safefactor.benchmarks import bench

  target = targets.TARGETS[target_name]
  shapes = trees.shape_structs(tree, scale, dtype_name)
  param_bytes = common.nbytes(shapes)
  candidates = {}
  for name in configs:
    momentum = _OPTAX_MOMENTUM[name]
    optax_name = "momentum" if momentum is not None else "default"
    if ("optax.adafactor", optax_name) not in candidates:
      candidates[("optax.adafactor", optax_name)] = optax.adafactor(1e-3, momentum=momentum)
    candidates[("safefactor", name)] = osf.safefactor(1e-3, **CONFIGS[name])
  factored_leaves = sum(bench.is_factored(shapes))
  rows = []
  for (optimizer, config), tx in candidates.items():
    progress(f"{target.name} {tree} {dtype_name} {config}: {optimizer}")
    compiled, seconds = compile_for(target, tx, shapes)
    text = compiled.as_text()
    memory = compiled.memory_analysis()
    settings = CONFIGS.get(config, {})
    rows.append({
        "target": target.name, "tree": tree, "dtype": dtype_name, "config": config,
        "optimizer": optimizer, "params": common.count(shapes),
        "leaves": len(jax.tree.leaves(shapes)),
        "factored_leaves": factored_leaves,
        "passes": targets.traffic_bytes(target, compiled) / param_bytes,
        "temp": (None if memory is None else memory.temp_size_in_bytes / param_bytes),
        "fusions": targets.fusions(text), "compile_s": seconds,
        "control_flow": targets.control_flow(text),
        "floors": floors(shapes, "momentum" in settings or config == "momentum",
                         settings.get("skip_nonfinite_steps", True)
                         and optimizer == "safefactor"),
    })
  by_config = {row["config"]: row for row in rows if row["optimizer"] == "optax.adafactor"}
  for row in rows:
    base = by_config["momentum" if _OPTAX_MOMENTUM.get(row["config"]) else "default"]
    row["passes_ratio"] = row["passes"] / base["passes"]
    row["compile_ratio"] = row["compile_s"] / base["compile_s"]
  return rows


def median_of_processes(runs: Sequence[Sequence[dict]]) -> list[dict]:
  """The rows of one tree and dtype measured in several processes, as one set of rows.

  Rows are matched by configuration and optimizer (the processes may compile them in
  different orders), and come out in the first run's order. The compiler's figures
  (passes, temporaries, fusions) must be the same in every run; the compile time is each
  row's median over the runs, and its ratio the median of the ratios to optax's taken
  within each run (one process shares its warm-up and its load between the two).
  ``compile_runs`` and ``compile_ratio_runs`` keep every run's seconds and ratio.

  >>> row = {"config": "default", "optimizer": "safefactor", "passes": 5.9, "temp": 0.0,
  ...        "fusions": 9}
  >>> runs = [[dict(row, compile_s=s, compile_ratio=r)] for s, r in ((8, 1.2), (6, 1.0),
  ...                                                                (9, 1.4))]
  >>> [(r["compile_s"], r["compile_ratio"], r["compile_runs"]) for r in median_of_processes(runs)]
  [(8, 1.2, [8, 6, 9])]
  """
  def key(row):
    return row["config"], row["optimizer"]

  counts = sorted({len(run) for run in runs})
  if len(counts) > 1:
    raise ValueError(f"the processes compiled {' and '.join(map(str, counts))} steps: not one "
                     "program")
  by_run = [{key(row): row for row in run} for run in runs]
  combined = []
  for row in runs[0]:
    if any(key(row) not in rows for rows in by_run):
      raise ValueError(f"{row['config']} / {row['optimizer']}: not compiled by every process: "
                       "not one program")
    same = [rows[key(row)] for rows in by_run]
    for other in same[1:]:
      for figure in ("passes", "temp", "fusions"):
        if other[figure] != row[figure]:
          raise ValueError(f"{row['config']} / {row['optimizer']}: {figure} differs between "
                           f"processes ({row[figure]} and {other[figure]}): not one program")
    combined.append(dict(row, compile_s=statistics.median(r["compile_s"] for r in same),
                         compile_ratio=statistics.median(r["compile_ratio"] for r in same),
                         compile_runs=[r["compile_s"] for r in same],
                         compile_ratio_runs=[r["compile_ratio"] for r in same]))
  return combined


def rotated(configs: Sequence[str], process: int) -> list[str]:
  """``configs`` in the order process ``process`` compiles them: each takes its turn first.

  A process compiles every step one after another, and a step's compile time depends on
  what the process compiled before it (on H100 by up to tens of percent), so the processes
  of one run start at different configurations.

  >>> for process in range(3):
  ...   print(rotated(["default", "stochastic", "kahan"], process))
  ['default', 'stochastic', 'kahan']
  ['stochastic', 'kahan', 'default']
  ['kahan', 'default', 'stochastic']
  """
  turn = process % len(configs)
  return [*configs[turn:], *configs[:turn]]


COLUMNS = ("target", "tree", "dtype", "config", "optimizer", "passes (ratio)",
           "floors: exact / guarded", "temporaries", "fusions", "compile (ratio)")


def markdown_header() -> str:
  return "| " + " | ".join(COLUMNS) + " |\n" + "|" + "---|" * len(COLUMNS)


def markdown_rows(rows: Sequence[dict]) -> str:
  lines = []
  for r in rows:
    temp = "n/a" if r["temp"] is None else f"{r['temp']:.3f}"
    flags = " (control flow: TPU count partial)" if r["control_flow"] else ""
    lines.append(
        f"| {r['target']} | {r['tree']} ({r['params'] / 1e6:.3g}M, {r['leaves']} leaves) "
        f"| {r['dtype']} | {r['config']} | {r['optimizer']} "
        f"| {r['passes']:.2f} ({r['passes_ratio']:.2f}x){flags} "
        f"| {r['floors']['adafactor']:.2f} / {r['floors']['guarded']:.2f} | {temp} "
        f"| {r['fusions']} | {r['compile_s']:.1f} s ({r['compile_ratio']:.2f}x{_spread(r)}) |")
  return "\n".join(lines)


def _spread(row: dict) -> str:
  ratios = row.get("compile_ratio_runs") or []
  return f"; {min(ratios):.2f}x-{max(ratios):.2f}x" if len(ratios) > 1 else ""


LEGEND = """Compiled for the target on this machine, without the accelerator, and never run:
every figure is the compiler's. passes: bytes moved to and from device memory / the params'
bytes (TPU: HBM bytes read off the optimised program's memory spaces; GPU: XLA's cost
analysis of the GPU program); 3.00 is p - lr * g, the least any step moves. ratio: to
optax.adafactor's at the same learning rate and momentum. floors: the exact Adafactor
step's least traffic, and the guarded step's (the old momentum read once more for the
skip's check). temporaries: XLA's temporary buffers / the params' bytes. compile: trace,
lower and compile in this process (one compile each: tens of percent between runs), or with
--processes N the median over N fresh processes, each starting at another configuration,
with the least and the most of the processes' ratios."""


def legend(rows: Sequence[dict]) -> str:
  """:data:`LEGEND`, and a note naming the trees of ``rows`` that have no factored leaf.

  >>> print(legend([{"tree": "gpt2-small", "factored_leaves": 0}]).splitlines()[-2])
  Note: no leaf of gpt2-small is factored at this --scale: every second moment is full size, so
  """
  unfactored = sorted({row["tree"] for row in rows if row["factored_leaves"] == 0})
  if not unfactored:
    return LEGEND
  note = (f"no leaf of {', '.join(unfactored)} is factored at this --scale: every second "
          "moment is full size, so these rows do not measure the factored step that "
          "full-size models take.")
  return LEGEND + "\n" + textwrap.fill(note, width=96, initial_indent="Note: ",
                                        subsequent_indent="  ")

