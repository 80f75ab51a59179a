"""Two SGLang ranks with L3 (``_tp`` and ``_storage``): each rank's storage threads are stepped alone, and a
step that enters one of 0.5.20's storage all-reduces (the prefetch thread's MIN of the storage hits, the
prefetch sync thread's MIN of a read's completed tokens) stays in flight until the other rank has taken the
same step, as the model's parked query does; the harness compares observations and both ranks' snapshots
after every step."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from refcache.check.harness import Divergence, Harness, HiCacheHarness
from refcache.check.recorded import replay_recorded
from refcache.config import PROFILES, AttentionKind, HiCacheConfig, PrefetchPolicy
from refcache.engines.sglang import SGLangRanks, open_system, versions
from refcache.engines.sglang._tp import RELEASED, merge_ranks
from refcache.engines.sglang.record import RecordingError, record
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import (
    AdvanceClock,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    EventsResult,
    FaultKind,
    IOQueue,
    IOResult,
    MatchPrefix,
    MatchResult,
    Observation,
    Op,
    PrefetchFromStorage,
    ProgressResult,
    Reset,
    ResetResult,
    StorageFault,
)
from refcache.hicache.recording import NeverReturned, Recording, read_recording
from refcache.hicache.snapshot import Snapshot
from refcache.model import HiCacheModel
from refcache.systems import OpenSystems

from .test_l3 import A, config, stops_on_r13, to_l3
from .test_record import ADMISSION_ERA, record_documents

RELEASE = versions.installed().row
pytestmark = pytest.mark.skipif(
    2 not in RELEASE.l3_ranks_on("sglang"),
    reason=f"the sglang system (HiRadixCache) does not open SGLang {RELEASE.version} with two ranks and L3",
)
PROFILE = PROFILES[versions.installed_profile()]
"""The installed release's (0.5.18: no prefetch acks, D-54; its one storage all-reduce is the hit query's)."""
ACKED = not PROFILE["prefetch_progress_in_operation"]  # 0.5.19 on: the sync thread reduces each read's ack


def two_ranks(**options: Any) -> HiCacheConfig:
    return config(1, storage_batch_size=4, tp_size=2, **options).with_fidelity(PROFILE).resolve()


def on_both(ops: list[Op]) -> list[Op]:
    """``ops`` with every CompleteIO run on rank 0, then on rank 1."""
    out: list[Op] = []
    for op in ops:
        out += [op, CompleteIO(op.queue, 1, op.count)] if isinstance(op, CompleteIO) else [op]
    return out


@contextmanager
def a_in_l3_on_two_ranks(cfg: HiCacheConfig) -> Iterator[HiCacheHarness]:
    """The model and two SGLang ranks in one harness, with ``A`` written through to both ranks' L3."""
    sglang = open_system(cfg)
    assert isinstance(sglang, SGLangRanks)
    with OpenSystems[Op, Observation, Snapshot]({"model": HiCacheModel(cfg), "sglang": sglang}) as systems:
        harness = Harness(cfg, systems, write_trace=False, family=HICACHE)
        for op in on_both(to_l3(A)):
            harness.step(op)
        yield harness


def queue(harness: HiCacheHarness, rank: int, name: str) -> int:
    queues: dict[str, int] = dict(harness.snapshots["sglang"].ranks[rank].queues)
    return queues[name]


def test_a_storage_step_on_one_rank_waits_in_its_all_reduce_for_the_other() -> None:
    """Rank 1 lost a page of A (its own file: MHA keys name the rank), so its hit query finds fewer pages;
    the query on rank 0 stays in the MIN all-reduce (nothing to drain) until rank 1's query, and then both
    ranks allocate and read the MIN. Each read's ack waits in the sync thread's all-reduce until the other
    rank has read that batch."""
    with a_in_l3_on_two_ranks(two_ranks()) as harness:
        assert len(harness.snapshots["sglang"].ranks[1].l3_keys) == 8
        harness.step(StorageFault(FaultKind.DELETE, 1, 5))  # rank 1's sorted view: some page of A
        harness.step(PrefetchFromStorage(2, A))
        assert harness.step(CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1)) == IOResult(1)
        assert queue(harness, 0, "prefetch_query") == 1  # in the all-reduce: rank 1 has not queried
        assert harness.step(CheckHicacheEvents()) == EventsResult(0, 0, 0, 0, 0)
        assert queue(harness, 0, "prefetch_io") == 0
        assert harness.step(CompleteIO(IOQueue.PREFETCH_QUERY, 1, 1)) == IOResult(1)
        harness.step(CheckHicacheEvents())  # both ranks drain the MIN of the hits and allocate
        hits = harness.snapshots["sglang"].ranks[0].ongoing_prefetch[0].hit_pages
        assert 0 < hits < 8 and harness.snapshots["sglang"].ranks[1].ongoing_prefetch[0].hit_pages == hits
        assert harness.step(CompleteIO(IOQueue.PREFETCH_IO, 0, 4)) == IOResult(1)
        events = harness.step(CheckHicacheEvents())
        assert isinstance(events, EventsResult) and events.host_releases == 0  # rank 1's ack is not there yet
        assert harness.step(CompleteIO(IOQueue.PREFETCH_IO, 1, 4)) == IOResult(1)
        harness.step(CheckHicacheEvents())
        for rank in (0, 1):
            assert queue(harness, rank, "prefetch_io") in (0, 1)
        assert harness.step(CheckPrefetchProgress(2)) == ProgressResult(True, hits)
        match = harness.step(MatchPrefix(A))
        assert isinstance(match, MatchResult) and match.host_hit_length == hits


def test_a_query_waiting_in_its_all_reduce_still_holds_what_admission_allocated() -> None:
    """Up to 0.5.15 (D-01 off) admission allocates the key's host memory; a miss queried on rank 0 waits in the
    MIN of the hits (``cache_controller.py`` 0.5.15:1035) with all of it, as the model's parked query does, and
    releases it (the revoke) only once rank 1's query gave the MIN. The adapter took the query's return for its
    resolution, so rank 0's snapshot had let the slots go while its thread still held them (the differential's
    step 65 on 0.5.13..0.5.15); from 0.5.16 nothing is allocated before the drain, so this holds trivially."""
    b = tuple(range(101, 109))  # not in L3: every rank's query misses

    def prefetch_held(name: str, rank: int) -> tuple[int, ...]:
        held = harness.snapshots[name].ranks[rank].host.held
        return tuple(s for owner, slots in held if owner.startswith("prefetch:") for s in slots)

    with a_in_l3_on_two_ranks(two_ranks()) as harness:
        harness.step(PrefetchFromStorage(2, b))
        admitted = prefetch_held("model", 0)
        assert len(admitted) == (0 if PROFILE["allocate_prefetch_after_query"] else 8)
        assert harness.step(CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1)) == IOResult(1)
        assert queue(harness, 0, "prefetch_query") == 1  # in the all-reduce: rank 1 has not queried
        assert prefetch_held("model", 0) == prefetch_held("sglang", 0) == admitted
        assert harness.step(CompleteIO(IOQueue.PREFETCH_QUERY, 1, 1)) == IOResult(1)
        harness.step(CheckHicacheEvents())
        assert prefetch_held("sglang", 0) == prefetch_held("sglang", 1) == ()
        assert harness.step(CheckPrefetchProgress(2)) == ProgressResult(True, 0)


def test_a_reset_is_refused_on_both_ranks_while_one_waits_in_a_storage_all_reduce() -> None:
    """D-16 with two ranks: a prefetch ended before any query (best_effort), then rank 0's thread queries it and
    waits in the MIN of the hits for rank 1, which has it still queued. Rank 0 is busy as the model's parked query
    is: neither rank flushes. Without it rank 0 flushed and rank 1 did not (``RankError``: the ranks answered
    ``Reset()`` differently), which the two-rank write_back fuzz on 0.5.16 met at step 725 (seed 2)."""
    cfg = two_ranks(hicache_storage_prefetch_policy=PrefetchPolicy.BEST_EFFORT)
    with stops_on_r13(), a_in_l3_on_two_ranks(cfg) as harness:
        harness.step(PrefetchFromStorage(2, A))
        assert harness.step(CheckPrefetchProgress(2)) == ProgressResult(True, 0)  # ended before its query
        assert harness.step(CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1)) == IOResult(1)
        assert queue(harness, 0, "prefetch_query") == 1  # rank 0's thread in the all-reduce
        assert harness.step(Reset()) == ResetResult(False)
        assert harness.step(CompleteIO(IOQueue.PREFETCH_QUERY, 1, 1)) == IOResult(1)
        harness.step(CheckHicacheEvents())
        if not PROFILE["allocate_prefetch_after_query"]:
            # up to 0.5.15 (D-01 off) the query that found A buffered the ended operation, whose I/O thread still
            # reads one batch (D-63) before it releases the tail: busy until then, on both ranks as in the model
            assert harness.step(Reset()) == ResetResult(False)
            for rank in (0, 1):
                assert harness.step(CompleteIO(IOQueue.PREFETCH_IO, rank, 1)) == IOResult(1)
            harness.step(CheckHicacheEvents())
        assert harness.step(Reset()) == ResetResult(True)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_read_fault_on_one_rank_is_reduced_for_both(rank: int) -> None:
    """A failed read on one rank only: the sync threads' MIN of the completed tokens gives both ranks the
    shorter prefix, as the model's drain does."""
    cfg = two_ranks(attention=AttentionKind.MLA)
    with (
        stops_on_r13(),
        OpenSystems[Op, Observation, Snapshot](
            {"model": HiCacheModel(cfg), "sglang": open_system(cfg)}
        ) as systems,
    ):
        harness = Harness(cfg, systems, write_trace=False, family=HICACHE)
        ops = [
            *on_both(to_l3(A)),
            PrefetchFromStorage(2, A),
            *on_both([CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1)]),
            CheckHicacheEvents(),
            StorageFault(FaultKind.FAIL_NEXT_READ, rank, 0),
            *on_both([CompleteIO(IOQueue.PREFETCH_IO, 0, 4)]),
            CheckHicacheEvents(),
            CheckHicacheEvents(),
        ]
        for op in ops:
            harness.step(op)
        assert harness.step(CheckPrefetchProgress(2)) == ProgressResult(True, 0)


def test_a_model_that_reduces_storage_hits_with_max_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison is not vacuous: a model whose parked query resolves with the MAX of the ranks' hits
    diverges from the all-reduce SGLang's threads take through the parent."""
    import refcache.model._cache as model_cache

    monkeypatch.setattr(model_cache, "reduce_min", max)
    cfg = two_ranks()
    with OpenSystems[Op, Observation, Snapshot](
        {"model": HiCacheModel(cfg), "sglang": open_system(cfg)}
    ) as systems:
        harness = Harness(cfg, systems, write_trace=False, family=HICACHE)
        for op in [
            *on_both(to_l3(A)),
            StorageFault(FaultKind.DELETE, 1, 5),
            PrefetchFromStorage(2, A),
            CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1),
        ]:
            harness.step(op)
        with pytest.raises(Divergence, match="hit_pages"):  # the query's all-reduce returns on both ranks
            harness.step(CompleteIO(IOQueue.PREFETCH_QUERY, 1, 1))


RECORDED: list[Op] = [
    *on_both(to_l3(A)),
    PrefetchFromStorage(2, A),
    CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1),  # waits in the hits' all-reduce: seen once rank 1 queried
    CheckHicacheEvents(),
    CompleteIO(IOQueue.PREFETCH_QUERY, 1, 1),
    CheckHicacheEvents(),
    CompleteIO(IOQueue.PREFETCH_IO, 0, 4),  # two batches, each ack waiting in rank 0's sync thread
    CheckHicacheEvents(),
    CompleteIO(IOQueue.PREFETCH_IO, 1, 4),
    CheckHicacheEvents(),
    CheckPrefetchProgress(2),
    MatchPrefix(A),
]
"""A prefetch on two ranks whose every storage step waits in its all-reduce for the other rank's."""


def _as_recorded(ops: Sequence[Op], results: Sequence[object]) -> list[Op]:
    """What the recording holds for ``ops``: each completion as what ran (the recorder sees what completed),
    a storage completion as its steps, one line each (the parent sends them one at a time)."""
    out: list[Op] = []
    for op, result in zip(ops, results, strict=True):
        if isinstance(op, CompleteIO) and isinstance(result, IOResult):
            storage = op.queue in (IOQueue.PREFETCH_QUERY, IOQueue.PREFETCH_IO, IOQueue.BACKUP)
            each = (
                [replace(op, count=1)] * result.completed
                if storage
                else [replace(op, count=result.completed)]
            )
            out += each if result.completed else []
        else:
            out.append(op)
    return out


@ADMISSION_ERA
@pytest.mark.parametrize("attention", [AttentionKind.MHA, AttentionKind.MLA])
def test_two_ranks_with_l3_are_recorded_and_replay_clean(attention: AttentionKind, tmp_path: Path) -> None:
    """``record`` on two ranks with L3: a storage step that waits in its all-reduce reaches the scheduler
    (and the rank's recorder) only when the parent hands in the MIN after the peer's step; the merge writes
    it where it was driven (``merge_ranks``: the steps a release lets through are its own span, matched to
    the steps each rank ran, in order). The recording is the operations driven and replays clean on the
    model, snapshots and all (MLA: a backup changes the peer's view of the shared L3 keys); with one
    storage step credited to the other rank, or one step dropped, it does not."""
    cfg = two_ranks(attention=attention)
    sglang = open_system(cfg)
    assert isinstance(sglang, SGLangRanks)
    with sglang, record(sglang, tmp_path / "run.jsonl", snapshots=True) as recorder:
        results = [sglang.apply(op) for op in RECORDED]
    recording = recorder.recording()
    assert recording.ops == _as_recorded(RECORDED, results)
    assert read_recording(tmp_path / "run.jsonl").ops == recording.ops
    assert replay_recorded(recording) == len(recording.ops)

    misplaced_steps_diverge(recording)


def misplaced_steps_diverge(recording: Recording) -> None:
    """A two-rank recording with L3 (this file's, ``test_record_unified``'s) is not replayed clean whatever its
    storage steps: rank 0's first query credited to rank 1 diverges where rank 1 has no query left, and rank
    1's read dropped diverges on the line after it."""
    first = recording.ops.index(CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1))
    wrong = [*recording.ops]
    wrong[first] = CompleteIO(IOQueue.PREFETCH_QUERY, 1, 1)  # rank 1's query, where rank 0's ran
    with pytest.raises(Divergence, match="outcomes differ") as credited:  # rank 1 has no query left
        replay_recorded(replace(recording, ops=wrong))
    assert credited.value.step == recording.ops.index(CompleteIO(IOQueue.PREFETCH_QUERY, 1, 1)) + 1
    read = recording.ops.index(CompleteIO(IOQueue.PREFETCH_IO, 1, 1))
    dropped = replace(
        recording,
        ops=recording.ops[:read] + recording.ops[read + 1 :],
        observed=recording.observed[:read] + recording.observed[read + 1 :],
        snapshots=recording.snapshots[:read] + recording.snapshots[read + 1 :],
    )
    with pytest.raises(Divergence, match="snapshots differ") as lost:
        replay_recorded(dropped)
    assert lost.value.step == read + 1  # the line after it: rank 1's read is missing


def test_a_storage_step_the_ranks_were_not_sent_is_refused() -> None:
    """``merge_ranks``: a release's lines must be steps each rank ran and had not shown yet, in order."""
    cfg = two_ranks()
    query = CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1)
    rank0 = Recording(cfg, [query], [IOResult(1)], [None])
    rank1 = Recording(cfg, [query], [IOResult(1)], [None])
    stepped = {0: IOQueue.PREFETCH_QUERY, 1: IOQueue.PREFETCH_QUERY}
    merged = merge_ranks([0, 1, RELEASED], [(rank0, [0, 1]), (rank1, [0, 1])], [], stepped=stepped)
    assert merged.ops == [query, replace(query, rank=1)] and merged.observed == [IOResult(1)] * 2
    with pytest.raises(RecordingError, match="not seen yet"):  # rank 1's step, which it was never sent
        merge_ranks(
            [0, 1, RELEASED], [(rank0, [0, 1]), (rank1, [0, 1])], [], stepped={0: IOQueue.PREFETCH_QUERY}
        )
    other = Recording(cfg, [MatchPrefix(A)], [None], [None])
    with pytest.raises(RecordingError, match="when storage all-reduces returned"):
        merge_ranks([0, 1, RELEASED], [(rank0, [0, 1]), (other, [0, 1])], [], stepped=stepped)


def test_a_storage_step_among_a_lock_step_or_hung_operations_lines_is_refused() -> None:
    """``merge_ranks``: a storage step is written where the rank ran it (``stepped``) and seen in that
    entry's or a release's lines; among a lock-step operation's lines (or the lines of the operation that
    hung) it would be written as rank 0's, or twice, so the merge refuses it."""
    cfg = two_ranks()
    query = CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1)
    match = MatchPrefix(A)
    both = Recording(cfg, [match, query], [None, IOResult(1)], [None, None])
    with pytest.raises(RecordingError, match=r"storage step .* lock-step or hung"):
        merge_ranks([None], [(both, [2]), (both, [2])], [])
    plain = Recording(cfg, [match], [None], [None])
    assert merge_ranks([None], [(plain, [1]), (plain, [1])], []).ops == [match]  # the same without it
    hang = NeverReturned(0, 1, "hiradix_cache.py:226 _all_reduce_attn_groups", 1, 0)
    drain = CheckHicacheEvents()
    stuck = Recording(cfg, [match, query], [None, IOResult(1)], [None, None])
    peer = Recording(cfg, [match, query, drain], [None, IOResult(1), None], [None] * 3)
    with pytest.raises(RecordingError, match=r"storage step .* lock-step or hung"):
        merge_ranks([None, None], [(stuck, [1]), (peer, [1, 3])], [], (drain, hang))
    merged = merge_ranks(
        [None, None],
        [(plain, [1]), (Recording(cfg, [match, drain], [None, None], [None] * 2), [1, 2])],
        [],
        (drain, hang),
    )
    assert merged.observed == [None, hang]


def test_a_rank_that_reads_past_its_peers_step_is_seen_as_it_is() -> None:
    """MLA (the ranks share L3 keys): rank 1 reads the first batch, then rank 0 reads both; the parent reduces
    the first batch's ack in the middle of rank 0's steps, and the snapshot after them must still be the
    ranks' own (rank 0's operation done: its final ack sent), not the one read at that reduction."""
    cfg = two_ranks(attention=AttentionKind.MLA)
    with OpenSystems[Op, Observation, Snapshot](
        {"model": HiCacheModel(cfg), "sglang": open_system(cfg)}
    ) as systems:
        harness = Harness(cfg, systems, write_trace=False, family=HICACHE)
        for op in [
            *on_both(to_l3(A)),
            PrefetchFromStorage(2, A),
            *on_both([CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1)]),
            CheckHicacheEvents(),
            CompleteIO(IOQueue.PREFETCH_IO, 1, 1),
        ]:
            harness.step(op)
        assert harness.step(CompleteIO(IOQueue.PREFETCH_IO, 0, 4)) == IOResult(2)
        stages = [r.ongoing_prefetch[0].stage for r in harness.snapshots["sglang"].ranks]
        assert stages == ["done", "io"], stages
        assert harness.step(CompleteIO(IOQueue.PREFETCH_IO, 1, 4)) == IOResult(1)
        harness.step(CheckHicacheEvents())
        assert harness.step(CheckPrefetchProgress(2)) == ProgressResult(True, 8)


@ADMISSION_ERA
def test_refcache_record_runs_two_ranks_with_l3(tmp_path: Path) -> None:
    """``refcache record --l3 --tp-size 2`` over four 40-block documents requested twice in turn (as
    ``test_record.py``'s one-rank run): both ranks' storage threads query, read and back up, the second
    round's prefetches insert pages, and the recording, snapshots and all, replays clean on the model."""
    rec = record_documents(tmp_path, "--tp-size", "2")
    steps = {(op.queue, op.rank) for op in rec.ops if isinstance(op, CompleteIO)}
    storage = (IOQueue.BACKUP, IOQueue.PREFETCH_QUERY, IOQueue.PREFETCH_IO)
    assert steps >= {(queue, rank) for queue in storage for rank in (0, 1)}, steps
    inserted = [obs.inserted for obs in rec.observed if isinstance(obs, ProgressResult)]
    assert sum(inserted) > 0, inserted
    assert replay_recorded(rec) == len(rec.ops)


def test_a_timeout_on_one_rank_clock_stops_the_prefetch_on_both() -> None:
    """D-41: ``AdvanceClock(us, rank)`` moves that rank worker's clock alone (each real rank reads its own
    ``time.monotonic()``). Past the timeout on rank 0 only, 0.5.20's MAX all-reduce of ``should_terminate``
    (``check_prefetch_progress``, hiradix_cache.py:1650-1656) stops the prefetch on both ranks, as the model
    says; 0.5.18's ``can_terminate_prefetch`` reduces ``1 - can_terminate`` by MAX (D-54, the classic protocol):
    it stops only once every rank timed out. The harness compares both ranks' clocks (``clock_skew_us``) after
    every step."""
    cfg = two_ranks(hicache_storage_prefetch_policy="timeout", prefetch_timeout_base=0.01)
    with a_in_l3_on_two_ranks(cfg) as harness:
        harness.step(PrefetchFromStorage(2, A))
        for rank in (0, 1):
            assert harness.step(CompleteIO(IOQueue.PREFETCH_QUERY, rank, 1)) == IOResult(1)
        assert harness.step(CheckPrefetchProgress(2)) == ProgressResult(done=False, inserted=0)
        harness.step(AdvanceClock(20_000, rank=0))  # 20 ms > 10 ms + 8 tokens * 0.25 s / 1024, on rank 0
        snap = harness.snapshots["sglang"]
        assert (snap.clock_us, [r.clock_skew_us for r in snap.ranks]) == (0, [20_000, 0])
        assert harness.step(CheckPrefetchProgress(2)) == ProgressResult(done=ACKED, inserted=0)
        if not ACKED:
            harness.step(AdvanceClock(20_000, rank=1))
            assert harness.step(CheckPrefetchProgress(2)) == ProgressResult(done=True, inserted=0)
        assert all(r.ongoing_prefetch == () for r in harness.snapshots["sglang"].ranks)
