"""The largest z-score the spike rule sees on the main job's model in a healthy run.

Trains the main job's character-level transformer (float32 params, safefactor at the main
job's learning rate, no injected spike) for ``--steps`` steps with ``skip_spikes`` off,
records each step's global gradient norm and loss, and replays the spike rule over them in
float64: per step, z = (x - mean) / max(std, 0.02 |mean|) over the last ``--window``
steps, once half of them are there. Prints the largest z of each statistic and where it
was, and how many steps a threshold of 6 would have skipped (none, on a healthy run, is
the point).

    python tools/spike_z.py --steps 2000
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_safefactor as osf
from optax_safefactor._src.spikes import RELATIVE_STD_FLOOR
from optax_safefactor.benchmarks import demo


def z_scores(values: np.ndarray, window: int) -> np.ndarray:
  """Per step, the rule's z against the previous ``window`` values (NaN before half)."""
  z = np.full(len(values), np.nan)
  for step in range(len(values)):
    history = values[max(0, step - window):step]
    if len(history) < max(window // 2, 2):
      continue
    mean = history.mean()
    std = max(history.std(ddof=1), RELATIVE_STD_FLOOR * abs(mean))
    z[step] = (values[step] - mean) / std
  return z


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--window", type=int, default=128)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  from flax import nnx

  corpus = demo.load_corpus()
  alphabet = sorted(set(corpus))
  encoded = np.array([alphabet.index(c) for c in corpus], np.int32)
  model = demo._build_model(len(alphabet), jnp.float32, args.seed)
  optimizer = nnx.Optimizer(model, osf.safefactor(1e-2), wrt=nnx.Param)
  rng = np.random.default_rng(args.seed)

  @nnx.jit
  def step(model, optimizer, tokens):
    def loss_fn(model):
      logits = model(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss, optax.global_norm(grads)

  losses, norms = [], []
  for _ in range(args.steps):
    starts = rng.integers(0, len(encoded) - demo.SEQUENCE_LENGTH - 1, demo.BATCH_SIZE)
    batch = np.stack([encoded[s:s + demo.SEQUENCE_LENGTH + 1] for s in starts])
    loss, norm = step(model, optimizer, jnp.asarray(batch))
    losses.append(float(loss))
    norms.append(float(norm))
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.steps} steps, "
        f"window {args.window}")
  for name, values in (("gradient norm", np.array(norms)), ("loss", np.array(losses))):
    z = z_scores(values, args.window)
    worst = int(np.nanargmax(z))
    print(f"{name}: largest z {z[worst]:.2f} at step {worst}; steps with z > 6: "
          f"{int(np.sum(z > 6))}; z > 4: {int(np.sum(z > 4))}")


if __name__ == "__main__":
  main()
