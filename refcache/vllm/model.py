"""``VllmModel``: the executable reference model of vLLM v1's KV cache manager (one or more full-attention
KV cache groups of one spec) and CPU offload manager, playing vLLM's scheduler over the operation alphabet of ``refcache.vllm.ops``.

Pure Python and deterministic; the block pool is ``refcache.vllm._pool``, the offload manager and its
policies ``refcache.vllm._offload``. The adapter over vLLM's own code (``refcache.engines.vllm``) takes
the same operations and reports the same ``VllmSnapshot``, so the harness compares them step by step.

With several KV cache groups (``VllmConfig.kv_groups``) every group holds its own table per request, in
the one shared pool, and the coordinator's order is kept: an admission touches every group's hit blocks
first, then allocates every group's blocks for external tokens, then every group's new blocks (in group
order each time), and caches each group's full blocks; ``free`` frees group 0's table, then group 1's.
The offload operations move group 0's blocks (the adapter's connector offloads one group).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

from refcache.config import HiCacheConfig
from refcache.family import NodeId
from refcache.vllm._offload import Access, OffloadManager
from refcache.vllm._pool import BlockPool
from refcache.vllm.config import VllmConfig
from refcache.vllm.ops import (
    Admit,
    AdmitResult,
    CompleteLoad,
    CompleteStore,
    Decode,
    DecodeResult,
    Done,
    EventKind,
    EventsResult,
    EvictBlocks,
    Free,
    HitResult,
    IOResult,
    KvEvent,
    Load,
    LoadResult,
    Lookup,
    ResetPrefixCache,
    ResetResult,
    Store,
    StoreResult,
    TakeEvents,
    VllmObservation,
    VllmOp,
    check_op,
    group_namespace,
    namespace_of,
)
from refcache.vllm.snapshot import OffloadRecord, RequestRecord, VllmSnapshot

__all__ = ["VllmModel", "replay_events"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def replay_events(counts: Counter[NodeId], events: list[KvEvent]) -> None:
    """Apply the block pool's events to a multiset of contents (offload events are not the pool's)."""
    for event in events:
        if event.kind is EventKind.STORED:
            counts.update(event.keys)
        elif event.kind is EventKind.REMOVED:
            counts.subtract(event.keys)
        elif event.kind is EventKind.CLEARED:
            counts.clear()


@dataclass
class _Request:
    rid: int
    tokens: list[int]  # prompt then output; only Decode appends
    namespace: str
    prompt_len: int
    hit_tokens: int
    groups: int = 1
    tables: list[list[int]] = field(default_factory=list)  # per group: block ids; append-only
    num_cached: list[int] = field(default_factory=list)  # per group: leading table entries hashed
    num_computed: int = 0  # tokens computed (the scheduler advances it)
    access: Access = field(default_factory=Access)  # offload accesses

    def __post_init__(self) -> None:
        self.tables = [[] for _ in range(self.groups)]
        self.num_cached = [0] * self.groups

    def keys(self, bs: int, group: int = 0) -> list[NodeId]:
        namespace = group_namespace(self.namespace, group)
        return [NodeId(namespace, tuple(self.tokens[: (i + 1) * bs])) for i in range(len(self.tokens) // bs)]


class VllmModel:
    """The reference model (see the module docstring). ``apply`` raises ``UsageError`` (state unchanged)
    for an operation the alphabet's preconditions refuse."""

    def __init__(self, config: HiCacheConfig) -> None:
        self.config = VllmConfig.of(config)
        self.pool = BlockPool(self.config.num_blocks)
        self.offload = (
            OffloadManager(self.config.offload_chunks, self.config.offload_policy)
            if self.config.offload_chunks
            else None
        )
        self.requests: dict[int, _Request] = {}  # running, by rid
        self.stores: deque[tuple[NodeId, ...]] = deque()  # queued store jobs
        self.loads: deque[tuple[NodeId, ...]] = deque()  # queued load jobs
        self.events: list[KvEvent] = []  # emitted, not yet taken by TakeEvents
        self.replayed: Counter[NodeId] = Counter()  # every block-pool event so far, replayed

    # --- operations -----------------------------------------------------------------------------------

    def apply(self, op: VllmOp) -> VllmObservation:
        check_op(op, self.config, self.requests, len(self.stores), len(self.loads))
        result = self._apply(op)
        pool_events, self.pool.events = self.pool.events, []
        replay_events(self.replayed, pool_events)
        self.events += pool_events
        if self.offload is not None:
            self.events += self.offload.take_events()
        return result

    def _apply(self, op: VllmOp) -> VllmObservation:
        bs = self.config.block_size
        match op:
            case Lookup(tokens, lora, salt):
                probe = self._new(-1, tokens, lora, salt)
                return HitResult(len(self._hit(probe)[0]) * bs)
            case Admit(rid, tokens, lora, salt, external):
                return self._admit(self._new(rid, tokens, lora, salt), external)
            case Decode(rid, token):
                req = self.requests[rid]
                req.tokens.append(token)
                return DecodeResult(self._allocate(req), tuple(req.tables[0]))
            case Free(rid):
                req = self.requests.pop(rid)
                for table in req.tables:  # the coordinator frees group by group
                    self.pool.free(table)
                if self.offload is not None:
                    self.offload.on_request_finished(req.access)
                return Done()
            case EvictBlocks(block_ids):
                self.pool.evict_blocks(block_ids)
                return Done()
            case ResetPrefixCache():
                return ResetResult(self.pool.reset())
            case TakeEvents():
                taken, self.events = tuple(self.events), []
                return EventsResult(taken)
            case _:
                return self._apply_offload(op)

    def _new(self, rid: int, tokens: tuple[int, ...], lora: str | None, salt: str | None) -> _Request:
        return _Request(rid, list(tokens), namespace_of(lora, salt), len(tokens), 0, self.config.kv_groups)

    def _hit(self, req: _Request) -> list[list[int]]:
        bs = self.config.block_size
        keys = [req.keys(bs, g) for g in range(req.groups)]
        return self.pool.hit_groups(keys, (len(req.tokens) - 1) // bs)

    def _admit(self, req: _Request, external: int) -> AdmitResult:
        bs = self.config.block_size
        n = len(req.tokens)
        hits = self._hit(req)
        hit_tokens = len(hits[0]) * bs
        external = min(external, n - 1 - hit_tokens)
        need = sum(
            max(_cdiv(n, bs) - len(hit), 0) + sum(1 for b in hit if self.pool.blocks[b].ref_cnt == 0)
            for hit in hits
        )
        if need > self.pool.num_free:
            return AdmitResult(False, 0, ())
        for table, hit in zip(req.tables, hits, strict=True):  # phase 1: every group's hit is touched
            self.pool.touch(hit)
            table += hit
        req.num_cached = [len(hit) for hit in hits]
        req.hit_tokens = req.num_computed = hit_tokens
        if external > 0:  # phase 2: then every group's blocks for the external tokens
            for table in req.tables:
                table += self.pool.get_new_blocks(max(0, _cdiv(hit_tokens + external, bs) - len(table)))
        self.requests[req.rid] = req
        assert self._allocate(req)
        return AdmitResult(True, req.hit_tokens, tuple(req.tables[0]))

    def _allocate(self, req: _Request) -> bool:
        """allocate_slots for every uncomputed token, group by group, then cache each group's full blocks;
        False if they do not fit."""
        bs = self.config.block_size
        n = len(req.tokens)
        if sum(max(_cdiv(n, bs) - len(table), 0) for table in req.tables) > self.pool.num_free:
            return False
        for table in req.tables:
            table += self.pool.get_new_blocks(max(_cdiv(n, bs) - len(table), 0))
        num_full = n // bs
        for group, table in enumerate(req.tables):
            self.pool.cache_full(table, req.keys(bs, group), req.num_cached[group], num_full)
            req.num_cached[group] = max(req.num_cached[group], num_full)
        req.num_computed = n
        return True

    def _apply_offload(self, op: VllmOp) -> VllmObservation:
        assert self.offload is not None  # check_op refuses offload operations without it
        bs = self.config.block_size
        match op:
            case Store(rid):
                req = self.requests[rid]
                keys = req.keys(bs)[: req.num_computed // bs]
                prepared = self.offload.prepare_store(keys, req.access)
                if prepared is None:
                    return StoreResult(False, (), ())
                stored, evicted = prepared
                if stored:
                    self.stores.append(tuple(stored))
                return StoreResult(True, tuple(stored), tuple(evicted))
            case CompleteStore(success):
                job = self.stores.popleft()
                self.offload.complete_store(job, success)
                return IOResult(job)
            case Load(rid):
                req = self.requests[rid]
                lookups: list[str] = []
                hits: list[NodeId] = []
                for key in req.keys(bs):
                    lookups.append(self.offload.lookup(key))
                    if lookups[-1] != "hit":
                        break
                    hits.append(key)
                if hits:
                    self.offload.prepare_load(hits, req.access)
                    self.loads.append(tuple(hits))
                return LoadResult(tuple(lookups), tuple(hits))
            case CompleteLoad():
                job = self.loads.popleft()
                self.offload.complete_load(job)
                return IOResult(job)
            case _:  # pragma: no cover - every operation is handled above
                raise AssertionError(f"unhandled operation {op!r}")

    # --- state ------------------------------------------------------------------------------------------

    def snapshot(self) -> VllmSnapshot:
        bs = self.config.block_size
        requests = tuple(
            RequestRecord(
                r.rid,
                tuple(r.tokens),
                r.namespace,
                r.prompt_len,
                r.hit_tokens,
                r.num_computed,
                tuple(r.keys(bs)),
                tuple(r.tables[0]),
                r.num_cached[0],
                tuple(tuple(t) for t in r.tables[1:]),
                tuple(r.num_cached[1:]),
            )
            for r in sorted(self.requests.values(), key=lambda r: r.rid)
        )
        offload = None
        if self.offload is not None:
            recency, frequent, ghosts, target = self.offload.policy.orders()
            offload = OffloadRecord(
                self.offload.capacity,
                self.offload.chunk_records(),
                recency,
                frequent,
                ghosts,
                target,
                tuple(self.offload.free_list),
                self.offload.num_allocated,
                self.offload.num_evictable,
                self.offload.num_write_pending,
                tuple(self.stores),
                tuple(self.loads),
            )
        return VllmSnapshot(
            bs,
            self.pool.records(),
            tuple(self.pool.queue),
            tuple(reversed(self.pool.queue)),
            self.pool.num_free,
            tuple(sorted((k, tuple(v)) for k, v in self.pool.cache.items())),
            requests,
            tuple(sorted((k, n) for k, n in self.replayed.items() if n)),
            (),
            offload,
        )

    def close(self) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
