"""The LMCache bug zoo: real upstream LMCache cache-logic bugs, re-introduced one at a time as source patches on
LMCache 0.5.6's own functions (the ``Edit`` mechanism of ``tests/quality/zoo.py``: an exact snippet of one
function's source replaced and the function recompiled in its module, for the duration of ``applied()``).

LMCache as shipped has known findings (``specs/lmcache-known.json``, F1 on almost every disk write), so each bug
is hunted as CI's session runs the engine: ``refcache fuzz --seed 0 --known specs/lmcache-known.json`` (the
zoo's ``hunt`` with ``Bug.known``): a divergence that matches a known finding ends its example and the run goes
on; the bug is caught only by a divergence no known finding explains, and its trace is shrunk keeping only
such divergences. ``specs/lmcache-zoo.md`` tabulates the results.
"""

from __future__ import annotations

from pathlib import Path

from quality.zoo import Bug, Edit, hunt

__all__ = ["KNOWN", "MASKED", "ZOO", "hunt", "lmcache_bug"]

ROOT = Path(__file__).resolve().parents[3]
KNOWN = ROOT / "specs" / "lmcache-known.json"
SYSTEMS = ("lmcache-model", "lmcache")
EXAMPLES = 40  # CI's sample: tests/engines/lmcache/test_differential.py runs `fuzz --examples 40 --seed 0`
ENGINE = "lmcache.v1.cache_engine:LMCacheEngine"
MANAGER = "lmcache.v1.storage_backend.storage_manager:StorageManager"
CPU = "lmcache.v1.storage_backend.local_cpu_backend:LocalCPUBackend"
LRU = "lmcache.v1.storage_backend.cache_policy.lru:LRUCachePolicy"


def lmcache_bug(
    slug: str, what: str, upstream: str, edits: tuple[Edit, ...], caught_by: str, max_trace_ops: int = 12
) -> Bug:
    """A zoo bug of LMCache's own code, hunted past the known findings by CI's sample of the LMCache session."""
    return Bug(
        slug,
        what,
        upstream,
        edits,
        caught_by,
        budget=EXAMPLES,
        max_trace_ops=max_trace_ops,
        family="lmcache",
        systems=SYSTEMS,
        machine_name="LmcacheDifferentialMachine",
        known=KNOWN,
    )


ZOO: tuple[Bug, ...] = (
    lmcache_bug(
        "lru-evicts-pinned",
        "the LRU policy offers pinned (or referenced) objects as eviction candidates: allocate() evicts an "
        "object a lookup pinned, and its memory goes back to the allocator under the pin",
        "issue #987 / PR #993 (pinned objects evicted from the hot cache and freed in the allocator)",
        (
            Edit(
                f"{LRU}.get_evict_candidates",
                "            if not cache.can_evict:\n",
                "            if False:\n",
            ),
        ),
        "snapshots differ after Store",
    ),
    lmcache_bug(
        "lookup-unpin-never-unpins",
        "lookup_unpin drops the request's pin ledger without unpinning: objects a lookup pinned and no "
        "retrieve consumed stay pinned for ever (never evictable)",
        "issue #1034 (pinned objects hit by a lookup but never retrieved are never unpinned)",
        (
            Edit(
                f"{ENGINE}.lookup_unpin",
                "                self.storage_manager.batched_unpin(keys, [location])\n",
                "                pass\n",
            ),
        ),
        "snapshots differ after LookupUnpin",
    ),
    lmcache_bug(
        "clear-skips-evictable",
        "LocalCPUBackend.clear() skips the evictable objects and removes the held (referenced or pinned) ones",
        "PR #1564 (LocalCPUBackend.clear() did not remove evictable objects); shipped in 0.3.5 and 0.3.6 as "
        "'if memory_obj.can_evict: continue'",
        (
            Edit(
                f"{CPU}.clear",
                "                if not memory_obj.can_evict:\n",
                "                if memory_obj.can_evict:\n",
            ),
        ),
        "outcomes differ on Clear",
    ),
    lmcache_bug(
        "remove-bypasses-ref-count",
        "removing an object from the hot cache does not drop the cache's reference: eviction and clear "
        "never give the memory back to the allocator",
        "PR #3130 (batched_remove bypassed the ref counts)",
        (Edit(f"{CPU}.remove", "            memory_obj.ref_count_down()\n", "            pass\n"),),
        "snapshots differ after Clear",
    ),
    lmcache_bug(
        "put-keeps-extra-reference",
        "the store path keeps one reference too many on every object it puts (batched_put does not drop the "
        "allocation's reference), so no stored object is ever evictable or freed",
        "issue #1756 (the serializer's extra ref_count_up prevented eviction): the same extra reference, put "
        "back in 0.5.6's store path (0.5.6's store does not go through a serializer)",
        (
            Edit(
                f"{MANAGER}.batched_put",
                "                memory_obj.ref_count_down()\n",
                "                pass\n",
            ),
        ),
        "snapshots differ after Store",
    ),
    lmcache_bug(
        "async-takes-object-by-position",
        "an async retrieve takes the prefetched objects by position instead of by key: when the mask skips a "
        "prefix, each chunk gets the object of an earlier chunk (wrong KV)",
        "issue #1866 / PR #1867 (async loading took the wrong memory object when the mask skipped a prefix)",
        (
            Edit(
                f"{ENGINE}._async_process_tokens_internal",
                "            memory_obj = memory_obj_map.get(key)\n",
                "            position = len(chunks)\n"
                "            memory_obj = (\n"
                "                list(memory_obj_map.values())[position] if position < len(memory_obj_map) else None\n"
                "            )\n"
                "            taken = list(memory_obj_map)[position] if memory_obj is not None else key\n",
            ),
            Edit(
                f"{ENGINE}._async_process_tokens_internal",
                "            used_keys.add(key)\n",
                "            used_keys.add(taken)\n",
            ),
        ),
        "lmcache crashed on Retrieve",
    ),
    lmcache_bug(
        "forced-remove-keeps-lookup-pins",
        "a forced remove (clear) takes an object out of the hot cache without releasing the lookup pins it "
        "still holds: no key-based unpin can reach it any more, so its memory is never freed",
        "shipped in 0.3.3's LocalCPUBackend.remove (only ref_count_down); 0.5.6 releases the pins (its "
        "docstring states the rule); no tracker number found",
        (
            Edit(
                f"{CPU}.remove",
                "                while memory_obj.is_pinned:\n                    memory_obj.unpin()\n",
                "                pass\n",
            ),
        ),
        "snapshots differ after Clear",
    ),
)

MASKED: tuple[Bug, ...] = (
    lmcache_bug(
        "sync-retrieve-unpins-lookup-pins",
        "a blocking retrieve unpins the objects a lookup pinned, so the request's lookup_unpin unpins them a "
        "second time ('Double unpin'): the pin another lookup holds on the same object is lost",
        "issue #5090 (open; PRs #5095, #5098, #5120): retrieve unpinned what lookup pinned, then lookup_unpin "
        "again; 0.5.6's blocking retrieve no longer unpins (its async retrieve still does: F2)",
        (
            Edit(
                f"{ENGINE}.retrieve",
                "                if (self.async_loading or self._is_passive()) and memory_obj.is_pinned:\n",
                "                if memory_obj.is_pinned:\n",
            ),
        ),
        "differ",
    ),
)
"""Real bugs that the hunt past the known findings does NOT catch in CI's sample (specs/lmcache-zoo.md says
why). Kept as data for ``specs/lmcache-zoo.md``; not tested. ``forced-remove-keeps-lookup-pins`` was here
while F7 explained the whole of its ``Clear`` step; since findings explain only their own lines it is in
``ZOO``."""
