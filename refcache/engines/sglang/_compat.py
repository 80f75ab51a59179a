"""What differs between the SGLang releases the HiRadixCache adapter (``_adapter``, ``_tp``, ``_storage``,
``_snapshot``, ``_runtime``) and the UnifiedRadixCache adapter (``_unified``, written against 0.5.23) drive, as data: one row per API difference, with the releases it applies to.

The adapter is written against 0.5.20; where an older release differs, it asks ``compat.has(ROW)`` for the
installed release and takes that release's way at that one spot. No adapter code is copied per release: a
row names one difference (a module that moved, an argument passed instead of published, a field renamed), and
each is consulted at one place. Behaviour that changed between releases (not an API) is not here: it is a
fidelity option of the model with its release range (``refcache.config``; specs/decisions.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from refcache.engines.sglang import versions
from refcache.engines.sglang.versions import Before, Releases, Since, Until
from refcache.errors import UsageError

__all__ = [
    "MODULES",
    "ROWS",
    "Compat",
    "Row",
    "excluded_values",
    "installed_excluded_values",
    "installed_unified_counts_unreaped_loads",
]


@dataclass(frozen=True)
class Row:
    """One API difference between releases."""

    name: str  # what the adapter asks (``Compat.has``)
    releases: Releases  # where the difference applies (the releases that do it the older way)
    what: str  # the difference, in a line: what those releases do


ROWS: Final[tuple[Row, ...]] = (
    Row(
        "prefetch_timeout_from_start",
        Until("0.5.22"),
        "the timeout policy compares time.monotonic() - operation.start_time in _prefetch_timeout_check_linear_func "
        "(0.5.23 on: a PollTimer over time.perf_counter from the first blocked check, utils/poll_timer.py; D-55)",
    ),
    Row(
        "storage_config_without_dcp_rank",
        Until("0.5.22"),
        "the storage backend's configuration (_generate_storage_config) reads no decode context-parallel rank "
        "(0.5.23 on: get_parallel().attn_dcp_rank, which nothing writes without the groups: stated as 0)",
    ),
    # UnifiedRadixCache (``_unified``), on the releases that ship it and refcache drives with it: 0.5.19 on
    Row(
        "tree_core_backend_from_env",
        Until("0.5.20"),
        "CacheInitParams has no tree_core_backend: UnifiedRadixCache reads SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND "
        "(default python) (0.5.21 on: tree_core_backend=, the environment variable its default)",
    ),
    Row(
        "match_device_indices",
        Until("0.5.21"),
        "MatchResult carries the device slots (device_indices) and init_load_back returns the loaded slots "
        "(0.5.22 on: device_prefix_len and the loaded length; the slots asked of path_device_indices(last node))",
    ),
    Row(
        "lock_by_node_id",
        Until("0.5.21"),
        "inc_lock_ref(node) returns a receipt for dec_lock_ref(node, receipt), the request's kept as "
        "req.lock_receipt on req.last_node (0.5.22 on: lock(node) returns a TreeLock for unlock(lock), req.lock)",
    ),
    Row(
        "request_lock_fields",
        Until("0.5.19"),
        "cache_finished_req releases the request's lock with a receipt rebuilt from req.swa_uuid_for_lock and "
        "req.skip_lock_node_ids (0.5.20 on: the receipt kept whole as req.lock_receipt); _unified._Request "
        "answers to both",
    ),
    Row(
        "load_back_under_device_lock",
        Until("0.5.21"),
        "the scheduler holds only the temporary lock of the last device node around init_load_back (0.5.22 on: "
        "also a host lock and a lock of best_match_node)",
    ),
    Row(
        "host_lock_single_node",
        Until("0.5.21"),
        "a host lock counts on the locked node only and the receipt holds no boundary; a split leaves it on the "
        "lower half (0.5.22 on: a segment up to the receipt's host_uuid boundary, both halves of a split)",
    ),
    Row(
        "cache_req_calls",
        Until("0.5.21"),
        "release_kv_cache(req, cache, is_insert=) (up to 0.5.20 through cache_finished_req; 0.5.21 through "
        "insert_req / free_kv_row / unpin / on_release(inserted=)) and the scheduler cache_unfinished_req(req, "
        "chunked=True) (0.5.22 on: release_kv_cache(checkpoint=) and checkpoint_kv_cache, through checkpoint / "
        "free_kv_row / unlock / on_release)",
    ),
    Row(
        "host_duplicate_reclaim_always",
        Until("0.5.19"),
        "drive_host_eviction reclaims host copies that duplicate device copies under write_back always: no "
        "SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM turns it off (0.5.20 on: the variable does, D-48)",
    ),
    Row(
        "backups_unbatched",
        Until("0.5.20"),
        "an insert starts its write-through at once (0.5.21 on: backups wait for the batch's "
        "flush_pending_backups)",
    ),
    Row(
        "no_load_back_slot_query",
        Until("0.5.21"),
        "no has_free_load_back_slot: the adapter counts the loads still in ack_load_queue against the load "
        "counters itself (0.5.22 on: the scheduler asks the cache)",
    ),
    Row(
        "plain_request_ids",
        Until("0.5.19"),
        "prefetch_from_storage, check_prefetch_progress, pop_prefetch_loaded_tokens and release_aborted_request "
        "take the request id string, and ongoing_prefetch (UnifiedRadixCache's revoke_pending_prefetch too) is "
        "keyed by it (0.5.20 on: a CacheRequestHandle); UnifiedRadixCache's prefetch_from_storage has no "
        "storage_hit_end, which the adapter never passes",
    ),
    Row(
        "prefetch_progress_in_operation",
        Until("0.5.18"),
        "no PrefetchAck: no prefetch_sync_queue, ack_prefetch_queue or prefetch sync thread; the I/O thread adds "
        "what it reads to the operation's completed_tokens and queues the unread tail for release after "
        "_page_transfer, and the prefetch thread builds prefetch_buffer and starts the I/O thread itself (0.5.19 "
        "on: acks through the sync thread, drained by the scheduler)",
    ),
    Row(
        "storage_layout_from_groups",
        Until("0.5.15"),
        "_generate_storage_config reads the tensor and pipeline ranks from parallel_state's module functions "
        "(get_tensor_model_parallel_rank, ..., imported into cache_controller), which need the model-parallel "
        "groups (0.5.16 on: get_parallel(), which the adapter overrides)",
    ),
    Row(
        "storage_batch_size_attribute",
        Until("0.5.12"),
        "the storage threads read the batch size from the controller's storage_batch_size (128, set when the "
        "backend attaches), not the module's STORAGE_BATCH_SIZE (0.5.13 on, read in the 0.5.13 wheel)",
    ),
    Row(
        "prefetch_allocated_at_admission",
        Until("0.5.15"),
        "prefetch_from_storage allocates the whole key's host memory at admission (evict_host, then a shorter "
        "page-aligned key from 0.5.11) and an ongoing_prefetch entry is (node, key, host_indices, operation); the "
        "prefetch thread cuts the operation's host_indices to the hits, releasing the rest, or revokes it (all "
        "released, its request id on prefetch_revoke_queue); no prefetch_hit_queue and no revoke method: the drain's "
        "_drain_revoke pops the entries (0.5.16 on: the drain of the hit query allocates, D-01)",
    ),
    Row(
        "prefetch_groups_all_reduce",
        Releases("0.5.11", "0.5.18"),
        "the storage threads' one all-reduce, the prefetch thread's MIN of the storage hits, is "
        "_all_reduce_prefetch_groups(tensor, op) over prefetch_sync_groups (0.5.19 on: _all_reduce(tensor, op, "
        "groups), with prefetch_hits_sync_groups and the sync thread's prefetch_completion_sync_groups)",
    ),
    Row(
        "prefetch_hits_all_reduce_inline",
        Until("0.5.10"),
        "the prefetch thread's MIN of the storage hits is torch.distributed.all_reduce(..., "
        "group=prefetch_tp_group) written inline in prefetch_thread_func under tp_world_size > 1 (one gloo group; "
        "0.5.11 on: _all_reduce_prefetch_groups over prefetch_sync_groups)",
    ),
    Row(
        "prefetch_revoke_queue",
        Until("0.5.17"),
        "the prefetch thread puts the request id of a query below max(prefetch_threshold, page_size) on "
        "prefetch_revoke_queue, which the drain empties first (_drain_revoke) and check_hicache_events reduces "
        "with the three other queue sizes (0.5.18 on: the drain of prefetch_hit_queue revokes)",
    ),
    Row(
        "last_hash_from_node",
        Until("0.5.16"),
        "the scheduler asks the anchor for its last page hash, last_host_node.get_last_hash_value() (0.5.17 on: "
        "the cache's get_last_hash_value(node))",
    ),
    Row(
        "prefetch_without_extra_key",
        Until("0.5.18"),
        "prefetch_from_storage(req_id, last_host_node, tokens, last_hash, prefix_keys) takes no extra_key (the "
        "key's namespace is the anchor's, as 0.5.19 on, whose extra_key= is unused there)",
    ),
    Row(
        "server_args_passed",
        Until("0.5.18"),
        "HiRadixCache(params, server_args) reads the ServerArgs it is passed (0.5.19 on: the published context)",
    ),
    Row(
        "load_back_from_last_host_node",
        Until("0.5.11"),
        "InitLoadBackParams(last_host_node=...) and MatchResult has no best_match_node (0.5.12 on: "
        "best_match_node=..., the deepest node every component accepts; the host match for HiRadixCache)",
    ),
    Row(
        "fill_ids_attribute",
        Until("0.5.12"),
        "cache_unfinished_req reads req.fill_ids (0.5.13 on: req.get_fill_ids()); _adapter._Request answers both",
    ),
    Row(
        "loads_retired_per_rank",
        Until("0.5.12"),
        "loading_check retires the loads each rank's own stream finished, no collective (0.5.13 on: a MIN over "
        "tp_group): two ranks may answer CheckHicacheEvents with different load counts, which _tp joins as "
        "EventsResult.loads_by_rank (the model's D-68)",
    ),
    Row(
        "write_through_per_node",
        Until("0.5.12"),
        "ongoing_write_through maps an ack to the one node it backs up (0.5.13 on: to (lock node, length, "
        "the nodes it publishes))",
    ),
    Row(
        "kvcacheio_at_import",
        Until("0.5.12"),
        "memory_pool_host imports sgl_kernel.kvcacheio's copy functions when it loads (0.5.13 on: only where "
        "sgl_kernel exists); without it, _runtime provides that module made of _cpu's functions",
    ),
    Row(
        "server_args_built",
        Until("0.5.15"),
        "no RuntimeContext.override_server_args: a ServerArgs is built and published by "
        "set_global_server_args_for_scheduler (0.5.16 on: override_server_args().install())",
    ),
    Row(
        "committed_len_from_request",
        Until("0.5.15"),
        "cache_finished_req(req) asks req.pop_committed_kv_cache() how many tokens to handle "
        "(0.5.16 on: kv_len_to_handle=)",
    ),
    Row(
        "host_free_eager",
        Until("0.5.15"),
        "the host pool frees slots into free_slots at once (0.5.16 on: into release_slots, merged lazily)",
    ),
    Row(
        "free_group_flag",
        Until("0.5.18"),
        "the allocator marks grouped frees with is_not_in_free_group (0.5.19 on: free_group is None outside one)",
    ),
    Row(
        "paged_free_direct",
        Until("0.5.16"),
        "the paged allocator frees pages in free() itself (0.5.17 on: through _release_page_ids)",
    ),
    Row(
        "req_pool_per_request",
        Until("0.5.18"),
        "ReqToTokenPool.alloc(reqs) / free(req) take the requests (0.5.19 on: alloc_rows(n) / free_rows(rows))",
    ),
    Row(
        "request_kv_fields",
        Until("0.5.18"),
        "the tree reads req.req_pool_idx and req.cache_protected_len (0.5.19 on: req.kv.*); _adapter._Request "
        "answers to both names",
    ),
    # before 0.5.10 (HiRadixCache, ``_adapter``)
    Row(
        "init_load_back_positional",
        Until("0.5.9"),
        "init_load_back(last_node, host_hit_length) takes the last host node and the host hit length "
        "(0.5.10 on: InitLoadBackParams)",
    ),
    Row(
        "request_dllm_query",
        Until("0.5.9"),
        "ReqToTokenPool.alloc(reqs) asks each request is_dllm() (0.5.10 on: it does not); _adapter._Request "
        "answers it",
    ),
    Row(
        "storage_threads_on_stop_event",
        Until("0.5.8"),
        "L3: the storage threads loop on the controller's stop_event, which also guards the transfer buffers and "
        "which reset() sets, joins the threads, clears and restarts them (0.5.9 on: a storage_stop_event of their "
        "own, for runtime attach and detach); the adapter installs its waking event under both names",
    ),
    Row(
        "drain_without_impl",
        Until("0.5.8"),
        "L3: drain_storage_control_queues is one function, with no _drain_storage_control_queues_impl inside "
        "(0.5.9 on); the adapter counts the revokes around it",
    ),
    Row(
        "io_thread_unnamed",
        Until("0.5.8"),
        "L3: the prefetch thread starts the I/O thread (prefetch_io_aux_func) as a local, not as the controller's "
        "prefetch_io_aux_thread (0.5.9 on); the adapter finds it among the running threads by its target",
    ),
    Row(
        "no_storage_detach",
        Until("0.5.8"),
        "L3: no HiRadixCache.shutdown / detach_storage_backend (0.5.9 on): nothing stops the storage threads but "
        "the controller's stop_event; the adapter's close sets it and joins them",
    ),
    Row(
        "no_loaded_tokens_count",
        Until("0.5.8"),
        "L3: no pop_prefetch_loaded_tokens (0.5.9 on): check_prefetch_progress computes the tokens it loaded, "
        "min_completed_tokens - matched_length, for its metrics only; the adapter takes the same difference from "
        "the _insert_helper_host call inside it",
    ),
    Row(
        "insert_positional",
        Until("0.5.8"),
        "insert(key, value, chunked=, priority=) returns the prefix length (0.5.9 on: InsertParams, InsertResult)",
    ),
    Row(
        "evict_returns_nothing",
        Until("0.5.8"),
        "evict(num_tokens) takes the count and returns nothing (0.5.9 on: EvictParams, EvictResult)",
    ),
    Row(
        "req_pool_by_count",
        Until("0.5.8"),
        "ReqToTokenPool.alloc(n) returns n free rows (0.5.9 to 0.5.18: alloc(reqs); 0.5.19 on: alloc_rows(n))",
    ),
    Row(
        "tree_frees_request_row",
        Until("0.5.8"),
        "cache_finished_req frees the request's req_to_token row itself (0.5.9 on: the caller does)",
    ),
    Row(
        "no_leaf_sets",
        Until("0.5.8"),
        "no evictable_leaves / evictable_host_leaves: evict and evict_host collect their leaves by walking the "
        "tree (0.5.9 on: the sets, kept up to date at every change)",
    ),
    Row(
        "match_prefix_by_key",
        Until("0.5.7"),
        "match_prefix(key) takes the RadixKey itself (0.5.8 on: MatchPrefixParams(key=...))",
    ),
    Row(
        "host_alloc_without_allocator",
        Releases("0.5.6.post1", before="0.5.7"),
        "ALLOC_MEMORY_FUNCS' functions take (dims, dtype, device, pin_memory), no HostTensorAllocator (0.5.7 on: "
        "allocator=, which _runtime's CPU allocation asks for)",
    ),
    Row(
        "host_pin_inline",
        Before("0.5.6.post1"),
        "the host pools allocate with torch.empty and pin with cudaHostRegister where SUPPORT_PIN_MEMORY (true "
        "off NPUs), no ALLOC_MEMORY_FUNCS (0.5.6.post1 on: the dispatch table _runtime fills for the CPU)",
    ),
    # before 0.5.6 (HiRadixCache, ``_adapter``)
    Row(
        "constructor_arguments",
        Until("0.5.5"),
        "HiRadixCache takes its sixteen settings as arguments (pools, tp group, page size, the hicache_* "
        "options, eviction policy, model name, is_eagle) and reads no ServerArgs (0.5.6 on: CacheInitParams)",
    ),
    Row(
        "finished_len_from_output",
        Before("0.5.5.post1"),
        "cache_finished_req caches len(req.origin_input_ids) + len(req.output_ids) - 1 tokens: the last "
        "sampled token has no KV yet (0.5.5.post1 on: the committed length it is told or asks for); "
        "_adapter._Request presents one such token after the request's own",
    ),
    Row(
        "prefix_from_prefix_indices",
        Until("0.5.5"),
        "the tree frees a request's slots from len(req.prefix_indices) (EAGLE: one less past "
        "req.last_matched_prefix_len) and keeps the re-matched length as req.last_matched_prefix_len (0.5.6 "
        "on: both are req.cache_protected_len); _adapter._Request answers to both names",
    ),
    Row(
        "no_node_priority",
        Until("0.5.5"),
        "TreeNode has no priority and insert takes none (0.5.6 on: max over the inserts, inherited by "
        "splits); the snapshot reads 0, what the model's nodes carry without D-24 and D-51",
    ),
    Row(
        "no_priority_policy",
        Until("0.5.5"),
        "no PriorityStrategy: --radix-eviction-policy priority is refused (0.5.6 on: priority, then LRU)",
    ),
    Row(
        "no_page_head_layout",
        Until("0.5.5"),
        "the host pools have no page_head layout: --hicache-mem-layout page_head is refused (0.5.6 on: "
        "page_head, with the kernel io backend)",
    ),
    Row(
        "host_pin_always",
        Releases("0.5.4.post2", before="0.5.5.post3"),
        "the host pools pin their buffers with torch.cuda.cudart().cudaHostRegister whenever pin_memory "
        "(default True; no SUPPORT_PIN_MEMORY to turn off); _runtime gives the module a torch whose "
        "cuda.cudart() registers nothing (0.5.4.post2 and .post3 are 0.5.5's here; 0.5.5.post3 on: "
        "SUPPORT_PIN_MEMORY, 'host_pin_inline')",
    ),
    Row(
        "controller_cuda_streams",
        Before("0.5.5.post3"),
        "the controller names torch.cuda's Stream, Event and stream() itself (0.5.5.post3 on: the device_module "
        "global); _runtime gives it a torch whose cuda is the fake device module",
    ),
    # before 0.5.5 (HiRadixCache, ``_adapter``)
    Row(
        "host_pin_at_allocation",
        Before("0.5.4.post2"),
        "the host pools pin by allocating with torch.empty(..., pin_memory=self.pin_memory) (and the flat data "
        "page with torch.zeros), pin_memory a pool argument HiRadixCache leaves at True, which a CPU-only torch "
        "refuses (0.5.4.post2 on: torch.empty, then cudaHostRegister, 'host_pin_always'); _runtime gives the module a "
        "torch whose empty and zeros allocate unpinned",
    ),
    # before 0.5.4 (HiRadixCache, ``_adapter``)
    Row(
        "no_global_server_args",
        Until("0.5.3"),
        "no published ServerArgs (server_args.py has no set_global_server_args_for_scheduler) and nothing of "
        'HiCache reads one: the adapter publishes none (0.5.4 to 0.5.15: a ServerArgs(model_path="dummy") '
        'published, "server_args_built"; 0.5.3\'s ServerArgs validates even a dummy model and needs an '
        "accelerator)",
    ),
    Row(
        "release_by_retraction",
        Until("0.5.3"),
        "cache_finished_req has no is_insert: it always inserts; a request is released without caching by the "
        "retraction, ScheduleBatch.release_req (frees its slots from the page-aligned prefix, its row, unlocks "
        "its last node) (0.5.4 on: cache_finished_req(req, is_insert=False)); the adapter calls that method "
        "with a batch of the one request",
    ),
    Row(
        "lru_lfu_policies_only",
        Until("0.5.3"),
        "RadixCache knows the eviction policies lru and lfu only (TreeNode has no creation_time): "
        "--radix-eviction-policy fifo, mru and filo are refused (0.5.4 on: those three too)",
    ),
    Row(
        "prefetch_without_prefix_keys",
        Until("0.5.3"),
        "L3: prefetch_from_storage(req_id, last_host_node, new_input_tokens, last_hash) takes no prefix_keys, and "
        "the controller's page functions take no extra_info (0.5.4 on: prefix_keys, passed to the backend as "
        "HiCacheStorageExtraInfo; None unless hicache_storage_pass_prefix_keys, which HiCacheFile ignores)",
    ),
    Row(
        "evict_in_schedule_batch",
        Until("0.5.3"),
        "the admission's eviction of the shortfall is the scheduler batch's _evict_tree_cache_if_needed "
        "(schedule_batch.py; 0.5.4 on: evict_from_tree_cache in mem_cache/common.py, which 0.5.3 lacks); "
        "the adapter calls that method with a batch holding what it reads",
    ),
)
"""Every API difference, newest first where they chain."""

_BY_NAME: Final = {row.name: row for row in ROWS}

_MEM: Final = "sglang.srt.mem_cache"
MODULES: Final[dict[str, tuple[tuple[Releases, str | None], ...]]] = {
    # the host pools' classes (and the transfer functions ``_cpu`` replaces there)
    "host_mha": ((Since("0.5.16"), f"{_MEM}.pool_host.mha"), (Until("0.5.15"), f"{_MEM}.memory_pool_host")),
    "host_mla": ((Since("0.5.16"), f"{_MEM}.pool_host.mla"), (Until("0.5.15"), f"{_MEM}.memory_pool_host")),
    # ALLOC_MEMORY_FUNCS, the host allocation ``_runtime`` replaces
    "host_common": (
        (Since("0.5.14"), f"{_MEM}.pool_host.common"),
        (Releases("0.5.6.post1", "0.5.13"), f"{_MEM}.memory_pool_host"),
        (Before("0.5.6.post1"), None),  # the pools allocate with torch.empty themselves ("host_pin_inline")
    ),
    # the L1<->L2 transfer engine (its own device_module); before 0.5.18 the controller's only
    "l2_transfer": ((Since("0.5.18"), f"{_MEM}.l2_transfer"), (Until("0.5.17"), None)),
    # the native page hash ``_runtime`` replaces by hashlib; before 0.5.15 the hash is Python's own
    "native_hash": ((Since("0.5.15"), f"{_MEM}.cpp_utils.native_hash"), (Until("0.5.14"), None)),
    # the device slot allocators (page size 1, paged)
    "allocator_token": ((Since("0.5.13"), f"{_MEM}.allocator.token"), (Until("0.5.12"), f"{_MEM}.allocator")),
    "allocator_paged": ((Since("0.5.13"), f"{_MEM}.allocator.paged"), (Until("0.5.12"), f"{_MEM}.allocator")),
}
"""Where a module the adapter patches or builds from lives, per release (None: that release has none)."""


class Compat:
    """The rows that apply to one release."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.rows = frozenset(row.name for row in ROWS if version in row.releases)

    def module(self, role: str) -> str | None:
        """The module that plays ``role`` (``MODULES``) in this release; None where it has none."""
        for releases, module in MODULES[role]:
            if self.version in releases:
                return module
        raise UsageError(f"no row of MODULES[{role!r}] covers SGLang {self.version}")

    def has(self, name: str) -> bool:
        """Whether the row ``name`` applies to this release. Raises ``UsageError`` for a name no row has."""
        if name not in _BY_NAME:
            raise UsageError(f"no compatibility row {name!r}; rows: {', '.join(_BY_NAME)}")
        return name in self.rows


def installed_unified_counts_unreaped_loads() -> bool:
    """Whether the installed release's UnifiedRadixCache admits a load back only while fewer than
    ``LayerDoneCounter.num_counters`` loads are not yet reaped by ``loading_check``, finished or not
    (``has_free_load_back_slot``: ``len(ack_load_queue) < num_counters``, 0.5.22 on), where the releases before
    it have no such query and the ``sglang-unified`` adapter counts the unfinished loads (the compat row
    ``no_load_back_slot_query``, the one place the adapter decides it; ``SystemEntry.counts_unreaped_loads``).
    Raises ``UnsupportedError`` for a release no row drives, ``UsageError`` when SGLang is not installed."""
    return not Compat(versions.installed().rows).has("no_load_back_slot_query")


def excluded_values(version: str) -> dict[str, tuple[str, ...]]:
    """The configuration values (field -> values) the ``sglang`` adapter cannot run on release ``version``,
    which has no such option: up to 0.5.5 the priority eviction policy and the page_head host layout
    (rows ``no_priority_policy``, ``no_page_head_layout``), up to 0.5.3 fifo, mru and filo too
    (``lru_lfu_policies_only``). The adapter refuses them at open; the
    machines draw none of them (``SystemEntry.excludes``). Raises ``UnsupportedError`` for a release no row
    drives."""
    compat = Compat(versions.place(version).rows)
    out: dict[str, tuple[str, ...]] = {}
    if compat.has("lru_lfu_policies_only"):
        out["radix_eviction_policy"] = ("fifo", "mru", "filo", "priority")
    elif compat.has("no_priority_policy"):
        out["radix_eviction_policy"] = ("priority",)
    if compat.has("no_page_head_layout"):
        out["hicache_mem_layout"] = ("page_head",)
    return out


def installed_excluded_values() -> dict[str, tuple[str, ...]]:
    """``excluded_values`` of the installed release (``SystemEntry.excludes`` of ``sglang``). Raises
    ``UnsupportedError`` for a release no row drives, ``UsageError`` when SGLang is not installed."""
    return excluded_values(versions.installed().rows)
