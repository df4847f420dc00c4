"""Plant known bugs one at a time and check that the tests meant to catch each one fail.

    .venv/bin/python tools/mutate.py                 every mutant in tools/mutants.toml
    .venv/bin/python tools/mutate.py --only a,b      the named mutants
    .venv/bin/python tools/mutate.py --list          the mutants and the tests that should kill them
    .venv/bin/python tools/mutate.py --json out.json ...and write the results as JSON

Run it before a release: a mutant that survives is a bug the suite would ship. Each mutant is a
plain text replacement (its ``old`` text must occur exactly once in its file, so a drifted
mutant is reported instead of silently planting nothing) applied to a private copy of the
working tree (``.git`` and ``.venv`` left out); the mutant's tests run there with this
interpreter, the copy's core and plugins first on the import path. Before the mutants, the same
tests run on the unmodified copy: a test that fails there cannot tell anything, and the run
stops. A mutant is *killed* when its tests fail, *survived* when they pass, and *timeout* when
they run past ``--timeout`` (counted as not killed: a hang is not a catch).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "tools" / "mutants.toml"
PLUGINS = ("plugins/nvidia_sm100", "plugins/ascend_950")


@dataclass
class Mutant:
    name: str
    file: str
    old: str
    new: str
    tests: list[str]
    why: str = ""


@dataclass
class Result:
    name: str
    outcome: str  # killed | survived | timeout
    seconds: float
    failed: str = ""  # the first failing test, as pytest names it


def load(path: Path = MUTANTS) -> list[Mutant]:
    data = tomllib.loads(path.read_text())
    mutants = [Mutant(name=name, **fields) for name, fields in data.items()]
    for m in mutants:
        if not m.tests:
            raise SystemExit(f"{path}: mutant {m.name!r} names no tests")
    return mutants


def check_applies(mutant: Mutant, root: Path) -> str | None:
    """Why ``mutant`` cannot be planted in ``root``, or None."""
    path = root / mutant.file
    if not path.is_file():
        return f"{mutant.file} does not exist"
    count = path.read_text().count(mutant.old)
    if count != 1:
        return f"its old text occurs {count} times in {mutant.file} (must be exactly once): update tools/mutants.toml"
    if mutant.old == mutant.new:
        return "its old and new texts are the same"
    return None


def copy_tree(dest: Path) -> None:
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache"))


def run_tests(tree: Path, tests: list[str], timeout: float) -> tuple[str, float, str]:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *(str(tree / p) for p in PLUGINS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--no-header", "-rf", *tests]
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, ""
    seconds = time.monotonic() - start
    failed = next((line.split(" ", 1)[1].split(" - ")[0] for line in done.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))), "")
    if done.returncode == 0:
        return "passed", seconds, ""
    if done.returncode == 5:  # no tests collected: the mutant's test names are stale
        raise SystemExit(f"no tests collected for {' '.join(tests)}: update tools/mutants.toml\n{done.stdout[-2000:]}")
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "(no output)"
    return "failed", seconds, failed or last


def mutate(mutants: list[Mutant], timeout: float, progress=print) -> list[Result]:
    problems = [f"{m.name}: {why}" for m in mutants if (why := check_applies(m, ROOT))]
    if problems:
        raise SystemExit("cannot plant:\n  " + "\n  ".join(problems))
    results = []
    with tempfile.TemporaryDirectory(prefix="deepinfer-mutate-") as tmp:
        tree = Path(tmp) / "tree"
        copy_tree(tree)
        baseline = sorted({t for m in mutants for t in m.tests})
        progress(f"baseline: {len(baseline)} test selections on the unmodified tree ...")
        status, seconds, failed = run_tests(tree, baseline, timeout * 4)
        if status != "passed":
            raise SystemExit(f"the tests fail without any mutant ({status}: {failed}); fix them first")
        progress(f"baseline passed in {seconds:.0f} s")
        for i, m in enumerate(mutants, 1):
            path = tree / m.file
            original = path.read_text()
            path.write_text(original.replace(m.old, m.new, 1))
            try:
                status, seconds, failed = run_tests(tree, m.tests, timeout)
            finally:
                path.write_text(original)
            outcome = {"failed": "killed", "passed": "survived"}.get(status, status)
            results.append(Result(m.name, outcome, round(seconds, 1), failed))
            progress(f"[{i}/{len(mutants)}] {outcome:8s} {m.name} ({seconds:.0f} s){'  by ' + failed if failed else ''}")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated mutant names")
    ap.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mutant's tests (default 600)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    mutants = load()
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {m.name for m in mutants})
        if unknown:
            ap.error(f"unknown mutants {unknown}; --list shows them")
        mutants = [m for m in mutants if m.name in names]
    if args.list:
        for m in mutants:
            print(f"{m.name}: {m.file}: {m.why}\n    tests: {' '.join(m.tests)}")
        return 0
    results = mutate(mutants, args.timeout)
    killed = sum(r.outcome == "killed" for r in results)
    print(f"\nscore: {killed} of {len(results)} mutants killed ({100 * killed / max(len(results), 1):.0f}%)")
    for r in results:
        if r.outcome != "killed":
            print(f"  {r.outcome}: {r.name}")
    if args.json:
        args.json.write_text(json.dumps({"killed": killed, "total": len(results), "results": [asdict(r) for r in results]}, indent=2))
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
