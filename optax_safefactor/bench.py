"""``python -m optax_safefactor bench``: safefactor against optax.adafactor, as ratios.

For each model-shaped parameter tree and dtype, every optimizer is compiled into the same
train step (update + apply), timed with interleaved repetitions in one process, and
reported against ``optax.adafactor`` at the same configuration: median step time, compile
time, temporary bytes (``compiled.memory_analysis()``), optimizer-state bytes against the
theoretical minimum, and the fraction of a plain scale-copy roofline (``p - lr * g``: the
least memory traffic any optimizer step has) achieved, and the fraction of that copy's
bandwidth achieved on the least traffic an Adafactor step needs
(:func:`minimum_traffic_bytes`). Runs unchanged on CPU, GPU and TPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_safefactor as osf
from optax_safefactor._src.plan import default_plan


def gpt2_small(scale: float) -> dict:
  width, vocab = int(768 * scale), int(50257 * scale)
  tree = {"wte": (vocab, width), "wpe": (1024, width), "ln_f": {"scale": (width,)}}
  for i in range(12):
    tree[f"h{i}"] = {
        "ln1": {"scale": (width,), "bias": (width,)}, "ln2": {"scale": (width,), "bias": (width,)},
        "attn": {"kernel": (width, 3 * width), "bias": (3 * width,)},
        "proj": {"kernel": (width, width), "bias": (width,)},
        "fc": {"kernel": (width, 4 * width), "bias": (4 * width,)},
        "out": {"kernel": (4 * width, width), "bias": (width,)},
    }
  return tree


def vit_b16(scale: float) -> dict:
  width = int(768 * scale)
  tree = {"patch": {"kernel": (16, 16, 3, width), "bias": (width,)}, "cls": (1, 1, width),
          "pos": (1, 197, width), "head": {"kernel": (width, 1000), "bias": (1000,)},
          "norm": {"scale": (width,), "bias": (width,)}}
  for i in range(12):
    tree[f"block{i}"] = {
        "ln1": {"scale": (width,), "bias": (width,)}, "ln2": {"scale": (width,), "bias": (width,)},
        "qkv": {"kernel": (width, 3 * width), "bias": (3 * width,)},
        "proj": {"kernel": (width, width), "bias": (width,)},
        "mlp1": {"kernel": (width, 4 * width), "bias": (4 * width,)},
        "mlp2": {"kernel": (4 * width, width), "bias": (width,)},
    }
  return tree


def scanned_24_layers(scale: float) -> dict:
  width, layers = int(768 * scale), 24
  return {
      "embed": (int(32000 * scale), width),
      "layers": {
          "ln1": (layers, width), "ln2": (layers, width),
          "qkv": (layers, width, 3 * width), "proj": (layers, width, width),
          "mlp1": (layers, width, 4 * width), "mlp2": (layers, 4 * width, width),
      },
  }


def unscanned_600_leaves(scale: float) -> dict:
  width = max(int(128 * scale), 8)
  return {f"layer{i}": {
      "up": (width, 4 * width), "up_bias": (4 * width,), "down": (4 * width, width),
      "down_bias": (width,), "norm_scale": (width,), "norm_bias": (width,),
      "query": (width, width), "key": (width, width), "value": (width, width),
      "out": (width, width), "query_bias": (width,), "out_bias": (width,),
  } for i in range(50)}


TREES: dict[str, Callable[[float], dict]] = {
    "gpt2-small": gpt2_small, "vit-b16": vit_b16, "scanned-24": scanned_24_layers,
    "600-leaves": unscanned_600_leaves,
}


def make_params(shapes: dict, dtype) -> dict:
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
  return jax.tree.unflatten(
      treedef, [(jax.random.normal(k, s, jnp.float32) * 0.02).astype(dtype)
                for k, s in zip(keys, leaves, strict=True)])


def minimum_state_bytes(params: dict, momentum: bool) -> int:
  """float32 rows + columns per factored leaf, the full size per other leaf, a few scalars."""
  total = 64
  for p in jax.tree.leaves(params):
    plan = default_plan(p.shape, True, 128)
    if plan is None:
      total += 4 * p.size
    else:
      total += 4 * (int(np.prod(plan.row_stat_shape(p.shape))) +
                    int(np.prod(plan.col_stat_shape(p.shape))))
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
  for p in jax.tree.leaves(params):
    size = p.dtype.itemsize * p.size
    if default_plan(p.shape, True, 128) is None:
      total += 2 * size + 3 * 4 * p.size + 3 * size
    else:
      total += 3 * size + 3 * size
    if momentum:
      total += 2 * 4 * p.size
  return total


def _compile(step_fn, *args):
  start = time.perf_counter()
  compiled = jax.jit(step_fn, donate_argnums=(0, 1)).lower(*args).compile()
  return compiled, time.perf_counter() - start


def measure(tree: str, dtype_name: str, scale: float, repetitions: int) -> list[dict]:
  dtype = jnp.dtype(dtype_name)
  params = make_params(TREES[tree](scale), dtype)
  grads = jax.tree.map(lambda p: (p * 0.5 + 0.001).astype(p.dtype), params)
  configs = {
      "default": dict(learning_rate=1e-3),
      "momentum": dict(learning_rate=1e-3, momentum=0.9),
  }
  candidates = {}
  for config_name, config in configs.items():
    candidates[("optax.adafactor", config_name)] = optax.adafactor(**config)
    candidates[("safefactor", config_name)] = osf.safefactor(**config)
    candidates[("safefactor, guard off", config_name)] = osf.safefactor(
        **config, skip_nonfinite_steps=False)

  def step_for(tx):
    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
    return step

  runners, rows = {}, {}
  for key, tx in candidates.items():
    state = tx.init(params)
    compiled, seconds = _compile(step_for(tx), params, state, grads)
    memory = compiled.memory_analysis()
    rows[key] = {
        "tree": tree, "dtype": dtype_name, "optimizer": key[0], "config": key[1],
        "compile_s": seconds,
        "temp_bytes": int(memory.temp_size_in_bytes) if memory is not None else None,
        "state_bytes": int(sum(x.nbytes for x in jax.tree.leaves(state))),
        "state_minimum_bytes": minimum_state_bytes(params, key[1] == "momentum"),
    }
    runners[key] = [compiled, jax.tree.map(jnp.copy, params), state]

  def scale_copy(params, state, grads):
    del state
    return jax.tree.map(lambda p, g: p - jnp.asarray(1e-3, p.dtype) * g, params, grads), None

  roofline, _ = _compile(scale_copy, params, None, grads)
  roofline_params = jax.tree.map(jnp.copy, params)
  times = {key: [] for key in runners}
  roofline_times = []
  for _ in range(repetitions + 1):  # the first round warms up and is dropped
    for key, runner in runners.items():
      compiled, p, s = runner
      start = time.perf_counter()
      p, s = compiled(p, s, grads)
      jax.block_until_ready(p)
      times[key].append(time.perf_counter() - start)
      runner[1:] = [p, s]
    start = time.perf_counter()
    roofline_params, _ = roofline(roofline_params, None, grads)
    jax.block_until_ready(roofline_params)
    roofline_times.append(time.perf_counter() - start)
  roofline_s = float(np.median(roofline_times[1:]))
  copy_bytes = 3 * sum(p.dtype.itemsize * p.size for p in jax.tree.leaves(params))
  for key, row in rows.items():
    row["step_s"] = float(np.median(times[key][1:]))
    row["roofline_fraction"] = roofline_s / row["step_s"]
    # The copy's bandwidth, against the bandwidth the step achieves on its least traffic.
    row["minimum_traffic_bytes"] = minimum_traffic_bytes(params, key[1] == "momentum")
    row["bandwidth_fraction"] = (
        row["minimum_traffic_bytes"] / row["step_s"]) / (copy_bytes / roofline_s)
  for key, row in rows.items():
    base = rows[("optax.adafactor", key[1])]
    row["step_ratio"] = row["step_s"] / base["step_s"]
    row["compile_ratio"] = row["compile_s"] / base["compile_s"]
    if row["temp_bytes"] is not None and base["temp_bytes"]:
      row["temp_ratio"] = row["temp_bytes"] / base["temp_bytes"]
  n_params = sum(p.size for p in jax.tree.leaves(params))
  for row in rows.values():
    row["params"] = int(n_params)
    row["leaves"] = len(jax.tree.leaves(params))
  return list(rows.values())


def markdown(rows: Sequence[dict]) -> str:
  lines = ["| tree | dtype | config | optimizer | step | compile | temp bytes | state / minimum "
           "| roofline | bandwidth |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    temp = f"{r['temp_ratio']:.2f}x" if "temp_ratio" in r else "n/a"
    lines.append(
        f"| {r['tree']} ({r['params'] / 1e6:.0f}M, {r['leaves']} leaves) | {r['dtype']} "
        f"| {r['config']} | {r['optimizer']} | {r['step_ratio']:.2f}x | {r['compile_ratio']:.2f}x "
        f"| {temp} | {r['state_bytes'] / r['state_minimum_bytes']:.2f} "
        f"| {100 * r['roofline_fraction']:.0f}% | {100 * r['bandwidth_fraction']:.0f}% |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m optax_safefactor bench",
      description="Step time, compile time and memory of safefactor as ratios to "
                  "optax.adafactor in the same process.")
  parser.add_argument("--trees", nargs="+", choices=sorted(TREES), default=sorted(TREES))
  parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"),
                      default=["float32", "bfloat16"])
  parser.add_argument("--scale", type=float, default=1.0,
                      help="shrink the widths (and vocabularies) for a quick run (1.0)")
  parser.add_argument("--repetitions", type=int, default=5)
  parser.add_argument("--json", type=pathlib.Path, default=None, help="also write rows as JSON")
  args = parser.parse_args(argv)
  if not 0 < args.scale <= 4 or args.repetitions < 1:
    parser.error("--scale must be in (0, 4] and --repetitions at least 1")
  print(f"backend: {jax.default_backend()}, {len(jax.devices())} device(s): "
        f"{jax.devices()[0].device_kind}", file=sys.stderr)
  rows = []
  for tree in args.trees:
    for dtype in args.dtypes:
      print(f"measuring {tree} / {dtype} ...", file=sys.stderr, flush=True)
      rows.extend(measure(tree, dtype, args.scale, args.repetitions))
  print(markdown(rows))
  if args.json is not None:
    args.json.write_text(json.dumps(rows, indent=2))
    print(f"json: {args.json}")
  return 0
