"""SGLang 0.5.20's own HiCache, driven through refcache's operation alphabet: ``SGLangSystem``.

Theory of operation
-------------------
What runs is SGLang's code: ``HiRadixCache`` (tree, matching, insert, eviction, load back, write-through,
the leaf sets and locks), its ``HiCacheController`` (write and load queues, acks), the device pools and slot
allocators, the host pools and their layouts, and ``evict_from_tree_cache`` / ``cache_finished_req`` /
``cache_unfinished_req`` exactly as the scheduler calls them. One rank in this process, on the CPU, in a
one-rank gloo group (every collective of 0.5.20 is skipped at world size 1); with ``tp_size=2`` one worker
process per rank in a two-rank gloo group, where SGLang's all-reduces run for real (``_tp``).

What the adapter supplies, and nothing else:

* ``_shim``: the import shim for a machine without CUDA (``torchvision`` and one ``transformers`` attribute,
  listed in ``_shim.STUBBED``), installed only when the real ``torchvision`` fails to import.
* ``_cpu``: CPU equivalents of the ``sgl_kernel.kvcacheio`` copy functions the host pools call (undefined
  without CUDA), built on ``refcache.gpu.transfer``. They are refcache's code, not SGLang's.
* ``_gate``: fake device streams and events, so that the L1<->L2 copies SGLang queues run, and their acks
  report done, only when a ``CompleteIO(WRITE|LOAD)`` says so.
* ``_runtime``: the patches of SGLang's module globals (those three, host allocation without
  ``cudaHostRegister``, and a logical ``time.monotonic`` for LRU stamps), and the gloo group.
* ``_adapter``: the scheduler's call sequence per operation, and the observations SGLang does not return
  (derived as each method says).
* ``_snapshot``: SGLang's state read into ``refcache.hicache.snapshot.Snapshot``, device slots renamed to
  refcache's allocation order.
* ``_storage``: L3 — SGLang's file backend (``HiCacheFile``) and its four storage threads, which stay
  SGLang's own but take one step per ``CompleteIO(PREFETCH_QUERY|PREFETCH_IO|BACKUP)`` (the ``Gate``); a
  thread that dies or does not park raises ``EngineThreadError``. ``_adapter`` injects the storage faults.
* ``_tp``: two ranks (of either system: ``RANK_SYSTEMS``), one spawned worker process each, joined in a gloo group; lock-step operations to
  every rank, ``CompleteIO`` to its rank, the snapshots side by side; the ranks' all-reduces checked to stay
  in step (one its idle peer never entered is a ``RankError`` at once), a set-up hook the workers run
  (``REFCACHE_SGLANG_RANK_SETUP``; the zoo patches the ranks with it), and recording (``record``).
* ``record`` (with ``_recorder``): the recorder — a live ``HiRadixCache`` written down as a recorded trace;
  its admission stages are data in ``refcache.engines.admission``.
* ``_unified``: SGLang 0.5.19 to 0.5.23 (``UnifiedRadixCache``, system ``sglang-unified``), a subclass of the
  0.5.20 adapter with that release's construction, call order and snapshot; ``versions`` (the versions API
  over ``refcache.sglang_releases``) checks the installed release at open and builds environments per
  release, ``_compat`` holds the API differences of 0.5.5 to 0.5.19 (a row per difference with its release
  range), and ``latest`` reports what of the driven names a newer release still has.

The gating: a copy is queued on a fake stream by SGLang's own ``start_writing`` / ``start_loading``;
``CompleteIO(WRITE|LOAD)`` runs the stream through the oldest unfinished acks' events; SGLang's
``check_hicache_events`` then retires them exactly as on a GPU. With L3 (``hicache_storage_backend="file"``)
the storage threads run under the ``Gate`` (``_storage``): each ``CompleteIO`` of a storage queue lets one
thread take one step, and the adapter settles the threads after every operation, so every interleaving is an
explicit step. ``unsupported`` says what the adapter cannot run (``specs/sglang-adapter.md``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names below, imported on first use: ``versions`` is read without torch or SGLang
    from refcache.config import HiCacheConfig
    from refcache.engines.sglang._adapter import (
        MAX_PENDING_LOADS,
        TP_SIZES,
        SGLangSystem,
        host_defaults,
        unsupported,
    )
    from refcache.engines.sglang._tp import RankError, SGLangRanks, shutdown_workers
    from refcache.engines.sglang._unified import UnifiedSGLangSystem

__all__ = [
    "MAX_PENDING_LOADS",
    "TP_SIZES",
    "RankError",
    "SGLangRanks",
    "SGLangSystem",
    "host_defaults",
    "open_system",
    "open_unified",
    "shutdown_workers",
    "unsupported",
]

_LAZY = {
    "MAX_PENDING_LOADS": "_adapter",
    "TP_SIZES": "_adapter",
    "SGLangSystem": "_adapter",
    "host_defaults": "_adapter",
    "unsupported": "_adapter",
    "RankError": "_tp",
    "SGLangRanks": "_tp",
    "shutdown_workers": "_tp",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_system(config: HiCacheConfig) -> SGLangSystem | SGLangRanks:
    """The ``sglang`` system (``refcache.systems.SYSTEMS``) for the installed release (``versions``: another
    release is an ``UnsupportedError`` naming the supported ones, before anything of SGLang is imported): one
    rank in this process (``SGLangSystem``), or one worker process per rank in a gloo group (``SGLangRanks``,
    tp_size 2). Raises ``UnsupportedError`` for a configuration the adapter cannot run (``unsupported``)."""
    from refcache.engines.sglang._adapter import SGLangSystem
    from refcache.engines.sglang._tp import SGLangRanks

    if config.tp_size == 1:
        return SGLangSystem(config)
    return SGLangRanks(config)


def open_unified(config: HiCacheConfig) -> UnifiedSGLangSystem | SGLangRanks:
    """The ``sglang-unified`` system (``UnifiedRadixCache``, 0.5.19 to 0.5.23) for the installed release: one rank
    in this process (``UnifiedSGLangSystem``), or one worker process per rank (``SGLangRanks`` of
    ``sglang-unified``, tp_size 2, where ``Release.ranks_on`` says). Raises ``UnsupportedError`` as
    ``open_system``."""
    from refcache.engines.sglang._tp import SGLangRanks
    from refcache.engines.sglang._unified import UnifiedSGLangSystem

    if config.tp_size == 1:
        return UnifiedSGLangSystem(config)
    return SGLangRanks(config, system=UnifiedSGLangSystem.SYSTEM)
