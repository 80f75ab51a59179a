"""``UnifiedSGLangSystem``: SGLang 0.5.23's own ``UnifiedRadixCache`` and ``HybridCacheController`` behind the
alphabet (L1 + L2, one rank, CPU); also 0.5.21 and 0.5.22, and 0.5.19 and 0.5.20, whose schedulers build
``UnifiedRadixCache`` for HiCache too, through ``_compat``'s rows up to 0.5.21 (system ``sglang-unified``).

0.5.23 replaced ``HiRadixCache`` by ``UnifiedRadixCache`` (``mem_cache/unified_radix_cache.py``): a tree core
(``UnifiedTreeCore``, nodes addressed by ``NodeId``, per-component data, LRU lists instead of eviction heaps)
driven by a cache that applies the core's actions, a ``HybridCacheController`` over a host pool group, and
request locks as ``TreeLock`` receipts. ``cache_finished_req`` / ``cache_unfinished_req`` are gone: the
scheduler calls ``release_kv_cache(req, tree_cache, checkpoint=...)`` and ``checkpoint_kv_cache(req,
tree_cache)`` (``mem_cache/common.py``), which call the cache's ``checkpoint`` / ``free_kv_row`` / ``unlock`` /
``on_release``.

Shared with the 0.5.20 adapter (``_adapter.SGLangSystem``, which this class extends): the import shim
(``_shim``), the CPU transfer functions (``_cpu``), the gated device streams (``_gate``), the host allocation
without ``cudaHostRegister`` and the gloo group (``_runtime``), the device slot renaming and the operation
dispatch. What differs is here: the module globals to patch (``ensure_ready``), construction, the scheduler's
call order per operation, and the snapshot (``read_snapshot``). 0.5.23 stamps nodes with its own logical
counter (``get_and_increase_time_counter``), so no clock is patched. Citations are ``file:line`` in the 0.5.23
wheel (``site-packages/sglang/srt/...``); ``specs/sglang-adapter.md`` ("Newer releases") lists what changed.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from refcache.config import HiCacheConfig
from refcache.engines.sglang import _adapter, _compat, _cpu, _gate, _runtime, _storage, versions
from refcache.engines.sglang._snapshot import (
    DeviceRenamer,
    host_free_slots,
    pending_backup_reads,
    prefetch_state,
    request_records,
)
from refcache.errors import UnsupportedError
from refcache.hashing import Token, page_hashes, storage_namespace_seed
from refcache.hicache.ops import (
    CacheUnfinishedRequest,
    Done,
    FinishResult,
    Observation,
    Op,
    PrefetchResult,
    StartResult,
)
from refcache.hicache.snapshot import InFlight, NodeId, NodeRecord, PoolRecord, RankSnapshot, Snapshot
from refcache.hicache.states import NodeState

__all__ = ["VERSION", "UnifiedSGLangSystem", "ensure_ready", "unsupported"]

VERSION = "0.5.23"
"""The release this adapter is written against (``constraints/sglang-0.5.23.txt``); ``versions.RELEASES`` says
every release it drives."""

_ready = False


def ensure_ready() -> None:
    """Import SGLang 0.5.23 (through the shim), patch the module globals it resolves at import time — the same
    injection points as 0.5.20 (``device_module`` of the controller and the L2 transfer engine, the
    ``transfer_kv_*`` names of the host pools, ``ALLOC_MEMORY_FUNCS["cpu"]``, and for L3 the controller's
    ``Queue`` and the native page hash) — and start the gloo group."""
    global _ready
    with _runtime.LOCK:
        if _ready:
            return
        from refcache.engines.sglang import _shim

        _shim.install()
        import logging

        logging.getLogger("sglang").setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import sglang.srt.managers.cache_controller as cache_controller
            import sglang.srt.mem_cache.l2_transfer as l2_transfer
            import sglang.srt.mem_cache.pool_host.common as host_common
            import sglang.srt.mem_cache.pool_host.mha as host_mha
            import sglang.srt.mem_cache.pool_host.mla as host_mla
            import sglang.srt.mem_cache.unified_radix_cache  # noqa: F401 - the class under test
        cache_controller.device_module = _gate.FAKE_DEVICE_MODULE
        # L3 (as _runtime.ensure_ready for HiRadixCache): the storage threads' queues wait on the gate of the
        # controller built inside _storage.building, and the page hashes (L3 keys) are _runtime._PageHash's
        cache_controller.Queue = _storage.GatedQueue
        native_hash = _compat.Compat(versions.installed().rows).module("native_hash")
        if native_hash is not None:
            hashing: Any = importlib.import_module(native_hash)
            hashing._load_native_hash_module = lambda: _runtime._PageHash
        l2_transfer.device_module = _gate.FAKE_DEVICE_MODULE
        l2_transfer._timing_events_supported.cache_clear()
        host_common.ALLOC_MEMORY_FUNCS["cpu"] = _runtime._alloc_host_memory
        _cpu.install([host_mha, host_mla])
        _runtime._init_process_group()
        _ready = True


def unsupported(config: HiCacheConfig) -> str | None:
    """Why this adapter cannot run ``config`` (None: it can): the 0.5.20 adapter's limits (tp_size 1 in this
    process or 2 through the worker processes of ``_tp``, L3 on HiCacheFile only, the host pool sized by ratio).
    On which releases it opens two ranks and L3, the release table says (``Release.ranks_on``, ``l3_on``, checked
    by ``versions.check_installed``)."""
    return _adapter.unsupported(config)


class _Request(_adapter._Request):
    """A running request as 0.5.23's ``release_kv_cache`` / ``checkpoint`` read it (duck type of ``Req``; the
    KV record is SGLang's own ``ReqKvInfo``)."""

    def __init__(self, rid: int, tokens: tuple[int, ...], extra_key: str | None, prompt_len: int) -> None:
        from sglang.srt.managers.schedule_batch import ReqKvInfo

        super().__init__(rid, tokens, extra_key, prompt_len)
        self.kv = ReqKvInfo()
        self.full_untruncated_fill_ids = list(tokens)
        self.session_id = None
        self.session = None
        self.kv_rotation_base = None
        self.lock: Any = None
        self.lock_receipt: Any = (
            None  # up to 0.5.21 (_compat "lock_by_node_id"): the receipt of req.last_node
        )
        self.swa_prefix_lock_released = False  # up to 0.5.21: read by cache_finished_req (0.5.21: unpin)
        # 0.5.19 (_compat "request_lock_fields"): the release rebuilds the receipt from these (no SWA component)
        self.swa_uuid_for_lock: int | None = None
        self.skip_lock_node_ids: dict[Any, set[int]] = {}
        self.last_host_node: Any = None
        self.best_match_node: Any = None
        self.host_hit_length = 0
        self.swa_host_hit_length = 0
        self.mamba_host_hit_length = 0
        self.auxiliary_swa_host_hit_length = 0
        self.skip_radix_cache_insert = False
        self.finished_reason: Any = None
        self.finished_len = None
        self.reasoning_tokens = 0
        self.prefix_len = 0
        self.extend_end = len(tokens)
        self.multimodal_inputs = None
        self.is_retracted = False

    def finished(self) -> bool:
        return self.finished_reason is not None

    def owned_kv_len(self) -> int:
        return int(self.kv.kv_committed_len)

    def effective_kv_committed_len(self) -> int:
        """Up to 0.5.21 (``release_kv_cache``): the committed tokens; no speculative tail here."""
        return int(self.kv.kv_committed_len)

    def refresh_fill_ids(self) -> None:
        self.full_untruncated_fill_ids = self.origin_input_ids + self.output_ids


class UnifiedSGLangSystem(_adapter.SGLangSystem):
    """SGLang 0.5.23's HiCache (``UnifiedRadixCache``) on the CPU: ``apply(op) -> Observation``,
    ``snapshot() -> Snapshot``. Same contract as ``SGLangSystem``."""

    SYSTEM: ClassVar[str] = "sglang-unified"
    _REVOKE: ClassVar[str] = "revoke_pending_prefetch"  # public here, and keyed by the request handle
    _TIMEOUT: ClassVar[str | None] = None  # the modules' ``time`` reads the logical clock (``_entered``)
    host_duplicate_reclaim: bool = False  # whether evict_host reclaims host duplicates (set at _build, D-48)

    # --- construction: the base's __init__ with this release's check, imports and build ---------------------

    @staticmethod
    def _why_unsupported(config: HiCacheConfig) -> str | None:
        return unsupported(config)

    @staticmethod
    def _ready() -> None:
        ensure_ready()

    @contextmanager
    def _entered(self) -> Iterator[None]:
        """0.5.23 reads the published configuration at run time too (``get_spec()``, ``get_serving()`` in
        ``release_kv_cache``): every call runs with this system's configuration published (captured at
        construction, ``snapshot_context`` / ``restore_context``) and puts the previous one back."""
        from sglang.srt.runtime_context import restore_context, snapshot_context

        with _runtime.LOCK:
            previous = snapshot_context()
            restore_context(self._context)
            if self.gate is not None:
                _use_clock(self.clock, self.compat)
                _runtime.use_batch_size(self.config.storage_batch_size)
            try:
                yield
            finally:
                restore_context(previous)

    def _build(self) -> None:
        import torch.distributed as dist
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.runtime_context import get_context, snapshot_context

        cfg = self.config
        ps = cfg.page_size
        extra = self._open_storage()
        if self.gate is not None:
            _use_clock(self.clock, self.compat)
        override = get_context().override_server_args(
            hicache_ratio=cfg.hicache_ratio,
            hicache_size=0,
            hicache_mem_layout=cfg.hicache_mem_layout.value,
            hicache_write_policy=cfg.hicache_write_policy.value,
            hicache_io_backend=cfg.hicache_io_backend.value,
            hicache_storage_backend=cfg.hicache_storage_backend,
            hicache_storage_prefetch_policy=cfg.hicache_storage_prefetch_policy.value,
            hicache_storage_backend_extra_config=json.dumps(extra) if extra else None,
            served_model_name=cfg.model_name,
            page_size=ps,
            enable_hierarchical_cache=True,
            device="cpu",
        )
        published = override.install()
        try:
            kv, allocator, self.req_to_token_pool = _adapter.device_pools(cfg, self.compat)
            # As registry.create_unified_radix_cache builds it for a plain KV model: one FULL component, then
            # init_hicache. The Python tree core: the Rust one needs a toolchain (tree_core_registry.py).
            backend = {} if self.compat.has("tree_core_backend_from_env") else {"tree_core_backend": "python"}
            params = CacheInitParams(
                disable=False,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=allocator,
                page_size=ps,
                is_eagle=cfg.is_eagle,
                tp_cache_group=dist.group.WORLD,
                eviction_policy=cfg.radix_eviction_policy.value,
                tree_components=(ComponentType.FULL,),
                **backend,
            )
            self.cache = UnifiedRadixCache(params)
            with self._building_storage():  # the controller and its storage threads are built here
                self.cache.init_hicache(published, params)  # 0.5.22 reads file_storage_path there
            self._context = snapshot_context()
            # drive_host_eviction reclaims host duplicates first under write_back unless the variable is set
            if cfg.hicache_write_policy.value == "write_back" and self.compat.has(
                "host_duplicate_reclaim_always"
            ):
                self.host_duplicate_reclaim = True
            elif cfg.hicache_write_policy.value == "write_back":
                from sglang.srt.environ import envs

                self.host_duplicate_reclaim = not envs.SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM.get()
        finally:
            override.restore()
        cache = self.cache
        # 0.5.23 still fixes the load-back threshold at 10 tokens (unified_radix_cache.py:574).
        cache.load_back_threshold = cfg.load_back_threshold
        self.tree = cache.tree_core
        self.controller = cache.cache_controller
        self.allocator = allocator
        self.host_pool = self.controller.mem_pool_host.anchor_entry.host_pool
        self.host_pool.can_use_jit = False
        self.host_pool.pin_memory = False  # the storage path's staging pages (as the 0.5.20 adapter)
        self.renamer = DeviceRenamer(cfg.device_size, ps)
        self._wrap_allocator()
        self._register_buffers(kv)
        if self.gate is not None:
            self._gate_storage(self.gate)

    # --- helpers --------------------------------------------------------------------------------------------

    def _match_result(self, tokens: tuple[int, ...], extra_key: str | None, req: Any = None) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        return self.cache.match_prefix(MatchPrefixParams(key=self._key(tokens, extra_key), req=req))

    def node(self, node_id: Any) -> Any:
        return self.tree.node_by_id(node_id)

    def depth(self, node: Any) -> int:
        """Key elements from the root to the end of ``node`` (a ``NodeId`` or a node)."""
        if not hasattr(node, "parent"):
            node = self.node(node)
        return super().depth(node)

    def _live_prefetch_ops(self) -> list[Any]:
        return [entry.operation for entry in self.cache.ongoing_prefetch.values()]

    def _prefetching(self) -> set[int]:
        """The rids with an ``ongoing_prefetch`` entry (keyed by ``CacheRequestHandle``; up to 0.5.19 the rid
        string, ``_compat`` "plain_request_ids")."""
        return {int(getattr(handle, "rid", handle)) for handle in self.cache.ongoing_prefetch}

    def _match(self, tokens: tuple[int, ...], extra_key: str | None) -> Any:
        from refcache.hicache.ops import MatchResult

        m = self._match_result(tokens, extra_key)
        deepest = m.last_host_node if m.host_hit_length > 0 else m.last_device_node
        return MatchResult(
            self._device_len(m), m.host_hit_length, self.depth(deepest), self.depth(m.last_host_node)
        )

    def _device_len(self, m: Any) -> int:
        """The device-resident matched length of a ``MatchResult`` (``_compat`` "match_device_indices")."""
        return len(m.device_indices) if self.compat.has("match_device_indices") else int(m.device_prefix_len)

    def _lock(self, node: Any) -> Any:
        """A lock of ``node``: a ``TreeLock``, or up to 0.5.21 the receipt ``inc_lock_ref`` returns."""
        if self.compat.has("lock_by_node_id"):
            return self.cache.inc_lock_ref(node).to_dec_params()
        return self.cache.lock(node)

    def _unlock(self, node: Any, lock: Any) -> None:
        """Releases what ``_lock(node)`` returned."""
        if self.compat.has("lock_by_node_id"):
            self.cache.dec_lock_ref(node, lock)
        else:
            self.cache.unlock(lock)

    def _flush_backups(self) -> None:
        """The batch's ``flush_pending_backups`` (after ``process_batch_result``, ``scheduler.py:5106``); up to
        0.5.20 an insert starts its backups itself."""
        if not self.compat.has("backups_unbatched"):
            self.cache.flush_pending_backups()

    # --- scheduler operations -------------------------------------------------------------------------------

    def _apply(self, op: Op) -> Observation:
        if isinstance(op, CacheUnfinishedRequest):
            self._unfinished(op.rid)
            return Done()
        return super()._apply(op)

    def _start(
        self, rid: int, tokens: tuple[int, ...], extra_key: str | None, prompt_len: int | None
    ) -> StartResult:
        """Admission, as ``match_kv_cache``, ``PrefillAdder.add_one_req`` (``schedule_policy.py:1430-1530``),
        ``_commit_prefill_admission`` and ``prepare_for_extend`` call the cache: ``match_prefix`` (with the
        request); under a temporary ``lock`` of the last device node, with a host hit: a host lock and a lock
        of ``best_match_node`` around ``init_load_back``; ``req.lock = lock(last_node)``;
        ``evict_from_tree_cache`` (``evict_for_alloc``) and ``alloc``; the row; ``ready_to_load_host_cache``.
        Refused (``UnsupportedError``) while ``has_free_load_back_slot()`` is False: the scheduler does not
        admit a load back then (``unified_radix_cache.py:3733``)."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        cache, cfg = self.cache, self.config
        request = _Request(rid, tokens, extra_key, len(tokens) if prompt_len is None else prompt_len)
        m = self._match_result(tokens, extra_key, request)
        request.last_node, request.last_host_node = m.last_device_node, m.last_host_node
        request.best_match_node, request.host_hit_length = m.best_match_node, m.host_hit_length
        request.prefix_len = device_hit = self._device_len(m)
        if self.compat.has("no_load_back_slot_query"):
            free_slot = _gate.pending(self.controller.ack_load_queue) < _adapter.MAX_PENDING_LOADS
        else:
            free_slot = cache.has_free_load_back_slot()
        if m.host_hit_length > 0 and not free_slot:
            raise UnsupportedError(
                "no free load-back slot (len(ack_load_queue) >= LayerDoneCounter.num_counters): SGLang's "
                "scheduler admits no load back then; complete a load (CompleteIO(LOAD)) and check events first"
            )
        loaded_len = 0
        loaded_slots: Any = None
        outer = self._lock(request.last_node)
        try:
            if m.host_hit_length > 0:
                pinned = not self.compat.has("load_back_under_device_lock")
                host_lock: Any = None
                inner: Any = None
                if pinned:
                    host_lock = cache.inc_host_lock_ref(request.best_match_node).to_dec_params()
                    inner = self._lock(request.best_match_node)
                try:
                    loaded = cache.init_load_back(
                        InitLoadBackParams(
                            best_match_node=request.best_match_node,
                            host_hit_length=m.host_hit_length,
                            req=request,
                        )
                    )
                finally:
                    if pinned:
                        self._unlock(request.best_match_node, inner)
                        cache.dec_host_lock_ref(request.best_match_node, host_lock)
                assert loaded is not None  # None only in buffer_only host memory mode
                # up to 0.5.21 the loaded slots, later their number (_compat "match_device_indices")
                loaded_slots, request.last_node = loaded
                loaded_len = (
                    len(loaded_slots) if self.compat.has("match_device_indices") else int(loaded_slots)
                )
        finally:
            self._unlock(m.last_device_node, outer)
        request.lock = request.lock_receipt = self._lock(request.last_node)
        if self.compat.has("match_device_indices"):
            prefix = torch.cat([m.device_indices, loaded_slots]) if loaded_len else m.device_indices
        else:
            prefix = cache.path_device_indices(request.last_node)
        need = len(tokens) - len(prefix)
        pages = -(-need // cfg.page_size) * cfg.page_size
        new: Any = torch.empty(0, dtype=torch.int64)
        if pages:
            evict_from_tree_cache(cache, pages)
            new = self.allocator.alloc(pages)
        if new is None:
            self._unlock(request.last_node, request.lock)
            cache.ready_to_load_host_cache()
            return StartResult(False, device_hit, loaded_len, 0)
        (row,) = self.req_to_token_pool.alloc_rows(1)
        slots = torch.cat([prefix, new[:need]])
        self.req_to_token_pool.req_to_token[row, : len(slots)] = slots.to(torch.int32)
        request.kv.req_pool_idx = row
        request.kv.cache_protected_len = len(prefix)
        request.kv.kv_committed_len = len(tokens)
        request.kv.kv_allocated_len = len(tokens)
        request.prefix_indices = prefix
        self.requests[rid] = request
        cache.ready_to_load_host_cache()
        if self._prefetch_waits() is not None:
            # 0.5.23's admission accounting (_account_prefill_cache_admission) closes the request's prefetch
            # wait (D-55); no L3 hit is credited here, so no metric reason
            cache.finish_storage_prefetch_admission(self._handle(rid), fulfilled_tokens=0, reason=None)
        return StartResult(True, device_hit, loaded_len, need)

    def _prefetch(self, rid: int, tokens: tuple[int, ...], extra_key: str | None) -> PrefetchResult:
        """The scheduler's ``_prefetch_kvcache`` (``scheduler.py`` 0.5.20:3080): match; then, the anchor
        ``last_host_node`` being backed up or the root (else refused: ``last_node_not_backuped``, D-13),
        ``prefetch_from_storage(handle, last_host_node,
        tokens[matched:], get_last_hash_value(last_host_node), None, matched_prefix_tokens=tokens[:matched],
        extra_key=...)``. It returns nothing: admitted is an ``ongoing_prefetch`` entry afterwards, the reason the
        first of its refusal tests that held before the call (no storage, page-aligned length below
        ``prefetch_threshold``, ``prefetch_rate_limited``). The whole sequence is the key, as for the 0.5.20
        adapter (D-24's prompt is the operation's)."""
        cache, cfg = self.cache, self.config
        m = self._match_result(tokens, extra_key)
        matched = self._device_len(m) + m.host_hit_length
        tail = max(0, self._key_len(tokens) - matched)
        tail -= tail % cfg.page_size
        if not cfg.enable_storage:
            return PrefetchResult(False, "storage_disabled", tail)
        anchor = m.last_host_node
        if not (cache.is_backuped(anchor) or cache.is_root(anchor)):
            # the scheduler does not call prefetch_from_storage: the anchor is the best match (D-46), which may be
            # device-only, and this is the seed's test (D-13; HiRadixCache's last_host_node always passes it)
            return PrefetchResult(False, "last_node_not_backuped", tail)
        handle = self._handle(rid)
        waits = self._prefetch_waits()
        wait = None if waits is None else waits.get(handle)
        expired = wait is not None and wait.expired  # 0.5.23 declines it before its other tests (D-55)
        below = tail < cache.prefetch_threshold
        limited = not below and self.controller.prefetch_rate_limited()
        cache.prefetch_from_storage(
            handle,
            anchor,
            list(tokens[matched:]),
            cache.get_last_hash_value(anchor),
            None,
            matched_prefix_tokens=list(tokens[:matched]),
            extra_key=extra_key,
        )
        if handle in cache.ongoing_prefetch:
            return PrefetchResult(True, "admitted", tail)
        reason = (
            "deadline_expired"
            if expired
            else "below_threshold"
            if below
            else "rate_limited"
            if limited
            else "?"
        )
        return PrefetchResult(False, reason, tail)

    def _prefetch_waits(self) -> dict[Any, Any] | None:
        """0.5.23's ``_storage_prefetch_wait`` (request handle -> ``_StoragePrefetchWait``: the ``timeout`` budget
        from the first blocked progress check, D-55); None up to 0.5.22, whose timeout runs from the prefetch's
        start (``_compat`` "prefetch_timeout_from_start") or without L3."""
        if not self.config.enable_storage or self.compat.has("prefetch_timeout_from_start"):
            return None
        return dict(self.cache._storage_prefetch_wait)

    def _free_row(self, request: _adapter._Request) -> None:
        """``release_kv_cache`` frees the row itself (``req_to_token_pool.free(req)``)."""

    def _finish(self, rid: int) -> FinishResult:
        """``release_kv_cache(req, tree_cache, checkpoint=True)`` (a finished request,
        ``batch_result_processor.py:129``): ``checkpoint`` inserts ``[protected, len)`` (and re-inserts the
        prompt prefix, D-24), ``free_kv_row`` frees the tail, ``unlock``, ``on_release``. ``prefix_len`` is
        what its first ``insert`` returned; ``freed`` as the 0.5.20 adapter counts it."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.common import release_kv_cache

        request = self.requests.pop(rid)
        assert isinstance(request, _Request)
        request.finished_reason = FINISH_LENGTH(length=len(request.output_ids))
        protected = int(request.kv.cache_protected_len)
        seen = self._spy_insert()
        try:
            release_kv_cache(request, self.cache, **self._release_insert(True))
        finally:
            del self.cache.insert
        self._flush_backups()
        prefix_len = seen[0] if seen else 0
        key_len = self._key_len(request.tokens)
        freed = max(0, prefix_len - protected) + len(request.tokens) - key_len
        return FinishResult(prefix_len, freed)

    def _release_insert(self, insert: bool) -> dict[str, bool]:
        """``release_kv_cache``'s keyword: ``checkpoint=`` (up to 0.5.21 ``is_insert=``, _compat "cache_req_calls")."""
        return {"is_insert" if self.compat.has("cache_req_calls") else "checkpoint": insert}

    def _spy_insert(self) -> list[int]:
        cache = self.cache
        seen: list[int] = []
        insert: Callable[[Any], Any] = cache.insert

        def spy(params: Any) -> Any:
            # 0.5.23's prefix_len also counts evicted nodes the insert re-filled from the request's slots
            # (adopted, not freed; unified_tree_core.py:1299-1310); 0.5.20 and refcache count only what was
            # already on the device. The adopted ranges are asked for and subtracted.
            params.track_adopted_ranges = True
            result = insert(params)
            # The new leaf is adopted too, after prefix_len (unified_tree_core.py:1390): only ranges inside count.
            matched = int(result.prefix_len)
            ranges = [r for rs in (result.adopted_ranges or {}).values() for r in rs]
            seen.append(matched - sum(min(end, matched) - start for start, end in ranges if start < matched))
            return result

        cache.insert = spy
        return seen

    def _unfinished(self, rid: int) -> None:
        """``checkpoint_kv_cache(req, tree_cache)``: ``checkpoint(req, up_to=extend_end)``, then the batch's
        ``flush_pending_backups``."""
        if self.compat.has("cache_req_calls"):
            self.cache.cache_unfinished_req(self.requests[rid], chunked=True)
        else:
            from sglang.srt.mem_cache.common import checkpoint_kv_cache

            checkpoint_kv_cache(self.requests[rid], self.cache)
        self._flush_backups()

    def _abort(self, rid: int) -> None:
        """``release_kv_cache(req, tree_cache, checkpoint=False)`` (``scheduler.py:3819``)."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT
        from sglang.srt.mem_cache.common import release_kv_cache

        request = self.requests.pop(rid)
        assert isinstance(request, _Request)
        request.finished_reason = FINISH_ABORT("aborted")
        with self.renamer.batch():
            release_kv_cache(request, self.cache, **self._release_insert(False))

    def _evict_host(self, num_tokens: int) -> int:
        """``evict_host`` returns the tokens it freed in 0.5.23 (D-21 no longer applies)."""
        return int(self.cache.evict_host(num_tokens))

    def _reset(self) -> bool:
        """``flush_cache``, as the 0.5.20 adapter's (``reset`` restarts the storage threads there too)."""
        if self.gate is not None:
            return super()._reset()
        if self.busy():
            return False
        self.cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()
        return True

    def snapshot(self) -> Snapshot:
        with self._entered():
            return read_snapshot(self)


def _use_clock(clock: _runtime.LogicalTime, compat: _compat.Compat) -> None:
    """With L3: the ``time`` of the modules that stamp and test a prefetch's start (``PrefetchOperation``
    in ``cache_controller`` and ``hybrid_cache_controller``, ``_prefetch_timeout_check_linear_func`` in
    ``unified_radix_cache``, 0.5.19..0.5.22) reads the logical clock in seconds; from 0.5.23 the ``timeout`` policy
    times its wait with a ``PollTimer`` (``utils/poll_timer``, ``time.perf_counter``), whose ``time`` reads it too
    (D-55; ``_compat`` "prefetch_timeout_from_start"). The tree core stamps its nodes with its own counter, so
    nothing else reads it."""
    import sglang.srt.managers.cache_controller as cache_controller
    import sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller as hybrid_cache_controller
    import sglang.srt.mem_cache.unified_radix_cache as unified_radix_cache

    seconds = _runtime.ClockSeconds(clock)
    for module in (cache_controller, hybrid_cache_controller, unified_radix_cache):
        module.time = seconds
    if not compat.has("prefetch_timeout_from_start"):
        poll_timer: Any = importlib.import_module("sglang.srt.utils.poll_timer")
        poll_timer.time = _runtime.PerfClockSeconds(clock)


def _state(node: Any) -> NodeState:
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    data = node.component_data[ComponentType.FULL]
    if data.value is not None:
        return NodeState.BOTH if data.host_value is not None else NodeState.DEVICE
    return NodeState.HOST


def _pinned_host_leaf(node: Any, full: Any) -> bool:
    """A host-only leaf that only a host lock keeps out of ``evictable_host_leaves`` (``_is_host_leaf`` excludes a
    node with ``host_lock_ref > 0``; its unlock puts it back). refcache's host-leaf set, like HiRadixCache's, keeps
    such a leaf and ``evict_host`` skips it while pinned (``host_ref_counter``, reported apart): the snapshot
    reports the set that way. Reached with L3, where an L3 backup pins a node whose device copy is then evicted."""
    data = node.component_data[full]
    return bool(
        data.value is None
        and data.host_value is not None
        and data.host_lock_ref > 0
        and data.lock_ref == 0
        and not node.children
    )


def _host_lock_segment(anchor: Any, receipt: Any, full: Any, single: bool) -> list[Any]:
    """The nodes a host-lock receipt counts on: from ``anchor`` up to the node that holds the receipt's
    boundary (``metadata["host_uuid"]``), as ``FullComponent.release_component_lock`` walks them; none when the
    receipt took no host lock. ``single`` (up to 0.5.21, _compat "host_lock_single_node"): ``anchor`` alone,
    when it holds a host lock."""
    if single:
        return [anchor] if anchor.component_data[full].host_lock_ref > 0 else []
    if full not in receipt.component_host_lock_uuids:
        return []
    boundary = receipt.get_lock_uuid(full, lock_host=True)
    segment: list[Any] = []
    node = anchor
    while node is not None:
        segment.append(node)
        if node.component_data[full].metadata.get("host_uuid") == boundary:
            break
        node = node.parent
    return segment


def read_snapshot(system: UnifiedSGLangSystem) -> Snapshot:
    """0.5.23's tree core, tables and pools as a ``Snapshot`` (the translations of ``_snapshot``): this
    process's rank. One rank of several (a ``_tp`` worker) reports its own clock as its ``clock_skew_us`` (and
    ``clock_us`` 0), which ``_tp.join_ranks`` joins with its peers' (D-41), as ``_snapshot.read_snapshot``."""
    cfg = system.config
    own = cfg.tp_size > 1
    return Snapshot(
        page_size=cfg.page_size,
        write_policy=cfg.hicache_write_policy.value,
        attention=cfg.attention.value,
        tp_size=cfg.tp_size,
        model_name=cfg.model_name,
        storage_enabled=cfg.enable_storage,
        is_eagle=cfg.is_eagle,
        clock_us=0 if own else system.clock_us,
        ranks=(_rank(system, system.clock_us if own else 0),),
        host_duplicate_reclaim=system.host_duplicate_reclaim,
    )


def _rank(system: UnifiedSGLangSystem, clock_skew_us: int) -> RankSnapshot:
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    full = ComponentType.FULL
    cache, tree, cc, renamer = system.cache, system.tree, system.controller, system.renamer
    ps = system.config.page_size
    ids: dict[int, NodeId] = {}
    hashes: dict[int, tuple[str, ...]] = {}
    order: list[Any] = []
    stack: list[tuple[Any, tuple[Token, ...]]] = [(tree.root_node, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            tokens = tuple(child.key)
            child_path = path + tokens
            namespace = child.key.extra_key
            ids[id(child)] = NodeId(namespace or "", child_path)
            if child.hash_value:
                hashes[id(child)] = tuple(child.hash_value)
            else:
                prior = hashes.get(id(node)) if node is not tree.root_node else None
                seed = prior[-1] if prior else storage_namespace_seed(namespace)
                hashes[id(child)] = tuple(page_hashes(tokens, ps, seed))
            order.append(child)
            stack.append((child, child_path))

    def key(node_id: Any) -> NodeId | None:
        node = tree._node_arena.get(node_id)
        return None if node is None else ids.get(id(node))

    in_flight: dict[int, set[str]] = {}
    write_through = []
    for entry in cache.ongoing_write_through.values():
        nodes = [tree._node_arena.get(n) for n in entry.publish_node_ids]
        write_through.append(tuple(ids[id(n)] for n in nodes if n is not None and id(n) in ids))
        for n in nodes:
            if n is not None:
                in_flight.setdefault(id(n), set()).add(InFlight.WRITE_THROUGH)
    load_back = []
    load_finished = []
    # An ack's finish event covers every load start_loading merged into it (its node_ids).
    finished = {nid: bool(a.finish_event.query()) for a in cc.ack_load_queue for nid in a.node_ids}
    # 0.5.22 on pins a loading anchor's host copy (load_back, inc_host_lock_ref) until the ack; the model does
    # not (D-05: only across the load's own eviction). The pin is a segment: a split of a pinned node moves its
    # boundary (``host_uuid``) to the new prefix (``FullComponent.redistribute_on_node_split``) and both halves
    # count it, as the release walk (``release_component_lock``) does, so every node of it is subtracted.
    load_pins: dict[int, int] = {}
    for ack_id, entry in cache.ongoing_load_back.items():
        node = tree._node_arena.get(entry.node_id)
        if node is not None:
            single = system.compat.has("host_lock_single_node")
            for pinned in _host_lock_segment(node, entry.host_lock_params, full, single):
                load_pins[id(pinned)] = load_pins.get(id(pinned), 0) + 1
            in_flight.setdefault(id(node), set()).add(InFlight.LOAD_BACK)
            if id(node) in ids:
                load_back.append(ids[id(node)])
                load_finished.append(finished.get(ack_id, False))

    storage = system.config.enable_storage
    backups = []
    backup_reads: list[tuple[int, ...]] = []
    prefetch_entries: list[tuple[int, NodeId | None, int, Any]] = []
    split_off: dict[int, tuple[NodeId, ...]] = {}  # rid -> the prefixes its anchor's host lock covers (D-57)
    if storage:
        single = system.compat.has("host_lock_single_node")
        reads = pending_backup_reads(cc)
        for op_id, (node_id, receipt) in cache.ongoing_backup.items():
            backup_reads.append(reads.get(op_id, ()))
            node = tree._node_arena.get(node_id)
            # the nodes the backup's host lock covers, root side first: from 0.5.22 a split under it moves the
            # lock's boundary to the new prefix (a segment, as for load pins above), up to 0.5.21 its node alone
            covered = [] if node is None else _host_lock_segment(node, receipt, full, single)[::-1] or [node]
            for n in covered:
                in_flight.setdefault(id(n), set()).add(InFlight.BACKUP)
            backups.append(tuple(ids[id(n)] for n in covered if id(n) in ids))
        for handle, entry in cache.ongoing_prefetch.items():
            anchor = tree._node_arena.get(entry.anchor_node_id)
            if anchor is not None:
                in_flight.setdefault(id(anchor), set()).add(InFlight.PREFETCH_ANCHOR)
            rid = int(getattr(handle, "rid", handle))
            root = anchor is None or tree.is_root(entry.anchor_node_id)
            if not root and entry.anchor_lock_params is not None:
                # D-57: from 0.5.22 the anchor's host lock is a segment (as a backup's above), and a split of the
                # anchor moves its boundary to the new prefix: the nodes above the anchor are pinned with it
                above = _host_lock_segment(anchor, entry.anchor_lock_params, full, single)[:0:-1]
                split_off[rid] = tuple(ids[id(n)] for n in above if id(n) in ids)
            prefetch_entries.append(
                (rid, None if root else ids.get(id(anchor)), len(entry.prefetch_key), entry.operation)
            )

    evictable, host_leaves = tree.evictable_device_leaves, tree.evictable_host_leaves
    records = []
    for n in order:
        data = n.component_data[full]
        records.append(
            NodeRecord(
                id=ids[id(n)],
                key_len=len(n.key),
                state=_state(n),
                value=None if data.value is None else renamer.slots(data.value.tolist()),
                host_value=None
                if data.host_value is None
                else tuple(int(s) for s in data.host_value.tolist()),
                hash_value=hashes[id(n)],
                lock_ref=int(data.lock_ref),
                host_ref_counter=int(data.host_lock_ref) - load_pins.get(id(n), 0),
                hit_count=int(n.hit_count),
                priority=int(n.priority),
                in_flight=tuple(sorted(in_flight.get(id(n), ()))),
                evictable_leaf=n in evictable,
                host_leaf=n in host_leaves or _pinned_host_leaf(n, full),
            )
        )
    records.sort(key=lambda r: r.id)

    held, requests = request_records(system, lambda last: None if tree.is_root(last) else key(last))
    host = system.host_pool
    host_free = host_free_slots(host)
    write_acks, load_acks = cc.ack_write_queue, cc.ack_load_queue
    write_pending = _gate.pending(write_acks)
    load_pending = _gate.pending(load_acks)
    held_host, prefetches = prefetch_state(system, prefetch_entries) if storage else ([], ())
    prefetches = tuple(dataclasses.replace(p, split_off=split_off.get(p.rid, ())) for p in prefetches)

    def size(name: str) -> int:
        return int(getattr(cc, name).qsize()) if storage else 0

    gate = system.gate
    return RankSnapshot(
        rank=system.rank,
        nodes=tuple(records),
        device=PoolRecord(renamer.pages * ps, ps, renamer.free_slots(), tuple(held)),
        host=PoolRecord(int(host.size), ps, tuple(host_free), tuple(held_host)),
        evictable_size=int(tree.full_evictable_size()),
        protected_size=int(tree.full_protected_size()),
        ongoing_write_through=tuple(write_through),
        ongoing_load_back=tuple(load_back),
        load_finished=tuple(load_finished),
        ongoing_backup=tuple(backups),
        backup_host_indices=tuple(backup_reads),
        ongoing_prefetch=prefetches,
        prefetch_tokens_occupied=int(cc.prefetch_tokens_occupied) if storage else 0,
        queues=(  # as the 0.5.20 adapter reads them (_snapshot.read_snapshot): the same controller queues
            ("write_pending", write_pending),
            ("write_acks", len(write_acks) - write_pending),
            ("load_pending", load_pending),
            ("load_acks", len(load_acks) - load_pending),
            (
                "prefetch_query",
                size("prefetch_queue")
                + size("prefetch_hit_queue")
                + (gate.in_all_reduce("prefetch_hits") if gate is not None else 0),
            ),
            (
                "prefetch_io",
                sum(op.host_indices is not None for op in system.prefetch_ops()) if storage else 0,
            ),
            ("backup_pending", size("backup_queue")),
            ("revoke", 0),  # no revoke queue: the drain of prefetch_hit_queue revokes
            ("backup_acks", size("ack_backup_queue")),
            ("host_release", size("host_mem_release_queue")),
        ),
        l3_keys=system.l3_keys(),
        requests=tuple(requests),
        clock_skew_us=clock_skew_us,
    )
