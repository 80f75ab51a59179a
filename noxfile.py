"""nox sessions: ``nox`` runs lint, typecheck, tests, contracts and coverage; fuzz, bench, gpu are opt-in.

Every session builds its own pip virtualenv from scratch. Sessions that need torch install the local CPU
wheel (``torch==2.13.0``) before the project, so pip never resolves a CUDA build; sessions that only touch
the pure-Python model install the project without dependencies.
"""

from __future__ import annotations

import os

import nox

nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "virtualenv"  # pip sees the local torch wheel; uv does not
nox.options.download_python = "never"  # no interpreter downloads on these machines
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "typecheck", "tests", "contracts", "coverage"]

PY = ["3.11"]  # the only interpreter the CPU torch wheel exists for
TORCH = "torch==2.13.0"
CPU_ENV = {"TRITON_INTERPRET": "1"}  # Triton kernels run on the CPU interpreter when there is no GPU


def _install_model_only(session: nox.Session, *extra: str) -> None:
    session.install("hypothesis>=6.150", "typer>=0.12", "rich>=13", *extra)
    session.install("--no-deps", "-e", ".")


@nox.session(python=PY, tags=["static"])
def lint(session: nox.Session) -> None:
    """ruff (lint + format check) and the layering contracts of import-linter."""
    _install_model_only(session, "ruff>=0.6", "import-linter>=2.1")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports")


@nox.session(python=PY, tags=["static"])
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the package, the tests, the benchmarks and this file."""
    session.install(TORCH)
    session.install("-e", ".[test,typecheck]")
    session.run("mypy", "--strict", "refcache", "tests", "bench", "noxfile.py")


@nox.session(python=PY, tags=["fast"])
def tests(session: nox.Session) -> None:
    """pytest on two workers: unit, properties (model state machines), gpu (CPU interpreter), regressions."""
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", "-n", "2", "--durations=10", *session.posargs, env=CPU_ENV)


@nox.session(python=PY, tags=["slow"])
def contracts(session: nox.Session) -> None:
    """CrossHair over the pure functions of the model, with bounded per-condition time."""
    _install_model_only(session, "crosshair-tool>=0.0.100")
    session.run(
        "crosshair",
        "check",
        "refcache/model/_pure.py",
        "--analysis_kind=PEP316",
        "--per_condition_timeout=8",
        "--max_uninteresting_iterations=40",
    )


@nox.session(python=PY, tags=["fast"])
def coverage(session: nox.Session) -> None:
    """Print which node states, transitions and in-flight table events the default run reaches."""
    _install_model_only(session)
    session.run("refcache", "coverage", "--examples", "150")


@nox.session(python=PY, default=False)
def fuzz(session: nox.Session) -> None:
    """Long randomized runs, model and implementation side by side (derandomize off):
    ``nox -s fuzz -- --minutes 30``."""
    session.install(TORCH)  # the default --against both drives the implementation
    session.install("-e", ".")
    session.run("refcache", "fuzz", *(session.posargs or ["--minutes", "10"]), env=CPU_ENV)


@nox.session(python=PY, default=False)
def bench(session: nox.Session) -> None:
    """Benchmarks that report ratios measured side by side in one run."""
    session.install(TORCH)
    session.install("-e", ".")
    for script in sorted(os.listdir("bench")):
        if script.startswith("bench_") and script.endswith(".py"):
            session.run("python", f"bench/{script}", *session.posargs)


@nox.session(python=PY, default=False)
def gpu(session: nox.Session) -> None:
    """On a CUDA machine: the data-plane tests natively (no interpreter) and the kernel benchmarks."""
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", "tests/gpu", "-x", *session.posargs)


@nox.session(python=PY, default=False)
def mutants(session: nox.Session) -> None:
    """Mutation testing (mutmut) of the model and the tree and controller: ``nox -s mutants -- --every 10``."""
    session.install(TORCH)
    session.install("-e", ".[test,mutants]")
    session.run("python", "tests/quality/mutants/run_mutants.py", *session.posargs)


SGLANG = "sglang==0.5.20"
SGLANG_CONSTRAINTS = "constraints/sglang-0.5.20.txt"


@nox.session(python=PY, tags=["engines"])
def sglang(session: nox.Session) -> None:
    """SGLang 0.5.20's own HiCache against the model (tests/engines/sglang): torch (CPU) first, the SGLang
    wheel without its GPU dependencies, then only what its HiCache modules import (the ``sglang`` extra,
    pinned by constraints/sglang-0.5.20.txt, which also holds torch), then refcache and pytest."""
    session.install(TORCH)
    session.install("--no-deps", SGLANG)
    session.install("-c", SGLANG_CONSTRAINTS, "-e", ".[sglang,test]")
    session.run(
        "pytest",
        "tests/engines/sglang",
        "-n",
        "2",
        "-rP",
        "--durations=10",
        *session.posargs,
        env={"REFCACHE_ENGINE_TESTS": "sglang", "PYTHONWARNINGS": "ignore"},
    )


@nox.session(python=PY, default=False)
def sglang_latest(session: nox.Session) -> None:
    """Which SGLang the registry has now, and whether the modules the adapter drives are still there
    (0.5.23 moved HiCache to UnifiedRadixCache: specs/sglang-adapter.md)."""
    session.install(TORCH)
    session.install("--no-deps", "--upgrade", "sglang")
    session.run("python", "-m", "refcache.engines.sglang.latest", external=False)


# In every default run (CI): nothing there is skipped for lack of SGLang.
nox.options.sessions.append("sglang")
