"""The configuration of a vLLM system, derived from a ``HiCacheConfig``.

One configuration type crosses the registry (``open_systems(names, config)``), the trace header, replay
and shrink. A vLLM system reads five of its fields, with the same meaning they have for HiCache:

=========================  ============================================================================
``HiCacheConfig``           vLLM
=========================  ============================================================================
``page_size``               ``block_size`` (= hash block size = scheduler block size: one group)
``device_size``             ``device_size // page_size`` usable GPU blocks, plus block 0, the null block
``host_size``               ``host_size // page_size // layer_num`` CPU offload chunks (``hicache_ratio`` sizes
                            it; the offload operations move group 0's blocks, so it gets group 0's share)
``radix_eviction_policy``   the offload policy: ``lru`` → LRU; ``lfu`` → ARC (vLLM's frequency-aware one)
``layer_num``               KV cache groups: each layer is one full-attention group of the same spec (a
                            hybrid model's equal-size groups), all sharing the one block pool
=========================  ============================================================================

Every other field is ignored. The four other eviction policies have no vLLM counterpart: ``of`` raises
``ConfigError`` naming them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from refcache.config import EvictionPolicy, HiCacheConfig
from refcache.errors import ConfigError

__all__ = ["OffloadPolicy", "VllmConfig"]


class OffloadPolicy(enum.StrEnum):
    """``CPUOffloadingManager(cache_policy=...)``."""

    LRU = "lru"  # least recently used chunk first (a recency rank per chunk)
    ARC = "arc"  # adaptive replacement: T1 (seen once) / T2 (reused), ghost lists B1 / B2


_POLICY: dict[EvictionPolicy, OffloadPolicy] = {
    EvictionPolicy.LRU: OffloadPolicy.LRU,
    EvictionPolicy.LFU: OffloadPolicy.ARC,
}


@dataclass(frozen=True)
class VllmConfig:
    """What a vLLM system is built with (see the module docstring for where each field comes from)."""

    block_size: int  # tokens per block (hash, scheduler and every group's KV block size are equal)
    num_blocks: int  # GPU blocks including block 0, the null block (never freed, hashed or queued)
    offload_chunks: int  # CPU offload capacity in chunks of one block; 0: no offload manager
    offload_policy: OffloadPolicy  # the offload manager's cache policy
    kv_groups: int = 1  # full-attention KV cache groups (1: UnitaryKVCacheCoordinator; more: Hybrid)

    @classmethod
    def of(cls, config: HiCacheConfig) -> VllmConfig:
        """The vLLM configuration a ``HiCacheConfig`` stands for. Raises ``ConfigError`` for an eviction
        policy vLLM does not have."""
        policy = _POLICY.get(config.radix_eviction_policy)
        if policy is None:
            raise ConfigError(
                f"radix_eviction_policy={config.radix_eviction_policy.value} has no vLLM offload policy: "
                f"use lru (vLLM's LRU) or lfu (vLLM's ARC)"
            )
        usable = config.device_size // config.page_size
        if usable < 1:
            raise ConfigError(f"device_size {config.device_size} holds no block of {config.page_size} tokens")
        return cls(
            config.page_size,
            usable + 1,
            config.host_size // config.page_size // config.layer_num,
            policy,
            config.layer_num,
        )

    @property
    def usable_blocks(self) -> int:
        """Blocks a request can hold: all but the null block."""
        return self.num_blocks - 1
