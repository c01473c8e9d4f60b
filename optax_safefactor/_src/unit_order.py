"""Compiler hints on the order of units: on XLA:TPU, an unguarded step's units one after another.

Without a guard each unit's step depends on nothing but its own arrays, and XLA:TPU's
memory scheduler keeps the order the units are listed in: every leaf's scaling reductions
first, every update last, so that each update reads its gradient and param from device
memory again. Linking each unit's reads to the previous unit's result keeps a leaf's work
together. Like :mod:`optax_safefactor._src.xla_hints` (the other hints, which pay on the CPU
and GPUs), each link is the plain computation on the compilers where it was not measured to
pay, chosen when the program is lowered (:func:`per_compiler.choose`), and is pinned by the
tests its docstring names.
"""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from optax_safefactor._src import per_compiler, placement

T = TypeVar("T")

#: Where :func:`read_after` and :func:`read_after_update` were measured to pay: XLA:TPU (v5e,
#: compiled without a device).
MEASURED_ON_TPU = ("tpu",)


def read_after(value: jax.Array, written: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(value, written)``, unchanged; on XLA:TPU, ``value`` is read only once ``written``
  has been computed.

  Without a guard, each unit's step depends on nothing but its own arrays, and XLA:TPU's
  memory scheduler, finding its orders of equal peak memory, keeps the list order: every
  leaf's scaling reductions first, every leaf's update last, so that each update reads its
  gradient and param from HBM again. Through one barrier with the previous unit's new
  momentum, a unit's gradient waits for that unit's update, and each leaf's work stays
  together. The 1B slice with ``momentum=0.9, skip_nonfinite_steps=False``, compiled for
  TPU v5e without a device: 6.81 passes against 7.66 without it in float32, 8.02 against
  9.25 in bfloat16 (optax.adafactor: 7.56 and 8.36; other trees in docs/benchmarks.md, "Unit
  after unit without a guard"). On H100 the 1B slice's bytes were the same either way and
  GPT-2 small's update kernels were no longer shared (589 fusions against 442), so it is
  applied on :data:`MEASURED_ON_TPU`. The momentum is
  the link because it is written in full anyway; passing the update through the barrier
  instead wrote it out in full (temporaries of 0.27x the params).

  Pinned by ``tests/test_accelerators.py::test_unguarded_steps_run_unit_after_unit_on_tpu``
  and ``tests/test_accelerators.py::test_an_unguarded_step_moves_less_than_optax_on_tpu``.

  >>> [x.tolist() for x in read_after(jnp.ones(2), jnp.zeros(1))]  # eager: unchanged
  [[1.0, 1.0], [0.0]]
  """
  value, written = per_compiler.barrier_on(MEASURED_ON_TPU, [value, written])
  return value, written


def read_after_update(value: jax.Array, statistics: T, update: jax.Array) -> tuple[jax.Array, T]:
  """``(value, statistics)``, unchanged; on XLA:TPU, both are read only once ``update``
  has been computed: :func:`read_after` for a step without momentum.

  Such a step writes nothing in full but its updates, and an update through a barrier is
  written out (temporaries of 0.27x the params). Instead the update's kernel also takes
  its largest magnitude, a scalar; ``value`` passes one barrier with it, and a zero made
  from its bits (two shifts, which XLA does not fold) is added to ``statistics``, so that
  the unit's reductions, which read them, wait for the previous unit's update. The 1B
  slice with ``skip_nonfinite_steps=False``, compiled for TPU v5e without a device: 4.01
  passes against 5.12 in bfloat16, 4.68 against 5.66 in float32 (optax.adafactor: 4.36 and
  5.84; other trees in docs/benchmarks.md, "Unit after unit without a guard or momentum").
  An update not known to be whole on every device (:func:`placement.is_replicated`) is not
  linked: its largest magnitude would be a collective. Nor is an empty one, which has none.

  Pinned by ``tests/test_accelerators.py::test_unguarded_steps_run_unit_after_unit_on_tpu``,
  ``tests/test_accelerators.py::test_an_unguarded_step_moves_less_than_optax_on_tpu``,
  ``tests/test_accelerators.py::test_a_sharded_update_is_not_linked_on_tpu`` and
  ``tests/test_accelerators.py::test_an_empty_update_links_no_unit_on_tpu``; its values by
  ``tests/test_compile.py::test_the_link_between_units_changes_no_value``.

  >>> value, statistics = read_after_update(jnp.ones(2), [jnp.full(1, 3.0)], jnp.zeros(2))
  >>> value.tolist(), statistics[0].tolist()  # eager: unchanged
  ([1.0, 1.0], [3.0])
  """
  if (not isinstance(value, jax.core.Tracer) or update.size == 0
      or not placement.is_replicated(update)):
    return value, statistics
  leaves, treedef = jax.tree.flatten(statistics)
  # The update comes back out unchanged, so that the plain form is per_compiler.unchanged,
  # which the other platforms lower without tracing anything.
  args = [value, update, *leaves]
  value, _, *leaves = per_compiler.choose(MEASURED_ON_TPU, _after_largest,
                                          per_compiler.unchanged, args,
                                          [jax.typeof(x) for x in args])
  return value, jax.tree.unflatten(treedef, leaves)


def _after_largest(value: jax.Array, update: jax.Array,
                   *statistics: jax.Array) -> list[jax.Array]:
  largest = jnp.max(jnp.abs(update)).astype(jnp.float32)
  value, largest = per_compiler.barrier(value, largest)
  bits = jax.lax.bitcast_convert_type(largest, jnp.uint32)
  zero = jax.lax.shift_right_logical(jax.lax.shift_right_logical(bits, np.uint32(31)),
                                     np.uint32(1))
  return [value, update, *[s + zero.astype(s.dtype) for s in statistics]]
