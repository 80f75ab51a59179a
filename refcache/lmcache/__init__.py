"""LMCache's KV cache layer as refcache's third engine family: vocabulary and reference model, pure Python.

LMCache stores a request's KV in chunks of a fixed number of tokens, named by a chained prefix hash, across
tiers (CPU memory, local disk, a remote store) with per-tier eviction by bytes, pins and reference counts on
its memory objects, and background writes and prefetches (``specs/lmcache-model.md``):

* ``config``: ``LMCacheConfig``, derived from a ``HiCacheConfig`` (chunk size, CPU and disk budgets, remote
  tier, cache policy, save_unfull_chunk, async loading), so the registry, the trace header, replay and
  shrink keep taking one configuration type;
* ``ops``: the operation alphabet (store, lookup, retrieve, unpin, prefetch, clear, the background
  executors' steps, storage faults) with its JSON codec and the preconditions every LMCache system checks;
* ``snapshot``: ``LMCacheSnapshot``, the tiers, the allocator, pins and jobs in flight as plain data;
* ``invariants``: the LMCache invariant family;
* ``trace``: traces of LMCache operations (the header names the family);
* ``scenarios``: the directed conformance scenarios; ``family``: ``FAMILY``, the ``refcache.family.Family``
  the checking side is generic over (its snapshot diff, status line and granularities);
* ``model``: ``LMCacheModel``, the executable reference model, over its parts (``_parts``: a tier's cache
  policy and the CPU allocator).

Nothing here imports torch, numpy or LMCache; ``refcache.engines.lmcache`` drives LMCache's own code.
"""

from __future__ import annotations

from refcache.lmcache.config import CachePolicy, LMCacheConfig
from refcache.lmcache.snapshot import LMCacheSnapshot

__all__ = ["CachePolicy", "LMCacheConfig", "LMCacheSnapshot"]
