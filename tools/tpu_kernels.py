"""How many kernels XLA:TPU compiles for one train step, and from how many computations.

``python tools/tpu_kernels.py --tree 1b-slice --dtype float32 --config momentum`` compiles
``optax.adafactor``'s train step and safefactor's for TPU v5e on this machine, without a
TPU (the ``accel`` extra), each in a process of its own with libtpu's low-level dump on,
and prints per optimizer:

* kernels: the low-level programs libtpu wrote, one per kernel it compiled (plus the
  top-level program), and their lines;
* large: the kernels of over ``--large`` lines (the full-size reductions and updates);
* computations: how many distinct fused computations those large kernels come from once
  memory spaces (``S(n)``) and tilings are left out. XLA:TPU compiles a computation once
  per placement of its operands (in HBM or on chip), so large kernels above computations
  are placement variants; "one each" is the lines the large kernels would take were each
  computation compiled once.

docs/benchmarks.md ("Why the guarded step compiles more kernels than optax's") has the
figures and what they say.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOW_LEVEL_PROGRAM = re.compile(r"^\d+-(?P<kernel>.+)-\d+-pre-cssa\.txt$")
FUSION = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = .* fusion\(.*calls=%(?P<calls>[\w.\-]+)")
COMPUTATION_START = re.compile(r"^%(?P<name>[\w.\-]+) .*\{\s*$")


def kernel_lines(dump: pathlib.Path) -> dict[str, int]:
  """Lines of each low-level program in a libtpu dump folder, by kernel name."""
  found = {}
  for path in dump.iterdir():
    match = LOW_LEVEL_PROGRAM.match(path.name)
    if match:
      found[match["kernel"]] = len(path.read_text().splitlines())
  return found


def _without_placement(line: str) -> str:
  line = re.sub(r"%[\w.\-]+", "%", line)
  line = re.sub(r", metadata=\{[^}]*\}", "", line)
  line = re.sub(r"S\(\d+\)", "", line)
  return re.sub(r":T\([\d,]+\)(\(\d+\))?", "", line).strip()


def computations(hlo_text: str) -> dict[str, str]:
  """Each fusion of the entry computation -> its fused computation's text, with names,
  metadata, memory spaces and tilings left out (equal texts: the same arithmetic)."""
  bodies, current = {}, None
  for line in hlo_text.splitlines():
    start = COMPUTATION_START.match(line)
    if start:
      current = bodies.setdefault(start["name"], [])
    elif line.startswith("}"):
      current = None
    elif current is not None:
      current.append(_without_placement(line))
  entry = hlo_text[hlo_text.index("\nENTRY"):]
  return {match["name"]: "\n".join(bodies[match["calls"]])
          for match in map(FUSION.match, entry.splitlines()) if match}


def summary(hlo_text: str, lines: dict[str, int], large: int) -> dict[str, int]:
  """Kernels, lines, large kernels, their computations and the lines of one each."""
  bodies = computations(hlo_text)
  large_kernels = [name for name in bodies if lines.get(name, 0) > large]
  by_body = collections.defaultdict(list)
  for name in large_kernels:
    by_body[bodies[name]].append(lines[name])
  return {"kernels": len(lines), "lines": sum(lines.values()), "large": len(large_kernels),
          "computations": len(by_body),
          "one_each": sum(max(counts) for counts in by_body.values())}


def _compile_one(tree: str, dtype: str, config: str, optimizer: str,
                 out: pathlib.Path) -> None:
  import optax

  import optax_safefactor as osf
  from optax_safefactor.benchmarks import compiled, targets, trees

  shapes = trees.shape_structs(tree, 1.0, dtype)
  tx = (optax.adafactor(1e-3, momentum=compiled.CONFIGS[config].get("momentum"))
        if optimizer == "optax.adafactor" else osf.safefactor(1e-3, **compiled.CONFIGS[config]))
  program, _ = compiled.compile_for(targets.TARGETS["tpu-v5e"], tx, shapes)
  out.write_text(program.as_text())


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tree", default="1b-slice")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--config", default="default")
  parser.add_argument("--large", type=int, default=2000, metavar="LINES")
  parser.add_argument("--optimizers", nargs="+", default=["optax.adafactor", "safefactor"],
                      choices=("optax.adafactor", "safefactor"))
  parser.add_argument("--one", type=pathlib.Path, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.one:
    _compile_one(args.tree, args.dtype, args.config, args.optimizers[0], args.one)
    return
  print("| optimizer | kernels | lines | large | computations | one each |")
  print("|---|---|---|---|---|---|")
  for optimizer in args.optimizers:
    with tempfile.TemporaryDirectory() as folder:
      dump = pathlib.Path(folder)
      hlo = dump / "program.hlo"
      # libtpu reads its flags once, as it loads: one process per program.
      env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
                 LIBTPU_INIT_ARGS=f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true")
      subprocess.run([sys.executable, __file__, "--tree", args.tree, "--dtype", args.dtype,
                      "--config", args.config, "--optimizers", optimizer, "--one", str(hlo)],
                     env=env, check=True, cwd=ROOT)
      found = summary(hlo.read_text(), kernel_lines(dump), args.large)
    print(f"| {optimizer} | {found['kernels']} | {found['lines']:,} | {found['large']} | "
          f"{found['computations']} | {found['one_each']:,} |")


if __name__ == "__main__":
  main()
