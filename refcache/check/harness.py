"""The differential harness: one operation applied to several systems, compared, checked, recorded.

``Harness.step(op)`` applies ``op`` to every system (the model, the implementation, another engine
through an adapter), then checks, in this order:

1. the outcomes agree — equal observations, or the same typed error from every system;
2. the snapshots agree, field by field (``diff_snapshots`` names the node by token path, the field and
   both values);
3. every invariant of ``refcache.invariants`` holds on every system's snapshot, and the step invariants
   hold between its previous and current snapshot. The invariants are functions of the snapshots alone, so
   where check 2 found every snapshot equal to the first system's (and the previous ones were equal too)
   they run once, on the first system's: the verdict on the others is the same.

What "snapshot", "invariant" and "trace" mean is the systems' engine family's: ``Harness(...,
invariants=family)`` takes an ``InvariantFamily`` (HiCache's, ``HICACHE``, by default; vLLM's is
``refcache.check.vllm_machines.VLLM``).

The first failure raises ``Divergence`` after writing the run so far — the failing operation last — as a
versioned JSONL trace (``refcache.trace``) that ``refcache replay`` re-executes. The trace text is also
part of the error message, so it survives in CI logs when files do not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

from refcache.config import HiCacheConfig
from refcache.errors import RefcacheError
from refcache.invariants import Violation, check_all, check_step
from refcache.ops import Observation, Op, Reset
from refcache.snapshot import NodeRecord, RankSnapshot, Snapshot
from refcache.systems import System
from refcache.trace import dumps_trace

__all__ = [
    "HICACHE",
    "TRACE_DIR_ENV",
    "Divergence",
    "Harness",
    "InvariantFamily",
    "Outcome",
    "diff_snapshots",
    "expect",
    "status_line",
]

TRACE_DIR_ENV: Final = "REFCACHE_TRACE_DIR"


class Divergence(AssertionError):
    """Raised by ``Harness.step`` when systems disagree or an invariant breaks. ``kind`` names the check
    that fired ("outcomes differ", "snapshots differ", "invariant violated on impl", "impl crashed"),
    ``step`` the 1-based failing operation (0: the initial state), ``trace_path`` the written trace
    (``None`` if none was written); the message says what differed."""

    def __init__(
        self, message: str, trace_path: Path | None, kind: str = "", step: int = 0, summary: str = ""
    ) -> None:
        super().__init__(message)
        self.trace_path = trace_path
        self.kind = kind
        self.step = step
        self.summary = summary or message  # what differed, without where the trace went or its text


Outcome = Observation | RefcacheError
"""What one step returns: the systems' common observation, or the typed error every one of them raised."""

_Obs = TypeVar("_Obs", bound=Observation)


def expect(outcome: Outcome, kind: type[_Obs]) -> _Obs:
    """``outcome`` as the observation type its operation returns (``StartRequest`` → ``StartResult``, ...).
    Re-raises an error outcome; a wrong type is a broken system, reported as an ``AssertionError``."""
    if isinstance(outcome, RefcacheError):
        raise outcome
    if not isinstance(outcome, kind):
        raise AssertionError(f"expected a {kind.__name__}, got {outcome!r}")
    return outcome


def _outcome_key(outcome: Outcome) -> object:
    """Observations compare by value; errors by type (messages are free text)."""
    return type(outcome).__name__ if isinstance(outcome, RefcacheError) else outcome


@dataclass(frozen=True)
class InvariantFamily:
    """What the harness checks and writes for one engine family: the state invariants of a snapshot, the
    step invariants between two snapshots and the operation between them, a readable diff of two snapshots
    and the trace text of a run. Typed over ``Any`` because each family has its own snapshot and
    operation types (``Snapshot`` and ``Op`` for HiCache)."""

    name: str
    check: Callable[[Any], list[Violation]]
    check_step: Callable[[Any, Any, Any], list[Violation]]
    diff: Callable[[Any, Any, str, str], list[str]]
    dumps: Callable[[HiCacheConfig, Sequence[Any]], str]


def _hicache_step(before: Snapshot, after: Snapshot, op: Op) -> list[Violation]:
    return [] if isinstance(op, Reset) else check_step(before, after)


class Harness:
    """Apply operations to ``systems`` in lock step and check them (see the module docstring).

    ``trace_name`` names the trace file written on failure under ``trace_dir`` (default: the
    ``REFCACHE_TRACE_DIR`` environment variable, else ``./refcache-traces``); ``write_trace=False`` writes
    none (the trace text is still in the message), for callers that replay many candidates.
    """

    def __init__(
        self,
        config: HiCacheConfig,
        systems: Mapping[str, System],
        *,
        trace_name: str = "failure",
        trace_dir: str | os.PathLike[str] | None = None,
        on_step: Callable[[int, Op, Outcome, Snapshot], None] | None = None,
        write_trace: bool = True,
        invariants: InvariantFamily | None = None,
    ) -> None:
        if not systems:
            raise ValueError("the harness needs at least one system")
        self.config = config
        self.systems = dict(systems)
        self.ops: list[Op] = []
        self.trace_name = trace_name
        self.trace_dir = Path(trace_dir or os.environ.get(TRACE_DIR_ENV) or "refcache-traces")
        self.on_step = on_step
        self.write_trace = write_trace
        self.family = invariants or HICACHE  # the engine family's invariants, snapshot diff and traces
        self.timings: dict[str, float] = {}  # seconds per system (apply + snapshot), "compare", "invariants"
        # Each system's snapshot after the last step (the step invariants compare the next one with it).
        self.snapshots: dict[str, Snapshot] = {
            name: self._snapshot(name, system, None) for name, system in self.systems.items()
        }
        self._check_invariants(self.snapshots, None, all_equal=False)
        # Whether every system's last snapshot equals the first system's (true after every step: check 2).
        first = next(iter(self.snapshots.values()))
        self._snapshots_equal = all(s == first for s in self.snapshots.values())

    def step(self, op: Op) -> Outcome:
        """Apply ``op`` everywhere; return the (common) outcome or raise ``Divergence``."""
        self.ops.append(op)
        outcomes: dict[str, Outcome] = {}
        snapshots: dict[str, Snapshot] = {}
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
        for name in names[1:]:
            if _outcome_key(outcomes[name]) != _outcome_key(first):
                self._fail(
                    "outcomes differ", f"on {op!r}:\n  {names[0]}: {first!r}\n  {name}: {outcomes[name]!r}"
                )
            if snapshots[name] != snapshots[names[0]]:
                diff = self.family.diff(snapshots[names[0]], snapshots[name], names[0], name)
                self._fail("snapshots differ", f"after {op!r}:\n" + "\n".join(diff[:40]))
        self._spent("compare", started)
        started = time.perf_counter()
        # Every snapshot equals the first system's now (checked above); if the previous ones did too, each
        # system's (previous, current) pair equals the first's and one check covers all of them.
        self._check_invariants(snapshots, op, all_equal=self._snapshots_equal)
        self._spent("invariants", started)
        self.snapshots = snapshots
        self._snapshots_equal = True
        if self.on_step is not None:
            self.on_step(len(self.ops), op, first, snapshots[names[0]])
        return first

    def _snapshot(self, name: str, system: System, op: Op | None) -> Snapshot:
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

    def _check_invariants(self, snapshots: dict[str, Snapshot], op: Op | None, *, all_equal: bool) -> None:
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
        return self.family.dumps(self.config, self.ops)

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
        raise Divergence(f"{summary}\n{where}\n--- trace ---\n{text}", path, kind, step, summary)


# --- snapshot diff ----------------------------------------------------------------------------------------


def _fmt_node(node: NodeRecord) -> str:
    return f"{node.id.namespace or '-'}:{list(node.id.path)}"


def _field_diff(prefix: str, a: object, b: object, name_a: str, name_b: str) -> list[str]:
    if a == b:
        return []
    if is_dataclass(a) and is_dataclass(b) and type(a) is type(b) and not isinstance(a, type):
        out: list[str] = []
        for f in fields(a):
            out += _field_diff(f"{prefix}.{f.name}", getattr(a, f.name), getattr(b, f.name), name_a, name_b)
        return out
    return [f"{prefix}: {name_a}={a!r} {name_b}={b!r}"]


def _rank_diff(a: RankSnapshot, b: RankSnapshot, name_a: str, name_b: str) -> list[str]:
    out: list[str] = []
    nodes_a = {n.id: n for n in a.nodes}
    nodes_b = {n.id: n for n in b.nodes}
    for node_id in sorted(set(nodes_a) | set(nodes_b)):
        na, nb = nodes_a.get(node_id), nodes_b.get(node_id)
        if na is None or nb is None:
            present = name_a if na is not None else name_b
            node = na or nb
            assert node is not None
            out.append(f"rank {a.rank} node {_fmt_node(node)}: only in {present}")
        else:
            out += _field_diff(f"rank {a.rank} node {_fmt_node(na)}", na, nb, name_a, name_b)
    for f in fields(a):
        if f.name not in ("nodes", "rank"):
            out += _field_diff(
                f"rank {a.rank} {f.name}", getattr(a, f.name), getattr(b, f.name), name_a, name_b
            )
    return out


def diff_snapshots(a: Snapshot, b: Snapshot, name_a: str = "model", name_b: str = "impl") -> list[str]:
    """Readable differences between two snapshots: which node (by token path), which field, both values."""
    out: list[str] = []
    for f in fields(a):
        if f.name != "ranks":
            out += _field_diff(f.name, getattr(a, f.name), getattr(b, f.name), name_a, name_b)
    if len(a.ranks) != len(b.ranks):
        return [*out, f"ranks: {name_a} has {len(a.ranks)}, {name_b} has {len(b.ranks)}"]
    for ra, rb in zip(a.ranks, b.ranks, strict=True):
        out += _rank_diff(ra, rb, name_a, name_b)
    return out


def status_line(snap: Snapshot) -> str:
    """One line per step in the spirit of TigerBeetle's VOPR: tier occupancy and in-flight counts."""
    parts = []
    for r in snap.ranks:
        d = r.device.size - len(r.device.free)
        h = r.host.size - len(r.host.free)
        q = ",".join(f"{name}={n}" for name, n in r.queues if n)
        parts.append(
            f"r{r.rank} L1 {d}/{r.device.size} L2 {h}/{r.host.size} L3 {len(r.l3_keys)} n{len(r.nodes)} "
            f"wt{len(r.ongoing_write_through)} lb{len(r.ongoing_load_back)} bk{len(r.ongoing_backup)} "
            f"pf{len(r.ongoing_prefetch)} rq{len(r.requests)}" + (f" [{q}]" if q else "")
        )
    return f"t={snap.clock_us}us " + " | ".join(parts)


HICACHE: Final = InvariantFamily("hicache", check_all, _hicache_step, diff_snapshots, dumps_trace)
"""HiCache's family: ``refcache.invariants`` over ``Snapshot``, traces of ``refcache.ops``."""
