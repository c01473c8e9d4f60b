"""The guards' counters: skipped calls in all, in a row, and per leaf, for steps and micro-batches.

A guard (:func:`skip_nonfinite`, safefactor's own) counts skipped optimizer steps in a
:class:`SkipNonfiniteState`; :func:`accumulate_gradients` counts skipped micro-batches
in :class:`MicroBatchCounters`. Both are counted by :func:`count_call`, and both are
found in any optimizer state by :func:`find_counters`, which every report reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_safefactor._src import array_dataclasses, checks, state_checks
from optax_safefactor._src.placement import is_box, unbox
from optax_safefactor._src.spikes import init_history
from optax_safefactor._src.trees import find_all_with_paths


@dataclasses.dataclass(frozen=True)
class LeafCounts:
  """One int32 count per param leaf, as one vector: a guard's per-leaf counters.

  A vector, not a tree of scalars shaped like the params: the step updates it with one
  vector operation, and the compiled step has one output for it rather than one per
  leaf (on trees of hundreds of leaves, the scalars cost more compile time than the
  rest of the guard). ``treedef`` is the params' structure (a pytree's static part, so
  not an array): it names the counts, and ``per_leaf()`` gives them shaped like the
  params again.

  Attributes:
    counts: int32 array of shape ``(number of param leaves,)``, in the params' leaf order.
    treedef: the structure of the params (boxed params such as ``nnx.Param`` are leaves).

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_safefactor as osf
    >>> tx = osf.safefactor(learning_rate=0.1)
    >>> params = {"b": jnp.zeros(3), "w": jnp.ones((2, 3))}
    >>> state = tx.init(params)
    >>> _, state = tx.update({"b": jnp.zeros(3), "w": jnp.full((2, 3), jnp.nan)}, state,
    ...                      params)
    >>> state.nonfinite_steps.counts
    Array([0, 1], dtype=int32)
    >>> state.nonfinite_steps.per_leaf()["w"], state.nonfinite_steps.names()
    (Array(1, dtype=int32), ["params['b']", "params['w']"])
  """

  counts: jax.Array
  treedef: Any

  def names(self) -> list[str]:
    """Each count's parameter path (``params['dense']['kernel']``), in order."""
    return [checks.path_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(
        self.treedef.unflatten([0] * self.treedef.num_leaves))[0]]

  def per_leaf(self) -> Any:
    """The counts shaped like the params: an int32 scalar per leaf (for abstract counts,
    a ``jax.ShapeDtypeStruct`` per leaf, placed as the vector is)."""
    counts = self._one_vector(unbox(self.counts))
    if isinstance(counts, jax.ShapeDtypeStruct):
      sharding = counts.sharding
      if isinstance(sharding, jax.sharding.NamedSharding):  # the vector is replicated
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
      scalar = jax.ShapeDtypeStruct((), counts.dtype, sharding=sharding)
      return self.treedef.unflatten([scalar] * self.treedef.num_leaves)
    return self.treedef.unflatten([counts[i] for i in range(self.treedef.num_leaves)])

  def host_values(self) -> dict[str, int]:
    """The counts as host ints by parameter path."""
    counts = self._one_vector(np.asarray(unbox(self.counts)))
    return dict(zip(self.names(), counts.tolist(), strict=True))

  def _one_vector(self, counts: Any) -> Any:
    """``counts`` if it is one optimizer's vector of one count per leaf; a ``ValueError``
    otherwise. Another model's vector (put in by hand) would be cut short or read past
    its end by the leaves' indices, which JAX clamps."""
    counts = _one_optimizers(counts, "LeafCounts")
    if counts.shape[0] != self.treedef.num_leaves:
      raise ValueError(
          f"this optimizer state holds {counts.shape[0]} per-leaf counts for params of "
          f"{self.treedef.num_leaves} leaves: it was not made for these params; "
          f"{state_checks.RESTORE}")
    return counts

  @classmethod
  def from_per_leaf(cls, tree: Any) -> LeafCounts:
    """The vector of a tree of int32 scalars (the per-leaf layout of earlier releases)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_box)
    return cls(jnp.asarray([unbox(x) for x in leaves], jnp.int32), treedef)


def _one_optimizers(counts: Any, owner: str) -> Any:
  """``counts`` if it is one optimizer's vector; a ``ValueError`` for a batch of them
  (jax.vmap over init and update, an ensemble), whose rows are members, not leaves."""
  if len(counts.shape) != 1:
    raise ValueError(
        f"this {owner} holds counts of shape {tuple(counts.shape)}: a batch of "
        f"{tuple(counts.shape[:-1])} optimizers (made under jax.vmap), not one; take one "
        "member's first, e.g. jax.tree.map(lambda x: x[i], counts)")
  return counts


def _listed(names: list[str] | tuple[str, ...]) -> str:
  """The first few of ``names``, and how many there are (a restore's error on a tree of
  hundreds of params stays readable)."""
  shown = ", ".join(names[:4])
  return shown if len(names) <= 4 else f"{shown}, ... ({len(names)} in all)"


array_dataclasses.register(
    LeafCounts, ("counts",),
    lambda counts: f"one count per param leaf of its params: {_listed(counts.names())}")


@dataclasses.dataclass(frozen=True)
class HyperparamCounts:
  """Per hyperparameter a guard checks: in how many steps its value was non-finite, and
  the last such step (the guard's ``step`` then, or -1).

  A NaN learning-rate schedule makes every update NaN; counted here, the reports name the
  hyperparameter rather than every leaf. ``names`` are the hyperparameters' names
  (``"learning_rate"``), a static part of the pytree like :class:`LeafCounts`'s treedef.

  Attributes:
    counts: int32 array of shape ``(len(names),)``.
    last_step: int32 array of shape ``(len(names),)``.
    names: the hyperparameters' names, in the arrays' order.
  """

  counts: jax.Array
  last_step: jax.Array
  names: tuple[str, ...]

  @classmethod
  def zeros(cls, names: tuple[str, ...]) -> HyperparamCounts:
    """No non-finite value seen yet, for each of ``names``."""
    return cls(jnp.zeros([len(names)], jnp.int32), jnp.full([len(names)], -1, jnp.int32),
               tuple(names))

  def counted(self, finite: jax.Array, step: jax.Array) -> HyperparamCounts:
    """After a step (the guard's ``step``) whose hyperparameters' finiteness is ``finite``
    (a bool vector in the order of ``names``)."""
    return dataclasses.replace(
        self,
        counts=jnp.where(finite, self.counts, optax.safe_increment(self.counts)),
        last_step=jnp.where(finite, self.last_step, step))

  def host_values(self) -> tuple[dict[str, int], dict[str, int]]:
    """The counts and last steps as host ints by name."""
    counts = _one_optimizers(np.asarray(unbox(self.counts)), "HyperparamCounts").tolist()
    last = np.asarray(unbox(self.last_step)).tolist()
    return dict(zip(self.names, counts, strict=True)), dict(zip(self.names, last, strict=True))


array_dataclasses.register(
    HyperparamCounts, ("counts", "last_step"),
    lambda counts: f"one per hyperparameter its guard checks: {_listed(counts.names)}")


class SkipNonfiniteState(NamedTuple):
  """State of :func:`skip_nonfinite` (and of :func:`safefactor`, which guards itself).

  Attributes:
    inner_state: the wrapped transformation's state, as of the last applied step.
    skipped_steps: total number of skipped steps (int32).
    consecutive_skips: skipped steps since the last applied one (int32).
    step: number of ``update`` calls, applied or skipped (int32).
    nonfinite_steps: per leaf, the number of steps in which that leaf's output
      was non-finite (a :class:`LeafCounts`).
    last_nonfinite_step: per leaf, the value of ``step`` the last time that leaf
      was non-finite, or -1 (a :class:`LeafCounts`).
    spikes: with ``skip_spikes``, the spike rule's :class:`SpikeHistory` (its skipped
      spikes are counted in ``skipped_steps`` too, never in ``consecutive_skips``);
      ``None`` without.
    nonfinite_hyperparams: per hyperparameter the guard checks (safefactor's learning
      rate, weight-decay rate and the other values its step reads; the values
      ``optax.inject_hyperparams`` holds inside :func:`skip_nonfinite`), in how many steps
      it was non-finite and when last (a :class:`HyperparamCounts`; ``None`` for a
      guard that checks none, as orbax cannot save a zero-size array). Such a step is
      skipped and counted in ``skipped_steps`` and ``consecutive_skips``. Added in 0.3:
      :func:`migrate_from_0_2` fills it in an older state.
  """

  inner_state: Any
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  step: jax.Array
  nonfinite_steps: Any
  last_nonfinite_step: Any
  spikes: Any = None
  nonfinite_hyperparams: Any = None


class MicroBatchCounters(NamedTuple):
  """What :func:`accumulate_gradients` counts: its skipped micro-batches.

  The fields of :class:`SkipNonfiniteState` less ``inner_state``, counted by the same
  code, with a micro-batch (one ``update`` call) in place of a step. The reports name
  them as micro-batches, and :func:`skipped_steps` includes them: a skipped micro-batch
  is a skipped update call.

  Attributes:
    skipped_steps: total number of skipped micro-batches (int32).
    consecutive_skips: skipped micro-batches since the last finite one (int32).
    step: number of micro-batches seen, finite or not (int32).
    nonfinite_steps: per leaf, the number of micro-batches in which that leaf was
      non-finite (a :class:`LeafCounts`).
    last_nonfinite_step: per leaf, the value of ``step`` the last time that leaf was
      non-finite, or -1 (a :class:`LeafCounts`).
  """

  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  step: jax.Array
  nonfinite_steps: Any
  last_nonfinite_step: Any


# Guard states and micro-batch counters: everything the reports read.
COUNTER_TYPES = (SkipNonfiniteState, MicroBatchCounters)

#: The counters both kinds keep, each checked to be int32 where a state comes into an
#: ``update`` (``state_checks.check_counters``), before anything is traced.
COUNTER_FIELDS = MicroBatchCounters._fields


def per_leaf_counters(params: Any, value: int) -> LeafCounts:
  """One int32 count per param leaf, each at ``value`` (a plain array, even for boxed
  params: a param's sharding does not fit the counts)."""
  treedef = jax.tree.structure(params, is_leaf=is_box)
  if _stands_in_for_params(params, treedef):
    # optax.tree.map_params inits with a leafless object in place of the params and maps
    # its function over what stands where that object lands: here, the counts.
    return params
  return LeafCounts(jnp.full([treedef.num_leaves], value, jnp.int32), treedef)


def _stands_in_for_params(params: Any, treedef: Any) -> bool:
  return (treedef.num_leaves == 0 and treedef.num_nodes == 1 and params is not None
          and not isinstance(params, (dict, list, tuple)))


def _zero_counts(params: Any) -> dict[str, Any]:
  return dict(
      skipped_steps=jnp.zeros([], jnp.int32),
      consecutive_skips=jnp.zeros([], jnp.int32),
      step=jnp.zeros([], jnp.int32),
      nonfinite_steps=per_leaf_counters(params, 0),
      last_nonfinite_step=per_leaf_counters(params, -1),
  )


def init_guarded(inner_state: Any, params: Any, spike_window: Any = None,
                 hyperparams: tuple[str, ...] = ()) -> SkipNonfiniteState:
  """A guard's state around ``inner_state``, with every counter at zero, an empty
  spike history of ``spike_window`` steps unless that is ``None``, and counts for the
  named ``hyperparams``."""
  spikes = None if spike_window is None else init_history(spike_window)
  # None where no hyperparameter is checked: orbax cannot save a zero-size array.
  return SkipNonfiniteState(inner_state=inner_state, **_zero_counts(params), spikes=spikes,
                            nonfinite_hyperparams=(HyperparamCounts.zeros(hyperparams)
                                                   if hyperparams else None))


def init_micro_batch_counters(params: Any) -> MicroBatchCounters:
  """Micro-batch counters for ``params``, every one at zero."""
  return MicroBatchCounters(**_zero_counts(params))


Counters = TypeVar("Counters", SkipNonfiniteState, MicroBatchCounters)


def count_call(counters: Counters, leaf_finite: jax.Array, call_finite: jax.Array,
               spike_skipped: jax.Array | None = None) -> Counters:
  """``counters`` after one more ``update`` call whose verdict is ``call_finite``.

  ``counters`` is a :class:`SkipNonfiniteState` or a :class:`MicroBatchCounters`;
  ``leaf_finite`` is a bool vector, one flag per param leaf in the params' leaf order
  (``xla_hints.flag_vector``). ``call_finite`` is False for any skipped call;
  ``spike_skipped`` (when given) is True where the call was skipped as a spike, which
  counts in ``skipped_steps`` but leaves ``consecutive_skips``, the run of non-finite
  skips, as it was. Nothing but the counters changes. Their dtypes are checked where the
  state comes in (``state_checks.check_counters`` with :data:`COUNTER_FIELDS`).
  """
  counts, last = counters.nonfinite_steps, counters.last_nonfinite_step
  if not isinstance(counts, LeafCounts) or not isinstance(last, LeafCounts):
    raise TypeError(
        f"{type(counters).__name__}.nonfinite_steps and .last_nonfinite_step must be "
        f"LeafCounts, got {type(counts).__name__}: a state in the per-leaf layout of "
        "optax_safefactor 0.2 (trees shaped like the params); convert it with "
        "osf.migrate_from_0_2(opt_state)")
  if leaf_finite.shape != counts.counts.shape:
    raise ValueError(
        f"the optimizer state counts {counts.counts.shape[0]} param leaves, but this update "
        f"has {leaf_finite.shape[0]}; make the state with init on these params")
  return counters._replace(
      skipped_steps=jnp.where(
          call_finite, counters.skipped_steps, optax.safe_increment(counters.skipped_steps)
      ),
      consecutive_skips=jnp.where(
          call_finite, 0,
          optax.safe_increment(counters.consecutive_skips) if spike_skipped is None
          else jnp.where(spike_skipped, counters.consecutive_skips,
                         optax.safe_increment(counters.consecutive_skips)),
      ),
      step=optax.safe_increment(counters.step),
      nonfinite_steps=dataclasses.replace(counts, counts=jnp.where(
          leaf_finite, counts.counts, optax.safe_increment(counts.counts))),
      last_nonfinite_step=dataclasses.replace(last, counts=jnp.where(
          leaf_finite, last.counts, counters.step)),
  )


def find_counters(opt_state: Any) -> list[SkipNonfiniteState | MicroBatchCounters]:
  """Every guard state and micro-batch counter in ``opt_state``, in its tree order, guards
  inside another guard included; a ``ValueError`` when there is none."""
  return [found for _, found in find_counters_with_paths(opt_state)]


def find_counters_with_paths(opt_state: Any) -> list[tuple[tuple[Any, ...], Any]]:
  """:func:`find_counters`' states, each with its key path in ``opt_state``."""
  found = find_all_with_paths(opt_state, COUNTER_TYPES)
  if not found and type(opt_state).__module__.startswith("flax.nnx"):
    # nnx.state() keeps each array in a dict by its field's name: no state type is left.
    raise ValueError(
        f"this is a flax {type(opt_state).__name__} (of nnx.state(optimizer), or of a model "
        "and optimizer pair, as saved or restored), which keeps the optimizer state's arrays "
        "but not its types, so no guard can be found in it: pass optimizer.opt_state (or "
        "the nnx.Optimizer), after nnx.update or nnx.merge of a restored state")
  if not found and checks.is_transformation(opt_state):
    raise TypeError(
        f"this is an optimizer ({state_checks.with_article(type(opt_state).__name__)}), not "
        "its state: pass the state it makes and updates, opt_state = optimizer.init(params)")
  if not found and _holds_counts_as_dicts(opt_state):
    raise ValueError(
        "no skip_nonfinite state found in opt_state: it holds a guard's counts "
        f"({', '.join(COUNTER_FIELDS)}) as a dict's items, as a checkpoint restored without a "
        f"target does (it keeps the arrays, not their types); {state_checks.RESTORE}")
  if not found:
    # optax's own guard is the usual one to find instead: say where its counts are.
    # Every one of them: in a multi_transform, each part's guard counts its own steps.
    theirs = [f"opt_state{jax.tree_util.keystr(path)}.total_notfinite"
              for path, _ in find_all_with_paths(opt_state, optax.ApplyIfFiniteState)]
    where_theirs = ""
    if len(theirs) == 1:
      where_theirs = (" It holds optax.apply_if_finite's state, which counts in its own "
                      f"fields: {theirs[0]} (and .notfinite_count, in a row)")
    elif theirs:
      where_theirs = (" It holds optax.apply_if_finite's states, which count in their own "
                      f"fields: {', '.join(theirs)} (and .notfinite_count, in a row)")
    raise ValueError(
        "no skip_nonfinite state found in opt_state; was the optimizer built with "
        "skip_nonfinite (safefactor does so unless skip_nonfinite_steps=False) or "
        "accumulate_gradients?" + where_theirs)
  if any(isinstance(unbox(guard.skipped_steps), jax.ShapeDtypeStruct) for _, guard in found):
    raise TypeError(
        "this optimizer state is abstract (jax.eval_shape's, or a checkpoint's restore "
        "target): it holds shapes, not counts; pass the state a step returned or the one "
        "restored into it")
  return found


def _holds_counts_as_dicts(tree: Any) -> bool:
  """Whether a dict in ``tree`` has every field of the counters: a guard's state restored
  as plain containers (orbax's ``restore`` without a target)."""
  if isinstance(tree, dict):
    return (set(COUNTER_FIELDS) <= set(tree)
            or any(_holds_counts_as_dicts(value) for value in tree.values()))
  if isinstance(tree, (list, tuple)):
    return any(_holds_counts_as_dicts(value) for value in tree)
  return False
