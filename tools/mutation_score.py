"""Measure the test suite with cosmic-ray: every mutant of a module, run against its tests.

The fast check (``tools/mutation_check.py``) applies a curated list of one-line bugs;
this is the measure: cosmic-ray generates every mutant its operators can make of one
module of ``optax_safefactor/_src/`` and runs that module's own tests against each one,
in a fresh process per mutant. ``tools/mutation_score.toml`` names each module's tests,
the seed and the timeout rule. Install the tool with ``pip install -e '.[mutation]'``.

  python tools/mutation_score.py plan numerics --sample 15 --label pilot
  python tools/mutation_score.py --all --label "full measurement"   # every mutant
  python tools/mutation_score.py --all --count        # work items per module, runs nothing
  python tools/mutation_score.py --all --count --baseline   # and each module's test time
  python tools/mutation_score.py plan --resume        # finish an interrupted session
  python tools/mutation_score.py --all --summarise    # the doc again, from the sessions
                                                      # (other labels' sections are kept)

Per module, cosmic-ray's own commands do the work, in a scratch copy of the working tree
(cosmic-ray mutates files in place; the checkout is never touched): ``cosmic-ray
baseline`` (the unmutated tests must pass; their time sets the timeout), ``cosmic-ray
init``, then two filters that mark work items skipped, as ``cr-filter-*`` do: mutants
inside annotations (never evaluated under ``from __future__ import annotations``, so
equivalent by construction) and, with ``--sample N``, all but a seeded sample of N;
then ``cosmic-ray exec``, ``cr-report`` and ``cr-html``. Sessions, configs and reports
stay in ``.mutation/`` (git ignores it). The score is killed / (killed + survived) from
``cosmic-ray dump``; cr-report's own rate counts skipped items as killed. Survivors get
the verdict recorded for them in ``tools/mutation_verdicts.toml``, or "open", and the
results go into ``docs/mutation-testing.md`` between its two result markers.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

# The scratch copy and the package check are the fast check's own.
from mutation_check import IGNORED, copy_tree, first_failure, package_location

REPO = Path(__file__).resolve().parent.parent
SETTINGS = REPO / "tools" / "mutation_score.toml"
VERDICTS = REPO / "tools" / "mutation_verdicts.toml"
DOC = REPO / "docs" / "mutation-testing.md"
WORK = REPO / ".mutation"
SOURCE = "optax_safefactor/_src"
BEGIN, END = "<!-- mutation_score results: begin -->", "<!-- mutation_score results: end -->"
ANNOTATION, NOT_SAMPLED = "skipped: inside an annotation", "skipped: not in the sample"
assert ".mutation" in IGNORED, "the copy must leave earlier sessions out"


def load_settings() -> dict:
  with SETTINGS.open("rb") as f:
    return tomllib.load(f)


def cosmic_ray(*args: str, cwd: Path, capture: bool = False) -> subprocess.CompletedProcess:
  """Run one of cosmic-ray's commands from this venv, in the scratch copy."""
  command = [str(Path(sys.executable).parent / args[0]), *args[1:]]
  # The copy's package, not the checkout's editable install, is the one mutated and tested.
  env = {**os.environ, "PYTHONPATH": str(cwd)}
  return subprocess.run(command, cwd=cwd, env=env, text=True,
                        capture_output=capture, check=False)


def write_config(path: Path, module: str, tests: list[str], timeout: float) -> None:
  """A cosmic-ray config for one module: its file, its tests, the local distributor."""
  test_command = " ".join([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                           *tests])
  path.write_text(
      "[cosmic-ray]\n"
      f'module-path = "{SOURCE}/{module}.py"\n'
      f"timeout = {timeout:.0f}\n"
      "excluded-modules = []\n"
      f'test-command = "{test_command}"\n\n'
      "[cosmic-ray.distributor]\n"
      'name = "local"\n')


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
  """Where the annotations are, if the module postpones their evaluation (else none)."""
  tree = ast.parse(source)
  postponed = any(isinstance(node, ast.ImportFrom) and node.module == "__future__"
                  and any(a.name == "annotations" for a in node.names) for node in tree.body)
  if not postponed:
    return []
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
      found.append(node.annotation)
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
      found.append(node.returns)
  return [((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)) for a in found]


def mark_skipped(session: Path, copy: Path, module: str, sample: int, seed: int) -> dict:
  """Filter the session as ``cr-filter-*`` do; the counts of what was generated and kept."""
  # Imported here: the rest of this script (--summarise) needs no cosmic-ray.
  from cosmic_ray.work_db import use_db
  from cosmic_ray.work_item import WorkerOutcome, WorkResult

  spans = annotation_spans((copy / SOURCE / f"{module}.py").read_text())
  with use_db(str(session)) as db:
    items = list(db.pending_work_items)
    kept = []
    for item in items:
      start = tuple(item.mutations[0].start_pos)
      if any(begin <= start < end for begin, end in spans):
        db.set_result(item.job_id, WorkResult(output=ANNOTATION,
                                               worker_outcome=WorkerOutcome.SKIPPED))
      else:
        kept.append(item)
    # Job ids are random: sort by what the mutant is, so that a seed picks the same ones.
    kept.sort(key=lambda i: (tuple(i.mutations[0].start_pos), i.mutations[0].operator_name,
                             i.mutations[0].occurrence))
    chosen = kept
    if 0 < sample < len(kept):
      chosen = random.Random(f"{seed}:{module}").sample(kept, sample)
      picked = {i.job_id for i in chosen}
      for item in kept:
        if item.job_id not in picked:
          db.set_result(item.job_id, WorkResult(output=NOT_SAMPLED,
                                                worker_outcome=WorkerOutcome.SKIPPED))
  return {"generated": len(items), "annotations": len(items) - len(kept),
          "candidates": len(kept), "run": len(chosen),
          "operators": len({i.mutations[0].operator_name for i in items})}


def read_session(session: Path, copy: Path) -> list[tuple[dict, dict | None]]:
  """``cosmic-ray dump``: one (work item, result or None) pair per line."""
  dump = cosmic_ray("cosmic-ray", "dump", str(session), cwd=copy, capture=True)
  if dump.returncode:
    raise SystemExit(f"cosmic-ray dump {session} failed:\n{dump.stderr[-2000:]}")
  return [tuple(json.loads(line)) for line in dump.stdout.splitlines() if line.strip()]


def outcome(result: dict | None) -> str:
  """killed, timeout, survived, incompetent, skipped or pending."""
  if result is None:
    return "pending"
  if result["worker_outcome"] in ("skipped", "no-test"):
    return "skipped"
  if result["worker_outcome"] != "normal" or result["test_outcome"] == "incompetent":
    return "incompetent"
  if result["test_outcome"] == "killed":
    # cosmic-ray counts a run past its timeout as killed, with this as its whole output.
    return "timeout" if result["output"] == "timeout" else "killed"
  return "survived"


def changed_lines(diff: str) -> tuple[str, str]:
  """The line a mutant changed, before and after, without the diff's markers."""
  lines = diff.splitlines()
  old = [s[1:].strip() for s in lines if s.startswith("-") and not s.startswith("---")]
  new = [s[1:].strip() for s in lines if s.startswith("+") and not s.startswith("+++")]
  return " ".join(old), " ".join(new)


def load_verdicts() -> dict[tuple[str, str, str], dict]:
  if not VERDICTS.exists():
    return {}
  with VERDICTS.open("rb") as f:
    entries = tomllib.load(f).get("survivor", [])
  return {(e["module"], e["original"], e["mutated"]): e for e in entries}


def summarise(module: str, pairs: list[tuple[dict, dict | None]]) -> dict:
  by = {}
  for item, result in pairs:
    by.setdefault(outcome(result), []).append((item, result))
  killed = len(by.get("killed", [])) + len(by.get("timeout", []))
  survived = len(by.get("survived", []))
  score = killed / (killed + survived) if killed + survived else math.nan
  return {"module": module, "by": by, "killed": killed, "survived": survived, "score": score}


def run_module(module: str, tests: list[str], args, settings: dict, copy: Path) -> None:
  """Baseline, init, filters, exec and reports for one module; its numbers in a JSON file."""
  config, session = WORK / f"{module}.toml", WORK / f"{module}.sqlite"
  meta_path = WORK / f"{module}.run.json"
  if args.resume:
    if not meta_path.exists():
      raise SystemExit(f"{module}: no session in {WORK} to resume")
    meta = json.loads(meta_path.read_text())
    # cosmic-ray finds a mutant by its operator's occurrence count in the file: in other code
    # the pending work items would mutate other places.
    if meta["module_sha256"] != source_hash(copy, module):
      raise SystemExit(f"{module}: {SOURCE}/{module}.py has changed since the session was "
                       "made; start it again (without --resume)")
    print(f"{module}: resuming the session made at {meta['commit']}", flush=True)
  else:
    write_config(config, module, tests, settings["baseline-timeout"])
    start = time.monotonic()
    base = cosmic_ray("cosmic-ray", "baseline", str(config), cwd=copy, capture=True)
    baseline_s = time.monotonic() - start
    if base.returncode:
      raise SystemExit(f"{module}: the unmutated code fails its tests (cosmic-ray baseline):\n"
                       f"{base.stderr[-4000:]}")
    # A mutant that makes the tests hang or crawl is killed once it takes this long.
    timeout = max(settings["min-timeout"], settings["timeout-factor"] * baseline_s)
    write_config(config, module, tests, timeout)
    session.unlink(missing_ok=True)
    if cosmic_ray("cosmic-ray", "init", str(config), str(session), cwd=copy).returncode:
      raise SystemExit(f"{module}: cosmic-ray init failed")
    counts = mark_skipped(session, copy, module, args.sample, args.seed)
    meta = {"module": module, "tests": tests, "seed": args.seed, "sample": args.sample,
            "baseline_s": round(baseline_s, 1), "timeout_s": round(timeout), **counts,
            "exec_s": 0.0, "label": args.label, "commit": commit(),
            "module_sha256": source_hash(copy, module),
            "date": datetime.date.today().isoformat()}
    print(f"{module}: {meta['generated']} mutants generated, {meta['annotations']} in "
          f"annotations, running {meta['run']} (baseline {meta['baseline_s']:.0f} s, timeout "
          f"{meta['timeout_s']} s)", flush=True)
  # Written before exec too, so that an interrupted run can be resumed.
  meta_path.write_text(json.dumps(meta, indent=1) + "\n")
  start = time.monotonic()
  cosmic_ray("cosmic-ray", "exec", str(config), str(session), cwd=copy)
  meta["exec_s"] = round(meta["exec_s"] + time.monotonic() - start, 1)
  meta_path.write_text(json.dumps(meta, indent=1) + "\n")
  report = cosmic_ray("cr-report", "--surviving-only", "--show-diff", str(session), cwd=copy,
                      capture=True)
  (WORK / f"{module}.report.txt").write_text(report.stdout)
  html = cosmic_ray("cr-html", str(session), cwd=copy, capture=True)
  (WORK / f"{module}.html").write_text(html.stdout)


def source_hash(copy: Path, module: str) -> str:
  return hashlib.sha256((copy / SOURCE / f"{module}.py").read_bytes()).hexdigest()


def commit() -> str:
  head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                        capture_output=True, text=True, check=False).stdout.strip()
  dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "optax_safefactor",
                          "tests"], capture_output=True, text=True, check=False).stdout.strip()
  return head + (" plus uncommitted changes" if dirty else "")


def survivor_verdicts(module: str, s: dict, verdicts: dict) -> dict[str, int]:
  """How many of a module's survivors are equivalent, killed later, or still open."""
  kinds = {"equivalent": 0, "killed-later": 0, "open": 0}
  for _, result in s["by"].get("survived", []):
    verdict = verdicts.get((module, *changed_lines(result["diff"])))
    kinds[verdict["verdict"] if verdict else "open"] += 1
  return kinds


def verdict_score(s: dict, kinds: dict[str, int]) -> float:
  """(killed + killed later) / (killed + survived - equivalent): the non-equivalent killed."""
  counted = s["killed"] + s["survived"] - kinds["equivalent"]
  return (s["killed"] + kinds["killed-later"]) / counted if counted else math.nan


def markdown(results: list[tuple[dict, dict]], verdicts: dict) -> str:
  """The results section of docs/mutation-testing.md."""
  metas = [meta for meta, _ in results]
  labels = sorted({meta["label"] for meta in metas})
  total_s = sum(meta["baseline_s"] + meta["exec_s"] for meta in metas)
  ran = sum(s["killed"] + s["survived"] + len(s["by"].get("incompetent", []))
            for _, s in results)
  per_mutant = sum(meta["exec_s"] for meta in metas) / ran if ran else math.nan
  sampled = any(meta["run"] < meta["candidates"] for meta in metas)
  scope = "a seeded sample, not the full measurement" if sampled else "every mutant"
  out = [f"## Results: {', '.join(labels)} ({scope})",
         "",
         f"Run on {', '.join(sorted({m['date'] for m in metas}))}, at commit "
         f"{', '.join(sorted({m['commit'] for m in metas}))}, with cosmic-ray "
         f"{cosmic_ray_version()}, on a 2-core machine shared with other work. Sample: "
         + ", ".join(f"{m['module']} {m['run']} of {m['candidates']}" for m in metas)
         + f" (seed {', '.join(sorted({str(m['seed']) for m in metas}))}). "
         f"Wall time {total_s / 60:.1f} min in all (baselines included), "
         f"{per_mutant:.1f} s per mutant.", "",
         "| module | mutants (in annotations) | run | killed | survived | of the killed, timeouts "
         "| incompetent "
         "| score | survivors: equivalent, killed later, open | score with the verdicts "
         "| baseline | exec | s per mutant |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for meta, s in results:
    count = s["killed"] + s["survived"] + len(s["by"].get("incompetent", []))
    kinds = survivor_verdicts(meta["module"], s, verdicts)
    out.append(
        f"| {meta['module']} | {meta['generated']} ({meta['annotations']}) | {count} | "
        f"{s['killed']} | {s['survived']} | {len(s['by'].get('timeout', []))} | "
        f"{len(s['by'].get('incompetent', []))} | {s['score']:.0%} | "
        f"{kinds['equivalent']}, {kinds['killed-later']}, {kinds['open']} | "
        f"{verdict_score(s, kinds):.0%} | {meta['baseline_s']:.0f} s "
        f"| {meta['exec_s']:.0f} s | {meta['exec_s'] / count if count else math.nan:.1f} |")
  out += ["", "The score with the verdicts leaves the equivalent mutants out and counts those a "
          "test added since kills as killed: (killed + killed later) / (killed + survived - "
          "equivalent)."]
  out += ["", "Tests per module: " + "; ".join(
      f"{m['module']}: {' '.join(t.removeprefix('tests/') for t in m['tests'])}"
      for m in metas) + ".", ""]
  # Which file's test failed first: what kills the mutants, and whether the order is right.
  for meta, s in results:
    firsts = {}
    for _, result in s["by"].get("killed", []):
      where = first_failure(result["output"]).split("::")[0].removeprefix("tests/")
      firsts[where] = firsts.get(where, 0) + 1
    if firsts:
      out += [f"{meta['module']} killed, first failure in: " + ", ".join(
          f"{where} {n}" for where, n in sorted(firsts.items(), key=lambda kv: -kv[1])) + ".", ""]
  if not any(s["by"].get(kind) for _, s in results for kind in ("survived", "timeout",
                                                                 "incompetent")):
    out += ["No mutant survived, timed out or was incompetent.", ""]
  for meta, s in results:
    for kind in ("survived", "timeout", "incompetent"):
      for item, result in s["by"].get(kind, []):
        mutation = item["mutations"][0]
        line = mutation["start_pos"][0]
        title = f"### {meta['module']}:{line} {mutation['operator_name']} ({kind})"
        if kind == "survived":
          original, mutated = changed_lines(result["diff"])
          verdict = verdicts.get((meta["module"], original, mutated))
          title += (f": {verdict['verdict']}" if verdict else ": open")
          why = [verdict["why"], ""] if verdict else []
        else:
          why = []
        diff = "\n".join(s for s in (result.get("diff") or "").splitlines()
                         if not s.startswith(("--- mutation diff", "---", "+++")))
        out += [title, "", *why, "```diff", diff.strip("\n"), "```", ""]
  return "\n".join(out).rstrip("\n") + "\n"


def cosmic_ray_version() -> str:
  try:
    from importlib.metadata import version
    return version("cosmic-ray")
  except Exception:  # the summary still says what ran, only without the version
    return "?"


RESULTS_HEADING = "## Results: "


def section_label(section: str) -> str:
  """The label a results section was written under: its heading up to the scope."""
  return section.removeprefix(RESULTS_HEADING).split(" (", 1)[0]


def results_sections(region: str) -> list[str]:
  """The results region of the doc, one string per "## Results: <label>" section."""
  sections: list[str] = []
  for line in region.strip("\n").splitlines(keepends=True):
    if line.startswith(RESULTS_HEADING) or not sections:
      sections.append("")
    sections[-1] += line
  return [s.rstrip("\n") + "\n" for s in sections if s.strip()]


def write_doc(new_sections: list[str]) -> None:
  """Replaces the sections of the labels just summarised and keeps every other one.

  Each session's .mutation/ holds only its own runs: a summary written from it must not
  drop the results other sessions measured and wrote down.
  """
  text = DOC.read_text()
  if BEGIN not in text or END not in text:
    raise SystemExit(f"{DOC} lacks the markers {BEGIN} and {END}")
  head, rest = text.split(BEGIN, 1)
  region, tail = rest.split(END, 1)
  replaced = {section_label(s): s for s in new_sections}
  kept = []
  for section in results_sections(region):
    kept.append(replaced.pop(section_label(section), section))
  kept += replaced.values()
  DOC.write_text(f"{head}{BEGIN}\n" + "\n".join(kept) + f"{END}{tail}")


def main(argv: list[str] | None = None) -> int:
  settings = load_settings()
  modules = settings["modules"]
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("modules", nargs="*", metavar="MODULE",
                      help=f"modules of {SOURCE}/: {', '.join(modules)}")
  parser.add_argument("--all", action="store_true", help="every module in the settings file")
  parser.add_argument("--sample", type=int, default=0,
                      help="mutants per module, a seeded sample (0, the default: all)")
  parser.add_argument("--seed", type=int, default=settings["seed"])
  parser.add_argument("--label", default="measurement", help="what this run is, for the doc")
  parser.add_argument("--count", action="store_true",
                      help="only generate the work items (cosmic-ray init) and count them")
  parser.add_argument("--baseline", action="store_true",
                      help="with --count: time each module's unmutated tests too")
  parser.add_argument("--resume", action="store_true",
                      help="run what an earlier session left pending, then report")
  parser.add_argument("--summarise", action="store_true",
                      help="run nothing: the doc from the sessions already in .mutation/")
  parser.add_argument("--no-doc", action="store_true", help=f"do not rewrite {DOC.name}")
  args = parser.parse_args(argv)
  chosen = list(modules) if args.all else args.modules
  unknown = set(chosen) - set(modules)
  if unknown or not chosen:
    parser.error(f"name modules from {', '.join(modules)} (or --all); unknown: "
                 f"{', '.join(sorted(unknown))}")
  WORK.mkdir(exist_ok=True)

  with tempfile.TemporaryDirectory(prefix="mutation-score-") as tmp:
    copy = Path(tmp) / "repo"
    copy_tree(None, copy)
    location = package_location(copy)
    if not location.startswith(str(copy)):
      print(f"the copy imports the package from {location}, not from {copy}", file=sys.stderr)
      return 2
    if args.count:
      return count(chosen, copy, Path(tmp), settings, args.baseline)
    results = []
    for module in chosen:
      if not args.summarise:
        run_module(module, modules[module]["tests"], args, settings, copy)
      meta_path = WORK / f"{module}.run.json"
      if not meta_path.exists():
        print(f"{module}: no session in {WORK}; run it first", file=sys.stderr)
        continue
      s = summarise(module, read_session(WORK / f"{module}.sqlite", copy))
      results.append((json.loads(meta_path.read_text()), s))
      pending = len(s["by"].get("pending", []))
      print(f"{module}: score {s['score']:.0%} ({s['killed']} killed, {s['survived']} survived"
            f"; {len(s['by'].get('timeout', []))} of the killed by timeout, "
            f"{len(s['by'].get('incompetent', []))} incompetent"
            + (f", {pending} still pending: --resume" if pending else "") + ")", flush=True)
      for item, result in s["by"].get("survived", []):
        mutation = item["mutations"][0]
        print(f"  survived {mutation['start_pos'][0]}: {mutation['operator_name']}: "
              f"{' -> '.join(changed_lines(result['diff']))}")
  if results and not args.no_doc:
    verdicts = load_verdicts()
    by_label: dict[str, list] = {}
    for meta, s in results:
      by_label.setdefault(meta["label"], []).append((meta, s))
    write_doc([markdown(group, verdicts) for group in by_label.values()])
    print(f"wrote {DOC.relative_to(REPO)}")
  return 0


def count(modules: list[str], copy: Path, tmp: Path, settings: dict, baseline: bool) -> int:
  """``cosmic-ray init`` per module and the annotation filter: how many mutants there are.

  With ``baseline``, also ``cosmic-ray baseline``: the tests' wall time, and the time a full
  run would take if every mutant ran every test (survivors do; a killed mutant stops at its
  first failure, so a real run is shorter).
  """
  print(f"{'module':<12} {'operators':>9} {'generated':>9} {'annotations':>11} {'to run':>6}"
        + (f" {'baseline':>8} {'at most':>8}" if baseline else ""))
  for module in modules:
    config, session = tmp / f"{module}.toml", tmp / f"{module}.sqlite"
    write_config(config, module, settings["modules"][module]["tests"],
                 settings["baseline-timeout"])
    if cosmic_ray("cosmic-ray", "init", str(config), str(session), cwd=copy).returncode:
      raise SystemExit(f"{module}: cosmic-ray init failed")
    counts = mark_skipped(session, copy, module, 0, 0)
    line = (f"{module:<12} {counts['operators']:>9} {counts['generated']:>9} "
            f"{counts['annotations']:>11} {counts['candidates']:>6}")
    if baseline:
      start = time.monotonic()
      base = cosmic_ray("cosmic-ray", "baseline", str(config), cwd=copy, capture=True)
      seconds = time.monotonic() - start
      line += (f" {seconds:>7.0f}s {counts['candidates'] * seconds / 3600:>7.1f}h" if
               base.returncode == 0 else "   FAILED (its tests fail unmutated)")
    print(line, flush=True)
    session.unlink()
  return 0


if __name__ == "__main__":
  sys.exit(main())
