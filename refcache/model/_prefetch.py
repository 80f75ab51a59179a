"""L3→L2 prefetch of one rank and of all ranks: admission, completion, abort, the drain (seed §2.2, §3.6, §3.7).

Theory of operation
-------------------
``PrefetchingTree`` adds to the tiers (``_tiers.TieredTree``) the scheduler's side of a prefetch: the
``ongoing_prefetch`` table (request id → anchor, key and the controller's ``PrefetchOperation``), the
tokens it occupies, and the insert of fetched pages as host-only nodes (``_insert_helper_host``). What
happens between admission and that insert is a *pipeline*, chosen once from the configuration
(``pipeline_for``) and held by every rank and by ``HiCacheModel``:

* ``AllocateAtAdmission`` (refcache's, seed §2.2; SGLang's up to 0.5.15): host memory for the whole key at
  admission; the query's MIN cuts it to the hits; ``check_prefetch_progress`` is ``can_terminate_prefetch``
  (MAX), then the MIN of completed tokens, then the insert; revokes, backups and releases drain by MIN-reduced
  counts. Its limits follow a release's where an option says: D-59 (a shorter key when the host pool falls
  short), D-60 (the cap), D-61 and D-64 (the timeout), D-62 (the priority of pages inserted below the root).
* ``AllocateAfterQuery`` (SGLang 0.5.20's, D-01, ``allocate_prefetch_after_query``): no host memory until
  the scheduler's drain of the hit query allocates the hits; the I/O helper's acks are reduced one by one
  (MIN) and the final one inserts; ``check_prefetch_progress`` is one MAX of ``should_terminate``.
* ``AllocateAfterQueryUnacked`` (SGLang up to 0.5.18's, D-01 with D-54, ``prefetch_progress_in_operation``):
  admission, query and drain as ``AllocateAfterQuery``'s; no acks: the I/O helper publishes its progress in the
  operation and releases the unread tail itself, and ``check_prefetch_progress`` is refcache's lock-step
  protocol (``can_terminate_prefetch`` with its MAX, the MIN of completed tokens, the insert).
* ``RevokeAtQuery`` (SGLang 0.5.16 and 0.5.17's, D-58, ``revoke_at_query``): ``AllocateAfterQueryUnacked`` whose
  prefetch thread revokes a query below the threshold through ``prefetch_revoke_queue``, drained first.

A pipeline holds no state: every method takes the rank (rank-local halves) or all ranks (the lock-step
protocol with its collectives, as ``HiCacheModel`` runs it), and rank state changes only through these
methods and the rank's own.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, TypeVar

from refcache.config import HiCacheConfig, PrefetchPolicy
from refcache.hicache.ops import ProgressResult
from refcache.hicache.states import NodeEvent, PrefetchEvent
from refcache.model._controller import HiCacheController, L3Store, PrefetchOperation
from refcache.model._pure import can_terminate_all, reduce_min
from refcache.model._tiers import TieredTree
from refcache.model._tree import ROOT_PRIORITY_SGLANG, Key, TreeNode

__all__ = [
    "PREFETCH_TIMEOUT_MAX_S",
    "ROOT_PRIORITY_0520",
    "AllocateAfterQuery",
    "AllocateAfterQueryUnacked",
    "AllocateAtAdmission",
    "PrefetchPipeline",
    "PrefetchingTree",
    "RevokeAtQuery",
    "pipeline_for",
]

ROOT_PRIORITY_0520: Final = ROOT_PRIORITY_SGLANG
"""The priority of 0.5.20's root node (``-sys.maxsize``), which a prefetch insert below it hands down (D-01)."""

PREFETCH_TIMEOUT_MAX_S: Final = 30.0
"""0.5.20's default ``prefetch_timeout_max`` (D-01)."""

_T = TypeVar("_T")


@dataclass(slots=True)
class _PrefetchEntry:
    """An ``ongoing_prefetch`` entry (scheduler side); the controller runs ``op``."""

    anchor: TreeNode  # last_host_node, host-protected until the entry goes
    tokens: Key  # page-aligned prefetch key
    namespace: str | None
    op: PrefetchOperation
    # D-57 only (empty otherwise): the prefixes split off the anchor since admission, root side first, each
    # host-protected with it until the entry goes; only PrefetchingTree._split_inflight adds to it
    split_off: list[TreeNode] = field(default_factory=list)


@dataclass(slots=True)
class _PrefetchWait:
    """D-55 (SGLang 0.5.23's ``_StoragePrefetchWait``): the ``timeout`` budget of request ``rid``'s prefetch, from
    its first progress check that could not terminate it; kept until the request's admission, its abort or a
    reset, so a later prefetch of the same request keeps it, and once expired declines it."""

    started_us: (
        int | None
    )  # the rank's clock at that first blocked check; None for a wait only marked expired
    timeout_s: float  # base + pages * per_page, in 0.5.23's float arithmetic
    expired: bool = False  # a check terminated the prefetch on its timeout verdict


class PrefetchingTree(TieredTree):
    """The tiers with the scheduler's side of L3 prefetch (see the module docstring)."""

    def __init__(self, config: HiCacheConfig, rank: int, l3: L3Store) -> None:
        TieredTree.__init__(self, config, rank, l3)
        self.prefetch_pipeline = pipeline_for(config)  # chosen once: never a flag tested per call
        self._reset_prefetch()

    def _reset_prefetch(self) -> None:
        self.ongoing_prefetch: dict[int, _PrefetchEntry] = {}  # rid → entry
        self.prefetch_tokens_occupied = 0
        self.prefetch_loaded_tokens: dict[
            int, int
        ] = {}  # AllocateAfterQuery only: rid → tokens its insert added
        self.prefetch_waits: dict[int, _PrefetchWait] = {}  # D-55 only: rid → its timeout budget

    def _split_inflight(self, child: TreeNode, new: TreeNode) -> None:
        TieredTree._split_inflight(self, child, new)
        if not self.cfg.anchor_pin_follows_split:
            return
        # D-57 (SGLang 0.5.22 on): the anchor's host pin is a segment; the prefix split off it, or off a prefix
        # split off it before, is pinned with it until the prefetch ends.
        for entry in self.ongoing_prefetch.values():
            pinned = [*entry.split_off, entry.anchor]
            if child in pinned:
                entry.split_off.insert(pinned.index(child), new)
                self._protect_host(new)

    def _release_prefetch_pins(self, entry: _PrefetchEntry) -> None:
        """Release what the entry host-protects: its anchor and (D-57) the prefixes split off it."""
        for node in [*entry.split_off, entry.anchor]:
            self._release_host(node)

    def prefetch_from_storage(self, rid: int, anchor: TreeNode, tokens: Key, namespace: str | None) -> str:
        """The three admission layers; returns "" when admitted, else the refusing layer's name."""
        return self.prefetch_pipeline.admit(self, rid, anchor, self.page_aligned(tokens), namespace)

    def _insert_helper_host(
        self, node: TreeNode, key: Key, host_value: list[int], hash_value: list[str], namespace: str | None
    ) -> int:
        """Attach fetched pages below ``node`` as host-only nodes; returns tokens not attached (freed).
        The anchor ``node`` and every matched child count as accessed (D-33)."""
        self._touch(node)
        matched = 0
        while key:
            child = node.children.get(self._child_key(namespace, key))
            if child is None:
                break
            self._touch(child)
            plen = self._match_len(child.key, key, 0)
            key, host_value, hash_value = key[plen:], host_value[plen:], hash_value[plen // self.ps :]
            matched += plen
            if plen < len(child.key):
                child = self._split_node(child, plen)
            node = child
        if not key:
            return matched
        if not node.backuped:
            # Never hang host-only nodes under a device-only node (sglang.md §9 #6): drop the data. D-06.
            return matched + len(key)
        leaf = self._new_node(namespace)
        leaf.key = key
        leaf.host_value = list(host_value)
        leaf.hash_value = list(hash_value)
        leaf.priority = self.prefetch_pipeline.new_leaf_priority(self, node)
        leaf.parent = node
        self._transition(leaf, NodeEvent.PREFETCH_INSERT)
        node.children[self._child_key(leaf.namespace, key)] = leaf
        self._refresh_leaf(leaf)
        self._refresh_leaf(node)
        return matched


def _timed_out_capped(rank: PrefetchingTree, op: PrefetchOperation) -> bool:
    """0.5.20's timeout test (D-39; D-61: also 0.5.12..0.5.15's), in its float arithmetic on clock readings in
    seconds, so the boundary rounds as there: now - start > min(max, base + per_ki_token * tokens / 1024), tokens =
    the hits recorded so far, max = 30 s (the default ``prefetch_timeout_max``)."""
    elapsed = rank.cache_controller.clock_us / 1_000_000 - op.start_us / 1_000_000
    tokens = len(op.hash_value) * rank.ps
    limit = min(
        PREFETCH_TIMEOUT_MAX_S,
        rank.cfg.prefetch_timeout_base + rank.cfg.prefetch_timeout_per_ki_token * tokens / 1024,
    )
    return elapsed > limit


def _agreed(results: Sequence[_T]) -> _T:
    # Lock-step steps see equal trees, so every rank must answer alike; a difference is a model bug.
    assert all(x == results[0] for x in results), f"ranks answered differently: {results}"
    return results[0]


class PrefetchPipeline(abc.ABC):
    """What happens to a prefetch between admission and the insert of its pages (see the module docstring).

    Stateless; one instance per kind (``pipeline_for``). Rank-local methods take the rank, the lock-step
    protocol takes every rank."""

    @abc.abstractmethod
    def threshold(self, cfg: HiCacheConfig) -> int:
        """The fewest tokens a prefetch may ask for."""

    @abc.abstractmethod
    def capacity_limit(self, cfg: HiCacheConfig) -> int:
        """Admission stops while ``prefetch_tokens_occupied`` is at least this."""

    @abc.abstractmethod
    def start(
        self, rank: PrefetchingTree, rid: int, anchor: TreeNode, tokens: Key, namespace: str | None
    ) -> PrefetchOperation | None:
        """Hand the prefetch to the controller; None when there is no host memory for it."""

    def admit(
        self, rank: PrefetchingTree, rid: int, anchor: TreeNode, tokens: Key, namespace: str | None
    ) -> str:
        """``prefetch_from_storage`` of a page-aligned key; "" when admitted, else the refusing layer's name."""
        if len(tokens) < self.threshold(rank.cfg):
            return "below_threshold"
        if rank.prefetch_tokens_occupied >= self.capacity_limit(rank.cfg):
            return "rate_limited"
        rank._protect_host(anchor)
        op = self.start(rank, rid, anchor, tokens, namespace)
        if op is None:
            rank._release_host(anchor)
            return "no_host_memory"
        # the operation's key: ``tokens``, or (D-59) the shorter key the admission fell back to
        rank.ongoing_prefetch[rid] = _PrefetchEntry(anchor, op.tokens, namespace, op)
        rank.prefetch_tokens_occupied += len(op.tokens)
        return ""

    def new_leaf_priority(self, rank: PrefetchingTree, parent: TreeNode) -> int:
        """The priority of a host-only node inserted below ``parent``: its parent's."""
        return parent.priority

    @abc.abstractmethod
    def check_prefetch_progress(self, ranks: Sequence[PrefetchingTree], rid: int) -> ProgressResult:
        """``CheckPrefetchProgress`` on every rank in lock step."""

    @abc.abstractmethod
    def abort_prefetch(self, ranks: Sequence[PrefetchingTree], rid: int) -> None:
        """``AbortPrefetch`` (the scheduler's ``release_aborted_request``) on every rank."""

    @abc.abstractmethod
    def drain_storage_control_queues(self, ranks: Sequence[PrefetchingTree]) -> tuple[int, int, int]:
        """The storage part of ``check_hicache_events``; returns (backups, host releases, prefetches revoked)."""

    @abc.abstractmethod
    def after_operation(self, ranks: Sequence[PrefetchingTree]) -> None:
        """Run after every operation."""


class AllocateAtAdmission(PrefetchPipeline):
    """refcache's prefetch pipeline: host memory for the whole key at admission (seed §2.2, §3.6)."""

    def threshold(self, cfg: HiCacheConfig) -> int:
        return cfg.effective_prefetch_threshold

    def capacity_limit(self, cfg: HiCacheConfig) -> int:
        # D-60 (SGLang 0.5.15): int(0.5 * host_size); the seed's int(0.8 * (L2 - L1)) otherwise
        return cfg.prefetch_capacity_limit_0520 if cfg.prefetch_cap_half_host else cfg.prefetch_capacity_limit

    def start(
        self, rank: PrefetchingTree, rid: int, anchor: TreeNode, tokens: Key, namespace: str | None
    ) -> PrefetchOperation | None:
        host_indices = rank.host.alloc(len(tokens))
        if host_indices is None:
            rank.evict_host(len(tokens))
            host_indices = rank.host.alloc(len(tokens))
        if host_indices is None and rank.cfg.prefetch_admission_falls_back:
            # D-59 (SGLang 0.5.11..0.5.15): the page-aligned part of what the pool has left, if it still reaches
            # the threshold (the key's first pages)
            available = rank.host.available_size()
            length = available - available % rank.ps
            if length >= self.threshold(rank.cfg):
                tokens = tokens[:length]
                host_indices = rank.host.alloc(length)
        if host_indices is None:
            return None
        return rank.cache_controller.prefetch(rid, tokens, rank._prior_hash(anchor, namespace), host_indices)

    def new_leaf_priority(self, rank: PrefetchingTree, parent: TreeNode) -> int:
        # D-62 (SGLang 0.5.6..0.5.15): the root's priority is -sys.maxsize, which a page inserted below it takes
        if parent is rank.root and rank.cfg.prefetch_takes_root_priority:
            return ROOT_PRIORITY_0520
        return parent.priority

    # --- the lock-step protocol ---------------------------------------------------------------------------

    def check_prefetch_progress(self, ranks: Sequence[PrefetchingTree], rid: int) -> ProgressResult:
        if rid not in ranks[0].ongoing_prefetch:
            return ProgressResult(done=True, inserted=0)
        if ranks[0].cfg.hicache_storage_prefetch_policy is not PrefetchPolicy.BEST_EFFORT:
            local = [self.can_terminate_local(r, rid) for r in ranks]
            if not can_terminate_all([can for can, _ in local], [done for _, done in local]):
                return ProgressResult(done=False, inserted=0)
        completed = reduce_min([self.terminate_prefetch(r, rid) for r in ranks])
        return _agreed(
            [ProgressResult(done=True, inserted=self.finish_prefetch(r, rid, completed)) for r in ranks]
        )

    def abort_prefetch(self, ranks: Sequence[PrefetchingTree], rid: int) -> None:
        if rid in ranks[0].ongoing_prefetch:
            for r in ranks:
                self.release_aborted_request(r, rid)

    def drain_storage_control_queues(self, ranks: Sequence[PrefetchingTree]) -> tuple[int, int, int]:
        sizes = [r.cache_controller.control_queue_sizes() for r in ranks]
        revoke, backups, releases = (reduce_min([s[i] for s in sizes]) for i in range(3))
        revoked = _agreed(
            [self.drain_storage_control_queues_apply(r, revoke, backups, releases) for r in ranks]
        )
        return backups, releases, revoked

    def after_operation(self, ranks: Sequence[PrefetchingTree]) -> None:
        pass  # an operation that let go of everything has released it through the queues already

    # --- one rank's halves --------------------------------------------------------------------------------

    def can_terminate_local(self, rank: PrefetchingTree, rid: int) -> tuple[bool, bool]:
        """Local half of ``can_terminate_prefetch``: ``(can_terminate, is_terminated)`` on this rank."""
        op = rank.ongoing_prefetch[rid].op
        policy = rank.cfg.hicache_storage_prefetch_policy
        if policy is PrefetchPolicy.BEST_EFFORT:
            return True, op.terminated
        # An empty hash list is never "complete" (sglang.md §9 #13).
        completed = len(op.hash_value) > 0 and op.completed_tokens == len(op.hash_value) * rank.ps
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            return completed, op.terminated
        return completed or self._prefetch_timed_out(rank, op), op.terminated

    def _prefetch_timed_out(self, rank: PrefetchingTree, op: PrefetchOperation) -> bool:
        if rank.cfg.prefetch_timeout_capped:  # D-61 (SGLang 0.5.12..0.5.15): 0.5.20's form and arithmetic
            return _timed_out_capped(rank, op)
        if rank.cfg.prefetch_timeout_in_floats:  # D-64 (SGLang up to 0.5.11): the seed's form, in floats
            elapsed = rank.cache_controller.clock_us / 1_000_000 - op.start_us / 1_000_000
            per_page = rank.ps / 1024 * rank.cfg.prefetch_timeout_per_ki_token
            return elapsed > rank.cfg.prefetch_timeout_base + len(op.hash_value) * per_page
        # timeout = base + per_page * pages, per_page = page_size / 1024 * per_ki_token (seed §3.6), in
        # integer microseconds scaled by 1024 so that no rounding is involved.
        elapsed_x1024 = (rank.cache_controller.clock_us - op.start_us) * 1024
        limit_x1024 = (
            rank.cfg.prefetch_timeout_base_us * 1024
            + len(op.hash_value) * rank.ps * rank.cfg.prefetch_timeout_per_ki_token_us
        )
        return elapsed_x1024 > limit_x1024

    def terminate_prefetch(self, rank: PrefetchingTree, rid: int) -> int:
        """``terminate_prefetch``: stop the operation; returns this rank's completed tokens."""
        return rank.cache_controller.terminate_prefetch(rank.ongoing_prefetch[rid].op)

    def finish_prefetch(self, rank: PrefetchingTree, rid: int, min_completed_tokens: int) -> int:
        """Insert the common prefix (MIN over ranks) as host-only nodes; returns tokens newly inserted."""
        entry = rank.ongoing_prefetch.pop(rid)
        op = entry.op
        # Everything read so far; any unread tail stays with the I/O helper.
        taken = rank.cache_controller.take(op, op.completed_tokens)
        inserted = taken[:min_completed_tokens]
        matched = rank._insert_helper_host(
            entry.anchor,
            entry.tokens[:min_completed_tokens],
            inserted,
            op.hash_value[: min_completed_tokens // rank.ps],
            entry.namespace,
        )
        if matched:
            rank.host.free(inserted[:matched])  # already in the tree: duplicates
        rank.cache_controller.append_host_mem_release(taken[min_completed_tokens:])
        rank._release_prefetch_pins(entry)
        rank.prefetch_tokens_occupied -= len(entry.tokens)
        return min_completed_tokens - matched

    def release_aborted_request(self, rank: PrefetchingTree, rid: int) -> None:
        entry = rank.ongoing_prefetch.pop(rid)
        ctrl = rank.cache_controller
        completed = ctrl.terminate_prefetch(entry.op)
        ctrl.append_host_mem_release(ctrl.take(entry.op, completed))
        rank._release_prefetch_pins(entry)
        rank.prefetch_tokens_occupied -= len(entry.tokens)

    def drain_storage_control_queues_apply(
        self, rank: PrefetchingTree, revoke: int, backup: int, release: int
    ) -> int:
        """Process the MIN-reduced number of entries of each control queue; returns the prefetches revoked."""
        revoked = 0
        for rid, op_id in rank.cache_controller.pop_revokes(revoke):
            entry = rank.ongoing_prefetch.get(rid)
            # The request may have terminated or aborted meanwhile, and its id may even carry a newer
            # prefetch: revoke only the operation the query resolved (SGLang keys this by request id).
            if entry is not None and entry.op.id == op_id:
                del rank.ongoing_prefetch[rid]
                rank._release_prefetch_pins(entry)
                rank.prefetch_tokens_occupied -= len(entry.tokens)
                revoked += 1
        rank.backup_acks_apply(backup)
        rank.host_mem_release_apply(release)
        return revoked


class AllocateAfterQuery(PrefetchPipeline):
    """SGLang 0.5.20's prefetch pipeline (D-01, ``allocate_prefetch_after_query``): the threshold as
    configured (not raised to a page), the cap ``int(0.5 * host_size)``, and no host memory until the
    drain of the hit query."""

    def threshold(self, cfg: HiCacheConfig) -> int:
        return cfg.prefetch_threshold

    def capacity_limit(self, cfg: HiCacheConfig) -> int:
        return cfg.prefetch_capacity_limit_0520

    def start(
        self, rank: PrefetchingTree, rid: int, anchor: TreeNode, tokens: Key, namespace: str | None
    ) -> PrefetchOperation | None:
        return rank.cache_controller.prefetch_unallocated(rid, tokens, rank._prior_hash(anchor, namespace))

    def admit(
        self, rank: PrefetchingTree, rid: int, anchor: TreeNode, tokens: Key, namespace: str | None
    ) -> str:
        """As every pipeline admits, but (D-55, 0.5.23) a request whose prefetch was terminated on its timeout
        verdict is declined until its admission (``prefetch_from_storage`` returns at its expired wait)."""
        wait = rank.prefetch_waits.get(rid)
        if wait is not None and wait.expired:
            return "deadline_expired"
        return super().admit(rank, rid, anchor, tokens, namespace)

    def new_leaf_priority(self, rank: PrefetchingTree, parent: TreeNode) -> int:
        # 0.5.20's new node takes its parent's priority, and its root's is -sys.maxsize (D-51: UnifiedRadixCache's
        # root priority is raised by every insert, which the tree keeps on its root).
        if parent is rank.root and not rank.cfg.root_priority_from_inserts:
            return ROOT_PRIORITY_0520
        return parent.priority

    # --- the lock-step protocol ---------------------------------------------------------------------------

    def check_prefetch_progress(self, ranks: Sequence[PrefetchingTree], rid: int) -> ProgressResult:
        """0.5.20's ``check_prefetch_progress`` (one MAX of ``should_terminate``), then the scheduler's
        ``pop_prefetch_loaded_tokens``: what this call, or an earlier drain of the final ack, inserted."""
        if rid in ranks[0].ongoing_prefetch:
            if not max(self.check_prefetch_progress_local(r, rid) for r in ranks):
                for r in ranks:
                    self.start_wait(r, rid)
                return ProgressResult(done=False, inserted=0)
            for r in ranks:
                self.mark_expired(r, rid)
                self.terminate_prefetch(r, rid)
        return _agreed(
            [ProgressResult(done=True, inserted=r.prefetch_loaded_tokens.pop(rid, 0)) for r in ranks]
        )

    def abort_prefetch(self, ranks: Sequence[PrefetchingTree], rid: int) -> None:
        for r in ranks:
            self.release_aborted_request(r, rid)

    def drain_storage_control_queues(self, ranks: Sequence[PrefetchingTree]) -> tuple[int, int, int]:
        sizes4 = [r.cache_controller.drain_queue_sizes() for r in ranks]
        hit, acks, backups, releases = (reduce_min([s[i] for s in sizes4]) for i in range(4))
        self._reduce_prefetch_acks(ranks, acks)
        revoked = _agreed(
            [self.drain_storage_control_queues_apply(r, hit, acks, backups, releases) for r in ranks]
        )
        return backups, releases, revoked

    def _reduce_prefetch_acks(self, ranks: Sequence[PrefetchingTree], count: int) -> None:
        """0.5.20's prefetch sync thread forwards each rank's ``n``-th read ack with the MIN over ranks of
        its completed tokens (``_reduce_prefetch_ack``, an all-reduce that returns once every rank's I/O
        thread sent that ack; the final ack carries none). The ``count`` acks every rank has are those."""
        queues = [r.cache_controller.ack_prefetch_queue for r in ranks]
        for i in range(count):
            done = [q[i][1] for q in queues]
            if any(d is None for d in done):
                continue
            low = reduce_min([d for d in done if d is not None])
            for q in queues:
                op, _, final = q[i]
                q[i] = (op, low, final)

    def after_operation(self, ranks: Sequence[PrefetchingTree]) -> None:
        for r in ranks:
            self.forget_dead_prefetches(r)

    # --- one rank's halves --------------------------------------------------------------------------------

    def revoke_pending_prefetch(self, rank: PrefetchingTree, rid: int) -> bool:
        """``_revoke_pending_prefetch``: drop the entry (by request id, as 0.5.20 keys it)."""
        entry = rank.ongoing_prefetch.pop(rid, None)
        if entry is None:
            return False
        rank._release_prefetch_pins(entry)
        rank.prefetch_tokens_occupied = max(0, rank.prefetch_tokens_occupied - len(entry.tokens))
        return True

    def handle_prefetch_result(self, rank: PrefetchingTree, rid: int) -> None:
        """``_handle_prefetch_result``: insert the drained completed tokens of the entry's operation; the
        operation keeps ``[completed_tokens, ...)`` until the drain of its final ack frees it."""
        entry = rank.ongoing_prefetch.pop(rid)
        op = entry.op
        done = op.completed_tokens - op.completed_tokens % rank.ps
        matched = rank._insert_helper_host(
            entry.anchor,
            entry.tokens[:done],
            op.host_indices[:done],
            op.hash_value[: done // rank.ps],
            entry.namespace,
        )
        rank.host.free(op.host_indices[:matched])
        rank._release_prefetch_pins(entry)
        rank.prefetch_tokens_occupied -= len(entry.tokens)
        rank.prefetch_loaded_tokens[rid] = done - matched

    def check_prefetch_progress_local(self, rank: PrefetchingTree, rid: int) -> bool:
        """Local half of 0.5.20's ``check_prefetch_progress``: ``is_terminated() or can_terminate``."""
        op = rank.ongoing_prefetch[rid].op
        policy = rank.cfg.hicache_storage_prefetch_policy
        if policy is PrefetchPolicy.BEST_EFFORT:
            return True
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            return op.terminated  # only the drain of the final ack completes it
        if rank.cfg.prefetch_timeout_from_first_poll:
            return op.terminated or self._deadline_expired(rank, rid, op)
        return op.terminated or self._prefetch_timed_out(rank, op)

    def _deadline_expired(self, rank: PrefetchingTree, rid: int, op: PrefetchOperation) -> bool:
        """D-55, 0.5.23's ``_prefetch_deadline_expired``: never once every hit is read (the drain of the final
        ack completes it); else the request's wait has expired, or has run for longer than its budget (clock
        readings in seconds, compared in floats as 0.5.23's ``PollTimer``). No wait yet: not expired."""
        if op.allocated and op.completed_tokens >= len(op.hash_value) * rank.ps:
            return False
        wait = rank.prefetch_waits.get(rid)
        if wait is None:
            return False
        if wait.expired:
            return True
        if wait.started_us is None:
            return False
        elapsed = rank.cache_controller.clock_us / 1_000_000 - wait.started_us / 1_000_000
        return elapsed > wait.timeout_s

    def start_wait(self, rank: PrefetchingTree, rid: int) -> None:
        """D-55, 0.5.23's ``_start_storage_prefetch_wait`` after a check that could not terminate: under
        ``timeout``, the request's first such check starts its wait, with a budget of the base plus the
        prefetch's requested pages (not its hits) at the per-page rate, ``page_size / 1024 * per_ki_token``."""
        cfg = rank.cfg
        if (
            not cfg.prefetch_timeout_from_first_poll
            or cfg.hicache_storage_prefetch_policy is not PrefetchPolicy.TIMEOUT
            or rid in rank.prefetch_waits
        ):
            return
        pages = len(rank.ongoing_prefetch[rid].tokens) // rank.ps
        per_page = rank.ps / 1024 * cfg.prefetch_timeout_per_ki_token
        rank.prefetch_waits[rid] = _PrefetchWait(
            rank.cache_controller.clock_us, cfg.prefetch_timeout_base + pages * per_page
        )

    def mark_expired(self, rank: PrefetchingTree, rid: int) -> None:
        """D-55, 0.5.23's ``_mark_prefetch_deadline_expired``: a check under ``timeout`` that terminates a prefetch
        not yet terminated marks the request's wait expired (creating one)."""
        cfg = rank.cfg
        if (
            cfg.prefetch_timeout_from_first_poll
            and cfg.hicache_storage_prefetch_policy is PrefetchPolicy.TIMEOUT
            and not rank.ongoing_prefetch[rid].op.terminated
        ):
            rank.prefetch_waits.setdefault(rid, _PrefetchWait(None, 0.0)).expired = True

    def _prefetch_timed_out(self, rank: PrefetchingTree, op: PrefetchOperation) -> bool:
        return _timed_out_capped(rank, op)

    def terminate_prefetch(self, rank: PrefetchingTree, rid: int) -> None:
        """Terminate, then revoke (no host memory yet) or insert what was drained."""
        op = rank.ongoing_prefetch[rid].op
        op.terminated = True
        if not op.allocated:
            self.revoke_pending_prefetch(rank, rid)
        else:
            self.handle_prefetch_result(rank, rid)

    def release_aborted_request(self, rank: PrefetchingTree, rid: int) -> None:
        """0.5.20's ``release_aborted_request`` (0.5.23's also ends the request's wait, D-55)."""
        rank.prefetch_loaded_tokens.pop(rid, None)
        rank.prefetch_waits.pop(rid, None)
        entry = rank.ongoing_prefetch.get(rid)
        if entry is None:
            return
        op = entry.op
        op.terminated = True
        if not op.allocated:
            self.revoke_pending_prefetch(rank, rid)
            return
        rank._release_prefetch_pins(entry)
        del rank.ongoing_prefetch[rid]
        rank.cache_controller.append_host_mem_release(op.host_indices[: op.completed_tokens])
        rank.prefetch_tokens_occupied -= len(entry.tokens)

    def drain_storage_control_queues_apply(
        self, rank: PrefetchingTree, hit: int, acks: int, backup: int, release: int
    ) -> int:
        """0.5.20's drain: allocate for (or revoke) queried prefetches, apply the I/O acks (the final one
        inserts a live entry's pages and frees the operation's unread tail), backups, releases. Returns the
        prefetches revoked."""
        ctrl = rank.cache_controller
        revoked = 0
        threshold = rank.cfg.prefetch_threshold
        for _ in range(hit):
            op = ctrl.prefetch_hit_queue.popleft()
            rid = op.request_id
            if rid not in rank.ongoing_prefetch:
                continue
            if op.terminated or op.storage_hit_count < threshold:
                revoked += self.revoke_pending_prefetch(rank, rid)
                continue
            length = op.storage_hit_count
            slots = rank.host.alloc(length)
            if slots is None:
                rank.evict_host(length)
                slots = rank.host.alloc(length)
            if slots is None:  # a shorter page-aligned prefix
                available = rank.host.available_size()
                length = min(op.storage_hit_count, available - available % rank.ps)
                if length >= threshold:
                    slots = rank.host.alloc(length)
            if slots is None:
                revoked += self.revoke_pending_prefetch(rank, rid)
                continue
            op.storage_hit_count = length
            op.hash_value = op.hash_value[: length // rank.ps]
            op.host_indices = slots
            op.allocated = True
            op.move(PrefetchEvent.QUERY_HIT)
            ctrl.prefetch_buffer.append(op)
        for _ in range(acks):
            op, completed, final = ctrl.ack_prefetch_queue.popleft()
            if completed is not None and op.request_id in rank.ongoing_prefetch:
                op.completed_tokens = completed
            if final:
                if op.request_id in rank.ongoing_prefetch:
                    self.handle_prefetch_result(rank, op.request_id)
                if rank.cfg.release_unread_prefetch_tail:  # D-52: freed by a later drain (counted before)
                    ctrl.append_host_mem_release(op.host_indices[op.completed_tokens :])
                else:
                    rank.host.free(op.host_indices[op.completed_tokens :])
                ctrl.pending_prefetch_ops.remove(op)
        rank.backup_acks_apply(backup)
        rank.host_mem_release_apply(release)
        self.start_io(ctrl)
        return revoked

    def start_io(self, ctrl: HiCacheController) -> None:
        """After the drain: the I/O helper runs on to its next read (0.5.20 acks what needs no read at once)."""
        ctrl.advance_prefetch_io()

    def forget_dead_prefetches(self, rank: PrefetchingTree) -> None:
        """Operations revoked before any allocation, and no longer queued, hold nothing (0.5.20 drops them)."""
        ctrl = rank.cache_controller
        queued = {op.id for op in ctrl.prefetch_queue} | {op.id for op in ctrl.prefetch_hit_queue}
        if ctrl.prefetch_parked is not None:
            queued.add(ctrl.prefetch_parked.op.id)
        live = {e.op.id for e in rank.ongoing_prefetch.values()}
        ctrl.pending_prefetch_ops = [
            op for op in ctrl.pending_prefetch_ops if op.allocated or op.id in queued or op.id in live
        ]


class AllocateAfterQueryUnacked(AllocateAfterQuery):
    """SGLang up to 0.5.18's prefetch pipeline (D-01 with D-54, ``prefetch_progress_in_operation``; read in
    0.5.18's ``hiradix_cache.py`` and ``cache_controller.py``): admission, the hit query and the drain's
    allocation as 0.5.20's, but no ``ack_prefetch_queue``. The I/O helper adds each batch it reads to the
    operation's ``completed_tokens`` and queues the unread tail for release when the transfer ends (the
    controller's ``read_reserved``, as refcache's); ``check_prefetch_progress`` is ``can_terminate_prefetch``
    (the MAX of ``[1 - can_terminate, is_terminated]``, none under ``best_effort``), then, an operation without
    host memory revoked, ``terminate_prefetch``, the MIN of completed tokens and the insert (refcache's
    ``finish_prefetch``); ``release_aborted_request`` releases what was read, the helper the rest."""

    def check_prefetch_progress(self, ranks: Sequence[PrefetchingTree], rid: int) -> ProgressResult:
        if rid not in ranks[0].ongoing_prefetch:
            return ProgressResult(done=True, inserted=0)
        if ranks[0].cfg.hicache_storage_prefetch_policy is not PrefetchPolicy.BEST_EFFORT:
            local = [self.can_terminate_local(r, rid) for r in ranks]
            if not can_terminate_all([can for can, _ in local], [done for _, done in local]):
                return ProgressResult(done=False, inserted=0)
        if not ranks[0].ongoing_prefetch[rid].op.allocated:
            for r in ranks:
                r.ongoing_prefetch[rid].op.terminated = True
                self.revoke_pending_prefetch(r, rid)
            return ProgressResult(done=True, inserted=0)
        completed = reduce_min([_CLASSIC.terminate_prefetch(r, rid) for r in ranks])
        return _agreed(
            [ProgressResult(done=True, inserted=_CLASSIC.finish_prefetch(r, rid, completed)) for r in ranks]
        )

    def can_terminate_local(self, rank: PrefetchingTree, rid: int) -> tuple[bool, bool]:
        """Local half of 0.5.18's ``can_terminate_prefetch``: ``(can_terminate, is_terminated)``; the timeout
        is 0.5.20's (``_prefetch_timeout_check_linear_func`` is the same)."""
        op = rank.ongoing_prefetch[rid].op
        policy = rank.cfg.hicache_storage_prefetch_policy
        completed = len(op.hash_value) > 0 and op.completed_tokens == len(op.hash_value) * rank.ps
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            return completed, op.terminated
        return completed or self._prefetch_timed_out(rank, op), op.terminated

    def release_aborted_request(self, rank: PrefetchingTree, rid: int) -> None:
        """0.5.18's ``release_aborted_request``: revoke an operation without host memory; else terminate, and
        queue what was read for release (the I/O helper releases the unread tail when its transfer ends)."""
        rank.prefetch_loaded_tokens.pop(rid, None)
        entry = rank.ongoing_prefetch.get(rid)
        if entry is None:
            return
        entry.op.terminated = True
        if not entry.op.allocated:
            self.revoke_pending_prefetch(rank, rid)
            return
        _CLASSIC.release_aborted_request(rank, rid)

    def drain_storage_control_queues(self, ranks: Sequence[PrefetchingTree]) -> tuple[int, int, int]:
        sizes = [r.cache_controller.drain_queue_sizes() for r in ranks]
        hit, backups, releases = (reduce_min([s[i] for s in sizes]) for i in (0, 2, 3))
        revoked = _agreed(
            [self.drain_storage_control_queues_apply(r, hit, 0, backups, releases) for r in ranks]
        )
        return backups, releases, revoked

    def after_operation(self, ranks: Sequence[PrefetchingTree]) -> None:
        pass  # the operations the tree let go are the controller's orphans until their transfer ends

    def start_io(self, ctrl: HiCacheController) -> None:
        pass  # every step of the helper is a read (``read_reserved``); nothing runs without one


class RevokeAtQuery(AllocateAfterQueryUnacked):
    """SGLang 0.5.16 and 0.5.17's prefetch pipeline (D-01 with D-54 and D-58, ``revoke_at_query``; read in
    0.5.17's ``cache_controller.py`` ``prefetch_thread_func`` and ``hiradix_cache.py``
    ``_drain_storage_control_queues_impl``): as 0.5.18's, but the prefetch thread revokes a query below the
    threshold itself, through ``prefetch_revoke_queue`` (the controller's ``RevokeAtQuery``), and the drain
    reduces four queue sizes (revoke, hit, backup, release) and empties its share of the revoke queue before it
    allocates for the hit queue: a revoke that unprotects an anchor lets the same drain's ``evict_host`` take
    it. The revoke goes by request id, as ``_revoke_pending_prefetch(req_id)`` does."""

    def drain_storage_control_queues(self, ranks: Sequence[PrefetchingTree]) -> tuple[int, int, int]:
        sizes = [r.cache_controller.drain_queue_sizes() for r in ranks]
        hit, backups, releases, revokes = (reduce_min([s[i] for s in sizes]) for i in (0, 2, 3, 4))
        revoked = _agreed([self.revoke_queued(r, revokes) for r in ranks])
        revoked += _agreed(
            [self.drain_storage_control_queues_apply(r, hit, 0, backups, releases) for r in ranks]
        )
        return backups, releases, revoked

    def revoke_queued(self, rank: PrefetchingTree, count: int) -> int:
        """The drain's first part: revoke the ``count`` oldest entries of the revoke queue; returns how many
        live prefetches it revoked."""
        return sum(
            self.revoke_pending_prefetch(rank, rid) for rid, _ in rank.cache_controller.pop_revokes(count)
        )


_CLASSIC: Final = AllocateAtAdmission()
_AFTER_QUERY: Final = AllocateAfterQuery()
_UNACKED: Final = AllocateAfterQueryUnacked()
_PIPELINES: Final[dict[tuple[bool, bool, bool], PrefetchPipeline]] = {
    **dict.fromkeys(
        ((False, a, r) for a in (False, True) for r in (False, True)), _CLASSIC
    ),  # D-54, D-58 refine D-01's
    (True, False, False): _AFTER_QUERY,
    (True, False, True): _AFTER_QUERY,  # D-58 refines D-54's pipeline only
    (True, True, False): _UNACKED,
    (True, True, True): RevokeAtQuery(),
}


def pipeline_for(config: HiCacheConfig) -> PrefetchPipeline:
    """The prefetch pipeline a configuration asks for (``allocate_prefetch_after_query``, D-01,
    ``prefetch_progress_in_operation``, D-54, and ``revoke_at_query``, D-58)."""
    return _PIPELINES[
        config.allocate_prefetch_after_query, config.prefetch_progress_in_operation, config.revoke_at_query
    ]
