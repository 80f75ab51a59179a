"""Replaying a recorded trace (``refcache.hicache.recording``) on a system: where did the engine leave the spec?

``replay_recorded(recording, systems)`` applies each recorded operation to ``systems`` (the model by
default) through the differential ``Harness`` (so their invariants are checked, and several systems are
compared with each other as usual), then compares the outcome with what the engine observed and, where the
recorder took one, the snapshot with the engine's. The first difference raises ``Divergence`` naming the
step, the operation and both values ("outcomes differ": the two observations; "snapshots differ": the
snapshot diff, node by token path and field, of the system against the recorded engine).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from refcache.check.harness import Divergence, Harness, Outcome, diff_snapshots
from refcache.errors import RefcacheError
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import Op
from refcache.hicache.recording import Recording
from refcache.hicache.snapshot import Snapshot
from refcache.systems import open_systems

__all__ = ["replay_recorded"]


def _fail(recording: Recording, step: int, kind: str, message: str) -> Divergence:
    summary = f"step {step}: {kind} {message}"
    return Divergence(summary, None, kind, step, summary)


def replay_recorded(
    recording: Recording,
    systems: Sequence[str] = ("model",),
    *,
    on_step: Callable[[int, Op, Outcome, Snapshot], None] | None = None,
) -> int:
    """Replay ``recording`` on fresh ``systems`` and compare with the engine step by step (module
    docstring). Returns the steps replayed; raises ``Divergence`` at the first difference."""
    engine = recording.engine
    with open_systems(systems, recording.config) as opened:
        harness = Harness(recording.config, opened, on_step=on_step, write_trace=False, family=HICACHE)
        first = next(iter(opened))
        for step, (op, seen, snap) in enumerate(
            zip(recording.ops, recording.observed, recording.snapshots, strict=True), start=1
        ):
            outcome = harness.step(op)
            if seen is not None and (isinstance(outcome, RefcacheError) or outcome != seen):
                raise _fail(
                    recording,
                    step,
                    "outcomes differ",
                    f"on {op!r}:\n  {first}: {outcome!r}\n  {engine}: {seen!r}",
                )
            if snap is not None and harness.snapshots[first] != snap:
                diff = diff_snapshots(harness.snapshots[first], snap, first, engine)
                raise _fail(recording, step, "snapshots differ", f"after {op!r}:\n" + "\n".join(diff[:40]))
    return len(recording.ops)
