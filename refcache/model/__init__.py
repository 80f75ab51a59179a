"""The reference model of HiCache: pure Python, strictly typed, deterministic.

``HiCacheModel(config)`` applies the operation alphabet of ``refcache.hicache.ops`` to N tensor-parallel ranks and
produces ``refcache.hicache.snapshot.Snapshot``\\ s. The files, from the top down:

* ``_cache.py``: ``HiCacheModel``, the N ranks in lock step and the collectives between them;
* ``_rank.py``: ``RankCache``, one rank's HiRadixCache, stacked from one layer per concern:
  ``_tree.py`` (the radix tree: nodes, states, locks, match, split, insert), ``_tiers.py`` (L1/L2 copies,
  eviction, loads, L2→L3 backups), ``_prefetch.py`` (L3→L2 prefetch and its pipeline, D-01) and
  ``_requests.py`` (running requests);
* ``_controller.py``: ``HiCacheController``, one rank's queues, acks and I/O jobs, and the shared L3 store;
* ``_snapshot.py``: ``snapshot_rank``, one rank encoded as a ``refcache.hicache.snapshot.RankSnapshot``;
* ``_eviction.py``: the eviction order and the leaf heaps;
* ``_pools.py``: the device and host slot allocators;
* ``_pure.py``: the pure functions that CrossHair checks against their contracts.
"""

from refcache.model._cache import HiCacheModel

__all__ = ["HiCacheModel"]
