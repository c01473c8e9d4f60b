"""The param_rounding benchmark runs end to end in its small mode and reports what it promises."""

import json

import jax
import pytest

from optax_safefactor.benchmarks import rounding


def test_small_run_reports_cost_and_memory(tmp_path, capsys):
  out = tmp_path / "new" / "rounding.json"  # a missing folder is created
  assert rounding.main(["--small", "--json", str(out)]) == 0
  printed = capsys.readouterr().out
  assert "| tree | config | mode | step (min / median / max)" in printed
  assert "| tree | optimizer and params | params | optimizer state |" in printed
  figures = json.loads(out.read_text())

  cost = {row["mode"]: row for row in figures["cost"]}
  assert set(cost) == set(rounding.MODES)
  n_params = cost["nearest"]["params"]
  for row in cost.values():
    # On a GPU or TPU host these are that device's times: the rows say which ran them.
    assert (row["backend"], row["device"]) == ("cpu", jax.devices()[0].device_kind)
    assert len(row["step_s_rounds"]) == row["repetitions"] == 2
    # Up to the last bit: the median ratio and the range are divided in different orders.
    low, high = row["step_ratio_min"] * (1 - 1e-12), row["step_ratio_max"] * (1 + 1e-12)
    assert 0 < low <= row["step_ratio"] <= high
    assert row["temp_bytes"] is not None and row["compile_s"] > 0
  assert cost["nearest"]["step_ratio_min"] == cost["nearest"]["step_ratio_max"] == 1
  # The state contract: no per-element state for stochastic rounding, exactly two
  # bytes per bfloat16 param for Kahan's compensation.
  assert cost["stochastic"]["state_bytes"] == cost["nearest"]["state_bytes"]
  assert cost["kahan"]["state_bytes"] - cost["nearest"]["state_bytes"] == 2 * n_params

  memory = {row["optimizer"]: row["total_bytes_per_param"] for row in figures["memory"]}
  # A few scalar counters on top of the per-element bytes.
  assert memory["AdamW, bfloat16 params + float32 master weights"] == pytest.approx(14, abs=1e-3)
  assert memory["AdamW, float32 params"] == pytest.approx(12, abs=1e-3)
  factored = memory["safefactor, bfloat16 params, nearest"] - 2  # the statistics, per param
  assert 0 < factored < 0.1
  assert memory["safefactor, bfloat16 params, stochastic"] == pytest.approx(2 + factored)
  assert memory["safefactor, bfloat16 params, kahan"] == pytest.approx(4 + factored)
  assert memory["safefactor, float32 params"] == pytest.approx(4 + factored)


def test_help_names_the_small_run(capsys):
  with pytest.raises(SystemExit) as exit_info:
    rounding.main(["--help"])
  assert exit_info.value.code == 0
  assert "--small runs --trees scanned-24" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("json_path", ["folder", "afile/rounding.json"])
def test_json_path_checked_before_measuring(json_path, tmp_path, capsys, monkeypatch):
  # An existing folder once ran the whole benchmark, then failed with IsADirectoryError.
  monkeypatch.setattr(rounding, "measure", lambda *args: pytest.fail("measured"))
  (tmp_path / "folder").mkdir()
  (tmp_path / "afile").write_text("")
  out = tmp_path / json_path
  assert rounding.main(["--small", "--json", str(out)]) == 2
  reason = "it is a folder" if json_path == "folder" else (
      f"{tmp_path / 'afile'} exists and is not a folder")
  # One line, as the step benchmark says it: the usage would add nothing.
  assert capsys.readouterr().err.strip().splitlines() == [
      f"python -m optax_safefactor bench-rounding: error: cannot write --json {out}: {reason}"]


def test_small_refuses_the_options_it_sets(monkeypatch, capsys):
  # --small overrode them: --small --trees gpt2-small measured scanned-24 without a word.
  monkeypatch.setattr(rounding, "measure", lambda *args: pytest.fail("measured"))
  assert rounding.main(["--small", "--trees", "gpt2-small", "--repetitions", "5"]) == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      "python -m optax_safefactor bench-rounding: error: --small sets --trees and "
      "--repetitions itself: give --small or those options, not both"]


def test_help_lists_trees_and_default_configs_plainly():
  text = " ".join(rounding.build_parser().format_help().split())
  assert ("any of 1b-slice, 600-leaves, gpt2-small, scanned-24, vit-b16 "
          "(gpt2-small scanned-24)") in text
  assert "momentum=0.9 in bfloat16 (both)" in text
  assert "['" not in text and "(default momentum)" not in text
