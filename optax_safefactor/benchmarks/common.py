"""What every benchmark shares: its reporting and its command line.

Reporting: :func:`format_range` gives a timed figure as min / median / max over the
rounds. The command line: :class:`HelpFormatter`, :func:`wrap`, :func:`plural`, and the
checks of an output path made before a long run (:func:`unwritable_folder`,
:func:`json_problem`, :func:`fail`).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import textwrap

# Reporting ---------------------------------------------------------------------------


def format_range(row: dict, name: str, scale: float, unit: str, digits: int) -> str:
  """``min / median / max`` of a figure and its ``_min`` and ``_max``, scaled, with a unit."""
  low, mid, high = (scale * row[key] for key in (f"{name}_min", name, f"{name}_max"))
  return f"{low:.{digits}f} / {mid:.{digits}f} / {high:.{digits}f}{unit}"


def plural(count: int, word: str) -> str:
  """``1 step``, ``2 steps``: a count with its noun, singular only for exactly one."""
  return f"{count} {word if count == 1 else word + 's'}"


# The command line --------------------------------------------------------------------


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """Help text wrapped without splitting at hyphens: ``safefactor-demo``, ``600-leaves``.

  Descriptions and epilogs are wrapped where they are written (:func:`wrap`), so that
  the subcommand list keeps its indentation.
  """

  def _split_lines(self, text, width):
    return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def wrap(text: str, indent: str = "", first: str | None = None) -> str:
  return textwrap.fill(" ".join(text.split()), 88, break_on_hyphens=False,
                       initial_indent=indent if first is None else first,
                       subsequent_indent=indent)


def unwritable_folder(path: pathlib.Path) -> str | None:
  """Why files cannot be written in folder ``path`` (created if missing), or None if they can.

  Checked before a long run rather than found out after it: the folder is created, and
  a probe file written and removed in it.
  """
  try:
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-") as probe:
      probe.write(b"probe")
      probe.flush()
  except (FileExistsError, NotADirectoryError):
    # A file stands where a folder should be: `path` itself or one of its parents. Name it,
    # since in "--json dir/name.json" the path the user wrote is not the folder.
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
      return f"{blocker} exists and is not a folder"
    return "a file stands where a folder should be"
  except OSError as error:
    reason = error.strerror or str(error)
    where = getattr(error, "filename", None)
    # The failing path can be a parent folder or the probe; say which when it is not `path`.
    if where is not None and os.fspath(where) != os.fspath(path):
      reason = f"{reason}: {where}"
    return reason
  return None


def json_problem(path: pathlib.Path) -> str | None:
  """Why ``--json path`` cannot be written, or None if it can; the benchmarks' one check.

  Run before measuring, so that a bad path is not found out when the results are ready:
  the path's folder is created and probed (:func:`unwritable_folder`), and the path must
  not be a folder itself.
  """
  problem = unwritable_folder(path.parent)
  if problem is None and path.is_dir():
    problem = "it is a folder"
  return problem


def fail(prog: str, message: str) -> int:
  """One line on stderr, as argparse words a usage error, and its exit status (2).

  For errors found after parsing (an output path that cannot be written): the usage
  would add nothing to the line that names the path and the reason.
  """
  print(f"{prog}: error: {message}", file=sys.stderr)
  return 2
