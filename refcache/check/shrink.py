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

from refcache.check.harness import Divergence, Harness, InvariantFamily
from refcache.config import HiCacheConfig
from refcache.errors import UsageError
from refcache.ops import Op
from refcache.systems import OpenSystems, SystemOptions, open_systems

__all__ = ["Failure", "ShrinkResult", "SystemsFactory", "failure_of", "shrink_trace", "systems_named"]

SystemsFactory = Callable[[HiCacheConfig], OpenSystems]
"""Fresh systems for one replay (the first one is the reference), closed after the replay."""


def systems_named(names: Sequence[str], options: SystemOptions | None = None) -> SystemsFactory:
    """The factory that opens registry systems ``names`` (``refcache.systems``), each with its ``options``,
    for each replay."""
    return lambda config: open_systems(names, config, options)


@dataclass(frozen=True)
class Failure:
    step: int  # 1-based index of the failing operation (0: the initial state already fails)
    kind: str  # "outcomes differ", "snapshots differ", "invariant violated on impl", "impl crashed", ...
    message: str  # the first line of the divergence
    detail: str = ""  # what differed: the lines after the first, up to the trace, joined by "; "

    @classmethod
    def of(cls, error: Divergence) -> Failure:
        lines = str(error).splitlines()
        detail = []
        for line in lines[1:]:
            if line.startswith(("trace written", "trace not written", "--- trace ---")):
                break
            detail.append(line.strip())
        return cls(error.step, error.kind, lines[0], "; ".join(detail))


@dataclass(frozen=True)
class ShrinkResult:
    ops: list[Op]  # ends with the failing operation
    failure: Failure
    original_length: int
    replays: int
    seconds: float
    complete: bool  # True: 1-minimal; False: the time budget ran out first


def failure_of(
    config: HiCacheConfig,
    ops: Sequence[Op],
    make_systems: SystemsFactory,
    invariants: InvariantFamily | None = None,
) -> Failure | None:
    """Replay ``ops`` on fresh systems (checked with ``invariants``, the harness's default family if None);
    the first divergence, or None if the whole trace agrees."""
    with make_systems(config) as systems:
        try:
            harness = Harness(config, systems, write_trace=False, invariants=invariants)
            for op in ops:
                harness.step(op)
        except Divergence as error:
            return Failure.of(error)
    return None


def shrink_trace(
    config: HiCacheConfig,
    ops: Sequence[Op],
    make_systems: SystemsFactory,
    *,
    seconds: float = 60.0,
    on_progress: Callable[[int, int], None] | None = None,
    invariants: InvariantFamily | None = None,
) -> ShrinkResult:
    """Shrink a failing trace (see the module docstring) for at most about ``seconds``.

    ``on_progress(length, replays)`` is called after every kept candidate. Raises ``UsageError`` when the
    trace does not fail at all.
    """
    started = time.monotonic()
    deadline = started + seconds
    target = failure_of(config, ops, make_systems, invariants)
    if target is None:
        raise UsageError("the trace replays without any divergence: there is nothing to shrink")
    current, failure = list(ops[: target.step]), target
    replays = 1

    def attempt(candidate: list[Op]) -> bool:
        nonlocal current, failure, replays
        replays += 1
        found = failure_of(config, candidate, make_systems, invariants)
        if found is None or found.kind != target.kind:
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
