"""The README's code blocks run as written, each section's blocks in a fresh interpreter."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _sections() -> dict[str, list[str]]:
  sections = {}
  for section in re.split(r"\n## ", README.read_text())[1:]:
    title = section.split("\n", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    if blocks:
      sections[title] = blocks
  return sections


SECTIONS = _sections()


def _run(source: str) -> str:
  # A fresh interpreter, as a reader would run it: the sharding block must be able to
  # give JAX its 8 CPU devices before the backend starts.
  result = subprocess.run(
      [sys.executable, "-c", source], cwd=ROOT, capture_output=True, text=True, timeout=300,
      env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def test_every_python_block_is_tested():
  assert sum(len(blocks) for blocks in SECTIONS.values()) == len(
      re.findall(r"```python\n", README.read_text()))
  assert "Quickstart" in SECTIONS and len(SECTIONS) >= 7


@pytest.mark.parametrize("title", sorted(SECTIONS))
def test_section_runs_as_written(title):
  output = _run("\n".join(SECTIONS[title]))
  expected = {
      "Quickstart": "0",
      "Sharded training, several hosts, scanned layers": "('data', None)\n(4, 128, 1)",
      "Checkpoints": "SkipNonfiniteState",
      "A Flax NNX model on an Explicit mesh": "True 0\n(None, None) (None, 'model')",
      "Migrating a running `optax.adafactor` job": "(1, 128)",
      "Spikes": "1 1\nskipped 1 of 100 steps; 1 spike (last at step 80: gradient norm 2272 > "
                "limit 50.79, largest in params['w'])",
  }
  if title in expected:
    assert output.strip() == expected[title]


def test_the_printed_comments_are_true():
  # The blocks state their output in comments; check the ones with exact values.
  output = _run("\n".join(SECTIONS["Non-finite steps"][:1]).replace(
      "osf.check_nonfinite_steps(opt_state, max_consecutive=3)", ""))
  lines = output.strip().splitlines()
  assert lines[:2] == ["2", "2"]
  assert lines[2] == ("skipped 2 of 4 steps (0 in a row); "
                      "non-finite: params['b'] x2 (last at step 2)")
  low = _run(SECTIONS["Low-precision params"][0]).strip().splitlines()
  values = {line.split()[0]: float(line.split()[1]) for line in low}
  assert values["nearest"] == 1.0
  assert abs(values["stochastic"] - 1.1) < 0.02 and abs(values["kahan"] - 1.1) < 0.02


def test_exactly_two_setup_commands_and_ci_runs_the_test_one():
  commands = re.findall(r"```bash\n(.*?)\n```", README.read_text(), re.DOTALL)
  assert len(commands) == 2
  assert commands[0].endswith("python -m optax_safefactor")
  assert commands[1].endswith("pytest")
  ci = (ROOT / ".ci" / "run").read_text()
  assert commands[1] in ci
