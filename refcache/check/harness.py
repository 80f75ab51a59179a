"""The differential harness: one operation applied to several systems, compared, checked, recorded.

``Harness.step(op)`` applies ``op`` to every system (the model, the implementation, another engine
through an adapter), then checks, in this order:

1. the outcomes agree — equal observations, or the same typed error from every system;
2. the snapshots agree, field by field (``diff_snapshots`` names the node by token path, the field and
   both values);
3. every invariant of ``refcache.hicache.invariants`` holds on every system's snapshot, and the step invariants
   hold between its previous and current snapshot. The invariants are functions of the snapshots alone, so
   where check 2 found every snapshot equal to the first system's (and the previous ones were equal too)
   they run once, on the first system's: the verdict on the others is the same.

What "operation", "snapshot", "invariant" and "trace" mean is the systems' engine family's: the harness is
generic over ``refcache.family.Family[Op, Obs, Snap]`` (``Harness(..., family=...)``: HiCache's is
``refcache.hicache.FAMILY``; each family's package has its own). An adapter that compares at a coarser granularity (``compare``:
e.g. without slot numbers) has both snapshots projected before check 2; the invariants of check 3 always
read the whole snapshots.

The first failure raises ``Divergence`` after writing the run so far — the failing operation last — as a
versioned JSONL trace (``refcache.hicache.trace``) that ``refcache replay`` re-executes. The trace text is also
part of the error message, so it survives in CI logs when files do not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final, Generic, TypeVar

from refcache.config import HiCacheConfig
from refcache.errors import RefcacheError, RefcacheException
from refcache.family import Family
from refcache.hicache.family import FAMILY as HICACHE
from refcache.hicache.family import diff_snapshots, status_line
from refcache.hicache.ops import Observation, Op
from refcache.hicache.snapshot import Snapshot
from refcache.systems import System

__all__ = [
    "HICACHE",
    "TRACE_DIR_ENV",
    "Divergence",
    "Harness",
    "HiCacheHarness",
    "Outcome",
    "diff_snapshots",
    "expect",
    "status_line",
]

TRACE_DIR_ENV: Final = "REFCACHE_TRACE_DIR"


class Divergence(RefcacheException, AssertionError):
    """Raised by ``Harness.step`` when systems disagree or an invariant breaks. ``kind`` names the check
    that fired ("outcomes differ", "snapshots differ", "invariant violated on impl", "impl crashed"),
    ``step`` the 1-based failing operation (0: the initial state), ``trace_path`` the written trace
    (``None`` if none was written); the message says what differed."""

    def __init__(
        self,
        message: str,
        trace_path: Path | None,
        kind: str = "",
        step: int = 0,
        summary: str = "",
        history: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.trace_path = trace_path
        self.kind = kind
        self.step = step
        self.summary = summary or message  # what differed, without where the trace went or its text
        self.history = history  # the repr of each operation before the failing one


Outcome = Observation | RefcacheError
"""What one step returns: the systems' common observation, or the typed error every one of them raised."""

_Obs = TypeVar("_Obs")


def expect(outcome: object, kind: type[_Obs]) -> _Obs:
    """``outcome`` as the observation type its operation returns (``StartRequest`` → ``StartResult``, ...).
    Re-raises an error outcome; a wrong type is a broken system, reported as an ``AssertionError``."""
    if isinstance(outcome, RefcacheError):
        raise outcome
    if not isinstance(outcome, kind):
        raise AssertionError(f"expected a {kind.__name__}, got {outcome!r}")
    return outcome


def _outcome_key(outcome: object) -> object:
    """Observations compare by value; errors by type (messages are free text)."""
    return type(outcome).__name__ if isinstance(outcome, RefcacheError) else outcome


O = TypeVar("O")  # noqa: E741 - the family's operation, observation and snapshot types
B = TypeVar("B")
S = TypeVar("S")


class Harness(Generic[O, B, S]):
    """Apply operations to ``systems`` of ``family`` (``refcache.hicache.FAMILY``, or another family's) in lock
    step and check them (see the module docstring).

    ``trace_name`` names the trace file written on failure under ``trace_dir`` (default: the
    ``REFCACHE_TRACE_DIR`` environment variable, else ``./refcache-traces``); ``write_trace=False`` writes
    none (the trace text is still in the message), for callers that replay many candidates. ``compare``
    projects both snapshots before they are compared (``refcache.systems.granularity``); None compares
    them as they are.
    """

    def __init__(
        self,
        config: HiCacheConfig,
        systems: Mapping[str, System[O, B, S]],
        *,
        family: Family[O, B, S],
        trace_name: str = "failure",
        trace_dir: str | os.PathLike[str] | None = None,
        on_step: Callable[[int, O, B | RefcacheError, S], None] | None = None,
        write_trace: bool = True,
        compare: Callable[[S], S] | None = None,
    ) -> None:
        if not systems:
            raise ValueError("the harness needs at least one system")
        self.config = config
        self.systems = dict(systems)
        self.family = family  # the systems' family: its invariants, snapshot diff and traces
        self.ops: list[O] = []
        self.trace_name = trace_name
        self.trace_dir = Path(trace_dir or os.environ.get(TRACE_DIR_ENV) or "refcache-traces")
        self.on_step = on_step
        self.write_trace = write_trace
        self.compare = compare
        self.timings: dict[str, float] = {}  # seconds per system (apply + snapshot), "compare", "invariants"
        # Each system's snapshot after the last step (the step invariants compare the next one with it).
        self.snapshots: dict[str, S] = {
            name: self._snapshot(name, system, None) for name, system in self.systems.items()
        }
        self._check_invariants(self.snapshots, None, all_equal=False)
        # Whether every system's last snapshot equals the first system's (true after every step: check 2).
        first = next(iter(self.snapshots.values()))
        self._snapshots_equal = compare is None and all(s == first for s in self.snapshots.values())

    def step(self, op: O) -> B | RefcacheError:
        """Apply ``op`` everywhere; return the (common) outcome or raise ``Divergence``."""
        self.ops.append(op)
        outcomes: dict[str, B | RefcacheError] = {}
        snapshots: dict[str, S] = {}
        for name, system in self.systems.items():
            started = time.perf_counter()
            try:
                outcomes[name] = system.apply(op)
            except RefcacheError as error:
                outcomes[name] = error
            except Exception as error:
                self._fail(f"{name} crashed", f"on {op!r}: {type(error).__name__}: {error}")
            snapshots[name] = self._snapshot(name, system, op)
            self._spent(name, started)
        started = time.perf_counter()
        names = list(self.systems)
        first = outcomes[names[0]]
        project = self.compare
        reference = snapshots[names[0]] if project is None else project(snapshots[names[0]])
        for name in names[1:]:
            if _outcome_key(outcomes[name]) != _outcome_key(first):
                self._fail(
                    "outcomes differ", f"on {op!r}:\n  {names[0]}: {first!r}\n  {name}: {outcomes[name]!r}"
                )
            other = snapshots[name] if project is None else project(snapshots[name])
            if other != reference:
                diff = self.family.diff(reference, other, names[0], name)
                self._fail("snapshots differ", f"after {op!r}:\n" + "\n".join(diff[:40]))
        self._spent("compare", started)
        started = time.perf_counter()
        # Every snapshot equals the first system's now (checked above); if the previous ones did too, each
        # system's (previous, current) pair equals the first's and one check covers all of them. Under a
        # coarser comparison the whole snapshots may differ, and each system's are checked.
        self._check_invariants(snapshots, op, all_equal=self._snapshots_equal)
        self._spent("invariants", started)
        self.snapshots = snapshots
        self._snapshots_equal = project is None
        if self.on_step is not None:
            self.on_step(len(self.ops), op, first, snapshots[names[0]])
        return first

    def _snapshot(self, name: str, system: System[O, B, S], op: O | None) -> S:
        """``system``'s snapshot; an exception from it (the system's own crash, not a refusal) is a failure
        like a crash in ``apply``: ``Divergence`` with the trace."""
        try:
            return system.snapshot()
        except Exception as error:
            where = "in its first snapshot" if op is None else f"in its snapshot after {op!r}"
            self._fail(f"{name} crashed", f"{where}: {type(error).__name__}: {error}")
            raise  # unreachable: _fail raises

    def _spent(self, what: str, started: float) -> None:
        self.timings[what] = self.timings.get(what, 0.0) + time.perf_counter() - started

    def _check_invariants(self, snapshots: dict[str, S], op: O | None, *, all_equal: bool) -> None:
        """Check the invariants on each system's snapshot (on the first one only when ``all_equal``: every
        system's previous and current snapshots equal the first system's, so the verdicts are the same)."""
        for name, snap in snapshots.items():
            violations = self.family.check(snap)
            if op is not None:
                violations += self.family.check_step(self.snapshots[name], snap, op)
            if violations:
                where = "initially" if op is None else f"after {op!r}"
                self._fail(
                    f"invariant violated on {name}", f"{where}:\n" + "\n".join(f"  {v}" for v in violations)
                )
            if all_equal:
                return

    def trace_text(self) -> str:
        return self.family.dumps_trace(self.config, self.ops)

    def _fail(self, kind: str, message: str) -> None:
        text = self.trace_text()
        path: Path | None = self.trace_dir / f"{self.trace_name}.jsonl" if self.write_trace else None
        try:
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
        except OSError:
            path = None
        against = ",".join(self.systems)
        where = (
            f"trace written to {path}; replay with: refcache replay {path} --against {against}"
            if path
            else "trace not written"
        )
        step = len(self.ops)
        summary = f"step {step}: {kind} {message}"
        history = tuple(repr(op) for op in self.ops[: max(step - 1, 0)])
        raise Divergence(f"{summary}\n{where}\n--- trace ---\n{text}", path, kind, step, summary, history)


HiCacheHarness = Harness[Op, Observation, Snapshot]
"""A harness over HiCache systems (``Harness(config, systems, family=HICACHE)``)."""
