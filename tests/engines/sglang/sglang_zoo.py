"""The bug zoo on SGLang 0.5.20 itself: the zoo bugs (``tests/quality/zoo.py``) that have a counterpart in
SGLang's code, re-introduced into SGLang's ``HiRadixCache`` (or, for the L3 page hashes, the hash helpers it
calls: ``mem_cache/utils.py``) with the same ``Edit`` mechanism (source patch of one function, swapped in for
a ``with bug.applied():`` block). The L3 bugs' forms: ``prefetch-tail-released-twice`` frees the unread tail
of a prefetch's host indices when the prefetch ends as well as when its completion ack drains
(hiradix_cache.py:674-675), the double free of issue #13483; ``wait-complete-on-empty-hashes`` is the
wait_complete test before PR #9397 (complete when completed_tokens == len(hash_value) * page_size, true for
0 == 0 before the hit query ran; 0.5.20 waits for the worker's termination); the hash bugs patch
``get_storage_hash_str`` (both its importers) and ``compute_node_hash_values`` as hiradix_cache.py imports it.
``eviction-ignores-priority`` keys every eviction heap of ``HiRadixCache`` (the device's,
``_make_eviction_heap`` and ``_promote_parent``, and ``evict_host``'s) on the node's id, its creation order,
for every policy: keying the first heap only mixed its tuples with the policy's float keys of promoted
parents, a ``TypeError`` of the patch (not of SGLang) under LRU, FIFO, FILO and MRU. Issue #30's three:
``prefetch-hits-reduced-by-max`` asks the prefetch thread's all-reduce of the storage hit count over
``prefetch_hits_sync_groups`` (managers/cache_controller.py:1234-1238) for MAX instead of MIN (the adapter's
gate reduces whichever the thread asks, ``SGLangSystem._gate_collectives``), so a rank fetches pages its own
L3 view lacks; ``prefetch-anchor-not-touched`` drops the stamp of ``last_access_time`` on the node
``_insert_helper_host`` starts from (the prefetch's anchor, hiradix_cache.py:1830; D-33);
``split-drops-priority`` builds ``_split_node``'s new node without the split node's priority
(hiradix_cache.py:1898).
The TP bug's form: ``collective-skipped-when-queues-empty`` returns from ``_sync_hicache_ready_counts`` before
its MIN all-reduce (hiradix_cache.py:1040, the one collective of ``check_hicache_events`` with one pipeline
stage) when this rank has no ready ack in any queue, as writing_check skipped its all-reduce on an empty
ongoing_write_through (issue #28429); it runs on two ranks, patched into the rank workers too
(``zoo_on_sglang.applied_everywhere``). Apply only after an ``SGLangSystem`` was built once (SGLang's modules
import behind the adapter's shim)."""

from __future__ import annotations

from typing import Final

from quality.zoo import ZOO, Bug, Edit

__all__ = ["NOT_REACHED", "NOT_RECORDED", "NO_COUNTERPART", "SGLANG_ZOO"]

_TREE: Final = "sglang.srt.mem_cache.hiradix_cache:HiRadixCache"
_UTILS: Final = "sglang.srt.mem_cache.utils"
_BY_SLUG: Final = {bug.slug: bug for bug in ZOO}


def _on_sglang(slug: str, *edits: Edit, caught_by: str) -> Bug:
    bug = _BY_SLUG[slug]
    return Bug(slug, bug.what, bug.upstream, edits, caught_by, notes="SGLang 0.5.20 counterpart")


SGLANG_ZOO: Final[dict[str, Bug]] = {
    bug.slug: bug
    for bug in (
        _on_sglang(
            "collective-skipped-when-queues-empty",
            Edit(
                f"{_TREE}._sync_hicache_ready_counts",
                "        self._all_reduce(ready_counts, torch.distributed.ReduceOp.MIN)\n",
                "        if not any(ready_counts.tolist()):\n"
                "            return 0, 0, tuple(ready_counts.tolist()[2:])\n"
                "        self._all_reduce(ready_counts, torch.distributed.ReduceOp.MIN)\n",
            ),
            caught_by="sglang crashed on CheckHicacheEvents()",
        ),
        _on_sglang(
            "prefetch-progress-early-return",
            Edit(
                f"{_TREE}.check_prefetch_progress",
                "        self._all_reduce(should_terminate_tensor, torch.distributed.ReduceOp.MAX)\n",
                "        if not should_terminate:\n"
                "            return False\n"
                "        self._all_reduce(should_terminate_tensor, torch.distributed.ReduceOp.MAX)\n",
            ),
            caught_by="sglang crashed on CheckPrefetchProgress(",
        ),
        _on_sglang(
            "evict-host-never-counts",
            Edit(
                f"{_TREE}.evict_host",
                "            num_evicted += self.cache_controller.evict_host(x.host_value)\n",
                "            self.cache_controller.evict_host(x.host_value)\n",
            ),
            caught_by="snapshots differ",
        ),
        _on_sglang(
            "host-leaf-predicate-swapped",
            Edit(
                f"{_TREE}._update_host_leaf_status",
                "        if not node.evicted or node.lock_ref > 0:\n",
                "        if not node.backuped or node.lock_ref > 0:\n",
            ),
            caught_by="snapshots differ",
        ),
        _on_sglang(
            "write-back-failed-backup-as-done",
            Edit(
                f"{_TREE}._evict_write_back",
                "elif self.write_backup(x, write_back=True) > 0:",
                "elif self.write_backup(x, write_back=True) >= 0:",
            ),
            caught_by="snapshots differ",
        ),
        _on_sglang(
            "eviction-ignores-priority",
            Edit(
                f"{_TREE}._make_eviction_heap",
                "            (self.eviction_strategy.get_priority(node), node)\n",
                "            ((node.id,), node)\n",
            ),
            Edit(
                f"{_TREE}._promote_parent",
                "heapq.heappush(heap, (self.eviction_strategy.get_priority(p), p))",
                "heapq.heappush(heap, ((p.id,), p))",
            ),
            Edit(
                f"{_TREE}.evict_host",
                "(self.eviction_strategy.get_priority(node), node) for node in leaves",
                "((node.id,), node) for node in leaves",
            ),
            Edit(
                f"{_TREE}.evict_host",
                "new_priority = self.eviction_strategy.get_priority(x.parent)",
                "new_priority = (x.parent.id,)",
            ),
            caught_by="snapshots differ",
        ),
        _on_sglang(
            "host-pages-freed-under-load",
            Edit(f"{_TREE}.load_back", "            n.protect_host()\n", "            pass\n"),
            Edit(f"{_TREE}.load_back", "                n.release_host()\n", "                pass\n"),
            Edit(f"{_TREE}.load_back", "            n.release_host()\n", "            pass\n"),
            caught_by="snapshots differ",
        ),
        _on_sglang(
            "unlock-never-locked",
            Edit(
                f"{_TREE}.writing_check",
                "self._finish_write_through_ack(ack_id, release_lock=False)",
                "self._finish_write_through_ack(ack_id, release_lock=True)",
            ),
            caught_by="snapshots differ",
        ),
        _on_sglang(
            "split-loses-write-through-fragment",
            Edit(
                f"{_TREE}._split_node",
                "self._replace_pending_write_through_node(child, [new_node, child])",
                "self._replace_pending_write_through_node(child, [child])",
            ),
            caught_by="snapshots differ",
        ),
        _on_sglang(
            "prefetch-tail-released-twice",
            Edit(
                f"{_TREE}._handle_prefetch_result",
                "        self.cache_controller.mem_pool_host.free(host_indices[:matched_length])\n",
                "        self.cache_controller.mem_pool_host.free(host_indices[:matched_length])\n"
                "        self.cache_controller.mem_pool_host.free(host_indices[min_completed_tokens:])\n",
            ),
            caught_by="snapshots differ",
        ),
        _on_sglang(
            "wait-complete-on-empty-hashes",
            Edit(
                f"{_TREE}.can_terminate_prefetch",
                '        if self.prefetch_stop_policy == "wait_complete":\n            return False\n',
                '        if self.prefetch_stop_policy == "wait_complete":\n'
                "            return operation.completed_tokens == len(operation.hash_value) * self.page_size\n",
            ),
            caught_by="outcomes differ on CheckPrefetchProgress",
        ),
        _on_sglang(
            "l3-keys-ignore-namespace",
            *(
                Edit(
                    f"{module}:get_storage_hash_str",
                    '            getattr(key, "extra_key", None), getattr(key, "cache_salt", None)\n',
                    "            None, None\n",
                )
                for module in (_UTILS, "sglang.srt.managers.cache_controller")
            ),
            caught_by="snapshots differ",
        ),
        _on_sglang(
            "prefetch-hits-reduced-by-max",
            Edit(
                "sglang.srt.managers.cache_controller:HiCacheController.prefetch_thread_func",
                "                    torch.distributed.ReduceOp.MIN,\n"
                "                    self.prefetch_hits_sync_groups,\n",
                "                    torch.distributed.ReduceOp.MAX,\n"
                "                    self.prefetch_hits_sync_groups,\n",
            ),
            caught_by="snapshots differ",
        ),
        _on_sglang(
            "prefetch-anchor-not-touched",
            Edit(
                f"{_TREE}._insert_helper_host",
                "        node.last_access_time = time.monotonic()\n        if len(key) == 0:\n",
                "        if len(key) == 0:\n",
            ),
            caught_by="outcomes differ on Evict",
        ),
        _on_sglang(
            "split-drops-priority",
            Edit(
                f"{_TREE}._split_node",
                "new_node = TreeNode(priority=child.priority)",
                "new_node = TreeNode()",
            ),
            caught_by="snapshots differ",
        ),
        _on_sglang(
            "hash-chain-restarted",
            Edit(
                f"{_TREE.partition(':')[0]}:compute_node_hash_values",
                "    if node.parent is not None and node.parent.hash_value is not None:\n",
                "    if False:\n",
            ),
            caught_by="snapshots differ",
        ),
    )
}

NO_COUNTERPART: Final[dict[str, str]] = {
    "prefetch-host-under-device-node": "no patch: it is SGLang 0.5.20's own behaviour (sglang.md §9 #6, "
    "still so in 0.5.20: _insert_helper_host, hiradix_cache.py:1827-1867, attaches the fetched pages below "
    "whatever node its walk ends at, backed up or not; the zoo's edit removes refcache's D-06 check, which "
    "0.5.20 never had). The sglang-0.5.20 profile does not follow it (D-06 has no fidelity option: "
    "following it breaks BACKUP-CONTIGUITY on the engine), so the profile machine's L3 rows draw "
    "write_through only, under which an inserted node is backed up at once and the bug cannot arise "
    "(specs/sglang-adapter.md, L3 #4; specs/decisions.md D-06, D-13)",
    "missing-per-layer-wait": "no counterpart the adapter runs: SGLang's per-layer wait is in the device pool's accessors "
    "(memory_pool.py:2487-2492, get_key_buffer waits on layer_transfer_counter), which only the model's "
    "forward pass calls; the adapter drives the cache, never a forward pass, and its snapshot carries no KV "
    "bytes (refcache's KV content oracle is its own data plane's)",
    "l3-checksum-ignored": "no counterpart: SGLang's HiCacheFile (mem_cache/hicache_storage.py) writes and "
    "reads pages with no checksum; the checksum is refcache's own file backend's and its fault injection's "
    "(specs/data-plane.md)",
    "l3-read-checks-fixed-header-only": "no counterpart: SGLang's HiCacheFile names each page's file by its key "
    "and stores nothing else in it (no header, no key, no page format), so there is no identity to validate; "
    "the misplaced-object fault that exposes the bug is refcache's own file backend's (FaultKind.MISPLACED is "
    "not among the sglang entry's fault kinds, refcache.systems)",
    "prefetch-release-by-min-completed": "no counterpart: SGLang 0.5.20's sync thread MIN-reduces every read "
    "ack's completed_tokens before the scheduler adopts it, so every rank holds the same completed tokens when "
    "_handle_prefetch_result (mem_cache/hiradix_cache.py 1673) inserts them, and the unread tail is freed at the "
    "completed_req ack; there is no rank-local completed amount to confuse with the MIN",
    "load-stream-newest-first": "no counterpart the adapter runs: on a CPU SGLang's load stream is the adapter's "
    "fake stream (_gate.complete fires the oldest unfired load acks' finish events, as a CompleteIO of the "
    "load queue asks), not SGLang code; what is SGLang's — each ack's node_ids and loading_check retiring the "
    "finished prefix of ack_load_queue — the snapshot's load_finished and LOAD-STREAM-ORDER check on the "
    "engine itself",
}
"""The zoo bugs with no counterpart patched into what the adapter runs of SGLang 0.5.20, and why: none the
adapter runs, none at all, or SGLang 0.5.20 has the bug itself."""

NOT_REACHED: Final[dict[str, str]] = {}
"""Counterparts in SGLANG_ZOO that the profile machine does not catch within the default budget, and why
(test_zoo_on_sglang.py asserts their recorded run instead)."""

NOT_RECORDED: Final[dict[str, str]] = {
    "prefetch-hits-reduced-by-max": "its situation is a storage fault on one rank's L3 view (the ranks' hit "
    "counts differ), which a recording cannot contain (refcache.engines.sglang.record: a StorageFault is the "
    "adapter's injection, not a call of the engine); the fault-free two-rank L3 machine did not reach the bug "
    "in 150 examples. Its shrunk trace (14 operations: a chain backed up to L3 on both ranks, dropped from L1 "
    "and L2, one page deleted from rank 0's view, a prefetch and its hit query on both ranks) is in "
    "specs/bug-zoo.md",
}
"""Counterparts in SGLANG_ZOO with no recorded run of generated operations (``zoo_on_sglang.SCRIPTS``), and
why (the two-rank hangs, ``collective-skipped-when-queues-empty`` and ``prefetch-progress-early-return``, are
recorded up to the operation that never returned, ``refcache.hicache.recording.NeverReturned``)."""
