"""One tensor-parallel rank of HiCache: the radix tree, its tiers, L3 prefetch and its requests.

Theory of operation
-------------------
``RankCache`` is SGLang's ``HiRadixCache`` for one rank, minus the bytes. It is four layers, one concern
per module, stacked as SGLang stacks ``RadixCache`` and ``HiRadixCache``:

=====================  ==================================================================================
``_tree.RadixTree``    the ``TreeNode`` records, their states, locks, leaf sets, match, split and insert
``_tiers.TieredTree``  the allocators, the ``cache_controller`` (``_controller.py``, SGLang's
                       ``HiCacheController``), L1→L2 backups, L1/L2 eviction, L2→L1 loads, L2→L3 backups
                       and the in-flight tables ``ongoing_write_through``, ``ongoing_load_back``,
                       ``ongoing_backup``
``_prefetch``          ``PrefetchingTree``: ``ongoing_prefetch`` and the insert of fetched pages, with the
                       ``PrefetchPipeline`` the configuration chose (refcache's, or 0.5.20's, D-01)
``_requests``          ``RequestCache``: the running requests
=====================  ==================================================================================

and this class adds what spans them: ``busy`` and ``reset``. The controller's jobs run only when
``HiCacheModel`` says so. Rank state changes only through methods of these classes and of the chosen
pipeline (``HiCacheModel`` calls them, never writes a field), and every node state change goes through
``_transition`` and the table of ``refcache.hicache.states``.

Methods named like SGLang's do what seed §1–§4 describe. Methods that SGLang runs under a collective are
split in two — a *local* half that reports this rank's fact (``ready_write_acks``, the pipeline's
``can_terminate_local``, the controller's ``parked_hits``, ...) and an *apply* half that takes the reduced
value — and ``HiCacheModel`` (or the pipeline, for prefetches) performs the MIN/MAX between them, exactly at
the points of the seed's §3.7 table. Where the sources differ the choice is recorded in
``specs/decisions.md`` under the D-number cited in a comment.

Ownership of slots (what the host/device conservation invariants check):
* device slots: free, a node's ``value``, or a running request's pages;
* host slots: free, a node's ``host_value``, a prefetch operation's ``host_indices`` (from allocation until
  inserted or released), or the host-memory release queue.
"""

from __future__ import annotations

from refcache.config import HiCacheConfig
from refcache.hicache.states import NodeEvent
from refcache.model._controller import L3Store
from refcache.model._requests import RequestCache
from refcache.model._tree import TreeNode

__all__ = ["RankCache", "TreeNode"]


class RankCache(RequestCache):
    """HiRadixCache + HiCacheController of one rank (see the module docstring)."""

    def __init__(self, config: HiCacheConfig, rank: int, l3: L3Store) -> None:
        RequestCache.__init__(self, config, rank, l3)

    # --- reset and idleness ---------------------------------------------------------------------------------

    def busy(self) -> bool:
        return bool(
            self.requests
            or self.ongoing_write_through
            or self.ongoing_load_back
            or self.ongoing_prefetch
            or self.ongoing_backup
            or self.cache_controller.busy()
        )

    def reset(self) -> None:
        for node in list(self.nodes.values()):
            if node is not self.root:
                self._transition(node, NodeEvent.RESET)
        self._reset_tree()
        self._reset_tiers()
        self._reset_prefetch()
        self._reset_requests()
        self.cache_controller.reset()
        self.device.clear()  # the controller shares both allocators: cleared, never replaced
        self.host.clear()
