"""The site's sources: API pages for every public name, plots and inventories up to date.

These run without Sphinx (the `docs` extra), but for the tests of the site's extensions that
use it, which skip without it; tests/test_site.py checks the built site.
"""

import pathlib
import types

import matplotlib.pyplot as plt
import numpy as np
import pytest

import optax_safefactor
from tests.helpers import load_module

ROOT = pathlib.Path(__file__).resolve().parents[1]



api_pages = load_module(ROOT / "docs" / "_ext" / "api_pages.py")
benchmark_plots = load_module(ROOT / "tools" / "benchmark_plots.py")
write_inventories = load_module(ROOT / "docs" / "_inventories" / "write_inventories.py")


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


def test_only_images_wider_than_the_content_column_fill_it(tmp_path):
  pytest.importorskip("sphinx")
  from docutils import nodes, utils

  figures = load_module(ROOT / "docs" / "_ext" / "figures.py")
  doctree = utils.new_document("page")
  widths = {"wide.png": figures.CONTENT_WIDTH_PX + 1, "narrow.png": figures.CONTENT_WIDTH_PX,
            "sized.png": 2000}
  for name, width in widths.items():
    plt.imsave(tmp_path / name, np.zeros((2, width, 3)))
    doctree += nodes.image(uri=name, candidates={"*": name})
  doctree[-1]["width"] = "50%"  # sized.png: the page sets its width
  doctree += nodes.image(uri="https://example.org/remote.png", candidates={"?": "remote"})
  assert figures.fill_content_width(doctree, tmp_path) == ["wide.png"]
  assert [image.get("width") for image in doctree.findall(nodes.image)] == [
      "100%", None, "50%", None]


def test_page_paths_name_each_page_by_its_files(tmp_path):
  pytest.importorskip("sphinx")
  page_links = load_module(ROOT / "docs" / "_ext" / "page_links.py")
  docs = tmp_path / "docs"
  (docs / "guides").mkdir(parents=True)
  (docs / "notebooks").mkdir()
  (docs / "guides" / "from_optax.md").write_text("# From optax\n")
  (docs / "changelog.md").write_text("```{include} ../CHANGELOG.md\n```\n")
  (docs / "notebooks" / "quickstart.ipynb").write_text("{}")
  assert page_links.page_paths(docs, ["guides/from_optax", "changelog", "notebooks/quickstart",
                                      "genindex"]) == {
      "docs/guides/from_optax.md": "guides/from_optax", "docs/changelog.md": "changelog",
      "CHANGELOG.md": "changelog", "notebooks/quickstart.ipynb": "notebooks/quickstart",
      "quickstart.ipynb": "notebooks/quickstart", "notebooks/quickstart.py": "notebooks/quickstart"}


def test_mentions_of_a_page_s_file_become_links_to_it():
  pytest.importorskip("sphinx")
  from docutils import nodes

  page_links = load_module(ROOT / "docs" / "_ext" / "page_links.py")
  paths = {"docs/benchmarks.md": "benchmarks", "quickstart.ipynb": "notebooks/quickstart",
           "docs/guides/low_precision.md": "guides/low_precision"}
  paragraph = nodes.paragraph("", "", nodes.Text("see docs/benchmarks.md, and "),
                              nodes.literal("", "quickstart.ipynb"),
                              nodes.literal("", "jupytext --sync quickstart.ipynb"),
                              nodes.Text(" olddocs/benchmarks.md docs/guides/low_precision.md"),
                              nodes.reference("", "docs/benchmarks.md", refuri="x.html"))
  section = nodes.section("", paragraph, nodes.literal_block("", "docs/benchmarks.md"))
  linked = page_links.link_mentions(section, paths, "guides/low_precision",
                                    lambda target: f"../{target}.html")
  assert linked == 2
  references = [(ref["refuri"], type(ref[0]).__name__, ref.astext())
                for ref in section.findall(nodes.reference)]
  assert references == [("../benchmarks.html", "Text", "docs/benchmarks.md"),
                        ("../notebooks/quickstart.html", "literal", "quickstart.ipynb"),
                        ("x.html", "Text", "docs/benchmarks.md")]
  # The text around a link, the command line, the page's own path and the code block stay.
  assert paragraph.astext() == ("see docs/benchmarks.md, and quickstart.ipynb"
                                "jupytext --sync quickstart.ipynb olddocs/benchmarks.md "
                                "docs/guides/low_precision.mddocs/benchmarks.md")
