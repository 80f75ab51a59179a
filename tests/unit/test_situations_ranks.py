"""The rank-divergent situations of the HiCache ledger (issue #30 item 1), recognised on hand-made runs of the
model with two ranks: a hit query answered while one rank's L3 view lacks a page the other has, and a prefetch
released while the ranks had read different amounts. Each is checked on a run that reaches it and on the
same run without the divergence, which must not."""

from __future__ import annotations

from collections.abc import Sequence

from refcache.check.coverage import Coverage
from refcache.check.situations import SITUATIONS, SituationTracker
from refcache.config import HiCacheConfig, PrefetchPolicy, WritePolicy
from refcache.hashing import page_hashes, storage_key, storage_namespace_seed
from refcache.hicache.ops import (
    AbortPrefetch,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    Evict,
    EvictHost,
    FaultKind,
    FinishRequest,
    IOQueue,
    Op,
    PrefetchFromStorage,
    StartRequest,
    StorageFault,
)
from refcache.model import HiCacheModel

TOKENS = (1, 2, 3, 4)
CONFIG = HiCacheConfig(
    page_size=1,
    device_size=8,
    hicache_ratio=2.0,
    hicache_write_policy=WritePolicy.WRITE_THROUGH,
    hicache_storage_backend="file",
    hicache_storage_prefetch_policy=PrefetchPolicy.BEST_EFFORT,
    prefetch_threshold=1,
    tp_size=2,
).resolve()


def _in_l3() -> list[Op]:
    """A request whose four pages reach L3 on both ranks, then leave L1 and L2."""
    ops: list[Op] = [StartRequest(0, TOKENS), FinishRequest(0)]
    for queue in (IOQueue.WRITE, IOQueue.BACKUP):
        ops += [CompleteIO(queue, rank, 64) for rank in (0, 1)] + [CheckHicacheEvents()]
    return [*ops, Evict(10_000), EvictHost(10_000)]


def _run(ops: Sequence[Op]) -> list[str]:
    """The situations each step of ``ops`` on the model reaches, in order."""
    model = HiCacheModel(CONFIG)
    tracker = SituationTracker(CONFIG)
    reached: list[str] = []
    before = model.snapshot()
    for op in ops:
        outcome = model.apply(op)
        after = model.snapshot()
        reached += tracker.observe(op, outcome, before, after)
        before = after
    return reached


def _delete_on_rank0(page: int) -> StorageFault:
    """The fault that deletes page ``page`` of TOKENS from rank 0's view only (its index in the sorted view)."""
    key = storage_key(
        page_hashes(TOKENS, 1, storage_namespace_seed(None))[page],
        model_name=CONFIG.model_name,
        mla=False,
        tp_rank=0,
        tp_size=2,
    )
    model = HiCacheModel(CONFIG)
    for op in _in_l3():
        model.apply(op)
    view = model.snapshot().ranks[0].l3_keys
    assert key in view and len(view) == len(TOKENS)
    return StorageFault(FaultKind.DELETE, 0, view.index(key))


def _query() -> list[Op]:
    """A prefetch of TOKENS whose hit query completes on rank 0, then on rank 1 (the MIN returns there)."""
    return [PrefetchFromStorage(1, TOKENS), *(CompleteIO(IOQueue.PREFETCH_QUERY, r, 64) for r in (0, 1))]


def test_a_hit_query_over_divergent_views_is_recognised() -> None:
    ops = [*_in_l3(), _delete_on_rank0(2), *_query()]
    reached = _run(ops)
    assert reached.count("l3-hit-ranks-disagree") == 1
    # the step that answers the query: the second rank's query completes and the MIN returns
    assert _run(ops[:-1]).count("l3-hit-ranks-disagree") == 0


def test_a_hit_query_over_equal_views_is_not() -> None:
    assert "l3-hit-ranks-disagree" not in _run([*_in_l3(), *_query()])
    # a fault on the same page of both ranks' views leaves their counts equal
    fault = _delete_on_rank0(2)
    both = [fault, StorageFault(FaultKind.DELETE, 1, fault.index)]
    assert "l3-hit-ranks-disagree" not in _run([*_in_l3(), *both, *_query()])


def test_a_release_after_unequal_reads_is_recognised() -> None:
    reads = [CompleteIO(IOQueue.PREFETCH_IO, 0, 64)]
    for release in (CheckPrefetchProgress(1), AbortPrefetch(1)):
        reached = _run([*_in_l3(), *_query(), *reads, release])
        assert reached.count("prefetch-released-ranks-differ") == 1, release


def test_a_release_after_equal_reads_is_not() -> None:
    reads = [CompleteIO(IOQueue.PREFETCH_IO, rank, 64) for rank in (0, 1)]
    for release in (CheckPrefetchProgress(1), AbortPrefetch(1)):
        assert "prefetch-released-ranks-differ" not in _run([*_in_l3(), *_query(), *reads, release])
    # unequal reads, but the prefetch is still in flight
    assert "prefetch-released-ranks-differ" not in _run(
        [*_in_l3(), *_query(), CompleteIO(IOQueue.PREFETCH_IO, 0, 64)]
    )


def test_the_ledger_fails_a_run_that_misses_them() -> None:
    """The coverage test (``Coverage.missing``) names each when a run reached every other situation."""
    ledger = Coverage()
    for name in SITUATIONS:
        if name not in ("l3-hit-ranks-disagree", "prefetch-released-ranks-differ"):
            ledger.reached(name)
    missing = [m for m in ledger.missing() if m.startswith("situation ")]
    assert missing == ["situation l3-hit-ranks-disagree", "situation prefetch-released-ranks-differ"]
