"""Trace shrinking: a shortest sub-sequence of a failing trace's operations that still fails the same way.

Hypothesis shrinks the choices that generated a run; this shrinks the trace itself, so it works on any
trace — one that ``refcache fuzz`` or a CI run wrote, one recorded from another engine through an
adapter, one written by hand — against whatever systems the caller builds. Each candidate is replayed
from scratch on fresh systems through the differential ``Harness``; it is kept when it diverges with the
same kind of failure (outcomes, snapshots, an invariant, a crash of the same system), and is then cut
just after its failing step. The search is ddmin (Zeller and Hildebrandt, "Simplifying and Isolating
Failure-Inducing Input", 2002) over operations, ending with single-operation removals: a result that
reaches ``complete`` is 1-minimal (removing any one operation loses the failure).

Removing an operation can make a later one invalid (a finish of a request that never started); every
system then raises the same ``UsageError``, the harness counts that as agreement, and a later pass removes
the dead operation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar, overload

from refcache.check.harness import Divergence, Harness
from refcache.config import HiCacheConfig
from refcache.errors import UsageError
from refcache.family import Family
from refcache.hicache.ops import Observation, Op
from refcache.hicache.snapshot import Snapshot
from refcache.systems import SYSTEMS, OpenSystems, SystemOptions, granularity, open_systems

__all__ = ["Failure", "ShrinkResult", "SystemsFactory", "failure_of", "shrink_trace", "systems_named"]

O = TypeVar("O")  # noqa: E741 - the family's operation, observation and snapshot types
B = TypeVar("B")
S = TypeVar("S")

SystemsFactory = Callable[[HiCacheConfig], OpenSystems[O, B, S]]
"""Fresh systems for one replay (the first one is the reference), closed after the replay."""


@overload
def systems_named(
    names: Sequence[str], options: SystemOptions | None = None
) -> SystemsFactory[Op, Observation, Snapshot]: ...
@overload
def systems_named(
    names: Sequence[str], options: SystemOptions | None = None, *, family: Family[O, B, S]
) -> SystemsFactory[O, B, S]: ...
def systems_named(
    names: Sequence[str], options: SystemOptions | None = None, *, family: Family[O, B, S] | None = None
) -> SystemsFactory[O, B, S] | SystemsFactory[Op, Observation, Snapshot]:
    """The factory that opens registry systems ``names`` (``refcache.systems``) of ``family`` (HiCache's
    unless given), each with its ``options``, for each replay."""
    if family is None:
        return lambda config: open_systems(names, config, options)
    chosen = family
    return lambda config: open_systems(names, config, options, family=chosen)


@dataclass(frozen=True)
class Failure:
    step: int  # 1-based index of the failing operation (0: the initial state already fails)
    kind: str  # "outcomes differ", "snapshots differ", "invariant violated on impl", "impl crashed", ...
    message: str  # the first line of the divergence
    detail: str = ""  # what differed: the lines after the first, up to the trace, joined by "; "
    history: tuple[str, ...] = ()  # the repr of each operation before the failing one, where known

    @classmethod
    def of(cls, error: Divergence) -> Failure:
        lines = str(error).splitlines()
        detail = []
        for line in lines[1:]:
            if line.startswith(("trace written", "trace not written", "--- trace ---")):
                break
            detail.append(line.strip())
        return cls(error.step, error.kind, lines[0], "; ".join(detail), error.history)


@dataclass(frozen=True)
class ShrinkResult(Generic[O]):
    ops: list[O]  # ends with the failing operation
    failure: Failure
    original_length: int
    replays: int
    seconds: float
    complete: bool  # True: 1-minimal; False: the time budget ran out first


def failure_of(
    config: HiCacheConfig,
    ops: Sequence[O],
    make_systems: SystemsFactory[O, B, S],
    *,
    family: Family[O, B, S],
) -> Failure | None:
    """Replay ``ops`` on fresh systems of ``family`` (compared at the granularity their registry entries ask
    for); the first divergence, or None if the whole trace agrees."""
    with make_systems(config) as systems:
        try:
            compare = granularity([n for n in systems if n in SYSTEMS], family)
            harness = Harness(config, systems, write_trace=False, family=family, compare=compare)
            for op in ops:
                harness.step(op)
        except Divergence as error:
            return Failure.of(error)
    return None


def shrink_trace(
    config: HiCacheConfig,
    ops: Sequence[O],
    make_systems: SystemsFactory[O, B, S],
    *,
    family: Family[O, B, S],
    seconds: float = 60.0,
    on_progress: Callable[[int, int], None] | None = None,
    keep: Callable[[Failure], bool] | None = None,
) -> ShrinkResult[O]:
    """Shrink a failing trace (see the module docstring) for at most about ``seconds``.

    ``on_progress(length, replays)`` is called after every kept candidate. ``keep(failure)``: a candidate is
    kept only if it also accepts the candidate's failure (the bug zoo rejects one that a known finding
    explains). Raises ``UsageError`` when the trace does not fail at all.
    """
    started = time.monotonic()
    deadline = started + seconds
    target = failure_of(config, ops, make_systems, family=family)
    if target is None:
        raise UsageError("the trace replays without any divergence: there is nothing to shrink")
    current, failure = list(ops[: target.step]), target
    replays = 1

    def attempt(candidate: list[O]) -> bool:
        nonlocal current, failure, replays
        replays += 1
        found = failure_of(config, candidate, make_systems, family=family)
        if found is None or found.kind != target.kind or (keep is not None and not keep(found)):
            return False
        current, failure = candidate[: found.step], found
        if on_progress is not None:
            on_progress(len(current), replays)
        return True

    parts, complete = 2, False
    while time.monotonic() < deadline:
        if len(current) <= 1:
            complete = True
            break
        chunk = math.ceil(len(current) / parts)
        for start in range(0, len(current), chunk):
            if time.monotonic() >= deadline:
                break
            if attempt(current[:start] + current[start + chunk :]):
                parts = max(parts - 1, 2)
                break
        else:
            if chunk == 1:
                complete = True  # no single operation can go
                break
            parts = min(parts * 2, len(current))
    return ShrinkResult(current, failure, len(ops), replays, time.monotonic() - started, complete)
