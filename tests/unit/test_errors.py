"""The error hierarchy (``refcache/errors.py``): every exception class refcache defines is under
``RefcacheException``, keeps the builtin base its ``except`` clauses rely on, and says when it is raised."""

from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

import pytest

from refcache import errors
from refcache.errors import (
    EngineFailure,
    NeverReturned,
    RankError,
    RecordingError,
    RefcacheError,
    RefcacheException,
    TransitionError,
    UsageError,
)

PACKAGE = Path(__file__).resolve().parents[2] / "refcache"


def _builtin_exception(name: str) -> bool:
    value = getattr(builtins, name, None)
    return isinstance(value, type) and issubclass(value, BaseException) and not issubclass(value, Warning)


def outside_the_hierarchy(root: Path) -> list[str]:
    """``path:line Class`` for every class under ``root`` that derives from a builtin exception and from no
    class of its own package (so not from ``RefcacheException``, directly or through another)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            names = [
                b.id if isinstance(b, ast.Name) else b.attr
                for b in node.bases
                if isinstance(b, ast.Name | ast.Attribute)
            ]
            if any(_builtin_exception(n) for n in names) and all(_builtin_exception(n) for n in names):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}")
    return found


OUTSIDE = {
    "RefcacheException",  # the root
    "BudgetSpent",  # a KeyboardInterrupt, so that Hypothesis stops rather than records a failure (errors.py)
    "WouldBlock",  # LMCache's endless busy-wait, past LMCache's own ``except Exception`` (errors.py)
    "_Wait",  # the busy-wait's first sleep, inside LMCache's allocator (refcache.engines.lmcache._driver)
}


def test_every_exception_class_is_under_refcache_exception() -> None:
    """Only the root and the documented exception derive from a builtin exception alone."""
    found = outside_the_hierarchy(PACKAGE)
    assert {entry.split()[-1] for entry in found} == OUTSIDE, found
    assert all(name in (errors.__doc__ or "") for name in OUTSIDE)  # the map says why


def _lineno(name: str) -> int:
    tree = ast.parse((PACKAGE / "errors.py").read_text(encoding="utf-8"))
    return next(n.lineno for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def test_the_detector_names_a_class_outside(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text(
        "class Root(Exception): ...\nclass Fine(Root, RuntimeError): ...\nclass Stray(RuntimeError): ...\n"
        "class Deep(Fine): ...\nclass Warned(UserWarning): ...\n",
        encoding="utf-8",
    )
    assert outside_the_hierarchy(package) == ["pkg/a.py:1 Root", "pkg/a.py:3 Stray"]


def test_transition_error_is_a_bug_not_a_usage_error() -> None:
    assert issubclass(TransitionError, RefcacheError)  # the harness compares it as an outcome
    assert not issubclass(
        TransitionError, UsageError
    )  # the command line's exit 2 is for the caller's mistakes


def test_failures_keep_their_builtin_bases_and_are_no_outcomes() -> None:
    assert issubclass(RankError, EngineFailure) and issubclass(RankError, RuntimeError)
    assert not issubclass(EngineFailure, RefcacheError)
    error = RankError("stuck", rank=1, hang=NeverReturned(1, 3, "f", 0, 2))
    assert isinstance(error.hang, NeverReturned) and error.rank == 1
    from refcache.check.harness import Divergence

    assert issubclass(Divergence, AssertionError) and issubclass(Divergence, RefcacheException)
    assert not issubclass(Divergence, RefcacheError)


def test_native_errors_are_in_the_hierarchy() -> None:
    pytest.importorskip("torch")
    native = importlib.import_module("refcache.gpu.native")
    oracle = importlib.import_module("refcache.gpu.kv_oracle")
    assert issubclass(native.NativeUnavailable, RuntimeError)
    assert issubclass(native.NativeUnavailable, RefcacheException)
    assert issubclass(oracle.NativeDisagreement, AssertionError)
    assert issubclass(oracle.NativeDisagreement, RefcacheException)


def test_never_returned_keeps_its_public_home() -> None:
    from refcache.hicache import recording

    assert recording.NeverReturned is NeverReturned
    assert "NeverReturned" in recording.__all__


def test_no_capacity_error() -> None:
    """Capacity exhaustion is an observation (a request not admitted), never an exception."""
    assert not hasattr(errors, "CapacityError")


@pytest.mark.parametrize("name", [n for n in errors.__all__ if n != "NeverReturned"])
def test_every_class_says_when_it_is_raised(name: str) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, RefcacheException)
    assert cls.__doc__ and len(cls.__doc__.split()) >= 12, f"{name}'s docstring says too little"


def test_recording_error_is_an_outcome() -> None:
    assert issubclass(RecordingError, RefcacheError)


@pytest.mark.parametrize(("error", "status"), [(TransitionError("no transition"), 1), (UsageError("bad"), 2)])
def test_simulate_reports_a_transition_error_as_a_bug(
    monkeypatch: pytest.MonkeyPatch, error: Exception, status: int
) -> None:
    """``refcache simulate``: an illegal node transition is the system's bug (exit 1), not a usage error (2)."""
    from refcache.config import HiCacheConfig
    from refcache.sim import command
    from refcache.sim.simulator import SimOptions

    def fails(*_: object, **__: object) -> None:
        raise error

    monkeypatch.setattr(command, "simulate", fails)
    trace = PACKAGE.parent / "tests" / "data" / "mooncake_conversation_head300.jsonl"
    assert command.run_command(trace, HiCacheConfig(), SimOptions(), limit=2) == status
