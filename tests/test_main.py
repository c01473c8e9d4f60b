"""The main job: ``python -m optax_safefactor`` runs, prints its table, writes its plot."""

import argparse
import importlib
import importlib.util
import io
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from optax_safefactor.__main__ import SUBCOMMANDS
from optax_safefactor.benchmarks import common, demo

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*args, cwd):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "optax_safefactor", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300)


def test_demo_prints_table_and_writes_plot(tmp_path):
  result = _run("--steps", "12", "--dtype", "float16", "--rounding-steps", "0",
                "--spike-steps", "0", "--out", str(tmp_path / "out"), cwd=tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert lines[0].startswith("| optimizer | params | write-back | lr | final loss")
  safe = next(line for line in lines if line.startswith("| safefactor | float16"))
  optax_row = next(line for line in lines if line.startswith("| optax.adafactor | float16"))
  assert "| 0 / 12 |" in safe and "nan" not in safe
  assert "nan" in optax_row  # the incumbent's float16 failure, shown side by side
  plot = tmp_path / "out" / "loss_curves.png"
  assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert f"plot: {plot}" in result.stdout
  # stderr is a pipe here, as a log file would be: a line per run and one at the end, not
  # a bar's carriage-return updates (once one line of 200 KB in a default run's log).
  progress = result.stderr.splitlines()
  assert "\r" not in result.stderr and len(progress) == 3, result.stderr[-3000:]
  assert progress[0].startswith("0/24 steps") and progress[-1].startswith("24/24 steps")
  assert all(len(line) < 80 for line in progress)


def test_bad_flag_is_a_usage_error(tmp_path):
  result = _run("--steps", "many", cwd=tmp_path)
  assert result.returncode == 2 and "usage:" in result.stderr
  result = _run("--frobnicate", cwd=tmp_path)
  assert result.returncode == 2 and "unrecognized arguments" in result.stderr


def test_accumulate_counts_optimizer_steps(tmp_path):
  result = _run("--steps", "2", "--accumulate", "4", "--dtype", "bfloat16", "--rounding-steps", "0",
                "--spike-steps", "0", "--out", str(tmp_path / "out"), cwd=tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  safe = next(line for line in result.stdout.splitlines()
              if line.startswith("| safefactor | bfloat16"))
  assert "| 0 / 2 |" in safe  # two optimizer steps of four micro-batches each


def _usage_error(argv, capsys) -> str:
  """The last line ``argv`` prints to stderr as the usage error (status 2) it must be.

  In this process: the command line's own status and stream are checked, in a fresh
  interpreter, by test_bad_flag_is_a_usage_error."""
  with pytest.raises(SystemExit) as exit_info:
    demo.parse_args(argv)
  assert exit_info.value.code == 2
  return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("k", ["0", "3", "-4"])
def test_accumulate_must_divide_the_batch(k, capsys):
  assert _usage_error(["--accumulate", k], capsys).endswith(
      "error: --accumulate must be a positive divisor of the batch size 16")


def test_write_back_and_spike_comparisons(tmp_path):
  # Both comparisons in one run (each alone repeats the dtype runs and JAX's start-up).
  # The spike's: two steps past it, safefactor skips it (the history holds 100 steps by
  # then) and optax.adafactor steps on it; the table and the plot's last panel show both.
  spike_steps = demo.SPIKE_AT + 2
  result = _run("--steps", "2", "--dtype", "bfloat16", "--rounding-steps", "3",
                "--spike-steps", str(spike_steps), "--out", str(tmp_path / "out"), cwd=tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [line.split(" | ") for line in result.stdout.splitlines() if "| 0.001 |" in line]
  write_back, spike = rows[:5], rows[5:]
  assert [row[:3] for row in write_back] == [
      ["| safefactor", "float32", "nearest"], ["| safefactor", "bfloat16", "nearest"],
      ["| safefactor", "bfloat16", "stochastic"], ["| safefactor", "bfloat16", "kahan"],
      ["| optax.adafactor", "bfloat16", "nearest"]]
  assert all(row[6] == "0 / 3" and "nan" not in " | ".join(row) for row in write_back)
  assert [(row[0], row[1], row[7]) for row in spike] == [
      ("| optax.adafactor", "float32", "n/a"), ("| safefactor (skip_spikes=6)", "float32", "1")]
  assert all(row[6] == f"0 / {spike_steps}" for row in spike)
  assert (tmp_path / "out" / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rounding_steps_is_zero_or_at_least_two(capsys):
  assert _usage_error(["--rounding-steps", "1"], capsys).endswith(
      "error: --rounding-steps must be 0 or at least 2")
  assert _usage_error(["--spike-steps", "1"], capsys).endswith(
      "error: --spike-steps must be 0 or at least 2")


@pytest.mark.parametrize("seed", ["-1", "4294967296", "99999999999999999999999"])
def test_seed_outside_what_jax_and_numpy_take_is_a_usage_error(seed, capsys):
  # Once a ValueError from numpy and an OverflowError from jax, after the first run began.
  assert _usage_error(["--steps", "2", "--seed", seed], capsys) == (
      f"python -m optax_safefactor: error: --seed must be from 0 to 4294967295, not {seed}")
  assert demo.parse_args(["--seed", "4294967295"]).seed == 4294967295
  assert "from 0 to 4294967295" in " ".join(demo.build_parser().format_help().split())


def test_help(tmp_path):
  result = _run("--help", cwd=tmp_path)
  assert result.returncode == 0 and "--dtype" in result.stdout and "--seed" in result.stdout
  # The benchmarks are subcommands, found from the top-level help with what they cost.
  words = " ".join(result.stdout.split())  # as read, wherever argparse wrapped it
  assert "python -m optax_safefactor bench" in words
  assert "bench --help" in words and "minutes" in words
  for name in SUBCOMMANDS:
    assert f"\n  {name} " in result.stdout, name


def test_every_option_is_documented():
  actions = [a for a in demo.build_parser()._actions if not isinstance(a, argparse._HelpAction)]
  assert {o for a in actions for o in a.option_strings} == {
      "--steps", "--dtype", "--out", "--seed", "--rounding-steps", "--spike-steps",
      "--accumulate"}
  assert all(a.help and len(a.help) > 10 for a in actions)


def test_unwritable_out_fails_before_training(tmp_path):
  result = _run("--out", "/proc/x", "--steps", "2", "--dtype", "float16", cwd=tmp_path)
  assert result.returncode == 2
  # One line naming the path and the reason; no traceback, no progress bar: nothing ran.
  assert result.stderr.strip().splitlines() == [
      "python -m optax_safefactor: error: cannot write the plot to --out /proc/x: "
      "No such file or directory"]
  assert result.stdout == ""


@pytest.mark.parametrize("absent", [("matplotlib",), ("flax", "matplotlib")])
def test_missing_extras_fail_before_training(absent, tmp_path, monkeypatch, capsys):
  # Without matplotlib the demo trained every run, then failed with a traceback at the plot.
  real_find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *args: None if name in absent else real_find_spec(name, *args))
  monkeypatch.setattr(demo, "train", lambda *args, **kwargs: pytest.fail("trained"))
  assert demo.main(["--out", str(tmp_path), "--steps", "2"]) == 2
  verb = "is" if len(absent) == 1 else "are"
  assert capsys.readouterr().err.strip().splitlines() == [
      f"python -m optax_safefactor: error: {' and '.join(absent)} {verb} not installed: the "
      "demo needs its extra, pip install 'optax-safefactor[demo]'"]


def test_ctrl_c_prints_the_finished_runs_and_one_line(tmp_path, monkeypatch, capsys):
  # Ctrl-C printed some 50 lines of traceback through JAX's compiler, and the runs that
  # had finished were lost.
  finished = []

  def train(name, dtype, steps, *args, **kwargs):
    if len(finished) == 2:
      raise KeyboardInterrupt
    finished.append(name)
    return _result(name, dtype, steps)

  monkeypatch.setattr(demo, "train", train)
  out = tmp_path / "out"
  try:
    status = demo.main(["--out", str(out), "--steps", "3", "--rounding-steps", "0",
                        "--spike-steps", "0"])
  except KeyboardInterrupt:
    pytest.fail("Ctrl-C went through main() as a traceback")
  assert status == common.INTERRUPTED
  captured = capsys.readouterr()
  rows = [line for line in captured.out.splitlines() if line.startswith("| ")]
  assert [row.split(" | ")[0] for row in rows[1:]] == ["| safefactor", "| optax.adafactor"]
  assert captured.err.splitlines()[-1] == (
      "python -m optax_safefactor: interrupted after 2 of 4 runs: the table shows the "
      "finished ones; no plot written")
  assert not (out / "loss_curves.png").exists()


def test_ctrl_c_in_a_subcommand_is_one_line_and_status_130(tmp_path):
  # As the shell sees it: the benchmark stopped by Ctrl-C inside its main().
  code = ("import runpy, optax_safefactor.benchmarks.accumulate as bench\n"
          "def interrupted(argv):\n  raise KeyboardInterrupt\n"
          "bench.main = interrupted\n"
          "runpy.run_module('optax_safefactor', run_name='__main__')\n")
  result = subprocess.run(
      [sys.executable, "-c", code, "bench-accumulate"], cwd=tmp_path, capture_output=True,
      text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
  assert result.returncode == 130, result.stderr[-3000:]
  assert result.stderr.splitlines() == ["python -m optax_safefactor bench-accumulate: interrupted"]


def test_unwritable_folder_reasons(tmp_path):
  assert common.unwritable_folder(tmp_path / "a" / "b") is None
  assert list((tmp_path / "a" / "b").iterdir()) == []  # the probe is removed
  (tmp_path / "file").write_text("")
  # The file in the way is named: in "--json dir/x.json" it is not the path the user wrote.
  named = f"{tmp_path / 'file'} exists and is not a folder"
  assert common.unwritable_folder(tmp_path / "file") == named
  assert common.unwritable_folder(tmp_path / "file" / "below") == named


def _result(optimizer, dtype, steps, **fields):
  losses = list(np.linspace(3.0, 2.0, steps))
  return demo.RunResult(optimizer, dtype, losses, 0, None, 1024, 1.0, **fields)


@pytest.mark.parametrize("dtypes", [("float16", "bfloat16"), ("bfloat16", "float16")])
def test_plot_panels_follow_the_table_and_ticks_are_whole_steps(dtypes):
  import matplotlib.pyplot as plt

  results = [_result(name, dtype, 5) for dtype in dtypes
             for name in ("safefactor", "optax.adafactor")]
  table_dtypes = [line.split(" | ")[1] for line in demo.results_table(results).splitlines()[2:]]
  figure = demo.loss_figure(results)
  try:
    figure.canvas.draw()
    titles = [axis.get_title() for axis in figure.axes]
    assert titles == [f"params in {d}, lr 0.01" for d in dict.fromkeys(table_dtypes)]
    for axis in figure.axes:
      ticks = [t for t in axis.get_xticks() if axis.get_xlim()[0] <= t <= axis.get_xlim()[1]]
      assert ticks and all(float(t).is_integer() for t in ticks), ticks
  finally:
    plt.close(figure)


def test_write_back_panel_follows_the_dtype_panels():
  import matplotlib.pyplot as plt

  results = [_result("safefactor", "float16", 5), _result("optax.adafactor", "float16", 5)]
  results += [_result("safefactor", dtype, 30, rounding=rounding, learning_rate=1e-3,
                      comparison="rounding")
              for dtype, rounding in [("float32", "nearest"), ("bfloat16", "stochastic")]]
  table = demo.results_table(results).splitlines()
  assert "| safefactor | bfloat16 | stochastic | 0.001 | 2.000 | 2.328 |" in table[-1]
  figure = demo.loss_figure(results)
  try:
    titles = [axis.get_title() for axis in figure.axes]
    assert titles == ["params in float16, lr 0.01", "write-back at lr 0.001 (mean of 15 steps)"]
    labels = [line.get_label() for line in figure.axes[1].get_lines()]
    assert labels == ["safefactor, float32 nearest", "safefactor, bfloat16 stochastic"]
  finally:
    plt.close(figure)


def _ink(figure, axis, color) -> int:
  """How many pixels of ``axis``, as drawn, are ``color`` (or nearly: lines are antialiased)."""
  from matplotlib.colors import to_rgb

  figure.canvas.draw()
  image = np.asarray(figure.canvas.buffer_rgba())[..., :3].astype(int)
  left, bottom, right, top = axis.get_window_extent().extents
  height = image.shape[0]
  panel = image[int(height - top):int(height - bottom), int(left):int(right)]
  return int((np.abs(panel - np.array(to_rgb(color)) * 255).max(axis=-1) < 40).sum())


@pytest.mark.parametrize("steps", [60, 150])
def test_curves_that_lie_on_each_other_all_show(steps):
  # The write-back panel of a default run: stochastic rounding and Kahan within 1% of float32
  # params, optax's bfloat16 curve on safefactor's round-to-nearest. Each curve was drawn
  # narrower than the one before it, and stochastic rounding (under Kahan, over float32)
  # kept a fifth of its pixels.
  import matplotlib.pyplot as plt

  base = 3 + np.exp(-np.arange(steps) / 30)
  runs = [("safefactor", "float32", "nearest", 0.0), ("safefactor", "bfloat16", "nearest", 0.5),
          ("safefactor", "bfloat16", "stochastic", 0.02),
          ("safefactor", "bfloat16", "kahan", 0.021),
          ("optax.adafactor", "bfloat16", "nearest", 0.5)]
  results = [demo.RunResult(name, dtype, list(base + offset), 0, None, 1024, 1.0,
                            rounding=rounding, learning_rate=1e-3, comparison="rounding")
             for name, dtype, rounding, offset in runs]
  figure = demo.loss_figure(results)
  try:
    (axis,) = figure.axes
    axis.get_legend().set_visible(False)  # its own samples of each colour
    lines = axis.get_lines()
    assert len(lines) == 5 and len({line.get_color() for line in lines}) == 5
    shown = [_ink(figure, axis, line.get_color()) for line in lines]
    for line in lines:
      line.set_visible(False)
    for line, pixels in zip(lines, shown, strict=True):
      line.set_visible(True)
      alone = _ink(figure, axis, line.get_color())
      line.set_visible(False)
      # Most of what the curve draws alone still shows among the others.
      assert pixels > alone / 2, (line.get_label(), pixels, alone)
  finally:
    plt.close(figure)


def test_four_panels_read_at_the_sites_width():
  # The site shows the figure about 800 px wide; it was one row of four panels there, its
  # legends 4 px high.
  import matplotlib.pyplot as plt
  from matplotlib.text import Text

  same = dict(learning_rate=1e-3)
  results = [_result(name, dtype, 30) for dtype in ("float16", "bfloat16")
             for name in ("safefactor", "optax.adafactor")]
  results += [_result("safefactor", "bfloat16", 30, rounding="kahan", comparison="rounding",
                      **same),
              _result("safefactor", "float32", demo.SPIKE_AT + 20, comparison="spike", **same)]
  figure = demo.loss_figure(results)
  try:
    figure.canvas.draw()
    corners = {(round(axis.get_position().x0, 2), round(axis.get_position().y0, 2))
               for axis in figure.axes}
    assert len(figure.axes) == 4 and len({x for x, _ in corners}) == 2
    assert len({y for _, y in corners}) == 2  # two rows of two
    pixels_per_point = 800 / (72 * figure.get_figwidth())
    texts = [t for t in figure.findobj(Text) if t.get_visible() and t.get_text().strip()]
    assert min(t.get_fontsize() for t in texts) * pixels_per_point >= 10
  finally:
    plt.close(figure)


def test_an_odd_panel_out_leaves_an_empty_cell():
  import matplotlib.pyplot as plt

  results = [_result(name, dtype, 5) for dtype in ("float16", "bfloat16")
             for name in ("safefactor", "optax.adafactor")]
  results.append(_result("safefactor", "bfloat16", 30, rounding="kahan",
                         learning_rate=1e-3, comparison="rounding"))
  figure = demo.loss_figure(results)
  try:
    assert [axis.get_title() for axis in figure.axes] == [
        "params in float16, lr 0.01", "params in bfloat16, lr 0.01",
        "write-back at lr 0.001 (mean of 15 steps)"]
  finally:
    plt.close(figure)


def test_spike_panel_marks_the_spike_and_names_the_skip():
  import matplotlib.pyplot as plt

  same = dict(learning_rate=1e-3, comparison="spike")
  steps = demo.SPIKE_AT + 20
  results = [_result("optax.adafactor", "float32", steps, **same),
             demo.RunResult("safefactor (skip_spikes=6)", "float32",
                            list(np.linspace(3.0, 2.0, steps)), 0, 1, 1024, 1.0, **same)]
  figure = demo.loss_figure(results)
  try:
    (axis,) = figure.axes
    assert axis.get_title() == ("a 50x gradient at step 100 (float32, lr 0.001)\n"
                                "(mean of 10 steps)")
    labels = [line.get_label() for line in axis.get_lines()]
    assert labels[:2] == ["optax.adafactor", "safefactor (skip_spikes=6) (1 step skipped)"]
    marks = [line for line in axis.get_lines() if line.get_label().startswith("_")]
    assert [list(line.get_xdata()) for line in marks] == [[demo.SPIKE_AT, demo.SPIKE_AT]]
  finally:
    plt.close(figure)


def test_a_spike_panel_of_a_run_that_ends_first_names_no_spike():
  # Its title named "a 50x gradient at step 100" for a run of 2 steps (no mark, no spike).
  import matplotlib.pyplot as plt

  same = dict(learning_rate=1e-3, comparison="spike")
  results = [_result("optax.adafactor", "float32", demo.SPIKE_AT, **same),
             _result("safefactor (skip_spikes=6)", "float32", demo.SPIKE_AT, **same)]
  figure = demo.loss_figure(results)
  try:
    (axis,) = figure.axes
    assert axis.get_title().startswith(
        "no spike: the run ends before step 100 (float32, lr 0.001)"), axis.get_title()
  finally:
    plt.close(figure)


def _visible(line) -> bool:
  """Whether a plotted curve shows: a marker on a finite point, or two finite points in a row."""
  finite = np.isfinite(np.asarray(line.get_ydata(), float))
  return bool(finite.any() and (line.get_marker() not in ("None", "", None)
                                or (finite[1:] & finite[:-1]).any()))


def test_short_runs_label_their_window_and_show_every_curve():
  import matplotlib.pyplot as plt

  nan = float("nan")
  # --steps 3: optax's float16 run has one finite step, and a run can have none at all.
  results = [_result("safefactor", "float16", 3),
             demo.RunResult("optax.adafactor", "float16", [3.0, nan, nan], 2, None, 1024, 1.0),
             _result("safefactor", "bfloat16", 3),
             demo.RunResult("optax.adafactor", "bfloat16", [nan] * 3, 3, None, 1024, 1.0)]
  assert "| mean loss, last 3 steps |" in demo.results_table(results)
  # --rounding-steps 6: shorter than the 20-step window.
  results += [_result("safefactor", dtype, 6, rounding=rounding, learning_rate=1e-3,
                      comparison="rounding")
              for dtype, rounding in [("float32", "nearest"), ("bfloat16", "kahan")]]
  table = demo.results_table(results).splitlines()
  assert "| mean loss, last 6 steps |" in table[0]
  assert "| 2.500 (all 3 steps) |" in table[2] and "| 2.500 | 0 / 6 |" in table[-1]
  figure = demo.loss_figure(results)
  try:
    figure.canvas.draw()
    titles = [axis.get_title() for axis in figure.axes]
    assert titles == ["params in float16, lr 0.01", "params in bfloat16, lr 0.01",
                      "write-back at lr 0.001 (mean of 3 steps)"]
    for axis in figure.axes:
      curves = [line for line in axis.get_lines() if not line.get_label().startswith("_")]
      for line in curves:  # every curve in the legend shows, or its label says why not
        assert _visible(line) or line.get_label().endswith("(all non-finite)"), line.get_label()
      ticks = [t for t in axis.get_xticks() if axis.get_xlim()[0] <= t <= axis.get_xlim()[1]]
      assert len(ticks) > 1 and all(float(t).is_integer() for t in ticks), ticks
    labels = [line.get_label() for line in figure.axes[1].get_lines()]
    assert "optax.adafactor (all non-finite)" in labels
    assert _visible(next(line for line in figure.axes[0].get_lines()
                         if line.get_label() == "optax.adafactor"))
    # The running mean keeps a curve, not one point per run.
    assert [len(line.get_xdata()) for line in figure.axes[2].get_lines()] == [4, 4]
  finally:
    plt.close(figure)


def _default_run_progress(stream) -> int:
  """What the default run reports: each run's name, then its steps one by one; their total."""
  args = demo.parse_args([])
  runs = [args.steps] * 4 + [args.rounding_steps] * 5 + [args.spike_steps] * 2
  with demo.progress_bar(sum(runs), stream) as progress:
    for index, steps in enumerate(runs):
      progress.set_description(f"run {index}")
      for _ in range(steps):
        progress.update(1)
  return sum(runs)


class _Terminal(io.StringIO):
  def isatty(self) -> bool:
    return True


def test_progress_in_a_log_is_a_line_per_run():
  # tqdm's carriage-return updates made a default run's log one line of 200 KB.
  log = io.StringIO()
  total = _default_run_progress(log)
  lines = log.getvalue().splitlines()
  assert "\r" not in log.getvalue() and len(lines) == 12  # eleven runs, then the end
  assert all(len(line) < 80 for line in lines), lines
  assert re.fullmatch(rf"0/{total} steps, \d+ s: run 0", lines[0]), lines[0]
  assert re.fullmatch(rf"{total}/{total} steps, \d+ s: done", lines[-1]), lines[-1]


def test_progress_on_a_terminal_is_a_bar():
  terminal = _Terminal()
  _default_run_progress(terminal)
  assert "\r" in terminal.getvalue() and "it/s" not in terminal.getvalue()
  assert "step/s" in terminal.getvalue() or "s/step" in terminal.getvalue()


def test_runs_of_one_dtype_share_the_compiled_gradient():
  # Compiling is most of a default run's time, and the gradient most of what each run
  # compiles: two runs with bfloat16 params compile it once.
  import jax.numpy as jnp

  loss_and_grads = demo._jitted(demo._loss_and_grads)
  tokens, factor = jnp.zeros((2, 9), jnp.int32), jnp.float32(1.0)
  compiled = loss_and_grads.jitted_fn._cache_size()
  for seed, dtype in enumerate(["bfloat16", "bfloat16", "float32"]):
    loss_and_grads(demo._build_model(8, jnp.dtype(dtype), seed), tokens, factor)
  assert loss_and_grads.jitted_fn._cache_size() - compiled == 2


MODULES = ["demo", *SUBCOMMANDS.values()]


@pytest.mark.parametrize("module", MODULES)
def test_help_prints_every_option_as_written(module):
  # argparse treats a help string as a %-format: a bare "18% above" once printed the option's
  # whole attribute dict in the middle of --help.
  parser = importlib.import_module(f"optax_safefactor.benchmarks.{module}").build_parser()
  # Compared without whitespace: argparse rewraps the text, and may break at a hyphen.
  rendered = "".join(parser.format_help().split())
  for action in parser._actions:
    assert action.help, f"{action.option_strings} has no help"
    # The %-expansion argparse applies must leave the text as written ("%%" prints "%").
    written = action.help.replace("%%", "%")
    assert action.help % dict(vars(action), prog=parser.prog) == written, action.option_strings
    assert "".join(written.split()) in rendered, action.option_strings


def _help(*command, cwd):
  return subprocess.run(
      [sys.executable, "-m", *command, "--help"], cwd=cwd,
      env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("module", MODULES)
def test_every_entry_point_runs_as_a_module(module, tmp_path):
  # `python -m optax_safefactor.bench` (and .demo) once printed nothing and exited 0.
  result = _help(f"optax_safefactor.benchmarks.{module}", cwd=tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith("usage: python -m optax_safefactor"), result.stdout[:200]


@pytest.mark.parametrize("subcommand", sorted(SUBCOMMANDS))
def test_every_subcommand_answers_its_own_help(subcommand, tmp_path):
  # Not the demo's help: the subcommand's parser, under the name that runs it.
  result = _help("optax_safefactor", subcommand, cwd=tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith(f"usage: python -m optax_safefactor {subcommand} ")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_dtype_starts_from_the_float32_models_weights(dtype):
  # flax's initialisers draw in the param dtype: the bfloat16 model had other weights
  # (4 standard deviations apart at most) than the float32 one it is compared with.
  import jax
  import jax.numpy as jnp
  from flax import nnx

  wide = nnx.state(demo._build_model(8, jnp.float32, 3), nnx.Param)
  narrow = nnx.state(demo._build_model(8, jnp.dtype(dtype), 3), nnx.Param)
  for w, n in zip(jax.tree.leaves(wide), jax.tree.leaves(narrow), strict=True):
    assert n.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(n), np.asarray(w.astype(dtype)))
