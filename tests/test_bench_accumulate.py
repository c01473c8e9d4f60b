"""The accumulation benchmark's command line: its checks and what it prints."""

import pytest

from optax_safefactor.benchmarks import accumulate


def test_every_k_below_two_is_a_usage_error(capsys, monkeypatch):
  monkeypatch.setattr(accumulate, "measure", lambda *args: pytest.fail("measured"))
  with pytest.raises(SystemExit) as exit_info:
    accumulate.main(["--every-k", "1"])
  assert exit_info.value.code == 2
  assert "--every-k at least 2" in capsys.readouterr().err.strip().splitlines()[-1]
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
