"""SGLang's own caches, driven in this process for side-by-side benchmarks (when ``import sglang`` works).

``load()`` imports SGLang 0.5.20's ``RadixCache`` / ``HiRadixCache`` on a CPU-only machine (through the
SGLang adapter's import shim, ``refcache.engines.sglang._shim``) or returns why it cannot. The loops below issue the calls SGLang's
scheduler makes for one request (match, lock, allocate with eviction of the shortfall, insert, free the
duplicates, unlock), the same calls refcache's ``StartRequest`` / ``FinishRequest`` stand for.

``HiRadixCache`` is built as ``specs/sglang-adapter.md`` describes (one-rank gloo group,
published server args, real pools and allocator, CPU copy functions for the ``direct`` I/O backend).
Copies run synchronously on the CPU (a stream whose events are always complete), so ``writing_check`` and
``loading_check`` retire every ack at the next ``check_hicache_events``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import tempfile
import types
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from refcache.engines.sglang import _shim

__all__ = ["HiRadixLoop", "RadixLoop", "load", "radix_tree_calls"]

_LOADED: dict[str, Any] = {}


def load() -> str | None:
    """Import SGLang's caches; ``None`` when they are ready, else why not."""
    if _LOADED:
        return None
    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed in this interpreter"
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    try:
        _shim.install()  # the adapter's import shim: torchvision stubbed only where it fails to import
        for name in (
            "sglang.srt.mem_cache.radix_cache",
            "sglang.srt.mem_cache.base_prefix_cache",
            "sglang.srt.mem_cache.cache_init_params",
            "sglang.srt.mem_cache.memory_pool",
            "sglang.srt.mem_cache.allocator.token",
            "sglang.srt.mem_cache.allocator.paged",
        ):
            _LOADED[name.rsplit(".", 1)[1]] = importlib.import_module(name)
        _LOADED["version"] = importlib.import_module("sglang").__version__
    except Exception as error:
        _LOADED.clear()
        return f"SGLang's caches do not import here: {type(error).__name__}: {error}"
    return None


def version() -> str:
    return str(_LOADED["version"])


def _key(tokens: Sequence[int]) -> Any:
    return _LOADED["radix_cache"].RadixKey(list(tokens), extra_key=None)


def radix_tree_calls(
    requests: Sequence[tuple[int, ...]], values: Sequence[torch.Tensor], page_size: int
) -> float:
    """``match_prefix`` + ``insert`` of every request on a fresh ``RadixCache`` (no allocator, no eviction);
    returns the seconds spent."""
    import time

    rc, bpc = _LOADED["radix_cache"], _LOADED["base_prefix_cache"]
    cache = rc.RadixCache.create_simulated(page_size=page_size)
    keys = [_key(r) for r in requests]
    match_params, insert_params = bpc.MatchPrefixParams, bpc.InsertParams
    start = time.perf_counter()
    for key, value in zip(keys, values, strict=True):
        cache.match_prefix(match_params(key=key))
        cache.insert(insert_params(key=key, value=value))
    return time.perf_counter() - start


def _pools(page_size: int, device_size: int) -> tuple[Any, Any]:
    mp = _LOADED["memory_pool"]
    kv = mp.MHATokenToKVPool(device_size, page_size, torch.float16, 2, 8, 2, "cpu", False)
    if page_size == 1:
        alloc = _LOADED["token"].TokenToKVPoolAllocator(
            device_size, torch.float16, "cpu", kv, need_sort=False
        )
    else:
        alloc = _LOADED["paged"].PagedTokenToKVPoolAllocator(
            device_size, page_size, torch.float16, "cpu", kv, need_sort=False
        )
    return kv, alloc


class RadixLoop:
    """SGLang's ``RadixCache`` over a real token allocator of ``device_size`` slots (tiny MHA KV pool)."""

    def __init__(self, page_size: int, device_size: int) -> None:
        self.ps = page_size
        _, self.alloc = _pools(page_size, device_size)
        cip = importlib.import_module("sglang.srt.mem_cache.cache_init_params")
        params = cip.CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=self.alloc,
            page_size=page_size,
            eviction_policy="lru",
        )
        self.cache = _LOADED["radix_cache"].RadixCache(params)

    def request(self, tokens: tuple[int, ...]) -> bool:
        """One request: match, lock, allocate (evicting the shortfall), insert, free duplicates, unlock."""
        bpc = _LOADED["base_prefix_cache"]
        c, key = self.cache, _key(tokens)
        m = c.match_prefix(bpc.MatchPrefixParams(key=key))
        last = m.last_device_node
        c.inc_lock_ref(last)
        prefix = m.device_indices
        need = len(tokens) - len(prefix)
        pages = -(-need // self.ps) * self.ps
        if self.alloc.available_size() < pages:
            c.evict(bpc.EvictParams(num_tokens=pages - self.alloc.available_size()))
        new = self.alloc.alloc(pages) if pages else prefix[:0]
        if new is None:
            c.dec_lock_ref(last)
            return False
        slots = torch.cat((prefix, new[:need]))
        aligned = len(tokens) - len(tokens) % self.ps
        result = c.insert(bpc.InsertParams(key=_key(tokens[:aligned]), value=slots[:aligned]))
        duplicates = slots[len(prefix) : result.prefix_len]
        if len(duplicates):
            self.alloc.free(duplicates)
        if aligned < len(tokens):  # the unaligned tail's page (the prefix is page-aligned)
            self.alloc.free(new[aligned - len(prefix) :])
        c.dec_lock_ref(last)
        return True

    def evict(self, num_tokens: int) -> int:
        bpc = _LOADED["base_prefix_cache"]
        return int(self.cache.evict(bpc.EvictParams(num_tokens=num_tokens)).num_tokens_evicted)


# --- HiRadixCache (specs/sglang-adapter.md) ------------------------------------------------------------------------


class _DoneEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    src_i, dst_i = src_indices.long(), dst_indices.long()
    for s, d in zip(src_layers, dst_layers, strict=True):
        d[dst_i] = s[src_i]


_PG_READY: list[bool] = []


def _hiradix_setup(page_size: int, write_policy: str) -> None:
    import torch.distributed as dist

    if not _PG_READY:
        torch_dist: Any = dist
        store = torch_dist.FileStore(tempfile.mktemp(prefix="refcache-bench-gloo-"), 1)
        torch_dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        _PG_READY.append(True)
    ctx = importlib.import_module("sglang.srt.runtime_context")
    ctx.get_context().override_server_args(
        hicache_ratio=2.0,
        hicache_size=0,
        hicache_mem_layout="layer_first",
        hicache_write_policy=write_policy,
        hicache_io_backend="direct",
        hicache_storage_backend=None,
        hicache_storage_prefetch_policy="best_effort",
        served_model_name="refcache",
        page_size=page_size,
        enable_hierarchical_cache=True,
        device="cpu",
    ).install()
    fake = types.SimpleNamespace(
        __name__="refcache_bench_sync_device",
        Event=_DoneEvent,
        Stream=_Stream,
        stream=lambda s: s if s is not None else _Stream(),
        current_stream=lambda *a, **k: _Stream(),
        synchronize=lambda *a, **k: None,
    )
    cc_mod: Any = importlib.import_module("sglang.srt.managers.cache_controller")
    l2_mod: Any = importlib.import_module("sglang.srt.mem_cache.l2_transfer")
    common: Any = importlib.import_module("sglang.srt.mem_cache.pool_host.common")
    cc_mod.device_module = fake
    l2_mod.device_module = fake
    if hasattr(l2_mod, "_timing_events_supported"):
        l2_mod._timing_events_supported.cache_clear()
    common.ALLOC_MEMORY_FUNCS["cpu"] = lambda dims, dtype, device, pin_memory, allocator, *a, **k: (
        allocator.allocate(dims, dtype=dtype, device=device)
    )
    for name in ("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.pool_host.mla"):
        mod: Any = importlib.import_module(name)
        mod.transfer_kv_direct = _transfer_kv_direct


class HiRadixLoop:
    """SGLang's ``HiRadixCache`` (L1 + L2, direct I/O backend, tiny MHA KV: 2 layers x 2 heads x 8 dims,
    fp16) over a real allocator of ``device_size`` slots. ``request`` runs one request and then
    ``check_hicache_events`` (the scheduler does so every step), so backups and loads retire."""

    def __init__(
        self, page_size: int, device_size: int, write_policy: str = "write_through_selective"
    ) -> None:
        _hiradix_setup(page_size, write_policy)
        self.ps = page_size
        kv, self.alloc = _pools(page_size, device_size)
        rc = _LOADED["radix_cache"]
        rc.TreeNode.counter = 0
        cip = importlib.import_module("sglang.srt.mem_cache.cache_init_params")
        hr = importlib.import_module("sglang.srt.mem_cache.hiradix_cache")
        import torch.distributed as dist

        params = cip.CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=self.alloc,
            page_size=page_size,
            tp_cache_group=dist.group.WORLD,
            eviction_policy="lru",
        )
        self.cache = hr.HiRadixCache(params, server_args=None)
        self.kv = kv

    def request(self, tokens: tuple[int, ...]) -> bool:
        bpc = _LOADED["base_prefix_cache"]
        c, key = self.cache, _key(tokens)
        m = c.match_prefix(bpc.MatchPrefixParams(key=key))
        last = m.last_device_node
        loaded = m.device_indices[:0]
        if m.host_hit_length > 0:
            c.inc_lock_ref(last)
            new_indices, new_last = c.init_load_back(
                bpc.InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length)
            )
            c.dec_lock_ref(last)
            last, loaded = new_last, new_indices
        c.inc_lock_ref(last)
        prefix = torch.cat((m.device_indices, loaded))
        need = len(tokens) - len(prefix)
        pages = -(-need // self.ps) * self.ps
        if self.alloc.available_size() < pages:
            c.evict(bpc.EvictParams(num_tokens=pages - self.alloc.available_size()))
        new = self.alloc.alloc(pages) if pages else prefix[:0]
        if new is None:
            c.dec_lock_ref(last)
            c.ready_to_load_host_cache()
            c.check_hicache_events()
            return False
        c.ready_to_load_host_cache()
        slots = torch.cat((prefix, new[:need]))
        # the fake forward pass writes the computed tokens' KV (one indexed store per layer, as refcache does)
        for layer in range(self.kv.layer_num):
            self.kv.k_buffer[layer][new[:need]] = 1
            self.kv.v_buffer[layer][new[:need]] = 1
        aligned = len(tokens) - len(tokens) % self.ps
        result = c.insert(bpc.InsertParams(key=_key(tokens[:aligned]), value=slots[:aligned]))
        duplicates = slots[len(prefix) : result.prefix_len]
        if len(duplicates):
            self.alloc.free(duplicates)
        if aligned < len(tokens):  # the unaligned tail's page (the prefix is page-aligned)
            self.alloc.free(new[aligned - len(prefix) :])
        c.dec_lock_ref(last)
        c.check_hicache_events()
        return True

    def close(self) -> None:
        shutdown = getattr(self.cache, "shutdown", None)
        if shutdown is not None:
            shutdown()
