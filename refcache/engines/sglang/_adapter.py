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

import importlib
import json
import os
import shutil
import tempfile
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Self

import torch

from refcache.config import AttentionKind, HiCacheConfig
from refcache.engines.sglang import _compat, _cpu, _gate, _runtime, _storage, versions
from refcache.engines.sglang._snapshot import DeviceRenamer, read_snapshot
from refcache.errors import UnsupportedError, UsageError
from refcache.hicache.ops import (
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
    FaultKind,
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
from refcache.hicache.snapshot import Snapshot

__all__ = ["MAX_PENDING_LOADS", "TP_SIZES", "SGLangSystem", "host_defaults"]

TP_SIZES = (1, 2)
"""The tensor-parallel sizes the adapter runs: 1 in this process, 2 through ``_tp`` (one process per rank)."""

MAX_PENDING_LOADS = 3
"""``LayerDoneCounter.num_counters`` in 0.5.20: a load back reuses the event slot of the load three before
it and asserts that load has finished (``managers/cache_controller.py:81-86``)."""

STORAGE_FAULTS: frozenset[FaultKind] = frozenset(
    {
        FaultKind.DELETE,
        FaultKind.FAIL_NEXT_READ,
        FaultKind.FAIL_NEXT_WRITE,
        FaultKind.DISK_FULL,
        FaultKind.FAIL_PUBLISH,
    }
)
"""The ``StorageFault`` kinds the adapter injects into HiCacheFile. The others (``CORRUPT``, ``FLIP_PAYLOAD``,
``MISPLACED``, ``STALE``) damage an object that must then fail a read check; HiCacheFile has no checksum
(D-18, D-30), so there is nothing of SGLang's to exercise: ``UnsupportedError``."""

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
    a command that draws configurations for it must draw ``tp_size`` 1 (2 when chosen)."""
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
    if config.enable_storage and config.hicache_storage_backend != "file":
        return (
            f"hicache_storage_backend={config.hicache_storage_backend!r}: the adapter runs SGLang's own file "
            "backend (HiCacheFile) only; use hicache_storage_backend='file' (specs/sglang-adapter.md, 'L3')"
        )
    if config.hicache_size > 0:
        return (
            "hicache_size > 0: size the host pool with hicache_ratio (0.5.20 sizes it through a collective)"
        )
    return None


@contextmanager
def _tp_layout(rank: int, size: int, compat: _compat.Compat) -> Iterator[None]:
    """The parallel layout the storage backend's configuration reads (``_generate_storage_config``): tensor
    rank ``rank`` of ``size``, one pipeline stage, as SGLang's tests state it (``get_parallel().override``);
    no model-parallel groups exist. HiCacheFile names its keys after it (``_<model>_<rank>_<size>``, MHA). The
    attention and MoE tensor widths are the whole group's (no data or context parallelism, no expert
    parallelism): from 0.5.21 ``override`` checks that the topology adds up (``_validate_parallel``, 0.5.21
    ``runtime_context.py:264``) and refuses ``tp_size`` 2 beside widths of 1; every release takes the fields.
    From 0.5.23 it reads the decode context-parallel rank too, which no group writes here: rank 0 (decode context
    parallelism off; ``_compat`` "storage_config_without_dcp_rank")."""
    if compat.has("storage_layout_from_groups"):  # up to 0.5.15 the controller asks parallel_state's groups
        from sglang.srt.managers import cache_controller

        layout = {
            "get_tensor_model_parallel_rank": lambda: rank,
            "get_tensor_model_parallel_world_size": lambda: size,
            "get_pipeline_model_parallel_rank": lambda: 0,  # 0.5.15 asks these two; 0.5.12 imports neither
            "get_pipeline_model_parallel_world_size": lambda: 1,
        }
        saved = {name: getattr(cache_controller, name) for name in layout if hasattr(cache_controller, name)}
        for name in saved:
            setattr(cache_controller, name, layout[name])
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(cache_controller, name, value)
        return
    from sglang.srt.runtime_context import get_parallel

    dcp: dict[str, int] = {} if compat.has("storage_config_without_dcp_rank") else {"attn_dcp_rank": 0}
    with get_parallel().override(
        tp_rank=rank,
        tp_size=size,
        attn_tp_rank=rank,
        attn_tp_size=size,
        moe_tp_size=size,
        pp_rank=0,
        pp_size=1,
        **dcp,
    ):
        yield


@contextmanager
def _published_server_args(compat: _compat.Compat, fields: dict[str, Any]) -> Iterator[Any]:
    """SGLang's ``ServerArgs`` carrying ``fields``, published while the cache is built (and passed to it where
    the release takes it, ``server_args_passed``): through ``override_server_args`` where the release has it;
    else (``server_args_built``) a ``ServerArgs(model_path="dummy")`` with the fields set, published with
    ``set_global_server_args_for_scheduler`` and unpublished after; up to 0.5.3 (``no_global_server_args``)
    nothing, None."""
    if compat.has("no_global_server_args"):  # up to 0.5.3: nothing to publish, nothing of HiCache reads it
        yield None
        return
    if not compat.has("server_args_built"):
        from sglang.srt.runtime_context import get_context

        override = get_context().override_server_args(**fields)
        published = override.install()
        try:
            yield published
        finally:
            override.restore()
        return
    from sglang.srt import server_args as module

    built = module.ServerArgs(model_path="dummy")
    for name, value in fields.items():
        setattr(built, name, value)
    try:
        previous = module.get_global_server_args()
    except ValueError:  # none published yet
        previous = None
    module.set_global_server_args_for_scheduler(built)
    try:
        yield built
    finally:
        module.set_global_server_args_for_scheduler(previous)


def device_pools(cfg: HiCacheConfig, compat: _compat.Compat) -> tuple[Any, Any, Any]:
    """SGLang's device side for ``cfg`` on the CPU, as its model runner builds it (the same modules in 0.5.20
    and 0.5.23): the KV pool (``MHATokenToKVPool`` / ``MLATokenToKVPool``), its slot allocator
    (``TokenToKVPoolAllocator`` for page size 1, else ``PagedTokenToKVPoolAllocator``) and a ``ReqToTokenPool``."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool

    ps, dtype = cfg.page_size, _DTYPES[cfg.dtype]
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
    token_module, paged_module = compat.module("allocator_token"), compat.module("allocator_paged")
    assert token_module is not None and paged_module is not None  # every release has them
    TokenToKVPoolAllocator = importlib.import_module(token_module).TokenToKVPoolAllocator
    PagedTokenToKVPoolAllocator = importlib.import_module(paged_module).PagedTokenToKVPoolAllocator
    if ps == 1:
        allocator = TokenToKVPoolAllocator(cfg.device_size, dtype, "cpu", kv, need_sort=False)
    else:
        allocator = PagedTokenToKVPoolAllocator(cfg.device_size, ps, dtype, "cpu", kv, need_sort=False)
    req_to_token_pool = ReqToTokenPool(
        size=64, max_context_len=cfg.device_size + 2 * ps, device="cpu", enable_memory_saver=False
    )
    return kv, allocator, req_to_token_pool


class _Faults:
    """Storage faults armed on SGLang's HiCacheFile, consumed as the model consumes them: the next read
    batch (``batch_get``) misses; the next write batch (``batch_set``) fails before writing; a full disk
    lets ``room`` more new objects be written (``set``) and fails the next; failing publishes fail every new
    object. The last two last until a write batch reports a failure."""

    def __init__(self) -> None:
        self.fail_next_read = False
        self.fail_next_write = False
        self.disk_room: int | None = None
        self.fail_publish = False

    def arm(self, kind: FaultKind, index: int) -> None:
        if kind is FaultKind.FAIL_NEXT_READ:
            self.fail_next_read = True
        elif kind is FaultKind.FAIL_NEXT_WRITE:
            self.fail_next_write = True
        elif kind is FaultKind.DISK_FULL:
            self.disk_room = index % 3
        elif kind is FaultKind.FAIL_PUBLISH:
            self.fail_publish = True

    def install(self, backend: Any) -> None:
        batch_get, batch_set, set_one, exists = (
            backend.batch_get,
            backend.batch_set,
            backend.set,
            backend.exists,
        )

        def faulty_batch_get(keys: list[str], *args: Any, **kwargs: Any) -> Any:
            if self.fail_next_read:
                self.fail_next_read = False
                return [None] * len(keys)
            return batch_get(keys, *args, **kwargs)

        def faulty_batch_set(keys: list[str], *args: Any, **kwargs: Any) -> bool:
            if self.fail_next_write:
                self.fail_next_write = False
                return False
            ok = bool(batch_set(keys, *args, **kwargs))
            if not ok:
                self.disk_room, self.fail_publish = None, False
            return ok

        def faulty_set(key: str, *args: Any, **kwargs: Any) -> bool:
            if not exists(key):
                if self.disk_room is not None:
                    if self.disk_room == 0:
                        return False
                    self.disk_room -= 1
                if self.fail_publish:
                    return False
            return bool(set_one(key, *args, **kwargs))

        backend.batch_get = faulty_batch_get
        backend.batch_set = faulty_batch_set
        backend.set = faulty_set


class _Request:
    """A running request as SGLang's ``Req`` exposes it to the tree cache (duck type)."""

    def __init__(
        self,
        rid: int,
        tokens: tuple[int, ...],
        extra_key: str | None,
        prompt_len: int,
        *,
        sampled_token: bool = False,
    ) -> None:
        self.rid = str(rid)
        self.number = rid
        self.tokens = tokens
        # D-24: the prompt is all tokens unless the operation says otherwise; 0.5.20 re-inserts the prompt
        # prefix in cache_finished_req when it is a proper prefix of the cached key.
        self.origin_input_ids = list(tokens[:prompt_len])
        # ``sampled_token``: up to 0.5.5 cache_finished_req caches all but the last output token, which a
        # finished request's scheduler has sampled and not yet run (``_compat`` "finished_len_from_output");
        # every token of ``tokens`` has KV, so one more follows them (its value never reaches the tree).
        self.output_ids = list(tokens[prompt_len:]) + ([0] if sampled_token else [])
        self.extra_key = extra_key
        self.cache_salt = None
        self.priority = 0
        self.last_node: Any = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.kv = types.SimpleNamespace(req_pool_idx=None, cache_protected_len=0)

    def reset_for_retract(self) -> None:
        """Up to 0.5.3 the retraction that releases a request without caching it resets it for a later rerun
        (``_compat`` "release_by_retraction"); the adapter drops the request instead."""

    def get_fill_ids(self) -> list[int]:
        return list(self.tokens)  # the tokens with KV (no sampled token, ``finished_len_from_output``)

    @property
    def fill_ids(self) -> list[int]:
        """Up to 0.5.12 ``cache_unfinished_req`` reads this attribute (``_compat`` "fill_ids_attribute")."""
        return self.get_fill_ids()

    # Up to 0.5.18 the tree and ReqToTokenPool read these on the request itself (``_compat``
    # "request_kv_fields"); later releases read ``req.kv``. One record, both names.
    @property
    def req_pool_idx(self) -> Any:
        return self.kv.req_pool_idx

    @req_pool_idx.setter
    def req_pool_idx(self, value: Any) -> None:
        self.kv.req_pool_idx = value

    @property
    def cache_protected_len(self) -> int:
        return int(self.kv.cache_protected_len)

    @cache_protected_len.setter
    def cache_protected_len(self, value: int) -> None:
        self.kv.cache_protected_len = value

    # Up to 0.5.5 the tree keeps the re-matched length under this name and frees from len(prefix_indices),
    # which the adapter sets to the protected prefix (``_compat`` "prefix_from_prefix_indices"). One record.
    @property
    def last_matched_prefix_len(self) -> int:
        return int(self.kv.cache_protected_len)

    @last_matched_prefix_len.setter
    def last_matched_prefix_len(self, value: int) -> None:
        self.kv.cache_protected_len = value

    def is_dllm(self) -> bool:
        """Up to 0.5.9 ``ReqToTokenPool.alloc`` asks each request whether it is a diffusion LM request
        (``_compat`` "request_dllm_query"): never."""
        return False

    def pop_committed_kv_cache(self) -> int:
        """Up to 0.5.15 ``cache_finished_req`` asks the request how many tokens it holds (``_compat``
        "committed_len_from_request"): all of them."""
        return len(self.tokens)


class SGLangSystem:
    """SGLang 0.5.20's HiCache on the CPU: ``apply(op) -> Observation``, ``snapshot() -> Snapshot``.

    Raises ``UnsupportedError`` from the constructor for a configuration the adapter cannot run
    (``unsupported``). An exception SGLang raises inside an operation propagates unchanged (the harness
    reports it as a crash of this system).
    """

    gate: _storage.Gate | None = None  # the storage threads' gate (L3 only)
    l3_dir: str | None = None  # HiCacheFile's directory (L3 only)
    op_base = 0  # 0.5.20's StorageOperation.counter at construction or the last reset (L3 only)
    _revoked = 0  # prefetches the last check_hicache_events revoked (L3 only)
    _taken: dict[str, int]  # backup acks and release items the last check_hicache_events took (L3 only)
    rank = 0  # the rank this process drives (its place in the gloo group; 0 with one rank)
    # (L3) the I/O thread queues an operation's unread tail for release when its transfer ends, and no ack
    # reports its progress (``_compat`` "prefetch_progress_in_operation": up to 0.5.18)
    io_releases_tail = False
    # (L3) the prefetch thread revokes a query below the threshold through ``prefetch_revoke_queue`` (``_compat``
    # "prefetch_revoke_queue": up to 0.5.17)
    revoke_queue = False
    # (L3) ``prefetch_from_storage`` allocates the whole key's host memory at admission (``_compat``
    # "prefetch_allocated_at_admission": up to 0.5.15; D-01 off)
    allocated_at_admission = False
    SYSTEM: ClassVar[str] = "sglang"  # its name in refcache.systems (versions.RELEASES says what it drives)
    RECORDED: ClassVar[bool] = True  # whether record()'s Recorder reads its cache (_Calls, or _UnifiedCalls)
    _REVOKE: ClassVar[str] = "_revoke_pending_prefetch"  # the cache's revoke of a pending prefetch (L3 only)
    # the cache's prefetch timeout test, run with the logical clock in seconds (None: the clock is patched)
    _TIMEOUT: ClassVar[str | None] = "is_prefetch_timeout"

    def __init__(self, config: HiCacheConfig, *, l3_dir: str | None = None) -> None:
        """``l3_dir``: HiCacheFile's directory, shared by the ranks of one system (``_tp`` passes it; the
        caller removes it); by default a temporary directory of this system's own, removed by ``close``."""
        cfg = config.resolve()
        why = self._why_unsupported(cfg)
        if why is not None:
            raise UnsupportedError(why)
        # the installed release, before anything of SGLang is imported (UnsupportedError, never an ImportError)
        self.release = versions.check_installed(self.SYSTEM, tp_size=cfg.tp_size, storage=cfg.enable_storage)
        self.compat = _compat.Compat(self.release.version)
        for option, values in _compat.excluded_values(self.release.version).items():
            if str(getattr(cfg, option)) in values:  # an option the release does not have
                raise UnsupportedError(
                    f"{option}={getattr(cfg, option)!s}: SGLang {self.release.version} has no such option "
                    "(specs/sglang-adapter.md, 'Releases')"
                )
        self.config = cfg
        self.clock_us = 0
        self.clock = _runtime.LogicalTime()  # SGLang's time.monotonic where the release reads it (use_clock)
        self.requests: dict[int, _Request] = {}
        self._closed = False
        self._registered: list[torch.Tensor] = []
        self._host_layers: list[torch.Tensor] = []
        self.gate = None
        self.l3_dir = None
        self._shared_l3 = l3_dir
        self._faults = _Faults()
        self._ops: list[Any] = []  # SGLang PrefetchOperations whose final ack was not drained yet
        self._io_done: set[int] = set()
        self._queried: set[int] = set()  # id() of the operations whose hit query resolved (admission era)
        self._querying: Any = None  # (two ranks, admission era) the query awaiting the MIN of the hits
        self._revoked = 0
        self._taken = {}
        self.op_base = 0
        with _runtime.LOCK:
            self._ready()
            self.rank, world = _runtime.rank_and_size()
            if world != cfg.tp_size:
                raise UnsupportedError(
                    f"tp_size={cfg.tp_size}, but this process is in a group of {world}: SGLangSystem drives "
                    "the rank of this process; open tp_size 2 through refcache.engines.sglang.open_system "
                    "(one worker process per rank)"
                )
            try:
                self._build()
            except BaseException:
                if self.l3_dir is not None and self._shared_l3 is None:  # no L3 directory left behind
                    shutil.rmtree(self.l3_dir, ignore_errors=True)
                raise

    # --- construction: _why_unsupported, _ready and _build are the release's (_unified replaces them) -------

    @staticmethod
    def _why_unsupported(config: HiCacheConfig) -> str | None:
        return unsupported(config)

    @staticmethod
    def _ready() -> None:
        """Import the release through the shim and patch its module globals (once per process; a rank worker of
        ``_tp`` calls it when it starts, before its set-up hook)."""
        _runtime.ensure_ready()

    def _build(self) -> None:
        """SGLang's pools, cache and controller for ``self.config`` (under ``_runtime.LOCK``)."""
        import torch.distributed as dist
        from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
        from sglang.srt.mem_cache.radix_cache import TreeNode

        _runtime.use_clock(self.clock)
        cfg = self.config
        ps = cfg.page_size
        extra = self._open_storage()
        fields: dict[str, Any] = {
            "hicache_ratio": cfg.hicache_ratio,
            "hicache_size": 0,
            "hicache_mem_layout": cfg.hicache_mem_layout.value,
            "hicache_write_policy": cfg.hicache_write_policy.value,
            "hicache_io_backend": cfg.hicache_io_backend.value,
            "hicache_storage_backend": cfg.hicache_storage_backend,
            "hicache_storage_prefetch_policy": cfg.hicache_storage_prefetch_policy.value,
            "hicache_storage_backend_extra_config": json.dumps(extra) if extra else None,
            "served_model_name": cfg.model_name,
            "page_size": ps,
            "enable_hierarchical_cache": True,
            "device": "cpu",
        }
        with _published_server_args(self.compat, fields) as published:
            TreeNode.counter = 0
            kv, allocator, self.req_to_token_pool = device_pools(cfg, self.compat)
            init: dict[str, Any] = {
                "disable": False,
                "req_to_token_pool": self.req_to_token_pool,
                "token_to_kv_pool_allocator": allocator,
                "page_size": ps,
                "is_eagle": cfg.is_eagle,
                "tp_cache_group": dist.group.WORLD,
                "eviction_policy": cfg.radix_eviction_policy.value,
            }
            with self._building_storage():
                if self.compat.has("constructor_arguments"):
                    self.cache = HiRadixCache(**self._constructor_arguments(init, extra))
                else:
                    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

                    passed = published if self.compat.has("server_args_passed") else None
                    self.cache = HiRadixCache(CacheInitParams(**init), server_args=passed)
        cache = self.cache
        # 0.5.20 fixes the load-back threshold at 10 tokens (hiradix_cache.py:211) with no flag: the adapter
        # sets the attribute to the configured value.
        cache.load_back_threshold = cfg.load_back_threshold
        self.controller = cache.cache_controller
        self.allocator = allocator
        self.host_pool = cache.token_to_kv_pool_host
        # The pools are CPU memory: never the CUDA JIT copies (only reachable where sgl_kernel exists).
        self.host_pool.can_use_jit = False
        # Nor pinned buffers: the storage path's staging pages (get_dummy_flat_data_page) are allocated with
        # the pool's pin_memory flag, which needs an accelerator; the pool's own memory is already allocated.
        self.host_pool.pin_memory = False
        self.renamer = DeviceRenamer(cfg.device_size, ps)
        self._wrap_allocator()
        self._register_buffers(kv)
        if self.gate is not None:
            self._gate_storage(self.gate)

    def _constructor_arguments(self, init: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        """Up to 0.5.5 ``HiRadixCache``'s sixteen arguments (``_compat`` "constructor_arguments"): what later
        releases read from ``CacheInitParams`` (``init``) and from the published server arguments (the
        storage backend's extra configuration ``extra``)."""
        cfg = self.config
        return {
            "req_to_token_pool": init["req_to_token_pool"],
            "token_to_kv_pool_allocator": init["token_to_kv_pool_allocator"],
            "tp_cache_group": init["tp_cache_group"],
            "page_size": init["page_size"],
            "hicache_ratio": cfg.hicache_ratio,
            "hicache_size": 0,  # the ratio sizes the host pool (``unsupported``)
            "hicache_write_policy": cfg.hicache_write_policy.value,
            "hicache_io_backend": cfg.hicache_io_backend.value,
            "hicache_mem_layout": cfg.hicache_mem_layout.value,
            "enable_metrics": False,
            "eviction_policy": init["eviction_policy"],
            "hicache_storage_backend": cfg.hicache_storage_backend,
            "hicache_storage_prefetch_policy": cfg.hicache_storage_prefetch_policy.value,
            "model_name": cfg.model_name,
            "storage_backend_extra_config": json.dumps(extra) if extra else None,
            "is_eagle": init["is_eagle"],
        }

    def _open_storage(self) -> dict[str, Any]:
        """With L3: this system's HiCacheFile directory and gate, and the storage backend's extra configuration
        (``--hicache-storage-backend-extra-config``, read by ``_parse_storage_backend_extra_config``;
        ``prefetch_timeout_max`` keeps the release's default, 30 s). Without L3: nothing, ``{}``."""
        cfg = self.config
        if not cfg.enable_storage:
            return {}
        self.l3_dir = self._shared_l3 or tempfile.mkdtemp(prefix="refcache-sglang-l3-")
        self.gate = _storage.Gate()
        return {
            "prefetch_threshold": cfg.prefetch_threshold,
            "prefetch_timeout_base": cfg.prefetch_timeout_base,
            "prefetch_timeout_per_ki_token": cfg.prefetch_timeout_per_ki_token,
        }

    @contextmanager
    def _building_storage(self) -> Iterator[None]:
        """Around the construction of the controller, with L3: its queues belong to the gate
        (``_storage.building``), HiCacheFile's directory is ``l3_dir`` (its environment variable, put back
        after) and the parallel layout is this rank's (``_tp_layout``). Without L3: nothing."""
        if self.gate is None or self.l3_dir is None:
            yield
            return
        env = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
        saved = os.environ.get(env)
        os.environ[env] = self.l3_dir
        try:
            with _storage.building(self.gate), _tp_layout(self.rank, self.config.tp_size, self.compat):
                yield
        finally:
            if saved is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = saved

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

    def _gate_storage(self, gate: _storage.Gate) -> None:
        """Hand SGLang's storage threads to ``gate`` (``_storage``): the gated queues, the gated
        ``page_get_func``, a stop event that wakes them, and the fault hooks on HiCacheFile."""
        cc = self.controller
        stop = _storage.NotifyingEvent(gate)
        cc.storage_stop_event = stop
        if self.compat.has(
            "storage_threads_on_stop_event"
        ):  # up to 0.5.8: their event is the controller's own
            cc.stop_event = stop
        gate.stop_event = stop
        _storage.watch(gate)
        self.io_releases_tail = self.compat.has("prefetch_progress_in_operation")
        self.revoke_queue = self.compat.has("prefetch_revoke_queue")
        self.allocated_at_admission = self.compat.has("prefetch_allocated_at_admission")
        if self.compat.has(
            "storage_batch_size_attribute"
        ):  # up to 0.5.12: the controller's own, not the module's
            cc.storage_batch_size = self.config.storage_batch_size
        self._started_io(gate)
        self._set_roles()
        page_get = cc.page_get_func

        def gated_page_get(*args: Any) -> Any:  # (operation, hash_values, host_indices[, extra_info])
            gate.acquire(IOQueue.PREFETCH_IO)
            return page_get(*args)

        cc.page_get_func = gated_page_get
        if self.io_releases_tail:
            transfer = cc._page_transfer

            def tracked_transfer(operation: Any) -> Any:
                try:
                    return transfer(operation)
                finally:  # (I/O thread) next, it queues the operation's unread tail for release
                    self._io_done.add(id(operation))

            cc._page_transfer = tracked_transfer
        if self.config.tp_size > 1:
            self._gate_collectives(gate)
        prefetch = cc.prefetch

        def tracked_prefetch(*args: Any, **kwargs: Any) -> Any:
            operation = prefetch(*args, **kwargs)
            self._ops.append(operation)
            return operation

        cc.prefetch = tracked_prefetch
        if self.allocated_at_admission:
            self._track_queries()
        else:
            self._count_revokes(self._REVOKE)
        if self._TIMEOUT is not None:
            self._clock_timeouts(self._TIMEOUT)
        self._faults.install(cc.storage_backend)
        self._number_ops()
        self._settle()

    def _track_queries(self) -> None:
        """Up to 0.5.15 (``allocated_at_admission``): the operations whose hit query resolved (the prefetch thread
        then revokes one below the threshold, releasing all its host memory, or releases the missed tail and
        buffers it, in the same step); and the live prefetches the drain revoked, which it pops from
        ``ongoing_prefetch`` inside ``_drain_storage_control_queues_impl`` (no revoke method to wrap).

        With one rank the query resolves when ``_storage_hit_query`` returns. With two it resolves when the MIN of
        the hits across ranks returns (``_all_reduce_prefetch_groups``, ``cache_controller.py`` 0.5.15:1035, under
        the gate since ``_gate_collectives``): until then the thread waits there with the whole ``host_indices``
        and an empty ``hash_value``, which is neither the revoke nor the cut yet (the model's parked query)."""
        cc, cache = self.controller, self.cache
        query = cc._storage_hit_query
        two_ranks = self.config.tp_size > 1

        def tracked_query(operation: Any) -> Any:
            result = query(operation)
            if not any(operation is op for op in self._ops):
                return result  # not a prefetch's: query_storage_hit_length's probe (PD decode; not driven)
            if two_ranks:
                self._querying = operation
            else:
                self._queried.add(id(operation))
            return result

        cc._storage_hit_query = tracked_query
        if two_ranks:  # two ranks: the MIN is _all_reduce_prefetch_groups (up to 0.5.10 the routed one)
            reduce_hits = cc._all_reduce_prefetch_groups

            def resolved_by_the_min(tensor: Any, op: Any) -> None:
                reduce_hits(tensor, op)
                if self._querying is not None:
                    self._queried.add(id(self._querying))
                    self._querying = None

            cc._all_reduce_prefetch_groups = resolved_by_the_min
        # up to 0.5.8 the drain is one function (no ``_impl`` inside)
        name = (
            "drain_storage_control_queues"
            if self.compat.has("drain_without_impl")
            else "_drain_storage_control_queues_impl"
        )
        drain = getattr(cache, name)

        def counted_drain(*args: Any, **kwargs: Any) -> Any:
            before = len(cache.ongoing_prefetch)
            try:
                return drain(*args, **kwargs)
            finally:
                self._revoked += before - len(cache.ongoing_prefetch)

        setattr(cache, name, counted_drain)

    def past_query(self, op: Any) -> bool:
        """Whether ``op``'s hit query has resolved (D-01: the drain allocated its host memory; up to 0.5.15 the
        prefetch thread's query returned)."""
        if self.allocated_at_admission:
            return id(op) in self._queried
        return op.host_indices is not None

    def revoked_at_query(self, op: Any) -> bool:
        """Up to 0.5.15: the query found too few hits, so the prefetch thread released all of ``op``'s host memory
        (its ``hash_value`` stays empty: a query at or above the threshold keeps at least one page)."""
        return self.allocated_at_admission and id(op) in self._queried and not op.hash_value

    def _count_revokes(self, name: str) -> None:
        """Wrap the cache's revoke method ``name`` (its one argument names the request as ``ongoing_prefetch``
        keys it) so that ``CheckHicacheEvents`` counts the live prefetches it revoked."""
        cache = self.cache
        revoke = getattr(cache, name)

        def counted_revoke(request: Any) -> None:
            if request in cache.ongoing_prefetch:
                self._revoked += 1
            revoke(request)

        setattr(cache, name, counted_revoke)

    def _clock_timeouts(self, name: str) -> None:
        """Wrap the cache's timeout test ``name``: while it runs, ``time.monotonic()`` reads the logical clock in
        seconds (the release compares it with the operation's start, which read the same clock)."""
        timed_out = getattr(self.cache, name)

        def clock_timeout(operation: Any) -> bool:
            self.clock.seconds = True
            try:
                return bool(timed_out(operation))
            finally:
                self.clock.seconds = False

        setattr(self.cache, name, clock_timeout)

    def _gate_collectives(self, gate: _storage.Gate) -> None:
        """The storage threads' all-reduces across ranks (``HiCacheController._all_reduce`` over its own gloo
        groups: the prefetch thread's MIN of the storage hits, ``prefetch_hits_sync_groups``, and the
        prefetch sync thread's MIN of an ack's completed tokens, ``prefetch_completion_sync_groups``) go
        through the gate (``Gate.all_reduce``): the thread parks there, and ``_tp``'s parent, which sees
        every rank's contributions, hands in the MIN (or the MAX a patched thread asks for) once every rank
        has made its ``n``-th one of a group. A contribution whose peer has not run that step yet stays in
        flight (the thread parked), so a rank's storage step settles without its peer, as the model lets
        it. Up to 0.5.18 the prefetch thread's MIN is the only one, through ``_all_reduce_prefetch_groups(tensor,
        op)`` over ``prefetch_sync_groups`` (``_compat`` "prefetch_groups_all_reduce"); up to 0.5.10 through
        ``torch.distributed.all_reduce`` on ``prefetch_tp_group`` itself ("prefetch_hits_all_reduce_inline":
        ``_storage.route_all_reduce``)."""
        import torch

        cc = self.controller

        def reduce_through_gate(tensor: Any, op: Any, group: str) -> None:
            if op not in (torch.distributed.ReduceOp.MIN, torch.distributed.ReduceOp.MAX):
                raise _storage.EngineThreadError(f"unexpected storage all-reduce {op!r}")
            # 0.5.20 asks for MIN; a MAX (the SGLang zoo's prefetch-hits-reduced-by-max) is the negated MIN
            # of the negated contributions, so the parent's reduction stays one MIN. Element by element: from
            # 0.5.22 Unified's hit query reduces the hits and each pool's pages packed in one tensor
            # (hybrid_cache_controller.py 0.5.22:1415-1428, _sync_prefetch_hit_query).
            sign = 1 if op == torch.distributed.ReduceOp.MIN else -1
            values = tuple(sign * int(v) for v in tensor.flatten().tolist())
            reduced = gate.all_reduce(group, values)
            tensor.copy_(torch.tensor([sign * v for v in reduced], dtype=tensor.dtype).reshape(tensor.shape))

        if self.compat.has("prefetch_hits_all_reduce_inline"):  # up to 0.5.10: the collective called inline
            # (cache_controller.py 0.5.10:954-962) on prefetch_tp_group: routed to the gate under 0.5.11's name,
            # which _track_queries wraps to resolve the query where the MIN returns
            def reduce_hits(tensor: Any, op: Any) -> None:
                reduce_through_gate(tensor, op, "prefetch_hits")

            cc._all_reduce_prefetch_groups = reduce_hits
            _storage.route_all_reduce(
                gate, cc.prefetch_tp_group, lambda tensor, op: cc._all_reduce_prefetch_groups(tensor, op)
            )
            return
        if self.compat.has("prefetch_groups_all_reduce"):  # 0.5.11..0.5.18: the prefetch thread's only
            real_groups = cc._all_reduce_prefetch_groups

            def all_reduce_prefetch_groups(tensor: Any, op: Any) -> None:
                if not cc.prefetch_sync_groups:
                    real_groups(tensor, op)
                    return None
                reduce_through_gate(tensor, op, "prefetch_hits")
                return None

            cc._all_reduce_prefetch_groups = all_reduce_prefetch_groups
            return
        real = cc._all_reduce

        def all_reduce(tensor: Any, op: Any, groups: Any) -> None:
            if not groups:
                real(tensor, op, groups)
                return None
            group = "prefetch_hits" if groups is cc.prefetch_hits_sync_groups else "prefetch_completion"
            reduce_through_gate(tensor, op, group)
            return None

        cc._all_reduce = all_reduce

    def _number_ops(self) -> None:
        """Operation ids count from here: 0.5.20's ``StorageOperation.counter`` is one class-wide counter
        (prefetches and backups), never reset; refcache numbers each rank's operations from 0 (per reset)."""
        from sglang.srt.managers.cache_controller import StorageOperation

        self.op_base = int(StorageOperation.counter)

    def _started_io(self, gate: _storage.Gate) -> None:
        """Wait for the prefetch thread to park: up to 0.5.18 it builds ``prefetch_buffer`` and starts the I/O
        thread when it starts (at construction and at every ``reset``), so both exist once it waits for work.
        A buffer it built after the construction ended belongs to the gate (``_storage.GatedQueue``)."""
        cc = self.controller
        gate.settle([cc.prefetch_thread])
        if cc.prefetch_buffer.gate is None:
            cc.prefetch_buffer.gate = gate
        if self.compat.has("io_thread_unnamed"):  # up to 0.5.8 the prefetch thread keeps it as a local
            # The newest I/O thread of this controller: reset() joins the prefetch and backup threads, not the
            # I/O thread, which may outlive it parked on the old buffer (the constructor resets once).
            # ``threading.enumerate()`` lists the running threads in the order they started.
            target = cc.prefetch_io_aux_func
            cc.prefetch_io_aux_thread = [
                t for t in threading.enumerate() if getattr(t, "_target", None) == target and t.is_alive()
            ][-1]

    def _set_roles(self) -> None:
        """Gate ``prefetch_queue`` and ``backup_queue``; note each operation's final ack when drained."""
        cc = self.controller
        cc.prefetch_queue.role = IOQueue.PREFETCH_QUERY
        cc.backup_queue.role = IOQueue.BACKUP
        if not self.io_releases_tail:  # up to 0.5.18 there are no acks: ``tracked_transfer`` sees the I/O end
            cc.ack_prefetch_queue.on_get = self._ack_drained
            cc.prefetch_sync_queue.on_put = self._ack_sent
        cc.ack_backup_queue.on_get = self._took("backups")
        cc.host_mem_release_queue.on_get = self._took("host_releases")

    def _ack_drained(self, ack: Any) -> None:
        """The scheduler drained an operation's final ack: it owns no host slot any more."""
        if ack is not None and ack.completed_req:
            self._ops = [op for op in self._ops if op is not ack.operation]
            self._io_done.discard(id(ack.operation))

    def _ack_sent(self, ack: Any) -> None:
        """(I/O thread) an operation's final ack: its I/O has ended (with two ranks, the sync thread may
        still wait in the all-reduce of an earlier ack before it forwards this one)."""
        if ack is not None and ack.completed_req:
            self._io_done.add(id(ack.operation))

    def _prune_ops(self) -> None:
        """Forget operations that will never hold host memory: revoked before the drain allocated any
        (no entry, not queued for the hit query or its drain)."""
        cc = self.controller
        queues = (
            (cc.prefetch_queue,)
            if self.allocated_at_admission
            else (cc.prefetch_queue, cc.prefetch_hit_queue)
        )
        queued = {id(op) for q in queues for op in list(q.queue)}
        live = {id(op) for op in self._live_prefetch_ops()}
        self._ops = [
            op
            for op in self._ops
            if (op.host_indices is not None and not self.revoked_at_query(op))
            or id(op) in queued
            or id(op) in live
        ]
        if self.io_releases_tail:  # and those the tree let go whose I/O thread released their tail
            ended = [op for op in self._ops if id(op) in self._io_done and id(op) not in live]
            self._ops = [op for op in self._ops if op not in ended]
            self._io_done.difference_update(id(op) for op in ended)
        self._queried.intersection_update(id(op) for op in self._ops)

    def _live_prefetch_ops(self) -> list[Any]:
        """The operations of the cache's ``ongoing_prefetch`` entries."""
        # an entry's operation is its last field (up to 0.5.15 the host indices come before it)
        return [entry[-1] for entry in self.cache.ongoing_prefetch.values()]

    def _prefetching(self) -> set[int]:
        """The rids with an ``ongoing_prefetch`` entry (its keys: the rid strings)."""
        return {int(rid) for rid in self.cache.ongoing_prefetch}

    def prefetch_ops(self) -> list[Any]:
        """SGLang's prefetch operations that may still hold host slots (final ack not drained)."""
        return list(self._ops)

    def io_done(self) -> set[int]:
        """``id()`` of the operations whose I/O ended (final ack sent), until that ack is drained."""
        return set(self._io_done)

    def io_ops(self) -> list[Any]:
        """The operation the I/O thread is transferring (one at most), as a list."""
        return [
            op
            for op in self._ops
            if self.past_query(op)
            and not self.revoked_at_query(op)
            and id(op) not in self._io_done
            and not any(op is queued for queued in list(self.controller.prefetch_buffer.queue))
        ]

    def _threads(self) -> list[Any]:
        cc = self.controller
        sync = [] if self.io_releases_tail else [cc.prefetch_sync_thread]
        return [cc.prefetch_thread, cc.prefetch_io_aux_thread, *sync, cc.backup_thread]

    def _settle(self) -> None:
        if self.gate is not None:
            self.gate.settle(self._threads())

    def settle(self) -> None:
        """Wait until the storage threads park again (``_tp``: after the parent handed in all-reduces)."""
        with self._entered():
            self._settle()

    def _wrap_allocator(self) -> None:
        """Mirror every allocation and free of SGLang's device allocator in the renamer (see ``DeviceRenamer``):
        ``alloc`` for both allocators; frees end in ``free`` (page size 1, and every page size up to 0.5.16) or
        ``_release_page_ids``."""
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
        old_flag = self.compat.has("free_group_flag")

        def grouping() -> bool:  # inside free_group_begin/end: the frees land at the end, in one free
            return not allocator.is_not_in_free_group if old_flag else allocator.free_group is not None

        if ps == 1 or self.compat.has("paged_free_direct"):
            free = allocator.free

            def tracked_free(free_index: torch.Tensor) -> None:
                if free_index.numel() and not grouping():  # each page once (a paged free names every slot)
                    renamer.freed(sorted({int(s) // ps * ps for s in free_index.tolist()}))
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
        """Stop SGLang's storage threads (``shutdown``: detach the backend) and remove the L3 directory;
        release the pools' registrations. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.gate is not None:
                with self._entered():
                    if self.compat.has("no_storage_detach"):  # up to 0.5.8: stop the threads as reset() does
                        self.controller.stop_event.set()
                        for thread in self._threads():
                            thread.join()
                    else:
                        self.cache.shutdown()
                _storage.unwatch(self.gate)
        finally:
            if self.l3_dir is not None and self._shared_l3 is None:
                shutil.rmtree(self.l3_dir, ignore_errors=True)
            _cpu.unregister(self._registered)
            _cpu.unregister_host(self._host_layers)

    def snapshot(self) -> Snapshot:
        with self._entered():
            return read_snapshot(self)

    @contextmanager
    def _entered(self) -> Iterator[None]:
        with _runtime.LOCK:
            _runtime.use_clock(self.clock)
            _runtime.use_batch_size(self.config.storage_batch_size)
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
            prefetching=self._prefetching(),
        )
        with self._entered():
            out = self._apply(op)
            if self.gate is not None:
                self._settle()  # what the ungated threads do in response belongs to this operation
                self._prune_ops()
            return out

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
                return self._prefetch(rid, tokens, extra_key)
            case CheckPrefetchProgress(rid):
                return self._check_prefetch_progress(rid)
            case AbortPrefetch(rid):
                self._abort_prefetch(rid)
                return Done()
            case CheckHicacheEvents():
                return self._check_events()
            case Reset():
                return ResetResult(self._reset())
            case CompleteIO(queue, _rank, count):
                return IOResult(self._complete(queue, count))
            case AdvanceClock(us, rank):
                if rank is None or rank == self.rank:  # D-41: this process's rank reads its own clock
                    self.clock_us += us  # only prefetch timeouts read it (``clock_timeout``)
                    self.clock.now_us = self.clock_us
                return Done()
            case StorageFault(kind, _rank, index):
                self._storage_fault(kind, index)
                return Done()

    # --- helpers --------------------------------------------------------------------------------------------

    def _key(self, tokens: tuple[int, ...], extra_key: str | None) -> Any:
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(list(tokens), extra_key=extra_key)

    def _evict_for_alloc(self, num_tokens: int) -> None:
        """The admission's eviction before ``alloc``: ``evict_from_tree_cache(cache, num_tokens)``
        (``mem_cache/common.py``); up to 0.5.3, which has no such function, the scheduler batch's own
        ``ScheduleBatch._evict_tree_cache_if_needed(num_tokens)`` (``_compat`` "evict_in_schedule_batch"),
        called with a batch that holds what the method reads of it (the tree, its allocator, not hybrid)."""
        if self.compat.has("evict_in_schedule_batch"):
            self._schedule_batch()._evict_tree_cache_if_needed(num_tokens)
            return
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        evict_from_tree_cache(self.cache, num_tokens)

    def _match_result(self, tokens: tuple[int, ...], extra_key: str | None) -> Any:
        """``match_prefix(MatchPrefixParams(key))``; up to 0.5.7 ``match_prefix(key)`` (``_compat``
        "match_prefix_by_key")."""
        key = self._key(tokens, extra_key)
        if self.compat.has("match_prefix_by_key"):
            return self.cache.match_prefix(key)
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        return self.cache.match_prefix(MatchPrefixParams(key=key))

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
            new_indices, new_last = cache.init_load_back(*self._load_back_args(m))
            cache.dec_lock_ref(last_node)
            last_node, loaded = new_last, new_indices
            prefix = torch.cat([prefix, loaded])
        cache.inc_lock_ref(last_node)
        need = len(tokens) - len(prefix)
        pages = -(-need // cfg.page_size) * cfg.page_size
        new: Any = torch.empty(0, dtype=torch.int64)
        if pages:
            self._evict_for_alloc(pages)
            new = self.allocator.alloc(pages)
        if new is None:
            cache.dec_lock_ref(last_node)
            cache.ready_to_load_host_cache()
            return StartResult(False, device_hit, len(loaded), 0)
        request = _Request(
            rid,
            tokens,
            extra_key,
            len(tokens) if prompt_len is None else prompt_len,
            sampled_token=self.compat.has("finished_len_from_output"),
        )
        if self.compat.has("req_pool_by_count"):
            (row,) = self.req_to_token_pool.alloc(1)
        elif self.compat.has("req_pool_per_request"):
            (row,) = self.req_to_token_pool.alloc([request])
        else:
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

    def _load_back_args(self, m: Any) -> tuple[Any, ...]:
        """``init_load_back``'s arguments for the match ``m``: ``InitLoadBackParams`` naming the host match
        (``best_match_node``; ``last_host_node`` up to 0.5.11, ``_compat`` "load_back_from_last_host_node");
        up to 0.5.9 the last host node and the host hit length themselves ("init_load_back_positional")."""
        if self.compat.has("init_load_back_positional"):
            return (m.last_host_node, m.host_hit_length)
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        if self.compat.has("load_back_from_last_host_node"):
            return (InitLoadBackParams(last_host_node=m.last_host_node, host_hit_length=m.host_hit_length),)
        return (InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length),)

    def _free_row(self, request: _Request) -> None:
        """Free the request's ``req_to_token`` row after ``cache_finished_req`` (up to 0.5.8 that call frees
        it itself, ``_compat`` "tree_frees_request_row")."""
        if self.compat.has("tree_frees_request_row"):
            return
        if self.compat.has("req_pool_per_request"):
            self.req_to_token_pool.free(request)
        else:
            self.req_to_token_pool.free_rows([request.kv.req_pool_idx])

    def _finish(self, rid: int) -> FinishResult:
        """``cache_finished_req(req, kv_len_to_handle=len(tokens))``. ``prefix_len`` is what its first
        ``insert`` returned (observed by wrapping ``insert`` for the call); ``freed`` counts the duplicate
        slots ``[protected_len, prefix_len)`` plus the unaligned tail ``[key_len, len(tokens))``, the two
        segments that call frees (in tokens, as the model counts them; the allocator frees whole pages)."""
        request = self.requests.pop(rid)
        cache = self.cache
        seen: list[int] = []
        insert: Callable[..., Any] = cache.insert
        # up to 0.5.8 insert(key, value, ...) returns the length itself (``_compat`` "insert_positional")
        positional = self.compat.has("insert_positional")

        def spy(*args: Any, **kwargs: Any) -> Any:
            result = insert(*args, **kwargs)
            seen.append(int(result) if positional else int(result.prefix_len))
            return result

        cache.insert = spy
        try:
            cache.cache_finished_req(request, **self._handled(request))
        finally:
            del cache.insert
        self._free_row(request)
        prefix_len = seen[0] if seen else 0
        key_len = self._key_len(request.tokens)
        freed = max(0, prefix_len - request.kv.cache_protected_len) + len(request.tokens) - key_len
        return FinishResult(prefix_len, freed)

    def _handled(self, request: _Request) -> dict[str, int]:
        """``cache_finished_req``'s length argument: all the request's tokens (up to 0.5.15 it asks the
        request, ``_Request.pop_committed_kv_cache``)."""
        if self.compat.has("committed_len_from_request"):
            return {}
        return {"kv_len_to_handle": len(request.tokens)}

    def _key_len(self, tokens: tuple[int, ...]) -> int:
        n = len(tokens) - (1 if self.config.is_eagle else 0)
        return n - n % self.config.page_size

    def _abort(self, rid: int) -> None:
        """``release_kv_cache(req, tree_cache, is_insert=False)`` = ``cache_finished_req(is_insert=False)``:
        frees every slot after the protected prefix and unlocks (up to 0.5.3 the retraction,
        ``_release_by_retraction``)."""
        request = self.requests.pop(rid)
        if self.compat.has("release_by_retraction"):
            self._release_by_retraction(request)
            return
        with self.renamer.batch():
            self.cache.cache_finished_req(request, is_insert=False, **self._handled(request))
        self._free_row(request)

    def _release_by_retraction(self, request: _Request) -> None:
        """Up to 0.5.3 ``cache_finished_req`` always inserts (no ``is_insert``); what releases a request
        without caching it is the retraction, ``ScheduleBatch.release_req`` (``_compat``
        "release_by_retraction"): it frees the request's slots from its page-aligned prefix to its length, its
        ``req_to_token`` row, and unlocks its last node. Called with a batch of that one request, holding what
        the method reads (not hybrid, not a disaggregated decode)."""
        batch = self._schedule_batch(request)
        server_args = types.SimpleNamespace(disaggregation_mode="null", page_size=self.config.page_size)
        with self.renamer.batch():
            batch.release_req(0, 0, server_args)

    def _schedule_batch(self, *requests: _Request) -> Any:
        """Up to 0.5.3 (``_compat`` "evict_in_schedule_batch", "release_by_retraction"): a stand-in for the
        scheduler's ``ScheduleBatch`` of ``requests`` whose methods are that class's own, holding what they read:
        the tree, its pools, each request's length (``seq_lens_cpu``: its tokens, all with KV), not hybrid."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        batch = types.SimpleNamespace(
            reqs=list(requests),
            seq_lens_cpu=torch.tensor([len(r.tokens) for r in requests], dtype=torch.int64),
            tree_cache=self.cache,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.cache.token_to_kv_pool_allocator,
            is_hybrid=False,
        )
        for name in ("_evict_tree_cache_if_needed", "release_req"):
            setattr(batch, name, types.MethodType(getattr(ScheduleBatch, name), batch))
        return batch

    def _evict(self, num_tokens: int) -> int:
        """``evict(EvictParams(num_tokens))``'s count; up to 0.5.8 ``evict(num_tokens)`` returns nothing
        (``_compat`` "evict_returns_nothing"): the tokens it took off the device are the ``evictable_size_``
        delta (each evicted node leaves it as its device slots are freed)."""
        if self.compat.has("evict_returns_nothing"):
            before = int(self.cache.evictable_size_)
            self.cache.evict(num_tokens)
            return before - int(self.cache.evictable_size_)
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        return int(self.cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted)

    def _evict_host(self, num_tokens: int) -> int:
        """``evict_host`` returns None in 0.5.20 (D-21): the tokens freed are the host pool's
        ``available_size`` delta (host slots are freed at once, into ``release_slots``)."""
        before = int(self.host_pool.available_size())
        self.cache.evict_host(num_tokens)
        return int(self.host_pool.available_size()) - before

    def _prefetch(self, rid: int, tokens: tuple[int, ...], extra_key: str | None) -> PrefetchResult:
        """``_prefetch_kvcache``: match; then, the anchor ``last_host_node`` being backed up or the root
        (always, in 0.5.20), ``prefetch_from_storage(handle, last_host_node, tokens[matched:],
        get_last_hash_value(last_host_node), extra_key=...)``. It returns nothing: admitted is
        ``rid in ongoing_prefetch`` afterwards, and the reason is the first of its refusal tests that holds
        (no storage, page-aligned length below ``prefetch_threshold``, ``prefetch_rate_limited``). Like
        ``StartRequest``, the whole sequence is the key (0.5.20's scheduler stops one token short)."""
        cache, cfg = self.cache, self.config
        m = self._match_result(tokens, extra_key)
        matched = len(m.device_indices) + m.host_hit_length
        key_len = self._key_len(tokens)
        tail = max(0, key_len - matched)
        tail -= tail % cfg.page_size
        if not cfg.enable_storage:
            return PrefetchResult(False, "storage_disabled", tail)
        anchor = m.last_host_node
        below = tail < cache.prefetch_threshold
        limited = not below and self.controller.prefetch_rate_limited()
        # up to 0.5.18 no extra_key= (the namespace is the anchor's there, as it is where it is passed)
        namespace = {} if self.compat.has("prefetch_without_extra_key") else {"extra_key": extra_key}
        # up to 0.5.16 the scheduler asks the node itself
        last_hash = (
            anchor.get_last_hash_value()
            if self.compat.has("last_hash_from_node")
            else cache.get_last_hash_value(anchor)
        )
        # up to 0.5.3 no prefix_keys (the adapter passes None: HiCacheFile reads none)
        prefix_keys = () if self.compat.has("prefetch_without_prefix_keys") else (None,)
        cache.prefetch_from_storage(
            self._handle(rid),
            anchor,
            list(tokens[matched:]),
            last_hash,
            *prefix_keys,
            **namespace,
        )
        if str(rid) in cache.ongoing_prefetch:
            return PrefetchResult(True, "admitted", tail)
        # up to 0.5.15 the admission allocates, and returns without an entry when the host pool falls short
        short = self.allocated_at_admission and not below and not limited
        reason = (
            "below_threshold" if below else "rate_limited" if limited else "no_host_memory" if short else "?"
        )
        return PrefetchResult(False, reason, tail)

    def _handle(self, rid: int) -> Any:
        """How the prefetch calls name request ``rid``: a ``CacheRequestHandle`` (up to 0.5.19 the rid string,
        ``_compat`` "plain_request_ids")."""
        if self.compat.has("plain_request_ids"):
            return str(rid)
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        return CacheRequestHandle(str(rid), 0)

    def _check_prefetch_progress(self, rid: int) -> ProgressResult:
        """``check_prefetch_progress(handle)``; when it returns True, ``pop_prefetch_loaded_tokens`` (the
        tokens it, or an earlier drain of the completion ack, inserted), as the scheduler does."""
        if not self.config.enable_storage:
            return ProgressResult(done=True, inserted=0)  # nothing is ever prefetching
        handle = self._handle(rid)
        if self.compat.has(
            "no_loaded_tokens_count"
        ):  # up to 0.5.8: the count its insert gives, as 0.5.9 keeps
            return self._check_prefetch_progress_counted(handle)
        if not self.cache.check_prefetch_progress(handle):
            return ProgressResult(done=False, inserted=0)
        return ProgressResult(done=True, inserted=int(self.cache.pop_prefetch_loaded_tokens(handle)))

    def _check_prefetch_progress_counted(self, handle: Any) -> ProgressResult:
        """Up to 0.5.8 (``_compat`` "no_loaded_tokens_count"): ``check_prefetch_progress``, whose one
        ``_insert_helper_host`` call inserts the fetched tokens; what it loaded is their number less the length
        the tree already held (0.5.9's ``loaded_from_storage``)."""
        cache = self.cache
        helper = cache._insert_helper_host
        loaded: list[int] = []

        def counted(node: Any, key: Any, host_value: Any, hash_value: Any) -> Any:
            matched = helper(node, key, host_value, hash_value)
            loaded.append(len(key) - int(matched))
            return matched

        cache._insert_helper_host = counted
        try:
            done = bool(cache.check_prefetch_progress(handle))
        finally:
            del cache._insert_helper_host  # the class's again
        return ProgressResult(done=done, inserted=sum(loaded) if done else 0)

    def _abort_prefetch(self, rid: int) -> None:
        """``release_aborted_request(handle)`` (the scheduler's ``_release_aborted_request``)."""
        if self.config.enable_storage:
            self.cache.release_aborted_request(self._handle(rid))

    def _storage_fault(self, kind: FaultKind, index: int) -> None:
        """Faults injected into SGLang's HiCacheFile (``STORAGE_FAULTS``); without L3 there is nothing to
        damage (the model's faults find an empty view too)."""
        if not self.config.enable_storage:
            return
        if kind not in STORAGE_FAULTS:
            raise UnsupportedError(
                f"StorageFault {kind.value}: SGLang 0.5.20's HiCacheFile has no checksum, so a damaged object "
                "is read back as data, not detected (D-18, D-30); the adapter injects "
                + ", ".join(sorted(k.value for k in STORAGE_FAULTS))
            )
        if kind is FaultKind.DELETE:
            view = self.l3_keys()
            if view:
                assert self.l3_dir is not None
                os.remove(os.path.join(self.l3_dir, view[index % len(view)] + ".bin"))
        else:
            self._faults.arm(kind, index)

    def l3_keys(self) -> tuple[str, ...]:
        """The objects of this rank's view of L3: HiCacheFile's file names without ``.bin`` (page hash and
        key suffix, refcache's ``storage_key``), sorted."""
        if self.l3_dir is None:
            return ()
        suffix = self.controller.storage_backend.config_suffix
        return tuple(
            sorted(
                name[:-4]
                for name in os.listdir(self.l3_dir)
                if name.endswith(suffix + ".bin") and len(name) == 64 + len(suffix) + 4
            )
        )

    def _check_events(self) -> EventsResult:
        """``check_hicache_events``: the acks it retired are the length deltas of ``ack_write_queue`` and
        ``ack_load_queue`` (it returns None); with L3 also of ``ack_backup_queue`` and
        ``host_mem_release_queue``, and ``revoked`` counts the prefetches its drain revoked
        (``_revoke_pending_prefetch`` on a live entry)."""
        cc = self.controller
        writes, loads = len(cc.ack_write_queue), len(cc.ack_load_queue)
        self._revoked = 0
        self._taken = {"backups": 0, "host_releases": 0}
        self.cache.check_hicache_events()
        return EventsResult(
            writes=writes - len(cc.ack_write_queue),
            loads=loads - len(cc.ack_load_queue),
            revoked=self._revoked,
            backups=self._taken["backups"],
            host_releases=self._taken["host_releases"],
        )

    def _took(self, name: str) -> Callable[[Any], None]:
        """An ``on_get`` hook counting the items the scheduler's drain takes, as ``name``: counted at the
        ``get``, so an item the same drain puts back (UnifiedRadixCache queues a prefetch's unread tail for
        release while draining, D-52) is not subtracted."""

        def took(_item: Any) -> None:
            self._taken[name] = self._taken.get(name, 0) + 1

        return took

    def busy(self) -> bool:
        """Refcache's "idle and drained" test (D-16) on SGLang's state: the queues this release's controller
        has (0.5.20 and 0.5.23 alike)."""
        cache, cc = self.cache, self.controller
        return bool(
            self.requests
            or cache.ongoing_write_through
            or cache.ongoing_load_back
            or cache.ongoing_prefetch
            or cache.ongoing_backup
            or cc.ack_write_queue
            or cc.ack_load_queue
            or getattr(cc, "write_queue", None)  # 0.5.23's controller has neither queue
            or getattr(cc, "load_queue", None)
            or (self.config.enable_storage and self._storage_busy())
        )

    def _storage_busy(self) -> bool:
        """The storage pipeline's share of ``busy``. A storage thread waiting in an all-reduce for its peer's step
        (two ranks) counts, as the model's parked query does (``prefetch_parked``): the query of a prefetch that
        ended before it ran has left the queue and the operations, yet its peer has it still queued."""
        cc = self.controller
        return bool(
            self._ops
            or (self.gate is not None and self.gate.contributions())
            or cc.prefetch_queue.qsize()
            or cc.prefetch_buffer.qsize()
            or (not self.allocated_at_admission and cc.prefetch_hit_queue.qsize())
            or (self.revoke_queue and cc.prefetch_revoke_queue.qsize())
            or (not self.io_releases_tail and cc.ack_prefetch_queue.qsize())
            or cc.backup_queue.qsize()
            or cc.ack_backup_queue.qsize()
            or cc.host_mem_release_queue.qsize()
        )

    def _reset(self) -> bool:
        """``flush_cache``: refused unless idle and drained (D-16); then ``reset()`` and, as the scheduler's
        ``flush_cache`` does, the request and token pools (``reset`` leaves the device allocator alone)."""
        if self.busy():
            return False
        self.cache.reset()
        if self.gate is not None:
            self.gate.restart_collectives()
        self.allocator.clear()
        self.req_to_token_pool.clear()
        if self.gate is not None:
            self._ops.clear()
            self._io_done.clear()
            self._queried.clear()
            self._querying = None
            self._number_ops()
            self._started_io(self.gate)
            self._set_roles()  # the queues stay, the threads are new
            self._settle()
        return True

    def _complete(self, queue: IOQueue, count: int) -> int:
        """``CompleteIO``: WRITE and LOAD fire the events of the oldest unfinished acks (``_gate``); the
        storage queues let SGLang's thread run one item per token (``_storage``): PREFETCH_QUERY one hit
        query, PREFETCH_IO one batch read, BACKUP one backup operation."""
        cc = self.controller
        if queue is IOQueue.WRITE:
            return _gate.complete(cc.ack_write_queue, count)
        if queue is IOQueue.LOAD:
            return _gate.complete(cc.ack_load_queue, count)
        gate = self.gate
        if gate is None:
            return 0
        runnable: Callable[[], bool]
        if queue is IOQueue.PREFETCH_QUERY:
            # (two ranks) not while the thread waits in the all-reduce of its last query (the model's parked
            # query): it takes the next one after that all-reduce returned
            runnable = lambda: cc.prefetch_queue.qsize() > 0 and not gate.in_all_reduce("prefetch_hits")  # noqa: E731
        elif queue is IOQueue.BACKUP:
            runnable = lambda: cc.backup_queue.qsize() > 0  # noqa: E731
        else:
            runnable = lambda: gate.where(cc.prefetch_io_aux_thread) == IOQueue.PREFETCH_IO.value  # noqa: E731
        done = 0
        while done < count and runnable():
            gate.grant(queue)
            self._settle()
            if not gate.spent(queue):
                raise _storage.EngineThreadError(f"SGLang's {queue.value} thread did not take its step")
            done += 1
        return done
