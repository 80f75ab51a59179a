"""The bug zoo on SGLang 0.5.20 itself: the zoo bugs (``tests/quality/zoo.py``) that have a counterpart in
SGLang's code, re-introduced into SGLang's ``HiRadixCache`` with the same ``Edit`` mechanism (source patch of
one function, swapped in for a ``with bug.applied():`` block). Apply only after an ``SGLangSystem`` was
built once (SGLang's modules import behind the adapter's shim)."""

from __future__ import annotations

from typing import Final

from quality.zoo import ZOO, Bug, Edit

__all__ = ["NOT_REACHED", "NO_COUNTERPART", "SGLANG_ZOO"]

_TREE: Final = "sglang.srt.mem_cache.hiradix_cache:HiRadixCache"
_BY_SLUG: Final = {bug.slug: bug for bug in ZOO}


def _on_sglang(slug: str, *edits: Edit, caught_by: str) -> Bug:
    bug = _BY_SLUG[slug]
    return Bug(slug, bug.what, bug.upstream, edits, caught_by, notes="SGLang 0.5.20 counterpart")


SGLANG_ZOO: Final[dict[str, Bug]] = {
    bug.slug: bug
    for bug in (
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
    )
}

_L3: Final = (
    "not patched yet: an L3 (storage prefetch / backup) path. The adapter runs SGLang's HiCacheFile since "
    "0dfbd9f (#13; its L3 rows, test_differential.py, are write_through, default budget, no divergence), "
    "which landed after this zoo was written; before it enable_storage was False (hiradix_cache.py:129) and "
    "this code never ran (prefetch_from_storage returns at :1798, the storage queues are drained only if "
    "enable_storage, :1552-1563). The recorder refuses L3 (record.py, prefetch_from_storage), so a "
    "recorded run needs it first"
)
_TP: Final = (
    "no counterpart the adapter runs: a TP collective: the profile machine runs one rank, where every all-reduce (_all_reduce, "
    "hiradix_cache.py:240) is the identity, so a skipped or early-returned collective cannot desynchronise "
    "ranks; the two-rank adapter (refcache.engines.sglang._tp) runs each rank in a spawned worker process, "
    "which this in-process source patch does not reach"
)
NO_COUNTERPART: Final[dict[str, str]] = {
    "collective-skipped-when-queues-empty": f"{_TP}. The code is there: with one pipeline stage, "
    "check_hicache_events (hiradix_cache.py:1555-1561) makes one MIN all-reduce of every queue's ready count "
    "(_sync_hicache_ready_counts, :1018-1040) that every rank enters (writing_check's own all-reduce, "
    "for pp_size > 1, is unconditional too: :1058-1071); the zoo's form, drain_storage_control_queues (:1579, all-reduce at :1596), runs only with "
    "pp_size > 1 and L3",
    "prefetch-progress-early-return": f"{_TP}; check_prefetch_progress (hiradix_cache.py:1638, MAX "
    "all-reduce at :1656) is also L3 prefetch",
    "prefetch-host-under-device-node": f"{_L3}: _insert_helper_host (hiradix_cache.py:1827) is called only "
    "from _handle_prefetch_result (:1685), the end of a storage prefetch",
    "missing-per-layer-wait": "no counterpart the adapter runs: SGLang's per-layer wait is in the device pool's accessors "
    "(memory_pool.py:2487-2492, get_key_buffer waits on layer_transfer_counter), which only the model's "
    "forward pass calls; the adapter drives the cache, never a forward pass, and its snapshot carries no KV "
    "bytes (refcache's KV content oracle is its own data plane's)",
    "prefetch-tail-released-twice": f"{_L3}: the tail of a prefetch's host indices is freed in "
    "_drain_ack_prefetch (hiradix_cache.py:674-675)",
    "wait-complete-on-empty-hashes": f"{_L3}: the wait_complete prefetch policy (can_terminate_prefetch, "
    "hiradix_cache.py:1613-1617)",
    "l3-keys-ignore-namespace": f"{_L3}: page hashes are computed only for storage or KV events "
    "(hiradix_cache.py:2004-2005, compute_node_hash_values, mem_cache/utils.py:164)",
    "hash-chain-restarted": f"{_L3}: page hashes are computed only for storage or KV events "
    "(hiradix_cache.py:2004-2005; the chain from the parent's last hash, mem_cache/utils.py:166-171)",
    "l3-checksum-ignored": "no counterpart: SGLang's HiCacheFile (mem_cache/hicache_storage.py) writes and "
    "reads pages with no checksum; the checksum is refcache's own file backend's and its fault injection's "
    "(specs/data-plane.md)",
}
"""The zoo bugs with no counterpart patched into what the adapter runs of SGLang 0.5.20, and why: none the
adapter runs, or (L3) not patched yet."""

NOT_REACHED: Final[dict[str, str]] = {}
"""Counterparts in SGLANG_ZOO that the profile machine does not catch within the default budget, and why
(test_zoo_on_sglang.py asserts their recorded run instead)."""
