"""The transformation type that reports, with its updates, whether they are finite."""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax


class FinishFn(Protocol):
  """Second half of a witnessed update: produce the outputs, given the step's verdict.

  ``step_finite`` is ``None`` when no guard is present (produce the plain update), or
  a scalar bool: when False the updates must be zeros and the new state must equal the
  old state exactly.
  """

  def __call__(self, step_finite: jax.Array | None) -> tuple[optax.Updates, optax.OptState]: ...


class WitnessedUpdateFn(Protocol):
  """First half of a witnessed update: per-leaf finiteness, and how to finish.

  Returns ``(leaf_finite, finish)``. ``leaf_finite`` has one scalar bool per leaf of
  the updates, True exactly when everything the transform would produce for that
  leaf (its update and its new state) is finite. It comes from statistics the
  transform computes anyway, so deciding a skip costs no extra pass over the
  gradients; and since the transform applies the verdict itself in ``finish``, it
  can place the selects where they fuse with work it does anyway.
  """

  def __call__(
      self, updates: optax.Updates, state: optax.OptState, params: optax.Params | None = None,
      **extra_args: Any,
  ) -> tuple[Any, FinishFn]: ...


class WitnessedTransformation(optax.GradientTransformationExtraArgs):
  """A ``GradientTransformationExtraArgs`` that can also report per-leaf finiteness.

  It is an ordinary two-field optax transformation (``init``, ``update``), so it
  composes with every optax combinator; :func:`skip_nonfinite` additionally
  finds ``update_with_witness`` on it, decides the skip from the witness and hands
  the verdict back, instead of scanning every output.
  """

  update_with_witness: WitnessedUpdateFn

  def __new__(cls, init: optax.TransformInitFn, update_with_witness: WitnessedUpdateFn):
    def update(updates, state, params=None, **extra_args):
      _, finish = update_with_witness(updates, state, params, **extra_args)
      return finish(None)

    transformation = super().__new__(cls, init, update)
    transformation.update_with_witness = update_with_witness
    return transformation


def keep_unless_skipped(step_finite: jax.Array | None, new: jax.Array, old: jax.Array) -> jax.Array:
  """``new``, or ``old`` (exactly) when the step is skipped."""
  if step_finite is None:
    return new
  return jnp.where(step_finite, new, jnp.asarray(old, new.dtype))


def zero_if_skipped(step_finite: jax.Array | None, update: jax.Array) -> jax.Array:
  """``update``, or zeros when the step is skipped."""
  if step_finite is None:
    return update
  return jnp.where(step_finite, update, jnp.zeros((), update.dtype))


def tree_all(bools: list[jax.Array]) -> jax.Array:
  """One scalar bool: all of a few ``bools`` (True when there are none)."""
  if not bools:
    return jnp.array(True)
  return jnp.all(jnp.stack([jnp.asarray(b, bool) for b in bools]))


def all_once(bools: list[jax.Array]) -> jax.Array:
  """All of ``bools`` as one scalar that the compiler computes once.

  Every leaf's output reads this flag. A plain ``and`` of the leaves' bools is cheap
  enough that XLA copies the whole chain into the fused kernel of every leaf, which
  makes compile time quadratic in the number of leaves; routing the flag through an
  ``exp`` (an op XLA will not duplicate) keeps one copy. The flag is built from
  0/1 counts, never from NaN, which the CPU backend's optimiser may fold away.
  """
  if not bools:
    return jnp.array(True)
  bad_leaves = jnp.sum(jnp.stack([jnp.where(b, 0.0, 1.0) for b in bools]).astype(jnp.float32))
  return jnp.exp(-bad_leaves) > 0.5


def unzip_leaf_results(updates: Any, results: Any, arity: int) -> tuple[Any, ...]:
  """Split a tree of per-leaf tuples (shaped like ``updates``) into ``arity`` trees."""
  treedef = jax.tree.structure(updates)
  columns = list(zip(*treedef.flatten_up_to(results), strict=True)) or [()] * arity
  return tuple(jax.tree.unflatten(treedef, column) for column in columns)

