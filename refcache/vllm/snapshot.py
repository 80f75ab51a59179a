"""``VllmSnapshot``: a vLLM block pool and CPU offload manager's whole observable state, as plain data.

Blocks are named by id (vLLM's block tables are append-only, so ids are stable and comparable between the
model and vLLM); cached content is named by ``NodeId`` (the namespace and the token path from the first
token to the block's end), the content a vLLM block hash stands for. The invariants of
``refcache.vllm.invariants`` and the differential harness read nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from refcache.family import NodeId

__all__ = ["BlockRecord", "ChunkRecord", "OffloadRecord", "RequestRecord", "VllmSnapshot"]


@dataclass(frozen=True)
class BlockRecord:
    """One GPU block (``KVCacheBlock``)."""

    id: int  # block_id; 0 is the null block
    ref_cnt: int  # requests holding it (touch/get_new_blocks add one, free_blocks removes one)
    key: NodeId | None  # the content its hash stands for (namespace names the group: ops.namespace_of)
    extra_keys: int  # further hashes of the block (partial-prefix entries); 0 with one full-attention group


@dataclass(frozen=True)
class RequestRecord:
    """One running request, as the scheduler side of the system holds it."""

    rid: int
    tokens: tuple[int, ...]  # prompt then output tokens
    namespace: str  # NodeId.namespace of its blocks (LoRA, cache_salt)
    prompt_len: int  # tokens given at admission
    hit_tokens: int  # prefix-cache hit adopted at admission
    num_computed: int  # num_computed_tokens
    keys: tuple[NodeId, ...]  # request.block_hashes as content (group 0's names): one per full block
    table: tuple[int, ...]  # req_to_blocks of KV cache group 0, block ids in order
    num_cached: int  # num_cached_block of group 0: leading table entries already hashed into the cache
    group_tables: tuple[tuple[int, ...], ...] = ()  # req_to_blocks of groups 1, 2, ... (one group: empty)
    group_num_cached: tuple[int, ...] = ()  # num_cached_block of groups 1, 2, ...

    def tables(self) -> tuple[tuple[int, ...], ...]:
        """Every group's table, group 0 first."""
        return (self.table, *self.group_tables)

    def cached_counts(self) -> tuple[int, ...]:
        """Every group's ``num_cached_block``, group 0 first."""
        return (self.num_cached, *self.group_num_cached)


@dataclass(frozen=True)
class ChunkRecord:
    """One CPU offload chunk (``ChunkStatus``)."""

    key: NodeId  # the block content it holds
    chunk_id: int  # physical CPU slot
    ref_cnt: int  # -1: write pending; 0: ready and evictable; > 0: loading (pinned by that many loads)


@dataclass(frozen=True)
class OffloadRecord:
    """The CPU offload manager, its policy and the jobs the connector has in flight."""

    capacity: int  # num_chunks
    chunks: tuple[ChunkRecord, ...]  # sorted by key
    recency: tuple[NodeId, ...]  # LRU: every chunk, least recently used first; ARC: T1, oldest first
    frequent: tuple[NodeId, ...]  # ARC: T2, oldest first; LRU: empty
    ghosts: tuple[tuple[NodeId, ...], tuple[NodeId, ...]]  # ARC: B1, B2, oldest first; LRU: empty
    target_recent: float  # ARC: target_t1_size; LRU: 0.0
    free_list: tuple[int, ...]  # freed chunk ids, reused from the end
    num_allocated: int  # chunk ids handed out so far (fresh ids are 0 .. num_allocated - 1)
    num_evictable: int  # the manager's counter of ready, unpinned chunks
    num_write_pending: int  # the manager's counter of write-pending chunks
    pending_stores: tuple[tuple[NodeId, ...], ...]  # queued store jobs, oldest first
    pending_loads: tuple[tuple[NodeId, ...], ...]  # queued load jobs, oldest first


@dataclass(frozen=True)
class VllmSnapshot:
    block_size: int
    blocks: tuple[BlockRecord, ...]  # every block, by id (block 0 first)
    free_queue: tuple[int, ...]  # the free block queue walked from its head (evicted / reused first)
    free_queue_backward: tuple[int, ...]  # the same queue walked from its tail
    num_free: int  # the queue's own counter (num_free_blocks)
    cache_map: tuple[tuple[NodeId, tuple[int, ...]], ...]  # content -> blocks holding it, sorted by content
    requests: tuple[RequestRecord, ...]  # running requests by rid
    events_replayed: tuple[tuple[NodeId, int], ...]  # every BlockStored/Removed/Cleared so far, replayed
    hash_collisions: tuple[str, ...]  # two different contents seen with one vLLM hash (must stay empty)
    offload: OffloadRecord | None  # None: no offload manager

    def cache_map_dict(self) -> dict[NodeId, tuple[int, ...]]:
        return dict(self.cache_map)
