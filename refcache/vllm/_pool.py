"""The reference model of vLLM's GPU block pool, shared by one or more full-attention KV cache groups.

Theory of operation. Blocks ``0 .. num_blocks-1``; block 0 is the null block, taken out at start and never
freed, hashed or queued. Every other block is in one state of ``BlockState``, a function of its reference
count and whether it holds a hash (vLLM keeps no state field; the model derives it the same way):

* the **free queue** holds exactly the unreferenced blocks, head first. ``get_new_blocks`` pops from the
  head and strips a popped block's hash there and then (eviction is lazy: a freed hashed block stays
  cached, and counts as free, until it is reused);
* ``free`` walks a table backwards: blocks that reach 0 without a hash go to the **head** (reused first,
  in that order), hashed ones to the **tail** (the chain's tail block is evicted first);
* a prefix hit ``touch``\\ es blocks: one with count 0 leaves the queue wherever it is;
* only full blocks of computed tokens are hashed, at allocation time (``cache_blocks``), and the cache map
  does not merge duplicates: one content may be held by several blocks, and a hit takes the block that
  was cached first;
* with several KV cache groups each group hashes its own blocks under its own key (the group id is part
  of vLLM's cache key; here of the ``NodeId`` namespace), and a block is a hit only if every group holds
  that content (``hit_groups``).

Every change of the cache map is reported as a ``KvEvent`` (one ``STORED`` per ``cache_blocks`` call,
one ``REMOVED`` per hash dropped, ``CLEARED`` on reset), in vLLM's order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from refcache.family import NodeId
from refcache.vllm.ops import EventKind, KvEvent
from refcache.vllm.snapshot import BlockRecord

__all__ = ["BlockPool", "BlockState"]


class BlockState(enum.Enum):
    """A usable block's state (``specs/vllm.md``)."""

    FREE_CLEAN = "free-clean"  # count 0, no hash: queued, reused first
    FREE_CACHED = "free-cached"  # count 0, hashed: queued, still a prefix hit until popped
    IN_USE = "in-use"  # count > 0, no hash (partial, uncomputed, or dropped by evict_blocks)
    IN_USE_CACHED = "in-use-cached"  # count > 0, hashed


@dataclass
class _Block:
    id: int  # block_id
    ref_cnt: int = 0  # only touch, get_new_blocks and free change it
    key: NodeId | None = None  # the content its hash stands for; only cache_full and _drop_hash set it

    @property
    def state(self) -> BlockState:
        if self.ref_cnt == 0:
            return BlockState.FREE_CLEAN if self.key is None else BlockState.FREE_CACHED
        return BlockState.IN_USE if self.key is None else BlockState.IN_USE_CACHED


class BlockPool:
    """The block pool: blocks, free queue, cache map and the event queue."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [_Block(i) for i in range(num_blocks)]  # by id; block 0 is the null block
        self.queue: list[int] = list(range(1, num_blocks))  # the free queue, head first
        self.cache: dict[NodeId, list[int]] = {}  # content -> blocks holding it, in caching order
        self.events: list[KvEvent] = []  # emitted, not yet taken

    @property
    def num_free(self) -> int:
        return len(self.queue)

    def hit_groups(self, keys: list[list[NodeId]], max_blocks: int) -> list[list[int]]:
        """The longest run of cached contents from the first, at most ``max_blocks``, in every group at once
        (``get_cached_block`` over the group ids): the run stops at the first content some group does not
        hold; each group's hit takes the block that was cached first. ``keys[g]`` are group ``g``'s
        contents."""
        out: list[list[int]] = [[] for _ in keys]
        for i in range(min(max_blocks, min(len(k) for k in keys))):
            held = [self.cache.get(k[i]) for k in keys]
            if not all(held):
                break
            for group, ids in zip(out, held, strict=True):
                assert ids
                group.append(ids[0])
        return out

    def touch(self, ids: list[int]) -> None:
        for block_id in ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self.queue.remove(block_id)
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the queue's head, dropping each one's hash; the caller checked there are
        enough."""
        taken, self.queue = self.queue[:n], self.queue[n:]
        for block_id in taken:
            self._drop_hash(self.blocks[block_id])
            self.blocks[block_id].ref_cnt += 1
        return taken

    def _drop_hash(self, block: _Block) -> None:
        if block.key is None:
            return
        ids = self.cache.get(block.key, [])
        if block.id in ids:
            ids.remove(block.id)
            if not ids:
                del self.cache[block.key]
            self.events.append(KvEvent(EventKind.REMOVED, (block.key,)))
        block.key = None

    def cache_full(self, table: list[int], keys: list[NodeId], num_cached: int, num_full: int) -> None:
        """Hash table entries ``num_cached .. num_full-1`` with their contents; one STORED event."""
        if num_cached >= num_full:
            return
        for i in range(num_cached, num_full):
            block, key = self.blocks[table[i]], keys[i]
            if block.key == key or block.id in self.cache.get(key, []):
                continue
            block.key = key
            self.cache.setdefault(key, []).append(block.id)
        parent = keys[num_cached - 1] if num_cached else None
        self.events.append(KvEvent(EventKind.STORED, tuple(keys[num_cached:num_full]), parent))

    def free(self, table: list[int]) -> None:
        first: list[int] = []
        last: list[int] = []
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (first if block.key is None else last).append(block_id)
        self.queue = first + self.queue + last

    def evict_blocks(self, ids: tuple[int, ...]) -> None:
        for block_id in set(ids):  # vLLM takes a set: its iteration order decides the events' order
            self._drop_hash(self.blocks[block_id])

    def reset(self) -> bool:
        if self.num_free != len(self.blocks) - 1:
            return False
        self.cache.clear()
        for block in self.blocks:
            block.key = None
        self.events.append(KvEvent(EventKind.CLEARED, ()))
        return True

    def records(self) -> tuple[BlockRecord, ...]:
        return tuple(BlockRecord(b.id, b.ref_cnt, b.key, 0) for b in self.blocks)
