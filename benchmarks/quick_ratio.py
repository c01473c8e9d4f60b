"""Quick step-time, compile-time and temporary-memory ratios of safefactor to optax.adafactor.

Runs both optimizers on the same model-shaped parameter tree in one process, with
interleaved repetitions, and prints medians as ratios to ``optax.adafactor``. A full
benchmark comes later; this is the measurement quoted in the README.

    python benchmarks/quick_ratio.py [gpt2] [many]
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_safefactor as osf


def gpt2_small_shapes(layers: int = 12, width: int = 768, vocab: int = 50257) -> dict:
  shapes = {"wte": (vocab, width), "wpe": (1024, width)}
  for i in range(layers):
    shapes[f"h{i}"] = {
        "ln1_scale": (width,), "ln1_bias": (width,),
        "attn_kernel": (width, 3 * width), "attn_bias": (3 * width,),
        "proj_kernel": (width, width), "proj_bias": (width,),
        "ln2_scale": (width,), "ln2_bias": (width,),
        "fc_kernel": (width, 4 * width), "fc_bias": (4 * width,),
        "out_kernel": (4 * width, width), "out_bias": (width,),
    }
  return shapes


def many_leaves_shapes(layers: int = 50, width: int = 128) -> dict:
  """An unscanned tree of 12 leaves per layer (600 for 50 layers)."""
  shapes = {}
  for i in range(layers):
    shapes[f"layer{i}"] = {
        "up": (width, 4 * width), "up_bias": (4 * width,),
        "down": (4 * width, width), "down_bias": (width,),
        "norm_scale": (width,), "norm_bias": (width,),
        "query": (width, width), "key": (width, width), "value": (width, width),
        "out": (width, width), "query_bias": (width,), "out_bias": (width,),
    }
  return shapes


def make_params(shapes: dict, dtype) -> dict:
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
  return jax.tree.unflatten(
      treedef, [jax.random.normal(k, s, dtype) * 0.02 for k, s in zip(keys, leaves, strict=True)]
  )


def compile_train_step(tx, params):
  state = tx.init(params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  start = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
  return compiled, state, time.perf_counter() - start


def compare(name: str, shapes: dict, dtype, config: dict, repetitions: int = 7) -> None:
  params = make_params(shapes, dtype)
  grads = jax.tree.map(lambda p: p * 0.5 + 0.001, params)
  candidates = {
      "optax.adafactor": optax.adafactor(**config),
      "safefactor": osf.safefactor(**config),
      "safefactor, guard off": osf.safefactor(**config, skip_nonfinite_steps=False),
  }
  compile_s, temp_bytes, runners = {}, {}, {}
  for label, tx in candidates.items():
    compiled, state, seconds = compile_train_step(tx, params)
    compile_s[label] = seconds
    temp_bytes[label] = compiled.memory_analysis().temp_size_in_bytes
    runners[label] = [compiled, jax.tree.map(jnp.copy, params), state]
  step_s = {label: [] for label in candidates}
  for _ in range(repetitions):
    for label, runner in runners.items():
      compiled, p, s = runner
      start = time.perf_counter()
      p, s = compiled(p, s, grads)
      jax.block_until_ready(p)
      step_s[label].append(time.perf_counter() - start)
      runner[1:] = [p, s]
  median = {label: float(np.median(times[1:])) for label, times in step_s.items()}
  base = "optax.adafactor"
  n_leaves = len(jax.tree.leaves(params))
  n_params = sum(p.size for p in jax.tree.leaves(params))
  print(f"\n{name}, {jnp.dtype(dtype).name}, {n_leaves} leaves, {n_params / 1e6:.1f}M params, "
        f"config {config}")
  print("| optimizer | step time | compile time | temporary bytes |")
  print("|---|---|---|---|")
  for label in candidates:
    print(f"| {label} | {median[label] / median[base]:.2f}x | "
          f"{compile_s[label] / compile_s[base]:.2f}x | "
          f"{temp_bytes[label] / max(temp_bytes[base], 1):.2f}x |")


def main(argv: list[str]) -> None:
  which = argv or ["gpt2", "many"]
  if "gpt2" in which:
    compare("GPT-2 small", gpt2_small_shapes(), jnp.float32, dict(learning_rate=1e-3))
    compare("GPT-2 small", gpt2_small_shapes(), jnp.float32,
            dict(learning_rate=1e-3, momentum=0.9))
  if "many" in which:
    compare("600-leaf tree", many_leaves_shapes(), jnp.float32, dict(learning_rate=1e-3))


if __name__ == "__main__":
  main(sys.argv[1:])
