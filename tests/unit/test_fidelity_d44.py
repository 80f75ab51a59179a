"""D-44, ``write_back_per_victim`` (SGLang 0.5.22 on): write_back eviction backs up, waits for and demotes one
victim at a time, so the backup of the next victim may evict the host copy of the one before; refcache (and
0.5.20) back up every victim first and release them together. Shown on the shrunk counterexample of the
model-versus-0.5.23 differential (specs/sglang-adapter.md "Newer releases")."""

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
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CompleteIO,
    Evict,
    EvictResult,
    FinishRequest,
    IOQueue,
    Op,
    StartRequest,
)
from refcache.hicache.snapshot import Path, RankSnapshot
from refcache.model import HiCacheModel

A = (1, 2, 3, 4)
B = tuple(range(10, 26))
C = tuple(range(30, 46))
OPS: Sequence[Op] = (
    StartRequest(1, A),
    FinishRequest(1),
    StartRequest(2, B),
    FinishRequest(2),
    StartRequest(3, C),  # evicts B to the host (16 of 32 host slots)
    FinishRequest(3),
    Evict(10000),
)


def _config(policy: WritePolicy = WritePolicy.WRITE_BACK) -> HiCacheConfig:
    """Device 20, host 32 tokens, page size 4, MRU, 0.5.23's profile but for D-44."""
    return HiCacheConfig(
        device_size=20,
        hicache_ratio=1.4,
        page_size=4,
        radix_eviction_policy=EvictionPolicy.MRU,
        hicache_write_policy=policy,
    ).with_fidelity({**PROFILES["sglang-0.5.23"], "write_back_per_victim": False})


def _run(
    config: HiCacheConfig, *, per_victim: bool, ops: Sequence[Op] = OPS
) -> tuple[list[object], RankSnapshot]:
    with HiCacheModel(config.with_fidelity({"write_back_per_victim": per_victim})) as model:
        results: list[object] = [model.apply(op) for op in ops]
        return results, model.snapshot().ranks[0]


def _host(rank: RankSnapshot) -> dict[Path, tuple[int, ...] | None]:
    return {n.id.path: n.host_value for n in rank.nodes if n.id.path}


def test_the_option_is_registered_and_followed_from_0522() -> None:
    assert FIDELITY_OPTIONS["D-44"] == "write_back_per_victim"
    assert PROFILES["sglang-0.5.22"]["write_back_per_victim"]
    assert PROFILES["sglang-0.5.23"]["write_back_per_victim"]
    assert not PROFILES["sglang-0.5.20"]["write_back_per_victim"]
    assert not PROFILES["refcache"]["write_back_per_victim"]
    assert (
        "0.5.22" in FOLLOWED_BY["write_back_per_victim"]
        and "0.5.20" not in FOLLOWED_BY["write_back_per_victim"]
    )


def test_one_victim_at_a_time_its_host_copy_is_the_next_backups_to_take() -> None:
    """Evict(10000) finds C (most recent) then A on the device, B on the host only. 0.5.23 backs C up into the
    16 free host slots and demotes it; A's backup is then 4 slots short and evict_host takes C's copy (MRU),
    so B stays and C is gone. Backing both up first (refcache, 0.5.20) pins C's copy: B's is evicted."""
    config = _config()
    results, on = _run(config, per_victim=True)
    assert results[-1] == EvictResult(num_evicted=20)
    assert _host(on) == {A: (16, 17, 18, 19), B: tuple(range(16))}
    assert on.host.free == tuple(range(20, 32))
    assert sorted(on.device.free) == list(range(20))
    results, off = _run(config, per_victim=False)
    assert results[-1] == EvictResult(num_evicted=20)
    assert _host(off) == {A: (0, 1, 2, 3), C: tuple(range(16, 32))}
    assert off.host.free == tuple(range(4, 16))


@pytest.mark.parametrize("policy", [WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_THROUGH_SELECTIVE])
def test_the_option_changes_nothing_but_write_back(policy: WritePolicy) -> None:
    """Only write_back eviction backs a victim up; the others evict what is backed up or drop it."""
    config = _config(policy)
    acks: list[Op] = [CompleteIO(IOQueue.WRITE, 0, 64), CheckHicacheEvents()]
    ops = [
        *OPS[:4],
        *acks,
        *OPS[4:6],
        *acks,
        StartRequest(4, (50, 51, 52, 53)),
        FinishRequest(4),
        Evict(10000),
    ]
    on, off = _run(config, per_victim=True, ops=ops), _run(config, per_victim=False, ops=ops)
    assert on == off and on[0][-1] != EvictResult(num_evicted=0)


def test_the_implementation_refuses_it() -> None:
    from refcache.gpu.driver import HiCacheImpl  # torch: imported by this test only

    with pytest.raises(UnsupportedError, match="write_back_per_victim"):
        HiCacheImpl(_config().with_fidelity({"write_back_per_victim": True}))
