"""The benchmark runs end to end (tiny scale) and reports every figure it promises."""

import argparse
import ast
import gc
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

from optax_safefactor.benchmarks import (
    accumulate,
    bench,
    common,
    compiled,
    rounding,
    targets,
    trees,
)
from optax_safefactor.benchmarks.bench import minimum_traffic_bytes
from optax_safefactor.benchmarks.compiled import markdown_rows, median_of_processes

# The help's small run: 7 leaves compile fast, and at this scale the layers are factored
# and the norms are not, so both kinds of leaf are measured.
SMALL_RUN = ["--trees", "scanned-24", "--dtypes", "float32", "--scale", "0.2",
             "--repetitions", "3"]


def _bench(*args, cwd):
  return subprocess.run(
      [sys.executable, "-m", "optax_safefactor", "bench", *args], cwd=cwd,
      env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=600)


def test_an_accelerator_target_without_its_compiler_is_one_clear_line(tmp_path):
  if targets.missing_compiler(targets.TARGETS["tpu-v5e"]) is None:
    pytest.skip("libtpu is installed: tests/test_accelerators.py compiles for it")
  result = _bench("--target", "tpu-v5e", cwd=tmp_path)
  assert result.returncode == 2 and result.stdout == ""
  assert result.stderr.strip().splitlines() == [
      "python -m optax_safefactor bench: error: cannot compile for tpu-v5e: libtpu is not "
      "installed: pip install 'optax-safefactor[accel]'"]


def test_configs_belong_to_an_accelerator_target(tmp_path):
  result = _bench("--configs", "default", cwd=tmp_path)
  assert result.returncode == 2
  assert "--configs is for an accelerator --target" in result.stderr


def test_processes_belong_to_an_accelerator_target(tmp_path):
  result = _bench("--processes", "3", cwd=tmp_path)
  assert result.returncode == 2
  assert "--processes is for an accelerator --target" in result.stderr


def test_repetitions_belong_to_the_cpu(tmp_path):
  # They were ignored for an accelerator target, which compiles each step once.
  result = _bench("--target", "tpu-v5e", "--repetitions", "3", cwd=tmp_path)
  assert result.returncode == 2
  assert "--repetitions is for the CPU" in result.stderr


def test_processes_combine_into_medians_of_one_program():
  row = {"config": "default", "optimizer": "safefactor", "passes": 5.9, "temp": 0.01,
         "fusions": 9}
  optax_row = dict(row, optimizer="optax.adafactor", passes=5.8)
  runs = [[dict(optax_row, compile_s=o, compile_ratio=1.0),
           dict(row, compile_s=s, compile_ratio=s / o)]
          for o, s in ((4.0, 6.0), (5.0, 5.0), (2.0, 4.0), (3.0, 3.3))]
  combined = median_of_processes(runs)
  assert [r["optimizer"] for r in combined] == ["optax.adafactor", "safefactor"]
  assert combined[0]["compile_s"] == 3.5 and combined[0]["compile_ratio"] == 1.0
  # The ratio is the median of each process's own ratio (1.5, 1.0, 2.0, 1.1), not the
  # ratio of the medians (4.5 / 3.5).
  assert combined[1]["compile_s"] == pytest.approx(4.5)
  assert combined[1]["compile_ratio"] == pytest.approx(1.3)
  assert combined[1]["compile_runs"] == [6.0, 5.0, 4.0, 3.3]
  assert combined[1]["compile_ratio_runs"] == pytest.approx([1.5, 1.0, 2.0, 1.1])
  assert combined[1]["passes"] == 5.9 and runs[0][1]["compile_s"] == 6.0  # runs unchanged
  # A process that compiled the steps in another order: its rows are matched by step.
  swapped = [runs[0], *[list(reversed(run)) for run in runs[1:]]]
  assert median_of_processes(swapped) == combined
  assert "(1.30x; 1.00x-2.00x) |" in markdown_rows([dict(
      combined[1], target="tpu-v5e", tree="1b-slice", dtype="float32", params=1e6,
      leaves=3, passes_ratio=1.0, floors={"adafactor": 6.0, "guarded": 6.0},
      control_flow=False)])
  with pytest.raises(ValueError, match="the processes compiled 1 and 2 steps"):
    median_of_processes([runs[0], runs[1][:1]])
  with pytest.raises(ValueError, match="default / safefactor: not compiled by every process"):
    median_of_processes([runs[0], [runs[1][0], dict(runs[1][1], config="kahan")]])
  runs[2][1]["fusions"] = 10
  with pytest.raises(ValueError, match="default / safefactor: fusions differs between "
                                       "processes"):
    median_of_processes(runs)


def test_each_process_starts_at_another_configuration(monkeypatch):
  # A step's compile time depends on what its process compiled before it: the processes
  # take turns at compiling each configuration first.
  orders = []

  def run(command, check, stdout):
    configs = command[command.index("--configs") + 1:command.index("--json")]
    orders.append(configs)
    rows = [{"config": config, "optimizer": "safefactor", "passes": 5.0, "temp": 0.0,
             "fusions": 9, "compile_s": 1.0 + len(orders), "compile_ratio": 1.0}
            for config in configs]
    pathlib.Path(command[command.index("--json") + 1]).write_text(json.dumps(rows))

  monkeypatch.setattr(bench.subprocess, "run", run)
  configs = ["default", "stochastic", "kahan"]
  runs = [bench._measured_in_a_new_process(targets.TARGETS["tpu-v5e"], "1b-slice", "bfloat16",
                                           1.0, configs, process) for process in range(4)]
  assert orders == [configs, ["stochastic", "kahan", "default"],
                    ["kahan", "default", "stochastic"], configs]
  combined = median_of_processes(runs)
  assert [row["config"] for row in combined] == configs
  assert [row["compile_runs"] for row in combined] == [[2.0, 3.0, 4.0, 5.0]] * 3


@pytest.mark.parametrize("failure", ["a process fails", "two processes disagree"])
def test_a_failed_process_is_one_clear_line(monkeypatch, capsys, failure):
  # Each process is a whole compile; what went wrong ends the run as one line, not a
  # traceback, naming the tree, the dtype and the target.
  row = {"config": "default", "optimizer": "safefactor", "passes": 5.9, "temp": 0.0,
         "fusions": 9, "compile_s": 1.0, "compile_ratio": 1.0}
  runs = iter([[row], [dict(row, fusions=10)]])

  def measured(target, tree, dtype, scale, configs, process):
    if failure == "a process fails" and process == 1:
      raise subprocess.CalledProcessError(1, ["python"])
    return next(runs)

  monkeypatch.setattr(targets, "missing_compiler", lambda target: None)
  monkeypatch.setattr(bench, "_measured_in_a_new_process", measured)
  status = bench.main(["--target", "tpu-v5e", "--trees", "1b-slice", "--dtypes", "bfloat16",
                       "--processes", "2"])
  assert status == 2
  error = capsys.readouterr().err.strip().splitlines()[-1]
  prefix = "python -m optax_safefactor bench: error: "
  if failure == "a process fails":
    assert error == (prefix + "a process compiling 1b-slice / bfloat16 for tpu-v5e failed "
                     "(exit status 1; its error is printed above); the rows above were "
                     "measured")
  else:
    assert error == (prefix + "1b-slice / bfloat16: default / safefactor: fusions differs "
                     "between processes (9 and 10): not one program")


def test_bench_runs_and_writes_json(tmp_path):
  out = tmp_path / "new" / "bench.json"  # a missing folder is created
  result = _bench(*SMALL_RUN, "--json", str(out), cwd=tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith(
      "| tree | dtype | config | optimizer | step (min / median / max) | compile")
  rows = json.loads(pathlib.Path(out).read_text())
  assert {(r["optimizer"], r["config"]) for r in rows} == {
      (name, config) for name in ("optax.adafactor", "safefactor", "safefactor, guard off",
                                  "safefactor, unpacked", "safefactor, spikes")
      for config in ("default", "momentum")}
  for row in rows:
    # On a GPU or TPU host these are that device's times: the rows say which ran them.
    assert (row["backend"], row["device"]) == ("cpu", jax.devices()[0].device_kind)
    for key in ("step_ratio", "compile_ratio", "temp_bytes", "state_bytes", "roofline_fraction",
                "bandwidth_fraction"):
      assert row[key] is not None and row[key] >= 0
    # Each timed figure comes with its spread over the rounds, and the rounds themselves.
    assert len(row["step_s_rounds"]) == len(row["copy_s_rounds"]) == row["repetitions"] == 3
    for key in ("step_ratio", "roofline_fraction", "bandwidth_fraction"):
      # The median and its range are computed in different orders, so where the median's
      # round is the extreme one they can differ in the last bit (seen: 0.3981043713406981
      # against 0.39810437134069804).
      low, high = row[f"{key}_min"] * (1 - 1e-12), row[f"{key}_max"] * (1 + 1e-12)
      assert 0 < low <= row[key] <= high, (key, row)
    assert 0 < row["factored_leaves"] < row["leaves"]  # both kinds of leaf are measured
    if row["optimizer"] == "optax.adafactor":
      assert row["step_ratio_min"] == row["step_ratio_max"] == 1
    if row["optimizer"].startswith("safefactor"):
      # The state is the theoretical minimum: float32 rows and columns, nothing else.
      # With spike skipping, plus its history: two float32 rings of 128 steps and scalars.
      spikes = 2 * 4 * 128 + 64 if row["optimizer"] == "safefactor, spikes" else 0
      assert row["state_bytes"] <= row["state_minimum_bytes"] + 64 * row["leaves"] + spikes
  # The legend follows the table and explains every column, with units and bounds.
  table, legend = result.stdout.split("\n\n", 1)
  header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
  assert len(table.splitlines()) == 2 + len(rows)
  for column in header:
    name = column.removesuffix(" (min / median / max)")
    assert f"\n  {name}  " in legend, name
  words = " ".join(legend.split())
  assert "min / median / max" in words and "in percent" in words
  assert "it can exceed 100%: the traffic counts every pass" in words


def test_bench_json_path_checked_before_measuring(tmp_path):
  result = _bench(*SMALL_RUN, "--json", "/proc/x/bench.json", cwd=tmp_path)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      "python -m optax_safefactor bench: error: cannot write --json /proc/x/bench.json: "
      "No such file or directory"]
  assert result.stdout == ""


def test_bench_help_documents_every_option_and_duration(tmp_path):
  parser = bench.build_parser()
  actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
  assert {o for a in actions for o in a.option_strings} == {
      "--trees", "--dtypes", "--scale", "--repetitions", "--target", "--configs", "--processes",
      "--json"}
  assert all(a.help and len(a.help) > 20 for a in actions)
  result = _bench("--help", cwd=tmp_path)
  assert result.returncode == 0
  text = " ".join(result.stdout.split())
  for tree in trees.TREES:
    assert tree in text
  assert "A full run (the defaults) takes about" in text and "minutes" in text
  assert f"a small one ({' '.join(SMALL_RUN)}) about" in text


def test_legend_notes_what_makes_a_run_hard_to_read():
  row = {"tree": "vit-b16", "repetitions": 1, "bandwidth_fraction": 1.1, "factored_leaves": 0}
  text = " ".join(bench.legend([row]).split())
  assert "fewer than 3 repetitions" in text and "1 row above 100% bandwidth" in text
  assert "no leaf of vit-b16 is factored" in text
  row = {"tree": "vit-b16", "repetitions": 5, "bandwidth_fraction": 0.9, "factored_leaves": 50}
  assert "Note" not in bench.legend([row])
  rows = [{**row, "bandwidth_fraction": 1.1}] * 2
  assert "2 rows above 100% bandwidth" in " ".join(bench.legend(rows).split())


def test_the_compiled_legend_notes_trees_with_no_factored_leaf():
  # The accelerator rows printed no such note: a run at a small --scale compiled a
  # different step (full-size second moments) than the one its table seemed to show.
  rows = [{"tree": "scanned-24", "factored_leaves": 0}, {"tree": "gpt2-small",
                                                         "factored_leaves": 50}]
  text = " ".join(compiled.legend(rows).split())
  assert "Note: no leaf of scanned-24 is factored at this --scale" in text
  assert "gpt2-small" not in text
  assert compiled.legend(rows[1:]) == compiled.LEGEND


def test_json_under_a_file_names_the_file(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(bench, "measure", lambda *args: pytest.fail("measured"))
  (tmp_path / "afile").write_text("")
  out = tmp_path / "afile" / "bench.json"
  assert bench.main(["--json", str(out)]) == 2
  # "it exists" once read as bench.json; the folder that is a file is named.
  assert capsys.readouterr().err.strip().splitlines() == [
      f"python -m optax_safefactor bench: error: cannot write --json {out}: "
      f"{tmp_path / 'afile'} exists and is not a folder"]


BENCHMARKS = pathlib.Path(bench.__file__).parent


@pytest.mark.parametrize(
    "module", [*sorted(p.name for p in BENCHMARKS.glob("*.py")), "../__main__.py"])
def test_command_line_uses_only_the_public_api(module):
  # accumulate.py once measured a private variant of accumulate_gradients, which tied the
  # library's internals to a benchmark.
  source = (BENCHMARKS / module).read_text()
  imported = [node.module for node in ast.walk(ast.parse(source))
              if isinstance(node, ast.ImportFrom) and node.module]
  imported += [alias.name for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.Import) for alias in node.names]
  private = [name for name in imported if "._src" in name or name.endswith("_src")]
  if module == "targets.py":
    # XLA's cost analysis of a GPU program compiled without a GPU has no public entry point.
    private.remove("jax._src.lib")
  assert not private


def test_factoring_is_the_librarys_and_follows_optax():
  # The benchmark once kept a copy of the factoring rule; it now asks safefactor's init.
  params = {"a": jnp.zeros((300, 200)), "b": jnp.zeros((4, 300, 200)),
            "c": jnp.zeros((300, 100)), "d": jnp.zeros((1024,))}
  assert bench.is_factored(params) == [True, True, False, False]
  # optax keeps a (1,)-shaped placeholder for the full statistic of a leaf it factors.
  full = jax.tree.leaves(optax.scale_by_factored_rms().init(params).v)
  assert bench.is_factored(params) == [v.shape == (1,) for v in full]
  # Rows drop the largest axis, columns the second largest; the unfactored leaf is whole.
  params = {"w": jnp.zeros((4, 300, 200)), "b": jnp.zeros((300, 100))}
  assert bench.minimum_state_bytes(params, momentum=False) == (
      64 + 4 * (4 * 300 + 4 * 200) + 4 * 300 * 100)


def test_minimum_traffic_counts_passes_over_each_array():
  factored, unfactored = jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((100,), jnp.bfloat16)
  # Factored: gradient read 3 times, parameter read twice and written once (2 bytes each).
  assert minimum_traffic_bytes({"w": factored}, momentum=False) == 6 * 2 * 256 * 128
  # Unfactored: 2 gradient reads, float32 statistic read, written and read, 3 param passes.
  assert minimum_traffic_bytes({"b": unfactored}, momentum=False) == (2 + 3) * 2 * 100 + 3 * 4 * 100
  # Momentum (float32) is read and written once.
  assert minimum_traffic_bytes({"w": factored}, momentum=True) == (6 * 2 + 2 * 4) * 256 * 128


def test_timed_calls_run_without_garbage_collection(monkeypatch):
  # A full collection of Python's cycle collector landed in the same timed call of every
  # run (the 600-leaf tree's third round of safefactor: 170 ms where the others took
  # 30 ms) and showed as a 4x max step ratio. It now runs before each round, not in it.
  enabled_at_each_clock_read = []
  clock = common.time.perf_counter

  def recording_clock():
    # The patch reaches every reader of time.perf_counter (JAX's own timers too): count
    # the reads of the benchmarks' compiling and timing helpers only.
    if sys._getframe(1).f_globals.get("__name__") == common.__name__:
      enabled_at_each_clock_read.append(gc.isenabled())
    return clock()

  monkeypatch.setattr(common.time, "perf_counter", recording_clock)
  # One of the two settings: every optimizer is still timed, in half the compile time.
  monkeypatch.setattr(bench, "CONFIGS", {"default": bench.CONFIGS["default"]})
  rows = bench.measure("scanned-24", "float32", 0.05, 2)
  assert gc.isenabled()
  # Each of 3 rounds reads the clock twice per optimizer and twice for the copy, with the
  # collector off; compiling reads it with the collector on.
  assert enabled_at_each_clock_read.count(False) == 3 * 2 * (len(rows) + 1)


@pytest.mark.parametrize("command", ["bench", "rounding", "accumulate"])
@pytest.mark.parametrize("flags,blamed,wanted", [
    (["--scale", "0"], "--scale", "must be in (0, 4], got 0"),
    (["--scale", "nan"], "--scale", "must be in (0, 4], got nan"),
    (["--scale", "5"], "--scale", "must be in (0, 4], got 5"),
    (["--repetitions", "0"], "--repetitions", "must be at least 1, got 0"),
    (["--repetitions", "two"], "--repetitions", "must be an integer at least 1, got two"),
])
def test_a_bad_flag_is_named_alone(command, flags, blamed, wanted, capsys):
  # Each flag's own error: `--scale 0` once blamed "--scale ... and --repetitions".
  module = {"bench": bench, "rounding": rounding, "accumulate": accumulate}[command]
  with pytest.raises(SystemExit) as exit_info:
    module.main(flags)
  assert exit_info.value.code == 2
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert f"argument {blamed}: {wanted}" in error, error
  other = {"--scale": "--repetitions", "--repetitions": "--scale"}[blamed]
  assert other not in error
