"""``SGLangSystem``: SGLang 0.5.20's own ``HiRadixCache`` and ``HiCacheController`` behind the alphabet.

Construction (one rank, CPU): publish the configuration the way SGLang's tests do
(``get_context().override_server_args(...)``), build SGLang's device pool (``MHATokenToKVPool`` /
``MLATokenToKVPool``), its slot allocator (``TokenToKVPoolAllocator`` for page size 1, else
``PagedTokenToKVPoolAllocator``), a ``ReqToTokenPool`` and ``HiRadixCache(CacheInitParams(...))``, which
builds its own host pool and controller. Then the override is restored: 0.5.20 reads it only while
constructing.

Each scheduler operation is the sequence of SGLang calls the 0.5.20 scheduler makes for that decision (the
table in ``specs/sglang-adapter.md``); the observations SGLang does not return are derived where stated on
each method.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Self

import torch

from refcache.config import AttentionKind, HiCacheConfig
from refcache.engines.sglang import _cpu, _gate, _runtime
from refcache.engines.sglang._snapshot import DeviceRenamer, read_snapshot
from refcache.errors import UnsupportedError, UsageError
from refcache.ops import (
    AbortPrefetch,
    AbortRequest,
    AdvanceClock,
    CacheUnfinishedRequest,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    Done,
    EventsResult,
    Evict,
    EvictHost,
    EvictHostResult,
    EvictResult,
    FinishRequest,
    FinishResult,
    IOQueue,
    IOResult,
    MatchPrefix,
    MatchResult,
    Observation,
    Op,
    PrefetchFromStorage,
    PrefetchResult,
    ProgressResult,
    Reset,
    ResetResult,
    StartRequest,
    StartResult,
    StorageFault,
    check_op,
)
from refcache.snapshot import Snapshot

__all__ = ["MAX_PENDING_LOADS", "TP_SIZES", "SGLangSystem", "host_defaults"]

TP_SIZES = (1, 2)
"""The tensor-parallel sizes the adapter runs: 1 in this process, 2 through ``_tp`` (one process per rank)."""

MAX_PENDING_LOADS = 3
"""``LayerDoneCounter.num_counters`` in 0.5.20: a load back reuses the event slot of the load three before
it and asserts that load has finished (``managers/cache_controller.py:81-86``)."""

_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def host_defaults() -> dict[str, tuple[str, str]]:
    """What this machine needs of a configuration (``refcache.systems.SystemEntry.defaults``): nothing — the
    adapter runs on any CPU. What it cannot run at all, it refuses from the constructor (``unsupported``);
    a command that draws configurations for it must draw ``tp_size`` 1 (2 when chosen) and no storage
    backend."""
    return {}


def unsupported(config: HiCacheConfig) -> str | None:
    """Why the adapter cannot run ``config`` (None: it can). The machines draw only configurations for
    which this is None."""
    if config.tp_size not in TP_SIZES:
        return (
            f"tp_size={config.tp_size}: the SGLang adapter runs tp_size 1 (this process) or 2 (one worker "
            "process per rank in a gloo group, refcache.engines.sglang._tp); more ranks are not tested "
            "(specs/sglang-adapter.md, 'Ranks')"
        )
    if config.enable_storage:
        return (
            f"hicache_storage_backend={config.hicache_storage_backend!r}: L3 is not supported by the SGLang "
            "adapter yet; SGLang 0.5.20's prefetch pipeline differs from refcache's (D-01: host memory "
            "after the hit query, another cap and timeout), and its four storage threads are not gated "
            "(specs/sglang-adapter.md, 'L3'). Use hicache_storage_backend=None"
        )
    if config.hicache_size > 0:
        return (
            "hicache_size > 0: size the host pool with hicache_ratio (0.5.20 sizes it through a collective)"
        )
    return None


class _Request:
    """A running request as SGLang's ``Req`` exposes it to the tree cache (duck type)."""

    def __init__(self, rid: int, tokens: tuple[int, ...], extra_key: str | None, prompt_len: int) -> None:
        self.rid = str(rid)
        self.number = rid
        self.tokens = tokens
        # D-24: the prompt is all tokens unless the operation says otherwise; 0.5.20 re-inserts the prompt
        # prefix in cache_finished_req when it is a proper prefix of the cached key.
        self.origin_input_ids = list(tokens[:prompt_len])
        self.output_ids = list(tokens[prompt_len:])
        self.extra_key = extra_key
        self.cache_salt = None
        self.priority = 0
        self.last_node: Any = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.kv = types.SimpleNamespace(req_pool_idx=0, cache_protected_len=0)

    def get_fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids


class SGLangSystem:
    """SGLang 0.5.20's HiCache on the CPU: ``apply(op) -> Observation``, ``snapshot() -> Snapshot``.

    Raises ``UnsupportedError`` from the constructor for a configuration the adapter cannot run
    (``unsupported``). An exception SGLang raises inside an operation propagates unchanged (the harness
    reports it as a crash of this system).
    """

    def __init__(self, config: HiCacheConfig) -> None:
        cfg = config.resolve()
        why = unsupported(cfg)
        if why is not None:
            raise UnsupportedError(why)
        self.config = cfg
        self.clock_us = 0
        self.clock = _runtime.LogicalTime()
        self.requests: dict[int, _Request] = {}
        self._closed = False
        self._registered: list[torch.Tensor] = []
        with _runtime.LOCK:
            _runtime.ensure_ready()
            self.rank, world = _runtime.rank_and_size()
            if world != cfg.tp_size:
                raise UnsupportedError(
                    f"tp_size={cfg.tp_size}, but this process is in a group of {world}: SGLangSystem drives "
                    "the rank of this process; open tp_size 2 through refcache.engines.sglang.open_system "
                    "(one worker process per rank)"
                )
            _runtime.use_clock(self.clock)
            self._build()

    # --- construction ---------------------------------------------------------------------------------------

    def _build(self) -> None:
        import torch.distributed as dist
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import TreeNode
        from sglang.srt.runtime_context import get_context

        cfg = self.config
        ps = cfg.page_size
        dtype = _DTYPES[cfg.dtype]
        override = get_context().override_server_args(
            hicache_ratio=cfg.hicache_ratio,
            hicache_size=0,
            hicache_mem_layout=cfg.hicache_mem_layout.value,
            hicache_write_policy=cfg.hicache_write_policy.value,
            hicache_io_backend=cfg.hicache_io_backend.value,
            hicache_storage_backend=cfg.hicache_storage_backend,
            hicache_storage_prefetch_policy=cfg.hicache_storage_prefetch_policy.value,
            served_model_name=cfg.model_name,
            page_size=ps,
            enable_hierarchical_cache=True,
            device="cpu",
        )
        override.install()
        try:
            TreeNode.counter = 0
            if cfg.attention is AttentionKind.MHA:
                kv = MHATokenToKVPool(
                    cfg.device_size, ps, dtype, cfg.head_num, cfg.head_dim, cfg.layer_num, "cpu", False
                )
            else:
                kv = MLATokenToKVPool(
                    cfg.device_size,
                    ps,
                    dtype,
                    cfg.kv_lora_rank,
                    cfg.qk_rope_head_dim,
                    cfg.layer_num,
                    "cpu",
                    False,
                )
            if ps == 1:
                allocator = TokenToKVPoolAllocator(cfg.device_size, dtype, "cpu", kv, need_sort=False)
            else:
                allocator = PagedTokenToKVPoolAllocator(
                    cfg.device_size, ps, dtype, "cpu", kv, need_sort=False
                )
            self.req_to_token_pool = ReqToTokenPool(
                size=64, max_context_len=cfg.device_size + 2 * ps, device="cpu", enable_memory_saver=False
            )
            params = CacheInitParams(
                disable=False,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=allocator,
                page_size=ps,
                is_eagle=cfg.is_eagle,
                tp_cache_group=dist.group.WORLD,
                eviction_policy=cfg.radix_eviction_policy.value,
            )
            self.cache = HiRadixCache(params, server_args=None)
        finally:
            override.restore()
        cache = self.cache
        # 0.5.20 fixes the load-back threshold at 10 tokens (hiradix_cache.py:211) with no flag: the adapter
        # sets the attribute to the configured value.
        cache.load_back_threshold = cfg.load_back_threshold
        self.controller = cache.cache_controller
        self.allocator = allocator
        self.host_pool = cache.token_to_kv_pool_host
        # The pools are CPU memory: never the CUDA JIT copies (only reachable where sgl_kernel exists).
        self.host_pool.can_use_jit = False
        self.renamer = DeviceRenamer(cfg.device_size, ps)
        self._wrap_allocator()
        self._register_buffers(kv)

    def _register_buffers(self, kv: Any) -> None:
        host = self.host_pool
        if self.config.attention is AttentionKind.MHA:
            device = [*kv.k_buffer, *kv.v_buffer]
            host_layers = [*host.k_data_refs, *host.v_data_refs]
        else:
            device = list(kv.kv_buffer)
            host_layers = list(host.data_refs)
        self._registered = device + host_layers
        _cpu.register(self._registered)
        _cpu.register_host(host_layers)
        self._host_layers = host_layers

    def _wrap_allocator(self) -> None:
        """Mirror every allocation and free of SGLang's device allocator in the renamer (see ``DeviceRenamer``):
        ``alloc`` for both allocators; frees end in ``free`` (page size 1) or ``_release_page_ids``."""
        allocator, renamer, ps = self.allocator, self.renamer, self.config.page_size
        alloc, clear = allocator.alloc, allocator.clear

        def tracked_alloc(need_size: int) -> Any:
            out = alloc(need_size)
            if out is not None:
                renamer.allocated([int(p) for p in out[::ps].tolist()])
            return out

        def tracked_clear() -> None:
            clear()
            renamer.clear()

        allocator.alloc = tracked_alloc
        allocator.clear = tracked_clear
        if ps == 1:
            free = allocator.free

            def tracked_free(free_index: torch.Tensor) -> None:
                if free_index.numel() and allocator.free_group is None:
                    renamer.freed([int(s) for s in free_index.tolist()])
                free(free_index)

            allocator.free = tracked_free
        else:
            release = allocator._release_page_ids

            def tracked_release(*page_ids: torch.Tensor) -> None:
                for ids in page_ids:
                    renamer.freed([int(p) * ps for p in ids.tolist()])
                release(*page_ids)

            allocator._release_page_ids = tracked_release

    # --- System protocol ------------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the pools' registrations; SGLang holds no thread without L3. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _cpu.unregister(self._registered)
        _cpu.unregister_host(self._host_layers)

    def snapshot(self) -> Snapshot:
        with self._entered():
            return read_snapshot(self)

    @contextmanager
    def _entered(self) -> Iterator[None]:
        with _runtime.LOCK:
            _runtime.use_clock(self.clock)
            yield

    def apply(self, op: Op) -> Observation:
        """Apply one operation. Raises ``UsageError`` (nothing changed) for an invalid one."""
        if self._closed:
            raise UsageError("the SGLang system is closed")
        check_op(
            op,
            tp_size=self.config.tp_size,
            is_eagle=self.config.is_eagle,
            running=self.requests,
            prefetching={int(rid) for rid in self.cache.ongoing_prefetch},
        )
        with self._entered():
            return self._apply(op)

    def _apply(self, op: Op) -> Observation:
        match op:
            case MatchPrefix(tokens, extra_key):
                return self._match(tokens, extra_key)
            case StartRequest(rid, tokens, extra_key):
                return self._start(rid, tokens, extra_key, op.prompt_len)
            case CacheUnfinishedRequest(rid):
                self.cache.cache_unfinished_req(self.requests[rid], chunked=True)
                return Done()
            case FinishRequest(rid):
                return self._finish(rid)
            case AbortRequest(rid):
                self._abort(rid)
                return Done()
            case Evict(num_tokens):
                return EvictResult(self._evict(num_tokens))
            case EvictHost(num_tokens):
                return EvictHostResult(self._evict_host(num_tokens))
            case PrefetchFromStorage(rid, tokens, extra_key):
                return self._prefetch(tokens, extra_key)
            case CheckPrefetchProgress(rid):
                return ProgressResult(done=True, inserted=0)  # no L3: nothing is ever prefetching
            case AbortPrefetch(rid):
                return Done()
            case CheckHicacheEvents():
                return self._check_events()
            case Reset():
                return ResetResult(self._reset())
            case CompleteIO(queue, _rank, count):
                return IOResult(self._complete(queue, count))
            case AdvanceClock(us):
                self.clock_us += us  # only prefetch timeouts read it, and there is no L3
                return Done()
            case StorageFault():
                return Done()  # no L3 objects to damage (the model's faults find an empty view too)

    # --- helpers --------------------------------------------------------------------------------------------

    def _key(self, tokens: tuple[int, ...], extra_key: str | None) -> Any:
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(list(tokens), extra_key=extra_key)

    def _match_result(self, tokens: tuple[int, ...], extra_key: str | None) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        return self.cache.match_prefix(MatchPrefixParams(key=self._key(tokens, extra_key)))

    def depth(self, node: Any) -> int:
        """Key elements from the root to the end of ``node``."""
        n = 0
        while node.parent is not None:
            n += len(node.key)
            node = node.parent
        return n

    # --- scheduler operations -------------------------------------------------------------------------------

    def _match(self, tokens: tuple[int, ...], extra_key: str | None) -> MatchResult:
        """``match_prefix``. ``last_node_depth`` is where the match ends (the deepest matched node: the last
        host node when there is a host hit, else the last device node), ``last_host_node_depth`` that of
        ``last_host_node``."""
        m = self._match_result(tokens, extra_key)
        deepest = m.last_host_node if m.host_hit_length > 0 else m.last_device_node
        return MatchResult(
            len(m.device_indices), m.host_hit_length, self.depth(deepest), self.depth(m.last_host_node)
        )

    def _start(
        self, rid: int, tokens: tuple[int, ...], extra_key: str | None, prompt_len: int | None
    ) -> StartResult:
        """Admission, as ``PrefillAdder.add_one_req`` and ``prepare_for_extend`` call the tree:
        ``match_prefix``; with a host hit, a temporary ``inc_lock_ref`` of the last device node around
        ``init_load_back``; ``inc_lock_ref`` of the node it returns; ``evict_from_tree_cache`` of the
        shortfall and ``alloc`` of whole pages; the request's slots into ``req_to_token``; then
        ``ready_to_load_host_cache`` (``start_loading``), which puts the queued load on the load stream.
        When the pool cannot hold the request it is not admitted: the lock is released (the load, if
        any, still runs, as it was initiated)."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        cache, cfg = self.cache, self.config
        if _gate.pending(self.controller.ack_load_queue) >= MAX_PENDING_LOADS:
            raise UnsupportedError(
                f"{MAX_PENDING_LOADS} load backs are still in flight: SGLang 0.5.20 reuses the load event of "
                "the load three before (LayerDoneCounter) and asserts it finished. The scheduler's forward "
                "pass waits for each load before the next batches; complete a load (CompleteIO(LOAD)) first"
            )
        m = self._match_result(tokens, extra_key)
        device_hit = len(m.device_indices)
        prefix = m.device_indices
        last_node = m.last_device_node
        loaded = torch.empty(0, dtype=torch.int64)
        if m.host_hit_length > 0:
            cache.inc_lock_ref(last_node)
            new_indices, new_last = cache.init_load_back(
                InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length)
            )
            cache.dec_lock_ref(last_node)
            last_node, loaded = new_last, new_indices
            prefix = torch.cat([prefix, loaded])
        cache.inc_lock_ref(last_node)
        need = len(tokens) - len(prefix)
        pages = -(-need // cfg.page_size) * cfg.page_size
        new: Any = torch.empty(0, dtype=torch.int64)
        if pages:
            evict_from_tree_cache(cache, pages)
            new = self.allocator.alloc(pages)
        if new is None:
            cache.dec_lock_ref(last_node)
            cache.ready_to_load_host_cache()
            return StartResult(False, device_hit, len(loaded), 0)
        request = _Request(rid, tokens, extra_key, len(tokens) if prompt_len is None else prompt_len)
        (row,) = self.req_to_token_pool.alloc_rows(1)
        slots = torch.cat([prefix, new[:need]])
        self.req_to_token_pool.req_to_token[row, : len(slots)] = slots.to(torch.int32)
        request.kv.req_pool_idx = row
        request.kv.cache_protected_len = len(prefix)
        request.prefix_indices = prefix
        request.last_node = last_node
        self.requests[rid] = request
        cache.ready_to_load_host_cache()
        return StartResult(True, device_hit, len(loaded), need)

    def _free_row(self, request: _Request) -> None:
        self.req_to_token_pool.free_rows([request.kv.req_pool_idx])

    def _finish(self, rid: int) -> FinishResult:
        """``cache_finished_req(req, kv_len_to_handle=len(tokens))``. ``prefix_len`` is what its first
        ``insert`` returned (observed by wrapping ``insert`` for the call); ``freed`` counts the duplicate
        slots ``[protected_len, prefix_len)`` plus the unaligned tail ``[key_len, len(tokens))``, the two
        segments that call frees (in tokens, as the model counts them; the allocator frees whole pages)."""
        request = self.requests.pop(rid)
        cache = self.cache
        seen: list[int] = []
        insert: Callable[[Any], Any] = cache.insert

        def spy(params: Any) -> Any:
            result = insert(params)
            seen.append(int(result.prefix_len))
            return result

        cache.insert = spy
        try:
            cache.cache_finished_req(request, kv_len_to_handle=len(request.tokens))
        finally:
            del cache.insert
        self._free_row(request)
        prefix_len = seen[0] if seen else 0
        key_len = self._key_len(request.tokens)
        freed = max(0, prefix_len - request.kv.cache_protected_len) + len(request.tokens) - key_len
        return FinishResult(prefix_len, freed)

    def _key_len(self, tokens: tuple[int, ...]) -> int:
        n = len(tokens) - (1 if self.config.is_eagle else 0)
        return n - n % self.config.page_size

    def _abort(self, rid: int) -> None:
        """``release_kv_cache(req, tree_cache, is_insert=False)`` = ``cache_finished_req(is_insert=False)``:
        frees every slot after the protected prefix and unlocks."""
        request = self.requests.pop(rid)
        with self.renamer.batch():
            self.cache.cache_finished_req(request, is_insert=False, kv_len_to_handle=len(request.tokens))
        self._free_row(request)

    def _evict(self, num_tokens: int) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        return int(self.cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted)

    def _evict_host(self, num_tokens: int) -> int:
        """``evict_host`` returns None in 0.5.20 (D-21): the tokens freed are the host pool's
        ``available_size`` delta (host slots are freed at once, into ``release_slots``)."""
        before = int(self.host_pool.available_size())
        self.cache.evict_host(num_tokens)
        return int(self.host_pool.available_size()) - before

    def _prefetch(self, tokens: tuple[int, ...], extra_key: str | None) -> PrefetchResult:
        """The operation's match (``PrefetchFromStorage`` is ``_prefetch_kvcache``: match, then prefetch);
        without L3 nothing is prefetched. ``tokens`` is the page-aligned tail after the matched part."""
        m = self._match_result(tokens, extra_key)
        key_len = self._key_len(tokens)
        tail = key_len - len(m.device_indices) - m.host_hit_length
        return PrefetchResult(False, "storage_disabled", tail - tail % self.config.page_size)

    def _check_events(self) -> EventsResult:
        """``check_hicache_events``: the acks it retired are the length deltas of ``ack_write_queue`` and
        ``ack_load_queue`` (it returns None)."""
        cc = self.controller
        writes, loads = len(cc.ack_write_queue), len(cc.ack_load_queue)
        self.cache.check_hicache_events()
        return EventsResult(
            writes=writes - len(cc.ack_write_queue),
            loads=loads - len(cc.ack_load_queue),
            revoked=0,
            backups=0,
            host_releases=0,
        )

    def busy(self) -> bool:
        """Refcache's "idle and drained" test (D-16) on SGLang's state."""
        cache, cc = self.cache, self.controller
        return bool(
            self.requests
            or cache.ongoing_write_through
            or cache.ongoing_load_back
            or cache.ongoing_prefetch
            or cache.ongoing_backup
            or cc.ack_write_queue
            or cc.ack_load_queue
            or cc.write_queue
            or cc.load_queue
        )

    def _reset(self) -> bool:
        """``flush_cache``: refused unless idle and drained (D-16); then ``reset()`` and, as the scheduler's
        ``flush_cache`` does, the request and token pools (``reset`` leaves the device allocator alone)."""
        if self.busy():
            return False
        self.cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()
        return True

    def _complete(self, queue: IOQueue, count: int) -> int:
        """``CompleteIO``: WRITE and LOAD fire the events of the oldest unfinished acks (``_gate``); the
        storage queues have no work without L3."""
        if queue is IOQueue.WRITE:
            return _gate.complete(self.controller.ack_write_queue, count)
        if queue is IOQueue.LOAD:
            return _gate.complete(self.controller.ack_load_queue, count)
        return 0
