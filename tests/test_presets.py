"""``osf.presets``: each preset, step by step, against the implementation it stands in for.

transformers' and torch's Adafactor run for real on torch tensors (skipped where they do
not install); big_vision and T5X, which do not install as packages, are checked against
the float64 restatements of their sources in ``tests/preset_references.py``. Every run is
30 steps on the same leaves: tall, wide, a vector, a stacked 3-D leaf, a leaf whose first
rows get zero gradients and an all-zero gradient, in float32 and float64.
"""

import inspect
import math
import re
import warnings

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import assume, given, settings

import optax_safefactor as osf
from optax_safefactor._src import preset_assembly
from tests.preset_references import BigVisionAdafactor, T5XAdafactor

STEPS = 30
SHAPES = {"tall": (64, 40), "wide": (40, 64), "vector": (48,), "stacked": (3, 40, 48),
          "zero_rows": (48, 36), "zeros": (36, 33)}

# The largest difference each comparison allows, relative to the largest update of the
# leaf at that step (the docstrings quote the measured values, a little below these).
BOUND = {np.float32: 2e-6, np.float64: 1e-14}


def _problem(dtype, steps=STEPS, shapes=SHAPES, seed=0, grad_scale=1.0):
  rng = np.random.default_rng(seed)
  params = {name: (rng.standard_normal(shape) * (0.5 + i / 4)).astype(dtype)
            for i, (name, shape) in enumerate(shapes.items())}
  grads = []
  for step in range(steps):
    scale = grad_scale * (1 + 4 * (step % 3))
    g = {name: (rng.standard_normal(shape) * scale).astype(dtype)
         for name, shape in shapes.items()}
    if "zero_rows" in g:
      g["zero_rows"][:5] = 0
    if "zeros" in g:
      g["zeros"][...] = 0
    grads.append(g)
  return params, grads


def _steps(before, after):
  """One step's ``(param before, param after)`` per leaf."""
  return {name: (np.asarray(before[name]), np.asarray(after[name])) for name in before}


def _run_preset(tx, params, grads):
  """Each step's params before and after, on the preset's own trajectory."""
  p = {name: jnp.asarray(value) for name, value in params.items()}
  state = tx.init(p)
  update = jax.jit(tx.update)
  out = []
  for g in grads:
    u, state = update({name: jnp.asarray(value) for name, value in g.items()}, state, p)
    new = optax.apply_updates(p, u)
    out.append(_steps(p, new))
    p = new
  return out, state


def _run_reference(reference, params, grads):
  """The same for a restatement: its float64 update written into the params' dtype."""
  reference.init(params)
  p = dict(params)
  out = []
  for g in grads:
    u = reference.step(g, p)
    new = {name: (np.asarray(p[name], np.float64) + u[name]).astype(p[name].dtype)
           for name in p}
    out.append(_steps(p, new))
    p = new
  return out


def _run_torch(make_optimizer, params, grads, torch):
  tensors = {name: torch.tensor(value.copy()) for name, value in params.items()}
  optimizer = make_optimizer(list(tensors.values()))
  out = []
  for g in grads:
    before = {name: t.numpy().copy() for name, t in tensors.items()}
    for name, t in tensors.items():
      t.grad = torch.tensor(g[name].copy())
    optimizer.step()
    out.append(_steps(before, {name: t.numpy().copy() for name, t in tensors.items()}))
  return out


def _largest_difference(ours, theirs):
  """The largest difference of two runs' updates, relative to the largest update of the
  leaf at that step, beyond one ulp of the param.

  Both sides write ``param + update`` in the params' dtype, each rounding to within half
  an ulp of its own exact sum, so their written updates may differ by an ulp of the
  param even when the updates agree exactly; what is left over is the updates' own
  difference.
  """
  worst = 0.0
  for step_ours, step_theirs in zip(ours, theirs, strict=True):
    for name, (before, after) in step_theirs.items():
      our_before, our_after = step_ours[name]
      assert np.all(np.isfinite(our_after)), name
      expected = after.astype(np.float64) - before.astype(np.float64)
      got = our_after.astype(np.float64) - our_before.astype(np.float64)
      ulp = np.spacing(np.maximum(np.abs(before), np.abs(after))).astype(np.float64)
      scale = np.max(np.abs(expected))
      if scale == 0:
        assert np.max(np.abs(got)) == 0, name
        continue
      excess = np.maximum(np.abs(got - expected) - ulp, 0)
      worst = max(worst, float(np.max(excess) / scale))
  return worst


@pytest.fixture(params=[np.float32, np.float64], ids=["float32", "float64"])
def dtype(request):
  if request.param == np.float64:
    request.getfixturevalue("x64")
  return request.param


# transformers ----------------------------------------------------------------------------

HF_CONFIGS = {
    "defaults": {},
    "lr_no_scale": dict(lr=1e-3, relative_step=False, scale_parameter=False),
    "warmup_momentum_decay": dict(warmup_init=True, beta1=0.9, weight_decay=0.01),
    "lr_scale_decay_clip": dict(lr=1e-2, relative_step=False, weight_decay=0.1,
                                clip_threshold=2.0, decay_rate=-0.6, eps=(1e-20, 1e-2)),
    "lr_decay_no_scale": dict(lr=3e-3, relative_step=False, scale_parameter=False,
                              weight_decay=0.05, beta1=0.5),
}


@pytest.mark.parametrize("config", sorted(HF_CONFIGS))
def test_transformers_matches_hf_adafactor(config, dtype):
  torch = pytest.importorskip("torch")
  hf = pytest.importorskip("transformers.optimization")
  kwargs = HF_CONFIGS[config]
  params, grads = _problem(dtype)
  # The preset's own momentum dtype: float64 for float64 params, as HF keeps exp_avg.
  ours, _ = _run_preset(osf.presets.transformers(**kwargs), params, grads)
  theirs = _run_torch(lambda ps: hf.Adafactor(ps, **kwargs), params, grads, torch)
  assert _largest_difference(ours, theirs) <= BOUND[dtype]


@pytest.mark.parametrize("warmup_init", [False, True])
def test_transformers_relative_step_past_ten_thousand_steps(warmup_init):
  """HF's relative step is 1/sqrt(t) once t passes 1e4 (with or without warm-up): both
  optimizers jump from step 1 to step 40001, then take the same steps."""
  torch = pytest.importorskip("torch")
  hf = pytest.importorskip("transformers.optimization")
  params, grads = _problem(np.float32, steps=6, shapes={"tall": (64, 40), "vector": (48,)})
  tx = osf.presets.transformers(warmup_init=warmup_init, beta1=0.5)
  p = {name: jnp.asarray(value) for name, value in params.items()}
  state = tx.init(p)
  tensors = {name: torch.tensor(value.copy()) for name, value in params.items()}
  optimizer = hf.Adafactor(list(tensors.values()), warmup_init=warmup_init, beta1=0.5)
  ours, theirs = [], []
  for step, g in enumerate(grads):
    if step == 1:
      inner = state.inner_state
      state = state._replace(inner_state=inner._replace(count=jnp.asarray(40000, jnp.int32)))
      for t in tensors.values():
        optimizer.state[t]["step"] = 40000
    u, state = tx.update({name: jnp.asarray(value) for name, value in g.items()}, state, p)
    new = optax.apply_updates(p, u)
    ours.append(_steps(p, new))
    p = new
    before = {name: t.numpy().copy() for name, t in tensors.items()}
    for name, t in tensors.items():
      t.grad = torch.tensor(g[name].copy())
    optimizer.step()
    theirs.append(_steps(before, {name: t.numpy().copy() for name, t in tensors.items()}))
  # safefactor's float32 mixing weight 1 - beta2, taken from beta2 rounded to float32, is
  # off by up to 6e-8 / (1 - beta2) relative at this step (2.5e-5 here; HF's is a double):
  # the preset's docstring states it.
  assert _largest_difference(ours, theirs) <= 1e-4
  # 1/sqrt(40002) = 5.0e-3 is the step now, half of the 1e-2 of the first 1e4 steps
  before, after = ours[-1]["vector"]
  rms_update = np.sqrt(np.mean((after.astype(np.float64) - before) ** 2))
  assert rms_update < 5.1e-3 * np.sqrt(np.mean(before.astype(np.float64) ** 2))


def test_transformers_without_eps_keeps_zero_rows_finite():
  """By design: with eps[0] = 0 HF divides 0 by 0 on an all-zero row; the preset floors."""
  torch = pytest.importorskip("torch")
  hf = pytest.importorskip("transformers.optimization")
  params, grads = _problem(np.float32, steps=3, shapes={"zero_rows": (12, 10)})
  kwargs = dict(eps=(0.0, 1e-3))
  ours, _ = _run_preset(osf.presets.transformers(**kwargs), params, grads)
  theirs = _run_torch(lambda ps: hf.Adafactor(ps, **kwargs), params, grads, torch)
  assert np.isnan(theirs[0]["zero_rows"][1]).any()
  before, after = ours[-1]["zero_rows"]
  assert np.isfinite(after).all() and np.array_equal(after[:5], before[:5])


# torch ------------------------------------------------------------------------------------

TORCH_CONFIGS = {
    "defaults": {},
    "lr_decay_clip": dict(lr=0.5, weight_decay=0.1, d=2.0, beta2_decay=-0.6),
    "maximize_eps": dict(maximize=True, eps=(1e-10, 1e-2), foreach=True),
}


@pytest.mark.parametrize("config", sorted(TORCH_CONFIGS))
def test_torch_matches_torch_adafactor(config, dtype):
  torch = pytest.importorskip("torch")
  kwargs = dict(TORCH_CONFIGS[config])
  if kwargs.get("eps", (None,))[0] is None and dtype == np.float64:
    # torch.optim.Adafactor's eps1=None is the param dtype's machine epsilon; the preset's
    # is float32's unless given (its docstring).
    kwargs["eps"] = (float(np.finfo(np.float64).eps), 1e-3)
  params, grads = _problem(dtype)
  ours, _ = _run_preset(osf.presets.torch(**kwargs), params, grads)
  theirs = _run_torch(lambda ps: torch.optim.Adafactor(ps, **kwargs), params, grads, torch)
  assert _largest_difference(ours, theirs) <= BOUND[dtype]


def test_torch_small_gradients_differ_within_the_stated_bound():
  """Below torch's row-mean floor (mean g**2 < eps1) torch's update is between 1 and
  s = sqrt(eps1 / mean) times the preset's, same direction (the docstring's bound)."""
  torch = pytest.importorskip("torch")
  shapes = {"w": (40, 64)}
  params, grads = _problem(np.float32, steps=10, shapes=shapes, grad_scale=1e-5)
  ours, _ = _run_preset(osf.presets.torch(d=1e6), params, grads)
  tensor = torch.tensor(params["w"].copy())
  optimizer = torch.optim.Adafactor([tensor], d=1e6)
  eps1 = float(np.finfo(np.float32).eps)
  shown_apart = False
  for step, g in enumerate(grads):
    # From the preset's params: the updates differ by a factor, and so would the params.
    before_ours, after_ours = ours[step]["w"]
    our_update = after_ours.astype(np.float64) - before_ours.astype(np.float64)
    with torch.no_grad():
      tensor.copy_(torch.tensor(before_ours))
    tensor.grad = torch.tensor(g["w"])
    optimizer.step()
    theirs = tensor.numpy().astype(np.float64) - before_ours.astype(np.float64)
    row_mean = float(optimizer.state[tensor]["row_var"].mean())
    s = math.sqrt(max(row_mean, eps1) / row_mean)
    ratio = np.sum(theirs * our_update) / np.sum(our_update**2)
    assert 1 - 1e-4 <= ratio <= s * (1 + 1e-4)
    shown_apart |= ratio > 2
  assert shown_apart  # the floor is reached here: without it the ratio would be 1


# big_vision --------------------------------------------------------------------------------

BIG_VISION_CONFIGS = {
    "defaults": ({}, {}),
    "wd_schedule_clip": (
        dict(wd=1e-3, clipping_threshold=1.0, beta2_cap=0.95, decay_rate=0.7,
             dtype_momentum="float32"),
        dict(wd_mask={"tall": True, "stacked": True})),
    "no_momentum_eps": (dict(momentum=None, eps=1e-20), {}),
}


def _warmup_cosine(count):
  t = jnp.asarray(count, float)
  return jnp.minimum((t + 1) / 10, 0.5 * (1 + jnp.cos(jnp.pi * t / 60)))


@pytest.mark.parametrize("config", sorted(BIG_VISION_CONFIGS))
def test_big_vision_matches_its_restatement(config, dtype):
  kwargs, extra = BIG_VISION_CONFIGS[config]
  params, grads = _problem(dtype)
  schedule = _warmup_cosine if config == "wd_schedule_clip" else None
  mask = extra.get("wd_mask", {})
  # A mask only where something decays (without, the preset warns that it has no effect).
  masked = ({"weight_decay_mask": {name: mask.get(name, False) for name in params}}
            if kwargs.get("wd") else {})
  tx = osf.presets.big_vision(1e-2, schedule=schedule, **kwargs, **masked)
  ours, _ = _run_preset(tx, params, grads)
  reference = BigVisionAdafactor(
      1e-2, schedule=None if schedule is None else (lambda c: float(_warmup_cosine(c))),
      wd_mask=mask, momentum_dtype=kwargs.get("dtype_momentum", ml_dtypes.bfloat16),
      compute_dtype=dtype, **{k: v for k, v in kwargs.items() if k != "dtype_momentum"})
  bound = BOUND[dtype]
  if dtype == np.float32 and momentum_in_bfloat16(kwargs):
    # A float32 blend within float32 rounding of a bfloat16 tie may be stored one bfloat16
    # ulp (2**-8 relative) away from the float64 blend's: both are right.
    bound = 2.0**-8
  assert _largest_difference(ours, _run_reference(reference, params, grads)) <= bound


def momentum_in_bfloat16(kwargs):
  return kwargs.get("momentum", 0.9) and kwargs.get("dtype_momentum", "bfloat16") == "bfloat16"


def test_big_vision_decays_kernels_only_by_default():
  params = {"dense": {"kernel": jnp.ones((8, 4)), "bias": jnp.ones(4)}}
  grads = jax.tree.map(jnp.zeros_like, params)
  tx = osf.presets.big_vision(1.0, wd=0.5, momentum=None)
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["dense"]["kernel"], -0.5)
  np.testing.assert_allclose(updates["dense"]["bias"], 0.0)
  # big_vision's config.wd is 0 unless set: no kernel decays then.
  tx = osf.presets.big_vision(1.0, momentum=None)
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates["dense"]["kernel"], 0.0)


def test_big_vision_skips_a_nonfinite_step_as_a_whole():
  params = {"dense": {"kernel": jnp.ones((64, 32))}}
  tx = osf.presets.big_vision(
      1e-2, wd=1e-2, schedule=lambda c: 1.0 / (jnp.asarray(c, jnp.float32) + 1))
  state = tx.init(params)
  good = {"dense": {"kernel": jnp.ones((64, 32))}}
  bad = {"dense": {"kernel": jnp.full((64, 32), jnp.nan)}}
  _, state = tx.update(good, state, params)
  updates, skipped = tx.update(bad, state, params)
  assert float(jnp.abs(updates["dense"]["kernel"]).max()) == 0  # no decay either
  assert int(osf.skipped_steps(skipped)) == 1
  # The schedule's count did not move: the next step equals the one without the NaN.
  expected, _ = tx.update(good, state, params)
  after, _ = tx.update(good, skipped, params)
  np.testing.assert_array_equal(after["dense"]["kernel"], expected["dense"]["kernel"])


# t5x ---------------------------------------------------------------------------------------

T5X_FACTOR_MAP = [("stacked", ("batch", "row", "column")), ("vector", ("none",)),
                  ("zeros", None), (".*", ("row", "column"))]
T5X_PLANS = {"stacked": ((1,), (2,), (0,)), "zeros": None}
T5X_CONFIGS = {
    "defaults": {},
    "momentum_decay": dict(beta1=0.9, weight_decay_rate=1e-3, clipping_threshold=2.0,
                           max_parameter_scale=0.8, decay_rate=0.6),
    "no_scale_no_clip": dict(multiply_by_parameter_scale=False, clipping_threshold=None,
                             global_norm_clip_threshold=50.0, epsilon1=1e-20),
    "unfactored": dict(factored=False, beta1=0.5, epsilon2=1e-1),
}


@pytest.mark.parametrize("config", sorted(T5X_CONFIGS))
def test_t5x_matches_its_restatement(config, dtype):
  kwargs = T5X_CONFIGS[config]
  params, grads = _problem(dtype)
  factor_map = T5X_FACTOR_MAP if kwargs.get("factored", True) else None
  with warnings.catch_warnings():  # a size threshold without factoring: T5X ignores it too
    warnings.filterwarnings("ignore", ".* has no effect", UserWarning)
    tx = osf.presets.t5x(1e-2, min_dim_size_to_factor=32, factor_map=factor_map, **kwargs)
  ours, _ = _run_preset(tx, params, grads)
  reference = T5XAdafactor(1e-2, plans=T5X_PLANS, min_dim_size_to_factor=32,
                           compute_dtype=dtype, **kwargs)
  assert _largest_difference(ours, _run_reference(reference, params, grads)) <= BOUND[dtype]


@pytest.mark.parametrize("rule, plan", [
    (("batch", "row", "none"), ((1,), (), (0,))), (("none", "none", "column"), ((), (2,), ())),
], ids=["rows", "columns"])
def test_t5x_factors_rows_without_columns_as_t5x_does(rule, plan, dtype):
  # T5X takes such a rule (its logical rules turn it into NONE, its factor_map does not):
  # a full-size statistic and its own mean, the unfactored estimate. safefactor's own
  # factor_rules refuse it, and the preset did, naming safefactor's rule.
  params, grads = _problem(dtype)
  factor_map = [("stacked", rule), *T5X_FACTOR_MAP]
  tx = osf.presets.t5x(1e-2, beta1=0.9, min_dim_size_to_factor=32, factor_map=factor_map)
  ours, _ = _run_preset(tx, params, grads)
  reference = T5XAdafactor(1e-2, beta1=0.9, plans={**T5X_PLANS, "stacked": plan},
                           min_dim_size_to_factor=32, compute_dtype=dtype)
  assert _largest_difference(ours, _run_reference(reference, params, grads)) <= BOUND[dtype]


def _t5x_plans(tx, params):
  state = tx.init(params)
  moments = state.inner_state.second_moment
  return {name: tuple(jax.tree.map(jnp.shape, tuple(moments[name]))) for name in params}


def test_t5x_logical_rules_follow_set_param_axes():
  params = {"attn": jnp.ones((2, 256, 4, 64)), "norm": jnp.ones((2, 256)),
            "out": jnp.ones((256, 512)), "pos": jnp.ones((2, 32, 8))}
  axes = {"attn": ("layers", "embed", "heads", "kv"), "norm": ("layers", "embed"),
          "out": ("mlp", "embed"), "pos": ("layers", "relpos_buckets", "heads")}
  tx = osf.presets.t5x(1e-2, logical_factor_rules="standard", param_logical_axes=axes)
  plans = _t5x_plans(tx, params)
  # rows: embed; columns: heads and kv; one set of statistics per layer
  assert plans["attn"] == ((2, 256, 1, 1), (2, 1, 4, 64))
  # rows without columns: unfactored, per layer
  assert plans["norm"] == ((2, 256),)
  # a matrix without a batch axis: the heuristic (T5X ignores its rule)
  assert plans["out"] == ((256, 1), (1, 512))
  # NONE with a column but no row: unfactored
  assert plans["pos"] == ((2, 32, 8),)
  with pytest.raises(ValueError, match="incomplete Adafactor spec"):
    osf.presets.t5x(1e-2, logical_factor_rules={"a": "row", "b": "col", "c": None},
                    param_logical_axes={"w": ("a", "b", "c")}).init({"w": jnp.ones((4, 5, 6))})
  with pytest.raises(ValueError, match="no logical factor rule for axis 'other'"):
    osf.presets.t5x(1e-2, logical_factor_rules="standard",
                    param_logical_axes={"w": ("other", "embed", "mlp")}
                    ).init({"w": jnp.ones((4, 5, 6))})


def test_t5x_factor_map_and_argument_errors():
  with pytest.raises(ValueError, match="no factor rule in factor_map matches"):
    osf.presets.t5x(1e-2, factor_map=[("kernel", ("row", "col"))]).init({"bias": jnp.ones(3)})
  with pytest.raises(ValueError, match="has 2 axes"):
    osf.presets.t5x(1e-2, factor_map=[(".*", ("batch", "row"))]).init({"w": jnp.ones((2, 3, 4))})
  with pytest.raises(ValueError, match="factored is False"):
    osf.presets.t5x(1e-2, factored=False, factor_map=[(".*", None)])
  with pytest.raises(ValueError, match="go together"):
    osf.presets.t5x(1e-2, logical_factor_rules="standard")
  with pytest.raises(TypeError, match="skip_nan_updates"):
    osf.presets.t5x(1e-2, skip_nan_updates=True)
  with pytest.raises(TypeError, match=r"presets.t5x\(\): multiply_by_parameter_scale must be "
                                      r"True or False, got \{'w': True\}"):
    osf.presets.t5x(1e-2, multiply_by_parameter_scale={"w": True})


def test_t5x_weight_decay_lr_exponent():
  params = {"w": jnp.ones((4, 3))}
  grads = {"w": jnp.zeros((4, 3))}
  tx = osf.presets.t5x(0.01, weight_decay_rate=2.0, weight_decay_rate_lr_exponent=1.0,
                       multiply_by_parameter_scale=False)
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], -0.02, rtol=1e-6)
  tx = osf.presets.t5x(lambda c: 0.01, weight_decay_rate_lr_exponent=2.0)
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], -1e-4, rtol=1e-6)


def test_t5x_refuses_spikes_behind_its_global_norm_clip_and_offers_the_chain_that_works():
  # Behind optax.clip_by_global_norm every step, the 50x one included, reached safefactor's
  # spike rule at the clip (a norm of 1.0 against about 45 unclipped): no spike was skipped.
  with pytest.raises(ValueError, match=re.escape(
      "osf.skip_nonfinite(optax.chain(optax.clip_by_global_norm(1.0), osf.presets.t5x(..., "
      "skip_nonfinite_steps=False)), skip_spikes=6.0)")):
    osf.presets.t5x(1e-2, global_norm_clip_threshold=1.0, skip_spikes=6.0)
  params = {"w": jnp.ones((64, 32))}
  offered = osf.skip_nonfinite(optax.chain(
      optax.clip_by_global_norm(1.0), osf.presets.t5x(1e-2, skip_nonfinite_steps=False)),
      skip_spikes=6.0)
  for tx in (osf.presets.t5x(1e-2, skip_spikes=6.0), offered):
    state, update = tx.init(params), jax.jit(tx.update)
    rng = np.random.default_rng(0)
    for step in range(100):
      scale = 50.0 if step == 80 else 1.0
      grads = {"w": jnp.asarray(rng.normal(size=(64, 32)) * scale, jnp.float32)}
      updates, state = update(grads, state, params)
      assert bool(jnp.any(updates["w"] != 0)) == (step != 80), step
    assert (int(osf.skipped_spikes(state)), int(osf.skipped_steps(state))) == (1, 1)


# Arguments and overrides ---------------------------------------------------------------------

PRESETS = {
    "transformers": lambda **kw: osf.presets.transformers(**kw),
    "torch": lambda **kw: osf.presets.torch(**kw),
    "big_vision": lambda **kw: osf.presets.big_vision(1e-3, **kw),
    "t5x": lambda **kw: osf.presets.t5x(1e-3, **kw),
}


# A safefactor argument that each preset sets from an argument of its own.
CONFLICTS = {"transformers": ("learning_rate", "lr"), "torch": ("clipping_threshold", "d"),
             "big_vision": ("weight_decay_rate", "wd"), "t5x": ("momentum", "beta1")}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_unknown_and_conflicting_overrides_are_named(preset):
  with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
    PRESETS[preset](no_such_option=1)
  name, own = CONFLICTS[preset]
  with pytest.raises(TypeError, match=rf"{name} is set from this preset's own .*{own}"):
    PRESETS[preset](**{name: 0.5})


@settings(max_examples=40)
@given(name=st.sampled_from(sorted(set(preset_assembly.SAFEFACTOR_ARGUMENTS) | {"bogus"})),
       preset=st.sampled_from(sorted(PRESETS)))
def test_every_override_is_taken_or_refused_by_name(name, preset):
  """An override either builds (its default value passes through) or raises naming it."""
  own = inspect.signature(getattr(osf.presets, preset)).parameters
  assume(name not in own)
  default = inspect.signature(osf.safefactor).parameters.get(name)
  value = default.default if default is not None else 1
  try:
    tx = PRESETS[preset](**{name: value})
  except TypeError as error:
    assert name in str(error)
  else:
    tx.init({"w": jnp.ones((4, 3))})


def test_overrides_reach_safefactor():
  tx = osf.presets.transformers(skip_nonfinite_steps=False, state_dtype="bfloat16")
  state = tx.init({"w": jnp.ones((4, 3))})
  assert isinstance(state, osf.AdafactorState)
  assert state.second_moment["w"].v_row.dtype == jnp.bfloat16
  tx = osf.presets.torch(momentum=0.9, dtype_momentum="bfloat16")
  assert tx.init({"w": jnp.ones((4, 3))}).inner_state.momentum["w"].dtype == jnp.bfloat16


def test_own_argument_errors():
  with pytest.raises(ValueError, match=re.escape(
      "Cannot combine manual `lr` and `relative_step=True` options: pass relative_step=False "
      "to train at lr (relative_step is True by default, as in transformers), or lr=None for "
      "the relative step size")):
    osf.presets.transformers(lr=1e-3)
  osf.presets.transformers(lr=1e-3, relative_step=False)  # what the message says works
  with pytest.raises(ValueError, match="requires `relative_step=True`"):
    osf.presets.transformers(lr=1e-3, relative_step=False, warmup_init=True)
  with pytest.raises(ValueError, match="no learning rate"):
    osf.presets.transformers(relative_step=False)
  with pytest.raises(ValueError, match=r"clip_threshold must be positive and finite, got 0\.0"):
    osf.presets.transformers(clip_threshold=0.0)
  with pytest.raises(ValueError, match="decay_rate must be negative"):
    osf.presets.transformers(decay_rate=0.8)
  with pytest.raises(ValueError, match="beta2_decay must be negative"):
    osf.presets.torch(beta2_decay=0.5)
  with pytest.raises(ValueError, match="d must be at least 1"):
    osf.presets.torch(d=0.5)
  with pytest.raises(ValueError, match="lr must be at least 0"):
    osf.presets.torch(lr=-1.0)
  with pytest.raises(ValueError, match="param_rounding"):
    osf.presets.big_vision(1e-3, param_rounding="stochastic")
  with pytest.raises(ValueError, match=r"skip_spikes .* needs skip_nonfinite_steps=True"):
    osf.presets.big_vision(1e-3, skip_nonfinite_steps=False, skip_spikes=6.0)


@pytest.mark.parametrize("build,error,message", [
    # Each was built and then trained wrongly or failed deep inside the step: a NaN learning
    # rate skipped every step blaming every leaf, a string one failed in JAX's dtype code.
    (lambda: osf.presets.big_vision(float("nan")), ValueError,
     r"presets.big_vision\(\): learning_rate must be finite, got nan"),
    (lambda: osf.presets.big_vision("1e-3"), TypeError,
     r"presets.big_vision\(\): learning_rate must be a number or a schedule, got '1e-3'"),
    (lambda: osf.presets.big_vision(1e-3, schedule=0.5), TypeError,
     r"presets.big_vision\(\): schedule must be a function of the step \(or None\), got 0.5"),
    (lambda: osf.presets.big_vision(1e-3, wd="0.1"), TypeError,
     r"presets.big_vision\(\): wd must be a number, got '0.1'"),
    # A negative threshold "clipped" by scaling with a negative factor: the step ascended.
    (lambda: osf.presets.t5x(1e-2, global_norm_clip_threshold=-1.0), ValueError,
     r"presets.t5x\(\): global_norm_clip_threshold must be non-negative and finite"),
    (lambda: osf.presets.t5x(1e-2, factored="no"), TypeError,
     r"presets.t5x\(\): factored must be True or False, got 'no'"),
    # None was taken as safefactor's "unscaled" (T5X asserts a learning rate is given): the
    # updates were the raw scaled gradients, and with a rounded bfloat16 beta1 it failed
    # multiplying None.
    (lambda: osf.presets.t5x(None), TypeError,
     r"presets.t5x\(\): learning_rate must be a number or a schedule, got None"),
    (lambda: osf.presets.torch(lr="0.01"), TypeError,
     r"presets.torch\(\): lr must be a number or a schedule, got '0.01'"),
    (lambda: osf.presets.torch(eps=1e-3), TypeError,
     r"presets.torch\(\): eps must be a pair \(eps\[0\], eps\[1\]\), as in torch, got 0.001"),
    (lambda: osf.presets.torch(weight_decay=float("inf")), ValueError,
     r"presets.torch\(\): weight_decay must be at least 0 and finite, got inf"),
    # A string switch read as True: maximize="False" maximised, warmup_init="False" warmed up.
    (lambda: osf.presets.torch(maximize="False"), TypeError,
     r"presets.torch\(\): maximize must be True or False, got 'False'"),
    (lambda: osf.presets.transformers(warmup_init="False"), TypeError,
     r"presets.transformers\(\): warmup_init must be True or False, got 'False'"),
    (lambda: osf.presets.transformers(clip_threshold="1"), TypeError,
     r"presets.transformers\(\): clip_threshold must be a number, got '1'"),
    # The error named safefactor's momentum, an argument the user had not passed.
    (lambda: osf.presets.transformers(beta1=1.0), ValueError,
     r"presets.transformers\(\): beta1 must be in \[0, 1\) \(or None\), got 1.0"),
    (lambda: osf.presets.transformers(weight_decay="0.1"), TypeError,
     r"presets.transformers\(\): weight_decay must be a number, got '0.1'"),
])
def test_a_presets_own_arguments_are_judged_by_their_names(build, error, message):
  with pytest.raises(error, match=message):
    build()


INJECTED = {
    "t5x": (lambda: optax.inject_hyperparams(osf.presets.t5x)(learning_rate=1e-2),
            lambda: osf.presets.t5x(1e-2)),
    # T5X's clip and lr exponent were tested for truth, which a traced array refuses
    # (TracerBoolConversionError in the jitted update); a zero of either is off, as T5X's,
    # and a zero rate under an exponent is 1 (T5X's `or`).
    **{f"t5x_{name}": (
        lambda kwargs=kwargs: optax.inject_hyperparams(osf.presets.t5x)(1e-2, **kwargs),
        lambda kwargs=kwargs: osf.presets.t5x(1e-2, **kwargs))
       for name, kwargs in {
           "clip_and_lr_exponent": dict(global_norm_clip_threshold=1.0, weight_decay_rate=1e-3,
                                        weight_decay_rate_lr_exponent=1.0),
           "zero_clip_and_lr_exponent": dict(global_norm_clip_threshold=0.0,
                                             weight_decay_rate=0.0,
                                             weight_decay_rate_lr_exponent=0.0),
           "zero_rate_under_lr_exponent": dict(weight_decay_rate=0.0,
                                               weight_decay_rate_lr_exponent=2.0)}.items()},
    "big_vision": (lambda: optax.inject_hyperparams(osf.presets.big_vision)(
        learning_rate=1e-2, wd=1e-4), lambda: osf.presets.big_vision(1e-2, wd=1e-4)),
    "transformers": (lambda: optax.inject_hyperparams(osf.presets.transformers)(
        lr=1e-2, relative_step=False, weight_decay=0.1),
        lambda: osf.presets.transformers(lr=1e-2, relative_step=False, weight_decay=0.1)),
    "torch": (lambda: optax.inject_hyperparams(osf.presets.torch)(lr=1e-2, weight_decay=0.1),
              lambda: osf.presets.torch(lr=1e-2, weight_decay=0.1)),
    # Overrides: inject_hyperparams passed them on gathered, as overrides={...}, which each
    # preset refused as an unknown argument named "overrides".
    "torch_overrides": (
        lambda: optax.inject_hyperparams(osf.presets.torch)(lr=1e-2, momentum=0.9,
                                                            skip_spikes=6.0),
        lambda: osf.presets.torch(lr=1e-2, momentum=0.9, skip_spikes=6.0)),
    "transformers_overrides": (
        lambda: optax.inject_hyperparams(osf.presets.transformers)(
            lr=1e-2, relative_step=False, weight_decay=0.1,
            weight_decay_mask={"w": True, "kernel": False}),
        lambda: osf.presets.transformers(lr=1e-2, relative_step=False, weight_decay=0.1,
                                         weight_decay_mask={"w": True, "kernel": False})),
    "t5x_overrides": (
        lambda: optax.inject_hyperparams(osf.presets.t5x)(1e-2, beta2_cap=0.5,
                                                          state_dtype="bfloat16"),
        lambda: osf.presets.t5x(1e-2, beta2_cap=0.5, state_dtype="bfloat16")),
}


@pytest.mark.parametrize("name", sorted(INJECTED))
def test_a_preset_injected_steps_as_the_preset_does(name):
  # optax.inject_hyperparams (the usual way to change a learning rate between steps)
  # failed in init for every preset, saying "unexpected keyword argument 'overrides'",
  # and then on the numbers the presets judged in Python.
  injected, plain = (make() for make in INJECTED[name])
  params = {"w": jnp.ones((4, 3)), "kernel": jnp.linspace(-1.0, 1.0, 256 * 130).reshape(256, 130)}
  grads = jax.tree.map(lambda p: jnp.cos(3 * p), params)
  state, plain_state = injected.init(params), plain.init(params)
  step = jax.jit(injected.update)
  for _ in range(2):
    updates, state = step(grads, state, params)
    expected, plain_state = plain.update(grads, plain_state, params)
    if name != "big_vision":
      chex.assert_trees_all_close(updates, expected, rtol=1e-6, atol=1e-9)
      continue
    # Injected, big_vision's momentum 0.9 is a float32 array: its 1 - momentum is a
    # float32 ulp off the Python float's, and a blend near a bfloat16 tie may be stored
    # one bfloat16 ulp away (2**-8 relative), here on 3 of 33,280 elements; a momentum
    # left unrounded would move every element.
    for ours, theirs in zip(jax.tree.leaves(updates), jax.tree.leaves(expected), strict=True):
      apart = ~np.isclose(ours, theirs, rtol=1e-6, atol=1e-9)
      assert apart.mean() < 1e-3
      np.testing.assert_allclose(ours, theirs, rtol=2.0**-8)


@pytest.mark.parametrize("preset,kwargs,message", [
    (osf.presets.t5x, dict(learning_rate=1e-2, momentum=0.9),
     "presets.t5x(): momentum is set from this preset's own beta1; pass that instead of "
     "momentum="),
    (osf.presets.t5x, dict(learning_rate=1e-2, skip_nan_updates=True),
     "presets.t5x(): skip_nan_updates is not taken: T5X keeps each NaN element's old value"),
    (osf.presets.torch, dict(lr=1e-2, momentun=0.9),
     "presets.torch() got an unexpected keyword argument 'momentun'; did you mean momentum?"),
])
def test_an_injected_presets_overrides_are_judged_by_their_names(preset, kwargs, message):
  with pytest.raises(TypeError, match=re.escape(message)):
    optax.inject_hyperparams(preset)(**kwargs).init({"w": jnp.ones((4, 3))})


def test_a_switch_given_as_an_array_is_refused_naming_static_args():
  # An array switch cannot steer the preset's Python: it would fail as a tracer's bool (an
  # optax.inject_hyperparams that hands bools over as arrays), or be read by truthiness.
  with pytest.raises(TypeError, match=r"presets.torch\(\): maximize is a switch, got an "
                                      r"array; under optax.inject_hyperparams pass it in "
                                      r"static_args=\('maximize',\)"):
    osf.presets.torch(maximize=jnp.array(True))


def test_transformers_decay_with_parameter_scale_skips_as_a_whole():
  params = {"w": jnp.full((8, 4), 2.0)}
  tx = osf.presets.transformers(weight_decay=0.1)
  state = tx.init(params)
  updates, state = tx.update({"w": jnp.full((8, 4), jnp.nan)}, state, params)
  assert float(jnp.abs(updates["w"]).max()) == 0 and int(osf.skipped_steps(state)) == 1


@pytest.mark.parametrize("dtype,rtol", [("complex64", 1e-5), ("complex128", 1e-12)])
def test_transformers_decays_a_complex_param_by_the_rms_of_its_modulus(x64, dtype, rtol):
  # HF computes the scale as a norm, of |p| for a complex tensor; the decay is
  # -weight_decay * lr * max(rms(|p|), eps2) * p, complex like p (computed in p's own
  # precision: complex64 is 32 bits a part), on top of the update without decay.
  rng = np.random.default_rng(0)
  shape = (6, 4)
  p = ((rng.normal(size=shape) + 1j * rng.normal(size=shape)) * 0.02).astype(dtype)
  g = (rng.normal(size=shape) - 0.5j * rng.normal(size=shape)).astype(dtype)
  params, grads = {"w": jnp.asarray(p)}, {"w": jnp.asarray(g)}
  plain, decayed = [osf.presets.transformers(lr=0.05, relative_step=False, weight_decay=wd)
                    for wd in (0.0, 0.3)]
  u_plain, _ = plain.update(grads, plain.init(params), params)
  u_decayed, _ = decayed.update(grads, decayed.init(params), params)
  scale = max(np.sqrt(np.mean(np.abs(p) ** 2)), 1e-3)
  expected = np.asarray(u_plain["w"]) - 0.3 * 0.05 * scale * p
  assert u_decayed["w"].dtype == np.dtype(dtype)
  np.testing.assert_allclose(np.asarray(u_decayed["w"]), expected, rtol=rtol,
                             atol=rtol * np.abs(expected).max())
  assert np.abs(np.imag(expected)).min() > 0  # the imaginary parts are decayed too


# Properties over the options -------------------------------------------------------------------

SMALL = {"m": (12, 10), "v": (7,), "s": (2, 6, 5)}


@settings(max_examples=8)
@given(clip_threshold=st.sampled_from([0.5, 1.0, 1.5, 4.0]),
       decay_rate=st.sampled_from([-0.8, -0.5, -1.0]),
       beta1=st.sampled_from([None, 0.0, 0.9]),
       weight_decay=st.sampled_from([0.0, 0.01]),
       scale_parameter=st.booleans(),
       relative_step=st.booleans(), warmup_init=st.booleans(),
       seed=st.integers(0, 2**16))
def test_transformers_property(clip_threshold, decay_rate, beta1, weight_decay,
                               scale_parameter, relative_step, warmup_init, seed):
  torch = pytest.importorskip("torch")
  hf = pytest.importorskip("transformers.optimization")
  kwargs = dict(clip_threshold=clip_threshold, decay_rate=decay_rate, beta1=beta1,
                weight_decay=weight_decay, scale_parameter=scale_parameter,
                relative_step=relative_step, warmup_init=warmup_init and relative_step,
                lr=None if relative_step else 3e-3)
  params, grads = _problem(np.float32, steps=4, shapes=SMALL, seed=seed)
  ours, _ = _run_preset(osf.presets.transformers(**kwargs), params, grads)
  theirs = _run_torch(lambda ps: hf.Adafactor(ps, **kwargs), params, grads, torch)
  assert _largest_difference(ours, theirs) <= BOUND[np.float32]


def test_a_preset_drops_its_own_defaults_that_its_original_ignores_without_warning():
  # The originals ignore a parameter scale's bounds without the scale, a momentum's dtype
  # without momentum, a size threshold without factoring; passed on, safefactor warned of
  # them under its own names (and big_vision's bfloat16 momentum dtype is its default).
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    osf.presets.t5x(1e-2, multiply_by_parameter_scale=False, factored=False)
    # Defaults spelt out: an equal number that is another object, a dtype by another name.
    osf.presets.t5x(1e-2, multiply_by_parameter_scale=False, epsilon2=float("1e-3"),
                    dtype_momentum=jnp.float32)
    osf.presets.big_vision(1e-2, momentum=None)
    osf.presets.transformers(lr=1e-3, relative_step=False, scale_parameter=False)


@pytest.mark.parametrize("build,message", [
    (lambda: osf.presets.t5x(1e-2, multiply_by_parameter_scale=False, epsilon2=0.2),
     r"presets.t5x\(\): epsilon2=0.2 has no effect: multiply_by_parameter_scale is False"),
    (lambda: osf.presets.t5x(1e-2, multiply_by_parameter_scale=False, epsilon2=1e-4),
     r"presets.t5x\(\): epsilon2=0.0001 has no effect"),
    (lambda: osf.presets.t5x(1e-2, dtype_momentum="bf16"),
     r"presets.t5x\(\): dtype_momentum='bf16' has no effect: beta1 is None"),
    (lambda: osf.presets.t5x(1e-2, multiply_by_parameter_scale=False, max_parameter_scale=0.5),
     r"presets.t5x\(\): max_parameter_scale=0.5 has no effect"),
    (lambda: osf.presets.t5x(1e-2, factored=False, min_dim_size_to_factor=4),
     r"presets.t5x\(\): min_dim_size_to_factor=4 has no effect: factored is False"),
    # T5X applies logical rules only when factoring (a factor_map it refuses there).
    (lambda: osf.presets.t5x(1e-2, factored=False, logical_factor_rules="standard",
                             param_logical_axes={"w": ("layers", "embed", "mlp")}),
     r"presets.t5x\(\): logical_factor_rules='standard' has no effect: factored is False"),
    (lambda: osf.presets.t5x(1e-2, dtype_momentum="bfloat16"),
     r"presets.t5x\(\): dtype_momentum='bfloat16' has no effect: beta1 is None"),
    (lambda: osf.presets.big_vision(1e-2, momentum=None, dtype_momentum="float32"),
     r"presets.big_vision\(\): dtype_momentum='float32' has no effect: momentum is off"),
    (lambda: osf.presets.transformers(lr=1e-3, relative_step=False, scale_parameter=False,
                                      eps=(1e-30, 0.1)),
     r"presets.transformers\(\): eps\[1\]=0.1 has no effect: scale_parameter is False"),
    # The originals decay a bfloat16 momentum by the Python float as bfloat16 holds it: 1.
    (lambda: osf.presets.big_vision(1e-2, momentum=0.999),
     r"presets.big_vision\(\): momentum is 0.999, which bfloat16 rounds to 1: the original "
     r"would never decay its momentum; the preset decays it by 0.999"),
    (lambda: osf.presets.t5x(1e-2, beta1=0.999, dtype_momentum="bfloat16"),
     r"presets.t5x\(\): beta1 is 0.999, which bfloat16 rounds to 1"),
], ids=["t5x-epsilon2", "t5x-smaller-epsilon2", "t5x-unknown-dtype", "t5x-max-scale",
        "t5x-size", "t5x-logical-rules", "t5x-momentum-dtype", "big_vision", "transformers",
        "big_vision-momentum-rounds-to-1", "t5x-beta1-rounds-to-1"])
def test_a_preset_warns_of_a_value_chosen_for_what_its_original_ignores(build, message):
  # The originals ignore them silently, and so did the presets: a value the user chose
  # was dropped without a word. It is named as the preset's own argument.
  with pytest.warns(UserWarning, match=message):
    build()


@pytest.mark.parametrize("build,message", [
    (lambda: osf.presets.transformers(weight_decay_mask=lambda p: p),
     r"presets.transformers\(\): weight_decay_mask selects the params that weight_decay "
     r"decays, and none is set"),
    (lambda: osf.presets.torch(weight_decay_mask=lambda p: p),
     r"presets.torch\(\): weight_decay_mask selects the params that weight_decay decays"),
    (lambda: osf.presets.torch(max_parameter_scale=1e-5),
     r"presets.torch\(\): eps\[1\]=0.001 is above max_parameter_scale=1e-05"),
    (lambda: osf.presets.t5x(1e-2, epsilon2=0.5, max_parameter_scale=0.1),
     r"presets.t5x\(\): epsilon2=0.5 is above max_parameter_scale=0.1"),
    (lambda: osf.presets.transformers(beta1=None, dtype_momentum="bfloat16"),
     r"presets.transformers\(\): dtype_momentum='bfloat16' is the momentum's dtype, and beta1 "
     r"is None"),
    (lambda: osf.presets.transformers(scale_parameter=False, max_parameter_scale=3.0),
     r"presets.transformers\(\): max_parameter_scale=3.0 bounds the parameter scale, and "
     r"scale_parameter=False"),
    # With steps after safefactor's, the guard moves out of it and checks the window again.
    (lambda: osf.presets.big_vision(1e-2, spike_window=3),
     r"presets.big_vision\(\): spike_window=3 sets the spike rule's history"),
    (lambda: osf.presets.torch(rounding_seed=3),
     r"presets.torch\(\): rounding_seed=3 seeds stochastic rounding's bits"),
], ids=["transformers-mask", "torch-mask", "torch-scales", "t5x-scales", "transformers-dtype",
        "transformers-scale-bound", "big_vision-window", "torch-seed"])
def test_safefactors_warnings_through_a_preset_name_its_arguments_at_the_callers_line(
    build, message):
  # They named safefactor's settings (weight_decay_rate, min_parameter_scale, momentum),
  # which these presets do not take, and pointed at the presets' own module.
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    build()
  assert len(caught) == 1, [str(w.message) for w in caught]
  assert re.match(message, str(caught[0].message)), str(caught[0].message)
  assert caught[0].filename == __file__


@pytest.mark.parametrize("build", [
    lambda: osf.presets.transformers(weight_decay=0.1, max_consecutive_skips=0),
    lambda: osf.presets.big_vision(1e-2, wd=0.1, max_consecutive_skips=0),
    lambda: osf.presets.t5x(1e-2, max_consecutive_skips=0),
], ids=["transformers-decay-after", "big_vision", "t5x"])
def test_a_preset_names_the_guards_setting_as_the_user_passed_it(build):
  # With steps after safefactor's the guard is skip_nonfinite's, whose own argument is
  # max_consecutive: the error named that, which the preset does not take.
  with pytest.raises(ValueError,
                     match=r"^presets\.\w+\(\): max_consecutive_skips must be a positive int"):
    build()


@pytest.mark.parametrize("build,error,message", [
    (lambda: osf.presets.transformers(lr=1e-3, relative_step=False, state_dtype="bf16"),
     TypeError, "presets.transformers(): state_dtype must be a floating dtype"),
    (lambda: osf.presets.t5x(1e-3, beta1=1.5),
     ValueError, "presets.t5x(): beta1 must be in [0, 1) (or None), got 1.5"),
    (lambda: osf.presets.torch(param_rounding="kahn"),
     ValueError, "presets.torch(): param_rounding must be one of"),
    (lambda: osf.presets.big_vision(1e-3, skip_spikes=-1.0),
     ValueError, "presets.big_vision(): skip_spikes"),
    (lambda: osf.presets.t5x(1e-3, decay_rate=-0.8),
     ValueError, "presets.t5x(): decay_rate must be positive and finite, got -0.8"),
])
def test_safefactors_errors_through_a_preset_name_the_preset(build, error, message):
  """Raised by safefactor's own checks, an error named the preset's argument but not the
  preset: with several optimizers built in one config, the user could not tell which."""
  with pytest.raises(error) as raised:
    build()
  assert str(raised.value).startswith(message), str(raised.value)
  assert str(raised.value).count("presets.") == 1


def test_transformers_clips_below_one_as_hf_does():
  # HF takes any positive clip_threshold; the preset refused those below 1.
  torch = pytest.importorskip("torch")
  hf = pytest.importorskip("transformers.optimization")
  kwargs = dict(clip_threshold=0.3, relative_step=False, scale_parameter=False, lr=3e-3)
  params, grads = _problem(np.float32, steps=4, shapes=SMALL, seed=7)
  ours, _ = _run_preset(osf.presets.transformers(**kwargs), params, grads)
  theirs = _run_torch(lambda ps: hf.Adafactor(ps, **kwargs), params, grads, torch)
  assert _largest_difference(ours, theirs) <= BOUND[np.float32]
  unclipped, _ = _run_preset(osf.presets.transformers(**{**kwargs, "clip_threshold": 1e3}),
                             params, grads)
  assert _largest_difference(ours, unclipped) > 100 * BOUND[np.float32]


@settings(max_examples=8)
@given(lr=st.sampled_from([1e-2, 0.3, 1.0]), beta2_decay=st.sampled_from([-0.8, -0.5]),
       eps2=st.sampled_from([1e-3, 1e-1]), d=st.sampled_from([1.0, 3.0]),
       weight_decay=st.sampled_from([0.0, 0.05]), maximize=st.booleans(),
       seed=st.integers(0, 2**16))
def test_torch_property(lr, beta2_decay, eps2, d, weight_decay, maximize, seed):
  torch = pytest.importorskip("torch")
  kwargs = dict(lr=lr, beta2_decay=beta2_decay, eps=(None, eps2), d=d,
                weight_decay=weight_decay, maximize=maximize)
  params, grads = _problem(np.float32, steps=4, shapes=SMALL, seed=seed)
  ours, _ = _run_preset(osf.presets.torch(**kwargs), params, grads)
  theirs = _run_torch(lambda ps: torch.optim.Adafactor(ps, **kwargs), params, grads, torch)
  assert _largest_difference(ours, theirs) <= BOUND[np.float32]


@pytest.mark.parametrize("dtype,expected", [
    (jnp.bfloat16, jnp.float32), (jnp.float16, jnp.float32), (jnp.float32, jnp.float32),
    (jnp.float64, jnp.float64)])
def test_transformers_keeps_its_momentum_as_hf_keeps_exp_avg(dtype, expected, request):
  # HF keeps exp_avg in the gradient's dtype, upcast to float32 for 16-bit ones; the preset
  # kept float32 for float64 params (1.35e-7 relative off after 30 steps).
  if dtype == jnp.float64:
    request.getfixturevalue("x64")
  params = {"w": jnp.ones((6, 4), dtype), "b": jnp.ones((4,), dtype)}
  state = osf.presets.transformers(beta1=0.9).init(params)
  momenta = state.inner_state.momentum
  assert {np.dtype(m.dtype) for m in jax.tree.leaves(momenta)} == {np.dtype(expected)}


@pytest.mark.parametrize("preset,kwargs", [
    ("big_vision", dict(learning_rate=0.05)),
    ("transformers", dict(weight_decay=0.01)),  # the decay scaled by the param's RMS
])
@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_a_preset_that_scales_afterwards_offers_the_rounding_that_works(preset, kwargs,
                                                                        rounding):
  build = getattr(osf.presets, preset)
  # The seed is offered with stochastic rounding only: Kahan's draws no bits.
  offered = ", seed=3" if rounding == "stochastic" else ""
  with pytest.raises(ValueError, match=rf"osf.with_param_rounding\(osf.presets.{preset}"
                                       rf"\(\.\.\.\), '{rounding}'{offered}\)"):
    build(**kwargs, param_rounding=rounding, rounding_seed=3)
  # What the message offers trains bfloat16 params with that rounding.
  tx = osf.with_param_rounding(build(**kwargs), rounding, seed=3 if offered else 0)
  params = {"kernel": jnp.ones((8, 8), jnp.bfloat16), "bias": jnp.ones((8,), jnp.bfloat16)}
  state = tx.init(params)
  for _ in range(3):
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  # Steps of about 1e-2 against a bfloat16 spacing of 2**-7 near 1: every weight moved.
  assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))
  assert bool(jnp.all(params["kernel"] < 1))


def test_transformers_decay_with_parameter_scale_takes_the_mask():
  # Under scale_parameter (the default) HF's decay is a step after safefactor's: the mask
  # went to safefactor, which has no decay of its own there, and every param was decayed.
  params = {"w": jnp.full((4, 3), 2.0), "b": jnp.ones(3)}
  grads = jax.tree.map(jnp.zeros_like, params)
  for scale_parameter in (True, False):
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      tx = osf.presets.transformers(lr=0.05, relative_step=False, weight_decay=0.1,
                                    scale_parameter=scale_parameter,
                                    weight_decay_mask={"w": True, "b": False},
                                    state_dtype="bfloat16")
    state = tx.init(params)
    updates, _ = tx.update(grads, state, params)
    # The other overrides still reach safefactor once the mask is taken out of them.
    moments = optax.tree_utils.tree_get(state, "second_moment")
    assert {leaf.dtype for leaf in jax.tree.leaves(moments)} == {jnp.dtype(jnp.bfloat16)}
    scale = 2.0 if scale_parameter else 1.0  # max(rms(p), eps2) under the parameter scale
    np.testing.assert_allclose(updates["w"], -0.1 * 0.05 * scale * 2.0, rtol=1e-6)
    np.testing.assert_array_equal(updates["b"], 0.0)


def test_big_vision_warns_of_a_mask_without_decay():
  with pytest.warns(UserWarning, match=r"big_vision\(\): weight_decay_mask .* wd is 0: it has "
                                       r"no effect"):
    osf.presets.big_vision(1e-3, weight_decay_mask={"w": True})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    osf.presets.big_vision(1e-3)
    osf.presets.big_vision(1e-3, wd=1e-4, weight_decay_mask={"w": True})


def test_t5x_lr_exponent_takes_a_scheduled_rate():
  # A rate schedule, which the preset hands to safefactor without the exponent, failed with
  # it multiplying the function ("unsupported operand type(s) for *: 'function'").
  params, grads = {"w": jnp.ones((4, 3))}, {"w": jnp.zeros((4, 3))}
  for learning_rate in (0.01, optax.constant_schedule(0.01)):
    tx = osf.presets.t5x(learning_rate, weight_decay_rate=optax.linear_schedule(2.0, 0.0, 100),
                         weight_decay_rate_lr_exponent=1.0, multiply_by_parameter_scale=False)
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.02, rtol=1e-6)


def test_t5x_lr_exponent_takes_a_rate_of_zero_as_none_as_t5x_does():
  # T5X: (weight_decay_rate or 1.0) * learning_rate ** exponent.
  params, grads = {"w": jnp.ones((4, 3))}, {"w": jnp.zeros((4, 3))}
  tx = osf.presets.t5x(0.01, weight_decay_rate=0.0, weight_decay_rate_lr_exponent=0.5,
                       multiply_by_parameter_scale=False)
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], -0.1, rtol=1e-6)


@pytest.mark.parametrize("build", [
    lambda momentum, dtype: osf.presets.big_vision(1.0, momentum=momentum,
                                                   dtype_momentum=dtype),
    lambda momentum, dtype: osf.presets.t5x(1.0, beta1=momentum, dtype_momentum=dtype,
                                            multiply_by_parameter_scale=False,
                                            clipping_threshold=None)],
    ids=["big_vision", "t5x"])
@pytest.mark.parametrize("momentum", [0.9, 0.99])
def test_a_bfloat16_momentum_decays_as_the_originals_python_float_does(build, momentum):
  # big_vision (optax.ema) and T5X decay the stored momentum by a Python float times it,
  # which JAX rounds to the momentum's dtype: 0.9 in bfloat16 is 0.8984375 (0.99 is
  # 0.98828125), while the new term keeps 1 - 0.9. The preset decayed by 0.9 itself: its
  # momentum ran up to 1.6% above theirs. optax.ema is big_vision's own momentum step,
  # and T5X's is the same expression. With |g| = 1 every step the scaled gradient is g.
  # (XLA:CPU keeps the bfloat16 product in float32, so the match is exact here; a
  # float16 product it rounds to float16, which the preset does not.)
  dtype = "bfloat16"
  rng = np.random.default_rng(0)
  grads = [np.where(rng.random(256) < 0.3, -1.0, 1.0).astype(np.float32) for _ in range(40)]
  tx = build(momentum, dtype)
  theirs = optax.ema(momentum, debias=False, accumulator_dtype=jnp.dtype(dtype))
  params = {"w": jnp.zeros(256)}
  state, their_state = tx.init(params), theirs.init(params["w"])
  step, their_step = jax.jit(tx.update), jax.jit(theirs.update)
  for g in grads:
    updates, state = step({"w": jnp.asarray(g)}, state, params)
    with jax.numpy_dtype_promotion("standard"):  # as big_vision runs optax
      expected, their_state = their_step(jnp.asarray(g), their_state)
    np.testing.assert_allclose(-updates["w"], expected, rtol=1e-6, atol=1e-6)
  stored = optax.tree_utils.tree_get(state, "momentum")["w"]
  np.testing.assert_array_equal(stored, their_state.ema)
