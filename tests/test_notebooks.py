"""The notebooks run top to bottom, are committed without outputs, and match their text form."""

import importlib.util
import os
import pathlib
import subprocess
import sys

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


def _install_cell():
  """The notebooks' first code cell, the same in each: it installs the package if needed."""
  sources = {next(c.source for c in jupytext.read(p.with_suffix(".py")).cells
                  if c.cell_type == "code") for p in NOTEBOOKS}
  assert len(sources) == 1, "the notebooks' install cells differ"
  return sources.pop()


def _run_install_cell(monkeypatch, folder, uploads=(), pip_succeeds=True, installed=False):
  """Runs the install cell in ``folder`` as on a fresh Colab, with pip stood in for.

  Returns the pip commands it ran. ``uploads`` are wheel file names, oldest first.
  """
  for age, name in enumerate(reversed(uploads)):
    (folder / name).write_bytes(b"")
    os.utime(folder / name, (1e9 - age, 1e9 - age))
  state = {"installed": installed}
  find_spec = importlib.util.find_spec

  def fake_find_spec(name, *args):
    if name == "optax_safefactor" and not state["installed"]:
      return None
    return find_spec(name, *args)

  commands = []

  def fake_run(command, *args, **kwargs):
    commands.append(command)
    state["installed"] = pip_succeeds
    return subprocess.CompletedProcess(command, 0 if pip_succeeds else 1)

  monkeypatch.chdir(folder)
  monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)
  monkeypatch.setattr(subprocess, "run", fake_run)
  exec(compile(_install_cell(), "install cell", "exec"), {})
  return commands


def test_install_cell_does_nothing_when_the_package_is_importable(monkeypatch, tmp_path):
  assert _run_install_cell(monkeypatch, tmp_path, installed=True) == []


def test_install_cell_installs_the_newest_uploaded_wheel_with_the_demo_extra(
    monkeypatch, tmp_path):
  uploads = ("optax_safefactor-0.1.0-py3-none-any.whl", "optax_safefactor-0.2.0-py3-none-any.whl",
             "optax_safefactor-0.2.0-py3-none-any (1).whl")  # a second upload: pip refuses it
  [command] = _run_install_cell(monkeypatch, tmp_path, uploads)
  assert command[-1] == f"{tmp_path / uploads[1]}[demo]"
  assert command[:4] == [sys.executable, "-m", "pip", "install"]


def test_install_cell_falls_back_to_pypi(monkeypatch, tmp_path):
  [command] = _run_install_cell(monkeypatch, tmp_path)
  assert command[-1] == "optax-safefactor[demo]"


def test_install_cell_says_how_to_get_a_wheel_when_neither_is_there(
    monkeypatch, tmp_path, capsys):
  with pytest.raises(ModuleNotFoundError, match="see the message above"):
    _run_install_cell(monkeypatch, tmp_path, pip_succeeds=False)
  message = capsys.readouterr().out
  assert "python -m build" in message and "upload dist/optax_safefactor-*.whl" in message
