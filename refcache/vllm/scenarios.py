"""vLLM's directed conformance scenarios: short runs, each through one situation of the block pool and the
CPU offload manager — a prefix hit, eviction under pressure, a refused reset, an offload store and load back,
a failed store. ``refcache.conformance.check_system`` runs every one on a system under test;
``tests/unit/test_family.py`` holds the reference model to them and checks what each reaches."""

from __future__ import annotations

from typing import Final

from refcache.config import EvictionPolicy, HiCacheConfig
from refcache.family import Scenario
from refcache.vllm.ops import (
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
    VllmOp,
)

__all__ = ["scenarios"]


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
