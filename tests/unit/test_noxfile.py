"""noxfile.py and .ci/run: the fast and full sets are what the header, the README and CI say, every
session's ``nox -l`` line is a whole sentence, and no install prints pip's resolver errors."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

nox = pytest.importorskip("nox")  # the test extra installs it; the portable sessions do not run this file
from nox._decorators import Func  # noqa: E402

ROOT = Path(__file__).parent.parent.parent


class RecordingSession:
    """Stands in for ``nox.Session``: records what a session function installs and runs."""

    def __init__(self, python: str, location: str = "/nonexistent/.nox/env") -> None:
        self.python = python
        self.virtualenv = SimpleNamespace(location=location)
        self.posargs: list[str] = []
        self.installs: list[tuple[str, ...]] = []
        self.runs: list[tuple[str, ...]] = []

    def install(self, *args: str, **kwargs: object) -> None:
        self.installs.append(args)

    def run(self, *args: str, **kwargs: object) -> None:
        self.runs.append(args)

    def log(self, *args: object, **kwargs: object) -> None:
        pass


@pytest.fixture(scope="module")
def noxfile() -> Iterator[tuple[ModuleType, dict[str, Func]]]:
    saved_path, saved_cwd = os.environ["PATH"], Path.cwd()
    nox.registry.reset()
    spec = importlib.util.spec_from_file_location("refcache_noxfile", ROOT / "noxfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        os.chdir(ROOT)  # as nox runs it: it links pyenv interpreters under ROOT/.nox
        spec.loader.exec_module(module)
        yield module, nox.registry.get()
    finally:
        os.environ["PATH"] = saved_path
        os.chdir(saved_cwd)
        nox.registry.reset()


def _sessions(registry: dict[str, Func], tag: str) -> list[str]:
    return [name for name, func in registry.items() if tag in func.tags]


def test_no_install_resolves_dependencies_after_a_no_deps_install(
    noxfile: tuple[ModuleType, dict[str, Func]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip checks the packages that depend on what an install brings and prints "ERROR: X requires Y,
    which is not installed" for an engine wheel installed --no-deps before it (noxfile.py, _NO_DEPS_LAST)."""
    monkeypatch.chdir(ROOT)  # sessions list tests/regressions and bench/
    _, registry = noxfile
    checked = 0
    for name, func in registry.items():
        pythons = func.python if isinstance(func.python, list) else [str(func.python)]
        session = RecordingSession(str(pythons[0]))
        func(session)
        no_deps_seen: tuple[str, ...] | None = None
        for args in session.installs:
            if "--no-deps" in args:
                no_deps_seen = args
            else:
                assert no_deps_seen is None, f"{name}: {args} resolves after the --no-deps {no_deps_seen}"
        checked += any("--no-deps" in args for args in session.installs)
    assert checked >= 4  # the engines' sessions and the model-only ones install without dependencies


class FailingSession(RecordingSession):
    def install(self, *args: str, **kwargs: object) -> None:
        raise RuntimeError("pip: No space left on device")


@pytest.mark.parametrize("failing", [False, True], ids=["passed", "failed"])
def test_on_ci_every_full_set_session_removes_its_environment_when_it_ends(
    noxfile: tuple[ModuleType, dict[str, Func]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    failing: bool,
) -> None:
    """Eleven environments kept to the end filled a CI machine's disk (noxfile.py, ``_ci_session``): on CI
    each session of the full set removes its own, passed or failed; off CI it stays."""
    monkeypatch.chdir(ROOT)
    _, registry = noxfile
    full = _sessions(registry, "ci")
    assert len(full) >= 10
    for ci in ("true", None):
        if ci:
            monkeypatch.setenv("CI", ci)
        else:
            monkeypatch.delenv("CI", raising=False)
        for name in registry:
            env = tmp_path / f"{name}-{ci}"
            (env / "bin").mkdir(parents=True)
            func = registry[name]
            pythons = func.python if isinstance(func.python, list) else [str(func.python)]
            session = (FailingSession if failing else RecordingSession)(str(pythons[0]), str(env))
            try:
                func(session)
            except RuntimeError:
                assert failing
            assert env.is_dir() == (not ci or name not in full), name


def test_every_nox_list_line_is_a_whole_sentence(noxfile: tuple[ModuleType, dict[str, Func]]) -> None:
    """``nox -l`` shows a docstring's first line: it must be the whole summary, not half a sentence."""
    _, registry = noxfile
    for name, func in registry.items():
        lines = (func.__doc__ or "").strip().splitlines()
        assert lines, f"{name} has no description"
        assert lines[0].rstrip().endswith((".", "``")), f"{name}: {lines[0]!r} is cut mid-sentence"
        assert len(lines) == 1 or not lines[1].strip(), f"{name}: the summary runs on to {lines[1]!r}"


def test_the_header_names_the_fast_full_and_opt_in_sets(noxfile: tuple[ModuleType, dict[str, Func]]) -> None:
    module, registry = noxfile
    header = " ".join((module.__doc__ or "").split())
    fast = re.search(r"``nox``: the fast set, .*? \(tag ``fast``\): ([\w, ]+) \(", header)
    full = re.search(r"``nox -t ci``: the full set, .*? \(tag ``ci``\): (.+?)\. ", header)
    opt_in = re.search(r"Opt-in, by name \(``nox -s NAME``\): ([\w, ]+)\.", header)
    assert fast and full and opt_in, header
    assert fast.group(1).split(", ") == _sessions(registry, "fast") == module.nox.options.sessions
    named = re.sub(r" \([^)]*\)", "", full.group(1)).split(", ")  # "portable (3.12 and 3.13)" -> portable
    assert named == _sessions(registry, "ci")
    assert opt_in.group(1).split(", ") == [n for n in registry if not {"fast", "ci"} & set(registry[n].tags)]
    assert not any(func.tags and not func.default for func in registry.values() if "ci" in func.tags)


def test_the_readme_test_command_is_what_ci_runs() -> None:
    """The README's second set-up command (install and run the tests) is .ci/run's, and the fast set is
    named beside it."""
    ci = [line for line in (ROOT / ".ci/run").read_text(encoding="utf-8").splitlines() if "-m nox" in line]
    assert len(ci) == 1
    ci_nox = shlex.split(ci[0])[shlex.split(ci[0]).index("nox") :]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    setup = readme.split("## Set up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    commands = [
        line.strip() for line in setup.splitlines() if line.startswith("    ") and "pip install" in line
    ]
    assert len(commands) == 2, commands  # the main job, and the tests
    last = shlex.split(commands[1].split("&&")[-1])
    assert last == ci_nox == ["nox", "-t", "ci"]
    assert "`nox`" in setup and "fast set" in setup
