"""The vLLM invariant family: named functions over a ``VllmSnapshot``.

HiCache's invariants (``refcache.hicache.invariants``) are stated over a radix tree; vLLM's prefix cache is a
pool of blocks with reference counts, a free queue and a map from content to blocks, so the family is
restated here (``specs/invariants.md``, section "vLLM": which HiCache invariant each one restates, which
do not apply and why, and the ones only vLLM needs). Each function returns the ``Violation``\\ s it finds.

``INVARIANTS`` are state invariants (one snapshot); ``STEP_INVARIANTS`` relate a snapshot to the one
before it and the operation between them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Final

from refcache.family import NodeId, Violation
from refcache.vllm.ops import EvictBlocks, ResetPrefixCache, Store, VllmOp, group_namespace
from refcache.vllm.snapshot import OffloadRecord, VllmSnapshot

__all__ = ["INVARIANTS", "NOT_APPLICABLE", "STEP_INVARIANTS", "check_all", "check_step"]

Invariant = Callable[[VllmSnapshot], list[Violation]]
StepInvariant = Callable[[VllmSnapshot, VllmSnapshot, VllmOp], list[Violation]]


def _v(inv: str, message: str, node: NodeId | None = None) -> Violation:
    return Violation(inv, None, node, message)


def key_of(namespace: str, tokens: tuple[int, ...], block: int, block_size: int) -> NodeId:
    """The content of block ``block`` (0-based) of a request: its namespace and tokens up to its end."""
    return NodeId(namespace, tokens[: (block + 1) * block_size])


def inv_hash_chain(snap: VllmSnapshot) -> list[Violation]:
    """HASH-CHAIN: a request's i-th hash stands for its tokens up to block i's end in its namespace (the
    chain from the parent's hash with ``extra_keys``), one per full block; the first ``num_cached`` entries
    of each group's table hold those hashes under that group's key, or none where ``evict_blocks`` dropped
    one."""
    out: list[Violation] = []
    bs = snap.block_size
    blocks = {b.id: b for b in snap.blocks}
    for r in snap.requests:
        expected = tuple(key_of(r.namespace, r.tokens, i, bs) for i in range(len(r.tokens) // bs))
        if r.keys != expected:
            out.append(_v("HASH-CHAIN", f"request {r.rid}: block hashes {r.keys} != the chain {expected}"))
            continue
        for group, (table, num_cached) in enumerate(zip(r.tables(), r.cached_counts(), strict=False)):
            if num_cached > min(len(table), len(r.keys)):
                out.append(
                    _v(
                        "HASH-CHAIN",
                        f"request {r.rid} group {group}: num_cached {num_cached} > full blocks held",
                    )
                )
                continue
            namespace = group_namespace(r.namespace, group)
            for i in range(num_cached):
                block = blocks.get(table[i])
                key = key_of(namespace, r.tokens, i, bs)
                if block is not None and block.key not in (key, None):
                    out.append(
                        _v(
                            "HASH-CHAIN",
                            f"request {r.rid} group {group}: table[{i}] = block {block.id} holds {block.key}",
                            key,
                        )
                    )
    return out


def inv_locks(snap: VllmSnapshot) -> list[Violation]:
    """LOCKS: a block's ``ref_cnt`` is >= 0 and equals the number of table entries holding it (the null
    block's count is not kept)."""
    held = Counter(b for r in snap.requests for table in r.tables() for b in table)
    out: list[Violation] = []
    for b in snap.blocks:
        if b.id == 0:
            continue
        if b.ref_cnt < 0 or b.ref_cnt != held[b.id]:
            out.append(_v("LOCKS", f"block {b.id}: ref_cnt {b.ref_cnt}, held by {held[b.id]} table entries"))
    return out


def inv_idle_drained(snap: VllmSnapshot) -> list[Violation]:
    """IDLE-DRAINED: with no request running every usable block is free; with no offload job queued no
    chunk is write-pending or pinned."""
    out: list[Violation] = []
    if not snap.requests and snap.num_free != len(snap.blocks) - 1:
        out.append(
            _v(
                "IDLE-DRAINED",
                f"no request runs but {snap.num_free} of {len(snap.blocks) - 1} blocks are free",
            )
        )
    off = snap.offload
    if off is not None and not off.pending_stores and not off.pending_loads:
        busy = [c.key for c in off.chunks if c.ref_cnt != 0]
        if busy or off.num_write_pending:
            out.append(_v("IDLE-DRAINED", f"no offload job queued but chunks {busy} are pending or pinned"))
    return out


def inv_device_conservation(snap: VllmSnapshot) -> list[Violation]:
    """DEVICE-CONSERVATION: every usable block is either queued with ``ref_cnt`` 0 or referenced, never
    both and never neither; the null block is never queued."""
    queued = set(snap.free_queue)
    out: list[Violation] = []
    for b in snap.blocks:
        if b.id == 0:
            if 0 in queued:
                out.append(_v("DEVICE-CONSERVATION", "the null block is in the free queue"))
        elif (b.id in queued) != (b.ref_cnt == 0) or b.ref_cnt < 0:
            where = "queued" if b.id in queued else "not queued"
            out.append(_v("DEVICE-CONSERVATION", f"block {b.id}: {where} with ref_cnt {b.ref_cnt}"))
    return out


def inv_size_accounting(snap: VllmSnapshot) -> list[Violation]:
    """SIZE-ACCOUNTING: the queue's counter equals its length and the number of unreferenced usable
    blocks."""
    unreferenced = sum(1 for b in snap.blocks if b.id != 0 and b.ref_cnt == 0)
    if snap.num_free == len(snap.free_queue) == unreferenced:
        return []
    return [
        _v(
            "SIZE-ACCOUNTING",
            f"num_free_blocks {snap.num_free}, queue length {len(snap.free_queue)}, unreferenced {unreferenced}",
        )
    ]


def inv_free_queue(snap: VllmSnapshot) -> list[Violation]:
    """FREE-QUEUE: the free queue holds exactly the unreferenced usable blocks, each once, and its links
    agree both ways (the backward walk is the forward walk reversed)."""
    out: list[Violation] = []
    twice = sorted(b for b, n in Counter(snap.free_queue).items() if n > 1)
    if twice:
        out.append(_v("FREE-QUEUE", f"blocks {twice} are queued more than once"))
    unreferenced = {b.id for b in snap.blocks if b.id != 0 and b.ref_cnt == 0}
    if set(snap.free_queue) != unreferenced:
        out.append(
            _v("FREE-QUEUE", f"queue {sorted(set(snap.free_queue))} != unreferenced {sorted(unreferenced)}")
        )
    if snap.free_queue_backward != tuple(reversed(snap.free_queue)):
        out.append(_v("FREE-QUEUE", f"backward walk {snap.free_queue_backward} != forward {snap.free_queue}"))
    return out


def inv_block_shape(snap: VllmSnapshot) -> list[Violation]:
    """BLOCK-SHAPE: only full blocks are hashed (a key's path is a positive multiple of the block size);
    the cache map lists a block under a key exactly when the block holds that key, each block once; the
    null block holds no hash."""
    out: list[Violation] = []
    bs = snap.block_size
    listed: Counter[int] = Counter()
    for key, ids in snap.cache_map:
        if not ids:
            out.append(_v("BLOCK-SHAPE", "an empty entry in the cache map", key))
        for block_id in ids:
            listed[block_id] += 1
            if block_id >= len(snap.blocks) or snap.blocks[block_id].key != key:
                out.append(
                    _v("BLOCK-SHAPE", f"cache map lists block {block_id}, which does not hold it", key)
                )
    for b in snap.blocks:
        if b.key is None:
            continue
        if b.id == 0:
            out.append(_v("BLOCK-SHAPE", "the null block holds a hash", b.key))
        if not b.key.path or len(b.key.path) % bs:
            out.append(_v("BLOCK-SHAPE", f"block {b.id} is hashed over {len(b.key.path)} tokens", b.key))
        if listed[b.id] != 1:
            out.append(
                _v("BLOCK-SHAPE", f"block {b.id} is listed {listed[b.id]} times in the cache map", b.key)
            )
    return out


def inv_no_dup_in_table(snap: VllmSnapshot) -> list[Violation]:
    """NO-DUP-IN-TABLE: no block appears twice in one request's table of one group, and no table holds the
    null block (full-attention groups skip no block)."""
    out: list[Violation] = []
    for r in snap.requests:
        for group, table in enumerate(r.tables()):
            twice = sorted(b for b, n in Counter(table).items() if n > 1)
            if twice or 0 in table:
                out.append(
                    _v(
                        "NO-DUP-IN-TABLE",
                        f"request {r.rid} group {group}: table {table} repeats {twice} or holds block 0",
                    )
                )
    return out


def _group_of(namespace: str) -> int:
    last = namespace.rsplit(",", 1)[-1]
    return int(last.removeprefix("group=")) if last.startswith("group=") else 0


def inv_group_disjoint(snap: VllmSnapshot) -> list[Violation]:
    """GROUP-DISJOINT: a block in use belongs to one KV cache group: no block is in two groups' tables (of
    one request or of two), and a hashed block in group g's table holds a group-g key (the #33775 class:
    one group's allocation taking another group's hit block)."""
    out: list[Violation] = []
    owner: dict[int, int] = {}
    blocks = {b.id: b for b in snap.blocks}
    for r in snap.requests:
        for group, table in enumerate(r.tables()):
            for block_id in table:
                if owner.setdefault(block_id, group) != group:
                    out.append(
                        _v(
                            "GROUP-DISJOINT",
                            f"block {block_id} is in group {owner[block_id]}'s and {group}'s tables",
                        )
                    )
                key = blocks[block_id].key if block_id in blocks else None
                if key is not None and _group_of(key.namespace) != group:
                    out.append(_v("GROUP-DISJOINT", f"block {block_id} in group {group}'s table holds", key))
    return out


def inv_groups_aligned(snap: VllmSnapshot) -> list[Violation]:
    """GROUPS-ALIGNED: the groups share one full-attention spec, so each request holds as many blocks and as
    many cached blocks in every group."""
    return [
        _v("GROUPS-ALIGNED", f"request {r.rid}: table lengths {lengths}, cached counts {r.cached_counts()}")
        for r in snap.requests
        if len(set(lengths := tuple(len(t) for t in r.tables()))) > 1 or len(set(r.cached_counts())) > 1
    ]


def inv_events_replay(snap: VllmSnapshot) -> list[Violation]:
    """EVENTS-REPLAY: replaying every KV event so far (a multiset per content: duplicates are not merged)
    gives the cache map's block count per content."""
    replayed = dict(snap.events_replayed)
    actual = {key: len(ids) for key, ids in snap.cache_map}
    if replayed == actual:
        return []
    diff = sorted(set(replayed) ^ set(actual) | {k for k in actual if replayed.get(k) != actual[k]})
    return [
        _v("EVENTS-REPLAY", f"events give {replayed.get(k, 0)} blocks, the cache map {actual.get(k, 0)}", k)
        for k in diff[:5]
    ]


def inv_hit_bound(snap: VllmSnapshot) -> list[Violation]:
    """HIT-BOUND: a request's prefix hit is whole blocks and at most ⌊(n−1)/block_size⌋ blocks of its
    n-token prompt (the last prompt token is always computed)."""
    bs = snap.block_size
    return [
        _v("HIT-BOUND", f"request {r.rid}: hit {r.hit_tokens} tokens of a {r.prompt_len}-token prompt")
        for r in snap.requests
        if r.hit_tokens % bs or r.hit_tokens > (r.prompt_len - 1) // bs * bs or r.hit_tokens < 0
    ]


def inv_namespace(snap: VllmSnapshot) -> list[Violation]:
    """NAMESPACE: different contents (tokens, LoRA, cache_salt) never share a hash."""
    return [_v("NAMESPACE", collision) for collision in snap.hash_collisions]


def _offload(snap: VllmSnapshot) -> OffloadRecord | None:
    return snap.offload


def inv_in_flight(snap: VllmSnapshot) -> list[Violation]:
    """IN-FLIGHT: a chunk is write-pending exactly while a queued store job holds it; a chunk is pinned by
    exactly the queued load jobs that hold it, and only a ready chunk is loaded."""
    off = _offload(snap)
    if off is None:
        return []
    out: list[Violation] = []
    storing = {k for job in off.pending_stores for k in job}
    loading = Counter(k for job in off.pending_loads for k in job)
    for c in off.chunks:
        if c.ref_cnt < 0 and c.key not in storing:
            out.append(_v("IN-FLIGHT", "write-pending without a queued store", c.key))
        if c.ref_cnt > 0 and c.ref_cnt != loading[c.key]:
            out.append(_v("IN-FLIGHT", f"pinned {c.ref_cnt} times by {loading[c.key]} queued loads", c.key))
        if c.ref_cnt < -1:
            out.append(_v("IN-FLIGHT", f"ref_cnt {c.ref_cnt}", c.key))
    present = {c.key: c.ref_cnt for c in off.chunks}
    for key, n in loading.items():
        if present.get(key, 0) < n:
            out.append(_v("IN-FLIGHT", f"a queued load of a chunk with ref_cnt {present.get(key)}", key))
    return out


def inv_host_conservation(snap: VllmSnapshot) -> list[Violation]:
    """HOST-CONSERVATION: chunk ids are unique, below ``num_allocated`` <= capacity, and disjoint from the
    free list; allocated = chunks + free list; the counters equal the ready-unpinned and write-pending
    chunks; the policy orders every chunk exactly once."""
    off = _offload(snap)
    if off is None:
        return []
    out: list[Violation] = []
    ids = [c.chunk_id for c in off.chunks]
    if (
        len(set(ids)) != len(ids)
        or set(ids) & set(off.free_list)
        or len(set(off.free_list)) != len(off.free_list)
    ):
        out.append(
            _v(
                "HOST-CONSERVATION",
                f"chunk ids {sorted(ids)} and free list {off.free_list} overlap or repeat",
            )
        )
    if (
        any(not 0 <= i < off.num_allocated for i in [*ids, *off.free_list])
        or off.num_allocated > off.capacity
    ):
        out.append(
            _v("HOST-CONSERVATION", f"chunk ids beyond num_allocated {off.num_allocated} / {off.capacity}")
        )
    if off.num_allocated != len(ids) + len(off.free_list):
        out.append(
            _v(
                "HOST-CONSERVATION",
                f"allocated {off.num_allocated} != {len(ids)} chunks + {len(off.free_list)} free",
            )
        )
    ready = sum(1 for c in off.chunks if c.ref_cnt == 0)
    pending = sum(1 for c in off.chunks if c.ref_cnt < 0)
    if (off.num_evictable, off.num_write_pending) != (ready, pending):
        out.append(
            _v(
                "HOST-CONSERVATION",
                f"counters evictable {off.num_evictable} / write_pending {off.num_write_pending}, "
                f"chunks {ready} ready / {pending} pending",
            )
        )
    ordered = [*off.recency, *off.frequent]
    if sorted(ordered) != sorted(c.key for c in off.chunks):
        out.append(_v("HOST-CONSERVATION", "the policy does not order every chunk exactly once"))
    return out


def inv_offload_policy(snap: VllmSnapshot) -> list[Violation]:
    """OFFLOAD-POLICY: the offload policy's lists within their bounds — the ghost lists (ARC's B1, B2;
    empty under LRU) hold no resident chunk, share no key and repeat none, each holds at most ``capacity``
    keys, and ARC's target size for T1 lies in ``[0, capacity]``. (That T1 and T2, or LRU's order,
    partition the resident chunks is HOST-CONSERVATION's last clause.)"""
    off = _offload(snap)
    if off is None:
        return []
    out: list[Violation] = []
    resident = {c.key for c in off.chunks}
    b1, b2 = off.ghosts
    for name, ghost in (("B1", b1), ("B2", b2)):
        out += [
            _v("OFFLOAD-POLICY", f"ghost list {name} holds a resident chunk", key)
            for key in sorted(set(ghost) & resident)
        ]
        if len(set(ghost)) != len(ghost):
            out.append(_v("OFFLOAD-POLICY", f"ghost list {name} repeats a key"))
        if len(ghost) > off.capacity:
            out.append(
                _v("OFFLOAD-POLICY", f"ghost list {name} holds {len(ghost)} keys, capacity {off.capacity}")
            )
    out += [_v("OFFLOAD-POLICY", "a key in both ghost lists", key) for key in sorted(set(b1) & set(b2))]
    if not 0 <= off.target_recent <= off.capacity:
        out.append(_v("OFFLOAD-POLICY", f"target size {off.target_recent} outside [0, {off.capacity}]"))
    return out


def step_store_keeps_offer(before: VllmSnapshot, after: VllmSnapshot, op: VllmOp) -> list[Violation]:
    """STORE-KEEPS-OFFER: a store never evicts a chunk it offers: every chunk of the request's computed full
    blocks that was resident before ``Store`` is resident after it (vLLM protects the offer from its own
    eviction; a refused store changes no chunk)."""
    if not isinstance(op, Store) or before.offload is None or after.offload is None:
        return []
    request = next((r for r in before.requests if r.rid == op.rid), None)
    if request is None:
        return []
    offered = request.keys[: request.num_computed // before.block_size]
    resident = {c.key for c in after.offload.chunks}
    held = {c.key for c in before.offload.chunks}
    return [
        _v("STORE-KEEPS-OFFER", f"store of request {op.rid} evicted a chunk it offers", key)
        for key in offered
        if key in held and key not in resident
    ]


def step_removal(before: VllmSnapshot, after: VllmSnapshot, op: VllmOp) -> list[Violation]:
    """STEP-REMOVAL: a running request's table only grows (block tables are append-only); a block that
    stays referenced keeps its hash unless the operation is ``EvictBlocks`` (or a reset, which only runs
    with nothing referenced)."""
    out: list[Violation] = []
    tables = {r.rid: r.tables() for r in before.requests}
    for r in after.requests:
        for old, new in zip(tables.get(r.rid, ()), r.tables(), strict=False):
            if new[: len(old)] != old:
                out.append(_v("STEP-REMOVAL", f"request {r.rid}: table {old} became {new}"))
    if isinstance(op, EvictBlocks | ResetPrefixCache):
        return out
    for b0, b1 in zip(before.blocks, after.blocks, strict=False):
        if b0.ref_cnt > 0 and b1.ref_cnt > 0 and b0.key is not None and b1.key != b0.key:
            out.append(_v("STEP-REMOVAL", f"block {b0.id} in use lost its hash", b0.key))
    return out


INVARIANTS: Final[tuple[Invariant, ...]] = (
    inv_hash_chain,
    inv_locks,
    inv_idle_drained,
    inv_device_conservation,
    inv_size_accounting,
    inv_free_queue,
    inv_block_shape,
    inv_no_dup_in_table,
    inv_group_disjoint,
    inv_groups_aligned,
    inv_events_replay,
    inv_hit_bound,
    inv_namespace,
    inv_in_flight,
    inv_host_conservation,
    inv_offload_policy,
)
STEP_INVARIANTS: Final[tuple[StepInvariant, ...]] = (step_removal, step_store_keeps_offer)

NOT_APPLICABLE: Final[dict[str, str]] = {
    "EVICTED-SUFFIX": "no tree: eviction pops the free queue's head, and duplicates and evict_blocks leave "
    "a chain's later blocks cached after an earlier one is gone (a lookup stops at the gap)",
    "EVICTED-BACKUPED": "a GPU block is evicted without any CPU copy; offload is a separate cache",
    "BACKUP-CONTIGUITY": "the offload manager stores chunks one by one with no prefix contract",
    "RANKS-EQUAL": "one scheduler holds the block pool; there are no per-rank copies to compare",
}
"""HiCache invariants with no vLLM counterpart, and why (``specs/invariants.md``)."""


def check_all(snap: VllmSnapshot) -> list[Violation]:
    """Every state invariant."""
    return [v for inv in INVARIANTS for v in inv(snap)]


def check_step(before: VllmSnapshot, after: VllmSnapshot, op: VllmOp) -> list[Violation]:
    """Every step invariant between two consecutive snapshots."""
    return [v for inv in STEP_INVARIANTS for v in inv(before, after, op)]
