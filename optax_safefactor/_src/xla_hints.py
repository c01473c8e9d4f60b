"""Compiler hints: how the Adafactor step is kept fast, named so the maths need not say it.

Each helper changes how XLA fuses or schedules the step, never what it computes, and
each names the compilers on which it was measured to pay (:data:`MEASURED_ON_CPU`,
:data:`MEASURED_ON_CPU_AND_GPU`, :data:`MEASURED_ON_GPU`): it is applied only there.
Elsewhere it is the plain computation it stands for: on XLA:TPU the step is the algorithm
as written (docs/benchmarks.md, "Accelerator compilers": the CPU's hints cost the TPU 13-18%
more traffic), its units linked one after another in an unguarded step
(:mod:`optax_safefactor._src.unit_order`, the one idea that pays there).

The choice is made when the program is lowered, not traced: a step traced on a CPU host
and compiled for a TPU gets the TPU's program. A hint on each leaf is one primitive
(:func:`per_compiler.choose`) whose lowering picks a form; ``jax.lax.platform_dependent``
(1.2 ms a call on the 2-core CPU, seconds on hundreds of leaves) serves the step's few
global hints only. Each hint is pinned by the test its docstring names, so removing or
breaking one fails a test rather than silently costing memory or compile time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from optax_safefactor._src import per_compiler, placement, trees

T = TypeVar("T")

#: The compilers on which the CPU's hints were measured to pay (JAX's platform names).
#: On XLA:TPU and XLA:GPU, compiled without a device, the same hints moved more bytes and
#: made more fusions than the plain step (docs/benchmarks.md, "Accelerator compilers").
MEASURED_ON_CPU = ("cpu",)

#: Where :func:`unmergeable` was measured to pay: XLA:CPU and XLA:GPU (H100, compiled
#: without a device: on 48 leaves of a few thousand elements, 9.09 passes and temporaries
#: of 1.01x the params without it, 7.83 and 0.08x with it; the 1B slice and GPT-2 small
#: within 0.01 pass either way). XLA:TPU keeps no such array (600-leaf tree: none).
MEASURED_ON_CPU_AND_GPU = ("cpu", "cuda")

#: Where :func:`pieces_apart`, :func:`step_scalars` and :func:`skip_verdict` were measured to
#: pay: XLA:GPU (H100, compiled without a device).
MEASURED_ON_GPU = ("cuda",)

#: XLA's CPU backend hands a reduction of at least this many elements to its library
#: kernels (XNNPACK), which it compiles in a fraction of a millisecond; a smaller one
#: becomes a chain of loop kernels (a reduce-window or two, then a reduce), each compiled
#: by LLVM in about 10 ms on the 2-core machine (docs/benchmarks.md).
LIBRARY_REDUCTION_SIZE = 4096


def _barrier_on(platforms: Sequence[str], values: Sequence[jax.Array]) -> list[jax.Array]:
  """``values`` through an optimization barrier on ``platforms``, as they are elsewhere."""
  values = list(values)
  for value in values:
    if isinstance(value, jax.core.Tracer):
      return per_compiler.barrier_on(platforms, values)
  return values  # eager: nothing to schedule


def separate_reads(*values: T) -> tuple[T, ...]:
  """The same values, as distinct copies that XLA:CPU will not merge.

  Each reduction that reads a gradient should read it itself: on the CPU a square or an
  upcast shared by two reductions is written to a full-size temporary and read back,
  where separate ones fuse into their reductions (float32 gradients included: without
  it, every leaf's square was kept at once). XLA:TPU and XLA:GPU fuse the two reductions
  of one read into one multi-output kernel instead, which the barrier prevents: there
  each reduction read the gradient from device memory again.

  Pinned by ``tests/test_compile.py::test_no_leaf_keeps_a_full_size_temporary``.
  """
  return tuple(_barrier_on(MEASURED_ON_CPU, values))


def fresh_read(value: jax.Array, dtype: Any) -> jax.Array:
  """``value.astype(dtype)``, where that is an upcast read (on the CPU) from a copy XLA
  will not merge.

  Used where, on the CPU, a full-size upcast would otherwise be shared with a later pass
  and kept alive across the skip decision. A value already in ``dtype`` has no upcast to
  share: it is read as it is (the same temporaries with and without a barrier,
  measured), since each barrier is HLO instructions per leaf that every compiler pass
  walks.

  Pinned by ``tests/test_compile.py::test_no_leaf_keeps_a_full_size_temporary``,
  ``test_a_bfloat16_momentum_on_the_clipping_pass_keeps_no_float32_copy`` and
  ``test_barriers_only_where_values_are_upcast``.

  >>> fresh_read(jnp.ones(2, jnp.bfloat16), jnp.float32).dtype
  dtype('float32')
  """
  if np.dtype(value.dtype) == np.dtype(dtype):
    return value
  (value,) = _barrier_on(MEASURED_ON_CPU, [value])
  return value.astype(dtype)


def computed_again(compute: Callable[..., list[jax.Array]], reads: Sequence[jax.Array],
                   scalars: Sequence[jax.Array], kept: Sequence[jax.Array]) -> list[jax.Array]:
  """``[*reads, *kept]``: full-size arrays to read, and values of the step's first half; on
  GPUs ``[*reads, *compute(*reads, *scalars)]``: the reads as new values, computed again.

  An unfactored leaf's statistic and factor are full-size, and the verdict waits for every
  leaf's first half: kept across it, on H100 they were temporaries of 1.00x the float32
  params' bytes and 10.00 passes; computed again, none and 8.00 (docs/benchmarks.md). XLA:TPU
  computes them again itself; on the CPU a mesh's step then no longer equalled one device's.

  Pinned by ``tests/test_accelerators.py::test_unfactored_leaves_recompute_on_a_gpu``.
  """
  n, m = len(reads), len(scalars)

  def again(*args):  # the scalars pass through, so that elsewhere all is per_compiler.unchanged
    fresh = per_compiler.barrier(*args[:n])
    return [*fresh, *args[n:n + m], *compute(*fresh, *args[n:n + m])]

  args = [*reads, *scalars, *kept]
  out = per_compiler.choose(MEASURED_ON_GPU, again, per_compiler.unchanged, args,
                            [jax.typeof(x) for x in args])
  return out[:n] + out[n + m:]


def step_scalars(*values: jax.Array) -> list[jax.Array]:
  """The step's scalars that every leaf reads (the decay, a scheduled rate), computed once
  in a kernel of their own on GPUs and read there as every kernel's operands.

  XLA:GPU's fusion pass weighs fusing a producer into each of its consumers again
  whenever one of them changes, so a cheap scalar read by every leaf costs a number of
  weighings that grows with the square of the leaves (GPT-2 small: 68,232 for ``beta2``
  and 106,054 for ``1 - beta2``, of 262,313); out of a barrier, it is a value no kernel
  can copy, and the pass skips it (37,754 in all). Elsewhere they are as they were.

  Pinned by
  ``tests/test_accelerators.py::test_the_steps_scalars_and_flags_are_computed_once_for_a_gpu_only``.
  """
  return _barrier_on(MEASURED_ON_GPU, values)


def skip_verdict(flags: jax.Array, others: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
  """The step's verdict, all of ``flags`` (one bool per unit) and ``others``
  (:func:`computed_once`), and ``flags`` as the guard's counters should read them.

  The verdict and the guard's two counters each read every flag, and XLA:GPU copies the
  flags' scalar work (each leaf's ``isfinite`` of its sums) into each of the three: three
  kernels of 54 and 55 operands on the 1B slice. Through a barrier on GPUs, one kernel
  computes the vector and the three read it; elsewhere the flags are as they were.

  Pinned by ``tests/test_accelerators.py::test_each_leafs_finite_flag_is_computed_once_on_a_gpu``.
  """
  if isinstance(flags, jax.core.Tracer):  # as _barrier_on checks; saves an eager call
    (flags,) = _barrier_on(MEASURED_ON_GPU, [flags])
  return computed_once([flags, *others]), flags


def _all_through_exp(flags: jax.Array) -> jax.Array:
  bad = jnp.sum(jnp.where(flags, 0.0, 1.0).astype(jnp.float32))
  return jnp.exp(-bad) > 0.5


def computed_once(bools: list[jax.Array]) -> jax.Array:
  """All of ``bools`` (scalars, or vectors of flags: one per leaf), as one scalar
  that XLA:CPU computes once rather than per consumer.

  Every leaf's output reads the step's skip flag. On the CPU a plain ``and`` of the
  leaves' flags is cheap enough that XLA copies the whole chain into each leaf's fused
  kernel, which makes compile time quadratic in the number of leaves. An ``exp`` is an
  op XLA does not duplicate, so there the flag is routed through one, built from 0/1
  counts, never from NaN, which the CPU backend may fold away. Elsewhere it is
  ``jnp.all``: one of the step's few global hints, chosen by
  ``jax.lax.platform_dependent``.

  Pinned by ``tests/test_compile.py::test_compiled_program_grows_linearly_with_leaves``.
  """
  if not bools:
    return jnp.array(True)
  flags = bools[0] if len(bools) == 1 and jnp.ndim(bools[0]) == 1 else trees.flag_vector(bools)
  return jax.lax.platform_dependent(flags, cpu=_all_through_exp, default=jnp.all)


def unmergeable(small: Any) -> Any:
  """Small arrays (scale factors), as new values on the CPU and GPUs.

  The final update is scaled again from the gradient and the small factors rather
  than kept from the clipping pass, so that the full-size scaled gradient has one
  reader and lives for one reduction. Passing the factors through a barrier makes them
  new values, so XLA cannot merge the two scalings back into one kept full-size array
  (float32 gradients included): on the CPU, and on GPUs, where without it a tree of
  small leaves kept every leaf's scaled gradient (:data:`MEASURED_ON_CPU_AND_GPU`).

  Pinned by ``tests/test_compile.py::test_no_leaf_keeps_a_full_size_temporary`` and
  ``tests/test_accelerators.py::test_small_leaves_keep_no_scaled_gradient_on_a_gpu``.
  """
  leaves, treedef = jax.tree.flatten(small)
  return jax.tree.unflatten(treedef, _barrier_on(MEASURED_ON_CPU_AND_GPU, leaves))


def bit_pattern_rounding(on_the_pattern: Callable[[jax.Array], jax.Array],
                         plain: Callable[[jax.Array], jax.Array], x: jax.Array,
                         dtype: Any) -> jax.Array:
  """``on_the_pattern(x)`` in a program for the CPU, ``plain(x)`` elsewhere: one rounding
  of float32 ``x`` onto bfloat16, its result in ``dtype``.

  Both give the same values for every normal number, zero, Inf and NaN (a NaN's payload
  aside); ``plain`` flushes float32 subnormals, which XLA:TPU flushes in its arithmetic
  anyway. On the CPU the rounding is a few integer operations on the float32 pattern,
  which vectorise where a float conversion can be a library call per element (CPUs
  without bfloat16 instructions). On the accelerators they made the write-back's fused
  kernel about three times as long as round to nearest's, for the same bytes: the 1B slice's
  Kahan step in bfloat16 compiled in 2.88x of nearest's time with them and 1.40x with
  ``plain`` on TPU v5e, 1.57x and 1.33x on H100 (medians of 3 processes, compiled without a
  device; docs/benchmarks.md). Applied on :data:`MEASURED_ON_CPU`; eager, the pattern is
  what runs.

  Pinned by ``tests/test_accelerators.py::test_each_hint_is_in_the_programs_it_pays_in_only``
  (``reduce_precision`` in the accelerators' programs, not in the CPU's).

  Which form runs, shown with two forms that differ (real callers' forms agree):

  >>> step = jax.jit(lambda v: bit_pattern_rounding(lambda a: a + 1, lambda a: a + 2, v,
  ...                                               jnp.float32))
  >>> step(jnp.zeros(1, jnp.float32)).tolist()  # lowered for the CPU: the pattern form
  [1.0]
  """
  if not isinstance(x, jax.core.Tracer):
    return on_the_pattern(x)
  out = jax.typeof(x).update(dtype=np.dtype(dtype), weak_type=False)
  (rounded,) = per_compiler.choose(MEASURED_ON_CPU, lambda v: [on_the_pattern(v)],
                                   lambda v: [plain(v)], [x], [out])
  return rounded


def pieces_apart(vector: jax.Array, bounds: Sequence[tuple[int, int]]) -> list[jax.Array]:
  """``vector[start:stop]`` for each of ``bounds``: on GPUs, arrays of their own.

  Every stochastically rounded unit reads its keys from one vector
  (``write_back.with_stream_keys``). XLA:GPU fuses sibling kernels that read the same
  array into one multi-output kernel: it fused the update kernels of a dozen leaves of one
  shape into one, a large kernel to compile, where apart they are one kernel compiled
  once and reused. Through a barrier the vector is written out, and through a second one
  each piece is an array of its own (a slice of the vector's buffer, which XLA:GPU takes
  without a kernel), so no two updates read one array. GPT-2 small in bfloat16 on H100,
  compiled without a device: 115 kernels and 25.0k lines of PTX without it, 97 and 14.1k
  with it (round to nearest: 95 and 12.8k); compiled in 1.69x and 1.54x of nearest's time
  (medians of 3 processes; docs/benchmarks.md, "Stochastic rounding's keys on H100"). On
  XLA:TPU the program compiled to the same code either way (the 1B slice: 286,509 and
  286,521 lines), so it is applied on :data:`MEASURED_ON_GPU`.

  Pinned by ``tests/test_accelerators.py::test_stochastic_updates_share_kernels_on_a_gpu``.

  >>> [piece.tolist() for piece in pieces_apart(jnp.arange(5), [(0, 1), (1, 4)])]
  [[0], [1, 2, 3]]
  """
  bounds = [(int(start), int(stop)) for start, stop in bounds]
  if not isinstance(vector, jax.core.Tracer):
    return _pieces(vector, bounds)
  pieces = [jax.typeof(vector).update(shape=(stop - start,)) for start, stop in bounds]
  barrier = per_compiler.barrier
  return per_compiler.choose(MEASURED_ON_GPU, lambda v: barrier(*_pieces(barrier(v)[0], bounds)),
                             lambda v: _pieces(v, bounds), [vector], pieces)


def _pieces(vector: jax.Array, bounds: Sequence[tuple[int, int]]) -> list[jax.Array]:
  return [vector[start:stop] for start, stop in bounds]


def _unfoldable_rows(runtime_scalar: jax.Array, count: int) -> list[jax.Array]:
  zero = jnp.asarray(runtime_scalar).astype(jnp.float32) * 0.0
  return [jnp.sqrt(jnp.float32(row * row) + zero).astype(jnp.int32) for row in range(count)]


def row_indices(runtime_scalar: jax.Array, count: int) -> list[jax.Array]:
  """``0, 1, ..., count - 1`` as int32 scalars that XLA:CPU cannot fold to constants.

  XLA's CPU backend compiles one kernel per distinct fused computation and reuses it
  for identical ones. A leaf's part of a packed result is read by a slice at its row,
  which fuses into the kernel that writes the leaf's output: with constant rows, every
  row is a distinct kernel (for each output and each leaf size). Read by a dynamic slice
  at an index known only at run time, every row is the same kernel. Each index is
  ``sqrt(r * r + z)``, with ``z = 0 * runtime_scalar`` (exactly 0 for a finite scalar,
  which XLA cannot fold for floats) and a square root (exact for a perfect square), an
  op that XLA computes once rather than copying it into each reader. Elsewhere they are
  constants (``jax.lax.platform_dependent``).

  Pinned by ``tests/test_packing.py::test_packed_rows_are_read_by_one_kernel``.

  >>> [int(i) for i in row_indices(jnp.array(7), 3)]
  [0, 1, 2]
  """
  def constants(_):
    return [jnp.int32(row) for row in range(count)]

  return jax.lax.platform_dependent(
      runtime_scalar, cpu=lambda scalar: _unfoldable_rows(scalar, count), default=constants)


def nan_unless_finite(*xs: jax.Array) -> jax.Array:
  """0 where every ``x`` is finite, NaN where one is not: ``sum(x - x)``, broadcast.

  Added to a scale factor, it carries a non-finite statistic into the clipping
  reduction that the step computes anyway, so that one reduction decides the
  finiteness of both (one kernel fewer per statistic). XLA does not fold ``x - x``
  for floats, since it is NaN for Inf and NaN.

  Pinned by ``tests/test_guard.py`` (a NaN in the statistics alone is skipped) and by
  ``tests/test_compile.py`` (kernel count).

  >>> nan_unless_finite(jnp.array([2.0, jnp.inf, jnp.nan])).tolist()
  [0.0, nan, nan]
  """
  poison = xs[0] - xs[0]
  for x in xs[1:]:
    poison = poison + (x - x)
  return poison


def leaf_cap(cap: jax.Array, poison: jax.Array) -> jax.Array:
  """The scalar ``cap`` as a small array of the leaf's own on the CPU: ``cap + poison``.

  That is the cap where ``poison`` is 0 and NaN where it is NaN. A constant cap
  broadcast to a leaf's shape is one and the same instruction for every leaf of that
  shape, so XLA shares it, and the CPU backend writes a shared broadcast out in full
  for the reduction kernels that read it (the clipping's): a full-size temporary per
  leaf shape (28 MB of GPT-2 small's 32 MB in float32), read again by every leaf's
  clipping pass. Broadcast from a small array of the leaf's own, it fuses into the
  kernel like the scale factors do (:data:`MEASURED_ON_CPU`).

  Elsewhere the cap stays the constant it is, broadcast to the same shape. Where
  ``poison`` is NaN the product it caps is NaN already (the column factor carries the
  same poison) and ``jnp.minimum`` returns NaN when either operand is, so the capped
  scale is the same. On XLA:TPU the leaf's own array made one kernel per on-chip
  placement (the 1B slice in bfloat16: 75 kernels and 5.63 passes, against 57 and 5.19),
  and on H100 the plain form compiled faster (docs/benchmarks.md, "The cap on TPU v5e and
  H100").

  Pinned by ``tests/test_compile.py::test_no_leaf_keeps_a_full_size_temporary`` (the CPU)
  and ``tests/test_accelerators.py::test_the_cap_is_each_leafs_own_array_on_the_cpu_only``.

  >>> leaf_cap(jnp.float32(8.0), jnp.array([[0.0, jnp.nan]])).tolist()  # eager: plain
  [[8.0, 8.0]]
  """
  if not isinstance(poison, jax.core.Tracer):
    return _constant_cap(cap, poison)[0]
  (capped,) = per_compiler.choose(MEASURED_ON_CPU, lambda c, p: [c + p], _constant_cap,
                                  [jnp.asarray(cap, poison.dtype), poison],
                                  [jax.typeof(poison)])
  return capped


def _constant_cap(cap: jax.Array, poison: jax.Array) -> list[jax.Array]:
  return [jnp.full_like(poison, cap)]


def finite_by_sum(x: jax.Array, per_row: bool = False) -> jax.Array:
  """Scalar bool: every element of ``x`` is finite, as one fused float reduction
  (with ``per_row``, one bool per index of the leading axis).

  ``sum(x - x)`` is 0 when every element is finite and NaN otherwise (``x - x`` is NaN
  for NaN and Inf, and a sum of zeros cannot overflow). XLA fuses it into the pass that
  computes ``x``, where ``all(isfinite(x))`` writes a full-size boolean temporary
  (a quarter of a float32 parameter) on the CPU backend.

  Pinned by ``tests/test_accumulate.py::test_temporary_bytes_are_at_most_multi_steps``;
  in the Adafactor step, which checks the old momentum with it, by
  ``tests/test_compile.py::test_no_leaf_keeps_a_full_size_temporary``.

  >>> bool(finite_by_sum(jnp.array([1.0, 2.0]))), bool(finite_by_sum(jnp.array([1.0, jnp.inf])))
  (True, False)
  """
  return jnp.isfinite(jnp.sum(nan_unless_finite(x),
                              axis=tuple(range(1, x.ndim)) if per_row else None))


def _padded_sum(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
  shape = tuple([1 if a in axes else size for a, size in enumerate(x.shape)])
  kept = [a for a in range(x.ndim) if a not in axes]
  zero = jnp.zeros((), x.dtype)
  if not kept:
    flat = jax.lax.pad(x.reshape(-1), zero, [(0, LIBRARY_REDUCTION_SIZE - x.size, 0)])
    return jnp.sum(flat).reshape(shape)
  rows = math.prod([x.shape[a] for a in kept])
  order = kept + list(axes)
  flat = (x if order == sorted(order) else jnp.transpose(x, order)).reshape(rows, -1)
  width = -(-LIBRARY_REDUCTION_SIZE // rows)
  flat = jax.lax.pad(flat, zero, [(0, 0, 0), (0, width - flat.shape[1], 0)])
  return jnp.sum(flat, axis=1).reshape(shape)


def _plain_sum(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
  return jnp.sum(x, axes, keepdims=True)


def sum_of(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
  """``jnp.sum(x, axes, keepdims=True)``.

  On the CPU, a small ``x`` (fewer than :data:`LIBRARY_REDUCTION_SIZE` elements) is
  padded with zeros to that size first, so that XLA's CPU backend compiles the reduction
  as a library kernel rather than as LLVM loop kernels: a small leaf's two reductions
  (its parameter scale and its clipping) and a factored leaf's row normaliser cost the
  compiler about a tenth as much. The zeros add nothing to the sum, and the padding fuses
  into the reduction with whatever computed ``x``. An array not known to be whole on every
  device (:func:`placement.is_replicated`) is reduced as it is: its reshape would be a
  reshard. Other compilers have no library reductions to reach: they reduce ``x`` as it
  is.

  Pinned by ``tests/test_compile.py::test_small_reductions_are_library_kernels``; its
  padded sizes by ``tests/test_compile.py::test_small_sums_are_padded_to_the_library_size_exactly``.

  >>> sum_of(jnp.arange(6.0).reshape(2, 3), (1,)).tolist()
  [[3.0], [12.0]]
  """
  if (not axes or not isinstance(x, jax.core.Tracer) or x.size == 0
      or x.size >= LIBRARY_REDUCTION_SIZE or not placement.is_replicated(x)):
    return jnp.sum(x, axes, keepdims=True) if axes else x
  shape = tuple([1 if a in axes else size for a, size in enumerate(x.shape)])
  out = jax.typeof(x).update(shape=shape, weak_type=False)
  (total,) = per_compiler.choose(MEASURED_ON_CPU, lambda x: [_padded_sum(x, axes)],
                                 lambda x: [_plain_sum(x, axes)], [x], [out])
  return total
