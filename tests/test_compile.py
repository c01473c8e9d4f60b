"""Compiled-program structure: linear in the number of leaves, no full-size temporaries."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from optax_safefactor._src import trees, unit_order, xla_hints
from tests.helpers import distinct_loop_kernels


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


def _reductions(tx, params) -> int:
  hlo = jax.jit(tx.update).lower(params, tx.init(params), params).as_text(dialect="hlo")
  return hlo.count(" reduce(")


def test_momentum_adds_no_reduction():
  # The old momentum is checked for finiteness on the clipping reduction, which reads the
  # scaled gradient anyway: a reduction of its own per leaf cost a kernel per leaf shape
  # and a tenth of the compile time of GPT-2 small with momentum.
  params = {"w": jnp.ones((8, 6)), "b": jnp.ones((6,)), "v": jnp.ones((5,))}
  without = _reductions(osf.safefactor(1e-3), params)
  assert _reductions(osf.safefactor(1e-3, momentum=0.9), params) == without


def _train_step(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def _temp_bytes(tx, params) -> int:
  compiled = (jax.jit(_train_step(tx), donate_argnums=(0, 1))
              .lower(params, tx.init(params), params).compile())
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.xla_memory_layout
@pytest.mark.parametrize("guard", [True, False])
@pytest.mark.parametrize("momentum", [None, 0.9])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_no_leaf_keeps_a_full_size_temporary(guard, momentum, dtype):
  # The clipping pass reads a scaled gradient; if the final update reused it, XLA kept
  # every leaf's scaled gradient alive at once: a whole tree of temporaries, allocated
  # and faulted in on each step (optax.adafactor does exactly that).
  # (bfloat16: the float32 upcasts of the gradient and the param must not be shared.)
  params = {f"w{i}": jnp.ones((256, 512), dtype) for i in range(12)}
  param_bytes = sum(p.nbytes for p in params.values())
  float32_leaf = 4 * 256 * 512  # what one leaf's float32 temporary takes
  ours = _temp_bytes(osf.safefactor(1e-3, momentum=momentum, skip_nonfinite_steps=guard), params)
  with jax.numpy_dtype_promotion("standard"):  # optax mixes float32 and bfloat16
    theirs = _temp_bytes(optax.adafactor(1e-3, momentum=momentum), params)
  assert theirs > 0.5 * param_bytes  # the layout this guards against
  # No full-size temporary at all: only row- and column-sized statistics and factors.
  # Measured: 0.15 float32 leaves without the guard, 0.22 with it, for every dtype and
  # momentum. A full-size temporary adds 0.5 (a bfloat16 copy) or 1.0 (a float32 one),
  # shared by the leaves of one shape or not: a constant cap broadcast to the leaves'
  # shape was such a one (1.19 with it), written out for the clipping reductions.
  assert ours < 0.45 * float32_leaf, (ours / float32_leaf, ours)


@pytest.mark.xla_memory_layout
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unclipped_momentum_is_checked_without_a_full_size_temporary(dtype):
  # Without clipping the old momentum's finiteness has a check of its own: a sum, which
  # fuses into its read, where all(isfinite) wrote a boolean temporary per leaf that XLA
  # kept for the whole tree. Measured: 0.18 float32 leaves, 3.07 with all(isfinite).
  params = {f"w{i}": jnp.ones((256, 512), dtype) for i in range(12)}
  ours = _temp_bytes(osf.safefactor(1e-3, momentum=0.9, clipping_threshold=None), params)
  assert ours < 0.5 * 4 * 256 * 512, ours


@pytest.mark.xla_memory_layout
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_bfloat16_momentum_on_the_clipping_pass_keeps_no_float32_copy(dtype):
  # With clipping, the old momentum's finiteness rides on the clipping reduction. Its
  # float32 upcast, shared with the update's blend, was written out in full for that
  # reduction and kept for the whole tree (18.1 float32 leaves here); read on its own it
  # fuses into the reduction (6.1). What stays is one bfloat16 copy of each old momentum:
  # the new momentum is written over it while the update still reads it.
  params = {f"w{i}": jnp.ones((256, 512), dtype) for i in range(12)}
  momentum_bytes = 2 * 256 * 512 * len(params)
  ours = _temp_bytes(osf.safefactor(1e-3, momentum=0.9, dtype_momentum="bfloat16"), params)
  assert ours < momentum_bytes + 0.45 * 4 * 256 * 512, (ours / momentum_bytes, ours)


def _barriers(params, **settings) -> int:
  tx = osf.safefactor(1e-3, **settings)
  hlo = jax.jit(tx.update).lower(params, tx.init(params), params).as_text(dialect="hlo")
  return hlo.count(" opt-barrier(")


@pytest.mark.parametrize("momentum", [None, 0.9])
def test_barriers_only_where_values_are_upcast(momentum):
  # The fresh reads keep XLA from sharing a narrow value's float32 upcast between passes
  # (test_no_leaf_keeps_a_full_size_temporary). A float32 value has none to share: there a
  # barrier only adds HLO instructions per leaf that every compiler pass walks.
  shapes = {"w": (256, 128), "b": (128,)}
  wide = {name: jnp.ones(shape, jnp.float32) for name, shape in shapes.items()}
  narrow = {name: jnp.ones(shape, jnp.bfloat16) for name, shape in shapes.items()}
  # Float32: the factored leaf's two statistics reads, and each leaf's factors.
  assert _barriers(wide, momentum=momentum) == 3
  # Bfloat16: besides, each leaf's gradient read for clipping and param read for its scale.
  assert _barriers(narrow, momentum=momentum) == 7


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_bfloat16_roundings_are_integer_operations_on_the_cpu(mode):
  # xla_hints.bit_pattern_rounding: the write-back's roundings onto bfloat16 are integer
  # operations on the float32 pattern in a program for the CPU, where they vectorise; XLA's
  # reduce_precision is the accelerators' form (tests/test_accelerators.py).
  params = {"w": jnp.ones((256, 128), jnp.bfloat16)}
  tx = osf.safefactor(1e-3, param_rounding=mode)
  lowered = jax.jit(tx.update).lower(params, tx.init(params), params).as_text()
  assert "stablehlo.reduce_precision" not in lowered
  assert "stablehlo.bitcast_convert" in lowered


def _step_text(tx, params) -> str:
  return jax.jit(_train_step(tx)).lower(params, tx.init(params), params).compile().as_text()


@pytest.mark.xla_cpu_kernels
@pytest.mark.parametrize("pack", [True, False])
def test_small_reductions_are_library_kernels(pack):
  # XLA's CPU backend compiles a reduction of fewer than 4,096 elements as a chain of LLVM
  # loop kernels (reduce-window, then reduce), at about 10 ms each; a larger one is a
  # library kernel, nearly free. Padded with zeros, a small leaf's parameter scale and
  # clipping sums and a factored leaf's row normaliser (here 256 rows) are library kernels.
  params = {"w": jnp.full((256, 192), 0.02), "b": jnp.full((300,), 0.02),
            "s": jnp.full((16, 16), 0.02), "c": jnp.full((300,), 0.03)}
  text = _step_text(osf.safefactor(1e-3, momentum=0.9, pack_small_leaves=pack), params)
  assert "reduce-window(" not in text


@pytest.mark.parametrize("shape, axes, padded", [
    ((300,), (0,), "4096xf32"),              # the whole array: padded to the size itself
    ((256, 12), (1,), "256x16xf32"),         # 256 rows: each padded to 4096 / 256 columns
    ((12, 256), (0,), "256x16xf32"),         # the kept axis first, then the same padding
    ((3, 7, 5), (0, 2), "7x586xf32"),        # 7 rows of 15: ceil(4096 / 7) columns
])
def test_small_sums_are_padded_to_the_library_size_exactly(shape, axes, padded):
  # Padded past LIBRARY_REDUCTION_SIZE the sum is still a library kernel, only longer; short
  # of it, it is LLVM loop kernels again. So the CPU's padded reduction is pinned exactly:
  # rows times the fewest columns that reach the size. The value is the plain sum.
  x = jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)
  summed = jax.jit(lambda x: xla_hints.sum_of(x, axes))
  text = summed.lower(x).as_text()
  assert "stablehlo.pad" in text and f"-> tensor<{padded}>" in text, text
  np.testing.assert_allclose(summed(x), np.sum(np.asarray(x, np.float64), axes, keepdims=True),
                             rtol=1e-5, atol=1e-5)
  # At the size itself there is nothing to pad.
  whole = jnp.ones((xla_hints.LIBRARY_REDUCTION_SIZE,), jnp.float32)
  assert "stablehlo.pad" not in jax.jit(lambda x: xla_hints.sum_of(x, (0,))).lower(whole).as_text()


@pytest.mark.parametrize("pred, on_true, on_false", [
    (True, np.ones(3), np.zeros(3)),            # a scalar predicate, values of one shape
    ([True, False, True], np.ones(3), 0.0),     # a predicate of their shape, a scalar filled
    (False, np.ones((2, 3)), 0.0),              # a scalar predicate, a scalar filled
])
def test_the_skips_select_is_one_select_op(pred, on_true, on_false):
  # jnp.where wraps itself in a jit of its own, a call that XLA must inline again: hundreds
  # of them in a step of hundreds of leaves. trees.select lowers to the select op alone.
  pred, on_true = jnp.asarray(pred), jnp.asarray(on_true, jnp.float32)
  selected = jax.jit(lambda p, a: trees.select(p, a, on_false))
  text = selected.lower(pred, on_true).as_text()
  assert "stablehlo.select" in text and "call @" not in text, text
  np.testing.assert_array_equal(selected(pred, on_true), np.where(pred, on_true, on_false))


@pytest.mark.parametrize("pred, on_true, on_false", [
    (True, 0.0, np.ones(3)),                    # a scalar on_true against an array: broadcast
    ([[True], [False]], np.ones((2, 3)), 0.0),  # a predicate of another shape: broadcast
])
def test_a_select_of_other_shapes_broadcasts_as_where_does(pred, on_true, on_false):
  got = trees.select(jnp.asarray(pred), on_true, on_false)
  np.testing.assert_array_equal(got, np.where(pred, on_true, on_false))
  assert got.dtype == jnp.asarray(on_true).dtype


@pytest.mark.xla_cpu_kernels
@pytest.mark.parametrize("momentum", [None, 0.9])
def test_leaves_of_other_sizes_share_kernels(momentum):
  # A kernel is compiled per distinct fused computation, and a size's 1/n in one makes it
  # the size's own. The step's finite flags read sums (no size), one scalar kernel makes a
  # leaf's whole multiplier, and the row normaliser's root is fused with its reduction.
  # Measured: 7.3 more loop kernels per factored leaf size (8.3 with momentum); 8.3 and 9.3
  # with a flag kernel per size, and the clipping apart from the rest of the multiplier.
  def kernels(shapes):
    params = {f"w{i}": jnp.full(shape, 0.02) for i, shape in enumerate(shapes)}
    return distinct_loop_kernels(_step_text(osf.safefactor(1e-3, momentum=momentum), params))

  one = kernels([(128, 256)])
  four = kernels([(128, 256), (128, 320), (128, 384), (128, 448)])
  assert (four - one) / 3 < (7.8 if momentum is None else 8.8), (one, four)


_LINK = jax.jit(unit_order._after_largest)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(pattern=st.integers(0, 2**32 - 1),
                  state_dtype=st.sampled_from(["float32", "bfloat16"]))
def test_the_link_between_units_changes_no_value(pattern, state_dtype):
  # unit_order.read_after_update's TPU form, run here: the zero it makes from the previous
  # update's largest magnitude is zero for every float32 bit pattern (NaN and Inf
  # included), so the gradient and the statistics come out bit for bit as they went in.
  update = jax.lax.bitcast_convert_type(jnp.array([pattern], jnp.uint32), jnp.float32)
  grad = jnp.array([0.5, -0.0, jnp.inf, jnp.nan], jnp.bfloat16)
  statistics = [jnp.array([1e-30, 3.0, jnp.inf, jnp.nan], state_dtype),
                jnp.array([[0.0, 7.0]], state_dtype)]
  out = _LINK(grad, update, *statistics)
  for before, after in zip([grad, update, *statistics], out, strict=True):
    assert after.dtype == before.dtype
    np.testing.assert_array_equal(
        jax.lax.bitcast_convert_type(after, jnp.uint16 if after.dtype.itemsize == 2
                                     else jnp.uint32),
        jax.lax.bitcast_convert_type(before, jnp.uint16 if before.dtype.itemsize == 2
                                     else jnp.uint32))
