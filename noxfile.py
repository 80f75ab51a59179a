"""refcache's nox sessions: ``nox`` runs the fast set, ``nox -t ci`` the full set that CI runs.

- ``nox``: the fast set, for contributors before a commit (tag ``fast``): lint, typecheck, unit (2 to 6
  minutes from a fresh clone on a 2-core machine, quiet to busy; README has the figures).
- ``nox -t ci``: the full set, what ``.ci/run`` runs on a fresh machine (tag ``ci``): lint, typecheck, tests,
  contracts, coverage, portable (3.12 and 3.13), sglang, sglang_latest, vllm, lmcache. The engine sessions
  download the engines' wheels.
- Opt-in, by name (``nox -s NAME``): fuzz, explore, bench, gpu, mutants, sglang_macro, sglang_releases.

Every session builds its own pip virtualenv from scratch. Sessions that need torch install the local CPU
wheel (``torch==2.13.0``) before the project, so pip never resolves a CUDA build; sessions that only touch
the pure-Python model install the project without dependencies. On CI each session of the full set removes
its environment when it ends (``_ci_session``), so the set needs one environment's disk at a time.
"""

from __future__ import annotations

import functools
import glob
import importlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import nox
from nox.command import CommandFailed

nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "virtualenv"  # pip sees the local torch wheel; uv does not
nox.options.download_python = "never"  # no interpreter downloads on these machines
nox.options.error_on_missing_interpreters = True
# `nox` alone: the fast set (the sessions tagged "fast"; tests/unit/test_noxfile.py holds the two equal)
nox.options.sessions = ["lint", "typecheck", "unit"]


SessionFunc = Callable[[nox.Session], None]


def _ci_session(*, python: list[str], tags: list[str]) -> Callable[[SessionFunc], SessionFunc]:
    """``nox.session`` for a session of the full set: on CI (``CI`` set, as on .ci/run's machine and on
    GitHub's runners) the session's virtualenv is removed when the session ends, passed or failed.

    The full set builds eleven environments, seven of them with torch and triton (2 to 3 GB each with the
    engines' imports); kept to the end, they filled a CI machine's disk at the ninth (stop 35: "No space
    left on device" installing torch for ``sglang``). Removed, the set needs one environment's disk at a
    time. Off CI they stay for inspection (nox rebuilds them from scratch on the next run either way)."""

    def register(func: SessionFunc) -> SessionFunc:
        @functools.wraps(func)
        def run(session: nox.Session) -> None:
            try:
                func(session)
            finally:
                location = getattr(session.virtualenv, "location", None)
                if os.environ.get("CI") and isinstance(location, str) and Path(location).is_dir():
                    shutil.rmtree(location, ignore_errors=True)
                    session.log(f"removed {location} (CI: one environment's disk at a time)")

        registered: SessionFunc = nox.session(python=python, tags=tags)(run)
        return registered

    return register


PY = ["3.11"]  # the only interpreter the CPU torch wheel exists for
# The pure-Python part (model, checking side, simulator) also runs where there is no torch wheel. 3.10
# cannot even import it: enum.StrEnum and typing.Self are 3.11+ (pyproject.toml: requires-python).
PORTABLE_PY = ["3.12", "3.13"]


def _expose_pyenv_interpreters(versions: list[str]) -> None:
    """pyenv installs these interpreters but its shims refuse every version that is not ``pyenv global``
    ("python3.12: command not found"), and nox finds the shim first. Put links to the real executables in
    front of PATH (only ``pythonX.Y`` themselves, so that ``python3`` stays what it was)."""
    links = Path(".nox", "interpreters")
    for version in versions:
        found = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")))
        if not found:
            continue  # not a pyenv machine: nox looks on PATH as usual
        links.mkdir(parents=True, exist_ok=True)
        link = links / f"python{version}"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(found[-1])
    if links.is_dir():
        os.environ["PATH"] = f"{links.resolve()}{os.pathsep}{os.environ['PATH']}"


_expose_pyenv_interpreters(PORTABLE_PY)
# The torch-free tests, explicitly: the model, invariants, states, ops, trace, hashing and config units,
# shrink and simulate against the model, and the command line (its tests that start the implementation
# skip without torch, as do the plot's without matplotlib); the model machines run as `refcache coverage`
# below (their full budget runs in `tests`). None of them imports torch, and torch is not installed here:
# an import would fail the session.
PORTABLE_TESTS = [
    "tests/unit/test_model_scenarios.py",
    "tests/unit/test_invariants.py",
    "tests/unit/test_states.py",
    "tests/unit/test_ops.py",
    "tests/unit/test_trace.py",
    "tests/unit/test_hashing.py",
    "tests/unit/test_config.py",
    "tests/unit/test_pure_functions.py",
    "tests/unit/test_shrink.py",
    "tests/unit/test_simulate.py",
    "tests/unit/test_cli.py",
    "tests/unit/test_bundled_trace.py",
    "tests/unit/test_family.py",
    "tests/unit/test_answers.py",
    "tests/unit/test_import_cycles.py",
    "tests/unit/test_admission.py",
    "tests/unit/test_package_maps.py",
    "tests/unit/test_errors.py",
    "tests/unit/test_cli_options.py",
    "tests/unit/test_cli_plan.py",
    "tests/unit/test_cli_replay.py",
    "tests/unit/test_cli_seed.py",
    "tests/unit/test_cli_engines.py",
    "tests/conformance/test_toy_engine.py",
]
TORCH = "torch==2.13.0"
CPU_ENV = {"TRITON_INTERPRET": "1"}  # Triton kernels run on the CPU interpreter when there is no GPU


def _install_model_only(session: nox.Session, *extra: str) -> None:
    session.install("hypothesis>=6.150", "typer>=0.12", "rich>=13", *extra)
    session.install("--no-deps", "-e", ".")


@_ci_session(python=PY, tags=["fast", "ci"])
def lint(session: nox.Session) -> None:
    """ruff (lint and format check) and import-linter's layering contracts."""
    _install_model_only(session, "ruff>=0.6", "import-linter>=2.1")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports")


@_ci_session(python=PY, tags=["fast", "ci"])
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the package, the tests, the benchmarks and this file."""
    session.install(TORCH)
    session.install("-e", ".[test,typecheck]")
    session.run("mypy", "--strict", "refcache", "tests", "bench", "noxfile.py")


# REFCACHE_NATIVE=require: a C fast path that fails to build fails the run instead of leaving only its torch
# fallback tested (refcache/gpu/native.py; the fallbacks have tests of their own)
TEST_ENV = {**CPU_ENV, "REFCACHE_NATIVE": "require"}
# The fast set's tests: every module's unit tests and the regression traces (about 1 min of pytest on two
# workers); the state machines, the data plane, the implementation and the bug zoo run in `tests`.
UNIT_TESTS = ["tests/unit", "tests/regressions"]


@nox.session(python=PY, tags=["fast"])
def unit(session: nox.Session) -> None:
    """pytest on two workers over tests/unit and tests/regressions (the fast set's tests).

    ``tests`` runs these too, with the rest, in the full set."""
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", "-n", "2", "--durations=10", *(session.posargs or UNIT_TESTS), env=TEST_ENV)


@_ci_session(python=PY, tags=["ci"])
def tests(session: nox.Session) -> None:
    """pytest on two workers over every folder of tests/ but engines.

    unit, properties (model state machines), gpu (CPU interpreter), impl, quality (the bug zoo),
    regressions."""
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", "-n", "2", "--durations=10", *session.posargs, env=TEST_ENV)


@_ci_session(python=PY, tags=["ci"])
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


@_ci_session(python=PY, tags=["ci"])
def coverage(session: nox.Session) -> None:
    """Print which node states, transitions and in-flight table events 150 examples of each machine reach."""
    _install_model_only(session)
    session.run("refcache", "coverage", "--examples", "150")


@_ci_session(python=PORTABLE_PY, tags=["ci"])
def portable(session: nox.Session) -> None:
    """The torch-free tests and commands on Python 3.12 and 3.13.

    The project without its dependencies, plus the pure-Python ones (no torch, triton, numpy or
    matplotlib); jsonschema too, so that the trace schema's tests run here as well."""
    _install_model_only(session, "pytest>=8", "jsonschema>=4")
    session.run(
        "python",
        "-c",
        "import sys, refcache.cli, refcache.model, refcache.sim, refcache.check.machines, refcache.conformance, "
        "refcache.hicache, refcache.vllm.family; "
        "assert not {'torch', 'triton', 'numpy'} & set(sys.modules), sorted(sys.modules)",
    )
    session.run("pytest", "-p", "no:cacheprovider", "-q", *PORTABLE_TESTS, *session.posargs)
    # 20 examples do not reach every state: exit 1 (something not reached) is expected, 2 would be an error.
    session.run("refcache", "coverage", "--examples", "20", success_codes=[0, 1])
    for trace in sorted(os.listdir("tests/regressions")):
        if trace.endswith(".jsonl"):
            session.run("refcache", "replay", f"tests/regressions/{trace}", "--against", "model", "-q")


@nox.session(python=PY, default=False)
def fuzz(session: nox.Session) -> None:
    """Long randomized runs, model and implementation side by side: ``nox -s fuzz -- --minutes 30``.

    Derandomize off: every run draws fresh examples."""
    session.install(TORCH)  # the default --against both drives the implementation
    session.install("-e", ".")
    session.run("refcache", "fuzz", *(session.posargs or ["--minutes", "10"]), env=CPU_ENV)


@nox.session(python=PY, default=False)
def explore(session: nox.Session) -> None:
    """Every operation sequence to depth 8 on the smallest L3 write-back configuration: ``nox -s explore``.

    The model alone, no torch (specs/exploration.md has the figures: a few minutes on one core); another
    depth or configuration: ``nox -s explore -- --depth 9 --tp-size 2``."""
    _install_model_only(session)
    session.run("refcache", "explore", *(session.posargs or ["--depth", "8"]))


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
    """On a CUDA machine: the data-plane tests natively (no interpreter).

    A GPU machine without network or nox runs the same from the repository root with its own torch
    (README): ``PYTHONPATH=. python3 -m pytest tests/gpu -q && PYTHONPATH=. python3 bench/bench_transfer.py``."""
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", "tests/gpu", "-x", *session.posargs)


@nox.session(python=PY, default=False)
def mutants(session: nox.Session) -> None:
    """Mutation testing (mutmut) of the model, the tree and the controller: ``nox -s mutants -- --every 10``."""
    session.install(TORCH)
    session.install("-e", ".[test,mutants]")
    session.run("python", "tests/quality/mutants/run_mutants.py", *session.posargs)


# _NO_DEPS_LAST: an engine wheel is installed without its dependencies (they are the GPU stack), so its
# requirements stay unmet. After every install that resolves dependencies, pip checks the installed packages
# that depend on what it just installed and prints "ERROR: ... requires ..., which is not installed" for each
# unmet requirement: the environment works, but the log looks broken. A --no-deps install skips that check,
# so the engine sessions install everything that resolves first and the --no-deps wheels last; after them
# nothing more is installed (tests/unit/test_noxfile.py holds every session to this order).
SGLANG = "sglang==0.5.20"
SGLANG_CONSTRAINTS = "constraints/sglang-0.5.20.txt"


@_ci_session(python=PY, tags=["ci", "engines"])
def sglang(session: nox.Session) -> None:
    """SGLang 0.5.20's own HiCache against the model (tests/engines/sglang).

    Torch (CPU) first, then refcache, pytest and only what SGLang's HiCache modules import (the ``sglang``
    extra, pinned by constraints/sglang-0.5.20.txt, which also holds torch), then the SGLang wheel without
    its GPU dependencies, last (``_NO_DEPS_LAST``)."""
    session.install(TORCH)
    session.install("-c", SGLANG_CONSTRAINTS, "-e", ".[sglang,test]")
    session.install("--no-deps", SGLANG)
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


@nox.session(python=PY, tags=["engines"], default=False)
def sglang_macro(session: nox.Session) -> None:
    """SGLang 0.5.20 against the model with the multi-step draws of issue #30 (opt-in, not in CI).

    The macro kinds (several loads in flight, a prefetch below a non-root anchor, a split, each with the
    eviction after) under 0.5.20's profile, on one rank, with L3, and on two ranks with L3
    (tests/engines/sglang/test_macro_kinds.py): about three times the ``sglang`` session's time per example.
    The same install as ``sglang``."""
    session.install(TORCH)
    session.install("-c", SGLANG_CONSTRAINTS, "-e", ".[sglang,test]")
    session.install("--no-deps", SGLANG)
    session.run(
        "pytest",
        "tests/engines/sglang/test_macro_kinds.py",
        "-n",
        "2",
        "-rP",
        *session.posargs,
        env={"REFCACHE_ENGINE_TESTS": "sglang", "REFCACHE_SGLANG_MACRO": "1", "PYTHONWARNINGS": "ignore"},
    )


SGLANG_LATEST = "sglang==0.5.23"
SGLANG_LATEST_CONSTRAINTS = "constraints/sglang-0.5.23.txt"
# What 0.5.23's HiCache modules and the calls the adapter makes import: each added because an import failed
# without it, in a fresh venv (specs/sglang-adapter.md, "Newer releases"); pinned by its constraints file.
SGLANG_LATEST_IMPORTS = [
    "numpy", "triton", "transformers", "orjson", "psutil", "pybase64", "requests", "pillow", "starlette",
    "msgspec", "pyzmq", "IPython", "aiohttp", "apache-tvm-ffi", "dill", "sentencepiece", "compressed-tensors",
    "gguf", "openai", "partial_json_parser",
]  # fmt: skip
# The adapter's version-neutral tests (they pick the adapter of the installed release), and the recorder on
# UnifiedRadixCache (test_record_unified.py, 8 tests, 55 s on 0.5.23 here); the rest of tests/engines/sglang
# (HiRadixCache's recording, the zoo) drives 0.5.20's HiRadixCache only. Two ranks run on 0.5.23's Unified
# under its profile (test_differential's ..._with_two_ranks_under_the_sglang_profile, about 2 minutes here) and
# under refcache's decisions (..._with_two_ranks, 60 examples in 265 s here since the replays that explain a
# divergence reuse a second pooled set of rank workers; it was deselected when each replay started its own and
# a run was past 30 minutes).
SGLANG_LATEST_TESTS = [
    "tests/engines/sglang/test_adapter_ops.py",
    "tests/engines/sglang/test_differential.py",
    "tests/engines/sglang/test_catches_and_replays.py",
    "tests/engines/sglang/test_fidelity_0522.py",
    "tests/engines/sglang/test_load_slots.py",
    "tests/engines/sglang/test_unified_compat.py",
    "tests/engines/sglang/test_unified_l3_findings.py",
    "tests/engines/sglang/test_unified_l3.py",
    "tests/engines/sglang/test_record_unified.py",
    "tests/engines/sglang/test_record_releases.py",
]


@_ci_session(python=PY, tags=["ci", "engines"])
def sglang_latest(session: nox.Session) -> None:
    """SGLang 0.5.23 (``UnifiedRadixCache``), the newest release, against the model through ``sglang-unified``.

    Torch (CPU) first, then only what its HiCache modules import, pinned by constraints/sglang-0.5.23.txt,
    then the wheels installed without dependencies, last (``_NO_DEPS_LAST``); then what of 0.5.20's modules
    are still there (``refcache.engines.sglang.latest``) and the adapter's version-neutral tests."""
    session.install(TORCH)
    session.install("-c", SGLANG_LATEST_CONSTRAINTS, *SGLANG_LATEST_IMPORTS)
    session.install(
        "-c",
        SGLANG_LATEST_CONSTRAINTS,
        "hypothesis>=6.150",
        "typer>=0.12",
        "rich>=13",
        "pytest>=8",
        "pytest-xdist>=3.5",
    )
    session.install("--no-deps", "-e", ".")
    session.install("--no-deps", SGLANG_LATEST)
    session.run("python", "-m", "refcache.engines.sglang.latest")
    session.run(
        "pytest",
        *SGLANG_LATEST_TESTS,
        "-n",
        "2",
        "-rP",
        "--durations=10",
        *session.posargs,
        env={"REFCACHE_ENGINE_TESTS": "sglang", "PYTHONWARNINGS": "ignore"},
    )


# The adapter's smoke tests: directed operations beside the model and the differential machines (L3 and two
# ranks where the release's row opens them; refused, as the tests check, where it does not).
SGLANG_SMOKE = [
    "tests/engines/sglang/test_adapter_ops.py",
    "tests/engines/sglang/test_differential.py",
    "tests/engines/sglang/test_release_findings.py",
    "tests/engines/sglang/test_fidelity_0522.py",
    "tests/engines/sglang/test_load_slots.py",
    "tests/engines/sglang/test_unified_compat.py",
    "tests/engines/sglang/test_unified_l3_findings.py",
    "tests/engines/sglang/test_unified_l3.py",
    "tests/engines/sglang/test_record_releases.py",
]


SMOKE_TP2 = "10"
"""Examples of the two-rank differential rows in the smoke set (``REFCACHE_SGLANG_TP2_EXAMPLES``; ``sglang``'s
own session keeps the test's 60): under refcache's decisions a release far from them (0.5.13..0.5.15) replays
each explained divergence on fresh rank workers, 10 examples about 3 minutes there (specs/sglang-adapter.md)."""


def _sglang_versions() -> ModuleType:
    """refcache.engines.sglang.versions (pure Python: the table of releases), imported from this checkout."""
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        return importlib.import_module("refcache.engines.sglang.versions")
    finally:
        sys.path.pop(0)


@nox.session(python=PY, tags=["engines"], default=False)
def sglang_releases(session: nox.Session) -> None:
    """The adapter's smoke tests on every supported SGLang release, each in its own virtualenv.

    The releases are ``refcache.engines.sglang.versions.SUPPORTED``, or those named, post releases too
    (``nox -s sglang_releases -- 0.5.12 0.5.10.post1``); ``--checkout DIR`` adds a source checkout of SGLang
    (the repository or its python/ folder), installed ``--no-deps -e`` and placed by its version (newer than
    the newest release: main, driven with that release's rows). Each virtualenv is built from the release's
    ``install_recipe`` (a checkout's ``checkout_recipe``) under .nox/sglang-releases/VERSION (rebuilt only
    when the recipe changed). One line per release at the end; the session fails if any release did."""
    versions = _sglang_versions()
    args, recipes, sources = list(session.posargs), {}, {}
    if "--checkout" in args:
        at = args.index("--checkout")
        if at + 1 >= len(args):
            session.error("--checkout DIR: give the SGLang checkout (or its python/ folder)")
        checkout = args[at + 1]
        del args[at : at + 2]
        try:
            label = versions.checkout_version(checkout)
            recipes[label], sources[label] = versions.checkout_recipe(checkout), str(Path(checkout).resolve())
        except Exception as error:  # UsageError, UnsupportedError: said as they are
            session.error(f"--checkout {checkout}: {error}")
    wanted = args or ([] if recipes else list(versions.SUPPORTED))
    for version in wanted:
        try:
            versions.check_supported(version)
        except Exception as error:  # UnsupportedError: names the supported releases
            session.error(str(error))
        recipes[version] = versions.install_recipe(version)
    report: list[str] = []
    for version, steps in recipes.items():
        env = Path(".nox", "sglang-releases", version).resolve()
        recipe = [list(step) for step in steps]
        stamp = env / "refcache-recipe.json"
        if not stamp.exists() or json.loads(stamp.read_text()) != recipe:
            shutil.rmtree(env, ignore_errors=True)
            session.run("python", "-m", "venv", str(env))
            for step in recipe:
                session.run(str(env / "bin" / "pip"), "install", "-q", *step, external=True)
            # written by a command (as the installs are), once they all succeeded
            session.run("python", "-c", f"open({str(stamp)!r}, 'w').write({json.dumps(recipe)!r})")
        started = time.monotonic()
        try:
            session.run(
                str(env / "bin" / "python"), "-m", "pytest", *SGLANG_SMOKE, "-n", "2", "-q", "-p",
                "no:cacheprovider", external=True,
                env={"REFCACHE_ENGINE_TESTS": "sglang", "PYTHONWARNINGS": "ignore", "TRITON_INTERPRET": "1",
                     "REFCACHE_SGLANG_TP2_EXAMPLES": os.environ.get("REFCACHE_SGLANG_TP2_EXAMPLES", SMOKE_TP2)},
            )  # fmt: skip
            outcome = "passed"
        except CommandFailed:
            outcome = "FAILED"
        what = versions.place(version, source=sources.get(version))
        report.append(f"{what}: smoke tests {outcome} in {time.monotonic() - started:.0f} s")
    for line in report:
        session.log(line)
    if any("FAILED" in line for line in report):
        session.error("some releases failed (lines above)")


VLLM = "vllm==0.33.0"
VLLM_CONSTRAINTS = "constraints/vllm-0.33.0.txt"
# What the block pool, the KV cache manager and the CPU offload manager import (each added because an import
# failed without it; apache-tvm-ffi is xgrammar's runtime dependency, skipped by its --no-deps install).
VLLM_IMPORTS = [
    "packaging", "pydantic", "regex", "numpy", "cbor2", "psutil", "pyzmq", "transformers", "aiohttp",
    "requests", "oss-harmony", "openai", "pillow", "pybase64", "cachetools", "msgspec", "cloudpickle",
    "uvloop", "py-cpuinfo", "prometheus_client", "fastapi", "partial_json_parser", "llguidance",
    "apache-tvm-ffi",
]  # fmt: skip


@_ci_session(python=PY, tags=["ci", "engines"])
def vllm(session: nox.Session) -> None:
    """vLLM 0.33.0's own block pool and CPU offload manager against the vLLM reference model.

    tests/engines/vllm: directed checks, the differential machine at the default budget, the vLLM bug zoo.
    Torch (CPU) first, then only what those modules import, pinned by constraints/vllm-0.33.0.txt, then the
    vLLM wheel and xgrammar without dependencies, last (``_NO_DEPS_LAST``); one pytest process (vLLM
    imports in about 15 s)."""
    session.install(TORCH)
    session.install("-c", VLLM_CONSTRAINTS, *VLLM_IMPORTS)
    session.install("-c", VLLM_CONSTRAINTS, "hypothesis>=6.150", "typer>=0.12", "rich>=13", "pytest>=8")
    session.install("--no-deps", "-e", ".")
    session.install("--no-deps", "-c", VLLM_CONSTRAINTS, "xgrammar==0.2.8")
    session.install("--no-deps", VLLM)
    session.run(
        "pytest",
        "tests/engines/vllm",
        "-rP",
        "--durations=10",
        *session.posargs,
        env={"REFCACHE_ENGINE_TESTS": "vllm", "PYTHONWARNINGS": "ignore"},
    )


LMCACHE = "lmcache==0.5.6"
LMCACHE_CONSTRAINTS = "constraints/lmcache-0.5.6.txt"
# What LMCache's cache engine, storage manager, CPU/disk/remote backends and fs:// connector import on CPU
# (each added because an import failed without it: numba resolves lmcache.device_ops, transformers is
# imported by token_database.py). Never vLLM: with vLLM importable LMCache switches to vLLM's hash function.
LMCACHE_IMPORTS = [
    "numpy", "numba", "transformers", "pyyaml", "msgspec", "sortedcontainers", "psutil", "prometheus_client",
    "requests", "py-cpuinfo", "cachetools", "aiohttp", "aiofile", "aiofiles", "pyzmq", "cryptography",
    "fastapi", "uvicorn", "blake3", "safetensors",
]  # fmt: skip


@_ci_session(python=PY, tags=["ci", "engines"])
def lmcache(session: nox.Session) -> None:
    """LMCache 0.5.6's own cache engine (CPU, local disk, fs:// remote) against the LMCache reference model.

    tests/engines/lmcache: directed checks, the differential machine at the default budget, the known
    findings replayed, the LMCache bug zoo. Torch (CPU) first, then what LMCache's imports need, pinned by
    constraints/lmcache-0.5.6.txt, then the LMCache wheel without dependencies, last (``_NO_DEPS_LAST``);
    telemetry off; one pytest process (LMCache imports in about 9 s)."""
    session.install(TORCH)
    session.install("-c", LMCACHE_CONSTRAINTS, *LMCACHE_IMPORTS)
    session.install("-c", LMCACHE_CONSTRAINTS, "hypothesis>=6.150", "typer>=0.12", "rich>=13", "pytest>=8")
    session.install("--no-deps", "-e", ".")
    session.install("--no-deps", LMCACHE)
    session.run(
        "pytest",
        "tests/engines/lmcache",
        "-rP",
        "--durations=10",
        *session.posargs,
        env={
            "REFCACHE_ENGINE_TESTS": "lmcache",
            "PYTHONWARNINGS": "ignore",
            "LMCACHE_TRACK_USAGE": "false",
            "DO_NOT_TRACK": "1",
        },
    )
