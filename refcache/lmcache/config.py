"""The configuration of an LMCache system, derived from a ``HiCacheConfig``.

One configuration type crosses the registry (``open_systems(names, config)``), the trace header, replay and
shrink, as for vLLM (``refcache.vllm.config``). An LMCache system reads these fields:

====================================  =====================================================================
``HiCacheConfig``                      LMCache (``LMCacheEngineConfig`` and the model's metadata)
====================================  =====================================================================
``page_size``                          ``chunk_size`` (tokens per chunk)
``layer_num``, ``head_num``,           the KV shape ``[2, layers, tokens, heads * head_dim]`` of one chunk
``head_dim``, ``dtype``                (``MemoryFormat.KV_2LTD``): ``bytes_per_token`` bytes per token
``device_size``                        the CPU budget in tokens: ``max_local_cpu_size`` holds
                                       ``ceil(device_size / page_size)`` full chunks, each at its aligned
                                       size (LMCache's first tier is CPU memory, the tier every other one is
                                       allocated through)
``hicache_storage_backend``            ``None``: CPU only; ``"file"``: CPU and local disk; ``"memory"``: CPU,
                                       local disk (when it has a budget) and a remote tier (``fs://`` on a
                                       temporary directory in the adapter; unbounded)
``hicache_ratio``                      the disk budget relative to the CPU budget: ``max_local_disk_size``
                                       holds ``ceil(int(device_size * hicache_ratio) / page_size)`` full
                                       chunks at their aligned size; 0 with ``"memory"``: no local disk, the
                                       remote tier only
``radix_eviction_policy``              ``cache_policy``: ``lru``, ``lfu``, ``fifo``, ``mru`` (LMCache's four)
``hicache_write_policy``               ``save_unfull_chunk``: ``write_through_selective`` (the default) →
                                       False (LMCache's default: a trailing partial chunk is not stored);
                                       ``write_through`` → True
``hicache_storage_prefetch_policy``    ``enable_async_loading``: ``best_effort`` (the default) → False
                                       (``retrieve`` reads synchronously); ``wait_complete`` → True
                                       (``Prefetch`` starts ``async_lookup_and_prefetch``, ``Retrieve``
                                       takes what it loaded)
====================================  =====================================================================

Every other field is ignored. A value with no LMCache meaning (``filo``/``priority`` policies, the
``write_back`` write policy, the ``timeout`` prefetch policy, ``"file"`` without a disk budget, an ``MLA``
cache) raises ``ConfigError`` naming the choices.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from refcache.config import AttentionKind, EvictionPolicy, HiCacheConfig, PrefetchPolicy, WritePolicy
from refcache.errors import ConfigError

__all__ = ["ALIGN_BYTES", "CachePolicy", "LMCacheConfig"]

ALIGN_BYTES: Final = 4096
"""The CPU allocator's alignment (``AddressManager.ALIGN_BYTES``): every object's physical size is its
logical size rounded up to it."""


class CachePolicy(enum.StrEnum):
    """``LMCacheEngineConfig.cache_policy`` (``v1/storage_backend/cache_policy``)."""

    LRU = "LRU"  # evict the least recently used entry first (a hit moves an entry to the end)
    LFU = "LFU"  # evict the least frequently used entry first, FIFO among equal frequencies
    FIFO = "FIFO"  # evict in insertion order; hits change nothing
    MRU = "MRU"  # evict the most recently used entry first (a hit moves it to the end, eviction scans back)


_POLICY: Final[dict[EvictionPolicy, CachePolicy]] = {
    EvictionPolicy.LRU: CachePolicy.LRU,
    EvictionPolicy.LFU: CachePolicy.LFU,
    EvictionPolicy.FIFO: CachePolicy.FIFO,
    EvictionPolicy.MRU: CachePolicy.MRU,
}


@dataclass(frozen=True)
class LMCacheConfig:
    """What an LMCache system is built with (see the module docstring for where each field comes from)."""

    chunk_size: int  # tokens per chunk (the unit of hashing, storage and eviction)
    bytes_per_token: int  # KV bytes of one token over every layer (K and V)
    cpu_bytes: int  # the CPU allocator's size (max_local_cpu_size in bytes); > 0
    disk_bytes: int  # max_local_disk_size in bytes; 0: no local disk tier
    remote: bool  # a remote tier (remote_url) after the local ones
    cache_policy: CachePolicy  # every tier's eviction policy (CPU and disk use the same one)
    save_unfull_chunk: bool = False  # store a trailing chunk shorter than chunk_size
    async_loading: bool = False  # enable_async_loading: Prefetch, and Retrieve from what it loaded

    def __post_init__(self) -> None:
        for name in ("chunk_size", "bytes_per_token", "cpu_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if isinstance(self.disk_bytes, bool) or self.disk_bytes < 0:
            raise ConfigError(f"disk_bytes={self.disk_bytes!r} must be a non-negative integer")
        if self.cpu_bytes < self.aligned(self.chunk_bytes):
            raise ConfigError(
                f"cpu_bytes={self.cpu_bytes} holds no chunk of {self.chunk_bytes} bytes "
                f"({self.aligned(self.chunk_bytes)} aligned); raise device_size"
            )

    @classmethod
    def of(cls, config: HiCacheConfig) -> LMCacheConfig:
        """The LMCache configuration a ``HiCacheConfig`` stands for. Raises ``ConfigError`` for a value with
        no LMCache meaning (module docstring)."""
        policy = _POLICY.get(config.radix_eviction_policy)
        if policy is None:
            raise ConfigError(
                f"radix_eviction_policy={config.radix_eviction_policy.value} has no LMCache cache policy: "
                f"use one of {', '.join(p.value for p in _POLICY)}"
            )
        if config.attention is not AttentionKind.MHA:
            raise ConfigError("LMCache systems model an MHA KV cache; use attention=MHA")
        if config.hicache_write_policy is WritePolicy.WRITE_BACK:
            raise ConfigError(
                "hicache_write_policy selects LMCache's save_unfull_chunk: write_through_selective (False) "
                "or write_through (True); write_back has no LMCache meaning"
            )
        if config.hicache_storage_prefetch_policy is PrefetchPolicy.TIMEOUT:
            raise ConfigError(
                "hicache_storage_prefetch_policy selects LMCache's enable_async_loading: best_effort (False) "
                "or wait_complete (True); timeout has no LMCache meaning"
            )
        per_token = config.bytes_per_token
        backend = config.hicache_storage_backend
        disk_tokens = int(config.device_size * config.hicache_ratio) if backend is not None else 0
        if backend == "file" and disk_tokens == 0:
            raise ConfigError(
                "hicache_storage_backend='file' is LMCache's local disk tier, sized by hicache_ratio; "
                "hicache_ratio must be > 0"
            )
        chunk = cls.aligned(config.page_size * per_token)
        return cls(
            chunk_size=config.page_size,
            bytes_per_token=per_token,
            cpu_bytes=-(-config.device_size // config.page_size) * chunk,
            disk_bytes=-(-disk_tokens // config.page_size) * chunk,
            remote=backend == "memory",
            cache_policy=policy,
            save_unfull_chunk=config.hicache_write_policy is WritePolicy.WRITE_THROUGH,
            async_loading=config.hicache_storage_prefetch_policy is PrefetchPolicy.WAIT_COMPLETE,
        )

    @property
    def chunk_bytes(self) -> int:
        """The logical size of one full chunk (``MemoryObj.get_size``)."""
        return self.chunk_size * self.bytes_per_token

    @staticmethod
    def aligned(size: int) -> int:
        """``size`` rounded up to ``ALIGN_BYTES`` (``AddressManager.compute_aligned_size``): the physical
        size of an object of ``size`` bytes, what both the CPU allocator and the disk budget count."""
        return (size + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES

    @property
    def disk(self) -> bool:
        """Whether the local disk tier exists."""
        return self.disk_bytes > 0

    @property
    def max_local_cpu_size(self) -> float:
        """``cpu_bytes`` in LMCache's unit (GiB; ``int(x * 1024**3)`` gives ``cpu_bytes`` back exactly)."""
        return self.cpu_bytes / 1024**3

    @property
    def max_local_disk_size(self) -> float:
        """``disk_bytes`` in LMCache's unit (GiB)."""
        return self.disk_bytes / 1024**3
