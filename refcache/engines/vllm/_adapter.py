"""The adapter: refcache's vLLM operations onto vLLM's scheduler-side calls, and vLLM's state out as a
``VllmSnapshot``.

The adapter plays the scheduler: it builds each ``Request`` (with vLLM's own request block hasher, so
``block_hashes`` are vLLM's), calls ``get_computed_blocks`` and ``allocate_slots``, advances
``num_computed_tokens``, frees, and keeps the offload jobs it started in two FIFO queues. After every
operation it takes both managers' events (vLLM filters a failed store's removal event at take time, and
the model takes its events at the same moments).

vLLM names cached content by hash; a snapshot names it by ``NodeId`` (namespace and token path). The
adapter records, for every hash vLLM computed for a request, the content it stands for; two contents
with one hash are a collision (``VllmSnapshot.hash_collisions``, the NAMESPACE invariant).

State is read from vLLM's objects, private ones included (the cache map's ``_cache``, the free queue's
links, the offload manager's counters and its policy's order): the snapshot is what the invariants need,
and a public listing of it does not exist.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Self

import torch
import vllm
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.request import Request, RequestStatus

from refcache.config import HiCacheConfig
from refcache.errors import UnsupportedError
from refcache.family import NodeId
from refcache.vllm.config import OffloadPolicy, VllmConfig
from refcache.vllm.model import replay_events
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
from refcache.vllm.snapshot import BlockRecord, ChunkRecord, OffloadRecord, RequestRecord, VllmSnapshot

__all__ = ["SUPPORTED", "VllmSystem"]

SUPPORTED: Final = "0.33."
"""The vLLM releases whose internals the adapter reads (``specs/vllm.md``, "Supported releases")."""

if not vllm.__version__.startswith(SUPPORTED):
    raise UnsupportedError(f"refcache.engines.vllm drives vLLM {SUPPORTED}x; this is vLLM {vllm.__version__}")

# The seed of every hash chain. sha256_cbor seeds it from a fixed string unless PYTHONHASHSEED is set, so
# hashes are the same in every process; the adapter never compares hashes across processes anyway.
init_none_hash(sha256_cbor)
# reset_prefix_cache logs a warning each time it refuses; a refusal is an observation here.
logging.getLogger("vllm.v1.core.block_pool").setLevel(logging.ERROR)

_MAX_MODEL_LEN: Final = 1 << 16
_LOOKUP: Final = {LookupResult.MISS: "miss", LookupResult.HIT: "hit", LookupResult.HIT_PENDING: "hit_pending"}


@dataclass
class _Running:
    request: Request
    context: ReqContext  # the offload manager's per-request context
    namespace: str
    prompt_len: int
    hit_tokens: int


class VllmSystem:
    """vLLM's managers behind the vLLM alphabet (see the module docstring)."""

    def __init__(self, config: HiCacheConfig) -> None:
        self.config = VllmConfig.of(config)
        bs = self.config.block_size
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)
        # One full-attention group per layer, all of one spec: one group gets the UnitaryKVCacheCoordinator,
        # more the HybridKVCacheCoordinator (one spec group: one joint lookup over the group ids).
        kv_config = KVCacheConfig(
            num_blocks=self.config.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(layer_names=[f"layer{g}"], kv_cache_spec=spec)
                for g in range(self.config.kv_groups)
            ],
        )
        self.manager = KVCacheManager(
            kv_config,
            max_model_len=_MAX_MODEL_LEN,
            scheduler_block_size=bs,
            hash_block_size=bs,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        self.offload = (
            CPUOffloadingManager(
                self.config.offload_chunks, cache_policy=self.config.offload_policy.value, enable_events=True
            )
            if self.config.offload_chunks
            else None
        )
        self._hasher = get_request_block_hasher(bs, sha256_cbor)
        self.running: dict[int, _Running] = {}
        self.stores: deque[tuple[list[object], ReqContext]] = deque()  # (offload keys, context)
        self.loads: deque[tuple[list[object], ReqContext]] = deque()
        self.events: list[KvEvent] = []  # taken from vLLM, not yet from us
        self.replayed: Counter[NodeId] = Counter()
        # (vLLM hash as bytes or as the event's int, group) and offload key -> content
        self._content: dict[object, NodeId] = {}
        self._collisions: list[str] = []
        self._lora_ids: dict[str, int] = {}

    # --- requests and hashes ------------------------------------------------------------------------------

    def _request(self, rid: int, tokens: tuple[int, ...], lora: str | None, salt: str | None) -> Request:
        lora_request = None
        if lora is not None:
            lora_id = self._lora_ids.setdefault(lora, len(self._lora_ids) + 1)
            lora_request = LoRARequest(lora_name=lora, lora_int_id=lora_id, lora_path=f"/lora/{lora}")
        request = Request(
            request_id=str(rid),
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=_MAX_MODEL_LEN // 2),
            pooling_params=None,
            lora_request=lora_request,
            cache_salt=salt,
            block_hasher=self._hasher,
        )
        self._learn(request, namespace_of(lora, salt))
        return request

    def _learn(self, request: Request, namespace: str) -> None:
        """Record the content each of ``request``'s hashes stands for."""
        bs = self.config.block_size
        tokens = tuple(request.all_token_ids)
        for i, block_hash in enumerate(request.block_hashes):
            key = NodeId(namespace, tokens[: (i + 1) * bs])
            known = self._content.setdefault(make_offload_key(block_hash, 0), key)
            if known != key:
                self._collisions.append(f"{known} and {key} share one block hash")
            for group in range(self.config.kv_groups):
                group_key = NodeId(group_namespace(namespace, group), key.path)
                self._content.setdefault((block_hash, group), group_key)
                self._content.setdefault((maybe_convert_block_hash(block_hash), group), group_key)

    def _node(self, name: object) -> NodeId:
        return self._content.get(name) or NodeId("?unknown-hash", ())

    def _cached(self, name: bytes) -> NodeId:
        """The content a cache key (``BlockHashWithGroupId``) stands for."""
        return self._node((get_block_hash(name), get_group_id(name)))

    def _offload_keys(self, run: _Running, n_blocks: int) -> list[object]:
        return [make_offload_key(h, 0) for h in run.request.block_hashes[:n_blocks]]

    # --- operations ---------------------------------------------------------------------------------------

    def apply(self, op: VllmOp) -> VllmObservation:
        check_op(op, self.config, self.running, len(self.stores), len(self.loads))
        result = self._apply(op)
        self._take_events()
        return result

    def _apply(self, op: VllmOp) -> VllmObservation:
        match op:
            case Lookup(tokens, lora, salt):
                _, hit, _ = self.manager.get_computed_blocks(self._request(-1, tokens, lora, salt))
                return HitResult(hit)
            case Admit(rid, tokens, lora, salt, external):
                return self._admit(rid, tokens, lora, salt, external)
            case Decode(rid, token):
                run = self.running[rid]
                request = run.request
                request.append_output_token_ids(token)
                self._learn(request, run.namespace)
                new = self.manager.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
                if new is not None:
                    request.num_computed_tokens = request.num_tokens
                return DecodeResult(new is not None, self._table(rid))
            case Free(rid):
                run = self.running.pop(rid)
                self.manager.free(run.request)
                if self.offload is not None:
                    self.offload.on_request_finished(run.context)
                return Done()
            case EvictBlocks(block_ids):
                self.manager.evict_blocks(set(block_ids))
                return Done()
            case ResetPrefixCache():
                return ResetResult(self.manager.reset_prefix_cache())
            case TakeEvents():
                taken, self.events = tuple(self.events), []
                return EventsResult(taken)
            case _:
                return self._apply_offload(op)

    def _admit(
        self, rid: int, tokens: tuple[int, ...], lora: str | None, salt: str | None, external: int
    ) -> AdmitResult:
        request = self._request(rid, tokens, lora, salt)
        blocks, hit, _ = self.manager.get_computed_blocks(request)
        external = min(external, request.num_tokens - 1 - hit)
        new = self.manager.allocate_slots(
            request,
            request.num_tokens - hit - max(external, 0),
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks,
            num_external_computed_tokens=max(external, 0),
        )
        if new is None:
            return AdmitResult(False, 0, ())
        request.num_computed_tokens = request.num_tokens
        request.status = RequestStatus.RUNNING
        context = ReqContext(req_id=str(rid))
        if self.offload is not None:
            self.offload.on_new_request(context)
        self.running[rid] = _Running(request, context, namespace_of(lora, salt), len(tokens), hit)
        return AdmitResult(True, hit, self._table(rid))

    def _apply_offload(self, op: VllmOp) -> VllmObservation:
        offload = self.offload
        assert offload is not None  # check_op refuses offload operations without it
        bs = self.config.block_size
        match op:
            case Store(rid):
                run = self.running[rid]
                keys = self._offload_keys(run, run.request.num_computed_tokens // bs)
                out = offload.prepare_store(keys, run.context)
                if out is None:
                    return StoreResult(False, (), ())
                stored = list(out.keys_to_store)
                if stored:
                    self.stores.append((stored, run.context))
                return StoreResult(
                    True, tuple(self._node(k) for k in stored), tuple(self._node(k) for k in out.evicted_keys)
                )
            case CompleteStore(success):
                keys, context = self.stores.popleft()
                offload.complete_store(keys, context, success=success)
                return IOResult(tuple(self._node(k) for k in keys))
            case Load(rid):
                run = self.running[rid]
                lookups: list[str] = []
                hits: list[object] = []
                for key in self._offload_keys(run, len(run.request.block_hashes)):
                    lookups.append(_LOOKUP[offload.lookup(key, run.context)])
                    if lookups[-1] != "hit":
                        break
                    hits.append(key)
                if hits:
                    offload.prepare_load(hits, run.context)
                    self.loads.append((hits, run.context))
                return LoadResult(tuple(lookups), tuple(self._node(k) for k in hits))
            case CompleteLoad():
                keys, context = self.loads.popleft()
                offload.complete_load(keys, context)
                return IOResult(tuple(self._node(k) for k in keys))
            case _:  # pragma: no cover - every operation is handled above
                raise AssertionError(f"unhandled operation {op!r}")

    def _take_events(self) -> None:
        pool_events: list[KvEvent] = []
        for event in self.manager.take_events():
            if isinstance(event, BlockStored):
                group = event.group_idx or 0
                parent = (
                    None if event.parent_block_hash is None else self._node((event.parent_block_hash, group))
                )
                keys = tuple(self._node((h, group)) for h in event.block_hashes)
                pool_events.append(KvEvent(EventKind.STORED, keys, parent))
            elif isinstance(event, BlockRemoved):
                group = event.group_idx or 0
                pool_events.extend(
                    KvEvent(EventKind.REMOVED, (self._node((h, group)),)) for h in event.block_hashes
                )
            elif isinstance(event, AllBlocksCleared):
                pool_events.append(KvEvent(EventKind.CLEARED, ()))
        replay_events(self.replayed, pool_events)
        self.events += pool_events
        if self.offload is not None:
            for offload_event in self.offload.take_events():
                kind = EventKind.OFFLOAD_REMOVED if offload_event.removed else EventKind.OFFLOAD_STORED
                self.events.append(KvEvent(kind, tuple(self._node(k) for k in offload_event.keys)))

    # --- state --------------------------------------------------------------------------------------------

    def _table(self, rid: int, group: int = 0) -> tuple[int, ...]:
        blocks = self.manager.coordinator.single_type_managers[group].req_to_blocks.get(str(rid), [])
        return tuple(b.block_id for b in blocks)

    def _walk(self, start: KVCacheBlock, forward: bool) -> tuple[int, ...]:
        """Block ids along the free queue's links from a fake end, stopping at the other fake end (or
        after more steps than there are blocks: a cycle)."""
        out: list[int] = []
        block = start.next_free_block if forward else start.prev_free_block
        while block is not None and block.block_id != -1 and len(out) <= self.config.num_blocks:
            out.append(block.block_id)
            block = block.next_free_block if forward else block.prev_free_block
        return tuple(out)

    def snapshot(self) -> VllmSnapshot:
        pool = self.manager.block_pool
        managers = self.manager.coordinator.single_type_managers
        blocks = tuple(
            BlockRecord(
                b.block_id,
                b.ref_cnt,
                None if b.block_hash is None else self._cached(b.block_hash),
                len(pool.cached_block_hashes_by_block.get(b.block_id, ())),
            )
            for b in pool.blocks
        )
        cache_map = []
        for name, held in pool.cached_block_hash_to_block._cache.items():
            ids = (held.block_id,) if isinstance(held, KVCacheBlock) else tuple(held)
            cache_map.append((self._cached(name), ids))
        requests = []
        for rid, run in sorted(self.running.items()):
            request = run.request
            requests.append(
                RequestRecord(
                    rid,
                    tuple(request.all_token_ids),
                    run.namespace,
                    run.prompt_len,
                    run.hit_tokens,
                    request.num_computed_tokens,
                    tuple(self._node((h, 0)) for h in request.block_hashes),
                    self._table(rid),
                    managers[0].num_cached_block.get(str(rid), 0),
                    tuple(self._table(rid, g) for g in range(1, len(managers))),
                    tuple(m.num_cached_block.get(str(rid), 0) for m in managers[1:]),
                )
            )
        queue = pool.free_block_queue
        return VllmSnapshot(
            self.config.block_size,
            blocks,
            self._walk(queue.fake_free_list_head, True),
            self._walk(queue.fake_free_list_tail, False),
            queue.num_free_blocks,
            tuple(sorted(cache_map)),
            tuple(requests),
            tuple(sorted((k, n) for k, n in self.replayed.items() if n)),
            tuple(self._collisions),
            self._offload_record(),
        )

    def _offload_record(self) -> OffloadRecord | None:
        offload = self.offload
        if offload is None:
            return None
        policy = offload._policy
        if self.config.offload_policy is OffloadPolicy.LRU:
            chunks = dict(policy.chunks)
            recency = tuple(sorted(chunks, key=lambda k: policy._ranks[k]))
            frequent: tuple[object, ...] = ()
            ghosts: tuple[tuple[object, ...], tuple[object, ...]] = ((), ())
            target = 0.0
        else:
            chunks = {**policy.t1, **policy.t2}
            recency, frequent = tuple(policy.t1), tuple(policy.t2)
            ghosts = (tuple(policy.b1), tuple(policy.b2))
            target = policy.target_t1_size
        records = sorted(
            (ChunkRecord(self._node(k), c.chunk_id, c.ref_cnt) for k, c in chunks.items()),
            key=lambda r: r.key,
        )
        return OffloadRecord(
            self.config.offload_chunks,
            tuple(records),
            tuple(self._node(k) for k in recency),
            tuple(self._node(k) for k in frequent),
            (tuple(self._node(k) for k in ghosts[0]), tuple(self._node(k) for k in ghosts[1])),
            target,
            tuple(offload._free_list),
            offload._num_allocated_chunks,
            offload._num_evictable_cache_chunks,
            offload._num_write_pending_chunks,
            tuple(tuple(self._node(k) for k in keys) for keys, _ in self.stores),
            tuple(tuple(self._node(k) for k in keys) for keys, _ in self.loads),
        )

    def close(self) -> None:
        self.running.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
