"""The transformation type that reports, with its updates, whether they are finite."""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax


class WitnessedUpdateFn(Protocol):
  """``update`` that also returns one scalar bool per leaf of the updates.

  The bool is True exactly when everything the transform produced for that leaf
  (the update and the leaf's new state) is finite. It is derived from statistics the
  transform computes anyway, so deciding a skip costs no extra pass over the
  gradients.
  """

  def __call__(
      self, updates: optax.Updates, state: optax.OptState, params: optax.Params | None = None,
      **extra_args: Any,
  ) -> tuple[optax.Updates, optax.OptState, Any]: ...


class WitnessedTransformation(optax.GradientTransformationExtraArgs):
  """A ``GradientTransformationExtraArgs`` that can also report per-leaf finiteness.

  It is an ordinary two-field optax transformation (``init``, ``update``), so it
  composes with every optax combinator; :func:`skip_nonfinite` additionally
  finds ``update_with_witness`` on it and decides skips from the witness instead
  of scanning every output.
  """

  update_with_witness: WitnessedUpdateFn

  def __new__(cls, init: optax.TransformInitFn, update_with_witness: WitnessedUpdateFn):
    def update(updates, state, params=None, **extra_args):
      new_updates, new_state, _ = update_with_witness(updates, state, params, **extra_args)
      return new_updates, new_state

    transformation = super().__new__(cls, init, update)
    transformation.update_with_witness = update_with_witness
    return transformation


def tree_all(bools: list[jax.Array]) -> jax.Array:
  """One scalar bool: all of ``bools`` (True when there are none)."""
  if not bools:
    return jnp.array(True)
  return jnp.all(jnp.stack([jnp.asarray(b, bool) for b in bools]))


def unzip_leaf_results(updates: Any, results: Any, arity: int) -> tuple[Any, ...]:
  """Split a tree of per-leaf tuples (shaped like ``updates``) into ``arity`` trees."""
  treedef = jax.tree.structure(updates)
  columns = list(zip(*treedef.flatten_up_to(results), strict=True)) or [()] * arity
  return tuple(jax.tree.unflatten(treedef, column) for column in columns)

