"""The benchmark runs end to end (tiny scale) and reports every figure it promises."""

import json
import os
import pathlib
import subprocess
import sys


def test_bench_runs_and_writes_json(tmp_path):
  out = tmp_path / "bench.json"
  result = subprocess.run(
      [sys.executable, "-m", "optax_safefactor", "bench", "--trees", "gpt2-small",
       "--dtypes", "float32", "--scale", "0.05", "--repetitions", "1", "--json", str(out)],
      cwd=tmp_path, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
      timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith("| tree | dtype | config | optimizer | step | compile")
  rows = json.loads(pathlib.Path(out).read_text())
  assert {(r["optimizer"], r["config"]) for r in rows} == {
      (name, config) for name in ("optax.adafactor", "safefactor", "safefactor, guard off")
      for config in ("default", "momentum")}
  for row in rows:
    for key in ("step_ratio", "compile_ratio", "temp_bytes", "state_bytes", "roofline_fraction"):
      assert row[key] is not None and row[key] >= 0
    if row["optimizer"].startswith("safefactor"):
      # The state is the theoretical minimum: float32 rows and columns, nothing else.
      assert row["state_bytes"] <= row["state_minimum_bytes"] + 64 * row["leaves"]
