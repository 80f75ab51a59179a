"""Two SGLang ranks with L3 (``_tp`` and ``_storage``): each rank's storage threads are stepped alone, and a
step that enters one of 0.5.20's storage all-reduces (the prefetch thread's MIN of the storage hits, the
prefetch sync thread's MIN of a read's completed tokens) stays in flight until the other rank has taken the
same step, as the model's parked query does; the harness compares observations and both ranks' snapshots
after every step."""

from __future__ import annotations

from typing import Any

import pytest

from refcache.check.harness import Divergence, Harness
from refcache.config import PROFILES, AttentionKind, HiCacheConfig
from refcache.engines.sglang import SGLangRanks, open_system
from refcache.errors import UnsupportedError
from refcache.model import HiCacheModel
from refcache.ops import (
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    EventsResult,
    FaultKind,
    IOQueue,
    IOResult,
    MatchPrefix,
    MatchResult,
    Op,
    PrefetchFromStorage,
    ProgressResult,
    StorageFault,
)
from refcache.systems import OpenSystems

from .test_l3 import A, config, to_l3

PROFILE = PROFILES["sglang-0.5.20"]


def two_ranks(**options: Any) -> HiCacheConfig:
    return config(1, storage_batch_size=4, tp_size=2, **options).with_fidelity(PROFILE).resolve()


def on_both(ops: list[Op]) -> list[Op]:
    """``ops`` with every CompleteIO run on rank 0, then on rank 1."""
    out: list[Op] = []
    for op in ops:
        out += [op, CompleteIO(op.queue, 1, op.count)] if isinstance(op, CompleteIO) else [op]
    return out


def queue(harness: Harness, rank: int, name: str) -> int:
    return dict(harness.snapshots["sglang"].ranks[rank].queues)[name]


def test_a_storage_step_on_one_rank_waits_in_its_all_reduce_for_the_other() -> None:
    """Rank 1 lost a page of A (its own file: MHA keys name the rank), so its hit query finds fewer pages;
    the query on rank 0 stays in the MIN all-reduce (nothing to drain) until rank 1's query, and then both
    ranks allocate and read the MIN. Each read's ack waits in the sync thread's all-reduce until the other
    rank has read that batch."""
    cfg = two_ranks()
    sglang = open_system(cfg)
    assert isinstance(sglang, SGLangRanks)
    with OpenSystems({"model": HiCacheModel(cfg), "sglang": sglang}) as systems:
        harness = Harness(cfg, systems, write_trace=False)
        for op in on_both(to_l3(A)):
            harness.step(op)
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


@pytest.mark.parametrize("rank", [0, 1])
def test_a_read_fault_on_one_rank_is_reduced_for_both(rank: int) -> None:
    """A failed read on one rank only: the sync threads' MIN of the completed tokens gives both ranks the
    shorter prefix, as the model's drain does."""
    cfg = two_ranks(attention=AttentionKind.MLA)
    with OpenSystems({"model": HiCacheModel(cfg), "sglang": open_system(cfg)}) as systems:
        harness = Harness(cfg, systems, write_trace=False)
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
    with OpenSystems({"model": HiCacheModel(cfg), "sglang": open_system(cfg)}) as systems:
        harness = Harness(cfg, systems, write_trace=False)
        for op in [
            *on_both(to_l3(A)),
            StorageFault(FaultKind.DELETE, 1, 5),
            PrefetchFromStorage(2, A),
            CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1),
        ]:
            harness.step(op)
        with pytest.raises(Divergence, match="hit_pages"):  # the query's all-reduce returns on both ranks
            harness.step(CompleteIO(IOQueue.PREFETCH_QUERY, 1, 1))


def test_two_ranks_with_l3_are_not_recorded() -> None:
    from refcache.engines.sglang.record import record

    sglang = open_system(two_ranks())
    assert isinstance(sglang, SGLangRanks)
    with sglang, pytest.raises(UnsupportedError, match="L3"), record(sglang):
        pass


def test_a_rank_that_reads_past_its_peers_step_is_seen_as_it_is() -> None:
    """MLA (the ranks share L3 keys): rank 1 reads the first batch, then rank 0 reads both; the parent reduces
    the first batch's ack in the middle of rank 0's steps, and the snapshot after them must still be the
    ranks' own (rank 0's operation done: its final ack sent), not the one read at that reduction."""
    cfg = two_ranks(attention=AttentionKind.MLA)
    with OpenSystems({"model": HiCacheModel(cfg), "sglang": open_system(cfg)}) as systems:
        harness = Harness(cfg, systems, write_trace=False)
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
