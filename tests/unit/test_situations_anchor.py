"""The situations of issue #30 item 5, recognised on short model traces: a prefetch revoked below a non-root
anchor, one that inserts pages there, the eviction right after it, a split of a prioritised node and the
eviction right after a split. Each is shown recognised and shown not recognised where one fact differs
(the anchor is the root, the eviction is not right after, the split node's priority is 0)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings

from refcache.check.configs import configs
from refcache.check.machines import EVICTION_ORDER_KINDS, machine
from refcache.check.situations import SituationTracker
from refcache.config import EvictionPolicy, HiCacheConfig, WritePolicy
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    Evict,
    EvictHost,
    FinishRequest,
    IOQueue,
    MatchPrefix,
    Op,
    PrefetchFromStorage,
    StartRequest,
)
from refcache.model import HiCacheModel

CONFIG = HiCacheConfig(
    page_size=1,
    device_size=8,
    hicache_storage_backend="file",
    tp_size=2,
    hicache_write_policy=WritePolicy.WRITE_THROUGH,
    radix_eviction_policy=EvictionPolicy.LRU,
    prefetch_threshold=1,
).resolve()

A, B, PEER = (1, 2, 3), (4, 5, 6), (7, 8)


def finish_copies() -> list[Op]:
    """The L1→L2 writes, then the L2→L3 backups, finished and acknowledged on both ranks."""
    ops: list[Op] = []
    for queue in (IOQueue.WRITE, IOQueue.BACKUP):
        ops += [CompleteIO(queue, rank, 64) for rank in range(2)]
        ops.append(CheckHicacheEvents())
    return ops


def run(rid: int, tokens: tuple[int, ...], prompt_len: int | None = None) -> list[Op]:
    return [StartRequest(rid, tokens, None, prompt_len), FinishRequest(rid)]


def prefetch(rid: int, tokens: tuple[int, ...]) -> list[Op]:
    ops: list[Op] = [PrefetchFromStorage(rid, tokens, None)]
    ops += [CompleteIO(IOQueue.PREFETCH_QUERY, rank, 64) for rank in range(2)]
    ops.append(CheckHicacheEvents())
    ops += [CompleteIO(IOQueue.PREFETCH_IO, rank, 64) for rank in range(2)]
    ops.append(CheckPrefetchProgress(rid))
    return ops


def reached(ops: Sequence[Op], config: HiCacheConfig = CONFIG) -> list[set[str]]:
    """The situations each operation reached, on the model."""
    model = HiCacheModel(config)
    tracker = SituationTracker(config)
    before = model.snapshot()
    out: list[set[str]] = []
    for op in ops:
        outcome = model.apply(op)
        after = model.snapshot()
        out.append(set(tracker.observe(op, outcome, before, after)))
        before = after
    return out


# A chain A+B backed up to L3 on both ranks; then L1 and L2 emptied; A runs again (the anchor), a peer after it.
SETUP: list[Op] = [
    *run(0, A),
    *run(1, A + B),
    *finish_copies(),
    Evict(10_000),
    *finish_copies(),
    EvictHost(10_000),
    *run(2, A),
    *finish_copies(),
    *run(3, PEER),
    *finish_copies(),
]


def test_a_prefetch_whose_tail_is_in_l3_inserts_below_its_anchor_then_an_eviction_chooses() -> None:
    ops = [*SETUP, *prefetch(4, A + B), Evict(2)]
    seen = reached(ops)
    assert seen[-2] == {"prefetch-inserts-below-anchor"}  # CheckPrefetchProgress: B under A
    assert "evict-chooses-after-prefetch-insert" in seen[-1]
    assert not any("prefetch-revoked-below-anchor" in s for s in seen)


def test_the_eviction_must_come_right_after_the_insert() -> None:
    ops = [*SETUP, *prefetch(4, A + B), CheckHicacheEvents(), Evict(2)]
    assert "evict-chooses-after-prefetch-insert" not in reached(ops)[-1]


def test_a_prefetch_whose_tail_is_missing_from_l3_is_revoked_below_its_anchor() -> None:
    ops = [*SETUP, *prefetch(4, (*A, 50, 51))]
    seen = reached(ops)
    assert seen[-4] == {"prefetch-revoked-below-anchor"}  # the CheckHicacheEvents after the query
    assert not any("prefetch-inserts-below-anchor" in s for s in seen)


def test_a_prefetch_below_the_root_is_neither() -> None:
    """With L1 and L2 emptied and nothing run again the anchor is the root: what push_down always did."""
    setup = [*run(0, A + B), *finish_copies(), Evict(10_000), *finish_copies(), EvictHost(10_000)]
    for tail in (A + B, (50, 51)):
        seen = reached([*setup, *prefetch(4, tail), Evict(2)])
        assert not any(s & {"prefetch-inserts-below-anchor", "prefetch-revoked-below-anchor"} for s in seen)
        assert "evict-chooses-after-prefetch-insert" not in seen[-1]


PRIORITISED = HiCacheConfig(
    page_size=1, device_size=8, radix_eviction_policy=EvictionPolicy.PRIORITY, reinsert_prompt_prefix=True
).resolve()


def test_a_split_of_a_prioritised_node_and_the_eviction_right_after() -> None:
    # D-24: the prompt (2 tokens) is inserted again with priority 1, which splits the chain there; the match
    # then splits the prioritised lower node, and the eviction right after chooses between it and the peer.
    ops = [*run(0, (1, 2, 3, 4, 5), prompt_len=2), *run(1, PEER), MatchPrefix((1, 2, 3), None), Evict(1)]
    seen = reached(ops, PRIORITISED)
    assert "split-of-prioritised-node" not in seen[1]  # D-24's split: the node was at 0 until this insert
    assert seen[-2] == {"split-of-prioritised-node"}
    assert seen[-1] == {"evict-chooses-after-split"}


def test_a_split_of_a_node_at_priority_0_is_not_one() -> None:
    ops = [*run(0, (1, 2, 3, 4, 5)), *run(1, PEER), MatchPrefix((1, 2, 3), None), Evict(1)]
    seen = reached(ops, PRIORITISED)
    assert "split-of-prioritised-node" not in seen[-2]
    assert seen[-1] == {"evict-chooses-after-split"}  # priorities 0 and 0: within 1
    later = reached([*ops[:-1], CheckHicacheEvents(), Evict(1)], PRIORITISED)
    assert "evict-chooses-after-split" not in later[-1]


@settings(max_examples=30, deadline=None)
@given(configs(priorities=True), configs())
def test_the_priority_policy_runs_with_the_prompt_re_insert(
    config: HiCacheConfig, plain: HiCacheConfig
) -> None:
    """D-24's re-insert is the default configurations' only source of non-zero priorities (issue #30 item 5):
    ``configs(priorities=True)`` (the machines without faults) gives it to the priority and LRU policies."""
    policies = (EvictionPolicy.PRIORITY, EvictionPolicy.LRU)
    assert config.reinsert_prompt_prefix == (config.radix_eviction_policy in policies)
    assert not plain.reinsert_prompt_prefix


def test_the_default_machines_draw_priorities_where_they_draw_the_eviction_order_kinds() -> None:
    assert set(EVICTION_ORDER_KINDS) <= set(machine().kinds)
    assert not set(EVICTION_ORDER_KINDS) & set(machine(faults=True).kinds)


@settings(max_examples=20, deadline=None)
@given(
    configs(priorities=True, constraints={"radix_eviction_policy": EvictionPolicy.PRIORITY}),
    configs(priorities=True, constraints={"radix_eviction_policy": EvictionPolicy.FIFO}),
    configs(priorities=True, constraints={"reinsert_prompt_prefix": False}),
)
def test_the_re_insert_follows_the_constrained_policy_and_a_constraint_on_it_stands(
    priority: HiCacheConfig, fifo: HiCacheConfig, kept: HiCacheConfig
) -> None:
    assert priority.reinsert_prompt_prefix and not fifo.reinsert_prompt_prefix
    assert not kept.reinsert_prompt_prefix
