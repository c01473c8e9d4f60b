"""What every benchmark shares: the compiled train step, its timing, and the command line.

Measuring: :func:`train_step` is the step every benchmark compiles (update and
``apply_updates``); :func:`compile_step` compiles it with params and state donated and
records the compile time and XLA's temporary bytes; :func:`time_rounds` times the
compiled steps in interleaved rounds with Python's cycle collector off. Reporting:
:func:`ratio_with_spread` and :func:`format_range` give a timed figure as min / median /
max over the rounds. The command line: :class:`HelpFormatter`, :func:`wrap`,
:func:`plural`, and the checks of an output path made before a long run
(:func:`unwritable_folder`, :func:`json_problem`, :func:`fail`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import pathlib
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

# Measuring ---------------------------------------------------------------------------


def number_in(kind: type, low: float, high: float | None = None, *,
               low_open: bool = False) -> Callable[[str], Any]:
  """An argparse ``type``: a ``kind`` (int or float) from ``low`` (exclusive if
  ``low_open``) to ``high``. argparse then names the flag that is wrong in its error.

  >>> scale = number_in(float, 0, 4, low_open=True)
  >>> scale("0.5")
  0.5
  >>> scale("0")
  Traceback (most recent call last):
  ...
  argparse.ArgumentTypeError: must be in (0, 4], got 0
  """
  if high is not None:
    wanted = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
  else:
    wanted = f"above {low:g}" if low_open else f"at least {low:g}"

  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"must be {'an integer' if kind is int else 'a number'} {wanted}, got {text}"
      ) from None
    if (value != value or (value <= low if low_open else value < low)
        or (high is not None and value > high)):  # NaN is in no range
      raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
    return value

  parse.__name__ = kind.__name__  # argparse's "invalid float value" names the type
  return parse


SCALE = number_in(float, 0, 4, low_open=True)
REPETITIONS = number_in(int, 1)


def train_step(tx: optax.GradientTransformation) -> Callable:
  """``(params, state, grads) -> (params, state)``: ``tx.update`` and ``apply_updates``."""

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


@dataclasses.dataclass
class Compiled:
  """One compiled step, the params and state it runs on, and what compiling it measured.

  The params are a copy and the state is the candidate's own: both are donated, so no
  two candidates may share a buffer.
  """

  step: Callable
  params: Any
  state: Any
  compile_s: float
  temp_bytes: int | None  # None where the backend gives no memory analysis
  calls_per_round: int = 1


def compile_step(step: Callable, params, state, grads, calls_per_round: int = 1) -> Compiled:
  """``step`` lowered and compiled with params and state donated, timed, and analysed."""
  start = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
  compile_s = time.perf_counter() - start
  memory = compiled.memory_analysis()
  temp_bytes = None if memory is None else int(memory.temp_size_in_bytes)
  return Compiled(compiled, jax.tree.map(jnp.copy, params), state, compile_s, temp_bytes,
                  calls_per_round)


@contextlib.contextmanager
def without_garbage_collection():
  """Python's cycle collector off for one timed round, and run just before it.

  As ``timeit`` does: a full collection scans every live object, the benchmark holds
  thousands of arrays (every candidate's params and state), and one collection landing
  in a timed call added about 140 ms to a 30 ms step of the 600-leaf tree, in the same
  round of every run.
  """
  was_enabled = gc.isenabled()
  gc.collect()
  gc.disable()
  try:
    yield
  finally:
    if was_enabled:
      gc.enable()


def time_rounds(candidates: Mapping[str, Compiled], grads,
                repetitions: int) -> dict[str, list[list[float]]]:
  """Seconds of each call, per candidate and timed round: ``[round][call]``.

  Each round runs every candidate's ``calls_per_round`` calls, in order, so a slow
  moment of the machine lands on all of them; each call is timed on its own, until its
  params and state are ready. Round 0 warms up and is dropped. Each candidate's params
  and state are carried from call to call (they are donated).
  """
  times = {name: [] for name in candidates}
  for round_index in range(repetitions + 1):
    with without_garbage_collection():
      for name, candidate in candidates.items():
        calls = []
        for _ in range(candidate.calls_per_round):
          start = time.perf_counter()
          candidate.params, candidate.state = candidate.step(
              candidate.params, candidate.state, grads)
          jax.block_until_ready((candidate.params, candidate.state))
          calls.append(time.perf_counter() - start)
        if round_index:
          times[name].append(calls)
  return times


def ratio_with_spread(row: dict, name: str, numerator: Any, denominator: Any,
                      factor: float = 1.0) -> None:
  """``row[name]``: ``factor`` times the ratio of the medians; ``_min``, ``_max``: per round.

  Within a round the runs compared are moments apart, so the spread of the round-by-round
  ratio shows how much a slow moment of the machine (another process, a frequency
  change) moved them, and how far the median can be trusted.
  """
  numerator, denominator = np.asarray(numerator), np.asarray(denominator)
  row[name] = factor * float(np.median(numerator)) / float(np.median(denominator))
  per_round = factor * numerator / denominator
  row[f"{name}_min"] = float(per_round.min())
  row[f"{name}_max"] = float(per_round.max())


def nbytes(tree) -> int:
  """Bytes of every array of ``tree``: arrays or ``jax.ShapeDtypeStruct``s."""
  return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape)
                 for x in jax.tree.leaves(tree)))


def count(tree) -> int:
  """Elements of every array of ``tree``."""
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def measured_on() -> dict[str, str]:
  """Which device ran a row's times: "cpu" is JAX's default device, a GPU or TPU where the
  machine has one. Every JSON row of a measured benchmark carries it."""
  return {"device": jax.devices()[0].device_kind, "backend": jax.default_backend()}


def backend_summary() -> str:
  """The versions and the devices a run measured, for its log."""
  return (f"jax {jax.__version__}, optax {optax.__version__}, backend {jax.default_backend()}, "
          f"{plural(len(jax.devices()), 'device')}: {jax.devices()[0].device_kind}")


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


# The exit status of a run stopped by Ctrl-C: 128 + SIGINT, as a shell reports it.
INTERRUPTED = 130


def fail(prog: str, message: str) -> int:
  """One line on stderr, as argparse words a usage error, and its exit status (2).

  For errors found after parsing (an output path that cannot be written): the usage
  would add nothing to the line that names the path and the reason.
  """
  print(f"{prog}: error: {message}", file=sys.stderr)
  return 2
