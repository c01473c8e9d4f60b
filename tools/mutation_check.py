"""Check that the test suite kills a curated list of one-line bugs.

Each mutation in ``tools/mutations.toml`` names a file of the package, an exact piece
of its text, a replacement, what the change breaks and the tests that must catch it.
For each one this script copies the repository to a temporary directory (the working
tree is never touched: other people may be editing it), applies the change there and
runs ``pytest -x`` on the named tests. A mutation whose tests still pass "survived":
the suite lets that bug through. The exit status is non-zero if any mutation
survived, if a mutation's text is not found exactly once, or if the unmutated copy
fails its own tests (then no result would mean anything).

  python tools/mutation_check.py                  # every mutation, on the working tree
  python tools/mutation_check.py --rev HEAD       # on a commit instead (git archive)
  python tools/mutation_check.py --only clip-threshold-multiplies --only param-scale-no-floor
  python tools/mutation_check.py --list          # print the list; check it matches the code

After a refactor moves the code, edit ``original`` (and ``file``) in the list: the
check refuses to run a mutation whose original text it cannot find exactly once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_LIST = REPO / "tools" / "mutations.toml"
# Never copied: version control, environments, caches and outputs of earlier runs (.mutation:
# tools/mutation_score.py's sessions).
IGNORED = (".git", ".venv", "venv", "__pycache__", "*.egg-info", ".hypothesis", ".pytest_cache",
           ".ruff_cache", "safefactor-demo", "build", "dist", ".mutation")


@dataclass(frozen=True)
class Mutation:
  name: str
  file: str
  original: str
  replacement: str
  breaks: str
  tests: tuple[str, ...]


def load_mutations(path: Path) -> list[Mutation]:
  with path.open("rb") as f:
    entries = tomllib.load(f).get("mutation", [])
  mutations, names = [], set()
  for index, entry in enumerate(entries):
    missing = {"name", "file", "original", "replacement", "breaks", "tests"} - set(entry)
    if missing:
      raise SystemExit(f"{path}: mutation #{index} lacks {sorted(missing)}")
    if entry["name"] in names:
      raise SystemExit(f"{path}: two mutations are named {entry['name']!r}")
    if entry["original"] == entry["replacement"]:
      raise SystemExit(f"{path}: mutation {entry['name']!r} does not change anything")
    names.add(entry["name"])
    tests = entry["tests"]
    mutations.append(Mutation(entry["name"], entry["file"], entry["original"],
                              entry["replacement"], entry["breaks"],
                              tuple([tests] if isinstance(tests, str) else tests)))
  return mutations


def copy_tree(rev: str | None, destination: Path) -> None:
  """The working tree (tracked and untracked files), or commit ``rev``, at ``destination``."""
  if rev is None:
    shutil.copytree(REPO, destination, ignore=shutil.ignore_patterns(*IGNORED), symlinks=True)
    return
  destination.mkdir(parents=True)
  archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True,
                           capture_output=True).stdout
  subprocess.run(["tar", "-x", "-C", str(destination)], input=archive, check=True)


def check_originals(mutations: list[Mutation], root: Path) -> list[str]:
  """One message per mutation whose original text is not in its file exactly once."""
  problems = []
  for m in mutations:
    path = root / m.file
    if not path.is_file():
      problems.append(f"{m.name}: {m.file} does not exist")
      continue
    count = path.read_text().count(m.original)
    if count != 1:
      problems.append(f"{m.name}: original text found {count} times in {m.file} (need exactly "
                      f"1); re-point this mutation at the current code:\n    {m.original!r}")
  return problems


def first_failure(output: str) -> str:
  """The first ``FAILED``/``ERROR`` line of pytest's short summary, without its prefix."""
  for line in output.splitlines():
    if line.startswith(("FAILED ", "ERROR ")):
      return line.split(" ", 1)[1].split(" - ", 1)[0]
  return "?"


def run_tests(root: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
  """``("passed" | "failed" | "timeout" | "error", seconds, output)`` for ``pytest -x``."""
  env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
  # The package must come from the copy, not from an editable install of the checkout.
  command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
             "--no-header", *tests]
  start = time.monotonic()
  try:
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                            timeout=timeout)
  except subprocess.TimeoutExpired as error:
    output = (error.stdout or b"").decode() if isinstance(error.stdout, bytes) else error.stdout
    return "timeout", time.monotonic() - start, output or ""
  elapsed = time.monotonic() - start
  output = result.stdout + result.stderr
  if result.returncode == 0:
    return "passed", elapsed, output
  if result.returncode in (4, 5):  # usage error, or no tests collected: a broken list entry
    return "error", elapsed, output
  return "failed", elapsed, output


def package_location(root: Path) -> str:
  env = {**os.environ, "PYTHONPATH": str(root)}
  return subprocess.run(
      [sys.executable, "-c", "import optax_safefactor; print(optax_safefactor.__file__)"],
      cwd=root, env=env, capture_output=True, text=True, check=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--list-file", type=Path, default=DEFAULT_LIST)
  parser.add_argument("--rev", help="mutate this commit (git archive) instead of the working tree")
  parser.add_argument("--only", action="append", default=[], metavar="NAME",
                      help="run only this mutation (repeatable)")
  parser.add_argument("--tests", nargs="+", metavar="TEST",
                      help="run these tests instead of each mutation's own (to check that "
                           "another test kills it too)")
  parser.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
  parser.add_argument("--skip-baseline", action="store_true",
                      help="do not first check that the unmutated copy passes the tests")
  parser.add_argument("--list", action="store_true", help="print the mutations and exit")
  parser.add_argument("-v", "--verbose", action="store_true", help="print pytest's output tail")
  args = parser.parse_args(argv)

  mutations = load_mutations(args.list_file)
  if args.only:
    unknown = set(args.only) - {m.name for m in mutations}
    if unknown:
      parser.error(f"unknown mutation(s): {', '.join(sorted(unknown))}")
    mutations = [m for m in mutations if m.name in args.only]
  if args.list:
    for m in mutations:
      print(f"{m.name}\n  {m.file}: {m.original.strip()!r} -> {m.replacement.strip()!r}\n"
            f"  breaks: {m.breaks}\n  tests: {' '.join(m.tests)}")
    # Read-only against the checkout: does the list still match the code?
    problems = check_originals(mutations, REPO) if args.rev is None else []
    if problems:
      print("mutation list does not match the code:", *problems, sep="\n  ", file=sys.stderr)
      return 2
    return 0
  if args.tests:
    mutations = [Mutation(m.name, m.file, m.original, m.replacement, m.breaks,
                          tuple(args.tests)) for m in mutations]

  with tempfile.TemporaryDirectory(prefix="mutation-check-") as tmp:
    root = Path(tmp) / "repo"
    copy_tree(args.rev, root)
    problems = check_originals(mutations, root)
    if problems:
      print("mutation list does not match the code:", *problems, sep="\n  ", file=sys.stderr)
      return 2
    location = package_location(root)
    if not location.startswith(str(root)):
      print(f"the copy imports the package from {location}, not from {root}", file=sys.stderr)
      return 2

    if not args.skip_baseline:
      all_tests = tuple(dict.fromkeys(t for m in mutations for t in m.tests))
      status, seconds, output = run_tests(root, all_tests, args.timeout * 2)
      print(f"baseline (no mutation): {status} in {seconds:.0f}s", flush=True)
      if status != "passed":
        print(output[-4000:], file=sys.stderr)
        print("the unmutated code fails its tests: fix that first", file=sys.stderr)
        return 2

    results = []
    for m in mutations:
      path = root / m.file
      pristine = path.read_text()
      path.write_text(pristine.replace(m.original, m.replacement, 1))
      try:
        status, seconds, output = run_tests(root, m.tests, args.timeout)
      finally:
        path.write_text(pristine)
      verdict = {"failed": "killed", "timeout": "killed (timeout)", "passed": "SURVIVED",
                 "error": "ERROR (tests not found)"}[status]
      results.append((m, verdict))
      by = f"  by {first_failure(output)}" if status == "failed" else ""
      print(f"{verdict:<18} {m.name:<36} {seconds:4.0f}s{by}", flush=True)
      if args.verbose or status in ("passed", "error"):
        print("    " + output[-3000:].strip().replace("\n", "\n    "), flush=True)

  killed = sum(v.startswith("killed") for _, v in results)
  print(f"\n{killed} of {len(results)} mutations killed")
  bad = [m.name for m, v in results if not v.startswith("killed")]
  if bad:
    print("not killed: " + ", ".join(bad))
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
