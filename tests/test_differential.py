"""Differential tests: safefactor step by step against the float64 reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import optax_safefactor as osf
from tests.reference import ReferenceAdafactor, reference_plan_from_roles


@pytest.mark.parametrize("eps,large,faint", [(1e-30, 1e5, 1e-16), (0.0, 3.0, 1e-20)])
def test_faint_columns_next_to_large_gradients_follow_the_reference(eps, large, faint):
  """Columns of faint gradients (their row statistic on the floor) next to large ones.

  Guards against the row factor computed as ``sqrt(normaliser / row)``: the quotient
  overflowed float32 once the normaliser passed ``max / floor`` (3.4e8 with eps=1e-30,
  4 with eps=0), and the cap then stood in for a scale it should not have bounded:
  with eps=1e-30 and gradients around 1e5 the faint columns' updates were 4,000 times
  the reference's, with eps=0 and gradients around 3, up to twice.
  """
  rng = np.random.default_rng(0)
  shape = (6, 5)
  # Rows of different scales, so that some column statistics exceed the normaliser.
  grads = rng.normal(size=shape) * large * np.array([1.0, 3.0, 0.3, 2.0, 0.5, 4.0])[:, None]
  grads[:, 2] = rng.normal(size=shape[0]) * faint
  tx = osf.scale_by_safe_factored_rms(min_dim_size_to_factor=2, epsilon=eps)
  params = {"w": jnp.zeros(shape)}
  reference = ReferenceAdafactor(eps=eps, multiply_by_parameter_scale=False,
                                 clipping_threshold=None)
  reference.init("w", shape, reference_plan_from_roles(shape, None, True, 2))
  state = tx.init(params)
  for step in range(3):
    step_grads = {"w": jnp.asarray(grads * (step + 1.0), jnp.float32)}
    updates, state = tx.update(step_grads, state, params)
    expected = -reference.step({"w": np.asarray(step_grads["w"])}, params)["w"]
    error = np.max(np.abs(np.asarray(updates["w"], np.float64) - expected))
    assert error <= 2e-5 * np.max(np.abs(expected)), (step, error)
