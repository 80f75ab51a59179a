"""Run mutmut over the model and the implementation's tree and controller, then report the kill rate.

    python tests/quality/mutants/run_mutants.py [--every N] [--seed S] [--jobs J] [--keep] [PATTERN ...]

``nox -s mutants -- ARGS`` runs this with ARGS in a fresh virtualenv. What is mutated and which tests run
per mutant is ``[tool.mutmut]`` in pyproject.toml; tests/quality/mutants/README.md has the figures.

* PATTERN: mutmut mutant names or globs (``'refcache.model._pure.*'``, ``'*HiRadixCache*evict*'``);
  none means every mutant.
* ``--every N``: a systematic sample — every N-th mutant of the (pattern-filtered) population in source
  order, starting at an offset drawn from ``--seed``. The report then gives a 95% Wilson interval.
* ``--keep``: reuse ``mutants/`` from the last run (mutmut keeps verdicts and re-tests only what changed);
  by default it is removed first so that every run starts from the current source.

The report (per file: mutants, killed, survived, timeout, no tests, kill rate) is printed and written to
``mutants/report.json`` together with the surviving mutants' names; ``mutmut show NAME`` prints a diff.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKDIR = Path("mutants")

# mutmut's exit-code verdicts (mutmut/stats.py); anything else is "suspicious".
STATUS = {
    1: "killed",
    3: "killed",
    0: "survived",
    5: "no tests",
    33: "no tests",
    34: "skipped",
    35: "suspicious",
    36: "timeout",
    37: "type check",
    -24: "timeout",
    24: "timeout",
    152: "timeout",
    255: "timeout",
    -11: "segfault",
    -9: "segfault",
}
COLUMNS = ("killed", "survived", "timeout", "no tests", "other", "not checked")

# Generate the mutants without running anything, the first steps of ``mutmut run`` (mutmut 3.8).
GENERATE = """
import os
from mutmut.__main__ import create_mutants
from mutmut.mutation.trampoline import set_mutant_under_test
from mutmut.utils.file_utils import copy_also_copy_files, copy_src_dir, setup_source_paths
set_mutant_under_test("mutant_generation")
os.makedirs("mutants", exist_ok=True)
copy_src_dir()
copy_also_copy_files()
setup_source_paths()
create_mutants(int(os.environ["MUTANTS_JOBS"]))
"""


def _order(name: str) -> tuple[str, int]:
    base, _, number = name.rpartition("__mutmut_")
    return base, int(number)


def load_results() -> dict[str, dict[str, int | None]]:
    """Source file -> {mutant name: exit code (None: not checked)}, from mutmut's ``.meta`` files."""
    results: dict[str, dict[str, int | None]] = {}
    for meta in sorted(WORKDIR.glob("refcache/**/*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        if codes:
            results[str(meta.relative_to(WORKDIR))[: -len(".meta")]] = codes
    return results


def status(code: int | None) -> str:
    if code is None:
        return "not checked"
    verdict = STATUS.get(code, "other")
    return verdict if verdict in COLUMNS else "other"


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def report(selected: set[str] | None, *, sampled: bool, wall_s: float, population: int) -> dict[str, object]:
    rows: dict[str, dict[str, int]] = {}
    survivors: dict[str, list[str]] = {}
    for path, codes in load_results().items():
        names = [n for n in codes if selected is None or n in selected]
        if not names:
            continue
        row = dict.fromkeys(COLUMNS, 0)
        for name in sorted(names, key=_order):
            verdict = status(codes[name])
            row[verdict] += 1
            if verdict in ("survived", "no tests", "other"):
                survivors.setdefault(verdict, []).append(name)
        rows[path] = row
    total = {c: sum(r[c] for r in rows.values()) for c in COLUMNS}
    rows["TOTAL"] = total

    def rate(r: dict[str, int]) -> str:
        checked = sum(r[c] for c in COLUMNS if c != "not checked")
        dead = r["killed"] + r["timeout"]
        return f"{100 * dead / checked:5.1f}%" if checked else "    -"

    width = max(len(p) for p in rows)
    head = f"{'file':<{width}}  {'mutants':>7}  " + "  ".join(f"{c:>11}" for c in COLUMNS) + "  kill rate"
    print(head)
    print("-" * len(head))
    for path, r in rows.items():
        n = sum(r.values())
        print(f"{path:<{width}}  {n:>7}  " + "  ".join(f"{r[c]:>11}" for c in COLUMNS) + f"  {rate(r):>9}")
    checked = sum(total[c] for c in COLUMNS if c != "not checked")
    dead = total["killed"] + total["timeout"]
    lo, hi = wilson(dead, checked)
    print(
        f"\nkill rate (killed + timeout over checked): {dead}/{checked}, 95% Wilson interval {lo:.1%}-{hi:.1%}"
    )
    if sampled:
        print(f"sample of {sum(total.values())} out of {population} mutants")
    print(f"wall time of the run: {wall_s / 60:.1f} min")
    data: dict[str, object] = {
        "rows": rows,
        "killed_or_timeout": dead,
        "checked": checked,
        "wilson95": [lo, hi],
        "sampled": sampled,
        "population": population,
        "wall_s": wall_s,
        "survivors": survivors,
    }
    (WORKDIR / "report.json").write_text(json.dumps(data, indent=2))
    print(f"survivors by verdict in {WORKDIR / 'report.json'}; show one with: mutmut show NAME")
    return data


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("patterns", nargs="*", help="mutant names or globs; none: every mutant")
    parser.add_argument("--every", type=int, default=0, help="systematic sample: every N-th mutant")
    parser.add_argument("--seed", type=int, default=0, help="picks the sample's offset")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="mutmut --max-children")
    parser.add_argument("--keep", action="store_true", help="reuse mutants/ and its verdicts")
    args = parser.parse_args(argv)

    if not args.keep and WORKDIR.exists():
        shutil.rmtree(WORKDIR)
    traces = tempfile.mkdtemp(prefix="refcache-mutant-traces-")  # killed mutants write divergence traces
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "REFCACHE_TRACE_DIR": traces,
        "MUTANTS_JOBS": str(args.jobs),
        # One mutant per core: torch must not start its own thread pool in every worker.
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "REFCACHE_MUTANTS": "1",
    }
    start = time.monotonic()
    selected: set[str] | None = None
    population = 0
    targets: list[str] = list(args.patterns)
    if args.every or args.patterns:
        subprocess.run([sys.executable, "-c", GENERATE], env=env, check=True, stdout=subprocess.DEVNULL)
        everyone = sorted((n for codes in load_results().values() for n in codes), key=_order)
        pool = [n for n in everyone if not args.patterns or any(fnmatch.fnmatch(n, p) for p in args.patterns)]
        if not pool:
            print(f"no mutant matches {args.patterns}", file=sys.stderr)
            return 2
        population = len(pool)
        if args.every > 1:
            offset = random.Random(args.seed).randrange(args.every)
            pool = pool[offset :: args.every]
            targets = pool
            print(f"sample: every {args.every}th of {population} mutants from offset {offset}: {len(pool)}")
        selected = set(pool)
    mutmut = str(Path(sys.executable).with_name("mutmut"))  # the virtualenv's, whatever PATH says
    code = subprocess.run([mutmut, "run", "--max-children", str(args.jobs), *targets], env=env).returncode
    wall_s = time.monotonic() - start
    shutil.rmtree(traces, ignore_errors=True)
    print()
    if selected is None:
        population = sum(len(c) for c in load_results().values())
    report(selected, sampled=args.every > 1, wall_s=wall_s, population=population)
    return code


if __name__ == "__main__":
    # mutmut spells its verdicts with emoji; keep the pass-through output readable in any locale.
    sys.stdout.reconfigure(errors="replace")  # type: ignore[union-attr]
    raise SystemExit(main(sys.argv[1:]))
