"""The main job: ``python -m optax_safefactor`` runs, prints its table, writes its plot."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*args, cwd):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "optax_safefactor", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300)


def test_demo_prints_table_and_writes_plot(tmp_path):
  result = _run("--steps", "12", "--dtype", "float16", "--out", str(tmp_path / "out"),
                cwd=tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert lines[0].startswith("| optimizer | params | final loss")
  safe = next(line for line in lines if line.startswith("| safefactor | float16"))
  optax_row = next(line for line in lines if line.startswith("| optax.adafactor | float16"))
  assert "| 0 / 12 |" in safe and "nan" not in safe
  assert "nan" in optax_row  # the incumbent's float16 failure, shown side by side
  plot = tmp_path / "out" / "loss_curves.png"
  assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert f"plot: {plot}" in result.stdout
  assert "step" in result.stderr  # the progress bar


def test_bad_flag_is_a_usage_error(tmp_path):
  result = _run("--steps", "many", cwd=tmp_path)
  assert result.returncode == 2 and "usage:" in result.stderr
  result = _run("--frobnicate", cwd=tmp_path)
  assert result.returncode == 2 and "unrecognized arguments" in result.stderr


def test_help(tmp_path):
  result = _run("--help", cwd=tmp_path)
  assert result.returncode == 0 and "--dtype" in result.stdout and "--seed" in result.stdout
