"""The conformance kit: run refcache's checks on your own engine, from your own test suite.

An engine of a family refcache knows (``refcache.hicache``: SGLang-style HiCache; ``refcache.vllm``: vLLM's
block pool and CPU offload manager) exposes an adapter — an object with ``apply(op)``, ``snapshot()``,
``close()`` and the context-manager methods (``refcache.systems.System``) — built by a factory that takes a
``refcache.config.HiCacheConfig``. Then, in its pytest suite::

    from refcache.conformance import check_system
    from refcache.hicache import FAMILY

    def test_my_cache_conforms() -> None:
        check_system(MyAdapter, family=FAMILY)

``check_system`` runs, in this order, each stopping at the first failure:

1. **the family's directed scenarios** (``Family.scenarios``): short runs through named situations, each
   step compared with the family's reference model and checked against every invariant;
2. **the random machines** of the family (the ones ``refcache fuzz`` runs), at refcache's CI budget unless
   told otherwise, derandomized (the same examples every run) unless ``seed`` is given.

A failure raises ``ConformanceError`` (an ``AssertionError``, so pytest reports it as a failed test): which
check fired, at which step, what differed, the shrunk trace and how to replay it. With ``reference=None``
the system runs alone and only the invariants judge it (what an engine without a reference model beside it
can check). An adapter that answers only part of the alphabet says so with ``answers`` (operation class
names): the scenarios that need another operation are skipped (and listed in the report), and the machines
draw only the rules it answers. ``compare`` chooses a coarser comparison with the reference (a family
granularity, e.g. ``"no-slots"``). docs/port-an-engine.md walks through it with a toy engine.

Like ``trio.testing``, this module is public and stable: what a third-party suite may import from refcache
is this module, ``refcache.family``, the families' packages and ``refcache.systems.SystemEntry``.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from unittest import mock

from hypothesis import settings as hypothesis_settings
from hypothesis.stateful import run_state_machine_as_test

from refcache.check import budget
from refcache.check.coverage import Coverage
from refcache.check.families import Checks, family_checks
from refcache.check.harness import TRACE_DIR_ENV, Divergence, Harness
from refcache.config import HiCacheConfig
from refcache.errors import RefcacheException, UsageError
from refcache.family import EXACT, Family, Scenario
from refcache.systems import System, SystemEntry, answered, granularity, open_systems, registered

__all__ = ["ConformanceError", "ConformanceReport", "check_system"]

O = TypeVar("O")  # noqa: E741 - the family's operation, observation and snapshot types
B = TypeVar("B")
S = TypeVar("S")


class ConformanceError(RefcacheException, AssertionError):
    """Raised by ``check_system`` when the system under test breaks its family's contract: a scenario or a
    random example diverged from the reference, or broke an invariant, or crashed. ``check`` says which
    ("scenario evict-host", "random machine ModelToyMachine"), ``kind`` what fired ("snapshots differ",
    "invariant violated on toy", "toy crashed"), ``step`` the 1-based failing operation, ``trace`` the
    (shrunk) trace, which ``refcache replay TRACE --against REFERENCE,NAME`` re-executes once the system is
    registered (``refcache.systems`` entry point). Fix the engine, or if refcache's reference is wrong, report it."""

    def __init__(self, message: str, *, check: str, kind: str, step: int, trace: Path | None) -> None:
        super().__init__(message)
        self.check = check
        self.kind = kind
        self.step = step
        self.trace = trace


@dataclass(frozen=True)
class ConformanceReport:
    """What ``check_system`` ran (everything passed, or it would have raised)."""

    family: str
    system: str
    reference: str | None
    scenarios: tuple[str, ...]  # the scenarios run
    skipped: tuple[str, ...]  # scenarios needing an operation the system does not answer
    examples: int  # random examples run, every machine together
    steps: int  # operations of those examples
    seconds: float
    outcomes: Mapping[str, int] = field(default_factory=dict)  # the machines' ledger: operation outcomes

    def __str__(self) -> str:
        against = f"against {self.reference}" if self.reference else "alone (invariants only)"
        skipped = f", {len(self.skipped)} skipped ({', '.join(self.skipped)})" if self.skipped else ""
        return (
            f"{self.system} conforms to the {self.family} family {against}: {len(self.scenarios)} scenarios"
            f"{skipped}, {self.examples:,} random examples ({self.steps:,} operations), {self.seconds:.1f} s"
        )


def check_system(
    factory: Callable[[HiCacheConfig], System[O, B, S]],
    *,
    family: Family[O, B, S],
    name: str = "candidate",
    reference: str | None = "",
    answers: Iterable[str] | None = None,
    compare: str = EXACT,
    scenarios: bool = True,
    random: bool = True,
    examples: int = budget.DIFFERENTIAL.examples,
    steps: int = budget.DIFFERENTIAL.steps,
    seed: int | None = None,
    constraints: Mapping[str, object] | None = None,
    trace_dir: str | os.PathLike[str] | None = None,
    shrink_seconds: float = 30.0,
) -> ConformanceReport:
    """Check the system ``factory`` builds against ``family`` (module docstring). ``name`` is what reports
    and traces call it; ``reference`` the registered system it is compared with (default: the family's
    reference model; None: none, invariants only); ``answers`` the operation class names it answers (default:
    all); ``compare`` the granularity of the comparison; ``examples`` × ``steps`` the random budget per
    machine; ``seed`` another sample than CI's derandomized one; ``constraints`` configuration fields the
    system needs fixed (e.g. ``{"tp_size": 1}``: the machines draw only those); ``trace_dir`` where failing
    traces go (default: ``REFCACHE_TRACE_DIR``, else a new temporary directory); ``shrink_seconds`` the
    time spent shrinking a failing random example.

    Returns a ``ConformanceReport``; raises ``ConformanceError`` at the first failure, ``UsageError`` for a
    bad argument (an unknown family, operation or granularity, a name that is taken)."""
    family_checks(family.name)  # an unknown family fails here (UsageError naming the known ones)
    ref = family.reference if reference == "" else reference
    if ref == name:
        raise UsageError(f"the system under test cannot be named {name!r}, like its reference")
    family.project(compare)  # an unknown granularity fails here, before anything runs
    names = (name,) if ref is None else (ref, name)
    directory = Path(
        trace_dir or os.environ.get(TRACE_DIR_ENV) or tempfile.mkdtemp(prefix="refcache-conformance-")
    )
    entry = SystemEntry(
        f"the system under test ({name})",
        factory,
        family=family.name,
        answers=None if answers is None else frozenset(answers),
        compare=compare,
    )
    started = time.monotonic()
    with registered(name, entry):
        ops = answered(names, family)
        ran, skipped = _scenarios(family, names, ops, directory) if scenarios else ((), ())
        ledger = Coverage()
        if random:
            _machines(
                family, names, ledger, constraints or {}, examples, steps, seed, directory, shrink_seconds
            )
    return ConformanceReport(
        family.name,
        name,
        ref,
        ran,
        skipped,
        ledger.runs,
        ledger.steps,
        time.monotonic() - started,
        dict(ledger.outcomes),
    )


def _scenarios(
    family: Family[O, B, S], names: tuple[str, ...], ops: frozenset[type[O]], directory: Path
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    ran: list[str] = []
    skipped: list[str] = []
    for scenario in family.scenarios():
        if any(type(op) not in ops for op in scenario.ops):
            skipped.append(scenario.name)
            continue
        _scenario(family, names, scenario, directory)
        ran.append(scenario.name)
    return tuple(ran), tuple(skipped)


def _scenario(
    family: Family[O, B, S], names: tuple[str, ...], scenario: Scenario[O], directory: Path
) -> None:
    check = f"scenario {scenario.name}"
    try:
        with open_systems(names, scenario.config, family=family) as opened:
            harness = Harness(
                scenario.config,
                opened,
                family=family,
                trace_name=f"{names[-1]}-{scenario.name}",
                trace_dir=directory,
                compare=granularity(names, family),
            )
            for op in scenario.ops:
                harness.step(op)
    except Divergence as error:
        raise ConformanceError(
            f"{check} ({scenario.what}) failed: {error.summary}\n{_replay(error.trace_path, names)}",
            check=check,
            kind=error.kind,
            step=error.step,
            trace=error.trace_path,
        ) from error


def _machines(
    family: Family[O, B, S],
    names: tuple[str, ...],
    ledger: Coverage,
    constraints: Mapping[str, object],
    examples: int,
    steps: int,
    seed: int | None,
    directory: Path,
    shrink_seconds: float,
) -> None:
    checks = family_checks(family.name)
    chosen = budget.Budget(examples, steps).settings(derandomize=seed is None, shrink=False)
    for machine in checks.machines(names, constraints, ledger, "", {}):
        if seed is not None:
            setattr(machine, "_hypothesis_internal_use_seed", seed)  # noqa: B010 - Hypothesis' @seed, as machine() sets it
        with mock.patch.dict(os.environ, {TRACE_DIR_ENV: str(directory)}):
            try:
                run_state_machine_as_test(machine, settings=hypothesis_settings(chosen, database=None))
            except Divergence as error:
                raise _shrunk(checks, machine.__name__, names, error, shrink_seconds) from error


def _shrunk(
    checks: Checks, machine: str, names: tuple[str, ...], error: Divergence, seconds: float
) -> ConformanceError:
    """The error for a failing random example, its trace shrunk (``refcache.check.shrink``) when it can be."""
    check = f"random machine {machine}"
    path = error.trace_path
    message = f"{check} failed: {error.summary}"
    if path is not None:
        out = path.with_name(path.name.removesuffix(".jsonl") + ".min.jsonl")
        try:
            result = checks.shrink(path, out, names, seconds=seconds)
        except UsageError:  # the divergence does not reproduce on a fresh replay: keep the whole trace
            message += "\n(the failure did not reproduce on a fresh replay: the trace is not shrunk)"
        else:
            message += (
                f"\nshrunk {result.original_length} -> {result.length} operations, "
                f"still: {result.failure.message}"
            )
            path = out
    return ConformanceError(
        f"{message}\n{_replay(path, names)}", check=check, kind=error.kind, step=error.step, trace=path
    )


def _replay(path: Path | None, names: tuple[str, ...]) -> str:
    if path is None:
        return "trace not written"
    return (
        f"trace: {path}\nreplay it (once {names[-1]!r} is registered, e.g. as a refcache.systems entry point): "
        f"refcache replay {path} --against {','.join(names)}"
    )
