"""The site's sources: API pages for every public name, plots and inventories up to date.

These run without Sphinx (the `docs` extra); tests/test_site.py checks the built site.
"""

import importlib.util
import pathlib
import sys
import types

import optax_safefactor

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(path: pathlib.Path) -> types.ModuleType:
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[path.stem] = module
  spec.loader.exec_module(module)
  return module


api_pages = _load(ROOT / "docs" / "_ext" / "api_pages.py")
benchmark_plots = _load(ROOT / "tools" / "benchmark_plots.py")
write_inventories = _load(ROOT / "docs" / "_inventories" / "write_inventories.py")


def _package_with_a_module() -> types.ModuleType:
  """A package like optax_safefactor with a public module, as ``osf.presets`` will be."""
  package = types.ModuleType("pkg")
  presets = types.ModuleType("pkg.presets")

  def t5x(learning_rate):
    """T5X's Adafactor."""

  def _private():
    """Not public."""

  t5x.__module__ = _private.__module__ = "pkg.presets"
  presets.t5x, presets._private = t5x, _private

  def safefactor():
    """The optimizer."""

  class State(tuple):
    """A state."""

  class FailedError(Exception):
    """An error."""

  package.safefactor, package.State, package.FailedError, package.presets = (
      safefactor, State, FailedError, presets)
  package.RULES = {"layers": "batch"}
  package.__all__ = ("RULES", "FailedError", "State", "presets", "safefactor")
  return package


def test_a_page_per_public_name_and_none_for_others(tmp_path):
  package = _package_with_a_module()
  (tmp_path / "removed_name.md").write_text("# removed_name\n")
  api_pages.write_pages(tmp_path, package)
  assert sorted(p.stem for p in tmp_path.glob("*.md")) == sorted(package.__all__)
  assert ".. autofunction:: safefactor" in (tmp_path / "safefactor.md").read_text()
  assert ".. autoclass:: State" in (tmp_path / "State.md").read_text()
  assert ".. autoexception:: FailedError" in (tmp_path / "FailedError.md").read_text()
  assert ".. autodata:: RULES" in (tmp_path / "RULES.md").read_text()


def test_a_public_module_gets_a_page_listing_its_functions(tmp_path):
  page = api_pages.page(_package_with_a_module(), "presets")
  assert page.startswith("# presets\n")
  assert ".. automodule:: pkg.presets" in page
  assert "   t5x" in page and ".. autofunction:: t5x" in page
  assert "_private" not in page


def test_every_name_of_the_package_gets_a_page(tmp_path):
  api_pages.write_pages(tmp_path, optax_safefactor)
  assert {p.stem for p in tmp_path.glob("*.md")} == set(optax_safefactor.__all__)
  # Sorted without regard to case, so a class sits next to the function that makes it.
  rules = (tmp_path / "DEFAULT_LOGICAL_RULES.md").read_text()
  assert "   Logical axis names that hold separate layers or experts" in rules
  assert api_pages.public_names(optax_safefactor)[:2] == ["accumulate_gradients",
                                                          "AccumulationState"]


def test_the_plots_show_the_benchmark_tables_as_they_stand():
  text = benchmark_plots.BENCHMARKS.read_text()
  steps = benchmark_plots.step_numbers(text)
  # The same rows (dtypes and configurations) for each of safefactor's variants.
  labels = {tuple(steps[name]["labels"]) for name in benchmark_plots.OPTIMIZERS}
  assert len(labels) == 1 and len(labels.pop()) >= 4
  assert all(len(steps[name]["step"]) == len(steps[name]["labels"])
             for name in benchmark_plots.OPTIMIZERS)
  assert benchmark_plots.png_numbers(benchmark_plots.STEP_PLOT) == steps, (
      "docs/benchmarks.md changed: run python tools/benchmark_plots.py")
  modes = benchmark_plots.rounding_numbers(text)
  assert len(modes["labels"]) == len(modes["kahan"]) == 4
  assert benchmark_plots.png_numbers(benchmark_plots.ROUNDING_PLOT) == modes, (
      "docs/benchmarks.md changed: run python tools/benchmark_plots.py")


def test_the_inventories_are_written_from_their_list():
  for project, (version, entries) in write_inventories.INVENTORIES.items():
    shipped = (ROOT / "docs" / "_inventories" / f"{project}.inv").read_bytes()
    assert shipped == write_inventories.inventory(project, version, entries), (
        f"{project}.inv is stale: run python docs/_inventories/write_inventories.py")
