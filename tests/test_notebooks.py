"""The notebooks run top to bottom, are committed without outputs, and match their text form."""

import importlib.util
import inspect
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


def curves_not_seen():
  """The legend entries of the open figures whose curve changes no pixel of the figure.

  Such a curve draws nothing (a single finite point without a marker, say) or lies under
  curves drawn after it. Runs in the notebook's kernel, after its cells.
  """
  import matplotlib.pyplot as plt
  import numpy as np

  def pixels(figure):
    figure.canvas.draw()
    return np.asarray(figure.canvas.buffer_rgba()).copy()

  not_seen = []
  for number in plt.get_fignums():
    figure = plt.figure(number)
    legends = [axes.get_legend() for axes in figure.axes if axes.get_legend()]
    for legend in legends:  # a legend shows each entry's line style even with no curve
      legend.set_visible(False)
    everything = pixels(figure)
    for axes in figure.axes:
      for line in axes.get_lines():
        if line.get_label().startswith("_"):
          continue
        line.set_visible(False)
        if np.array_equal(pixels(figure), everything):
          not_seen.append(f"{axes.get_title()}: {line.get_label()}")
        line.set_visible(True)
    for legend in legends:
      legend.set_visible(True)
  return not_seen


def _with_figure_check(notebook):
  """The notebook with a first cell that keeps its figures open and a last that checks them."""
  checked = nbformat.from_dict(notebook)
  keep_figures = ("from matplotlib_inline.backend_inline import InlineBackend\n"
                  "InlineBackend.instance().close_figures = False")
  check = (inspect.getsource(curves_not_seen) + "\n"
           "not_seen = curves_not_seen()\n"
           "assert not not_seen, f'legend entries without a visible curve: {not_seen}'")
  checked.cells = [nbformat.v4.new_code_cell(keep_figures), *checked.cells,
                   nbformat.v4.new_code_cell(check)]
  return checked


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path):
  # Each legend entry of its plots must have a curve one can see (the last, added cell).
  notebook = _with_figure_check(nbformat.read(path, as_version=4))
  NotebookClient(notebook, timeout=300, kernel_name="python3",
                 resources={"metadata": {"path": str(path.parent)}}).execute()
  errors = [output for cell in notebook.cells for output in cell.get("outputs", [])
            if output.get("output_type") == "error"]
  assert not errors, [f"{error['ename']}: {error['evalue']}" for error in errors]


def test_curves_not_seen_finds_a_lone_point_and_a_covered_curve():
  import matplotlib

  matplotlib.use("agg")
  import matplotlib.pyplot as plt

  plt.close("all")
  try:
    plt.plot([1.0, 2.0, 3.0], label="seen")
    plt.plot([1.0, float("nan"), float("nan")], "--", label="one point, no marker")
    plt.plot([1.0, float("nan"), float("nan")], "x", label="one point, a marker")
    plt.plot([3.0, 2.0, 1.0], color="C4", label="covered")
    plt.plot([3.0, 2.0, 1.0], color="C5", linewidth=4, label="on top")
    plt.title("t")
    plt.legend()
    assert curves_not_seen() == ["t: one point, no marker", "t: covered"]
  finally:
    plt.close("all")


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
