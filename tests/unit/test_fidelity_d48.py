"""D-48, ``reclaim_host_duplicates`` (SGLang 0.5.22 on, ``UnifiedTreeCore._reclaim_full_host_duplicates``): under
write_back, ``evict_host`` first frees the host copies of nodes that are also on the device (pass 1 sparing
evictable device leaves, pass 2 taking them); the node stays, device-only. refcache (and 0.5.20) free host
memory only by removing host-only leaves. The shrunk trace of the model-versus-0.5.23 write_back fuzzing
(seed 3, 7 operations; specs/sglang-adapter.md)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from refcache.config import (
    FIDELITY_OPTIONS,
    FOLLOWED_BY,
    PROFILES,
    EvictionPolicy,
    HiCacheConfig,
    WritePolicy,
)
from refcache.errors import UnsupportedError
from refcache.hicache.invariants import check_all, check_step
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CompleteIO,
    Evict,
    EvictHost,
    EvictHostResult,
    FinishRequest,
    IOQueue,
    Op,
    StartRequest,
)
from refcache.hicache.snapshot import RankSnapshot
from refcache.hicache.states import NodeEvent, NodeState
from refcache.model import HiCacheModel

T = tuple(range(3000, 3004))
OPS: Sequence[Op] = (
    StartRequest(22, T),
    FinishRequest(22),
    Evict(10000),  # write_back: T is backed up and demoted (host only)
    StartRequest(24, T),  # loads T back: on both tiers, held by request 24
    CompleteIO(IOQueue.LOAD),
    CheckHicacheEvents(),  # the load's ack: T is a settled duplicate
    EvictHost(11),
)


def _config(policy: WritePolicy = WritePolicy.WRITE_BACK) -> HiCacheConfig:
    """Device 9, host 28 tokens, page size 1, PRIORITY, 0.5.23's profile but for D-48."""
    return HiCacheConfig(
        device_size=9,
        hicache_ratio=3.0,
        page_size=1,
        load_back_threshold=4,
        radix_eviction_policy=EvictionPolicy.PRIORITY,
        hicache_write_policy=policy,
    ).with_fidelity({**PROFILES["sglang-0.5.23"], "reclaim_host_duplicates": False})


def _run(
    config: HiCacheConfig, *, reclaim: bool, ops: Sequence[Op] = OPS
) -> tuple[list[object], RankSnapshot, dict[tuple[NodeState, NodeEvent], int]]:
    with HiCacheModel(config.with_fidelity({"reclaim_host_duplicates": reclaim})) as model:
        results: list[object] = []
        before = model.snapshot()
        for op in ops:
            results.append(model.apply(op))
            after = model.snapshot()
            assert check_all(after) == [] and check_step(before, after) == [], op
            before = after
        return results, before.ranks[0], model.transitions_taken()


def test_the_option_is_registered_and_followed_from_0522() -> None:
    assert FIDELITY_OPTIONS["D-48"] == "reclaim_host_duplicates"
    assert PROFILES["sglang-0.5.22"]["reclaim_host_duplicates"]
    assert PROFILES["sglang-0.5.23"]["reclaim_host_duplicates"]
    assert not PROFILES["sglang-0.5.20"]["reclaim_host_duplicates"]
    assert not PROFILES["refcache"]["reclaim_host_duplicates"]
    assert "0.5.22" in FOLLOWED_BY["reclaim_host_duplicates"]


def test_evict_host_frees_the_host_copy_of_a_node_on_the_device() -> None:
    """Request 24 holds T on the device (locked: no pass spares it); 0.5.23 frees T's 4 host slots and T
    stays in the tree, device-only. Without the option T is no host leaf (it is on the device): nothing."""
    results, on, taken = _run(_config(), reclaim=True)
    assert results[-1] == EvictHostResult(num_evicted=4)
    (node,) = on.nodes
    assert node.state is NodeState.DEVICE and node.host_value is None and node.value is not None
    assert node.lock_ref == 1 and len(on.host.free) == 28
    assert taken[(NodeState.BOTH, NodeEvent.RECLAIM_HOST_DUPLICATE)] == 1
    results, off, taken = _run(_config(), reclaim=False)
    assert results[-1] == EvictHostResult(num_evicted=0)
    assert off.nodes[0].state is NodeState.BOTH and len(off.host.free) == 24
    assert (NodeState.BOTH, NodeEvent.RECLAIM_HOST_DUPLICATE) not in taken


def test_the_first_pass_spares_evictable_device_leaves() -> None:
    """Once request 24 is done T is an evictable device leaf: pass 1 skips it, pass 2 (nothing else to free)
    takes it. A pin on the host copy (none here) would keep it; a load in flight does (before the ack)."""
    results, on, _ = _run(_config(), reclaim=True, ops=[*OPS[:-1], FinishRequest(24), EvictHost(11)])
    assert results[-1] == EvictHostResult(num_evicted=4) and on.nodes[0].state is NodeState.DEVICE
    before_ack = [*OPS[:4], EvictHost(11)]
    results, on, _ = _run(_config(), reclaim=True, ops=before_ack)
    assert results[-1] == EvictHostResult(num_evicted=0) and on.nodes[0].state is NodeState.BOTH


def test_pass_one_takes_a_held_duplicate_before_an_evictable_leaf_registered_earlier() -> None:
    """Both loaded back, T first (then finished: an evictable device leaf), U second (held by request 4):
    EvictHost(4) takes U's host copy in pass 1, though T comes first in registration order."""
    u = tuple(range(4000, 4004))
    load: list[Op] = [CompleteIO(IOQueue.LOAD), CheckHicacheEvents()]
    ops: list[Op] = [StartRequest(1, T), FinishRequest(1), StartRequest(2, u), FinishRequest(2), Evict(10000)]
    ops += [StartRequest(3, T), *load, FinishRequest(3), StartRequest(4, u), *load, EvictHost(4)]
    results, on, _ = _run(_config(), reclaim=True, ops=ops)
    states = {n.id.path: n.state for n in on.nodes}
    assert results[-1] == EvictHostResult(num_evicted=4)
    assert states == {T: NodeState.BOTH, u: NodeState.DEVICE}


def test_a_reclaimed_node_is_backed_up_again_when_evicted() -> None:
    """Device-only again, T is written back (a new host copy) by the next eviction that takes it."""
    ops = [*OPS, FinishRequest(24), Evict(10000)]
    _, on, _ = _run(_config(), reclaim=True, ops=ops)
    assert on.nodes[0].state is NodeState.HOST and on.nodes[0].host_value is not None


@pytest.mark.parametrize("policy", [WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_THROUGH_SELECTIVE])
def test_the_option_changes_nothing_but_write_back(policy: WritePolicy) -> None:
    ops: list[Op] = [StartRequest(22, T), FinishRequest(22), StartRequest(23, T), FinishRequest(23)]
    ops += [CompleteIO(IOQueue.WRITE, 0, 8), CheckHicacheEvents(), EvictHost(11)]
    on, off = _run(_config(policy), reclaim=True, ops=ops), _run(_config(policy), reclaim=False, ops=ops)
    assert on[:2] == off[:2] and on[1].nodes[0].state is NodeState.BOTH


def test_the_implementation_refuses_it() -> None:
    from refcache.gpu.driver import HiCacheImpl  # torch: imported by this test only

    with pytest.raises(UnsupportedError, match="reclaim_host_duplicates"):
        HiCacheImpl(_config().with_fidelity({"reclaim_host_duplicates": True}))
