"""D-68, ``loads_retired_per_rank``: SGLang up to 0.5.12 retires on each rank the load backs its own stream finished,
with no collective ("batch forwarding is synced", ``hiradix_cache.py`` 0.5.5:318-331, 0.5.10:700-713,
0.5.12:791-804); 0.5.13 on, and the model without the option, retire a load once every rank finished it (a MIN,
seed §3.7). With the option ``CheckHicacheEvents`` answers each rank's count (``EventsResult.loads_by_rank``) and
no request may end while the ranks have retired different loads (SGLang's forward pass and its next check retire
them on every rank first); the differential machine reaps them as that forward pass would."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from refcache.config import FIDELITY_OPTIONS, PROFILES, HiCacheConfig, IOBackend, WritePolicy
from refcache.errors import UsageError
from refcache.hicache.invariants import inv_ranks_equal
from refcache.hicache.ops import (
    AbortRequest,
    CheckHicacheEvents,
    CompleteIO,
    EventsResult,
    Evict,
    EvictResult,
    FinishRequest,
    IOQueue,
    Op,
    StartRequest,
    StartResult,
)
from refcache.hicache.snapshot import NodeId, Snapshot
from refcache.hicache.trace import read_trace
from refcache.model import HiCacheModel
from refcache.model._rank import RankCache

TOKENS = (1, 2, 3, 4)
NODE = NodeId("", TOKENS)


def _config(per_rank: bool, **options: Any) -> HiCacheConfig:
    base: dict[str, Any] = {
        "page_size": 1,
        "device_size": 8,
        "hicache_io_backend": IOBackend.DIRECT,
        "hicache_ratio": 2.0,
        "hicache_write_policy": WritePolicy.WRITE_THROUGH,
        "hicache_storage_backend": None,
        "load_back_threshold": 1,
        "tp_size": 2,
        "loads_retired_per_rank": per_rank,
    }
    return HiCacheConfig(**{**base, **options}).resolve()


def _loaded_on_rank_1(model: HiCacheModel) -> None:
    """A node backed up on both ranks, evicted, and loaded back for request 2; only rank 1's copy finished."""
    ops: list[Op] = [
        StartRequest(1, TOKENS),
        FinishRequest(1),
        CompleteIO(IOQueue.WRITE, 0, 4),
        CompleteIO(IOQueue.WRITE, 1, 4),
        CheckHicacheEvents(),
    ]
    for op in ops:
        model.apply(op)
    assert model.apply(Evict(8)) == EvictResult(4)
    assert model.apply(StartRequest(2, (*TOKENS, 5))) == StartResult(True, 0, 4, 1)
    model.apply(CompleteIO(IOQueue.LOAD, 1, 1))


def test_the_option_is_followed_up_to_0_5_12() -> None:
    assert FIDELITY_OPTIONS["D-68"] == "loads_retired_per_rank"
    for profile in ("sglang-0.5.3", "sglang-0.5.5", "sglang-0.5.10", "sglang-0.5.12"):
        assert PROFILES[profile]["loads_retired_per_rank"], profile
    for profile in ("sglang-0.5.13", "sglang-0.5.18", "sglang-0.5.20", "refcache"):
        assert not PROFILES[profile]["loads_retired_per_rank"], profile


def test_each_rank_retires_its_own_finished_load() -> None:
    with HiCacheModel(_config(per_rank=True)) as model:
        _loaded_on_rank_1(model)
        assert model.apply(CheckHicacheEvents()) == EventsResult(0, 0, 0, 0, 0, loads_by_rank=(0, 1))
        ranks = model.snapshot().ranks
        assert ranks[0].ongoing_load_back == (NODE,) and ranks[1].ongoing_load_back == ()
        # the load's lock is gone on rank 1 only; the request's own keeps the node protected on both
        locks = [r.node(NODE).lock_ref for r in ranks]  # type: ignore[union-attr]
        assert locks[0] == locks[1] + 1
        assert [r.evictable_size for r in ranks] == [0, 0]
        with pytest.raises(UsageError, match="D-68"):
            model.apply(FinishRequest(2))
        with pytest.raises(UsageError, match="D-68"):
            model.apply(AbortRequest(2))
        model.apply(CompleteIO(IOQueue.LOAD, 0, 1))
        assert model.apply(CheckHicacheEvents()) == EventsResult(0, 0, 0, 0, 0, loads_by_rank=(1, 0))
        assert all(r.ongoing_load_back == () for r in model.snapshot().ranks)
        model.apply(FinishRequest(2))
        ranks = model.snapshot().ranks
        assert ranks[0].nodes == ranks[1].nodes  # the trees (and their locks) are equal again


def test_without_the_option_a_load_is_retired_once_every_rank_finished_it() -> None:
    with HiCacheModel(_config(per_rank=False)) as model:
        _loaded_on_rank_1(model)
        assert model.apply(CheckHicacheEvents()) == EventsResult(0, 0, 0, 0, 0)  # MIN(0, 1)
        assert all(r.ongoing_load_back == (NODE,) for r in model.snapshot().ranks)
        model.apply(FinishRequest(2))  # the load's lock is held on both ranks: nothing to refuse
        model.apply(CompleteIO(IOQueue.LOAD, 0, 1))
        assert model.apply(CheckHicacheEvents()) == EventsResult(0, 1, 0, 0, 0)


def test_one_rank_changes_nothing() -> None:
    with HiCacheModel(_config(per_rank=True, tp_size=1)) as model:
        model.apply(StartRequest(1, TOKENS))
        model.apply(FinishRequest(1))
        model.apply(CompleteIO(IOQueue.WRITE, 0, 4))
        assert model.apply(CheckHicacheEvents()) == EventsResult(1, 0, 0, 0, 0)


R12 = (
    Path(__file__).resolve().parents[1]
    / "regressions"
    / "sglang"
    / "known"
    / "r12-load-back-retired-on-one-rank.jsonl"
)


def _r12_last(model: HiCacheModel) -> tuple[EventsResult, Snapshot]:
    """R-12's trace (a load back whose request was not admitted, finished on rank 1 only): the last check."""
    _, ops = read_trace(R12)
    for op in ops[:-1]:
        model.apply(op)
    result = model.apply(ops[-1])
    assert isinstance(result, EventsResult)
    return result, model.snapshot()


def test_a_load_holding_its_anchors_last_lock_waits_for_every_rank() -> None:
    """R-12: a load whose lock is its node's only one is retired once every rank finished it, so the ranks'
    evictable sizes stay equal (SGLang up to 0.5.12 retires it on rank 1 alone); RANKS-EQUAL allows the load
    backs apart only under the snapshot's flag."""
    config, _ops = read_trace(R12)
    assert config.loads_retired_per_rank and config.tp_size == 2
    with HiCacheModel(config) as model:
        result, snap = _r12_last(model)
    assert result == EventsResult(0, 0, 0, 0, 0)
    assert snap.loads_retired_per_rank and inv_ranks_equal(snap) == []
    assert [r.evictable_size for r in snap.ranks] == [0, 0]


def test_ranks_equal_catches_a_rank_that_retired_the_last_lock_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation: a model that retires every finished load per rank (SGLang's way) breaks RANKS-EQUAL on the
    evictable and protected sizes, whatever the flag allows."""
    config, _ops = read_trace(R12)
    monkeypatch.setattr(
        RankCache, "loading_check_own", lambda self, finished, everywhere: self.loading_check_apply(finished)
    )
    with HiCacheModel(config) as model:
        result, snap = _r12_last(model)
    assert result.loads_by_rank == (0, 1)
    violations = inv_ranks_equal(snap)
    assert len(violations) == 1 and "evictable_size, protected_size" in violations[0].message


def test_ranks_equal_allows_the_load_backs_apart_only_under_the_flag() -> None:
    with HiCacheModel(_config(per_rank=True)) as model:
        _loaded_on_rank_1(model)
        model.apply(CheckHicacheEvents())
        snap = model.snapshot()
    assert snap.loads_retired_per_rank and inv_ranks_equal(snap) == []
    violations = inv_ranks_equal(replace(snap, loads_retired_per_rank=False))
    assert len(violations) == 1 and "nodes, ongoing_load_back" in violations[0].message


def test_ranks_whose_queues_retired_in_another_order_stay_equal() -> None:
    """A load is finished everywhere by its id, not by a count: rank 0 retired the request's load first, so at
    the next check its head is the last-lock load (finished on rank 0 only) and rank 1's the request's load
    (found by refcache fuzz on 0.5.11, where a MIN of the two counts retired the last-lock load on rank 0 alone
    and the model broke RANKS-EQUAL on the sizes)."""
    trace = R12.parents[1] / "decisions" / "d68-loads-retired-in-another-order.jsonl"
    config, ops = read_trace(trace)
    with HiCacheModel(config) as model:
        for op in ops[:-1]:
            model.apply(op)
        result = model.apply(ops[-1])
        snap = model.snapshot()
    assert result == EventsResult(0, 0, 0, 0, 0, loads_by_rank=(0, 1))
    assert inv_ranks_equal(snap) == []
