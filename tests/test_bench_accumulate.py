"""The accumulation benchmark: its command line, its checks, and what it measures."""

import jax
import pytest

from optax_safefactor.benchmarks import accumulate


def test_every_k_below_two_is_a_usage_error(capsys, monkeypatch):
  monkeypatch.setattr(accumulate, "measure", lambda *args: pytest.fail("measured"))
  with pytest.raises(SystemExit) as exit_info:
    accumulate.main(["--every-k", "1"])
  assert exit_info.value.code == 2
  assert "argument --every-k: must be at least 2, got 1" in capsys.readouterr().err
  # The help says so before a run does.
  assert "micro-batches per step, at least 2 (4)" in " ".join(
      accumulate.build_parser().format_help().split())


def test_one_repetition_is_one_group(capsys, monkeypatch):
  row = {"optimizer": "optax.MultiSteps", "tree": "scanned-24", "dtype": "float32",
         "every_k": 2, "params": 10**6, "leaves": 7, "accumulate_s": 1e-3, "step_s": 2e-3,
         "group_s": 1.5e-3, "temp_bytes": None, "compile_s": 1.0}
  monkeypatch.setattr(accumulate, "measure", lambda *args: [row])
  assert accumulate.main(["--repetitions", "1", "--every-k", "2"]) == 0
  captured = capsys.readouterr()
  assert "median of 1 group;" in captured.out  # once "1 groups"
  assert "device(s)" not in captured.err


def test_compares_the_public_accumulations_alone(capsys):
  # A tiny tree: seconds to compile. What is checked is the shape of the answer.
  with jax.numpy_dtype_promotion("standard"):  # MultiSteps mixes int and float counts
    rows = accumulate.measure("scanned-24", scale=0.05, every_k=2, repetitions=1)
  assert [row["optimizer"] for row in rows] == [
      "accumulate_gradients", "optax.MultiSteps", "safefactor alone"]
  by_name = {row["optimizer"]: row for row in rows}
  for key in ("accumulate_s", "step_s", "group_s", "compile_s"):
    assert by_name["optax.MultiSteps"][f"{key}_ratio"] == 1
    assert by_name["accumulate_gradients"][key] > 0
  # safefactor alone steps on every call: it has no accumulating micro-batch.
  alone = by_name["safefactor alone"]
  assert alone["accumulate_s"] != alone["accumulate_s"] and alone["step_s"] == alone["group_s"]
  table = accumulate.markdown(rows).splitlines()
  assert len(table) == 2 + len(rows)
  assert table[-1].startswith("| safefactor alone | n/a | ")
