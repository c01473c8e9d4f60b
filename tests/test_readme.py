"""The README's code blocks run as written, each section's blocks in a fresh interpreter."""

import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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
  assert "Quickstart" in SECTIONS


@pytest.mark.parametrize("title", sorted(SECTIONS))
def test_section_runs_as_written(title):
  output = _run("\n".join(SECTIONS[title]))
  # The sections that moved to docs/guides/ have their outputs checked by test_guides.py.
  expected = {"Quickstart": "0"}
  if title in expected:
    assert output.strip() == expected[title]


def test_links_into_the_docs_lead_to_files():
  # The README is also the site's front page (docs/index.md includes it), where these links
  # lead to the guides' pages; here they must name files that exist. A link into docs/ is
  # made relative to docs/index.md by the include; a notebook's (notebooks/N.ipynb) is read
  # from docs/index.md as is, and leads to the copy the site's build makes in docs/notebooks/.
  links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
  assert len(links) >= 8
  for link in links:
    assert (ROOT / link).is_file(), link
    assert link.startswith(("docs/", "notebooks/")) or link.endswith(".png"), link


def test_exactly_two_setup_commands_and_ci_runs_the_test_one():
  commands = re.findall(r"```bash\n(.*?)\n```", README.read_text(), re.DOTALL)
  assert len(commands) == 2
  assert commands[0].endswith("python -m optax_safefactor")
  assert commands[1].endswith("pytest")
  ci = (ROOT / ".ci" / "run").read_text()
  assert commands[1] in ci


def _installed_by(extras: dict[str, list[str]], extra: str) -> set[str]:
  """The distributions that ``pip install 'optax-safefactor[extra]'`` adds to the core's:
  the extra's requirements, with the extras of this package it names expanded."""
  names = set()
  for line in extras[extra]:
    requirement = Requirement(line)
    if canonicalize_name(requirement.name) == "optax-safefactor":
      for inner in requirement.extras:
        names |= _installed_by(extras, inner)
    else:
      names.add(canonicalize_name(requirement.name))
  return names


def test_the_extras_the_readme_lists_are_what_pyproject_installs():
  # The README once listed the demo extra as flax, matplotlib and tqdm: it installs the flax
  # extra, orbax-checkpoint with it.
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  extras = pyproject["project"]["optional-dependencies"]
  paragraph = next(p for p in README.read_text().split("\n\n") if p.startswith("Extras:"))
  # The extras written as a plain list of names: `name` (a, b, c).
  listed = dict(re.findall(r"`([\w-]+)` \(([\w-]+(?:, [\w-]+)*)\)", " ".join(paragraph.split())))
  assert {"flax", "demo"} <= listed.keys(), listed
  for extra, names in listed.items():
    assert {canonicalize_name(name) for name in names.split(", ")} == _installed_by(
        extras, extra), extra


def test_the_demo_table_is_a_default_runs():
  # Its steps are the defaults': a table left from before the defaults changed quotes a run
  # that `python -m optax_safefactor` no longer makes.
  from optax_safefactor.benchmarks import demo

  defaults = demo.parse_args([])
  table = README.read_text().split("| optimizer | params | write-back |", 1)[1]
  rows = [line.split(" | ") for line in table.split("\n\n", 1)[0].splitlines()[2:]]
  steps = [int(row[6].split(" / ")[1]) for row in rows]
  assert steps == ([defaults.steps] * 4 + [defaults.rounding_steps] * len(demo.ROUNDING_RUNS)
                   + [defaults.spike_steps] * 2)
