"""Bounded exhaustive exploration: every operation sequence up to a depth, breadth first, over the model.

Theory of operation. The random machines sample; ``explore`` enumerates. From the initial state of one small
configuration it applies every operation enabled there (``refcache.check.enabled.enabled_ops``, the function
the machines' ``step`` rule uses too) over a bounded alphabet (``Bounds``), checks every invariant of the
HiCache family on the state reached and every step invariant on the transition, and keeps the state if its
canonical form is new. Level by level, so the first failure found is one of minimal length: it is written as
a normal trace (``refcache replay``/``shrink`` accept it), with its depth.

A state is the model itself (``HiCacheModel``), forked by pickling (0.1 ms on these configurations, three
times cheaper than ``copy.deepcopy``). Its canonical form (``canonical``) is a BLAKE2b digest of the pickled
model after ``normalize``, which rewrites in place only what the model's behaviour cannot observe:

* the tree's logical access and creation stamps, compressed to their ranks (eviction reads them only through
  ``<`` and ``==``, and new stamps are always larger than every old one);
* caches rebuilt from other fields (the leaf heaps' lazily invalidated entries, the controller's sorted L3
  views) and the coverage counters of transitions taken;
* the iteration order of integer sets and of L3's object table (rebuilt sorted; L3 is read by key and
  through sorted views only).

Request ids are not renamed but chosen canonically: a new request or prefetch takes the smallest id the state
does not reference (``fresh_rid``), so interleavings that end in equal states pick equal ids. Tokens are
relabelled at generation (``token_symmetry``): a sequence may use a token of the alphabet no earlier operation
used only if every smaller unused one is used first. Slots are not renamed: freed pages go back to the free
list sorted, so two states that differ by a renaming of slots allocate differently. specs/exploration.md
says why each reduction is sound.

``explore(..., against=("model", "impl"))`` also runs every explored transition on the other systems through
the differential ``Harness``, replayed from the initial state (the implementation cannot be pickled; forking
a process that holds it is slower at these depths and unsound with L3), so a divergence is found at its
minimal depth too. The replay applies the path without the harness' checks (each proper prefix ran checked
as a transition of its own depth) and checks the transition; with L3 its temporary directories lie on a
tmpfs. specs/exploration.md measures where the lock step's time goes.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import pickle
import shutil
import sqlite3
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from refcache.check.coverage import TABLES, Coverage
from refcache.check.enabled import Bounds, enabled_ops
from refcache.check.harness import Divergence, Harness
from refcache.check.situations import SituationTracker
from refcache.config import HiCacheConfig
from refcache.errors import RefcacheError, UsageError
from refcache.family import Violation
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import (
    FaultKind,
    MatchPrefix,
    Observation,
    Op,
    PrefetchFromStorage,
    PrefetchResult,
    StartRequest,
)
from refcache.hicache.snapshot import Snapshot
from refcache.model import HiCacheModel
from refcache.systems import System, SystemOptions, granularity, open_systems

__all__ = [
    "Counterexample",
    "Explored",
    "Level",
    "Space",
    "canonical",
    "explore",
    "fresh_rid",
    "normalize",
]

DIGEST_BYTES: Final = 16
"""Bytes of the BLAKE2b digest a visited state is kept as (a collision needs about 2**64 states)."""


@dataclass(frozen=True)
class Space:
    """What an exploration covers: a configuration (resolved), the bounded alphabet, whether tokens are
    relabelled at generation (it pays when the alphabet holds sequences that differ by a renaming, such as
    ``(1,)`` and ``(2,)``; it cannot be on with MISPLACED faults, which read L3's key order), and the
    operations the search starts after. Raises ``UsageError`` for relabelling with MISPLACED faults."""

    config: HiCacheConfig
    bounds: Bounds
    token_symmetry: bool = False
    prefix: tuple[Op, ...] = ()  # operations applied first: the search starts from the state they reach

    def __post_init__(self) -> None:
        if self.token_symmetry and FaultKind.MISPLACED in self.bounds.fault_kinds:
            raise UsageError(
                "token relabelling is unsound with MISPLACED faults (they read L3's key order, which "
                "depends on the token values): explore without --token-symmetry or without that fault"
            )


@dataclass(frozen=True)
class Level:
    """One depth of the breadth-first search."""

    depth: int  # operations from the initial state
    frontier: int  # distinct states first reached at this depth
    transitions: int  # operations applied from the states of the depth before
    seconds: float  # wall time of this depth


@dataclass(frozen=True)
class Counterexample:
    """The first failure: a shortest operation sequence from the initial state that breaks a check."""

    ops: tuple[Op, ...]
    what: str  # the violated invariants, or the divergence's summary
    written: Path | None = None  # the trace file, when one was written

    @property
    def depth(self) -> int:
        return len(self.ops)


@dataclass
class Explored:
    """An exploration's result (and, pickled, its checkpoint)."""

    space: Space
    against: tuple[str, ...]
    levels: list[Level] = field(default_factory=list)
    states: int = 1  # distinct states, the initial one included
    transitions: int = 0
    refused: int = 0  # enabled operations a system refused with a typed error (an outcome, still checked)
    lockstep_transitions: int = 0  # transitions replayed on every system of ``against``
    lockstep_depth: int = 0  # the deepest level whose every transition ran in lock step
    seconds: float = 0.0
    complete: bool = False  # every state up to ``depth`` reached (no budget ran out)
    counterexample: Counterexample | None = None
    coverage: Coverage = field(default_factory=Coverage)
    # The frontier of the last finished depth: (pickled model and tracker, path, tokens used so far).
    frontier: list[tuple[bytes, bytes, tuple[Op, ...], frozenset[int]]] = field(default_factory=list)
    visited: set[bytes] = field(default_factory=set)

    @property
    def depth(self) -> int:
        return self.levels[-1].depth if self.levels else 0

    @property
    def states_per_second(self) -> float:
        return self.states / self.seconds if self.seconds else 0.0


# --- the canonical form ---------------------------------------------------------------------------------------


def normalize(model: HiCacheModel) -> None:
    """Rewrite ``model`` in place into the representative of its class (module docstring): stamps compressed to
    their ranks, caches rebuilt, coverage counters cleared, integer sets rebuilt sorted. The model behaves
    exactly as before on every operation sequence (tests/unit/test_explore.py checks it)."""
    for rank in model.ranks:
        nodes = list(rank.nodes.values())
        stamps = sorted({n.last_access_time for n in nodes} | {n.creation_time for n in nodes})
        order = {stamp: i + 1 for i, stamp in enumerate(stamps)}
        for n in nodes:
            n.last_access_time = order[n.last_access_time]
            n.creation_time = order[n.creation_time]
        rank._tick = len(stamps)  # larger than, or equal to, every stamp: the next one is larger than all
        for heap in (rank.leaves, rank.host_leaves):
            heap.members = set(heap.members)
            heap._compact()
        rank.transitions_taken = {}
    model.l3._views.clear()
    model.l3.objects = dict(sorted(model.l3.objects.items()))  # read by key and through sorted views only


def canonical(model: HiCacheModel, used: Iterable[int] = ()) -> bytes:
    """The digest of ``model``'s state (``normalize`` it first) and of the tokens used so far (what token
    relabelling may still rename)."""
    return _digest(pickle.dumps(model, protocol=pickle.HIGHEST_PROTOCOL), used)


def _digest(pickled: bytes, used: Iterable[int]) -> bytes:
    digest = hashlib.blake2b(pickled, digest_size=DIGEST_BYTES)
    digest.update(repr(sorted(used)).encode())
    return digest.digest()


def fresh_rid(model: HiCacheModel) -> int:
    """The smallest request id nothing in ``model`` refers to: no running request, no prefetch of any rank's
    tree or controller (queued, parked, reading, acknowledged, orphaned or being revoked)."""
    used: set[int] = set()
    for rank in model.ranks:
        used |= set(rank.requests) | set(rank.ongoing_prefetch)
        ctrl = rank.cache_controller
        used |= {rid for rid, _ in ctrl.prefetch_revoke_queue}  # (request id, operation id)
        used |= _request_ids(vars(ctrl).values(), depth=3)
    rid = 0
    while rid in used:
        rid += 1
    return rid


def _request_ids(values: Iterable[object], depth: int) -> set[int]:
    """The ``request_id`` of every object among ``values`` and the containers and records they hold, ``depth``
    levels down (a prefetch operation in a queue, a tuple, a parked query): read generically, so that a table
    the controller gains later is not missed."""
    out: set[int] = set()
    for value in values:
        rid = getattr(value, "request_id", None)
        if isinstance(rid, int):
            out.add(rid)
            continue
        if depth == 0 or isinstance(value, (str, bytes, bytearray, int, float, bool)) or value is None:
            continue
        if isinstance(value, dict):
            out |= _request_ids(value.values(), depth - 1)
        elif isinstance(value, (list, tuple, set, frozenset, deque)):
            out |= _request_ids(value, depth - 1)
        elif hasattr(value, "__dict__") and not callable(value):
            out |= _request_ids(vars(value).values(), depth - 1)
    return out


def _token_canonical(op: Op, used: frozenset[int], alphabet: Sequence[int]) -> bool:
    """Whether ``op``'s tokens introduce unused tokens of the alphabet in order: the first new token is the
    smallest unused one, the next new one the next, and so on (any other choice is a relabelling of one of
    these)."""
    if not isinstance(op, (StartRequest, MatchPrefix, PrefetchFromStorage)):
        return True
    unused = [t for t in alphabet if t not in used]
    expected = 0
    seen: set[int] = set()
    for t in op.tokens:
        if t in used or t in seen:
            continue
        if expected >= len(unused) or t != unused[expected]:
            return False
        seen.add(t)
        expected += 1
    return True


# --- one depth -------------------------------------------------------------------------------------------------

Entry = tuple[bytes, bytes, tuple[Op, ...], frozenset[int]]
"""A state of the frontier: the pickled (normalized) model, the pickled situation tracker, its path from the
initial state and the tokens that path used."""


@dataclass
class _Expansion:
    """What expanding some states gave (a worker's answer)."""

    children: list[tuple[bytes, Entry]] = field(default_factory=list)  # (canonical digest, entry)
    transitions: int = 0
    refused: int = 0
    lockstep: int = 0  # transitions also run on the other systems
    coverage: Coverage = field(default_factory=Coverage)
    failure: tuple[tuple[Op, ...], str] | None = None


@dataclass(frozen=True)
class _Lockstep:
    """The systems every transition also runs on, and how their parent states are reached."""

    against: tuple[str, ...]  # the model first
    options: SystemOptions | None
    fork: bool  # fork one process per transition from the parent's state; else replay from the initial state
    check_path: bool = (
        False  # replay the whole path through the harness (else the path unchecked: _at_parent)
    )


def _expand(space: Space, entries: Sequence[Entry], lockstep: _Lockstep | None = None) -> _Expansion:
    out = _Expansion()
    alphabet = sorted(space.bounds.tokens())
    cov = out.coverage
    for blob, tracked, path, used in entries:
        parent = pickle.loads(blob)
        before = parent.snapshot()
        rid = fresh_rid(parent)
        ops = [
            op
            for op in enabled_ops(before, space.bounds, rid)
            if not space.token_symmetry or _token_canonical(op, used, alphabet)
        ]
        if lockstep is not None:
            run = _lockstep_forked if lockstep.fork else _lockstep_replayed
            for op, failure in zip(ops, run(space, lockstep, path, ops), strict=True):
                out.lockstep += 1
                if failure is not None:
                    out.failure = ((*path, op), failure)
                    return out
        for op in ops:
            model, tracker = pickle.loads(blob), pickle.loads(tracked)
            out.transitions += 1
            try:
                outcome: object = model.apply(op)
            except UsageError:
                out.transitions -= 1  # not enabled after all: the model refuses it with the state unchanged
                continue
            except RefcacheError as error:
                outcome = error
                out.refused += 1
            except Exception as error:  # the model itself crashed: a finding
                out.failure = ((*path, op), f"model crashed: {type(error).__name__}: {error}")
                return out
            after = model.snapshot()
            violations: list[Violation] = HICACHE.check(after) + HICACHE.check_step(before, after, op)
            if violations:
                out.failure = ((*path, op), "\n".join(str(v) for v in violations))
                return out
            _count(cov, model, tracker, op, outcome, before, after)
            normalize(model)
            now_used = used | _tokens_of(op)
            child = pickle.dumps(model, protocol=pickle.HIGHEST_PROTOCOL)  # one pickle: the state and its key
            key = _digest(child, now_used if space.token_symmetry else ())
            tracker_bytes = pickle.dumps(tracker, protocol=pickle.HIGHEST_PROTOCOL)
            out.children.append((key, (child, tracker_bytes, (*path, op), now_used)))
    return out


def _tokens_of(op: Op) -> frozenset[int]:
    if isinstance(op, (StartRequest, MatchPrefix, PrefetchFromStorage)):
        return frozenset(op.tokens)
    return frozenset()


def _count(
    cov: Coverage,
    model: HiCacheModel,
    tracker: SituationTracker,
    op: Op,
    outcome: object,
    before: Snapshot,
    after: Snapshot,
) -> None:
    """The coverage ledger's counts for one transition, in the machines' terms (``HiCacheMachine._on_step``)."""
    cov.steps += 1
    reason = outcome.reason if isinstance(outcome, PrefetchResult) else None
    cov.outcomes[type(op).__name__ + ("" if reason is None else f":{reason}")] += 1
    for node in after.ranks[0].nodes:
        cov.states[node.state.value] += 1
    for (s, e), n in model.transitions_taken().items():
        cov.transitions[f"{s.value}--{e.value}"] += n
    if not isinstance(outcome, RefcacheError):
        for situation in set(tracker.observe(op, outcome, before, after)):  # type: ignore[arg-type]
            cov.situations[situation] += 1
    r0, r1 = before.ranks[0], after.ranks[0]
    for table in TABLES:
        was, now = len(getattr(r0, table)), len(getattr(r1, table))
        if now and not was:
            cov.filled[table] += 1
        if was and not now:
            cov.drained[table] += 1


def _merge(into: Coverage, other: Coverage) -> None:
    for name in ("states", "transitions", "filled", "drained", "outcomes", "situations"):
        counter: Counter[str] = getattr(into, name)
        counter.update(getattr(other, name))
    into.steps += other.steps


class _Visited:
    """The digests of the states reached: a set in memory, or a SQLite table on disk (``spill``)."""

    def __init__(self, initial: set[bytes], spill: Path | None) -> None:
        self.memory = initial
        self.db: sqlite3.Connection | None = None
        if spill is not None:
            self.db = sqlite3.connect(spill)
            self.db.execute("CREATE TABLE IF NOT EXISTS seen (key BLOB PRIMARY KEY) WITHOUT ROWID")
            self.db.executemany("INSERT OR IGNORE INTO seen VALUES (?)", ((k,) for k in initial))
            self.memory = set()

    def add(self, key: bytes) -> bool:
        """Whether ``key`` is new (and now seen)."""
        if self.db is None:
            if key in self.memory:
                return False
            self.memory.add(key)
            return True
        cursor = self.db.execute("INSERT OR IGNORE INTO seen VALUES (?)", (key,))
        return cursor.rowcount == 1

    def keys(self) -> set[bytes]:
        if self.db is None:
            return self.memory
        return {row[0] for row in self.db.execute("SELECT key FROM seen")}


# --- the search ---------------------------------------------------------------------------------------------------


def initial(space: Space, against: Sequence[str] = ("model",)) -> Explored:
    """The exploration before its first depth: the initial state (after ``space.prefix``, every step checked)
    checked and seen."""
    model = HiCacheModel(space.config)
    tracker = SituationTracker(model.config)
    result = Explored(space, tuple(against))
    before = model.snapshot()
    violations = HICACHE.check(before)
    done: tuple[Op, ...] = ()
    for op in space.prefix:
        if violations:
            break
        done = (*done, op)
        outcome = _apply_or_error(model, op)
        after = model.snapshot()
        violations = HICACHE.check(after) + HICACHE.check_step(before, after, op)
        if not isinstance(outcome, RefcacheError):
            tracker.observe(op, outcome, before, after)
        before = after
    if violations:
        result.counterexample = Counterexample(done, "\n".join(str(v) for v in violations))
        return result
    used = frozenset(t for op in space.prefix for t in _tokens_of(op))
    normalize(model)
    result.visited = {canonical(model, used if space.token_symmetry else ())}
    result.frontier = [
        (
            pickle.dumps(model, protocol=pickle.HIGHEST_PROTOCOL),
            pickle.dumps(tracker, protocol=pickle.HIGHEST_PROTOCOL),
            space.prefix,
            used,
        )
    ]
    return result


def _apply_or_error(model: HiCacheModel, op: Op) -> Observation | RefcacheError:
    try:
        return model.apply(op)
    except RefcacheError as error:
        return error


def explore(
    space: Space,
    *,
    depth: int,
    against: Sequence[str] = ("model",),
    max_states: int | None = None,
    seconds: float | None = None,
    jobs: int = 1,
    resume: Explored | None = None,
    checkpoint: Path | None = None,
    spill: Path | None = None,
    trace_dir: Path | None = None,
    options: SystemOptions | None = None,
    fork: bool = False,
    check_path: bool = False,
    on_level: Callable[[Explored], None] | None = None,
    on_progress: Callable[[int, int, int], None] | None = None,
) -> Explored:
    """Breadth-first search of ``space`` to ``depth`` operations (module docstring). Stops early at the first
    failure (``Explored.counterexample``, written under ``trace_dir`` when given), after ``max_states``
    distinct states or ``seconds`` of wall time (then ``complete`` is False and the last depth is partial).
    ``against``: the systems every transition also runs on, in lock step with the model (the first must be
    ``model``). ``jobs`` > 1 splits each depth's frontier across processes. ``resume`` goes on from an earlier
    result (``load``), ``checkpoint`` saves one after every depth. ``fork``: reach a transition's parent state
    by forking a process that holds it instead of replaying from the initial state (slower at the depths
    reached here, and unsound with L3: specs/exploration.md measures both). ``check_path``: replay every step
    of a transition's path through the harness, checked again (the former way, measured against the default
    in specs/exploration.md), instead of the path unchecked and only the transition checked. ``on_level`` sees the result
    after each depth, ``on_progress`` (states, depth, transitions) during one. Raises ``UsageError`` when
    ``against`` does not start with the model."""
    if not against or against[0] != "model":
        raise UsageError("explore searches the model's states: --against must start with model")
    result = resume if resume is not None else initial(space, against)
    if result.counterexample is not None:
        return result
    visited = _Visited(result.visited, spill)
    started = time.perf_counter() - result.seconds
    lockstep = _Lockstep(tuple(against), options, bool(fork), bool(check_path)) if len(against) > 1 else None
    with _scratch_on_tmpfs(lockstep is not None and space.config.enable_storage):
        pool = multiprocessing.get_context("fork").Pool(jobs) if jobs > 1 else None
        try:
            while result.depth < depth and result.frontier:
                level_start = time.perf_counter()
                nxt: list[Entry] = []
                transitions = 0
                stopped = False
                chunks = _chunks(
                    result.frontier, jobs * 4 if pool else max(1, len(result.frontier) // 50 or 1)
                )
                answers: Iterable[_Expansion]
                if pool is not None:
                    answers = pool.imap(_expand_star, ((space, chunk, lockstep) for chunk in chunks))
                else:
                    answers = (_expand(space, chunk, lockstep) for chunk in chunks)
                for answer in answers:
                    transitions += answer.transitions
                    result.refused += answer.refused
                    result.lockstep_transitions += answer.lockstep
                    _merge(result.coverage, answer.coverage)
                    if answer.failure is not None:
                        path, what = answer.failure
                        result.counterexample = _write(space, path, what, trace_dir)
                        stopped = True
                        break
                    for key, entry in answer.children:
                        if visited.add(key):
                            nxt.append(entry)
                            result.states += 1
                    if on_progress is not None:
                        on_progress(result.states, result.depth + 1, result.transitions + transitions)
                    if (max_states is not None and result.states >= max_states) or (
                        seconds is not None and time.perf_counter() - started >= seconds
                    ):
                        stopped = True
                        break
                result.transitions += transitions
                result.levels.append(
                    Level(result.depth + 1, len(nxt), transitions, time.perf_counter() - level_start)
                )
                result.frontier = nxt
                result.seconds = time.perf_counter() - started
                if lockstep is not None and not stopped:
                    result.lockstep_depth = result.depth
                if stopped:
                    result.complete = False
                    break
                result.visited = visited.keys() if visited.db is None else set()
                if checkpoint is not None:
                    save(result, checkpoint)
                if on_level is not None:
                    on_level(result)
            else:
                result.complete = result.counterexample is None
        finally:
            if pool is not None:
                pool.close()
                pool.join()
    result.seconds = time.perf_counter() - started
    result.visited = visited.keys() if visited.db is None else set()
    return result


TMPFS: Final = Path("/dev/shm")


@contextmanager
def _scratch_on_tmpfs(wanted: bool) -> Iterator[None]:
    """While ``wanted`` (a lock step with L3) and TMPDIR is not set: Python's temporary directories, hence each
    replay's L3 directory, which the implementation makes and removes, under a fresh directory on a tmpfs,
    when the machine has one. Removing a replay's L3 directory was 40 % of such a lock step on this machine's
    disk (4.5 ms a replay; 0.4 ms on /dev/shm: specs/exploration.md). Where the directory lies changes
    nothing the implementation reads: it names and reads its files inside it."""
    if not wanted or "TMPDIR" in os.environ or not (TMPFS.is_dir() and os.access(TMPFS, os.W_OK)):
        yield
        return
    saved = tempfile.tempdir
    base = tempfile.mkdtemp(prefix="refcache-explore-", dir=TMPFS)
    tempfile.tempdir = base
    try:
        yield
    finally:
        tempfile.tempdir = saved
        shutil.rmtree(base, ignore_errors=True)


def _expand_star(args: tuple[Space, Sequence[Entry], _Lockstep | None]) -> _Expansion:
    return _expand(*args)


def _chunks(items: list[Entry], n: int) -> list[list[Entry]]:
    size = max(1, -(-len(items) // max(1, n)))
    return [items[i : i + size] for i in range(0, len(items), size)]


def _harness(
    space: Space, lockstep: _Lockstep, opened: Mapping[str, System[Op, Observation, Snapshot]]
) -> Harness[Op, Observation, Snapshot]:
    return Harness(
        space.config,
        opened,
        family=HICACHE,
        write_trace=False,
        compare=granularity(lockstep.against, HICACHE),
    )


def _lockstep_replayed(
    space: Space, lockstep: _Lockstep, path: tuple[Op, ...], ops: Sequence[Op]
) -> list[str | None]:
    """Each of ``ops`` after ``path``, on fresh systems replayed from the initial state: the divergence's
    summary, or None, per operation. ``path`` is replayed without the harness' checks (``_at_parent``: it
    ran checked, step by step, when it was itself a transition; the first depth, after ``space.prefix``,
    replays checked) and only ``op`` goes through the harness;
    whatever goes wrong in the unchecked part is replayed again checked from the initial state
    (``_replayed_checked``), so that a failure's summary is the harness' own."""
    out: list[str | None] = []
    if lockstep.check_path or len(path) <= len(space.prefix):  # --from's operations never ran as transitions
        return [_replayed_checked(space, lockstep, (*path, op)) for op in ops]
    for op in ops:
        with open_systems(lockstep.against, space.config, lockstep.options, family=HICACHE) as opened:
            harness = _at_parent(space, lockstep, opened, path)
            if harness is not None:
                try:
                    harness.step(op)
                except Divergence as error:
                    out.append(f"{error.kind}: {error.summary}")
                    continue
                out.append(None)
                continue
        out.append(_replayed_checked(space, lockstep, (*path, op)))
    return out


def _at_parent(
    space: Space,
    lockstep: _Lockstep,
    opened: Mapping[str, System[Op, Observation, Snapshot]],
    path: tuple[Op, ...],
) -> Harness[Op, Observation, Snapshot] | None:
    """A harness over ``opened`` after every system applied ``path`` directly (no snapshot, comparison or
    invariant on the way), its trace holding ``path``; None when a system crashed on the way or the harness
    refused the state it starts from (the caller replays checked).

    Sound because the systems are deterministic (the manual executor, a logical clock: the lock step opens
    them so) and every proper prefix of ``path`` ran through the harness, checked, when it was a transition
    of its own depth; the last step's comparison covers both systems' whole snapshots after ``path`` and
    ``op``. Should a system not reproduce its state, the check of ``op`` still runs both systems on exactly
    ``path`` then ``op``: what it reports is a divergence of that sequence."""
    for step in path:
        for system in opened.values():
            try:
                system.apply(step)
            except RefcacheError:
                pass  # a refusal is an outcome: the harness compared it when this step was checked
            except Exception:
                return None
    try:
        harness = _harness(space, lockstep, opened)
    except Divergence:
        return None
    harness.ops = list(path)
    return harness


def _replayed_checked(space: Space, lockstep: _Lockstep, path: tuple[Op, ...]) -> str | None:
    """``path`` on fresh systems through the harness, every step checked: the divergence's summary, or None."""
    with open_systems(lockstep.against, space.config, lockstep.options, family=HICACHE) as opened:
        harness = _harness(space, lockstep, opened)
        try:
            for step in path:
                harness.step(step)
        except Divergence as error:
            return f"{error.kind}: {error.summary}"
    return None


def _lockstep_forked(
    space: Space, lockstep: _Lockstep, path: tuple[Op, ...], ops: Sequence[Op]
) -> list[str | None]:
    """Each of ``ops`` after ``path``: the systems replay ``path`` once, then one forked process per operation
    applies it and reports through a pipe (the parent's systems stay in the parent's state). Only without L3:
    forked children would share the implementation's L3 directory."""
    with open_systems(lockstep.against, space.config, lockstep.options, family=HICACHE) as opened:
        harness = _harness(space, lockstep, opened)
        try:
            for step in path:
                harness.step(step)
        except Divergence as error:
            return [f"{error.kind}: {error.summary}"] * len(ops)
        out: list[str | None] = []
        for op in ops:
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: one step, its verdict down the pipe, and out without any cleanup
                os.close(read)
                message = ""
                try:
                    harness.step(op)
                except Divergence as error:
                    message = f"{error.kind}: {error.summary}"
                except BaseException as error:  # whatever it is, the parent must hear of it
                    message = f"lock step crashed: {type(error).__name__}: {error}"
                with os.fdopen(write, "wb") as pipe:
                    pipe.write(message.encode())
                os._exit(0)
            os.close(write)
            with os.fdopen(read, "rb") as pipe:
                answer = pipe.read().decode()
            os.waitpid(pid, 0)
            out.append(answer or None)
    return out


def _write(space: Space, path: tuple[Op, ...], what: str, trace_dir: Path | None) -> Counterexample:
    written = None
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        written = trace_dir / f"explore-depth{len(path)}.jsonl"
        written.write_text(HICACHE.dumps_trace(space.config, path))
    return Counterexample(path, what, written)


def save(result: Explored, path: Path) -> None:
    """Write ``result`` as a checkpoint ``explore(resume=load(path))`` goes on from (atomically)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    os.replace(tmp, path)


def load(path: Path) -> Explored:
    """A checkpoint ``save`` wrote. Raises ``UsageError`` for a file that is not one."""
    try:
        result = pickle.loads(path.read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError) as error:
        raise UsageError(f"{path} is not an exploration checkpoint: {error}") from error
    if not isinstance(result, Explored):
        raise UsageError(f"{path} is not an exploration checkpoint")
    return result


# --- coverage, in the ledger's terms ----------------------------------------------------------------------------


def sampled_coverage(examples: int | None = None, steps: int | None = None) -> Coverage:
    """The ledger the random model machines fill at the default budget (``refcache coverage``'s run: the
    derandomized sample CI runs, fault-free and fault-injecting), to compare an exploration with."""
    from hypothesis.stateful import run_state_machine_as_test

    from refcache.check import budget
    from refcache.check.machines import machine
    from refcache.check.run import hypothesis_storage

    ledger = Coverage()
    chosen = budget.Budget(examples or budget.MODEL.examples, steps or budget.MODEL.steps)
    with hypothesis_storage():
        for faults in (False, True):
            run_state_machine_as_test(  # type: ignore[no-untyped-call, unused-ignore]
                machine(faults=faults, coverage=ledger), settings=chosen.settings(derandomize=True)
            )
    return ledger


def _reached(cov: Coverage) -> dict[str, set[str]]:
    """What a ledger reached, by the report's sections (``coverage_report``)."""
    return {
        "node states": {k for k, v in cov.states.items() if v},
        "transitions": {k for k, v in cov.transitions.items() if v},
        "tables filled": {k for k, v in cov.filled.items() if v},
        "tables drained": {k for k, v in cov.drained.items() if v},
        "situations": {k for k, v in cov.situations.items() if v},
        "outcomes": {k for k, v in cov.outcomes.items() if v},
    }


def compare_coverage(explored: Coverage, sampled: Coverage) -> str:
    """Per section of the coverage ledger: how much each reached, and what only one of them reached."""
    mine, theirs = _reached(explored), _reached(sampled)
    lines = ["coverage, exploration vs the random machines at the default budget:"]
    for section in mine:
        a, b = mine[section], theirs[section]
        lines.append(f"  {section}: exploration {len(a)}, machines {len(b)}, both {len(a & b)}")
        if a - b:
            lines.append(f"    only the exploration: {', '.join(sorted(a - b))}")
        if b - a:
            lines.append(f"    only the machines: {', '.join(sorted(b - a))}")
    return "\n".join(lines)
