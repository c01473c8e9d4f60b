"""docs/benchmarks.md is the record; the README's Performance section and the guide quote it.

Every table of the record sits under a heading that says when and where its figures come
from (a date, and the CPU or GPU they were measured on or the accelerator they were compiled
for); a current table (above "History") also gives jax's and optax's versions and the command
that reproduces it, and a table kept as history says that it is superseded. Every paragraph or
table row of the README's Performance section or of the performance guide that quotes a
figure names where it comes from, and each figure it quotes is one of a current table of
that place, with the same unit: a range of the text's own, a figure that a later measurement
superseded, or a CPU figure quoted for a TPU fails here.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
GUIDE = ROOT / "docs" / "guides" / "performance.md"
README = ROOT / "README.md"
HISTORY = "\n## History\n"

DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# Where a figure comes from, as a table's heading names it: the CPU that measured it, or the
# accelerator it was compiled for; and the words a quoting paragraph may name it by.
PLACES = {"2-core AMD EPYC CPU": ("CPU",), "TPU v5e": ("TPU",), "H100": ("H100", "GPU"),
          "NVIDIA H200": ("H200",)}
VERSIONS = (re.compile(r"\bjax(?: and jaxlib)?\s+\d+\.\d+\.\d+"),
            re.compile(r"\boptax\s+\d+\.\d+\.\d+"))
COMMAND = re.compile(r"`[^`]*\bpython [^`]+`")
# A figure: a decimal number and its unit, if any. Not a version (0.10.2): the number may not
# run on into another dot and digit.
FIGURE = re.compile(r"(?<![\w.])(\d+\.\d+)(?!\d|\.\d)(?:\s?(x|s|ms|MB|GB|KB|%)(?![\w]))?")
# A cell of spreads, "0.18 / 0.27 / 0.39x": its unit belongs to each of its numbers.
SPREAD = re.compile(r"^\d+(?:\.\d+)?(?: / \d+(?:\.\d+)?)+(x|%)$")


def figures(text: str) -> set[tuple[str, str]]:
  return {(number, unit or "") for number, unit in FIGURE.findall(text)}


def cell_figures(cell: str) -> set[tuple[str, str]]:
  spread = SPREAD.match(cell)
  if spread:
    return {(number, spread[1]) for number in re.findall(r"\d+\.\d+", cell)}
  return figures(cell)


def prose(text: str) -> str:
  """``text`` without its fenced blocks, inline code and link targets: what a reader reads."""
  text = re.sub(r"^(`{3,}).*?^\1[ \t]*$", "", text, flags=re.MULTILINE | re.DOTALL)
  text = re.sub(r"`[^`\n]*`", "", text)
  return re.sub(r"\]\([^)]*\)", "]", text)


def tables(text: str) -> list[dict]:
  """Each markdown table of ``text``: its heading, the text from that heading to it, its rows."""
  found, heading, since, rows = [], "", [], []
  for line in [*text.splitlines(), ""]:
    if line.startswith("|"):
      rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
      continue
    if rows:
      found.append({"heading": heading, "caption": "\n".join(since), "rows": rows})
      since, rows = [*since, "(table)"], []
    if line.startswith("#"):
      heading, since = line, []
    else:
      since.append(line)
  return found


def record(text: str) -> tuple[list[dict], list[dict]]:
  """The tables above "History" (current) and below it (superseded)."""
  current, _, history = text.partition(HISTORY)
  return tables(current), tables(history)


def current_figures(text: str) -> dict[str, set[tuple[str, str]]]:
  """Per place, the figures of the current tables whose heading names it."""
  found = {place: set() for place in PLACES}
  for table in record(text)[0]:
    for place in PLACES:
      if place in table["heading"]:
        found[place] |= {figure for row in table["rows"][2:] for cell in row
                         for figure in cell_figures(cell)}
  return found


def places_named(text: str) -> set[str]:
  return {place for place, words in PLACES.items() if any(word in text for word in words)}


def quotes(text: str) -> list[tuple[str, set[str]]]:
  """Each paragraph or table row of ``text`` that quotes a figure, with the places it names.

  A table row that names none takes those of the paragraph that introduces its table.
  """
  found = []
  blocks = re.split(r"\n\s*\n", prose(text))
  for index, block in enumerate(blocks):
    if not block.lstrip().startswith("|"):
      found.append((block, places_named(block)))
      continue
    introduction = places_named(blocks[index - 1]) if index else set()
    for row in block.strip().splitlines()[2:]:
      found.append((row, places_named(row) or introduction))
  return [(quote, places) for quote, places in found if figures(quote)]


def performance_section(readme: str) -> str:
  return readme.split("\n## Performance\n", 1)[1].split("\n## ", 1)[0]


def quoting_text() -> dict[str, str]:
  return {"README.md, Performance": performance_section(README.read_text()),
          "docs/guides/performance.md": GUIDE.read_text()}


def test_every_table_says_when_and_where():
  current, history = record(BENCHMARKS.read_text())
  assert len(current) >= 8 and len(history) >= 10
  for table in current + history:
    heading = table["heading"]
    assert DATE.search(heading), f"no date in {heading!r}"
    assert places_named(heading) and any(place in heading for place in PLACES), (
        f"no machine or target in {heading!r}")
  for table in history:
    assert "superseded" in table["heading"], table["heading"]


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("**/*.md"))],
                         ids=lambda page: str(page.relative_to(ROOT)))
def test_every_table_renders_as_one(page):
  # A header row without its |---| row under it renders as a paragraph of pipes (three
  # H200 tables did, on the site and on GitHub).
  text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
  broken = [table["rows"][0] for table in tables(text)
            if len(table["rows"]) < 2 or set("".join(table["rows"][1])) - set("-: ")]
  assert not broken, broken


def test_every_current_table_says_its_versions_and_command():
  for table in record(BENCHMARKS.read_text())[0]:
    caption = table["caption"]
    assert all(version.search(caption) for version in VERSIONS), table["heading"]
    assert COMMAND.search(caption), f"no command under {table['heading']!r}"


@pytest.mark.parametrize("name", sorted(quoting_text()))
def test_every_figure_quoted_is_in_a_current_table_of_the_place_it_names(name):
  recorded = current_figures(BENCHMARKS.read_text())
  found = quotes(quoting_text()[name])
  assert found, name
  problems = []
  for quote, places in found:
    tabled = set().union(*(recorded[place] for place in places))
    missing = sorted(figures(quote) - tabled, key=lambda figure: float(figure[0]))
    if not places:
      problems.append(f"names no machine or target: {quote.strip()[:200]}")
    elif missing:
      problems.append(
          f"{', '.join(number + unit for number, unit in missing)} in no current table for "
          f"{' or '.join(sorted(places))}: {quote.strip()[:200]}")
  assert not problems, f"{name}:\n" + "\n".join(problems)


def test_figures_are_read_as_written():
  assert figures("0.27x to 0.48x, 3.56 MB, 23.6 s (1.80x), jax 0.10.2") == {
      ("0.27", "x"), ("0.48", "x"), ("3.56", "MB"), ("23.6", "s"), ("1.80", "x")}
  assert cell_figures("0.18 / 0.27 / 0.39x") == {("0.18", "x"), ("0.27", "x"), ("0.39", "x")}
  assert figures(prose("`p - 0.1 * g` moves 3.00\n```text\n1.00\n```\n")) == {("3.00", "")}
