"""Compiled-program structure: the guard must keep the program linear in the number of leaves."""

import jax
import jax.numpy as jnp

import optax_safefactor as osf


def _compiled_lines(n_leaves: int) -> int:
  params = {f"w{i}": jnp.ones((4, 3)) for i in range(n_leaves)}
  tx = osf.safefactor(0.1, min_dim_size_to_factor=2, momentum=0.9)
  state = tx.init(params)
  return len(jax.jit(tx.update).lower(params, state, params).compile().as_text().splitlines())


def test_compiled_program_grows_linearly_with_leaves():
  # Every leaf reads one skip flag. If the compiler copies the flag's computation (over
  # all leaves) into each leaf's kernel, the program grows quadratically: 9x for 3x the
  # leaves, and compile time with it.
  small, large = _compiled_lines(20), _compiled_lines(60)
  assert large / small < 3.6, (small, large)
