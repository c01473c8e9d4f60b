"""The codebase's shape, pinned: what a contributor may rely on when changing it."""

import ast
import inspect
import itertools
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec

import optax_safefactor as osf
from optax_safefactor._src import hyperparams, placement

SRC = pathlib.Path(osf.__file__).parent / "_src"


def test_every_option_is_declared_once_in_the_hyperparameters():
  # 0.1 wrote each option out in safefactor, _validate and scale_by_adafactor, then
  # forwarded it again: one new option took five edits. Both factories now fill one
  # Hyperparams, so each of their arguments is a field (or a renamed optax argument).
  fields = set(hyperparams.Hyperparams._fields)
  renamed = {"step_offset": "decay_offset", "epsilon": "eps"}
  for factory in (osf.safefactor, osf.scale_by_safe_factored_rms):
    for name in inspect.signature(factory).parameters:
      assert renamed.get(name, name) in fields, (factory.__name__, name)


def _is_self_subtraction(node: ast.AST) -> bool:
  return (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)
          and ast.dump(node.left) == ast.dump(node.right))


def _called_name(node: ast.AST) -> str | None:
  """``exp`` for ``jnp.exp(...)`` or ``exp(...)``: the last name of what is called."""
  if not isinstance(node, ast.Call):
    return None
  func = node.func
  return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


# Every primitive a hint is built from: a barrier, the exp that XLA does not duplicate
# (computed_once), and x - x, which XLA does not fold (nan_unless_finite, finite_by_sum).
HINT_PRIMITIVES = {
    "optimization_barrier": lambda node: (isinstance(node, (ast.Attribute, ast.Name)) and
                                          getattr(node, "attr", getattr(node, "id", None))
                                          == "optimization_barrier"),
    "exp": lambda node: _called_name(node) == "exp",
    "x - x": _is_self_subtraction,
}


def _primitives_in(path: pathlib.Path) -> set[str]:
  tree = ast.parse(path.read_text())
  return {name for node in ast.walk(tree) for name, found in HINT_PRIMITIVES.items()
          if found(node)}


# The hints, and the primitive that lowers each one per platform.
HINT_MODULES = ("xla_hints.py", "unit_order.py", "per_compiler.py")


def test_compiler_hints_live_in_their_own_modules():
  # In 0.1 optimization_barrier and friends were threaded through the maths; in 0.2 a
  # finiteness hint lived in accumulate.py, where a grep for barriers could not see it.
  assert set().union(*[_primitives_in(SRC / name) for name in HINT_MODULES]) == set(
      HINT_PRIMITIVES)
  for path in SRC.glob("*.py"):
    if path.name not in HINT_MODULES:
      assert not _primitives_in(path), (path.name, _primitives_in(path))


@pytest.mark.parametrize("module", ["xla_hints", "unit_order"])
def test_every_hint_is_used_and_pinned(module):
  tree = ast.parse((SRC / f"{module}.py").read_text())
  # Private helpers (the per-compiler primitive and the hints' hinted forms) serve the hints.
  hints = [node for node in tree.body
           if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]
  assert hints, f"{module} has no hint"
  others = " ".join(p.read_text() for p in SRC.glob("*.py") if p.name != f"{module}.py")
  tests = pathlib.Path(__file__).parent
  for hint in hints:
    assert f"{module}.{hint.name}(" in others, f"{hint.name} is used nowhere"
    pinned = re.findall(r"``(tests/\w+\.py)(?:::(\w+))?``", ast.get_docstring(hint))
    assert pinned, f"{hint.name} names no test that pins it"
    for test_file, test_name in pinned:
      text = (tests.parent / test_file).read_text()
      assert not test_name or f"def {test_name}(" in text, (hint.name, test_file, test_name)


def test_every_module_has_one_idea_and_a_bounded_size():
  for path in sorted(SRC.glob("*.py")):
    text = path.read_text()
    assert len(text.splitlines()) <= 500, f"{path.name}: {len(text.splitlines())} lines"
    first_line = ast.get_docstring(ast.parse(text)).splitlines()[0]
    assert first_line.endswith("."), f"{path.name}: its docstring's first line says its idea"


def test_the_module_map_has_every_module():
  # docs/architecture.md is where a reader finds what each module owns: a module added
  # without its row (spikes, the presets' three, state_checks were) is found only by grep.
  table = (SRC.parents[1] / "docs" / "architecture.md").read_text()
  package = SRC.parent
  modules = [path.relative_to(package).as_posix()
             for folder in (package, SRC, package / "benchmarks")
             for path in sorted(folder.glob("*.py"))
             if path.name != "__init__.py" or folder == package]
  missing = [module for module in modules if f"`{module}`" not in table]
  assert not missing, f"docs/architecture.md's module table lacks {missing}"


def test_the_rounding_mode_is_read_in_one_module():
  # 0.2 compared the mode string in four files and validated it twice.
  for path in SRC.glob("*.py"):
    if path.name != "write_back.py":
      for mode in ("nearest", "stochastic", "kahan"):
        assert f'== "{mode}"' not in path.read_text(), (path.name, mode)
        assert f'!= "{mode}"' not in path.read_text(), (path.name, mode)


def test_a_new_hyperparameter_is_forwarded_without_an_edit():
  # Both factories build their Hyperparams from their own arguments (Hyperparams.of):
  # a new option is a signature entry, its docstring, a field and its use, nothing more.
  for factory in (osf.safefactor, osf.scale_by_safe_factored_rms):
    source = inspect.getsource(factory)
    assert "Hyperparams.of(locals()" in source, factory.__name__


def test_factor_rules_run_once_per_leaf():
  # 0.1 read the plan back off the state's shapes, which lost the batch axes, so it
  # called the user's rules again for every leaf on every trace.
  calls = []

  def rules(path, shape):
    calls.append(jax.tree_util.keystr(path))
    return ("batch", None, None) if len(shape) == 3 else None

  tx = osf.safefactor(0.1, factor_rules=rules)
  params = {"stack": jnp.ones((3, 130, 140)), "w": jnp.ones((130, 140))}
  state = tx.init(params)
  for _ in range(2):  # eager, then a jit trace
    _, state = tx.update(params, state, params)
  jax.jit(tx.update)(params, state, params)
  assert sorted(calls) == ["['stack']", "['w']"]


def test_boxes_and_partition_specs_follow_one_placement_rule():
  shapes = [((256, 512), (256, 1)), ((256, 512), (1, 512)), ((4, 1, 8), (4, 1, 1)),
            ((4, 8), (4, 8))]
  for param_shape, state_shape in shapes:
    names = ("data", "model", None)[: len(param_shape)]
    spec = placement.state_spec(PartitionSpec(*names), param_shape, state_shape)
    assert tuple(spec) == placement.fitted_axis_names(names, param_shape, state_shape)
    assert all(name is None for name, size in zip(tuple(spec), state_shape, strict=True)
               if size == 1)


def test_public_surface():
  assert "WitnessedTransformation" not in osf.__all__ and "FactorPlan" not in osf.__all__
  assert not hasattr(osf, "SafeFactoredState") and not hasattr(osf, "SafefactorState")
  assert sorted(osf.__all__) == sorted(set(osf.__all__))
  with pytest.raises(TypeError):
    osf.DEFAULT_LOGICAL_RULES["layers"] = "row"  # read-only: a shared default


def test_both_factories_share_one_state_type():
  params = {"w": jnp.ones((130, 140))}
  for tx in (osf.safefactor(0.1, skip_nonfinite_steps=False),
             osf.scale_by_safe_factored_rms()):
    assert isinstance(tx.init(params), osf.AdafactorState)
  assert isinstance(osf.safefactor(0.1).init(params).inner_state, osf.AdafactorState)
  assert isinstance(optax.tree_utils.tree_get(osf.safefactor(0.1).init(params), "count"),
                    jax.Array)


def _walk_one_update(tx, params, grads):
  """The package's own Python calls during one eager ``update``: each as (module, function)
  in order, and the pairs of modules that called each other."""
  state = tx.init(params)
  calls, edges = [], set()

  def module_of(frame):
    path = frame.f_code.co_filename if frame is not None else ""
    return pathlib.Path(path).name if str(SRC) in path else None

  def profile(frame, event, arg):
    del arg
    if event == "call" and (module := module_of(frame)):
      calls.append((module, frame.f_code.co_name))
      caller = module_of(frame.f_back)
      if caller and caller != module:
        edges.add((caller, module))

  sys.setprofile(profile)
  try:
    tx.update(grads, state, params)
  finally:
    sys.setprofile(None)
  return calls, {tuple(sorted(edge)) for edge in edges if edge[::-1] in edges}


def test_one_leaf_goes_down_the_layers_once():
  # One float16 (300, 200) leaf, eager: the update took 180 calls through 77 module
  # switches when the CPU's compiler hints and packing's bookkeeping sat on every leaf's
  # path (optax.adafactor: 30 and 16). A single leaf must not enter packing, and no two
  # modules may call each other (the kernel and the hints did).
  params = {"w": jnp.ones((300, 200), jnp.float16)}
  grads = {"w": jnp.full((300, 200), 0.01, jnp.float16)}
  calls, mutual = _walk_one_update(osf.safefactor(1e-3), params, grads)
  modules = [module for module, _ in calls]
  switches = sum(a != b for a, b in itertools.pairwise(modules))
  assert len(calls) <= 120, len(calls)
  assert switches <= 40, switches
  assert not mutual
  assert "packing.py" not in modules


def test_test_support_modules_import_only_what_every_test_run_installs():
  # --doctest-modules imports every module under tests/ that conftest.py does not ignore, in
  # every run, the core floors' too (no flax, orbax or demo tools there): a support module
  # that imported flax at the top failed that run's collection.
  tests_dir = pathlib.Path(__file__).parent
  ignored = next(
      ast.literal_eval(node.value)
      for node in ast.parse((tests_dir / "conftest.py").read_text()).body
      if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "collect_ignore")
  installed_everywhere = {
      "jax", "jaxlib", "numpy", "optax", "chex", "ml_dtypes", "optax_safefactor",
      "pytest", "hypothesis", "scipy", "tests"} | set(sys.stdlib_module_names)
  for path in sorted(tests_dir.glob("*.py")):
    if path.name.startswith("test_") or path.name in ignored:
      continue
    for node in ast.parse(path.read_text()).body:
      if isinstance(node, ast.Import):
        roots = [alias.name.split(".")[0] for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        roots = [node.module.split(".")[0]]
      else:
        continue
      for root in roots:
        assert root in installed_everywhere, (path.name, root)
