"""``python -m optax_safefactor bench-rounding``: what ``param_rounding`` costs, and what it saves.

Two measurements on the benchmarks' model-shaped trees (:mod:`.trees`) with bfloat16 params
and gradients:

- **Cost.** ``safefactor(param_rounding=mode)`` for each mode is compiled into the same
  train step (update and ``apply_updates``, params and state donated) and timed in
  interleaved rounds in one process. The step is reported against ``"nearest"`` (min /
  median / max of the round-by-round ratio), with XLA's temporary bytes
  (``compiled.memory_analysis()``), the compile time and the optimizer-state bytes per
  parameter. ``"stochastic"`` adds a counter-based hash of each element's index (integer
  multiplies and shifts) and no state; ``"kahan"`` reads and writes a 2-byte compensation
  per bfloat16 param. On a memory-bound accelerator the hash is nearly free and Kahan's
  buffer is its whole cost (about 6 bytes on top of the nearest step's 18 per param); on a
  CPU the hash's arithmetic can cost more than its bytes.
- **Memory.** Optimizer and param bytes per parameter, summed over the actual trees that
  ``init`` returns (``jax.eval_shape``, nothing allocated): AdamW with float32 master
  weights, AdamW on float32 params, ``with_param_rounding(optax.adamw)`` on bfloat16
  params, and safefactor on float32 params and on bfloat16 params in each mode.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_safefactor as osf
from optax_safefactor.benchmarks import common, trees
from optax_safefactor.benchmarks.common import format_range

MODES = ("nearest", "stochastic", "kahan")
TREES = ("gpt2-small", "scanned-24")
# "momentum" keeps a bfloat16 momentum, which "stochastic" also writes stochastically: the
# configuration in which the mode draws bits for two arrays per param.
CONFIGS = {
    "default": dict(learning_rate=1e-3),
    "momentum": dict(learning_rate=1e-3, momentum=0.9, dtype_momentum="bfloat16"),
}
SMALL = dict(trees=["scanned-24"], scale=0.2, repetitions=2, configs=["default"])
# The options --small sets, at their defaults (parsed as None, so that --small can tell an
# option given from one left out).
DEFAULTS = dict(trees=list(TREES), scale=1.0, repetitions=5, configs=list(CONFIGS))


def measure(tree: str, scale: float, repetitions: int, config: str) -> list[dict]:
  """One row per mode: step time (and its ratio to "nearest"), temp bytes, state bytes."""
  params, grads = trees.params_and_grads(tree, scale, "bfloat16")
  n_params = common.count(params)
  rows, compiled = {}, {}
  for mode in MODES:
    tx = osf.safefactor(**CONFIGS[config], param_rounding=mode)
    state = tx.init(params)
    compiled[mode] = common.compile_step(common.train_step(tx), params, state, grads)
    rows[mode] = {
        **common.measured_on(),
        "tree": tree, "scale": scale, "config": config, "mode": mode, "params": n_params,
        "leaves": len(jax.tree.leaves(params)), "compile_s": compiled[mode].compile_s,
        "temp_bytes": compiled[mode].temp_bytes, "state_bytes": common.nbytes(state),
        "state_bytes_per_param": common.nbytes(state) / n_params,
        "step_s_rounds": [], "repetitions": repetitions,
    }
    print(f"  compiled {tree} / {config} / {mode} in {compiled[mode].compile_s:.1f} s",
          file=sys.stderr, flush=True)
  for mode, rounds in common.time_rounds(compiled, grads, repetitions).items():
    rows[mode]["step_s_rounds"] = [calls[0] for calls in rounds]
  base = rows["nearest"]
  for row in rows.values():
    row["step_s"] = float(np.median(row["step_s_rounds"]))
    common.ratio_with_spread(row, "step_ratio", row["step_s_rounds"], base["step_s_rounds"])
    if row["temp_bytes"] is not None and base["temp_bytes"]:
      row["temp_ratio"] = row["temp_bytes"] / base["temp_bytes"]
  return list(rows.values())


def _adamw_with_master_weights(params):
  """bfloat16 params for the model, a float32 master copy, and AdamW's state on the copy."""
  master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  return {"params": params, "master": master, "opt_state": optax.adamw(1e-3).init(master)}


def _memory_candidates() -> dict[str, tuple[str, Callable]]:
  """name -> (param dtype, params -> the params and every optimizer array kept with them)."""

  def with_state(tx):
    return lambda params: {"params": params, "opt_state": tx.init(params)}

  def safefactor(**settings):
    return with_state(osf.safefactor(1e-3, **settings))

  return {
      "AdamW, bfloat16 params + float32 master weights": ("bfloat16", _adamw_with_master_weights),
      "AdamW, float32 params": ("float32", with_state(optax.adamw(1e-3))),
      "with_param_rounding(AdamW, stochastic), bfloat16 params": (
          "bfloat16", with_state(osf.with_param_rounding(optax.adamw(1e-3), "stochastic"))),
      "safefactor, float32 params": ("float32", safefactor()),
      "safefactor, float32 params, momentum": ("float32", safefactor(momentum=0.9)),
      **{f"safefactor, bfloat16 params, {mode}": ("bfloat16", safefactor(param_rounding=mode))
         for mode in MODES},
      "safefactor, bfloat16 params, stochastic, bfloat16 momentum": (
          "bfloat16", safefactor(param_rounding="stochastic", momentum=0.9,
                                 dtype_momentum="bfloat16")),
      "safefactor, bfloat16 params, kahan, bfloat16 momentum": (
          "bfloat16", safefactor(param_rounding="kahan", momentum=0.9,
                                 dtype_momentum="bfloat16")),
  }


def memory_story(tree: str, scale: float) -> list[dict]:
  """Bytes per parameter of the params plus everything the optimizer keeps, per candidate."""
  rows = []
  for name, (dtype, build) in _memory_candidates().items():
    params = trees.shape_structs(tree, scale, dtype)
    kept = jax.eval_shape(build, params)
    n_params = common.count(params)
    param_bytes = common.nbytes(params)
    rows.append({
        "tree": tree, "scale": scale, "optimizer": name, "params": n_params,
        "param_bytes_per_param": param_bytes / n_params,
        "optimizer_bytes_per_param": (common.nbytes(kept) - param_bytes) / n_params,
        "total_bytes_per_param": common.nbytes(kept) / n_params,
    })
  return rows


def cost_markdown(rows: Sequence[dict]) -> str:
  lines = ["| tree | config | mode | step (min / median / max) | step, median | temp bytes "
           "| compile | state bytes / param |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    temp = "n/a" if r["temp_bytes"] is None else (
        f"{r['temp_bytes'] / 1e6:.1f} MB ({r.get('temp_ratio', float('nan')):.2f}x)")
    lines.append(
        f"| {r['tree']} ({r['params'] / 1e6:.3g}M, {r['leaves']} leaves) | {r['config']} "
        f"| {r['mode']} | {format_range(r, 'step_ratio', 1, 'x', 2)} "
        f"| {r['step_s'] * 1e3:.1f} ms | {temp} "
        f"| {r['compile_s']:.1f} s | {r['state_bytes_per_param']:.3f} |")
  return "\n".join(lines)


def memory_markdown(rows: Sequence[dict]) -> str:
  lines = ["| tree | optimizer and params | params | optimizer state | total (bytes / param) |",
           "|---|---|---|---|---|"]
  for r in rows:
    lines.append(
        f"| {r['tree']} ({r['params'] / 1e6:.3g}M) | {r['optimizer']} "
        f"| {r['param_bytes_per_param']:.2f} | {r['optimizer_bytes_per_param']:.2f} "
        f"| {r['total_bytes_per_param']:.2f} |")
  return "\n".join(lines)


NOTES = """\
step: one train step (update and apply_updates, compiled, params and state donated) / the
  "nearest" step's, min / median / max; the median is the ratio of the median times, min
  and max the ratio taken round by round (each round runs every mode once, interleaved).
temp bytes: XLA's temporary buffers for one step (compiled.memory_analysis()), with the
  ratio to "nearest"'s.
state bytes / param: every array of the optimizer state, over the number of parameters.
Memory: bytes per parameter of the params and of everything the optimizer keeps with them
  (master weights, moments, statistics, compensation), from the trees init returns."""


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m optax_safefactor bench-rounding",
      description="The cost of safefactor's param_rounding modes on bfloat16 params (step "
                  "time against 'nearest', temporary bytes, state bytes per param) and the "
                  "memory story (optimizer and param bytes per parameter of AdamW with "
                  "float32 master weights and of safefactor in each mode). Tables go to "
                  "stdout, progress to stderr.",
      epilog="--small runs " + " ".join(
          f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
          for k, v in SMALL.items()) + " (seconds; for tests). The full run (the "
      "defaults) takes about 4 minutes on a 2-core CPU.")
  parser.add_argument("--trees", nargs="+", choices=sorted(trees.TREES), default=None,
                      metavar="TREE", help="parameter trees, any of "
                      f"{', '.join(sorted(trees.TREES))} ({' '.join(TREES)})")
  parser.add_argument("--scale", type=common.SCALE, default=None,
                      help="multiply the trees' widths and vocabularies by this, in (0, 4]; "
                           "below about 0.17 no leaf is factored (1.0)")
  parser.add_argument("--repetitions", type=common.REPETITIONS, default=None, metavar="N",
                      help="timed rounds after one warm-up round (5)")
  parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=None,
                      metavar="CONFIG", help="default: learning_rate=1e-3; momentum: also "
                      "momentum=0.9 in bfloat16 (both)")
  parser.add_argument("--small", action="store_true",
                      help="a quick run for tests: it sets the options above, so it takes "
                           "none of them")
  parser.add_argument("--json", type=pathlib.Path, default=None, metavar="FILE",
                      help="also write every figure to FILE as JSON")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  given = [f"--{key}" for key in SMALL if getattr(args, key) is not None]
  if args.small and given:
    # Overridden, the options given were dropped without a word.
    return common.fail(parser.prog, f"--small sets {' and '.join(given)} itself: give "
                       "--small or those options, not both")
  for key, value in (SMALL if args.small else DEFAULTS).items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  if args.json is not None:
    problem = common.json_problem(args.json)
    if problem is not None:
      return common.fail(parser.prog, f"cannot write --json {args.json}: {problem}")
  print(common.backend_summary(), file=sys.stderr)
  cost, memory = [], []
  for tree in args.trees:
    for config in args.configs:
      print(f"measuring {tree} / {config} ...", file=sys.stderr, flush=True)
      cost.extend(measure(tree, args.scale, args.repetitions, config))
    memory.extend(memory_story(tree, args.scale))
  print("Cost of param_rounding, bfloat16 params and gradients; ratios to 'nearest'")
  print(cost_markdown(cost))
  print()
  print("Memory: bytes per parameter")
  print(memory_markdown(memory))
  print()
  print(NOTES)
  if args.json is not None:
    args.json.write_text(json.dumps({"cost": cost, "memory": memory}, indent=2))
    print(f"json: {args.json}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
