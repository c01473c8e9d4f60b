"""The guard survives any wrapping: every wrapper skips exactly the steps the bare one skips.

safefactor decides its skip inside its own update, so no wrapper can lose the guard
(in 0.1 it rode on an attribute of the transformation, which ``_replace`` dropped).
Each guarded transformation below runs bare and wrapped over the same gradients,
with poisoned steps; the skip counts and the params must be the same.
"""

import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_safefactor as osf
from tests.helpers import TRANSFORMATIONS, assert_trees_close, run_steps

# Finite gradients whose square overflows float32: finite micro-batches for MultiSteps
# (whose own accumulator a NaN would poison), non-finite statistics inside the step.
OVERFLOW_STEPS = (2, 5)
NAN_STEPS = (3,)
STEPS = 8

# safefactor's keyword arguments, for the configurations that inject_hyperparams rebuilds too.
SAFEFACTOR_CONFIGS = {
    "safefactor": TRANSFORMATIONS["safefactor"].reference,
    "safefactor_momentum": TRANSFORMATIONS["safefactor_momentum"].reference,
    "safefactor_no_clipping": dict(learning_rate=0.05, clipping_threshold=None),
}
# Every guarded transformation of the registry that steps on every call, and the guards that
# only these tests build: an opt-in guard, and skip_nonfinite around an unguarded safefactor.
GUARDED = {
    **{name: t.build for name, t in TRANSFORMATIONS.items() if t.guarded and t.every_k == 1},
    "safefactor_no_clipping": lambda: osf.safefactor(
        **SAFEFACTOR_CONFIGS["safefactor_no_clipping"]),
    "scale_by_safe_factored_rms_guarded": lambda: optax.chain(
        osf.scale_by_safe_factored_rms(min_dim_size_to_factor=4, skip_nonfinite_steps=True),
        optax.scale(-0.05)),
    "skip_nonfinite_around_unguarded_safefactor": lambda: osf.skip_nonfinite(
        osf.safefactor(0.05, skip_nonfinite_steps=False)),
}

WRAPPERS = {
    "replace": lambda tx: tx._replace(init=tx.init),
    "chain": lambda tx: optax.chain(optax.identity(), tx),
    "with_extra_args_support": optax.with_extra_args_support,
    "masked_all": lambda tx: optax.masked(tx, {"w": True, "b": True}),
    "multi_steps_every_1": lambda tx: optax.MultiSteps(tx, every_k_schedule=1),
}


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, 16 * 12).reshape(16, 12), "b": jnp.full((12,), 0.5)}


def _grads(step: int):
  params = _params()
  grads = jax.tree.map(lambda p: jnp.sin(p * (step + 1)), params)
  if step in OVERFLOW_STEPS:
    grads["w"] = grads["w"].at[0, 0].set(1e30)
  if step in NAN_STEPS:
    grads["b"] = grads["b"].at[1].set(jnp.nan)
  return grads


def _run(tx, steps=STEPS, grads_for=_grads):
  return run_steps(tx, _params(), grads_for, steps)[:2]


def _finite_only(step):
  # MultiSteps cannot survive a NaN micro-batch (its own accumulator keeps it), so it
  # is fed the overflowing but finite poison only.
  grads = _grads(step)
  if step in NAN_STEPS:
    grads = _grads(0)
  return grads


@functools.cache
def _bare_run(guarded, grads_for):
  """The bare run, shared by the wrappers fed the same gradients: it does not depend on them."""
  return _run(GUARDED[guarded](), grads_for=grads_for)


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("guarded", sorted(GUARDED))
def test_wrapping_skips_the_same_steps(guarded, wrapper):
  grads_for = _finite_only if wrapper.startswith("multi_steps") else _grads
  bare_params, bare_state = _bare_run(guarded, grads_for)
  with jax.numpy_dtype_promotion("standard"):  # optax's wrappers mix int and float
    params, state = _run(WRAPPERS[wrapper](GUARDED[guarded]()), grads_for=grads_for)
  expected_skips = len(OVERFLOW_STEPS) + (0 if grads_for is _finite_only else len(NAN_STEPS))
  assert int(osf.skipped_steps(bare_state)) == expected_skips
  assert int(osf.skipped_steps(state)) == expected_skips
  assert_trees_close(params, bare_params, rtol=1e-6)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


@pytest.mark.parametrize("guarded", sorted(SAFEFACTOR_CONFIGS))
def test_inject_hyperparams_skips_the_same_steps(guarded):
  # inject_hyperparams rebuilds the transformation on every update; the guard is rebuilt
  # with it.
  bare_params, bare_state = _run(osf.safefactor(**SAFEFACTOR_CONFIGS[guarded]))
  tx = optax.inject_hyperparams(osf.safefactor, static_args=("min_dim_size_to_factor",))(
      **SAFEFACTOR_CONFIGS[guarded])
  with jax.numpy_dtype_promotion("standard"):
    params, state = _run(tx)
  assert int(osf.skipped_steps(state)) == int(osf.skipped_steps(bare_state)) == 3
  assert_trees_close(params, bare_params, rtol=1e-6)


def test_masked_subset_skips_when_its_leaves_are_poisoned():
  # Only "w" is optimised: the NaN in "b" never reaches safefactor, the overflow in "w" does.
  tx = optax.masked(osf.safefactor(0.05), {"w": True, "b": False})
  with jax.numpy_dtype_promotion("standard"):
    _, state = _run(tx)
  assert int(osf.skipped_steps(state)) == len(OVERFLOW_STEPS)


def test_replace_keeps_the_guard_of_0_1s_bug():
  # 0.1's guard rode on an attribute of a NamedTuple subclass: ``_replace`` kept the
  # class but dropped the attribute, and skip_nonfinite then raised AttributeError.
  tx = osf.safefactor(0.05, skip_nonfinite_steps=False)
  rebuilt = tx._replace(init=tx.init)
  params, state = _run(osf.skip_nonfinite(rebuilt))
  assert int(osf.skipped_steps(state)) == 3
  np.testing.assert_array_equal(np.isfinite(params["w"]), True)


@pytest.mark.parametrize("inner", [
    lambda: osf.safefactor(1e-2, skip_spikes=6.0),
    lambda: optax.chain(osf.safefactor(1e-2, skip_spikes=6.0), optax.scale(1.0)),
    lambda: osf.skip_nonfinite(optax.sgd(1e-2, momentum=0.9), skip_spikes=6.0),
], ids=["safefactor", "chain", "skip_nonfinite"])
def test_a_guard_around_a_spike_guard_applies_the_steps_the_inner_guard_applies(inner):
  # The inner guard's spike history holds NaN before any spike, by design; the outer guard
  # took it for a non-finite state and skipped every step, for ever.
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)}
  grads = [{"w": jnp.cos(params["w"] * (step + 1))} for step in range(6)]
  grads[3] = {"w": jnp.full((4, 3), jnp.nan)}
  bare, bare_state, _ = run_steps(inner(), params, grads)
  wrapped, wrapped_state, _ = run_steps(osf.skip_nonfinite(inner()), params, grads)
  assert_trees_close(wrapped, bare, rtol=0)
  # The inner guard skipped the NaN step; the outer one saw a finite, skipped step.
  assert int(osf.skipped_steps(bare_state)) == 1
  assert int(osf.skipped_steps(wrapped_state)) == 1
  assert not jnp.allclose(wrapped["w"], params["w"])


def _lookahead_run(tx, grads):
  params = optax.LookaheadParams.init_synced({"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)})
  state = tx.init(params)
  step = jax.jit(tx.update)
  # optax.lookahead mixes Python floats with its bool sync flag: standard promotion.
  with jax.numpy_dtype_promotion("standard"):
    for grad in grads:
      updates, state = step(grad, state, params)
      params = optax.apply_updates(params, updates)
  return params, state


def test_a_guard_around_lookahead_skips_the_whole_step_sync_included():
  # optax.lookahead takes the fast params' grads, not grads shaped like its LookaheadParams:
  # skip_nonfinite refused it for that. Around it, a poisoned step is skipped whole: the
  # fast step and the slow params' sync (every 2nd step: step 4 syncs) are both left out.
  def lookahead():
    return optax.lookahead(optax.sgd(0.05, momentum=0.9), sync_period=2, slow_step_size=0.5)

  base = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
  finite = [{"w": jnp.cos(base * (step + 1))} for step in range(6)]
  poisoned = [*finite[:3], {"w": base.at[1, 2].set(jnp.nan)}, *finite[3:]]
  expected, _ = _lookahead_run(lookahead(), finite)
  guarded, state = _lookahead_run(osf.skip_nonfinite(lookahead()), poisoned)
  assert_trees_close(guarded, expected, rtol=0)
  assert int(osf.skipped_steps(state)) == 1
  assert osf.nonfinite_report(state)["nonfinite_steps/params.fast['w']"] == 1
  assert not jnp.allclose(expected.slow["w"], base)  # the run did sync


def test_lookahead_grads_are_refused_where_they_cannot_be_judged():
  tx = osf.skip_nonfinite(optax.lookahead(optax.sgd(0.05), 2, 0.5), skip_spikes=6.0)
  params = optax.LookaheadParams.init_synced({"w": jnp.ones((4, 3))})
  with pytest.raises(ValueError, match=r"grads do not match params: missing from grads: "
                                       r"params.fast\['w'\].*skip_spikes names a spike"):
    tx.update({"w": jnp.ones((4, 3))}, tx.init(params), params)


def _charged_leaves(tx, grads, params):
  """The params one skipped first step charged its non-finite values to."""
  _, state = tx.update(grads, tx.init(params), params)
  report = osf.nonfinite_report(state)
  assert report["skipped_steps"] == 1
  return [key.split("/", 1)[1] for key in report if key.startswith("nonfinite_steps/")]


@pytest.mark.parametrize("wrap", ["masked", "multi_transform"])
def test_a_guard_around_masked_state_names_the_nonfinite_leaf_only(wrap):
  # optax.masked keeps a MaskedNode for each param it leaves out, so its moments were not
  # "shaped like the updates" and their NaN was charged to every leaf.
  params = {"enc": jnp.ones((4, 3)), "dec": jnp.ones(3), "emb": jnp.ones(5)}
  grads = {**jax.tree.map(jnp.ones_like, params), "dec": jnp.ones(3).at[0].set(jnp.nan)}
  if wrap == "masked":
    inner = optax.masked(optax.sgd(0.1, momentum=0.9), {"enc": True, "dec": True, "emb": False})
  else:
    inner = optax.multi_transform(
        {"train": optax.sgd(0.1, momentum=0.9), "frozen": optax.set_to_zero()},
        {"enc": "train", "dec": "train", "emb": "frozen"})
  assert _charged_leaves(osf.skip_nonfinite(inner), grads, params) == ["params['dec']"]


@pytest.mark.parametrize("min_dim_size_to_factor", [1, 128])
def test_a_guard_around_safefactors_statistics_names_the_nonfinite_leaf_only(
    min_dim_size_to_factor):
  # scale_by_safe_factored_rms keeps a FactoredMoment or FullMoment per leaf, which was not
  # "shaped like the updates" (not an array in each leaf's place): one leaf's NaN was
  # charged to every leaf, in the reports and in checked=True's error.
  params = {"a": jnp.ones(3), "b": jnp.ones((2, 2)), "c": jnp.ones((4, 3))}
  grads = {**jax.tree.map(jnp.ones_like, params), "b": jnp.ones((2, 2)).at[0, 0].set(jnp.nan)}
  inner = optax.chain(
      osf.scale_by_safe_factored_rms(min_dim_size_to_factor=min_dim_size_to_factor),
      optax.scale(-0.1))
  assert _charged_leaves(osf.skip_nonfinite(inner), grads, params) == ["params['b']"]


def test_state_under_each_leaf_of_another_shape_is_charged_to_every_leaf():
  # Under the updates' structure, only arrays of a leaf's rank, each axis its size or 1,
  # are read as that leaf's state. Anything else there (a per-leaf histogram; a chain's
  # states, when the params are a plain tuple as long as the chain) says nothing of
  # which leaf went bad.
  params = {"a": jnp.ones(3), "b": jnp.ones((2, 2))}

  def init(params):
    return {"a": {"histogram": jnp.zeros(5)}, "b": {"histogram": jnp.zeros(7)}}

  def update(updates, state, params=None):
    return updates, {"a": state["a"], "b": {"histogram": state["b"]["histogram"] + jnp.nan}}

  tx = osf.skip_nonfinite(optax.GradientTransformation(init, update))
  assert _charged_leaves(tx, params, params) == ["params['a']", "params['b']"]


def test_a_guard_around_reduce_on_plateau_steps_past_its_infinite_best_value():
  # reduce_on_plateau keeps best_value at +Inf until its first accumulation completes:
  # the guard took that for a non-finite state and skipped every step, for ever.
  params = {"w": jnp.ones((4, 3))}
  inner = optax.chain(optax.sgd(1e-2), optax.contrib.reduce_on_plateau(accumulation_size=3))

  def run(tx):
    p, state = params, tx.init(params)
    with jax.numpy_dtype_promotion("standard"):  # reduce_on_plateau mixes int and float
      for _ in range(6):
        updates, state = tx.update({"w": jnp.full((4, 3), 0.5)}, state, p,
                                   value=jnp.float32(1.0))
        p = optax.apply_updates(p, updates)
    return p, state

  expected, _ = run(inner)
  guarded, state = run(osf.skip_nonfinite(inner))
  assert_trees_close(guarded, expected, rtol=0)
  assert not jnp.allclose(guarded["w"], params["w"])
  assert int(osf.skipped_steps(state)) == 0


def test_an_injected_hyperparameter_infinite_by_design_is_a_setting_not_a_skip():
  # max_norm=inf means no clipping: the guard skipped every step for ever. A NaN, or an
  # infinity the step made (a schedule's), is still skipped and named.
  params, grads = {"w": jnp.ones((4, 3))}, {"w": jnp.full((4, 3), 0.1)}
  inner = optax.chain(optax.inject_hyperparams(optax.clip_by_global_norm)(
      max_norm=float("inf")), optax.sgd(0.1))
  tx = osf.skip_nonfinite(inner)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  expected, _ = inner.update(grads, inner.init(params), params)
  assert_trees_close(updates, expected, rtol=0)
  assert int(osf.skipped_steps(state)) == 0
  schedule = lambda count: jnp.where(count >= 1, jnp.inf, 0.1)  # noqa: E731
  tx = osf.skip_nonfinite(optax.inject_hyperparams(optax.sgd)(learning_rate=schedule))
  state = tx.init(params)
  for _ in range(3):
    _, state = jax.jit(tx.update)(grads, state, params)
  assert int(osf.skipped_steps(state)) == 2
  assert "hyperparameter learning_rate x2" in osf.nonfinite_summary(state)


class _Scalar(typing.NamedTuple):
  total: jax.Array


def _summing(start):
  """A transformation whose state is one float32 scalar: the running sum of |g|**2."""
  def init(params):
    del params
    return _Scalar(jnp.asarray(start, jnp.float32))

  def update(updates, state, params=None):
    del params
    total = state.total + sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(updates))
    return updates, _Scalar(total)

  return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("start,grad,skipped", [
    (jnp.inf, 1.0, 0),     # +Inf kept as it was: a sentinel
    (0.0, 1e30, 1),        # made infinite by this step (1e60 overflows float32)
    (jnp.nan, 1.0, 1),     # NaN is never kept
])
def test_a_scalar_state_is_judged_by_what_the_step_did_to_it(start, grad, skipped):
  tx = osf.skip_nonfinite(_summing(start))
  params = {"w": jnp.ones(3)}
  _, state = tx.update({"w": jnp.full(3, grad)}, tx.init(params), params)
  assert int(osf.skipped_steps(state)) == skipped
