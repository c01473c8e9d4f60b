"""The benchmark runs end to end (tiny scale) and reports every figure it promises."""

import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp

from optax_safefactor.bench import minimum_traffic_bytes


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
    for key in ("step_ratio", "compile_ratio", "temp_bytes", "state_bytes", "roofline_fraction",
                "bandwidth_fraction"):
      assert row[key] is not None and row[key] >= 0
    if row["optimizer"].startswith("safefactor"):
      # The state is the theoretical minimum: float32 rows and columns, nothing else.
      assert row["state_bytes"] <= row["state_minimum_bytes"] + 64 * row["leaves"]


def test_minimum_traffic_counts_passes_over_each_array():
  factored, unfactored = jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((100,), jnp.bfloat16)
  # Factored: gradient read 3 times, parameter read twice and written once (2 bytes each).
  assert minimum_traffic_bytes({"w": factored}, momentum=False) == 6 * 2 * 256 * 128
  # Unfactored: 2 gradient reads, float32 statistic read, written and read, 3 param passes.
  assert minimum_traffic_bytes({"b": unfactored}, momentum=False) == (2 + 3) * 2 * 100 + 3 * 4 * 100
  # Momentum (float32) is read and written once.
  assert minimum_traffic_bytes({"w": factored}, momentum=True) == (6 * 2 + 2 * 4) * 256 * 128
