"""HiCache configuration: SGLang's option names, the seed's defaults, validation and automatic rewrites.

``HiCacheConfig`` is a frozen record. ``HiCacheConfig(...)`` only checks types and ranges of single
options; ``resolve()`` applies the cross-option rules of seed §5.3/§5.6 (layout, io backend and decode
backend rewrites, each with a ``ConfigRewriteWarning`` that says what changed and why) and the rules that
reject a configuration outright (hierarchical cache with the radix cache disabled; host capacity not
larger than device capacity; out-of-scope backends). Model and implementation both take a resolved
configuration.

Capacities are in tokens. ``device_size`` stands for what SGLang derives from ``--mem-fraction-static``;
the host size follows seed §6: ``hicache_size`` (GB per rank) wins over ``hicache_ratio``, then the size is
rounded to ``(size // page_size + 1) * page_size`` and must exceed the device size.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, TypeVar

from refcache.errors import ConfigError, UnsupportedError
from refcache.sglang_releases import DRIVEN_POSTS, RELEASES, SUPPORTED, Before, Releases, Since, Until, parse

__all__ = [
    "FIDELITY_OPTIONS",
    "PROFILES",
    "AttentionKind",
    "ConfigRewriteWarning",
    "EvictionPolicy",
    "HiCacheConfig",
    "IOBackend",
    "MemLayout",
    "PrefetchPolicy",
    "WritePolicy",
]


class WritePolicy(enum.StrEnum):
    """``--hicache-write-policy``: when L1 data is copied to L2 (seed §3.5)."""

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


class IOBackend(enum.StrEnum):
    """``--hicache-io-backend``: how host<->device copies run (seed §5.4)."""

    KERNEL = "kernel"
    DIRECT = "direct"


class MemLayout(enum.StrEnum):
    """``--hicache-mem-layout``: host buffer dimension order (seed §5.3)."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"
    PAGE_HEAD = "page_head"


class PrefetchPolicy(enum.StrEnum):
    """``--hicache-storage-prefetch-policy``: when a running L3 prefetch may stop (seed §3.6)."""

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


class EvictionPolicy(enum.StrEnum):
    """``--radix-eviction-policy``: the six strategies of ``evict_policy.py`` (seed §3.1 ②)."""

    LRU = "lru"
    LFU = "lfu"
    FIFO = "fifo"
    MRU = "mru"
    FILO = "filo"
    PRIORITY = "priority"


class AttentionKind(enum.StrEnum):
    """The device KV pool type that selects the host pool class (seed §5.1)."""

    MHA = "MHA"
    MLA = "MLA"


class ConfigRewriteWarning(UserWarning):
    """Emitted by ``HiCacheConfig.resolve`` when it changes an option, as SGLang's ``_handle_hicache`` does.

    The message names the option, the old and new value, and the reason. To silence it, pass the value
    that resolution would choose.
    """


_STORAGE_BACKENDS: Final = ("file", "memory")
_OUT_OF_SCOPE_STORAGE: Final = ("mooncake", "hf3fs", "nixl", "aibrix", "eic", "lmcache", "dynamic")
_OUT_OF_SCOPE_IO: Final = ("kernel_ascend",)
_OUT_OF_SCOPE_LAYOUT: Final = ("page_first_kv_split",)
_DTYPES: Final = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2")
_DTYPE_BYTES: Final = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}


_E = TypeVar("_E", bound=enum.StrEnum)


def _enum_value(kind: type[_E], option: str, value: object) -> _E:
    if isinstance(value, kind):
        return value
    try:
        return kind(str(value))
    except ValueError:
        choices = ", ".join(repr(m.value) for m in kind)
        raise ConfigError(f"{option}={value!r} is not one of {choices}") from None


FIDELITY_OPTIONS: Final[Mapping[str, str]] = {
    "D-01": "allocate_prefetch_after_query",
    "D-07": "backup_protects_passed_node_only",
    "D-10": "drop_subtree_without_host",
    "D-13": "prefetch_below_last_host_node",
    "D-24": "reinsert_prompt_prefix",
    "D-35": "count_hits_per_request",
    "D-36": "priority_after_split",
    "D-37": "evict_host_shortfall",
    "D-38": "merge_write_acks",
    "D-42": "evict_request_size_on_admission",
    "D-44": "write_back_per_victim",
    "D-45": "split_keeps_creation_time",
    "D-46": "last_host_node_is_best_match",
    "D-47": "load_back_evicts_shortfall",
    "D-48": "reclaim_host_duplicates",
    "D-49": "free_duplicates_per_node",
    "D-50": "count_hits_on_refill",
    "D-51": "root_priority_from_inserts",
    "D-52": "release_unread_prefetch_tail",
    "D-53": "backup_per_fragment",
    "D-54": "prefetch_progress_in_operation",
    "D-55": "prefetch_timeout_from_first_poll",
    "D-56": "host_pool_rounded_down",
    "D-57": "anchor_pin_follows_split",
    "D-58": "revoke_at_query",
    "D-59": "prefetch_admission_falls_back",
    "D-60": "prefetch_cap_half_host",
    "D-61": "prefetch_timeout_capped",
    "D-62": "prefetch_takes_root_priority",
    "D-63": "terminated_prefetch_reads_batch",
    "D-64": "prefetch_timeout_in_floats",
    "D-65": "tail_freed_before_insert",
    "D-66": "failed_write_back_keeps_node",
    "D-67": "write_back_flush_skips_storage",
    "D-68": "loads_retired_per_rank",
}
"""Each decision where refcache chose otherwise than a SGLang release, and the option that follows that
release instead. Off by default; ``PROFILES`` says which ones each release follows."""

FOLLOWED_BY: Final[Mapping[str, Releases]] = {
    # hiradix_cache.py _drain_and_alloc_storage_hit, first in 0.5.16; up to 0.5.15 prefetch_from_storage allocates
    "allocate_prefetch_after_query": Since("0.5.16"),
    # fixed in 0.5.22: a split under the backup's host lock moves its boundary to the new prefix (a segment)
    "backup_protects_passed_node_only": Until("0.5.21"),
    # hiradix_cache.py evict's _drop_subtree_no_host, first in 0.5.15; up to 0.5.14 (0.5.9 included) a failed
    # write-back backup is still asserted backed up (sglang.md §9 #7), so no model side follows those releases
    "drop_subtree_without_host": Since("0.5.15"),
    # HiRadixCache's last_host_node is always backed up; UnifiedRadixCache's is the best match (D-46), which the
    # scheduler's is_backuped test refuses when it is device-only: the seed's test (D-13)
    "prefetch_below_last_host_node": Until("0.5.20"),
    "reinsert_prompt_prefix": Since("0.5.20"),  # radix_cache.py cache_finished_req, first in 0.5.20
    "count_hits_per_request": Since("0.5.22"),  # 0.5.21 does only the refill half, D-50
    "priority_after_split": Since("0.5.21"),
    "evict_host_shortfall": Since("0.5.21"),
    "merge_write_acks": Since("0.5.21"),
    "evict_request_size_on_admission": Until("0.5.16"),  # common.py evict_from_tree_cache, until 0.5.16
    "write_back_per_victim": Since("0.5.21"),  # unified_radix_cache.py _evict_components
    "split_keeps_creation_time": Since("0.5.21"),  # unified_tree_core.py _split_node
    "last_host_node_is_best_match": Since("0.5.21"),  # unified_tree_core.py match_prefix
    "load_back_evicts_shortfall": Since("0.5.21"),  # unified_radix_cache.py load_back
    "reclaim_host_duplicates": Since("0.5.21"),  # unified_tree_core.py _reclaim_full_host_duplicates
    "free_duplicates_per_node": Since("0.5.21"),  # unified_tree_core.py insert walk, FreeDeviceKV per node
    "count_hits_on_refill": Since("0.5.21"),  # unified_tree_core.py insert walk (D-35 counts it too)
    "root_priority_from_inserts": Since(
        "0.5.21"
    ),  # unified_tree_core.py insert: the root's priority is raised
    "release_unread_prefetch_tail": Since("0.5.21"),  # unified_radix_cache.py _drain_ack_prefetch
    "backup_per_fragment": Since("0.5.21"),  # unified_radix_cache.py _finish_write_through_ack
    # cache_controller.py: no prefetch_sync_queue / ack_prefetch_queue before 0.5.19 (PrefetchAck is new there)
    "prefetch_progress_in_operation": Until("0.5.18"),
    # unified_radix_cache.py _StoragePrefetchWait (a PollTimer), _prefetch_deadline_expired
    "prefetch_timeout_from_first_poll": Since("0.5.23"),
    # memory_pool_host.py HostKVCache: size - size % page_size (0.5.5:66-68; 0.5.5.post3:70-72 rounds up, as 0.5.6)
    "host_pool_rounded_down": Before("0.5.5.post3"),
    # components/full.py redistribute_on_node_split: a host lock is a segment, a split copies it to the new prefix
    "anchor_pin_follows_split": Since("0.5.22"),
    # cache_controller.py prefetch_thread_func: prefetch_revoke_queue, removed in 0.5.18 (the drain revokes)
    "revoke_at_query": Until("0.5.17"),
    # hiradix_cache.py prefetch_from_storage: available_size's page-aligned part once evict_host fell short (0.5.11
    # on; 0.5.10 refuses); from 0.5.16 nothing is allocated at admission (D-01: the drain falls back as well)
    "prefetch_admission_falls_back": Releases("0.5.11", "0.5.15"),
    # cache_controller.py attach_storage_backend: int(0.5 * mem_pool_host.size), first in 0.5.15 (0.5.14:
    # int(0.8 * (host - device))); from 0.5.16 D-01's pipeline has that cap itself
    "prefetch_cap_half_host": Releases("0.5.15", "0.5.15"),
    # hiradix_cache.py _prefetch_timeout_check_linear_func: min(max, base + per_ki_token * tokens / 1024), first in
    # 0.5.12 (0.5.11: base + pages * per_page); from 0.5.16 D-01's pipeline times so itself (D-39)
    "prefetch_timeout_capped": Releases("0.5.12", "0.5.15"),
    # radix_cache.py: the root is TreeNode(priority=-sys.maxsize) and hiradix_cache.py _insert_helper_host's new
    # node takes its parent's priority (0.5.6 on; 0.5.5 has no priority); from 0.5.16 under D-01 (D-39)
    "prefetch_takes_root_priority": Releases("0.5.6", "0.5.15"),
    # cache_controller.py _page_transfer: page_get_func before any termination test (the same code 0.5.10..0.5.18);
    # from 0.5.19 prefetch_io_aux_func skips the read of a terminated operation
    "terminated_prefetch_reads_batch": Until("0.5.18"),
    # hiradix_cache.py _prefetch_timeout_check_linear_func: base + len(hash_value) * per_page on clock seconds, in
    # floats (0.5.5, 0.5.6, 0.5.10, 0.5.11 read); from 0.5.12 D-61's min(max, ...)
    "prefetch_timeout_in_floats": Until("0.5.11"),
    # radix_cache.py cache_finished_req: the unaligned tail is freed before the insert (0.5.4 on: after it)
    "tail_freed_before_insert": Until("0.5.3"),
    # hiradix_cache.py evict: a write_back victim whose write_backup found no host memory is skipped, left on the
    # device (0.5.11:874-880, ``written > 0``); 0.5.10 counts it and asserts it backed up (crashes, sglang.md §9
    # #7); 0.5.15 on drops it (_drop_subtree_no_host, D-10)
    "failed_write_back_keeps_node": Releases("0.5.11", "0.5.14"),
    # hiradix_cache.py writing_check(write_back=True): the blocking flush of a write_back eviction retires its acks
    # without queueing their nodes' L2 -> L3 backups (0.5.8:276-285); 0.5.9 on backs each up (0.5.9:671, PR #14718)
    "write_back_flush_skips_storage": Until("0.5.8"),
    # hiradix_cache.py loading_check: each rank retires the loads its own stream finished, no collective ("batch
    # forwarding is synced", 0.5.3:306-319, 0.5.5:318-331, 0.5.10:700-713, 0.5.12:791-804); 0.5.13 on: a MIN
    "loads_retired_per_rank": Until("0.5.12"),
}
"""Each fidelity option -> the SGLang releases that behave as it says (specs/decisions.md, each decision's
release range); ``PROFILES`` has a ``sglang-X.Y.Z`` for every supported release, derived from it."""

FOLLOWED_BY_UNIFIED: Final[Mapping[str, Releases]] = {
    # D-35's count_hits_per_request stays 0.5.22 on: 0.5.19's and 0.5.20's UnifiedRadixCache count no hit at a
    # chunked insert (as HiRadixCache) but one on a node an insert refills (D-50, as 0.5.22)
    "count_hits_on_refill": Since("0.5.19"),  # unified_tree_core.py: the hit after _unevict_node_on_insert
    "priority_after_split": Since("0.5.20"),  # unified_tree_core.py: split first, then the matched part
    "split_keeps_creation_time": Since("0.5.19"),  # unified_tree_core.py _split_node
    "evict_host_shortfall": Since("0.5.19"),  # a write_back backup short of host memory evicts the shortfall
    "reclaim_host_duplicates": Since("0.5.19"),  # unified_tree_core.py _reclaim_full_host_duplicates (D-48)
    "write_back_per_victim": Since("0.5.19"),  # unified_radix_cache.py _evict_components (D-44)
    "last_host_node_is_best_match": Since("0.5.19"),  # unified_tree_core.py match_prefix (D-46)
    "load_back_evicts_shortfall": Since("0.5.19"),  # unified_radix_cache.py load_back (D-47)
    "free_duplicates_per_node": Since("0.5.19"),  # unified_tree_core.py insert walk, FreeDeviceKV (D-49)
    "root_priority_from_inserts": Since(
        "0.5.19"
    ),  # unified_tree_core.py insert: max(root.priority, priority)
    "release_unread_prefetch_tail": Since("0.5.19"),  # the final ack's unread tail to host_mem_release_queue
    "backup_per_fragment": Since("0.5.19"),  # _finish_write_through_ack: one backup per published node
    "prefetch_below_last_host_node": Until("0.5.18"),  # none: _prefetch_kvcache's is_backuped test (D-13)
}
"""Where UnifiedRadixCache behaves as an option says on a release whose default system drives HiRadixCache
(``Release.also``: 0.5.19 and 0.5.20, whose schedulers build UnifiedRadixCache although refcache's ``sglang``
drives their HiRadixCache): each option -> the releases whose UnifiedRadixCache does it; an option not here follows
``FOLLOWED_BY``. The ``sglang-X.Y.Z-unified`` profiles are derived from it."""

PROFILES: Final[Mapping[str, Mapping[str, bool]]] = {
    "refcache": dict.fromkeys(FIDELITY_OPTIONS.values(), False),
    **{
        f"sglang-{version}": {option: version in FOLLOWED_BY[option] for option in FIDELITY_OPTIONS.values()}
        for version in sorted((*SUPPORTED, *DRIVEN_POSTS), key=parse)
    },
    **{
        f"sglang-{r.version}-unified": {
            option: r.version in FOLLOWED_BY_UNIFIED.get(option, FOLLOWED_BY[option])
            for option in FIDELITY_OPTIONS.values()
        }
        for r in RELEASES
        if "sglang-unified" in r.also
    },
}
"""Named sets of fidelity options: ``refcache`` (the decisions of specs/decisions.md, the default) and, for
every supported SGLang release (``refcache.engines.sglang.versions.SUPPORTED``) and every post release it drives
(``DRIVEN_POSTS``: ``sglang-0.5.5.post3``, each range evaluated at the post release itself, as ``_compat``'s rows
are; a range written in releases holds their post releases), ``sglang-X.Y.Z``: what that release does (``FOLLOWED_BY``; ``sglang-X.Y.Z-unified``: its UnifiedRadixCache where its default system drives
HiRadixCache, ``FOLLOWED_BY_UNIFIED``), bugs of sglang.md §9 excepted but one: D-07's unpinned backup fragment, §9
#15, which L3 runs against the engine reach at once (specs/sglang-adapter.md, "Releases")."""


@dataclass(frozen=True, kw_only=True)
class HiCacheConfig:
    """Every option of seed §6 under SGLang's name, with the seed's default, plus the test-scale knobs.

    Raises ``ConfigError`` for a bad single option and ``UnsupportedError`` for an out-of-scope name.
    """

    # --- seed §6, SGLang names and defaults ------------------------------------------------------------
    enable_hierarchical_cache: bool = True
    disable_radix_cache: bool = False
    page_size: int = 1
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0  # GB per rank; > 0 wins over hicache_ratio
    hicache_write_policy: WritePolicy = WritePolicy.WRITE_THROUGH_SELECTIVE
    hicache_io_backend: IOBackend = IOBackend.KERNEL
    hicache_mem_layout: MemLayout = MemLayout.LAYER_FIRST
    hicache_storage_backend: str | None = None  # None: only L1 + L2
    hicache_storage_prefetch_policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT
    radix_eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    prefetch_threshold: int = 256  # tokens; clamped to >= page_size (see ``effective_prefetch_threshold``)
    prefetch_timeout_base: float = 1.0  # seconds
    prefetch_timeout_per_ki_token: float = 0.25  # seconds per 1024 tokens
    decode_attention_backend: str | None = None  # only matters for the fa3 rewrite of seed §5.6
    # --- parallelism and model shape ----------------------------------------------------------------------
    tp_size: int = 1
    attention: AttentionKind = AttentionKind.MHA
    is_eagle: bool = False  # EAGLE bigram keys (seed §5.7)
    model_name: str = "refcache"  # L3 key suffix (seed §5.5)
    # --- capacities and constants (SGLang derives device_size from --mem-fraction-static) -----------------
    device_size: int = 64  # L1 capacity in tokens
    load_back_threshold: int = 10  # tokens; smaller host hits are not loaded (seed §2.3)
    storage_batch_size: int = 128  # pages per L3 batch (seed §2.2, §4.2)
    # --- KV dimensions (data plane only; the model ignores them) -------------------------------------------
    layer_num: int = 2
    head_num: int = 2  # heads on this rank (after the TP split)
    head_dim: int = 8
    kv_lora_rank: int = 8
    qk_rope_head_dim: int = 4
    dtype: str = "float16"
    # --- fidelity: follow SGLang 0.5.20 where refcache decided otherwise (specs/decisions.md) -----------------
    drop_subtree_without_host: bool = False  # D-10: 0.5.20's _drop_subtree_no_host
    reinsert_prompt_prefix: bool = False  # D-24: 0.5.20's prompt-boundary re-insert in cache_finished_req
    count_hits_per_request: bool = False  # D-35: 0.5.23 counts a hit once per request, at every insert
    priority_after_split: bool = False  # D-36: 0.5.23 raises an insert's priority on the matched part only
    evict_host_shortfall: bool = False  # D-37: a backup short of host memory evicts the shortfall (0.5.23)
    merge_write_acks: bool = False  # D-38: 0.5.23 merges one step's backups into one copy and one write ack
    allocate_prefetch_after_query: bool = False  # D-01: 0.5.20's prefetch pipeline (host memory at the drain)
    prefetch_below_last_host_node: bool = False  # D-13: 0.5.20 admits below an unbacked last node
    backup_protects_passed_node_only: bool = False  # D-07: 0.5.20 pins only that node (sglang.md §9 #15)
    evict_request_size_on_admission: bool = False  # D-42: up to 0.5.16 admission evicts the whole size
    write_back_per_victim: bool = False  # D-44: 0.5.22 on, write_back evicts victim by victim
    split_keeps_creation_time: bool = False  # D-45: 0.5.22 on, a split keeps the creation time
    last_host_node_is_best_match: bool = False  # D-46: 0.5.22 on, a match's last_host_node is its last node
    load_back_evicts_shortfall: bool = False  # D-47: 0.5.22 on, a load back evicts only the shortfall
    reclaim_host_duplicates: bool = False  # D-48: 0.5.22 on, write_back evict_host frees duplicates first
    free_duplicates_per_node: bool = False  # D-49: 0.5.22 on, an insert frees duplicates node by node
    count_hits_on_refill: bool = False  # D-50: Unified from 0.5.19, an insert counts a hit on refilled nodes
    root_priority_from_inserts: bool = False  # D-51: Unified, the root's priority is the max of the inserts'
    release_unread_prefetch_tail: bool = False  # D-52: Unified, a prefetch's unread tail to the release queue
    backup_per_fragment: bool = False  # D-53: Unified, a split write-through is backed up per fragment
    prefetch_progress_in_operation: bool = False  # D-54: up to 0.5.18, no prefetch acks (under D-01)
    prefetch_timeout_from_first_poll: bool = (
        False  # D-55: 0.5.23, the timeout runs from the first blocked check
    )
    host_pool_rounded_down: bool = False  # D-56: up to 0.5.5, the host pool is rounded down to whole pages
    anchor_pin_follows_split: bool = (
        False  # D-57: 0.5.22 on, a split anchor's host pin covers the new prefix too
    )
    revoke_at_query: bool = False  # D-58: up to 0.5.17, the query revokes through a queue (under D-01, D-54)
    prefetch_admission_falls_back: bool = False  # D-59: 0.5.11..0.5.15, admission falls back to a shorter key
    prefetch_cap_half_host: bool = False  # D-60: 0.5.15, in-flight prefetch tokens capped at int(0.5 * host)
    prefetch_timeout_capped: bool = False  # D-61: 0.5.12..0.5.15, the timeout is min(max, ...) in floats
    prefetch_takes_root_priority: bool = False  # D-62: 0.5.6..0.5.15, pages under the root get -sys.maxsize
    terminated_prefetch_reads_batch: bool = False  # D-63: up to 0.5.18, a terminated prefetch reads one batch
    prefetch_timeout_in_floats: bool = False  # D-64: up to 0.5.11, the seed's timeout compared in floats
    tail_freed_before_insert: bool = False  # D-65: up to 0.5.3, a finish frees the unaligned tail first
    failed_write_back_keeps_node: bool = False  # D-66: 0.5.11..0.5.14, a victim short of host stays
    write_back_flush_skips_storage: bool = False  # D-67: up to 0.5.8, write_back's flush queues no L3 backup
    loads_retired_per_rank: bool = False  # D-68: up to 0.5.12, each rank retires its own finished loads

    def __post_init__(self) -> None:
        # Accept plain strings for enum options (JSON, CLI) and normalise them.
        for option, kind in (
            ("hicache_write_policy", WritePolicy),
            ("hicache_io_backend", IOBackend),
            ("hicache_mem_layout", MemLayout),
            ("hicache_storage_prefetch_policy", PrefetchPolicy),
            ("radix_eviction_policy", EvictionPolicy),
            ("attention", AttentionKind),
        ):
            raw = getattr(self, option)
            if option == "hicache_io_backend" and raw in _OUT_OF_SCOPE_IO:
                raise UnsupportedError(
                    f"hicache_io_backend={raw!r} (Ascend NPU) is out of scope; use 'kernel' or 'direct'"
                )
            if option == "hicache_mem_layout" and raw in _OUT_OF_SCOPE_LAYOUT:
                raise UnsupportedError(
                    f"hicache_mem_layout={raw!r} (Ascend NPU) is out of scope; use layer_first, page_first, "
                    "page_first_direct or page_head"
                )
            object.__setattr__(self, option, _enum_value(kind, option, raw))
        for option in (
            "page_size",
            "tp_size",
            "device_size",
            "storage_batch_size",
            "layer_num",
            "head_num",
            "head_dim",
        ):
            value = getattr(self, option)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{option}={value!r} must be a positive integer")
        for option in ("prefetch_threshold", "load_back_threshold", "kv_lora_rank", "qk_rope_head_dim"):
            value = getattr(self, option)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{option}={value!r} must be a non-negative integer")
        for option in (
            "hicache_ratio",
            "hicache_size",
            "prefetch_timeout_base",
            "prefetch_timeout_per_ki_token",
        ):
            value = getattr(self, option)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < math.inf:
                raise ConfigError(f"{option}={value!r} must be a finite non-negative number")
        for option in (
            "enable_hierarchical_cache",
            "disable_radix_cache",
            "is_eagle",
            *FIDELITY_OPTIONS.values(),
        ):
            if not isinstance(getattr(self, option), bool):
                raise ConfigError(f"{option}={getattr(self, option)!r} must be True or False")
        if not isinstance(self.model_name, str) or not self.model_name:  # type: ignore[redundant-expr]
            raise ConfigError(
                f"model_name={self.model_name!r} must be a non-empty string (it suffixes L3 keys)"
            )
        if self.decode_attention_backend is not None and not isinstance(self.decode_attention_backend, str):
            raise ConfigError(
                f"decode_attention_backend={self.decode_attention_backend!r} must be a string or None"
            )
        if self.hicache_storage_backend is not None:
            if self.hicache_storage_backend in _OUT_OF_SCOPE_STORAGE:
                raise UnsupportedError(
                    f"hicache_storage_backend={self.hicache_storage_backend!r} is out of scope; refcache models "
                    f"L3 with one of {', '.join(_STORAGE_BACKENDS)}"
                )
            if self.hicache_storage_backend not in _STORAGE_BACKENDS:
                raise ConfigError(
                    f"hicache_storage_backend={self.hicache_storage_backend!r} is not one of "
                    f"{', '.join(_STORAGE_BACKENDS)} (or None for no L3)"
                )
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not one of {', '.join(_DTYPES)}")
        if self.attention is AttentionKind.MLA and self.kv_lora_rank + self.qk_rope_head_dim == 0:
            raise ConfigError("MLA needs kv_lora_rank + qk_rope_head_dim > 0")

    # --- derived values -------------------------------------------------------------------------------------

    @property
    def enable_storage(self) -> bool:
        """Whether L3 exists (``--hicache-storage-backend`` given)."""
        return self.hicache_storage_backend is not None

    @property
    def write_through_threshold(self) -> int:
        """Hits that trigger L1→L2: 1 for write_through, 2 otherwise (seed §3.5)."""
        return 1 if self.hicache_write_policy is WritePolicy.WRITE_THROUGH else 2

    @property
    def effective_prefetch_threshold(self) -> int:
        """``max(prefetch_threshold, page_size)`` (seed §3.6)."""
        return max(self.prefetch_threshold, self.page_size)

    @property
    def bytes_per_token(self) -> int:
        """Host bytes per token on one rank (seed §5.2)."""
        itemsize = _DTYPE_BYTES[self.dtype]
        if self.attention is AttentionKind.MHA:
            return self.head_dim * self.head_num * self.layer_num * itemsize * 2
        return (self.kv_lora_rank + self.qk_rope_head_dim) * itemsize * self.layer_num

    @property
    def host_size(self) -> int:
        """Host pool capacity in tokens: from hicache_size or hicache_ratio, then page-rounded (seed §6): one
        page more than the whole pages it holds; ``host_pool_rounded_down`` (D-56, SGLang up to 0.5.5): the
        whole pages only."""
        if self.hicache_size > 0:
            size = int(self.hicache_size * 1e9 // self.bytes_per_token)
        else:
            size = int(self.device_size * self.hicache_ratio)
        page_num = size // self.page_size + (0 if self.host_pool_rounded_down else 1)
        return page_num * self.page_size

    @property
    def prefetch_capacity_limit(self) -> int:
        """In-flight prefetch tokens allowed: ``int(0.8 * (L2 - L1))`` (seed §3.6, §6)."""
        return int(0.8 * (self.host_size - self.device_size))

    @property
    def prefetch_capacity_limit_0520(self) -> int:
        """0.5.20's cap on in-flight prefetch tokens (D-01): ``int(0.5 * host_size)``."""
        return int(0.5 * self.host_size)

    @property
    def prefetch_timeout_base_us(self) -> int:
        return round(self.prefetch_timeout_base * 1_000_000)

    @property
    def prefetch_timeout_per_ki_token_us(self) -> int:
        return round(self.prefetch_timeout_per_ki_token * 1_000_000)

    # --- cross-option rules ---------------------------------------------------------------------------------

    def resolve(self) -> HiCacheConfig:
        """Apply seed §5.3/§5.6 rewrites (warning for each) and reject impossible combinations.

        Raises ``ConfigError`` when the hierarchical cache is off or the radix cache disabled, when the
        host pool would not be larger than the device pool, or for page_head with MLA.
        """
        if not self.enable_hierarchical_cache:
            raise ConfigError("enable_hierarchical_cache=False: refcache models HiCache; set it to True")
        if self.disable_radix_cache:
            raise ConfigError(
                "enable_hierarchical_cache and disable_radix_cache are mutually exclusive (SGLang "
                "server_args.py rejects the pair); set disable_radix_cache=False"
            )
        cfg = self
        if (
            cfg.hicache_mem_layout is MemLayout.PAGE_FIRST_DIRECT
            and cfg.hicache_io_backend is not IOBackend.DIRECT
        ):
            cfg = cfg._rewrite(
                "hicache_io_backend",
                IOBackend.DIRECT,
                "the page_first_direct layout only supports the direct io backend",
            )
        if cfg.hicache_io_backend is IOBackend.DIRECT and cfg.hicache_mem_layout is MemLayout.PAGE_FIRST:
            cfg = cfg._rewrite(
                "hicache_mem_layout",
                MemLayout.PAGE_FIRST_DIRECT,
                "the page_first layout is not supported with the direct io backend",
            )
        if cfg.hicache_io_backend is IOBackend.KERNEL:
            if cfg.decode_attention_backend is None:
                # Not a user-visible change of an explicit option, so no warning (SGLang logs nothing either).
                cfg = dataclasses.replace(cfg, decode_attention_backend="triton")
            elif cfg.decode_attention_backend == "fa3":
                cfg = cfg._rewrite(
                    "hicache_io_backend",
                    IOBackend.DIRECT,
                    "the FlashAttention3 decode backend is not compatible with the hierarchical cache kernel io "
                    "backend; using direct I/O, which may be slower with small page sizes",
                )
                if cfg.hicache_mem_layout is MemLayout.PAGE_FIRST:
                    cfg = cfg._rewrite(
                        "hicache_mem_layout",
                        MemLayout.PAGE_FIRST_DIRECT,
                        "the page_first layout is not supported with the direct io backend",
                    )
        if cfg.hicache_mem_layout is MemLayout.PAGE_HEAD and cfg.attention is AttentionKind.MLA:
            raise ConfigError(
                "hicache_mem_layout='page_head' is MHA only; for MLA use layer_first, page_first or page_first_direct"
            )
        if cfg.hicache_mem_layout is MemLayout.PAGE_HEAD and cfg.hicache_io_backend is IOBackend.DIRECT:
            raise ConfigError(
                "hicache_mem_layout='page_head' needs hicache_io_backend='kernel' (seed §5.4 has no direct row)"
            )
        if cfg.host_size <= cfg.device_size:
            raise ConfigError(
                f"host capacity {cfg.host_size} tokens is not larger than device capacity {cfg.device_size} tokens "
                "(seed §6: the host memory must be larger than the device memory); raise hicache_ratio above 1 "
                "or hicache_size"
            )
        return cfg

    def with_fidelity(self, options: Mapping[str, bool]) -> HiCacheConfig:
        """A copy with fidelity options set (``FIDELITY_OPTIONS`` values, e.g. a ``PROFILES`` entry).
        Raises ``ConfigError`` for any other name."""
        unknown = sorted(set(options) - set(FIDELITY_OPTIONS.values()))
        if unknown:
            raise ConfigError(
                f"{unknown} are not fidelity options; known: {sorted(FIDELITY_OPTIONS.values())}"
            )
        return dataclasses.replace(self, **options)  # type: ignore[arg-type]

    def _rewrite(self, option: str, value: object, why: str) -> HiCacheConfig:
        old = getattr(self, option)
        warnings.warn(
            f"{option} changed from {old!s} to {value!s}: {why}", ConfigRewriteWarning, stacklevel=3
        )
        return dataclasses.replace(self, **{option: value})  # type: ignore[arg-type]

    # --- codec ----------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict of every field (enums as their SGLang strings)."""
        out: dict[str, object] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = value.value if isinstance(value, enum.Enum) else value
        return out

    @classmethod
    def from_json(cls, data: dict[str, object]) -> HiCacheConfig:
        """Inverse of ``to_json``; unknown keys raise ``ConfigError``."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown configuration keys {unknown}; known keys are {sorted(known)}")
        return cls(**data)  # type: ignore[arg-type]

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)
