"""The model's fidelity options for SGLang 0.5.23 (D-35..D-38, ``PROFILES["sglang-0.5.23"]``): each one changes
what the model does exactly where 0.5.23 differs from 0.5.20 and refcache, shown on a short trace (the
shrunk counterexamples of the model-versus-0.5.23 differential, specs/sglang-adapter.md "Newer releases"),
and 0.5.20's profile leaves all three off."""

from __future__ import annotations

from collections.abc import Sequence

from refcache.config import FIDELITY_OPTIONS, PROFILES, EvictionPolicy, HiCacheConfig, WritePolicy
from refcache.hicache.ops import (
    CacheUnfinishedRequest,
    CheckHicacheEvents,
    CompleteIO,
    EventsResult,
    FinishRequest,
    IOQueue,
    Op,
    StartRequest,
)
from refcache.hicache.snapshot import NodeRecord, RankSnapshot
from refcache.model import HiCacheModel

NEW = {
    "D-35": "count_hits_per_request",
    "D-36": "priority_after_split",
    "D-37": "evict_host_shortfall",
    "D-38": "merge_write_acks",
}


def _run(config: HiCacheConfig, ops: Sequence[Op], **options: bool) -> RankSnapshot:
    with HiCacheModel(config.with_fidelity(options)) as model:
        for op in ops:
            model.apply(op)
        return model.snapshot().ranks[0]


def _node(rank: RankSnapshot, path: tuple[int, ...]) -> NodeRecord:
    return next(n for n in rank.nodes if n.id.path == path)


def test_the_options_are_registered_and_only_0523_follows_them() -> None:
    assert {d: FIDELITY_OPTIONS[d] for d in NEW} == NEW
    assert all(PROFILES["sglang-0.5.23"][o] for o in NEW.values())
    assert not any(PROFILES["sglang-0.5.20"][o] for o in NEW.values())
    assert not any(PROFILES["refcache"][o] for o in NEW.values())


def test_d35_a_checkpoint_counts_a_hit_and_writes_through() -> None:
    """0.5.23 inserts an unfinished request's KV as a finished one (a hit, then the write-through), and its
    finish counts no node twice; 0.5.20 counts nothing for a chunked insert."""
    config = HiCacheConfig(device_size=16, page_size=1, hicache_write_policy=WritePolicy.WRITE_THROUGH)
    a = (1, 2, 3, 4)
    ops: list[Op] = [StartRequest(1, a), CacheUnfinishedRequest(1)]
    off, on = _run(config, ops), _run(config, ops, count_hits_per_request=True)
    assert (_node(off, a).hit_count, _node(off, a).host_value) == (0, None)
    assert (_node(on, a).hit_count, _node(on, a).host_value) == (1, (0, 1, 2, 3))
    on = _run(config, [*ops, FinishRequest(1)], count_hits_per_request=True)
    assert _node(on, a).hit_count == 1, "the finish must not count what the checkpoint inserted"


def test_d35_an_insert_over_an_evicted_node_counts_a_hit() -> None:
    config = HiCacheConfig(device_size=8, page_size=1, hicache_write_policy=WritePolicy.WRITE_THROUGH)
    a = tuple(range(1, 9))
    ops: list[Op] = [
        StartRequest(1, a),
        FinishRequest(1),
        CompleteIO(IOQueue.WRITE, 0, 8),
        CheckHicacheEvents(),
        StartRequest(2, tuple(range(20, 28))),  # evicts a to the host
        FinishRequest(2),
        CompleteIO(IOQueue.WRITE, 0, 8),
        CheckHicacheEvents(),
        StartRequest(3, a),  # a host hit below load_back_threshold: recomputed, refills a on insert
        FinishRequest(3),
    ]
    config = HiCacheConfig(**{**config.__dict__, "load_back_threshold": 100})
    assert _node(_run(config, ops), a).hit_count == 1
    assert _node(_run(config, ops, count_hits_per_request=True), a).hit_count == 2


def test_d36_the_tail_of_a_split_keeps_its_priority() -> None:
    """The prompt re-insert (D-24, priority + 1) splits the node: 0.5.20 raises the whole node first, so the
    tail gets the new priority too; 0.5.23 raises only the matched part."""
    config = HiCacheConfig(
        device_size=32,
        page_size=1,
        radix_eviction_policy=EvictionPolicy.PRIORITY,
        hicache_write_policy=WritePolicy.WRITE_THROUGH,
        reinsert_prompt_prefix=True,
    )
    tokens = tuple(range(1, 11))
    ops: list[Op] = [StartRequest(1, tokens, prompt_len=8), FinishRequest(1)]
    assert _node(_run(config, ops), tokens).priority == 1
    assert _node(_run(config, ops, priority_after_split=True), tokens).priority == 0
    assert _node(_run(config, ops, priority_after_split=True), tokens[:8]).priority == 1


def test_d37_a_backup_short_of_host_memory_evicts_only_the_shortfall() -> None:
    """The shrunk counterexample: the write-through of a new leaf finds 2 free host slots of the 6 it needs.
    0.5.20 evicts 6 host tokens (both host-only nodes of the 2900 chain), 0.5.23 evicts the 4 missing."""
    config = HiCacheConfig(
        device_size=8,
        page_size=2,
        hicache_ratio=1.5,
        hicache_write_policy=WritePolicy.WRITE_THROUGH,
        radix_eviction_policy=EvictionPolicy.FIFO,
    )
    ops: list[Op] = [
        StartRequest(22, (2900, 2901)),
        FinishRequest(22),
        StartRequest(23, (2900, 2901, 2902, 2903, 2904, 2905)),
        FinishRequest(23),
        CompleteIO(IOQueue.WRITE, 0, 64),
        CheckHicacheEvents(),
        StartRequest(28, (3400, 3401, 3402, 3403, 3404, 3405)),
        FinishRequest(28),
        CompleteIO(IOQueue.WRITE, 0, 64),
        CheckHicacheEvents(),
        StartRequest(30, (4000, 4001, 4002, 4003, 4004, 4005)),
        FinishRequest(30),
    ]
    off, on = _run(config, ops), _run(config, ops, evict_host_shortfall=True)
    assert (2900, 2901) not in {n.id.path for n in off.nodes} and len(off.host.free) == 2
    assert _node(on, (2900, 2901)).host_value is not None and on.host.free == ()


def test_d38_one_steps_backups_share_one_write_ack() -> None:
    """The shrunk counterexample (write_through_selective): the checkpoint's insert backs up two nodes;
    0.5.20 queues a copy and an ack per node, 0.5.23 one merged copy for the step."""
    config = HiCacheConfig(
        device_size=8,
        page_size=1,
        hicache_ratio=1.5,
        radix_eviction_policy=EvictionPolicy.FIFO,
        hicache_write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE,
    ).with_fidelity({**PROFILES["sglang-0.5.23"], "merge_write_acks": False})
    ops: list[Op] = [
        StartRequest(30, (3, 4, 2, 4, 4), prompt_len=4),
        FinishRequest(30),
        StartRequest(31, (3, 4, 2, 4, 4, 4, 1), prompt_len=3),
        CacheUnfinishedRequest(31),
    ]
    off, on = _run(config, ops), _run(config, ops, merge_write_acks=True)
    assert dict(off.queues)["write_pending"] == 2 and dict(on.queues)["write_pending"] == 1
    assert off.ongoing_write_through == on.ongoing_write_through, "the same nodes are in flight either way"
    with HiCacheModel(config.with_fidelity({"merge_write_acks": True})) as model:
        for op in [*ops, CompleteIO(IOQueue.WRITE, 0, 1)]:
            model.apply(op)
        assert model.apply(CheckHicacheEvents()) == EventsResult(1, 0, 0, 0, 0)
        assert model.snapshot().ranks[0].ongoing_write_through == (), "the one ack retires every node"
