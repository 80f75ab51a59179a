"""The reference model of HiCache: pure Python, strictly typed, deterministic.

``HiCacheModel(config)`` applies the operation alphabet of ``refcache.ops`` to N tensor-parallel ranks and
produces ``refcache.snapshot.Snapshot``\\ s. Read ``_rank.py`` for one rank's HiRadixCache and controller,
``_cache.py`` for the ranks and their collectives, ``_eviction.py`` for the eviction order and
``_pools.py`` for the slot allocators.
"""

from refcache.model._cache import HiCacheModel

__all__ = ["HiCacheModel"]
