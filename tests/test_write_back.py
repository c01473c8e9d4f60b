"""The write-back of a skipped step: it leaves params and write-back state alone (contract 5, 8).

With momentum or weight decay the update of a skipped step is not zero before the
verdict is applied (it is ``beta1 * m + lambda * p``), so a Kahan compensation
computed from it moves unless the skip keeps the old one; with low-precision momentum
and statistics every stream draws bits, so a skip that consumed any (by counting the
step) would move every later rounding. Every configuration below has momentum and
weight decay, and each run with a NaN step must equal the run without it, bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from tests.helpers import assert_trees_bitwise_equal, run_steps

SHAPES = {"w": (24, 20), "b": (20,)}

WRITE_BACKS = {
    # safefactor's own write-back, float32 statistics.
    "safefactor": lambda mode: osf.safefactor(
        0.05, min_dim_size_to_factor=8, momentum=0.9, weight_decay_rate=1e-2,
        param_rounding=mode),
    # Every stream of safefactor draws bits: momentum, row and column statistics, params.
    "safefactor_low_precision_state": lambda mode: osf.safefactor(
        1e-3, min_dim_size_to_factor=8, momentum=0.9, weight_decay_rate=1e-3,
        dtype_momentum="bfloat16", state_dtype="bfloat16", param_rounding=mode),
    # The wrapper around any optax optimizer, inside the guard.
    "with_param_rounding": lambda mode: osf.skip_nonfinite(
        osf.with_param_rounding(optax.adamw(1e-3, weight_decay=1e-2), mode)),
}


def _tree(seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.normal(size=s) * scale, jnp.bfloat16) for k, s in SHAPES.items()}


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
@pytest.mark.parametrize("write_back", sorted(WRITE_BACKS))
def test_a_skipped_step_changes_nothing(write_back, mode):
  tx = WRITE_BACKS[write_back](mode)
  params = _tree(0)
  good = [_tree(s, scale=0.1) for s in (1, 2, 3)]
  poisoned = {**good[1], "w": good[1]["w"].at[0, 0].set(jnp.nan)}
  # optax.adamw mixes int and float counts.
  with_skip = run_steps(tx, params, [good[0], poisoned, *good[1:]], dtype_promotion="standard")
  clean = run_steps(tx, params, good, dtype_promotion="standard")
  assert int(osf.skipped_steps(with_skip[1])) == 1 and int(osf.skipped_steps(clean[1])) == 0
  assert_trees_bitwise_equal(with_skip[0], clean[0])
  assert_trees_bitwise_equal(with_skip[1].inner_state, clean[1].inner_state)
  assert int(with_skip[1].inner_state.count) == len(good)
  if mode == "kahan":  # the buffer is in use, so keeping it is not trivially true
    assert any(np.any(np.asarray(c)) for c in jax.tree.leaves(clean[1].inner_state.compensation))


@pytest.mark.parametrize("mode", ["nearest", "stochastic", "kahan"])
def test_a_mode_read_from_a_config_is_the_mode(mode):
  # A mode built at run time (read from a config file, say) is equal to the literal but
  # not the same object: the write-back must compare values, not identities.
  built = "".join(list(mode))
  assert built == mode and built is not mode
  params = _tree(0)
  grads = [_tree(s, scale=0.1) for s in (1, 2)]
  for make in (lambda m: osf.safefactor(0.05, momentum=0.9, param_rounding=m),
               lambda m: osf.with_param_rounding(optax.sgd(1e-2), m)):
    assert_trees_bitwise_equal(run_steps(make(built), params, grads)[:2],
                               run_steps(make(mode), params, grads)[:2])


KAHAN = {
    "safefactor": lambda: osf.safefactor(0.1, param_rounding="kahan"),
    "with_param_rounding": lambda: osf.with_param_rounding(optax.sgd(0.1, momentum=0.9), "kahan"),
}
NEAREST = {
    "safefactor": lambda: osf.safefactor(0.1),
    "with_param_rounding": lambda: osf.with_param_rounding(optax.sgd(0.1, momentum=0.9),
                                                           "nearest"),
}


@pytest.mark.parametrize("name", sorted(KAHAN))
@pytest.mark.parametrize("wrap", ["bare", "flatten"])
def test_kahan_steps_one_float32_array_as_nearest_does(name, wrap):
  # init's compensation of one float32 array is None itself (no narrow param, nothing to
  # compensate); update took it for a state made with another mode and refused it.
  def build(kind):
    tx = kind[name]()
    return optax.flatten(tx) if wrap == "flatten" else tx

  params = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
  if wrap == "flatten":
    params = {"w": params, "b": jnp.ones(3)}
  grads = [jax.tree.map(lambda p, s=step: jnp.cos(p * (s + 1)), params) for step in range(3)]
  kahan, kahan_state, _ = run_steps(build(KAHAN), params, grads)
  nearest, _, _ = run_steps(build(NEAREST), params, grads)
  assert_trees_bitwise_equal(kahan, nearest)  # float32 params: untouched by every mode
  assert jax.tree.structure(kahan_state) == jax.tree.structure(build(KAHAN).init(params))


def test_kahan_takes_a_state_without_compensation_where_no_param_is_narrow():
  # A state made with "nearest" over float32 params holds nothing Kahan would keep.
  params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
  grads = {"w": jnp.full((4, 3), 0.5), "b": jnp.full(3, 0.5)}
  tx = osf.with_param_rounding(optax.sgd(0.1), "kahan")
  state = osf.with_param_rounding(optax.sgd(0.1), "nearest").init(params)
  updates, new_state = tx.update(grads, state, params)
  assert new_state.compensation is None
  np.testing.assert_allclose(updates["w"], -0.05, rtol=1e-6)
  narrow = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  with pytest.raises(ValueError, match="holds no compensation"):
    tx.update(grads, osf.with_param_rounding(optax.sgd(0.1), "nearest").init(narrow), narrow)
