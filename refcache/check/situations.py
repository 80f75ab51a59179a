"""Situations: the named circumstances where real HiCache bugs live, recognised from outside a system.

A situation is a fact about one step that the node states, transitions and tables of the coverage
ledger do not show: a load back of a chain of nodes, a refusal under a device prefix, a load acknowledged
on one rank before the others, a clock that lands exactly on a prefetch deadline, a storage read that
stops in the middle of a chain, a read that meets an object a fault misplaced. Storage faults are
followed through their documented meaning (``FaultKind``: which object of the rank's sorted L3 view a
fault's index picks) and the L3 key sets of the snapshots: a read removes the damaged object it meets. ``SituationTracker.observe`` recognises them from what a machine sees —
the operation, its outcome and the reference system's snapshots before and after — never from the
model's internals, so the ledger means the same when a machine drives another engine's adapter.
``SITUATIONS`` names each with one line of meaning (``refcache coverage`` prints them; the coverage test
fails when the default budget misses one). Another family's situations live with its rules
(``refcache.rules``), and ``ledger_report`` (``refcache.check.coverage``) prints them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Final

from refcache.config import AttentionKind, HiCacheConfig, PrefetchPolicy, WritePolicy
from refcache.hashing import Token, page_hashes, storage_key, storage_namespace_seed, to_bigram
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    EventsResult,
    Evict,
    EvictResult,
    FaultKind,
    IOQueue,
    Observation,
    Op,
    PrefetchFromStorage,
    PrefetchResult,
    ProgressResult,
    StartRequest,
    StartResult,
    StorageFault,
)
from refcache.hicache.snapshot import InFlight, NodeId, NodeRecord, PrefetchRecord, RankSnapshot, Snapshot
from refcache.hicache.states import NodeState

__all__ = [
    "SITUATIONS",
    "SituationTracker",
    "damaged_key",
    "key_of",
    "walk",
]

SITUATIONS: Final[Mapping[str, str]] = {
    "load-back-chain": "a request loads a host chain of two or more nodes back to the device",
    "load-back-refused-under-device-node": "a host suffix below load_back_threshold is not loaded, under "
    "a device prefix whose last node is not the root",
    "load-back-at-threshold": "a request loads exactly load_back_threshold tokens (more than a page)",
    "load-back-evicts-device": "a load back needs more device slots than are free, so it evicts "
    "(sglang.md §9 #8)",
    "load-acked-on-one-rank": "CheckHicacheEvents while one rank has finished a load and another has not",
    "control-queues-skewed": "CheckHicacheEvents while the ranks' control queues differ (sglang.md §9 #1)",
    "prefetch-progress-skewed": "CheckPrefetchProgress while the ranks have read different amounts "
    "(sglang.md §9 #2)",
    "prefetch-hits-at-threshold": "a prefetch's hit query finds exactly prefetch_threshold tokens (more "
    "than a page)",
    "prefetch-at-timeout": "an unfinished, non-empty prefetch is checked when its elapsed time equals its "
    "timeout",
    "prefetch-past-timeout": "an unfinished, non-empty prefetch is checked 1 us after its timeout",
    "prefetch-timed-out-on-one-rank": "an unfinished, non-empty prefetch is checked past its timeout on "
    "one rank's clock and not on another's (D-41; sglang.md §9 #2)",
    "prefetch-over-device-node": "a prefetch finishes while a device-only node sits on its path below its "
    "anchor (sglang.md §9 #6)",
    "prefetch-read-stops-mid-chain": "a prefetch read stops at a bad page after a whole earlier storage "
    "batch arrived",
    "write-through-at-hit-count": "selective write-through starts on a node whose hit count just reached "
    "the threshold",
    "split-under-write-through": "a pending write-through covers a node split into fragments "
    "(sglang.md §9 #15)",
    "write-back-drops-for-host": "write-back eviction drops a device-only node that found no host memory "
    "(sglang.md §9 #7)",
    "misplaced-object-read": "a prefetch read meets an object that a misplaced fault overwrote with the "
    "next key's object (issue #30 item 2)",
    "damaged-page-rewritten-and-read": "a page whose damaged object a read dropped is backed up again, then "
    "read intact by a prefetch (issue #30 item 2)",
    "deleted-inner-page-before-later-batch": "a prefetch's hit query stops at an absent inner page while a "
    "later page of the chain, in a later storage batch, is present (issue #30 item 2)",
    "l3-hit-ranks-disagree": "a prefetch's hit query is answered while the ranks' L3 views of its chain "
    "differ, so the ranks' own hit counts differ and the MIN differs from one of them (issue #30 item 1)",
    "prefetch-released-ranks-differ": "a prefetch's entry goes (done, aborted or revoked) while the ranks "
    "had read different amounts of it: each rank frees its own unread rest (issue #30 item 1)",
    "loads-in-flight-interleaved": "a completion of one rank's load stream finishes some, not all, of two or "
    "more host->device loads in flight there (issue #30 item 4)",
    "loads-retired-between-completions": "CheckHicacheEvents while a rank has a finished load and a newer "
    "unfinished one: loading_check retires the finished prefix only (issue #30 item 4)",
    "prefetch-revoked-below-anchor": "a prefetch admitted below a non-root anchor is revoked: its tail is "
    "missing from L3 (issue #30 item 5)",
    "prefetch-inserts-below-anchor": "a prefetch ends by inserting host-only pages, read from L3, below a "
    "non-root anchor (issue #30 item 5)",
    "evict-chooses-after-prefetch-insert": "an Evict right after such an insert, with an evictable leaf at or "
    "below the anchor and another outside its subtree (D-33: the insert touched the anchor)",
    "split-of-prioritised-node": "a node whose priority is not 0 is split (its new node inherits the "
    "priority)",
    "evict-chooses-after-split": "an Evict right after a split, with the split's new node unlocked on the "
    "device and an evictable leaf outside its subtree whose priority is within 1 of its own",
    "load-back-write-back-short-of-host": "a load back under write-back must evict a device-only leaf whose "
    "backup needs more host memory than is free or held by unpinned host-only nodes off the loaded path: only "
    "the pages being loaded could give it (sglang.md §9 #7, #8; issue #30 item 6)",
    "flipped-payload-read": "a prefetch read meets an object whose payload a fault flipped (bit rot): its "
    "framing and key are intact, only its checksum tells (issue #30 item 6)",
}


def key_of(config: HiCacheConfig, tokens: tuple[int, ...]) -> tuple[Token, ...]:
    """The radix key of ``tokens``: the tokens, or their EAGLE bigrams."""
    return tuple(to_bigram(tokens)) if config.is_eagle else tokens


def walk(
    rank: RankSnapshot, key: tuple[Token, ...], namespace: str | None, page_size: int
) -> list[tuple[NodeRecord, int]]:
    """The nodes ``match_prefix`` would pass on ``key`` (page-aligned), from the root down, each with the
    number of its key elements the match covers (less than its length only for the last one)."""
    key = key[: len(key) // page_size * page_size]
    children: dict[NodeId, list[NodeRecord]] = {}
    for node in rank.nodes:
        children.setdefault(node.parent_id, []).append(node)
    here = NodeId(namespace or "", ())
    out: list[tuple[NodeRecord, int]] = []
    depth = 0
    while depth < len(key):
        step = next((c for c in children.get(here, ()) if c.id.path[depth] == key[depth]), None)
        if step is None:
            break
        common = 0
        for a, b in zip(step.id.path[depth:], key[depth:], strict=False):
            if a != b:
                break
            common += 1
        common = common // page_size * page_size
        if common == 0:
            break
        out.append((step, common))
        if common < step.key_len:
            break
        depth += common
        here = step.id
    return out


def damaged_key(kind: FaultKind, view: tuple[str, ...], index: int) -> str | None:
    """The key of ``view`` (a rank's sorted L3 view) that an object fault of ``kind`` at ``index`` damages
    (``FaultKind``; misplaced: modulo the view's length less one, copying the next key's object over it);
    None for a fault that damages no object, or an empty view."""
    if kind is FaultKind.MISPLACED:
        return view[index % (len(view) - 1)] if len(view) >= 2 else None
    if kind in (FaultKind.CORRUPT, FaultKind.DELETE, FaultKind.FLIP_PAYLOAD, FaultKind.STALE) and view:
        return view[index % len(view)]
    return None


def _at_or_below(node: NodeId, anchor: NodeId) -> bool:
    """Whether ``node`` is ``anchor`` or in its subtree (the same namespace, a path that extends it)."""
    return node.namespace == anchor.namespace and node.path[: len(anchor.path)] == anchor.path


def _queue(rank: RankSnapshot, name: str) -> int:
    return dict(rank.queues).get(name, 0)


def _interleaved_loads(op: Op, before: Snapshot, after: Snapshot) -> Iterator[str]:
    """Issue #30 item 4, from the load queue's lengths (finished: ``load_acks``; not yet: ``load_pending``):
    a completion that leaves a finished and an unfinished load on its rank, with two or more in flight and
    at least one finished by it; an events check that meets a finished load beside an unfinished one."""
    match op:
        case CompleteIO(IOQueue.LOAD, rank, _) if rank < len(before.ranks) and rank < len(after.ranks):
            was, now = _queue(before.ranks[rank], "load_pending"), _queue(after.ranks[rank], "load_pending")
            if now < was and now >= 1 and _queue(after.ranks[rank], "load_acks") >= 1:
                yield "loads-in-flight-interleaved"
        case CheckHicacheEvents():
            if any(_queue(r, "load_acks") and _queue(r, "load_pending") for r in before.ranks):
                yield "loads-retired-between-completions"
        case _:
            pass


def _record(rank: RankSnapshot, rid: int) -> PrefetchRecord | None:
    return next((p for p in rank.ongoing_prefetch if p.rid == rid), None)


class SituationTracker:
    """Recognises situations step by step for one run (it remembers each prefetch's start time, tokens
    and namespace). ``observe`` yields the names of the situations one step reached."""

    def __init__(self, config: HiCacheConfig) -> None:
        self.config = config
        # rid -> each rank's clock at the start (D-41), tokens, namespace
        self.prefetches: dict[int, tuple[tuple[int, ...], tuple[int, ...], str | None]] = {}
        # L3 objects a fault damaged and no read has met yet (storage key -> the first fault's kind), those a
        # read dropped, and those of them backed up again since
        self.damaged: dict[str, FaultKind] = {}
        self.dropped: set[str] = set()
        self.rewritten: set[str] = set()
        self._keys: dict[tuple[int, int], list[str]] = {}  # (rid, rank) -> its prefetched pages' L3 keys
        # issue #30 item 5: the anchors below which the last step inserted a prefetch's pages, and the new
        # nodes of the last step's splits (an Evict right after them chooses between them and a peer)
        self._inserted_below: list[NodeId] = []
        self._split_new: list[NodeId] = []
        # D-55 (prefetch_timeout_from_first_poll): rid -> each rank's clock at its first progress check that did
        # not finish it, where the timeout starts
        self._waits: dict[int, tuple[int, ...]] = {}

    def deadline_pages(self, rec: PrefetchRecord) -> int:
        """The pages a prefetch's timeout counts: its hits (D-26, D-39), or under D-55 the pages it asked for."""
        if self.config.prefetch_timeout_from_first_poll:
            return rec.tokens // self.config.page_size
        return rec.hit_pages

    def timeout_x1024(self, hit_pages: int) -> int:
        """A prefetch's timeout in microseconds times 1024 (exact: no rounding)."""
        cfg = self.config
        return (
            cfg.prefetch_timeout_base_us * 1024
            + hit_pages * cfg.page_size * cfg.prefetch_timeout_per_ki_token_us
        )

    def started(self, rid: int, rank: int = 0) -> int | None:
        """``rank``'s clock when prefetch ``rid``'s timeout started, if it did (each rank reads its own, D-41): its
        admission, or under D-55 its first progress check that did not finish it."""
        if self.config.prefetch_timeout_from_first_poll:
            clocks = self._waits.get(rid)
            return None if clocks is None else clocks[rank]
        entry = self.prefetches.get(rid)
        return None if entry is None else entry[0][rank]

    def prefetch_keys(self, rid: int, rank: int, rec: PrefetchRecord) -> list[str]:
        """The L3 keys, on ``rank``, of the pages prefetch ``rid`` reads (its page-aligned tail below its
        anchor, ``rec.tokens`` long), in order; [] for a prefetch this tracker did not see admitted."""
        known = self._keys.get((rid, rank))
        if known is not None:
            return known
        entry = self.prefetches.get(rid)
        if entry is None:
            return []
        cfg = self.config
        ps = cfg.page_size
        key = key_of(cfg, entry[1])
        aligned = len(key) // ps * ps
        hashes = page_hashes(key[:aligned], ps, storage_namespace_seed(entry[2]))
        mla = cfg.attention is AttentionKind.MLA
        keys = [
            storage_key(h, model_name=cfg.model_name, mla=mla, tp_rank=rank, tp_size=cfg.tp_size)
            for h in hashes[(aligned - rec.tokens) // ps :]
        ]
        self._keys[(rid, rank)] = keys
        return keys

    def observe(
        self, op: Op, outcome: Observation | Exception, before: Snapshot, after: Snapshot
    ) -> Iterator[str]:
        yield from self._storage(op, before, after)
        yield from self._step(op, outcome, before, after)
        yield from self._ranks(before, after)
        yield from self._anchored(op, outcome, before, after)

    def _storage(self, op: Op, before: Snapshot, after: Snapshot) -> Iterator[str]:
        """The L3 situations: damaged objects followed from their fault to the read that drops them, their
        backup again and their next read."""
        if isinstance(op, StorageFault) and op.rank < len(before.ranks):
            key = damaged_key(op.kind, before.ranks[op.rank].l3_keys, op.index)
            if key is not None and op.kind is not FaultKind.DELETE:
                self.damaged.setdefault(key, op.kind)
            return
        if not (self.damaged or self.dropped):
            return
        present = {k for r in after.ranks for k in r.l3_keys}
        reading = isinstance(op, CompleteIO) and op.queue is IOQueue.PREFETCH_IO
        for key in [k for k in self.damaged if k not in present]:
            kind = self.damaged.pop(key)
            if reading:  # a read removes the damaged object it meets
                self.dropped.add(key)
                if kind is FaultKind.MISPLACED:
                    yield "misplaced-object-read"
                elif kind is FaultKind.FLIP_PAYLOAD:
                    yield "flipped-payload-read"
        for key in [k for k in self.dropped if k in present]:
            self.dropped.discard(key)
            self.rewritten.add(key)
        self.rewritten &= present
        if reading and self.rewritten and isinstance(op, CompleteIO) and op.rank < len(before.ranks):
            ps = self.config.page_size
            for was in before.ranks[op.rank].ongoing_prefetch:
                now = _record(after.ranks[op.rank], was.rid)
                if now is None or now.completed_tokens <= was.completed_tokens:
                    continue
                keys = self.prefetch_keys(was.rid, op.rank, was)
                if self.rewritten & set(keys[was.completed_tokens // ps : now.completed_tokens // ps]):
                    yield "damaged-page-rewritten-and-read"

    def _step(
        self, op: Op, outcome: Observation | Exception, before: Snapshot, after: Snapshot
    ) -> Iterator[str]:
        cfg = self.config
        ps = cfg.page_size
        r0, a0 = before.ranks[0], after.ranks[0]
        match op:
            case StartRequest(_, tokens, namespace) if isinstance(outcome, StartResult):
                yield from self._start(r0, a0, tokens, namespace, outcome)
            case PrefetchFromStorage(rid, tokens, namespace) if isinstance(outcome, PrefetchResult):
                if outcome.admitted:
                    clocks = tuple(before.rank_clock_us(r) for r in range(len(before.ranks)))
                    self.prefetches[rid] = (clocks, tokens, namespace)
            case CheckHicacheEvents() if cfg.tp_size > 1:
                if any(_queue(r, "load_acks") for r in before.ranks) and any(
                    _queue(r, "load_pending") for r in before.ranks
                ):
                    yield "load-acked-on-one-rank"
                control = {
                    tuple(_queue(r, q) for q in ("revoke", "backup_acks", "host_release"))
                    for r in before.ranks
                }
                if len(control) > 1:
                    yield "control-queues-skewed"
            case CheckPrefetchProgress(rid):
                yield from self._progress(before, rid, outcome)
                if isinstance(outcome, ProgressResult) and not outcome.done and rid not in self._waits:
                    self._waits[rid] = tuple(before.rank_clock_us(r) for r in range(len(before.ranks)))
            case CompleteIO(IOQueue.PREFETCH_IO, rank, _) if rank < len(before.ranks):
                for was in before.ranks[rank].ongoing_prefetch:
                    now = _record(after.ranks[rank], was.rid)
                    if (
                        now is not None
                        and now.terminated
                        and not was.terminated
                        and now.completed_tokens >= cfg.storage_batch_size * ps
                        and now.completed_tokens < now.hit_pages * ps
                    ):
                        yield "prefetch-read-stops-mid-chain"
            case Evict() if cfg.hicache_write_policy is WritePolicy.WRITE_BACK:
                yield from self._dropped(r0, a0)
            case _:
                pass
        yield from _interleaved_loads(op, before, after)
        for rec in r0.ongoing_prefetch:
            now = _record(a0, rec.rid)
            if (
                rec.stage == "query"
                and now is not None
                and now.stage != "query"
                and now.hit_pages * ps == cfg.effective_prefetch_threshold > ps
            ):
                yield "prefetch-hits-at-threshold"
            if rec.stage == "query" and now is not None and now.stage != "query" and now.hit_pages:
                yield from self._gap(rec.rid, before, now)
        before_wt = {f for entry in r0.ongoing_write_through for f in entry}
        for entry in a0.ongoing_write_through:
            if len(entry) > 1 and entry not in r0.ongoing_write_through:
                yield "split-under-write-through"
        if cfg.hicache_write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            for node in a0.nodes:
                if (
                    InFlight.WRITE_THROUGH in node.in_flight
                    and node.id not in before_wt
                    and node.hit_count == cfg.write_through_threshold
                ):
                    yield "write-through-at-hit-count"
                    break

    def _ranks(self, before: Snapshot, after: Snapshot) -> Iterator[str]:
        """Rank-divergent prefetches (issue #30 item 1): a hit query answered (its stage leaves ``query``:
        the MIN all-reduce returned on every rank at once) while the ranks' own counts differ — each rank's
        leading pages of the chain present in its L3 view, what its query finds; and an entry that goes
        from every rank while the ranks' completed tokens differ."""
        if len(before.ranks) < 2:
            return
        for rec in before.ranks[0].ongoing_prefetch:
            records = [_record(rank, rec.rid) for rank in before.ranks]
            nows = [_record(rank, rec.rid) for rank in after.ranks]
            if any(r is None for r in records):
                continue
            if rec.stage == "query" and nows[0] is not None and nows[0].stage != "query":
                hits: set[int] = set()
                for rank, was in zip(before.ranks, records, strict=True):
                    assert was is not None
                    view = set(rank.l3_keys)
                    keys = self.prefetch_keys(rec.rid, rank.rank, was)
                    hits.add(next((i for i, k in enumerate(keys) if k not in view), len(keys)))
                if len(hits) > 1:
                    yield "l3-hit-ranks-disagree"
            if all(n is None for n in nows) and len({r.completed_tokens for r in records if r}) > 1:
                yield "prefetch-released-ranks-differ"

    def _anchored(
        self, op: Op, outcome: Observation | Exception, before: Snapshot, after: Snapshot
    ) -> Iterator[str]:
        """Issue #30 item 5, on rank 0: prefetches that end below a non-root anchor (revoked, or inserting
        pages there), splits of prioritised nodes, and the eviction that comes right after an insert or a
        split (``_inserted_below``, ``_split_new``: what the previous step left)."""
        r0, a0 = before.ranks[0], after.ranks[0]
        if isinstance(op, Evict) and isinstance(outcome, EvictResult) and outcome.num_evicted:
            leaves = [n for n in r0.nodes if n.evictable_leaf]
            for anchor in self._inserted_below:
                below = [n for n in leaves if _at_or_below(n.id, anchor)]
                if below and len(below) < len(leaves):
                    yield "evict-chooses-after-prefetch-insert"
                    break
            for new in self._split_new:
                node = r0.node(new)
                if node is None or node.state is NodeState.HOST or node.lock_ref:
                    continue
                if any(not _at_or_below(n.id, new) and abs(n.priority - node.priority) <= 1 for n in leaves):
                    yield "evict-chooses-after-split"
                    break
        self._inserted_below, self._split_new = [], []
        ended = [p for p in r0.ongoing_prefetch if p.anchor is not None and _record(a0, p.rid) is None]
        if ended and isinstance(outcome, EventsResult) and outcome.revoked:
            yield "prefetch-revoked-below-anchor"
        was = {n.id for n in r0.nodes}
        new_nodes = [n for n in a0.nodes if n.id not in was]
        for rec in ended:
            assert rec.anchor is not None
            anchor = rec.anchor
            if any(  # a new host-only node below the anchor that is no split fragment of an earlier node
                n.state is NodeState.HOST
                and _at_or_below(n.id, anchor)
                and n.id != anchor
                and not any(_at_or_below(old, n.id) for old in was)
                for n in new_nodes
            ):
                self._inserted_below.append(anchor)
        if self._inserted_below:
            yield "prefetch-inserts-below-anchor"
        for node in r0.nodes:
            now = a0.node(node.id)
            if now is not None and now.key_len < node.key_len:  # split: the lower part keeps the name
                self._split_new.append(now.parent_id)
                if node.priority:
                    yield "split-of-prioritised-node"

    def _gap(self, rid: int, before: Snapshot, now: PrefetchRecord) -> Iterator[str]:
        """A hit query that stopped, on some rank, at an absent inner page of its chain while a page in a
        later storage batch is present there (a query that went on past the gap would count it)."""
        gap, batch = now.hit_pages, self.config.storage_batch_size
        for rank in before.ranks:
            keys = self.prefetch_keys(rid, rank.rank, now)
            view = set(rank.l3_keys)
            later = (keys[q] in view for q in range(gap + 1, len(keys)) if q // batch > gap // batch)
            if gap < len(keys) and keys[gap] not in view and any(later):
                yield "deleted-inner-page-before-later-batch"
                return

    def _start(
        self,
        r0: RankSnapshot,
        a0: RankSnapshot,
        tokens: tuple[int, ...],
        namespace: str | None,
        obs: StartResult,
    ) -> Iterator[str]:
        cfg = self.config
        path = walk(r0, key_of(cfg, tokens), namespace, cfg.page_size)
        device = [n for n, _ in path if n.state is not NodeState.HOST]
        host = sum(m for n, m in path if n.state is NodeState.HOST)
        if obs.loaded:
            loaded = sum(1 for n, _ in path if n.state is NodeState.HOST)
            if cfg.hicache_write_policy is WritePolicy.WRITE_BACK and len(r0.device.free) < obs.loaded:
                yield from self._short_of_host(r0, {n.id for n, _ in path})
            if loaded >= 2:
                yield "load-back-chain"
            if obs.loaded == cfg.load_back_threshold > cfg.page_size:
                yield "load-back-at-threshold"
            if len(r0.device.free) < obs.loaded:
                yield "load-back-evicts-device"
        elif device and 0 < host < cfg.load_back_threshold:
            yield "load-back-refused-under-device-node"
        if cfg.hicache_write_policy is WritePolicy.WRITE_BACK:
            yield from self._dropped(r0, a0)

    def _short_of_host(self, r0: RankSnapshot, on_path: set[NodeId]) -> Iterator[str]:
        """A load back that evicts the device under write-back (the caller checked), where a device-only
        leaf's backup needs more host memory than the free slots and the unpinned host-only nodes off the
        loaded path hold: the nested evict_host finds room only in the pages being loaded, which must stay
        pinned (sglang.md §9 #8), else the leaf is dropped (§9 #7)."""
        spare = len(r0.host.free) + sum(
            len(n.host_value or ())
            for n in r0.nodes
            if n.state is NodeState.HOST and not n.host_ref_counter and n.id not in on_path
        )
        if any(
            n.state is NodeState.DEVICE and n.evictable_leaf and len(n.value or ()) > spare for n in r0.nodes
        ):
            yield "load-back-write-back-short-of-host"

    def _dropped(self, r0: RankSnapshot, a0: RankSnapshot) -> Iterator[str]:
        after = {n.id for n in a0.nodes}
        if any(n.state is NodeState.DEVICE and n.id not in after for n in r0.nodes):
            yield "write-back-drops-for-host"

    def _progress(self, before: Snapshot, rid: int, outcome: Observation | Exception) -> Iterator[str]:
        cfg = self.config
        records = [r for rank in before.ranks if (r := _record(rank, rid)) is not None]
        if not records:
            return
        if len({r.completed_tokens for r in records}) > 1:
            yield "prefetch-progress-skewed"
        rec = records[0]
        entry = self.prefetches.get(rid)
        if entry is None:
            return
        starts, tokens, namespace = entry
        if cfg.prefetch_timeout_from_first_poll:
            starts = self._waits.get(rid, ())
        unfinished = any(
            r.completed_tokens < r.hit_pages * cfg.page_size and not r.terminated for r in records
        )
        if (
            cfg.hicache_storage_prefetch_policy is PrefetchPolicy.TIMEOUT
            and rec.hit_pages
            and unfinished
            and starts
        ):
            limit = self.timeout_x1024(self.deadline_pages(rec))
            elapsed = [(before.rank_clock_us(r) - starts[r]) * 1024 for r in range(len(starts))]
            if elapsed[0] == limit:
                yield "prefetch-at-timeout"
            elif elapsed[0] > limit >= elapsed[0] - 1024:
                yield "prefetch-past-timeout"
            if any(e > limit for e in elapsed) and not all(e > limit for e in elapsed):
                yield "prefetch-timed-out-on-one-rank"
        if isinstance(outcome, ProgressResult) and outcome.done:
            anchor_depth = 0 if rec.anchor is None else rec.anchor.depth
            path = walk(before.ranks[0], key_of(cfg, tokens), namespace, cfg.page_size)
            if any(n.state is NodeState.DEVICE and n.id.depth > anchor_depth for n, _ in path):
                yield "prefetch-over-device-node"
