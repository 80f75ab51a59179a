"""vLLM's ``Family``: what the checking side needs of its operations, snapshots and invariants, and its
directed conformance scenarios (a prefix hit, eviction under pressure, a refused reset, offload store and
load back, a failed store)."""

from __future__ import annotations

import typing
from typing import Final

from refcache.config import EvictionPolicy, HiCacheConfig
from refcache.family import Family, Scenario, field_diff
from refcache.vllm.invariants import check_all, check_step
from refcache.vllm.ops import (
    OPS,
    Admit,
    CompleteLoad,
    CompleteStore,
    Decode,
    Free,
    Load,
    Lookup,
    ResetPrefixCache,
    Store,
    TakeEvents,
    VllmObservation,
    VllmOp,
)
from refcache.vllm.snapshot import VllmSnapshot
from refcache.vllm.trace import dumps_trace, is_vllm_trace, read_trace

__all__ = ["FAMILY", "diff_vllm_snapshots", "scenarios", "status_line"]


def diff_vllm_snapshots(
    a: VllmSnapshot, b: VllmSnapshot, name_a: str = "vllm-model", name_b: str = "vllm"
) -> list[str]:
    """Readable differences between two vLLM snapshots: which field (block, request, chunk), both values."""
    return field_diff("snapshot", a, b, name_a, name_b)


def status_line(snap: VllmSnapshot) -> str:
    """One line per step: GPU blocks in use of the usable ones, blocks holding a cached hash, the free queue's
    length and ``rq`` running requests; with offloading, CPU chunks of the capacity, stores not yet
    complete, and ``st``/``ld`` queued store and load jobs."""
    used = sum(1 for b in snap.blocks if b.ref_cnt > 0)
    cached = sum(1 for b in snap.blocks if b.key is not None)
    line = f"blocks used {used}/{len(snap.blocks) - 1} cached {cached} free {snap.num_free} rq{len(snap.requests)}"
    off = snap.offload
    if off is not None:
        line += (
            f" | chunks {len(off.chunks)}/{off.capacity} pending {off.num_write_pending} "
            f"st{len(off.pending_stores)} ld{len(off.pending_loads)}"
        )
    return line


def _config(
    block_size: int, blocks: int, ratio: float = 1.5, policy: EvictionPolicy = EvictionPolicy.LRU
) -> HiCacheConfig:
    """One KV cache group of ``blocks`` usable blocks of ``block_size`` tokens (``refcache.vllm.config``)."""
    return HiCacheConfig(
        page_size=block_size,
        device_size=block_size * blocks,
        hicache_ratio=ratio,
        radix_eviction_policy=policy,
        layer_num=1,
    )


P: Final = (1, 2, 3, 4, 5, 6, 7, 8)
Q: Final = (1, 2, 3, 4, 9, 9, 9, 9)
R: Final = (5, 5, 6, 6, 7, 7, 8, 8)


def scenarios() -> tuple[Scenario[VllmOp], ...]:
    """Every vLLM scenario, in a fixed order."""
    return (
        Scenario(
            "prefix-hit",
            "a freed request's full blocks are found by a lookup and adopted by the next request sharing them",
            _config(2, 8),
            (Admit(0, P), Decode(0, 1), Free(0), Lookup(Q), Admit(1, Q), Free(1), TakeEvents()),
        ),
        Scenario(
            "evict-under-pressure",
            "cached free blocks are evicted, oldest first, when a request needs more blocks than are empty",
            _config(2, 6),
            (Admit(0, P), Free(0), Admit(1, R), Lookup(P), Free(1), TakeEvents()),
        ),
        Scenario(
            "reset-refused-while-in-use",
            "reset_prefix_cache is refused while a block is held and empties the cache once none is",
            _config(2, 8),
            (Admit(0, P), ResetPrefixCache(), Free(0), ResetPrefixCache(), Lookup(P), TakeEvents()),
        ),
        Scenario(
            "offload-store-and-load",
            "a request's blocks are stored to CPU chunks, the GPU copies evicted, then loaded back",
            _config(2, 6),
            (
                Admit(0, P),
                Store(0),
                CompleteStore(),
                Free(0),
                Admit(1, R),
                Free(1),
                Admit(2, P),
                Load(2),
                CompleteLoad(),
                Free(2),
                TakeEvents(),
            ),
        ),
        Scenario(
            "failed-store",
            "a store job whose transfer fails leaves nothing stored and nothing pinned",
            _config(2, 6, policy=EvictionPolicy.LFU),
            (Admit(0, P), Store(0), CompleteStore(success=False), Admit(1, P), Load(1), Free(0), Free(1)),
        ),
    )


OBSERVATIONS: Final[tuple[type[VllmObservation], ...]] = typing.get_args(VllmObservation)

FAMILY: Final[Family[VllmOp, VllmObservation, VllmSnapshot]] = Family(
    name="vllm",
    summary="vLLM (refcache.vllm.ops)",
    ops=OPS,
    observation=OBSERVATIONS,
    snapshot=VllmSnapshot,
    check=check_all,
    check_step=check_step,
    diff=diff_vllm_snapshots,
    status_line=status_line,
    dumps_trace=dumps_trace,
    read_trace=read_trace,
    is_trace=is_vllm_trace,
    scenarios=scenarios,
    reference="vllm-model",
    granularities={},
)
"""vLLM's family: ``refcache.vllm.invariants`` over ``VllmSnapshot``, traces of ``refcache.vllm.ops``."""
