"""The main job: a tiny transformer language model trained in float16 and bfloat16.

``python -m optax_safefactor`` trains the same character-level model, on the text of the
Apache License 2.0 shipped with the package, with ``safefactor`` and with
``optax.adafactor``, with params in float16 and in bfloat16, then prints a table and
writes a plot of the loss curves to ``./safefactor-demo/loss_curves.png`` (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import pathlib
import sys
import time
from collections.abc import Sequence
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_safefactor as osf
from optax_safefactor.benchmarks.common import (
    INTERRUPTED,
    HelpFormatter,
    fail,
    plural,
    unwritable_folder,
    wrap,
)

SEQUENCE_LENGTH = 64
BATCH_SIZE = 16
WIDTH = 128
LAYERS = 2
HEADS = 4


def load_corpus() -> str:
  return resources.files("optax_safefactor").joinpath("data/apache-2.0.txt").read_text()


@functools.cache
def _language_model_class():
  """The model's class, defined once per process.

  nnx.jit keys its compiled programs on the model's classes: one class for every run lets
  the runs with params of one dtype share the compiled gradient (:func:`_loss_and_grads`).
  """
  from flax import nnx

  compute = jnp.float32

  class Block(nnx.Module):
    def __init__(self, dtype, rngs):
      self.attention_norm = nnx.LayerNorm(WIDTH, dtype=compute, param_dtype=dtype, rngs=rngs)
      self.attention = nnx.MultiHeadAttention(
          num_heads=HEADS, in_features=WIDTH, dtype=compute, param_dtype=dtype, decode=False,
          rngs=rngs)
      self.mlp_norm = nnx.LayerNorm(WIDTH, dtype=compute, param_dtype=dtype, rngs=rngs)
      self.up = nnx.Linear(WIDTH, 4 * WIDTH, dtype=compute, param_dtype=dtype, rngs=rngs)
      self.down = nnx.Linear(4 * WIDTH, WIDTH, dtype=compute, param_dtype=dtype, rngs=rngs)

    def __call__(self, x, mask):
      x = x + self.attention(self.attention_norm(x), mask=mask)
      return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))

  class LanguageModel(nnx.Module):
    def __init__(self, vocab_size, dtype, rngs):
      self.embed = nnx.Embed(vocab_size, WIDTH, dtype=compute, param_dtype=dtype, rngs=rngs)
      self.position = nnx.Param(
          (jax.random.normal(rngs.params(), (SEQUENCE_LENGTH, WIDTH)) * 0.02).astype(dtype))
      self.blocks = nnx.List([Block(dtype, rngs) for _ in range(LAYERS)])
      self.norm = nnx.LayerNorm(WIDTH, dtype=compute, param_dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
      x = self.embed(tokens) + self.position[None, : tokens.shape[1]].astype(compute)
      mask = nnx.make_causal_mask(tokens)
      for block in self.blocks:
        x = block(x, mask)
      return self.embed.attend(self.norm(x)).astype(jnp.float32)

  return LanguageModel


def _build_model(vocab_size: int, dtype, seed: int):
  """Params stored in ``dtype`` (their gradients too); activations in float32.

  Every dtype starts from the same weights, the float32 model's rounded: flax's
  initialisers draw in the param dtype, which would give a bfloat16 model other weights
  than the float32 one it is compared with.
  """
  from flax import nnx

  language_model = _language_model_class()
  model = language_model(vocab_size, dtype, nnx.Rngs(seed))
  if jnp.dtype(dtype) != jnp.float32:
    weights = nnx.state(language_model(vocab_size, jnp.float32, nnx.Rngs(seed)), nnx.Param)
    nnx.update(model, jax.tree.map(lambda w: w.astype(dtype), weights))
  return model


@dataclasses.dataclass
class RunResult:
  optimizer: str
  dtype: str
  losses: list[float]
  nonfinite_param_steps: int
  skipped_steps: int | None
  state_bytes: int
  ms_per_step: float
  rounding: str = "nearest"  # how the update is written back into the params
  learning_rate: float = 1e-2
  comparison: str = "dtype"  # "dtype" (float16 and bfloat16) or "rounding"

  @property
  def tail_window(self) -> int:
    """How many of the last steps :attr:`tail_loss` averages: ``TAIL``, or all of a shorter run."""
    return min(TAIL, len(self.losses))

  @property
  def tail_loss(self) -> float:
    """The mean loss of the last ``tail_window`` steps: one step's loss is too noisy to compare."""
    return float(np.mean(self.losses[-self.tail_window:]))


TAIL = 20
# jax.random.key keeps only the low 32 bits of a seed unless jax_enable_x64 is on, so larger
# seeds would build the same model as a smaller one; negative ones numpy's generator refuses.
MAX_SEED = 2**32 - 1

# The write-back comparison: bfloat16 params at a learning rate where Adafactor's updates
# (about lr times the param's RMS) fall below half a bfloat16 ulp, so round-to-nearest
# drops most of them; float32 params are the reference.
ROUNDING_LEARNING_RATE = 1e-3
ROUNDING_RUNS = (
    ("safefactor", "float32", "nearest"),
    ("safefactor", "bfloat16", "nearest"),
    ("safefactor", "bfloat16", "stochastic"),
    ("safefactor", "bfloat16", "kahan"),
    ("optax.adafactor", "bfloat16", "nearest"),
)


# The spike comparison: float32 params, one batch whose gradient is multiplied by
# SPIKE_FACTOR (finite, as a bad batch's can be) once the spike rule has its half window of
# history (64 steps at the default spike_window=128). Adafactor's update clipping bounds
# that one step, so the loss does not jump; the spike's cost is in the second moment, which
# it multiplies about 60-fold at step 100 (beta2 = 1 - 101**-0.8): the next updates shrink
# and optax.adafactor falls behind, which shows at a learning rate where progress is steady.
SPIKE_AT = 100
SPIKE_LEARNING_RATE = 1e-3
SPIKE_FACTOR = 50.0
SKIP_SPIKES = 6.0
# The running mean the spike's panel draws, in steps.
SPIKE_MEAN = 10


# The default run's steps per run of each comparison: no more than show its point, since
# each step costs every run of the comparison (the default run's 860 steps take about half
# its time; compiling, the other half). optax's float16 params are NaN from the first step
# and its bfloat16 curve is safefactor's; the write-back curves part at once
# (over the last 20 of 60 steps, round-to-nearest's loss 18% above float32 params',
# stochastic and Kahan within 0.1%: the README's table); optax.adafactor falls behind
# over some 80 steps after the spike.
STEPS = 50
ROUNDING_STEPS = 60
SPIKE_STEPS = 180


def _optimizer(optimizer_name: str, learning_rate: float, accumulate: int,
               param_rounding: str | None, skip_spikes: float | None = None):
  if optimizer_name == "safefactor":
    tx = osf.safefactor(learning_rate, param_rounding=param_rounding or "nearest",
                        skip_spikes=skip_spikes)
    # optax.MultiSteps would poison its accumulator for ever on one NaN micro-batch.
    return osf.accumulate_gradients(tx, accumulate) if accumulate > 1 else tx
  tx = optax.adafactor(learning_rate)
  return optax.MultiSteps(tx, accumulate) if accumulate > 1 else tx


def _loss_and_grads(model, tokens, gradient_factor):
  """The batch's loss, and the gradient of ``gradient_factor`` times it (in the params' dtype)."""
  from flax import nnx

  def loss_fn(model):
    logits = model(tokens[:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss * gradient_factor, loss

  (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  return loss, grads


def _apply_update(model, optimizer, grads):
  """One optimizer update of the params; whether they are all finite after it."""
  from flax import nnx

  optimizer.update(model, grads)
  return jnp.all(jnp.stack([
      jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]))


@functools.cache
def _jitted(function):
  """``function`` under nnx.jit, one wrapper per process: a call whose arguments have the
  structure of an earlier call's (a model of the same dtype) reuses its compiled program."""
  from flax import nnx

  return nnx.jit(function)


def train(optimizer_name: str, dtype_name: str, steps: int, seed: int, progress, *,
          accumulate: int = 1, learning_rate: float = 1e-2,
          param_rounding: str | None = None, skip_spikes: float | None = None,
          spike_at: int | None = None) -> RunResult:
  """``steps`` optimizer steps, each on ``BATCH_SIZE`` sequences in ``accumulate`` micro-batches.

  The loss recorded for a step is the mean of its micro-batch losses. At step ``spike_at``
  (if any) the gradient is ``SPIKE_FACTOR`` times the batch's.
  """
  from flax import nnx

  corpus = load_corpus()
  alphabet = sorted(set(corpus))
  encoded = np.array([alphabet.index(c) for c in corpus], np.int32)
  dtype = jnp.dtype(dtype_name)
  model = _build_model(len(alphabet), dtype, seed)
  tx = _optimizer(optimizer_name, learning_rate, accumulate, param_rounding, skip_spikes)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  rng = np.random.default_rng(seed)

  # One micro-step is two compiled programs, called `accumulate` times per optimizer step
  # (the accumulating transformation emits the update on the last micro-batch of a group):
  # the gradient, compiled once per param dtype and shared by the runs (most of the compile
  # time of a run), and the optimizer's update, compiled for each run.
  loss_and_grads, apply_update = _jitted(_loss_and_grads), _jitted(_apply_update)
  losses, nonfinite_steps, started = [], 0, None
  for index in range(steps):
    starts = rng.integers(0, len(encoded) - SEQUENCE_LENGTH - 1, BATCH_SIZE)
    batch = np.stack([encoded[s:s + SEQUENCE_LENGTH + 1] for s in starts])
    micro_losses, params_finite = [], True
    factor = jnp.float32(SPIKE_FACTOR if index == spike_at else 1.0)
    for tokens in np.split(batch, accumulate):
      loss, grads = loss_and_grads(model, jnp.asarray(tokens), factor)
      finite = apply_update(model, optimizer, grads)
      micro_losses.append(float(loss))
      params_finite = params_finite and bool(finite)
    losses.append(float(np.mean(micro_losses)))
    nonfinite_steps += not params_finite
    if index == 0:
      started = time.perf_counter()  # the first step includes compilation
    progress.update(1)
  ms_per_step = (time.perf_counter() - started) * 1e3 / max(steps - 1, 1)
  state_leaves = jax.tree.leaves(nnx.state(optimizer.opt_state))
  skipped = (int(osf.skipped_steps(optimizer.opt_state)) if optimizer_name == "safefactor"
             else None)
  if skip_spikes is not None:
    optimizer_name = f"{optimizer_name} (skip_spikes={skip_spikes:g})"
  return RunResult(
      optimizer_name, dtype_name, losses, nonfinite_steps, skipped,
      sum(np.asarray(leaf).nbytes for leaf in state_leaves), ms_per_step,
      param_rounding or "nearest", learning_rate)


def results_table(results: Sequence[RunResult]) -> str:
  # The header names the window the rows average; a run shorter than it (when --steps and
  # --rounding-steps differ) says its own in its cell.
  window = max((r.tail_window for r in results), default=TAIL)
  header = (f"| optimizer | params | write-back | lr | final loss "
            f"| mean loss, last {plural(window, 'step')} "
            "| steps with non-finite params | steps skipped | optimizer state | ms / step |")
  rows = [header, "|---|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    tail = f"{r.tail_loss:.3f}"
    if r.tail_window != window:
      tail += f" (all {plural(r.tail_window, 'step')})"
    rows.append(
        f"| {r.optimizer} | {r.dtype} | {r.rounding} | {r.learning_rate:g} | {r.losses[-1]:.3f} "
        f"| {tail} | {r.nonfinite_param_steps} / {len(r.losses)} "
        f"| {'n/a' if r.skipped_steps is None else r.skipped_steps} "
        f"| {r.state_bytes / 1024:.1f} KiB | {r.ms_per_step:.1f} |"
    )
  return "\n".join(rows)


def _panels(results: Sequence[RunResult]):
  """(title, runs, window) per panel: the dtype comparison's, the write-back one, the spike's.

  ``window`` is the running mean's length in steps; 1 plots every step as it is.
  """
  dtype_runs = [r for r in results if r.comparison == "dtype"]
  panels = [(f"params in {dtype}, lr {runs[0].learning_rate:g}", runs, 1)
            for dtype in dict.fromkeys(r.dtype for r in dtype_runs)
            for runs in [[r for r in dtype_runs if r.dtype == dtype]]]
  rounding = [r for r in results if r.comparison == "rounding"]
  if rounding:
    # Smoothed: the gap between write-back modes is smaller than one step's noise. A
    # window as long as the run would leave one point per curve; at most half the run
    # keeps a curve of at least half its steps.
    window = min(TAIL, min(len(r.losses) for r in rounding) // 2)
    title = f"write-back at lr {rounding[0].learning_rate:g} "
    title += f"(mean of {window} steps)" if window > 1 else "(each step: too few to average)"
    panels.append((title, rounding, max(window, 1)))
  spike = [r for r in results if r.comparison == "spike"]
  if spike:
    # Smoothed too: after the spike, optax's curve falls behind by less than one step's
    # noise at first.
    window = min(SPIKE_MEAN, min(len(r.losses) for r in spike) // 2)
    reached = min(len(r.losses) for r in spike) > SPIKE_AT
    title = (f"a {SPIKE_FACTOR:g}x gradient at step {SPIKE_AT} " if reached
             else f"no spike: the run ends before step {SPIKE_AT} ")
    title += f"({spike[0].dtype}, lr {spike[0].learning_rate:g})"
    if window > 1:
      title += f"\n(mean of {window} steps)"
    panels.append((title, spike, max(window, 1)))
  return panels


# The figure reads at the width the site's pages show it, about 800 px: FIGURE_WIDTH inches
# wide, it has 800 / (72 * FIGURE_WIDTH) px to a point there, 1.1 at 10 inches, so its
# smallest text (TEXT_SIZE points: ticks, legends, notes) is 11 px. Panels fill rows of
# COLUMNS.
FIGURE_WIDTH = 10.0
PANEL_HEIGHT = 5.2
COLUMNS = 2
TITLE_SIZE, LABEL_SIZE, TEXT_SIZE = 12, 11, 10
LINE_WIDTH = 2.2
# One marker shape per curve of a panel, in drawing order.
CURVE_MARKERS = ("o", "s", "^", "D", "v", "P")
# Curves closer than this fraction of their panel's range over most of their steps lie on
# each other (a line is about 1% of a panel's height): they share the line in turns.
COINCIDE = 0.02
# The length of a curve's turn on a shared line, in line widths (matplotlib scales dashes
# by the width).
TURN = 2.5


@dataclasses.dataclass
class _Curve:
  steps: np.ndarray
  losses: np.ndarray
  label: str
  dashed: bool  # optax's curves, when they have a line of their own


def _curve(run: RunResult, window: int) -> _Curve:
  """What a panel draws of ``run``: its losses (a running mean over ``window`` steps) and
  its legend label."""
  losses = np.asarray(run.losses, float)
  label = run.optimizer
  if run.comparison == "rounding":  # one optimizer, several dtypes and modes
    label = f"{run.optimizer}, {run.dtype} {run.rounding}"
  if run.comparison == "spike" and run.skipped_steps:
    label += f" ({plural(run.skipped_steps, 'step')} skipped)"
  if window > 1:
    losses = np.convolve(losses, np.ones(window) / window, mode="valid")
  if not np.isfinite(losses).any():
    label += " (all non-finite)"  # in the legend, but nothing to draw
  offset = len(run.losses) - len(losses)  # a running mean starts at its window's end
  return _Curve(offset + np.arange(len(losses)), losses, label,
                dashed=run.optimizer.startswith("optax"))


def _lie_on_each_other(first: _Curve, second: _Curve, span: float) -> bool:
  """Whether two curves are within ``COINCIDE * span`` of each other at most of the steps
  where either is finite (a curve that turns NaN lies on none)."""
  steps = np.union1d(first.steps, second.steps)
  first_losses, second_losses = (np.full(steps.size, np.nan) for _ in range(2))
  first_losses[np.searchsorted(steps, first.steps)] = first.losses
  second_losses[np.searchsorted(steps, second.steps)] = second.losses
  drawn = np.isfinite(first_losses) | np.isfinite(second_losses)
  close = np.abs(first_losses - second_losses) < COINCIDE * span  # False where either is NaN
  return bool(drawn.any() and close.sum() > drawn.sum() / 2)


def _coinciding_groups(curves: Sequence[_Curve]) -> list[list[int]]:
  """The curves' indices, grouped with the curves each lies on (:func:`_lie_on_each_other`)."""
  finite = [c.losses[np.isfinite(c.losses)] for c in curves]
  span = float(np.ptp(np.concatenate(finite))) if any(f.size for f in finite) else 0.0
  groups: list[list[int]] = []
  for index, curve in enumerate(curves):
    group = next((g for g in groups
                  if any(_lie_on_each_other(curve, curves[i], span) for i in g)), None)
    if group is None:
      groups.append([index])
    else:
      group.append(index)
  return groups


def _draw_panel(axis, title: str, runs: Sequence[RunResult], window: int,
                first_column: bool) -> None:
  from matplotlib.ticker import MaxNLocator

  curves = [_curve(r, window) for r in runs]
  group_of = {i: group for group in _coinciding_groups(curves) for i in group}
  for index, (run, curve) in enumerate(zip(runs, curves, strict=True)):
    # Curves that lie on each other (bfloat16 round-to-nearest and optax's; stochastic
    # rounding, Kahan and float32 params) share the line in turns, each drawing one dash
    # of TURN widths where the one before it stops, so every colour shows along it; a
    # curve alone is solid, or dashed for optax.
    group = group_of[index]
    turn = group.index(index)
    if len(group) > 1:
      style = (turn * TURN, (TURN, (len(group) - 1) * TURN))
    else:
      style = "--" if curve.dashed else "-"
    finite = np.isfinite(curve.losses)
    # A finite point between non-finite ones draws no line (optax's float16 run that
    # turns NaN after its first step), and a short run has few points: mark them all.
    isolated = finite & ~np.r_[False, finite[:-1]] & ~np.r_[finite[1:], False]
    if isolated.any() or len(curve.losses) <= TAIL:
      every = 1
    else:  # the markers of a shared line take turns too, rather than sit on each other
      spacing = max(1, len(curve.losses) // 8)
      every = (turn * spacing // len(group), spacing)
    axis.plot(curve.steps, curve.losses, linestyle=style, linewidth=LINE_WIDTH,
              marker=CURVE_MARKERS[index % len(CURVE_MARKERS)], markersize=6,
              markevery=every, markerfacecolor="none", label=curve.label)
    bad = np.flatnonzero(~np.isfinite(run.losses))
    if bad.size:
      _mark_step(axis, bad[0], f"{run.optimizer}: NaN from step {bad[0]}", "red")
  if runs and runs[0].comparison == "spike" and len(runs[0].losses) > SPIKE_AT:
    _mark_step(axis, SPIKE_AT, f"{SPIKE_FACTOR:g}x gradient", "darkorange")
  axis.set_title(title, fontsize=TITLE_SIZE)
  axis.set_xlabel("step", fontsize=LABEL_SIZE)
  # Steps are whole numbers; left alone, a short run gets ticks at 0.5, 1.5, ...
  axis.xaxis.set_major_locator(MaxNLocator(integer=True))
  if first_column:  # every panel's y axis is the same quantity: named once per row
    axis.set_ylabel("training loss (cross-entropy)", fontsize=LABEL_SIZE)
  axis.tick_params(labelsize=TEXT_SIZE)
  # Under the panel: inside, a legend of five curves covers some of them.
  axis.legend(fontsize=TEXT_SIZE, loc="upper center", bbox_to_anchor=(0.5, -0.2),
              frameon=False)


def _mark_step(axis, step: int, text: str, color: str) -> None:
  """A vertical line at ``step``, named at the top of the panel."""
  axis.axvline(step, color=color, alpha=0.5, linestyle=":")
  axis.annotate(text, (step, 1), xycoords=("data", "axes fraction"), xytext=(5, -15),
                textcoords="offset points", color=color, fontsize=TEXT_SIZE)


def loss_figure(results: Sequence[RunResult]):
  """The panels in rows of ``COLUMNS``: one per dtype in the order of the table's rows, then
  the write-back comparison, then the spike."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  panels = _panels(results)
  columns = min(COLUMNS, len(panels))
  rows = -(-len(panels) // columns)
  figure, axes = plt.subplots(rows, columns, figsize=(FIGURE_WIDTH, PANEL_HEIGHT * rows),
                              squeeze=False)
  for index, axis in enumerate(axes.flat):
    if index < len(panels):
      _draw_panel(axis, *panels[index], first_column=index % columns == 0)
    else:
      axis.remove()  # an odd panel out leaves its row's last cell empty
  figure.suptitle("Character-level transformer on the Apache-2.0 text", fontsize=TITLE_SIZE)
  figure.tight_layout()
  return figure


def plot(results: Sequence[RunResult], path: pathlib.Path) -> None:
  import matplotlib.pyplot as plt

  figure = loss_figure(results)
  path.parent.mkdir(parents=True, exist_ok=True)
  figure.savefig(path, dpi=110)
  plt.close(figure)


PROG = "python -m optax_safefactor"


SUBCOMMAND_HELP = {
    "bench": "safefactor against optax.adafactor on model-shaped parameter trees: step "
             "time, compile time, temporary and state memory, as ratios with their spread "
             "over repetitions. A full run takes about 9 minutes and 16 GB of memory on a "
             f"2-core CPU; `{PROG} bench --help` lists its options and a run of under a "
             "minute.",
    "bench-rounding": "the cost of safefactor's param_rounding modes on bfloat16 params, "
                      "against 'nearest', and the bytes per parameter they keep. A full "
                      "run takes about 4 minutes on a 2-core CPU; --small, seconds.",
    "bench-accumulate": "accumulate_gradients against optax.MultiSteps and against "
                        "safefactor alone: time per micro-batch, temporary bytes and "
                        "compile time.",
}
EPILOG = "subcommands (SUBCOMMAND --help lists the options of each):\n" + "\n".join(
    wrap(text, indent=" " * 20, first=f"  {name:<18}") for name, text in SUBCOMMAND_HELP.items())


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog=PROG,
      usage=f"{PROG} [-h] [--steps N] [--dtype DTYPE] [--out DIR] [--seed N]\n"
            f"       {' ' * len(PROG)} [--rounding-steps N] [--spike-steps N] [--accumulate K]\n"
            f"       {PROG} {{bench,bench-rounding,bench-accumulate}} [-h] [options]",
      description=wrap(
          "Train a tiny transformer in float16 and bfloat16 with safefactor and with "
          "optax.adafactor, print a results table and write a plot of the loss curves."),
      epilog=EPILOG, formatter_class=HelpFormatter,
  )
  parser.add_argument("--steps", type=int, default=STEPS, metavar="N",
                      help=f"training steps per run, at least 2 ({STEPS})")
  parser.add_argument("--dtype", choices=("float16", "bfloat16", "both"), default="both",
                      help="the params' dtype in the first comparison, against optax.adafactor "
                           "at lr 1e-2; the write-back comparison trains bfloat16 and float32 "
                           "params and the spike comparison float32 ones, whatever this is "
                           "(both)")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("safefactor-demo"),
                      metavar="DIR",
                      help="folder for the plot, created if missing (./safefactor-demo)")
  parser.add_argument("--seed", type=int, default=0, metavar="N",
                      help="random seed of the model's initialization and of the batches, "
                           f"from 0 to {MAX_SEED} (2^32 - 1) (0)")
  parser.add_argument(
      "--rounding-steps", type=int, default=ROUNDING_STEPS, metavar="N",
      help=f"steps of each write-back run: bfloat16 params at lr {ROUNDING_LEARNING_RATE:g} "
           "with safefactor's param_rounding nearest, stochastic and kahan, against float32 "
           "params and optax.adafactor; 0 skips them. The default shows round-to-nearest "
           "stalling (on a 2-core CPU its loss ended 18%% above float32 params', stochastic "
           f"and kahan within 0.1%%) ({ROUNDING_STEPS})")
  parser.add_argument(
      "--spike-steps", type=int, default=SPIKE_STEPS, metavar="N",
      help=f"steps of each spike run: float32 params at lr {SPIKE_LEARNING_RATE:g}, with a "
           "gradient "
           f"{SPIKE_FACTOR:g} times the batch's at step {SPIKE_AT}, for optax.adafactor and "
           f"for safefactor with skip_spikes={SKIP_SPIKES:g}, which skips it; 0 skips these "
           f"runs, and a run of {SPIKE_AT} steps or fewer ends before the spike; the "
           f"default shows optax.adafactor falling behind over {SPIKE_STEPS - SPIKE_AT} "
           f"steps after it ({SPIKE_STEPS})")
  parser.add_argument(
      "--accumulate", type=int, default=1, metavar="K",
      help=f"split each batch of {BATCH_SIZE} sequences into K micro-batches and accumulate "
           "their gradients: osf.accumulate_gradients around safefactor, optax.MultiSteps "
           f"around optax.adafactor; K divides {BATCH_SIZE}; --steps counts optimizer steps "
           "(1: off)")
  return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.steps < 2:
    parser.error("--steps must be at least 2")
  if args.rounding_steps != 0 and args.rounding_steps < 2:
    parser.error("--rounding-steps must be 0 or at least 2")
  if args.spike_steps != 0 and args.spike_steps < 2:
    parser.error("--spike-steps must be 0 or at least 2")
  if not 0 <= args.seed <= MAX_SEED:
    parser.error(f"--seed must be from 0 to {MAX_SEED}, not {args.seed}")
  if args.accumulate < 1 or BATCH_SIZE % args.accumulate:
    parser.error(f"--accumulate must be a positive divisor of the batch size {BATCH_SIZE}")
  return args


class LogProgress:
  """Progress for a stream that is not a terminal (a log file, a pipe): one short line as
  each run starts and one at the end. A bar's carriage-return updates would make one line
  of hundreds of kilobytes there."""

  def __init__(self, total: int, stream):
    self.total, self.stream, self.done = total, stream, 0
    self.started = time.perf_counter()

  def __enter__(self) -> LogProgress:
    return self

  def __exit__(self, error_type, error, traceback) -> None:
    if error_type is None:
      self._line("done")

  def set_description(self, text: str) -> None:
    """Called as each run starts, with the run's name."""
    self._line(text)

  def update(self, steps: int) -> None:
    self.done += steps

  def _line(self, text: str) -> None:
    elapsed = time.perf_counter() - self.started
    print(f"{self.done}/{self.total} steps, {elapsed:.0f} s: {text}", file=self.stream,
          flush=True)


def progress_bar(total: int, stream):
  """tqdm's bar of ``total`` steps on a terminal; elsewhere a line per run (LogProgress)."""
  if stream.isatty():
    from tqdm import tqdm

    return tqdm(total=total, unit="step", file=stream)
  return LogProgress(total, stream)


def missing_extras(stream) -> list[str]:
  """The demo's packages that are not installed: flax for the model, matplotlib for the
  plot, and tqdm for the progress bar on a terminal (elsewhere a line per run)."""
  needed = ["flax", "matplotlib"] + (["tqdm"] if stream.isatty() else [])
  return [name for name in needed if importlib.util.find_spec(name) is None]


def _train_all(args: argparse.Namespace, runs, rounding_runs, spike_runs, total: int,
               results: list[RunResult]) -> None:
  """Every run of the demo, appended to ``results`` as each finishes."""
  with progress_bar(total, sys.stderr) as progress:
    for name, dtype in runs:
      progress.set_description(f"{name} / {dtype}")
      results.append(train(name, dtype, args.steps, args.seed, progress,
                           accumulate=args.accumulate))
    for name, dtype, rounding in rounding_runs:
      progress.set_description(f"{name} / {dtype} {rounding}")
      result = train(name, dtype, args.rounding_steps, args.seed, progress,
                     accumulate=args.accumulate, learning_rate=ROUNDING_LEARNING_RATE,
                     param_rounding=rounding if name == "safefactor" else None)
      results.append(dataclasses.replace(result, comparison="rounding"))
    for name, skip_spikes in spike_runs:
      progress.set_description(f"{name} / a {SPIKE_FACTOR:g}x gradient")
      result = train(name, "float32", args.spike_steps, args.seed, progress,
                     accumulate=args.accumulate, learning_rate=SPIKE_LEARNING_RATE,
                     skip_spikes=skip_spikes, spike_at=SPIKE_AT)
      results.append(dataclasses.replace(result, comparison="spike"))


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  # Checked before training, not found missing when the plot is drawn after it.
  missing = missing_extras(sys.stderr)
  if missing:
    verb = "is" if len(missing) == 1 else "are"
    return fail(PROG, f"{' and '.join(missing)} {verb} not installed: the demo needs its "
                      "extra, pip install 'optax-safefactor[demo]'")
  problem = unwritable_folder(args.out)
  if problem is not None:
    return fail(PROG, f"cannot write the plot to --out {args.out}: {problem}")
  dtypes = ("float16", "bfloat16") if args.dtype == "both" else (args.dtype,)
  runs = [(name, dtype) for dtype in dtypes for name in ("safefactor", "optax.adafactor")]
  rounding_runs = ROUNDING_RUNS if args.rounding_steps else ()
  spike_runs = ((("optax.adafactor", None), ("safefactor", SKIP_SPIKES)) if args.spike_steps
                else ())
  total = (len(runs) * args.steps + len(rounding_runs) * args.rounding_steps
           + len(spike_runs) * args.spike_steps)
  results: list[RunResult] = []
  try:
    _train_all(args, runs, rounding_runs, spike_runs, total, results)
  except KeyboardInterrupt:
    # Ctrl-C: the finished runs' rows, not a traceback through JAX's compiler; no plot.
    if results:
      print(results_table(results))
    planned = len(runs) + len(rounding_runs) + len(spike_runs)
    print(f"{PROG}: interrupted after {len(results)} of {plural(planned, 'run')}"
          f"{': the table shows the finished ones' if results else ''}; no plot written",
          file=sys.stderr)
    return INTERRUPTED
  print(results_table(results))
  path = args.out / "loss_curves.png"
  plot(results, path)
  print(f"plot: {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
