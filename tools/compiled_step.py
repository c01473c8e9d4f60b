"""The compiled step's op counts and trace/compile times, for comparing two versions.

``python tools/compiled_step.py ops --json ops.json`` writes, for the 600-leaf tree (50
unscanned layers of width 128, bfloat16 params), guard on and off and each rounding mode,
how many instructions of each opcode the optimised HLO of one update has. Two such files
from two checkouts are compared with ``python tools/compiled_step.py compare a.json b.json``,
which prints every opcode whose count changed.

``python tools/compiled_step.py times`` measures, on 48 layers of width 256 (576 leaves,
float32), the time to trace and lower the train step (``jax.jit(step).lower``) and the
time XLA takes to compile it, for safefactor (spike skipping off and on) and
``optax.adafactor`` in the same process, as the least over ``--repetitions`` rounds, with
JAX's caches cleared before each.

``python tools/compiled_step.py pairs --tree 600-leaves --dtype float32 --pairs 5`` runs
each pair in a fresh process: it compiles ``optax.adafactor`` and safefactor (with and
without ``pack_small_leaves``, guard on; the jitted step returning params and state) one
after the other, in an order that alternates between pairs, and prints the median over the
pairs of each ratio to optax: trace+lower and XLA compile apart, and both together (what a
user waits for before the first step). A fresh process per pair
keeps one compile's caches and memory out of the next; the ratio within a pair cancels most
of what else the machine is doing. ``--tree layered-48`` is the 576-leaf tree above; the
others are the benchmark's (``optax_safefactor.benchmarks.trees``).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import re
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import optax

import optax_safefactor as osf

# An HLO instruction line: "  name = type opcode(operands), ...", with an optional ROOT.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][\w\-]*)\(")


def layered_tree(layers: int, width: int, dtype) -> dict:
  """Unscanned transformer-like layers: 12 leaves each (4 matrices, 2 MLP, 6 vectors)."""
  shapes = {f"layer{i}": {
      "up": (width, 4 * width), "up_bias": (4 * width,), "down": (4 * width, width),
      "down_bias": (width,), "norm_scale": (width,), "norm_bias": (width,),
      "query": (width, width), "key": (width, width), "value": (width, width),
      "out": (width, width), "query_bias": (width,), "out_bias": (width,),
  } for i in range(layers)}
  return jax.tree.map(lambda shape: jnp.full(shape, 0.02, dtype), shapes,
                      is_leaf=lambda x: isinstance(x, tuple))


def train_step(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def opcode_counts(hlo_text: str) -> dict[str, int]:
  counts = collections.Counter()
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if match:
      counts[match.group(1)] += 1
  return dict(sorted(counts.items()))


def op_counts() -> dict[str, dict[str, int]]:
  params = layered_tree(50, 128, jnp.bfloat16)
  results = {}
  for guard in (True, False):
    for mode in ("nearest", "stochastic", "kahan"):
      tx = osf.safefactor(1e-3, skip_nonfinite_steps=guard, param_rounding=mode)
      compiled = jax.jit(tx.update).lower(params, tx.init(params), params).compile()
      results[f"guard={'on' if guard else 'off'} {mode}"] = opcode_counts(compiled.as_text())
  return results


def compare(before: dict, after: dict) -> int:
  worse = 0
  for config in before:
    old, new = before[config], after.get(config, {})
    changed = {op: (old.get(op, 0), new.get(op, 0)) for op in sorted(set(old) | set(new))
               if old.get(op, 0) != new.get(op, 0)}
    total = (sum(old.values()), sum(new.values()))
    print(f"{config}: {total[0]} -> {total[1]} instructions")
    for op, (a, b) in changed.items():
      print(f"  {op}: {a} -> {b}")
      worse += b > a
  return worse


def jaxpr_equations(tx, params) -> int:
  """How many equations tracing the train step records, nested ones included."""
  def count(jaxpr) -> int:
    total = 0
    for equation in jaxpr.eqns:
      total += 1
      for value in equation.params.values():
        inner = getattr(value, "jaxpr", None)
        if inner is not None:
          total += count(getattr(inner, "jaxpr", inner))
    return total

  return count(jax.make_jaxpr(train_step(tx))(params, tx.init(params), params).jaxpr)


def timed_compile(tx, params) -> dict[str, float]:
  """Seconds to trace and lower ``tx``'s train step on ``params``, and to compile it."""
  state = tx.init(params)
  # As timeit does: collect first, then time with the cycle collector off, so that a
  # collection does not land in one measurement.
  gc.collect()
  gc.disable()
  try:
    started = time.perf_counter()
    lowered = jax.jit(train_step(tx)).lower(params, state, params)
    lowered_at = time.perf_counter()
    lowered.compile()
    compiled_at = time.perf_counter()
  finally:
    gc.enable()
  return {"trace+lower": lowered_at - started, "compile": compiled_at - lowered_at}


def times(repetitions: int) -> dict[str, dict[str, float]]:
  params = layered_tree(48, 256, jnp.float32)
  candidates = {"safefactor": osf.safefactor(1e-3),
                "safefactor, unpacked": osf.safefactor(1e-3, pack_small_leaves=False),
                "safefactor, spikes": osf.safefactor(1e-3, skip_spikes=6.0),
                "optax.adafactor": optax.adafactor(1e-3)}
  rounds = {name: {"trace+lower": [], "compile": []} for name in candidates}
  for _ in range(repetitions):
    for name, tx in candidates.items():
      jax.clear_caches()
      for what, seconds in timed_compile(tx, params).items():
        rounds[name][what].append(seconds)
  # The least of the rounds: tracing and compiling are deterministic work, and anything
  # else on the machine only ever adds to them.
  return {name: {what: min(values) for what, values in measured.items()}
          for name, measured in rounds.items()}


PAIR_CANDIDATES = ("optax.adafactor", "safefactor", "safefactor, unpacked")


def _pair_candidate(name: str, momentum: bool):
  extra = {"momentum": 0.9} if momentum else {}
  if name == "optax.adafactor":
    return optax.adafactor(1e-3, **extra)
  return osf.safefactor(1e-3, pack_small_leaves=name == "safefactor", **extra)


def one_pair(tree: str, dtype: str, momentum: bool, order: int) -> dict[str, dict[str, float]]:
  """Trace+lower and compile seconds of each candidate, in this process, once each."""
  if tree == "layered-48":
    params = layered_tree(48, 256, jnp.dtype(dtype))
  else:
    from optax_safefactor.benchmarks import trees
    params, _ = trees.params_and_grads(tree, 1.0, dtype)
  names = PAIR_CANDIDATES if order % 2 == 0 else PAIR_CANDIDATES[::-1]
  # A tiny step of each first: what the first trace in a process pays once (imports,
  # JAX's own caches) is then no candidate's.
  tiny = {"w": jnp.ones((4, 4), jax.tree.leaves(params)[0].dtype)}
  for name in names:
    tx = _pair_candidate(name, momentum)
    jax.jit(train_step(tx)).lower(tiny, tx.init(tiny), tiny).compile()
  return {name: timed_compile(_pair_candidate(name, momentum), params) for name in names}


def pairs(tree: str, dtype: str, momentum: bool, count: int) -> dict[str, dict[str, float]]:
  """The median over ``count`` fresh-process pairs of each candidate's ratios to optax."""
  ratios = {name: {"trace+lower": [], "compile": [], "total": []} for name in PAIR_CANDIDATES[1:]}
  seconds = {name: [] for name in PAIR_CANDIDATES}
  for order in range(count):
    result = subprocess.run(
        [sys.executable, __file__, "one-pair", tree, dtype, str(int(momentum)), str(order)],
        capture_output=True, text=True, check=True)
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    for name in PAIR_CANDIDATES:
      seconds[name].append(measured[name]["compile"])
    for times_ in measured.values():
      times_["total"] = times_["trace+lower"] + times_["compile"]
    for name in ratios:
      for what in ("trace+lower", "compile", "total"):
        ratios[name][what].append(measured[name][what] / measured["optax.adafactor"][what])
  summary = {name: {what: statistics.median(values) for what, values in by_what.items()}
             for name, by_what in ratios.items()}
  for name, values in seconds.items():
    summary.setdefault(name, {})["compile_s"] = statistics.median(values)
  return summary


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  ops = sub.add_parser("ops", help="op counts of the optimised HLO")
  ops.add_argument("--json", help="write the counts to this file")
  cmp = sub.add_parser("compare", help="compare two op-count files")
  cmp.add_argument("before")
  cmp.add_argument("after")
  timing = sub.add_parser("times", help="trace+lower and compile times against optax")
  timing.add_argument("--repetitions", type=int, default=5)
  paired = sub.add_parser("pairs", help="compile-time ratios to optax over fresh-process pairs")
  paired.add_argument("--tree", default="layered-48")
  paired.add_argument("--dtype", default="float32")
  paired.add_argument("--momentum", action="store_true")
  paired.add_argument("--pairs", type=int, default=5)
  single = sub.add_parser("one-pair")
  for name in ("tree", "dtype", "momentum", "order"):
    single.add_argument(name)
  args = parser.parse_args(argv)
  if args.command == "one-pair":
    print(json.dumps(one_pair(args.tree, args.dtype, args.momentum == "1", int(args.order))))
    return 0
  if args.command == "pairs":
    summary = pairs(args.tree, args.dtype, args.momentum, args.pairs)
    config = "momentum" if args.momentum else "default"
    print(f"{args.tree} {args.dtype} {config}, median of {args.pairs} fresh-process pairs; "
          f"optax.adafactor compiles in {summary['optax.adafactor']['compile_s']:.2f} s")
    for name in PAIR_CANDIDATES[1:]:
      print(f"  {name} / optax.adafactor: trace+lower {summary[name]['trace+lower']:.2f}x, "
            f"compile {summary[name]['compile']:.2f}x ({summary[name]['compile_s']:.2f} s), "
            f"both {summary[name]['total']:.2f}x")
    return 0
  if args.command == "ops":
    counts = op_counts()
    text = json.dumps(counts, indent=1)
    if args.json:
      with open(args.json, "w") as f:
        f.write(text)
    for config, ops_of in counts.items():
      print(f"{config}: {sum(ops_of.values())} instructions")
    return 0
  if args.command == "compare":
    with open(args.before) as f, open(args.after) as g:
      return 1 if compare(json.load(f), json.load(g)) else 0
  measured = times(args.repetitions)
  params = layered_tree(48, 256, jnp.float32)
  for name, tx in (("safefactor", osf.safefactor(1e-3)),
                   ("optax.adafactor", optax.adafactor(1e-3))):
    print(f"{name}: {jaxpr_equations(tx, params)} traced equations")
  for name, values in measured.items():
    print(f"{name}: trace+lower {values['trace+lower']:.2f} s, compile {values['compile']:.2f} s")
  theirs = measured["optax.adafactor"]
  for name in ("safefactor", "safefactor, unpacked", "safefactor, spikes"):
    ours = measured[name]
    print(f"{name} / optax.adafactor: trace+lower "
          f"{ours['trace+lower'] / theirs['trace+lower']:.2f}x, "
          f"compile {ours['compile'] / theirs['compile']:.2f}x")
  return 0


if __name__ == "__main__":
  sys.exit(main())
