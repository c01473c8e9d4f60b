"""The notebooks run top to bottom, are committed without outputs, and match their text form."""

import pathlib

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_all_three_notebooks_exist():
  assert [p.stem for p in NOTEBOOKS] == ["migrate_from_optax", "quickstart", "sharding"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs_and_paired(path):
  notebook = nbformat.read(path, as_version=4)
  for cell in notebook.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, f"{path.name} has outputs"
  text_form = jupytext.read(path.with_suffix(".py"))
  assert [c.source for c in text_form.cells] == [c.source for c in notebook.cells], (
      f"{path.name} and {path.with_suffix('.py').name} differ: run jupytext --sync")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path):
  notebook = nbformat.read(path, as_version=4)
  NotebookClient(notebook, timeout=300, kernel_name="python3",
                 resources={"metadata": {"path": str(path.parent)}}).execute()
  errors = [output for cell in notebook.cells for output in cell.get("outputs", [])
            if output.get("output_type") == "error"]
  assert not errors
