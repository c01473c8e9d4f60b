"""``python -m optax_safefactor bench``: safefactor against optax.adafactor, as ratios.

For each model-shaped parameter tree and dtype, every optimizer is compiled into the same
train step (update + apply), timed with interleaved repetitions in one process, and
reported against ``optax.adafactor`` at the same configuration: step time (min / median /
max over the repetitions), compile time, temporary bytes (``compiled.memory_analysis()``),
optimizer-state bytes against the theoretical minimum, the fraction of a plain
scale-copy roofline (``p - lr * g``: the least memory traffic any optimizer step has)
achieved, and the fraction of that copy's bandwidth achieved on the least traffic an
Adafactor step needs (:func:`minimum_traffic_bytes`). :data:`LEGEND` explains each
column; it is printed under the table. Runs unchanged on CPU, GPU and TPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_safefactor as osf
from optax_safefactor.benchmarks import common, compiled, targets, trees
from optax_safefactor.benchmarks.common import HelpFormatter, format_range, plural, wrap


def second_moments(params: dict) -> list:
  """Per leaf of ``params``, the second moment ``safefactor`` keeps for it, as shapes.

  A :class:`~optax_safefactor.FactoredMoment` (row and column statistics) or a
  :class:`~optax_safefactor.FullMoment` (one per element), from ``init`` traced by
  ``jax.eval_shape`` (nothing allocated): the library's own factoring rule, not a copy of
  it that could drift.
  """
  state = jax.eval_shape(osf.safefactor(1e-3).init, params)
  moments = optax.tree_utils.tree_get(state, "second_moment")
  return jax.tree.leaves(
      moments, is_leaf=lambda x: isinstance(x, (osf.FactoredMoment, osf.FullMoment)))


def is_factored(params: dict) -> list[bool]:
  """Per leaf of ``params``: whether ``safefactor`` factors its second moment."""
  return [isinstance(moment, osf.FactoredMoment) for moment in second_moments(params)]


def minimum_state_bytes(params: dict, momentum: bool) -> int:
  """float32 rows + columns per factored leaf, the full size per other leaf, a few scalars."""
  total = 64
  for p, moment in zip(jax.tree.leaves(params), second_moments(params), strict=True):
    # The statistics' count at 4 bytes each: a factored leaf's rows and columns (one drops
    # the largest axis, the other the second largest), or every element of another leaf.
    total += 4 * common.count(moment)
    if momentum:
      total += 4 * p.size
  return total


def minimum_traffic_bytes(params: dict, momentum: bool) -> int:
  """Bytes any Adafactor step (clipping and parameter scale on) must move through memory.

  A factored leaf reads its gradient three times: for the row and column statistics,
  for the clipping RMS of the gradient scaled by them, and for the update, scaled by
  that RMS. The parameter is read twice (its RMS, the update) and written once. An
  unfactored leaf's scale is elementwise, so its clipping RMS comes in the first pass:
  two gradient reads, and its full-size statistic is read, written and read again.
  Momentum is read and written once. The scale-copy roofline moves 3 parameter sizes.
  """
  total = 0
  for p, factored in zip(jax.tree.leaves(params), is_factored(params), strict=True):
    size = p.dtype.itemsize * p.size
    if factored:
      total += 3 * size + 3 * size
    else:
      total += 2 * size + 3 * 4 * p.size + 3 * size
    if momentum:
      total += 2 * 4 * p.size
  return total


# The key of the scale-copy among the compiled steps.
COPY = "scale-copy"


# The settings each optimizer is measured with (every row is one of these).
CONFIGS = {
    "default": dict(learning_rate=1e-3),
    "momentum": dict(learning_rate=1e-3, momentum=0.9),
}


def measure(tree: str, dtype_name: str, scale: float, repetitions: int) -> list[dict]:
  params, grads = trees.params_and_grads(tree, scale, dtype_name)
  candidates = {}
  for config_name, config in CONFIGS.items():
    candidates[("optax.adafactor", config_name)] = optax.adafactor(**config)
    candidates[("safefactor", config_name)] = osf.safefactor(**config)
    candidates[("safefactor, guard off", config_name)] = osf.safefactor(
        **config, skip_nonfinite_steps=False)
    candidates[("safefactor, unpacked", config_name)] = osf.safefactor(
        **config, pack_small_leaves=False)
    candidates[("safefactor, spikes", config_name)] = osf.safefactor(**config,
                                                                     skip_spikes=6.0)

  compiled, rows = {}, {}
  for key, tx in candidates.items():
    state = tx.init(params)
    compiled[key] = common.compile_step(common.train_step(tx), params, state, grads)
    rows[key] = {
        **common.measured_on(),
        "tree": tree, "dtype": dtype_name, "optimizer": key[0], "config": key[1],
        "compile_s": compiled[key].compile_s, "temp_bytes": compiled[key].temp_bytes,
        "state_bytes": common.nbytes(state),
        "state_minimum_bytes": minimum_state_bytes(params, key[1] == "momentum"),
    }

  def scale_copy(params, state, grads):
    del state
    return jax.tree.map(lambda p, g: p - jnp.asarray(1e-3, p.dtype) * g, params, grads), None

  # Compiled alike and timed in the same rounds, after every optimizer.
  compiled[COPY] = common.compile_step(scale_copy, params, None, grads)
  times = {key: [calls[0] for calls in rounds]
           for key, rounds in common.time_rounds(compiled, grads, repetitions).items()}
  copy_rounds = times.pop(COPY)
  roofline_s = float(np.median(copy_rounds))
  copy_bytes = 3 * common.nbytes(params)
  for key, row in rows.items():
    rounds = times[key]
    row["step_s"] = float(np.median(rounds))
    row["step_s_rounds"] = rounds
    row["copy_s"] = roofline_s
    row["copy_s_rounds"] = copy_rounds
    common.ratio_with_spread(row, "roofline_fraction", copy_rounds, rounds)
    # The copy's bandwidth, against the bandwidth the step achieves on its least traffic.
    row["minimum_traffic_bytes"] = minimum_traffic_bytes(params, key[1] == "momentum")
    row["copy_bytes"] = copy_bytes
    common.ratio_with_spread(row, "bandwidth_fraction", copy_rounds, rounds,
                             factor=row["minimum_traffic_bytes"] / copy_bytes)
  for key, row in rows.items():
    base = rows[("optax.adafactor", key[1])]
    common.ratio_with_spread(row, "step_ratio", row["step_s_rounds"], base["step_s_rounds"])
    row["compile_ratio"] = row["compile_s"] / base["compile_s"]
    if row["temp_bytes"] is not None and base["temp_bytes"]:
      row["temp_ratio"] = row["temp_bytes"] / base["temp_bytes"]
  n_params, factored_leaves = common.count(params), sum(is_factored(params))
  for row in rows.values():
    row["params"] = n_params
    row["leaves"] = len(jax.tree.leaves(params))
    row["factored_leaves"] = factored_leaves
    row["repetitions"] = repetitions
  return list(rows.values())


COLUMNS = ("tree", "dtype", "config", "optimizer", "step", "compile", "temp bytes",
           "state / minimum", "roofline", "bandwidth")

LEGEND = {
    "tree": "the parameter tree, with its parameter count, its number of leaves and how "
            "many of them have a factored second moment; --scale shrinks its widths and "
            "vocabulary.",
    "dtype": "the dtype of the params and of the gradients.",
    "config": "default: learning_rate=1e-3; momentum: the same with momentum=0.9.",
    "optimizer": "optax.adafactor is the reference of every ratio (its own step, compile "
                 "and temp bytes are 1.00x); 'guard off' is safefactor with "
                 "skip_nonfinite_steps=False; 'unpacked' is safefactor with "
                 "pack_small_leaves=False (every leaf stepped alone); 'spikes' is "
                 "safefactor with skip_spikes=6.0 (spike skipping on as well as the "
                 "non-finite guard).",
    "step": "time of one train step (update and apply_updates, compiled, params and state "
            "donated) / optax.adafactor's at the same tree, dtype and config, as "
            "min / median / max. The median is the ratio of the two median times; min and "
            "max are the same ratio taken round by round (each round runs every optimizer "
            "and the copy once, interleaved in this process). Above 0, no upper bound; "
            "lower is faster. A wide range means a noisy machine: a difference between two "
            "medians is clear when their ranges do not overlap.",
    "compile": "seconds to lower and compile the step / optax.adafactor's. One compile "
               "each, so no spread; expect tens of percent between runs. Lower is better.",
    "temp bytes": "XLA's temporary buffers for one step (compiled.memory_analysis()) / "
                  "optax.adafactor's; exact, no spread. n/a where the backend reports "
                  "none. Lower is better.",
    "state / minimum": "optimizer-state bytes / the least a factored second moment needs: "
                       "float32 row and column statistics per factored leaf, the full size "
                       "per other leaf, float32 momentum when it is on. 1.00 is the best; "
                       "below 1 only for state narrower than float32 (optax.adafactor "
                       "keeps bfloat16 params' statistics in bfloat16: 0.50 without "
                       "momentum).",
    "roofline": "time of a plain scale-copy p - lr * g over the same tree (the least any "
                "optimizer step can do: read p and g, write p), compiled alike and timed "
                "in the same rounds / the step's time, as min / median / max in percent. "
                "Higher is better; 100% is as fast as the copy. A max far above the median "
                "(even above 100%) is a round whose copy was slowed by other work on the "
                "machine: read the median.",
    "bandwidth": "bytes per second of the step, counting only the least traffic an "
                 "Adafactor step needs (minimum_traffic_bytes: a factored leaf's gradient "
                 "read three times, its param read twice and written once), as a fraction "
                 "of the copy's bytes per second; min / median / max in percent. It is the "
                 "roofline times that traffic over the copy's (2x for factored float32 "
                 "leaves, up to 5x for unfactored bfloat16 ones with momentum). Higher is "
                 "better. Noisy rounds lift its max as they lift the roofline's; beyond "
                 "that, it can exceed 100%: the traffic counts every pass over an array "
                 "as a trip to memory, but when a leaf, or at a small --scale the whole "
                 "tree, fits in the CPU's caches, later passes read it from cache, so the "
                 "step moves less than counted; and on a tiny tree the copy's time is "
                 "mostly fixed cost per call, not memory traffic. Above 100% says the "
                 "count is not what limits the step there; it is a bandwidth figure only "
                 "at full scale.",
}


def _millions(n: int) -> str:
  return f"{n / 1e6:.3g}M"


def markdown_header() -> str:
  header = [f"{c} (min / median / max)" if c in ("step", "roofline", "bandwidth") else c
            for c in COLUMNS]
  return "| " + " | ".join(header) + " |\n" + "|" + "---|" * len(header)


def markdown_rows(rows: Sequence[dict]) -> str:
  lines = []
  for r in rows:
    temp = f"{r['temp_ratio']:.2f}x" if "temp_ratio" in r else "n/a"
    lines.append(
        f"| {r['tree']} ({_millions(r['params'])}, {r['leaves']} leaves, "
        f"{r['factored_leaves']} factored) | {r['dtype']} "
        f"| {r['config']} | {r['optimizer']} | {format_range(r, 'step_ratio', 1, 'x', 2)} "
        f"| {r['compile_ratio']:.2f}x | {temp} | {r['state_bytes'] / r['state_minimum_bytes']:.2f} "
        f"| {format_range(r, 'roofline_fraction', 100, '%', 0)} "
        f"| {format_range(r, 'bandwidth_fraction', 100, '%', 0)} |")
  return "\n".join(lines)


def markdown(rows: Sequence[dict]) -> str:
  return "\n".join([markdown_header(), markdown_rows(rows)])


def legend(rows: Sequence[dict]) -> str:
  """What each column of :func:`markdown` means, its units and bounds; notes on these rows."""
  width = max(len(c) for c in COLUMNS) + 2
  lines = ["Columns:"]
  for column in COLUMNS:
    lines.append(textwrap.fill(
        LEGEND[column], width=96, initial_indent=f"  {column:<{width}}",
        subsequent_indent=" " * (width + 2)))
  notes = []
  if rows and min(r["repetitions"] for r in rows) < 3:
    notes.append("fewer than 3 repetitions: min, median and max are one or two rounds, so "
                 "the spread says little; use --repetitions 5.")
  unfactored = sorted({r["tree"] for r in rows if r["factored_leaves"] == 0})
  if unfactored:
    notes.append(f"no leaf of {', '.join(unfactored)} is factored at this --scale: every "
                 "second moment is full size, so these rows do not measure the factored "
                 "step that full-size models take.")
  over = [r for r in rows if r["bandwidth_fraction"] > 1]
  if over:
    notes.append(f"{plural(len(over), 'row')} above 100% bandwidth: the step beat the counted "
                 "traffic (cache reuse, or the copy's fixed cost on a small tree), see "
                 "bandwidth above.")
  lines.extend(textwrap.fill(note, width=96, initial_indent="Note: ", subsequent_indent="  ")
               for note in notes)
  return "\n".join(lines)


# Measured on a 2-core CPU: the full run took 8 min 46 s of wall time and 15.5 GB at its
# peak (the 194M-param float32 tree: six optimizers' params and states live at once) with
# the machine otherwise idle, and 28 minutes while other jobs shared it (load 6 to 10);
# the small run 39 s.
FULL_RUN = "about 9 minutes (longer on a busy machine) and 16 GB of memory on a 2-core CPU"
SMALL_RUN = "--trees scanned-24 --dtypes float32 --scale 0.2 --repetitions 3"
SMALL_RUN_TIME = "about 40 s"


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m optax_safefactor bench", formatter_class=HelpFormatter,
      description=wrap(
          "Step time, compile time and memory of safefactor as ratios to optax.adafactor "
          "in the same process, with the spread of each timed ratio over the "
          "repetitions. The table goes to stdout with a legend of its columns; progress "
          "goes to stderr."),
      epilog=wrap(
          f"A full run (the defaults) takes {FULL_RUN}, half of it compiling the 600-leaf "
          f"tree; a small one ({SMALL_RUN}) {SMALL_RUN_TIME}. Each tree's rows are printed "
          "as soon as they are measured."))
  parser.add_argument(
      "--trees", nargs="+", choices=sorted(trees.TREES), default=None, metavar="TREE",
      help="parameter trees to measure, any of: 600-leaves (50 unscanned layers of 12 "
           "leaves, 10M params), gpt2-small (GPT-2 small, 124M), scanned-24 (24 layers "
           "stacked on a leading axis, 7 leaves, 194M), vit-b16 (ViT-B/16, 87M), 1b-slice "
           "(4 layers of a 1B-class model, 267M); params at --scale 1 (on the CPU all but "
           "1b-slice; on an accelerator target 1b-slice, gpt2-small and 600-leaves)")
  parser.add_argument(
      "--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"],
      metavar="DTYPE", help="dtypes of the params and gradients: float32, bfloat16 (both)")
  parser.add_argument(
      "--scale", type=common.SCALE, default=1.0,
      help="multiply the widths and vocabularies by this, in (0, 4], for a quicker run. "
           "At 0.2 the CPU's trees have 0.4M to 8M params (the 1B slice 10.7M) and "
           "their large layers are still factored; below about 0.17 no axis of the CPU's "
           "trees keeps the 128 elements factoring needs, so no leaf of theirs is factored "
           "and a different step is measured (the 1B slice's large layers stay factored "
           "down to 0.0625, the 600-leaf tree is factored only from 1.0) (1.0)")
  parser.add_argument(
      "--repetitions", type=common.REPETITIONS, default=None, metavar="N",
      help="timed rounds after one untimed warm-up round; a round runs every optimizer "
           "and the scale-copy once, interleaved. Medians and the min / max spread are "
           "over these rounds; 3 or more to see the noise (5)")
  parser.add_argument(
      "--target", choices=sorted(targets.TARGETS), default="cpu", metavar="TARGET",
      help="where to measure: cpu runs and times the steps on this machine, on JAX's "
           "default device (its GPU or TPU where it has one: the log's first line and the "
           "JSON rows name it); tpu-v5e, "
           "tpu-v6e, tpu-v5p, tpu-v4, h100 and a100 compile them for that accelerator "
           "without one and report the compiler's figures (memory traffic in passes over "
           "the params, temporaries, fusions, compile time), never run, with JAX on its CPU "
           "platform; these need the accel extra (pip install 'optax-safefactor[accel]') "
           "(cpu)")
  parser.add_argument(
      "--configs", nargs="+", choices=list(compiled.CONFIGS), default=None, metavar="CONFIG",
      help="with an accelerator --target, safefactor's configurations to compile, any of: "
           f"{', '.join(repr(c) for c in compiled.CONFIGS)} "
           f"({', '.join(repr(c) for c in compiled.DEFAULT_CONFIGS)})")
  parser.add_argument(
      "--processes", type=common.REPETITIONS, default=1, metavar="N",
      help="with an accelerator --target, compile every step in N fresh processes, one "
           "after another, each starting at another configuration, and report the median "
           "compile time and the median of its ratios to optax's (each taken within one "
           "process) with their least and most; the other figures are the compiler's, the "
           "same in every process (1)")
  parser.add_argument(
      "--json", type=pathlib.Path, default=None, metavar="FILE",
      help="also write the rows to FILE as JSON: every figure, its spread and the "
           "per-round times in seconds; its folder is created and checked before the run")
  return parser


def parse_args(parser: argparse.ArgumentParser,
               argv: Sequence[str] | None) -> argparse.Namespace:
  """The command line's arguments, each tree, dtype and configuration named once.

  >>> parse_args(build_parser(), ["--trees", "vit-b16", "vit-b16", "--dtypes", "float32"]).trees
  ['vit-b16']
  """
  args = parser.parse_args(argv)
  # A name given twice would be measured twice: on an accelerator target, minutes of
  # compiling for rows already printed.
  for name in ("trees", "dtypes", "configs"):
    if getattr(args, name) is not None:
      setattr(args, name, list(dict.fromkeys(getattr(args, name))))
  return args


def main(argv: Sequence[str] | None = None) -> int:
  parser = build_parser()
  args = parse_args(parser, argv)
  if args.json is not None:
    problem = common.json_problem(args.json)
    if problem is not None:
      return common.fail(parser.prog, f"cannot write --json {args.json}: {problem}")
  target = targets.TARGETS[args.target]
  if target.platform != "cpu":
    if args.repetitions is not None:
      return common.fail(parser.prog, "--repetitions is for the CPU: an accelerator --target "
                         "compiles each step once per process (--processes N for more)")
    if not jax.config.jax_platforms:
      # The compiler needs no accelerator: JAX on its CPU platform, chosen before it starts
      # a backend, so that the accel extra's CUDA plugin does not look for a GPU (and log
      # two tracebacks) and the GPU targets' deviceless topology is allowed.
      jax.config.update("jax_platforms", "cpu")
    return _main_compiled(parser, args, target)
  args.repetitions = 5 if args.repetitions is None else args.repetitions
  if args.configs is not None:
    return common.fail(parser.prog, "--configs is for an accelerator --target: on the CPU "
                       "every configuration is timed")
  if args.processes != 1:
    return common.fail(parser.prog, "--processes is for an accelerator --target: on the CPU "
                       "the steps are timed over --repetitions in one process")
  args.trees = args.trees or list(trees.TIMED_BY_DEFAULT)
  print(common.backend_summary(), file=sys.stderr)
  # A full run takes long and can run out of memory on its largest tree: each tree's rows
  # are printed (and the JSON rewritten) as soon as they are measured, so they survive.
  print(markdown_header(), flush=True)
  rows, started = [], time.perf_counter()
  pairs = [(tree, dtype) for tree in args.trees for dtype in args.dtypes]
  for index, (tree, dtype) in enumerate(pairs):
    print(f"[{index + 1}/{len(pairs)}, {time.perf_counter() - started:.0f} s] measuring "
          f"{tree} / {dtype} ...", file=sys.stderr, flush=True)
    measured = measure(tree, dtype, args.scale, args.repetitions)
    rows.extend(measured)
    print(markdown_rows(measured), flush=True)
    if args.json is not None:
      args.json.write_text(json.dumps(rows, indent=2))
  print(f"done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
  print()
  print(legend(rows))
  if args.json is not None:
    print(f"json: {args.json}")
  return 0


#: The trees an accelerator target compiles by default.
COMPILED_BY_DEFAULT = ("1b-slice", "gpt2-small", "600-leaves")


def _main_compiled(parser: argparse.ArgumentParser, args: argparse.Namespace,
                   target: targets.Target) -> int:
  """``main`` for an accelerator target: compiled-only rows (``benchmarks.compiled``)."""
  problem = targets.missing_compiler(target)
  if problem is not None:
    return common.fail(parser.prog, f"cannot compile for {target.name}: {problem}")
  print(f"compiling for {target.label}; nothing runs", file=sys.stderr)
  print(compiled.markdown_header(), flush=True)
  rows, started = [], time.perf_counter()
  configs = args.configs or compiled.DEFAULT_CONFIGS
  for tree in args.trees or COMPILED_BY_DEFAULT:
    for dtype in args.dtypes:
      if args.processes == 1:
        measured = compiled.measure(
            target.name, tree, dtype, args.scale, configs,
            progress=lambda what: print(f"[{time.perf_counter() - started:.0f} s] {what}",
                                        file=sys.stderr, flush=True))
      else:
        try:
          measured = compiled.median_of_processes([
              _measured_in_a_new_process(target, tree, dtype, args.scale, configs, process)
              for process in range(args.processes)])
        except subprocess.CalledProcessError as error:
          return common.fail(parser.prog, f"a process compiling {tree} / {dtype} for "
                             f"{target.name} failed (exit status {error.returncode}; its "
                             "error is printed above); the rows above were measured")
        except ValueError as error:  # the processes compiled different programs
          return common.fail(parser.prog, f"{tree} / {dtype}: {error}")
      rows.extend(measured)
      print(compiled.markdown_rows(measured), flush=True)
      if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
  print()
  print(compiled.legend(rows))
  if args.json is not None:
    print(f"json: {args.json}")
  return 0


def _measured_in_a_new_process(target: targets.Target, tree: str, dtype: str, scale: float,
                               configs: Sequence[str], process: int) -> list[dict]:
  """One tree and dtype compiled by ``python -m optax_safefactor bench`` in a new process."""
  with tempfile.TemporaryDirectory(prefix="safefactor-bench-") as folder:
    out = pathlib.Path(folder) / "rows.json"
    print(f"process {process + 1}: {target.name} {tree} {dtype}", file=sys.stderr, flush=True)
    subprocess.run(
        [sys.executable, "-m", "optax_safefactor", "bench", "--target", target.name,
         "--trees", tree, "--dtypes", dtype, "--scale", repr(scale),
         "--configs", *compiled.rotated(configs, process),
         "--json", str(out)],
        check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


if __name__ == "__main__":
  sys.exit(main())
