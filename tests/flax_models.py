"""The small nnx model that the Flax tests train: 16 inputs, 32 hidden units, 8 outputs."""

import jax
from flax import nnx


class SmallMLP(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(16, 32, rngs=rngs)
    self.down = nnx.Linear(32, 8, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x)))
