"""The performance guide's plots, drawn from the tables of docs/benchmarks.md.

Reads the current measurements of the 2-core CPU (the page's part of that name, above its
"History"; the guide shows these plots beside that machine's figures): the step table of
``python -m optax_safefactor bench`` (step time of safefactor and its variants against
``optax.adafactor``) and the write-back modes' table (each mode against ``"nearest"``), and
writes two PNGs into docs/guides/. Compile time is left out of the plot: the bench compiles
each step once, and the page's fresh-process pairs are its compile-time figures. Each PNG
carries the numbers it was drawn from in a text chunk (``Numbers``), so tests/test_docs.py
can check that the plots committed are those of the tables as they stand. Each title names
the heading of its table: the date and the machine.

    python tools/benchmark_plots.py
"""

from __future__ import annotations

import json
import pathlib
import re
import struct
import zlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
STEP_HEADER = "| tree | dtype | config | optimizer | step (min / median / max)"
ROUNDING_HEADER = "| tree | config | mode | step (min / median / max)"
STEP_PLOT = ROOT / "docs" / "guides" / "performance_step_time.png"
ROUNDING_PLOT = ROOT / "docs" / "guides" / "performance_write_back.png"
OPTIMIZERS = ("safefactor", "safefactor, guard off", "safefactor, unpacked",
              "safefactor, spikes")
# The heading of the page's superseded measurements; the plots show only what is above it.
HISTORY = "\n## History\n"
# The part of the page the plots are drawn from.
CPU_PART = "\n## On the 2-core CPU: measured\n"


def current(text: str) -> str:
  """The 2-core CPU's current measurements: that part of the page, without "History"."""
  return text.split(HISTORY, 1)[0].split(CPU_PART, 1)[1].split("\n## ", 1)[0]


def _table(text: str, header: str) -> list[list[str]]:
  """The rows of the markdown table whose header line starts with ``header``."""
  lines = text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith(header))
  rows = []
  for line in lines[start + 2:]:
    if not line.startswith("|"):
      break
    rows.append([cell.strip() for cell in line.strip("|").split("|")])
  return rows


def heading_of(text: str, header: str) -> str:
  """The heading above the table whose header line starts with ``header`` (its date and machine)."""
  before = text[:text.index("\n" + header)]
  return next(line.lstrip("#").strip() for line in reversed(before.splitlines())
              if line.startswith("#"))


def _median(cell: str) -> float:
  """The median of a ``min / median / max`` cell such as ``0.64 / 0.78 / 0.95x``."""
  return float(cell.rstrip("x").split("/")[1])


def step_numbers(text: str) -> dict[str, dict[str, list[float]]]:
  """Per optimizer, the median step time against optax, in table order.

  The keys of each are ``labels`` (tree, dtype, config) and ``step``.
  """
  rows = _table(current(text), STEP_HEADER)
  numbers = {}
  for optimizer in OPTIMIZERS:
    chosen = [row for row in rows if row[3] == optimizer]
    numbers[optimizer] = {
        "labels": [f"{re.sub(r' [(].*', '', row[0])} {row[1]} {row[2]}" for row in chosen],
        "step": [_median(row[4]) for row in chosen],
    }
  return numbers


def rounding_numbers(text: str) -> dict[str, list]:
  """The write-back modes' median step time against ``"nearest"``, per tree and config."""
  rows = _table(current(text), ROUNDING_HEADER)
  labels = list(dict.fromkeys(f"{re.sub(r' [(].*', '', row[0])} {row[1]}" for row in rows))
  numbers = {"labels": labels}
  for mode in ("stochastic", "kahan"):
    numbers[mode] = [_median(row[3]) for row in rows if row[2] == mode]
  return numbers


def png_numbers(path: pathlib.Path) -> object:
  """The numbers a PNG written here was drawn from (its ``Numbers`` text chunk)."""
  data = path.read_bytes()
  position = 8
  while position < len(data):
    length, kind = struct.unpack(">I4s", data[position:position + 8])
    body = data[position + 8:position + 8 + length]
    if kind == b"tEXt" and body.startswith(b"Numbers\0"):
      return json.loads(body.split(b"\0", 1)[1])
    if kind == b"zTXt" and body.startswith(b"Numbers\0"):
      return json.loads(zlib.decompress(body.split(b"\0", 1)[1][1:]))
    position += 12 + length
  raise ValueError(f"{path} has no Numbers chunk")


def _bars(axes, labels, series, title, ylabel):
  width = 0.8 / len(series)
  for index, (name, values) in enumerate(series.items()):
    axes.bar([i + (index - (len(series) - 1) / 2) * width for i in range(len(labels))], values,
             width, label=name)
  axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
  axes.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
  axes.set_title(title)
  axes.set_ylabel(ylabel)
  axes.legend(fontsize=8)


def draw() -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  text = BENCHMARKS.read_text()
  versions = "jax 0.10.2, optax 0.2.8 (docs/benchmarks.md)"

  steps = step_numbers(text)
  labels = steps["safefactor"]["labels"]
  figure, axes = plt.subplots(figsize=(8, 4.5))
  _bars(axes, labels, {name: steps[name]["step"] for name in OPTIMIZERS},
        "Step time against optax.adafactor (dashed)", "ratio, median of 5 rounds")
  figure.suptitle(f"{heading_of(current(text), STEP_HEADER)}\n{versions}", fontsize=9)
  figure.tight_layout()
  figure.savefig(STEP_PLOT, dpi=80, metadata={"Numbers": json.dumps(steps)})
  plt.close(figure)

  modes = rounding_numbers(text)
  figure, axes = plt.subplots(figsize=(7, 4))
  _bars(axes, modes["labels"], {mode: modes[mode] for mode in ("stochastic", "kahan")},
        'bfloat16 params: step time against "nearest" (dashed)', "ratio, median of 5 rounds")
  figure.suptitle(f"{heading_of(current(text), ROUNDING_HEADER)}\n{versions}", fontsize=9)
  figure.tight_layout()
  figure.savefig(ROUNDING_PLOT, dpi=80, metadata={"Numbers": json.dumps(modes)})
  plt.close(figure)


if __name__ == "__main__":
  draw()
  print(f"wrote {STEP_PLOT.relative_to(ROOT)} and {ROUNDING_PLOT.relative_to(ROOT)}")
