"""Every guide in docs/guides/ runs as written: its code blocks, in order, in a fresh interpreter.

The convention every page follows: each ```python fenced block runs, top to bottom, in one
fresh interpreter per page, with JAX on the CPU (a page that needs a mesh gives JAX its 8
CPU devices in its first block); a block that must not run is written ```{code-block}
python. A ```text block that directly follows a ```python block is that block's output, as
the reader sees it: it must match what the block prints (doctest's rules: ``...`` matches
anything, runs of whitespace are one), and a block that prints must be followed by one.
The pages are found by glob, so a new one is run without an edit here.
"""

import doctest
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
# A fenced block: its opening fence (3 or more backticks), its info string, its body.
FENCE = re.compile(r"^(?P<fence>`{3,})(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$",
                   re.MULTILINE | re.DOTALL)
# Between blocks: a line that marks the end of one block's output and names it.
MARK = "\x1e-- end of block {} --\x1e"
RUNNER = """
import json, sys
blocks = json.loads(sys.stdin.read())
for index, (path, line, source) in enumerate(blocks):
  # Padded so that a traceback names the page's own line numbers.
  exec(compile("\\n" * (line - 1) + source, path, "exec"), globals())
  print(MARK.format(index), flush=True)
""".replace("MARK", repr(MARK))


def blocks(path: pathlib.Path) -> list[dict]:
  """The page's ```python blocks, each with its first line and the ```text output after it."""
  text = path.read_text()
  found = list(FENCE.finditer(text))
  result = []
  for index, match in enumerate(found):
    if match["info"].strip() != "python":
      continue
    output = None
    following = found[index + 1] if index + 1 < len(found) else None
    if (following is not None and following["info"].strip() == "text"
        and not text[match.end():following.start()].strip()):
      output = following["body"]
    result.append({"line": text.count("\n", 0, match.start("body")) + 1,
                   "source": match["body"], "output": output})
  return result


def run_page(path: pathlib.Path) -> list[str]:
  """Runs the page's blocks in a fresh interpreter; returns what each block printed."""
  page_blocks = blocks(path)
  result = subprocess.run(
      [sys.executable, "-c", RUNNER], cwd=ROOT, capture_output=True, text=True, timeout=600,
      input=json.dumps([[str(path), block["line"], block["source"]] for block in page_blocks]),
      env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert result.returncode == 0, f"{path.name}:\n{result.stderr[-4000:]}"
  outputs = re.split(r"\x1e-- end of block \d+ --\x1e\n", result.stdout)
  assert len(outputs) == len(page_blocks) + 1 and outputs[-1] == "", result.stdout[-2000:]
  return outputs[:-1]


def test_the_guides_exist():
  names = {path.stem for path in GUIDES}
  assert {"from_optax", "low_precision", "nonfinite_and_spikes", "sharding", "checkpoints",
          "performance"} <= names


def test_blocks_finds_code_and_its_output(tmp_path):
  page = tmp_path / "page.md"
  page.write_text("# A page\n\n```python\nprint(1)\n```\n\n```text\n1\n```\n\n"
                  "```{code-block} python\nraise SystemExit\n```\n\n"
                  "````python\nx = 2\n````\nText.\n\n```text\nnot an output\n```\n")
  assert blocks(page) == [{"line": 4, "source": "print(1)\n", "output": "1\n"},
                          {"line": 16, "source": "x = 2\n", "output": None}]


@pytest.mark.parametrize("path", GUIDES, ids=lambda path: path.stem)
def test_guide_runs_as_written(path):
  page_blocks = blocks(path)
  assert page_blocks, f"{path.name} has no ```python block"
  outputs = run_page(path)
  checker = doctest.OutputChecker()
  flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
  for block, printed in zip(page_blocks, outputs, strict=True):
    assert block["output"] is not None or not printed, (
        f"{path.name}, the block at line {block['line']} printed\n{printed}\n"
        "but no ```text block follows it to show the reader what it prints")
    if block["output"] is not None:
      assert checker.check_output(block["output"], printed, flags), (
          f"{path.name}, the block at line {block['line']} printed\n{printed}\n"
          f"where the page shows\n{block['output']}")
