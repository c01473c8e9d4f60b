"""The benchmarks' model-shaped parameter trees, by name, at a chosen scale.

Each tree is a dict of shapes, with the layer structure of the model it is named after;
``scale`` multiplies its widths and vocabulary, so a test or a quick run measures the
same structure at a fraction of the size. :func:`params_and_grads` fills one in.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


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


def slice_of_1b(scale: float) -> dict:
  """Four layers of a 1B-class language model: every matrix at least 16 MB in float32, too
  large for any accelerator's on-chip memory, with the norms beside them."""
  width, hidden, vocab = int(2048 * scale), int(8192 * scale), int(32000 * scale)
  tree = {"embed": (vocab, width), "final_norm": (width,)}
  for i in range(4):
    tree[f"layer{i}"] = {
        "qkv": (width, 3 * width), "out": (width, width), "up": (width, hidden),
        "down": (hidden, width), "norm1": (width,), "norm2": (width,)}
  return tree


TREES: dict[str, Callable[[float], dict]] = {
    "gpt2-small": gpt2_small, "vit-b16": vit_b16, "scanned-24": scanned_24_layers,
    "600-leaves": unscanned_600_leaves, "1b-slice": slice_of_1b,
}

#: The trees a timed run on this machine measures by default; the 1B slice (267M params)
#: is for the accelerators' compilers, which need no memory for it.
TIMED_BY_DEFAULT = ("600-leaves", "gpt2-small", "scanned-24", "vit-b16")


def make_params(shapes: dict, dtype) -> dict:
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
  return jax.tree.unflatten(
      treedef, [(jax.random.normal(k, s, jnp.float32) * 0.02).astype(dtype)
                for k, s in zip(keys, leaves, strict=True)])


def params_and_grads(tree: str, scale: float, dtype) -> tuple[dict, dict]:
  """The tree's params (normal, scaled by 0.02) and finite gradients, both in ``dtype``."""
  params = make_params(TREES[tree](scale), jnp.dtype(dtype))
  grads = jax.tree.map(lambda p: (p * 0.5 + 0.001).astype(p.dtype), params)
  return params, grads


def shape_structs(tree: str, scale: float, dtype) -> dict:
  """The tree as ``jax.ShapeDtypeStruct``s in ``dtype``, for ``jax.eval_shape``: no memory."""
  return jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)),
                      TREES[tree](scale), is_leaf=lambda x: isinstance(x, tuple))
