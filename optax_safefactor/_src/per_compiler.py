"""One computation in two forms, the form chosen per platform when the program is lowered.

The compiler hints (:mod:`optax_safefactor._src.xla_hints`,
:mod:`optax_safefactor._src.unit_order`) each pair a hinted computation
with the plain one it stands for. :func:`choose` binds both as one primitive whose
lowering rule picks the hinted form on the platforms named and the plain form everywhere
else, so that a step traced on a CPU host and compiled for a TPU (ahead of time, or by
``python -m optax_safefactor bench --target tpu-v5e``) gets the TPU's program. Eager, under
``jax.vmap`` and under differentiation, the plain form is what runs.

Two forms that differ, to show which runs (a hint's two forms compute the same values):

>>> hinted, plain, one = (lambda x: [x + 1]), (lambda x: [x + 2]), jnp.ones(())
>>> float(choose(("cpu",), hinted, plain, [one], [jax.typeof(one)])[0])  # eager: plain
3.0
>>> def step(platforms):
...   return jax.jit(lambda x: choose(platforms, hinted, plain, [x], [jax.typeof(x)])[0])
>>> float(step(("cpu",))(one)), float(step(("tpu",))(one))  # lowered for this CPU
(2.0, 3.0)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp  # noqa: F401  (the doctest's)
from jax.extend.core import Primitive
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import ad, batching, mlir

# The platforms a lowering rule is registered for; any other lowers the plain computation.
_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

_per_compiler_p = Primitive("safefactor_hint")
_per_compiler_p.multiple_results = True


def choose(platforms: Sequence[str], hinted: Callable[..., Sequence[jax.Array]],
           plain: Callable[..., Sequence[jax.Array]], args: Sequence[jax.Array],
           out_avals: Sequence[Any]) -> list[jax.Array]:
  """``hinted(*args)`` in a program lowered for one of ``platforms``, else ``plain(*args)``.

  Both return a list of arrays of ``out_avals`` (shapes, dtypes and shardings), and
  compute the same values. Traced once, as one primitive.
  """
  return _per_compiler_p.bind(*args, platforms=tuple(platforms), hinted=hinted, plain=plain,
                              out_avals=tuple(out_avals))


def barrier(*values: jax.Array) -> list[jax.Array]:
  """``values`` through one optimization barrier."""
  return list(jax.lax.optimization_barrier(values))


def unchanged(*values: jax.Array) -> list[jax.Array]:
  """``values`` as they are."""
  return list(values)


def barrier_on(platforms: Sequence[str], values: Sequence[jax.Array]) -> list[jax.Array]:
  """``values`` through one optimization barrier in a program lowered for one of
  ``platforms``, as they are elsewhere."""
  return choose(platforms, barrier, unchanged, values, [jax.typeof(v) for v in values])


def _lowering_for(platform: str) -> Callable[..., Any]:
  def lower(ctx, *args, platforms, hinted, plain, out_avals):
    del out_avals
    chosen = hinted if platform in platforms else plain
    # The barriers are one op each, written directly: tracing them as functions at every
    # lowering cost the CPU's trace+lower time on trees of hundreds of leaves.
    if chosen is unchanged:
      return list(args)
    if chosen is barrier:
      return list(stablehlo.OptimizationBarrierOp(args).results)
    return mlir.lower_fun(lambda *xs: list(chosen(*xs)), multiple_results=True)(ctx, *args)
  return lower


def _batched(args, dims, *, plain, **_):
  outs = jax.vmap(lambda *xs: list(plain(*xs)), in_axes=list(dims))(*args)
  return outs, [0] * len(outs)


def _jvp(primals, tangents, *, plain, **_):
  tangents = [ad.instantiate_zeros(t) for t in tangents]
  outs, out_tangents = jax.jvp(lambda *xs: list(plain(*xs)), list(primals), tangents)
  return outs, out_tangents


_per_compiler_p.def_impl(lambda *args, plain, **_: list(plain(*args)))
_per_compiler_p.def_abstract_eval(lambda *_, out_avals, **__: list(out_avals))
batching.primitive_batchers[_per_compiler_p] = _batched
ad.primitive_jvps[_per_compiler_p] = _jvp
mlir.register_lowering(_per_compiler_p, _lowering_for("other"))
for _platform in _PLATFORMS:
  mlir.register_lowering(_per_compiler_p, _lowering_for(_platform), platform=_platform)
