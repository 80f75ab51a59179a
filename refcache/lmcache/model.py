"""``LMCacheModel``: the executable reference model of LMCache's cache engine (``LMCacheEngine`` over
``StorageManager``, ``LocalCPUBackend``, ``LocalDiskBackend`` and ``RemoteBackend``), playing the serving
engine's connector over the operation alphabet of ``refcache.lmcache.ops``.

Theory of operation. A request's tokens are cut into chunks of ``chunk_size`` tokens; chunk i is named by
the tokens up to its end (``ops.chunk_keys``: what LMCache's chained prefix hash stands for). Every chunk
stored is first a CPU memory object allocated from one address space (``_parts.Allocator``); ``Store``
allocates a fresh object per chunk, evicting from the CPU tier one policy candidate at a time, and hands
them to ``batched_put``, which writes through every tier in order: CPU (the object itself), local disk (an
admitted write that holds the object until a ``Step(Queue.DISK)`` publishes the file), remote (the bytes are
serialized at once; the put completes at a ``Step(Queue.REMOTE)``). A lookup walks the tiers in the same
order, each answering a prefix of the keys the tiers before it left; a retrieve reads that prefix and
promotes what it read below CPU into CPU. Objects carry reference and pin counts: an object is evictable
when nothing but its tier holds it and nothing pins it; it is freed when both counts reach 0.

Pure Python and deterministic. Where LMCache's behaviour is a choice the model follows it; where LMCache
would crash, hang or lose track of memory the model states what it promises instead. Both are the decision
list of ``specs/lmcache-model.md`` (L-01 ...), cited where they apply.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

from refcache.config import HiCacheConfig
from refcache.errors import UsageError
from refcache.family import NodeId
from refcache.lmcache._parts import Allocator, MemoryObj, Policy
from refcache.lmcache.config import LMCacheConfig
from refcache.lmcache.ops import (
    Clear,
    ClearResult,
    Done,
    FaultKind,
    LMCacheObservation,
    LMCacheOp,
    Lookup,
    LookupResult,
    LookupUnpin,
    PollPrefetch,
    Prefetch,
    PrefetchResult,
    Queue,
    Retrieve,
    RetrieveResult,
    Step,
    StepResult,
    StorageFault,
    Store,
    StoreResult,
    Tier,
    check_op,
    chunk_keys,
)
from refcache.lmcache.snapshot import (
    CpuEntry,
    CpuRecord,
    DiskEntry,
    DiskJob,
    DiskRecord,
    LMCacheSnapshot,
    ObjectRecord,
    PinRecord,
    PrefetchRecord,
    RemoteJob,
    RemoteRecord,
)

__all__ = ["LMCacheModel"]

CPU, DISK, REMOTE = "cpu", "disk", "remote"  # tier names in lookup_pins, in LMCache's backend order

Chunk = tuple[NodeId, int, int]  # (key, start, end)


@dataclass
class _DiskMeta:
    """``DiskCacheMetadata``: one published file."""

    size: int
    pin_count: int = 0
    damaged: bool = False


@dataclass
class _Job:
    """A queued disk or remote job."""

    kind: str  # "put" or "read"
    keys: tuple[NodeId, ...]
    objs: list[MemoryObj] = field(default_factory=list)  # disk put: the copy; reads: the buffers
    lookup_id: int | None = None


@dataclass
class _Prefetch:
    """One ``async_lookup_and_prefetch`` and its loading tasks (one per tier with a hit)."""

    chunk_ends: list[int]  # cum_chunk_lengths without the leading 0
    expected: list[int] = field(default_factory=list)  # tier_expected_chunks
    results: list[list[tuple[NodeId, MemoryObj]] | None] = field(default_factory=list)  # None: still loading
    done: bool = False
    hit: int = 0
    pinned: list[NodeId] = field(default_factory=list)  # disk entries its pinned lookup pinned (L-12)
    owned: Counter[int] = field(default_factory=Counter)  # pins it holds on CPU objects, by address (L-13)


class LMCacheModel:
    """The reference model (module docstring). ``apply`` raises ``UsageError`` for an operation the alphabet's
    preconditions refuse, before changing anything."""

    def __init__(self, config: HiCacheConfig) -> None:
        self.config = LMCacheConfig.of(config)
        c = self.config
        self.alloc = Allocator(c.cpu_bytes)
        # CPU tier (LocalCPUBackend): hot_cache key -> object, in the policy's mapping order.
        self.hot: dict[NodeId, MemoryObj] = {}
        self.cpu_policy = Policy(c.cache_policy)
        self.cpu_touched: list[NodeId] = []  # keys_in_request
        # Disk tier (LocalDiskBackend).
        self.disk: dict[NodeId, _DiskMeta] = {}
        self.disk_policy = Policy(c.cache_policy)
        self.disk_touched: list[NodeId] = []
        self.reserved = 0  # current_cache_size
        self.usage = 0
        self.disk_puts: list[NodeId] = []  # the disk worker's put_tasks
        self.disk_jobs: list[_Job] = []  # the executor's queue, in submission order
        self.disk_fail_write = False
        self.disk_fail_read = False
        # Remote tier (RemoteBackend).
        self.remote: dict[NodeId, bool] = {}  # stored key -> damaged
        self.remote_puts: list[NodeId] = []  # put_tasks
        self.remote_jobs: deque[_Job] = deque()
        self.remote_fail_write = False
        self.remote_fail_read = False
        # The engine.
        self.lookup_pins: dict[int, dict[str, list[NodeId]]] = {}
        self.prefetches: dict[int, _Prefetch] = {}
        self.warnings: list[str] = []

    # --- the System protocol -------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        pass

    def apply(self, op: LMCacheOp) -> LMCacheObservation:
        check_op(
            op,
            self.config,
            frozenset(self.lookup_pins),
            frozenset(self.prefetches),
            {Queue.DISK: len(self.disk_jobs), Queue.REMOTE: len(self.remote_jobs)},
            frozenset(i for i, p in self.prefetches.items() if p.done and p.hit),
        )
        match op:
            case Store(tokens, skip):
                return StoreResult(self._store(tokens, skip))
            case Lookup(tokens, lookup_id, pin):
                return LookupResult(self._lookup(tokens, lookup_id, pin))
            case Retrieve(tokens, skip, lookup_id):
                if self.config.async_loading:
                    assert lookup_id is not None
                    return RetrieveResult(self._retrieve_async(tokens, skip, lookup_id))
                return RetrieveResult(self._retrieve(tokens, skip, lookup_id))
            case LookupUnpin(lookup_id):
                self._lookup_unpin(lookup_id)
                return Done()
            case Prefetch(tokens, lookup_id, pin):
                self._prefetch(tokens, lookup_id, pin)
                return Done()
            case PollPrefetch(lookup_id):
                p = self.prefetches[lookup_id]
                return PrefetchResult(p.done, p.hit)
            case Clear(tokens):
                return ClearResult(self._clear(tokens))
            case Step(queue, count):
                return StepResult(self._step(queue, count))
            case StorageFault(tier, kind, index):
                self._fault(tier, kind, index)
                return Done()
        raise UsageError(f"not an LMCache operation: {op!r}")  # pragma: no cover - the match is exhaustive

    # --- memory objects ------------------------------------------------------------------------------------

    def _ref_up(self, obj: MemoryObj) -> MemoryObj:
        obj.ref_count += 1
        return obj

    def _ref_down(self, obj: MemoryObj) -> None:
        """``ref_count_down``: freed once neither a reference nor a pin holds it."""
        obj.ref_count -= 1
        if obj.ref_count < 0:
            self.warnings.append(f"double free: object at {obj.address} ({obj.content})")
            obj.ref_count = 0
        if obj.ref_count == 0 and obj.pin_count == 0 and obj.address in self.alloc.objects:
            self.alloc.free(obj)

    def _unpin(self, obj: MemoryObj) -> None:
        """``unpin``: freed once neither a reference nor a pin holds it."""
        obj.pin_count -= 1
        if obj.pin_count <= 0 and obj.ref_count <= 0 and obj.address in self.alloc.objects:
            self.alloc.free(obj)
        if obj.pin_count < 0:
            self.warnings.append(f"double unpin: object at {obj.address} ({obj.content})")
            obj.pin_count = 0

    def _release(self, obj: MemoryObj, prefetch: _Prefetch) -> None:
        """Drop ``prefetch``'s hold on ``obj``: the pin it took, if it took one, and its reference (L-13:
        LMCache 0.5.6 unpins whatever pin the object has when it uses it, and drops only the reference of a
        loaded chunk it does not use)."""
        if prefetch.owned[obj.address] > 0:
            prefetch.owned[obj.address] -= 1
            self._unpin(obj)
        self._ref_down(obj)

    def _allocate(self, key: NodeId, tokens: int) -> MemoryObj | None:
        """``LocalCPUBackend.allocate``: a fresh object for ``tokens`` tokens of ``key``, evicting CPU entries
        one policy candidate at a time until it fits; None when nothing more can be evicted. LMCache's
        busy-wait (``busy_loop=True``) would wait for ever there; the model answers None instead (L-05)."""
        nbytes = tokens * self.config.bytes_per_token
        while True:
            obj = self.alloc.allocate(nbytes, tokens, key)
            if obj is not None:
                return obj
            victim = self.cpu_policy.candidate(self.hot, lambda k: self.hot[k].can_evict)
            if victim is None:
                return None
            self._cpu_remove(victim, force=False)

    # --- tiers ---------------------------------------------------------------------------------------------

    def _cpu_put(self, key: NodeId, obj: MemoryObj) -> None:
        """``LocalCPUBackend.submit_put_task``: a key already cached keeps its object (L-02)."""
        if key in self.hot:
            return
        self.hot[key] = self._ref_up(obj)
        self.cpu_policy.on_put(key)

    def _cpu_remove(self, key: NodeId, *, force: bool) -> bool:
        """``LocalCPUBackend.remove``: a forced remove also releases the lookup pins the object holds."""
        obj = self.hot.pop(key, None)
        if obj is None:
            return False
        if force:
            while obj.pin_count > 0:
                self._unpin(obj)
            self._forget_pins(CPU, key)
            for prefetch in self.prefetches.values():
                prefetch.owned.pop(obj.address, None)  # its pins went with the others
        self._ref_down(obj)
        if force:
            self.cpu_policy.on_force_evict(key)
        return True

    def _forget_pins(self, tier: str, key: NodeId) -> None:
        """L-14: a forced remove takes the key out of every lookup's pins in that tier, so a later
        ``lookup_unpin`` cannot unpin the object a new store puts under the same key (LMCache 0.5.6 keeps the
        key in ``lookup_pins``)."""
        for lookup_id in list(self.lookup_pins):
            mapping = self.lookup_pins[lookup_id]
            if key in mapping.get(tier, []):
                mapping[tier] = [k for k in mapping[tier] if k != key]
                if not mapping[tier]:
                    del mapping[tier]
                if not mapping:
                    del self.lookup_pins[lookup_id]

    def _disk_put(self, key: NodeId, obj: MemoryObj) -> None:
        """``LocalDiskBackend.submit_put_task``: admit a write (reserve its bytes, evicting published files in
        policy order) and queue it; a key on disk or being written is not written again."""
        if key in self.disk:
            self.disk_policy.on_hit(key, self.disk)
            return
        size = obj.size
        if size > self.config.disk_bytes or key in self.disk_puts:
            return
        shortfall = self.reserved + size - self.config.disk_bytes
        if shortfall > 0 and sum(m.size for m in self.disk.values() if m.pin_count <= 0) < shortfall:
            return
        while self.reserved + size > self.config.disk_bytes:
            victim = self.disk_policy.candidate(self.disk, lambda k: self.disk[k].pin_count <= 0)
            if victim is None:  # pragma: no cover - the evictable bytes were counted above
                return
            self.reserved -= self.disk[victim].size
            self._disk_remove(victim, force=False)
        self.reserved += size
        self.disk_policy.on_put(key)
        self.disk_puts.append(key)
        self.disk_jobs.append(_Job("put", (key,), [self._ref_up(obj)]))

    def _disk_remove(self, key: NodeId, *, force: bool) -> bool:
        """``LocalDiskBackend.remove``. A forced remove releases the file's bytes from the reservation too
        (L-07: LMCache 0.5.6 releases them from ``usage`` only)."""
        meta = self.disk.pop(key, None)
        if meta is None:
            return False
        self.usage -= meta.size
        if force:
            self.reserved -= meta.size
            self.disk_policy.on_force_evict(key)
            self._forget_pins(DISK, key)
            for prefetch in self.prefetches.values():
                prefetch.pinned = [k for k in prefetch.pinned if k != key]
        return True

    def _remote_put(self, key: NodeId, obj: MemoryObj) -> None:
        """``RemoteBackend.submit_put_task``: a key being put is skipped; otherwise the put is queued on the loop
        and holds the object until it ran (the naive serializer hands the object itself on with one more
        reference, which the connector drops after the put, ``InstrumentedRemoteConnector.put``)."""
        if key in self.remote_puts:
            return
        self.remote_puts.append(key)
        self.remote_jobs.append(_Job("put", (key,), [self._ref_up(obj)]))

    def _batched_put(self, chunks: list[tuple[NodeId, MemoryObj]]) -> None:
        """``StorageManager.batched_put``: every tier in order, then the caller's references dropped."""
        for key, obj in chunks:
            self._cpu_put(key, obj)
        if self.config.disk:
            for key, obj in chunks:
                self._disk_put(key, obj)
        if self.config.remote:
            for key, obj in chunks:
                self._remote_put(key, obj)
        for _, obj in chunks:
            self._ref_down(obj)

    def _contains(self, tier: str, keys: list[NodeId], pin: bool) -> int:
        """``batched_contains`` of one tier: how many leading ``keys`` it holds, pinning them with ``pin``."""
        hits = 0
        for key in keys:
            if tier == CPU and key in self.hot:
                if pin:
                    self.hot[key].pin_count += 1
                    self.cpu_touched.append(key)
            elif tier == DISK and key in self.disk:
                if pin:
                    self.disk[key].pin_count += 1
                    self.disk_touched.append(key)
            elif not (tier == REMOTE and key in self.remote):
                break
            hits += 1
        return hits

    def _tiers(self) -> list[str]:
        return [CPU] + ([DISK] if self.config.disk else []) + ([REMOTE] if self.config.remote else [])

    def _block_mapping(self, keys: list[NodeId], pin: bool) -> dict[str, list[NodeId]]:
        """``StorageManager.batched_contains``: each tier answers a prefix of what the tiers before it left."""
        mapping: dict[str, list[NodeId]] = {}
        total = 0
        for tier in self._tiers():
            hits = self._contains(tier, keys, pin)
            if hits == 0:
                continue
            mapping[tier] = keys[:hits]
            total += hits
            keys = keys[hits:]
            if not keys:
                break
        return mapping

    def _touch(self) -> None:
        """``StorageManager.touch_cache``: the pinned hits' policy updates, last key first."""
        for key in reversed(self.cpu_touched):
            self.cpu_policy.on_hit(key, self.hot)
        self.cpu_touched = []
        for key in reversed(self.disk_touched):
            self.disk_policy.on_hit(key, self.disk)
        self.disk_touched = []

    # --- operations ----------------------------------------------------------------------------------------

    def _chunks(self, tokens: tuple[int, ...], skip: int) -> list[Chunk]:
        """``process_tokens(tokens, mask)``: each chunk's key, start and end, the first ``skip`` tokens out."""
        c = self.config
        keys = chunk_keys(tokens, c.chunk_size, c.save_unfull_chunk)
        return [(k, i * c.chunk_size, k.depth) for i, k in enumerate(keys) if i * c.chunk_size >= skip]

    def _store(self, tokens: tuple[int, ...], skip: int) -> int:
        """``LMCacheEngine.store``: a fresh object per chunk, cached or not (L-02); allocation stops at the
        first chunk that does not fit (``force_store_wait`` off: no busy-wait)."""
        chunks: list[tuple[NodeId, MemoryObj]] = []
        stored = 0
        for key, start, end in self._chunks(tokens, skip):
            obj = self._allocate(key, end - start)
            if obj is None:
                break
            chunks.append((key, obj))
            stored += end - start
        if chunks:
            self._batched_put(chunks)
        return stored

    def _lookup(self, tokens: tuple[int, ...], lookup_id: int | None, pin: bool) -> int:
        """``LMCacheEngine.lookup``: the prefix over the tiers; pinned hits recorded under ``lookup_id``."""
        keys = [k for k, _, _ in self._chunks(tokens, 0)]
        mapping = self._block_mapping(keys, pin)
        if pin and mapping:
            assert lookup_id is not None
            self.lookup_pins[lookup_id] = mapping
        hits = sum(len(v) for v in mapping.values())
        if pin:
            self._touch()
        return keys[hits - 1].depth if hits else 0

    def _lookup_unpin(self, lookup_id: int) -> None:
        """``lookup_unpin``: release a pinned lookup's pins, or a finished prefetch's objects."""
        if lookup_id in self.lookup_pins:
            for tier, keys in self.lookup_pins.pop(lookup_id).items():
                for key in keys:
                    if tier == CPU and key in self.hot:
                        self._unpin(self.hot[key])
                    elif tier == DISK and key in self.disk:
                        self.disk[key].pin_count -= 1
            return
        prefetch = self.prefetches.get(lookup_id)
        if prefetch is None or not prefetch.done:
            return
        del self.prefetches[lookup_id]
        self._release_pins(prefetch)
        for result in prefetch.results:
            for _, obj in result or []:
                self._release(obj, prefetch)

    def _release_pins(self, prefetch: _Prefetch) -> None:
        """L-12: the disk pins a pinned prefetch lookup took go when the prefetch is consumed (LMCache 0.5.6
        keeps them: nothing records them)."""
        for key in prefetch.pinned:
            if key in self.disk:
                self.disk[key].pin_count -= 1
        prefetch.pinned = []

    def _read(self, tier: str, keys: list[NodeId], chunks: list[Chunk]) -> list[MemoryObj | None]:
        """``StorageManager.batched_get`` from one tier: an object (one reference for the caller) per key or
        None; what a lower tier read completely is promoted into CPU."""
        if tier == CPU:
            return [self._ref_up(self.hot[k]) if k in self.hot else None for k in keys]
        tokens = {k: e - s for k, s, e in chunks}
        out: list[MemoryObj | None] = []
        if tier == DISK and len(keys) > 1:
            # batched_get_blocking: every buffer is allocated before any file is read.
            buffers = [self._allocate(k, tokens[k]) if k in self.disk else None for k in keys]
            for key, buf in zip(keys, buffers, strict=True):
                out.append(self._disk_read(key, buf))
            for key, got in zip(keys, out, strict=True):
                if got is not None:
                    self.disk_policy.on_hit(key, self.disk)
        else:
            for key in keys:
                if tier == DISK:
                    buf = self._allocate(key, tokens[key]) if key in self.disk else None
                    got = self._disk_read(key, buf)
                    if got is not None:
                        self.disk_policy.on_hit(key, self.disk)
                else:
                    got = self._remote_read(key, tokens[key])
                out.append(got)
        if None not in out:
            for key, obj in zip(keys, out, strict=True):
                assert obj is not None
                self._cpu_put(key, obj)
        return out

    def _disk_read(self, key: NodeId, buf: MemoryObj | None) -> MemoryObj | None:
        """One file read into ``buf``; a damaged file or a failed read is a miss (L-08) and frees ``buf``."""
        if buf is None:
            return None
        meta = self.disk.get(key)
        failed = self.disk_fail_read
        self.disk_fail_read = False
        if meta is None or meta.damaged or failed:
            self._ref_down(buf)
            return None
        return buf

    def _remote_read(self, key: NodeId, tokens: int) -> MemoryObj | None:
        """One remote get of a stored object (L-20, L-24): an armed read fault fails it before anything is
        allocated; otherwise a buffer is allocated (it may evict) and the object read into it, a damaged one
        being a miss that frees the buffer."""
        if key not in self.remote:
            return None
        if self.remote_fail_read:
            self.remote_fail_read = False
            return None
        buf = self._allocate(key, tokens)
        if buf is None:
            return None
        if self.remote[key]:
            self._ref_down(buf)
            return None
        return buf

    def _retrieve(self, tokens: tuple[int, ...], skip: int, lookup_id: int | None) -> int:
        """``LMCacheEngine.retrieve`` with synchronous loading (``_process_tokens_internal``)."""
        chunks = self._chunks(tokens, skip)
        pins = self.lookup_pins.get(lookup_id) if lookup_id is not None else None
        if pins is not None and len(pins) == 1:
            blocks = {next(iter(pins)): chunks}  # L-04: the pinned tier is asked for every chunk
        else:
            mapping = self._block_mapping([k for k, _, _ in chunks], pin=False)
            blocks, at = {}, 0
            for tier, keys in mapping.items():
                blocks[tier] = chunks[at : at + len(keys)]
                at += len(keys)
        got: list[tuple[Chunk, MemoryObj]] = []
        failed: int | None = None
        for tier, block in blocks.items():
            objs = self._read(tier, [k for k, _, _ in block], block)
            used = 0
            for chunk, obj in zip(block, objs, strict=True):
                if obj is None:
                    failed = chunk[1] if failed is None else min(failed, chunk[1])
                    break
                got.append((chunk, obj))
                used += 1
            for obj in objs[used:]:
                if obj is not None:
                    self._ref_down(obj)
        if failed is not None:
            kept = [(chunk, obj) for chunk, obj in got if chunk[2] <= failed]
            for chunk, obj in got:
                if chunk[2] > failed:
                    self._ref_down(obj)
            got = kept
        for _, obj in got:
            self._ref_down(obj)
        return sum(e - s for (_, s, e), _ in got)

    def _retrieve_async(self, tokens: tuple[int, ...], skip: int, lookup_id: int) -> int:
        """``retrieve`` with async loading (``_async_process_tokens_internal``): the chunks the prefetch
        loaded, from the first one on, until one is missing; the prefetch is consumed (L-06)."""
        prefetch = self.prefetches.pop(lookup_id)
        self._release_pins(prefetch)
        loaded = {k: obj for result in prefetch.results for k, obj in result or []}
        used: list[tuple[Chunk, MemoryObj]] = []
        for key, start, end in self._chunks(tokens, skip):
            obj = loaded.get(key)
            if obj is None:
                break
            used.append(((key, start, end), obj))
        keep = {chunk[0] for chunk, _ in used}
        for key, obj in loaded.items():
            if key not in keep:
                self._release(obj, prefetch)
        for _, obj in used:
            self._release(obj, prefetch)
        return sum(e - s for (_, s, e), _ in used)

    def _prefetch(self, tokens: tuple[int, ...], lookup_id: int, pin: bool) -> None:
        """``async_lookup_and_prefetch``: each tier's hit (a prefix of what the tiers before it left) starts
        loading: CPU hits are referenced at once, disk hits get pinned CPU buffers and one read job, remote
        hits one read job. No hit: the answer is 0 at once."""
        keys = [k for k, _, _ in self._chunks(tokens, 0)]
        prefetch = _Prefetch([k.depth for k in keys])
        self.prefetches[lookup_id] = prefetch
        for tier in self._tiers():
            hits = self._contains(tier, keys, pin)
            if hits == 0:
                continue
            prefetch.expected.append(hits)
            part = keys[:hits]
            if pin and tier == DISK:
                prefetch.pinned.extend(part)
            if tier == CPU:
                prefetch.results.append([(k, self._ref_up(self.hot[k])) for k in part])
                if pin:
                    prefetch.owned.update(self.hot[k].address for k in part)
            elif tier == DISK:
                bufs: list[MemoryObj] = []
                for key in part:
                    buf = self._allocate(key, self._tokens_of(key))
                    if buf is None:
                        break  # L-11: partial results; LMCache 0.5.6 keeps its disk lock here
                    self.disk[key].pin_count += 1
                    self.disk_policy.on_hit(key, self.disk)
                    buf.pin_count += 1
                    prefetch.owned[buf.address] += 1
                    bufs.append(buf)
                prefetch.results.append(None)
                self.disk_jobs.append(_Job("read", tuple(part[: len(bufs)]), bufs, lookup_id))
            else:
                prefetch.results.append(None)
                self.remote_jobs.append(_Job("read", tuple(part), [], lookup_id))
            keys = keys[hits:]
            if not keys:
                break
        self._maybe_answer(lookup_id)

    def _tokens_of(self, key: NodeId) -> int:
        """Tokens of the chunk ``key`` names (its end minus its chunk's start)."""
        return key.depth - (key.depth - 1) // self.config.chunk_size * self.config.chunk_size

    def _maybe_answer(self, lookup_id: int) -> None:
        """``prefetch_all_done_callback`` once every tier's loading task finished: the answer counts tiers in
        order and stops at the first that loaded fewer chunks than its lookup found, releasing the rest."""
        prefetch = self.prefetches[lookup_id]
        if prefetch.done or any(r is None for r in prefetch.results):
            return
        prefetch.done = True
        total = 0
        results = [r for r in prefetch.results if r is not None]
        for index, result in enumerate(results):
            total += len(result)
            if len(result) < prefetch.expected[index]:
                for later in results[index + 1 :]:
                    for _, obj in later:
                        self._release(obj, prefetch)
                prefetch.results = [*results[: index + 1]]
                break
        prefetch.hit = prefetch.chunk_ends[total - 1] if total else 0

    def _clear(self, tokens: tuple[int, ...] | None) -> int:
        """``LMCacheEngine.clear``: without tokens, ``StorageManager.clear`` (only the CPU tier has
        ``clear``: its evictable entries, counted in tokens); with tokens, each chunk removed from every
        tier (forced), counted in removals."""
        if tokens is None:
            victims = [k for k, obj in self.hot.items() if obj.can_evict]
            cleared = sum(self.hot[k].tokens for k in victims)
            for key in victims:
                self._cpu_remove(key, force=True)
            return cleared
        removed = 0
        for key, _, _ in self._chunks(tokens, 0):
            removed += self._cpu_remove(key, force=True)
            if self.config.disk:
                removed += self._disk_remove(key, force=True)
            if self.config.remote and key in self.remote:
                del self.remote[key]
                removed += 1
        return removed

    def _step(self, queue: Queue, count: int) -> tuple[NodeId, ...]:
        """Run the next ``count`` jobs of ``queue`` (fewer when it empties)."""
        done: list[NodeId] = []
        for _ in range(count):
            if queue is Queue.DISK:
                if not self.disk_jobs:
                    break
                # The executor's priority queue: prefetch reads before puts, each in submission order.
                index = next((i for i, j in enumerate(self.disk_jobs) if j.kind == "read"), 0)
                job = self.disk_jobs.pop(index)
                self._run_disk(job)
            else:
                if not self.remote_jobs:
                    break
                job = self.remote_jobs.popleft()
                self._run_remote(job)
            done.extend(job.keys)
        return tuple(done)

    def _run_disk(self, job: _Job) -> None:
        if job.kind == "put":
            key, obj = job.keys[0], job.objs[0]
            failed = self.disk_fail_write
            self.disk_fail_write = False
            self.disk_puts.remove(key)
            self._ref_down(obj)
            if failed:  # L-08: a failed write publishes nothing and gives its reservation back
                self.reserved -= obj.size
                self.disk_policy.on_force_evict(key)
                return
            self.usage += obj.size
            if key in self.disk:
                self.disk_policy.on_hit(key, self.disk)
            else:
                self.disk[key] = _DiskMeta(obj.size)
            return
        assert job.lookup_id is not None
        result: list[tuple[NodeId, MemoryObj]] = []
        broken = False
        for key, buf in zip(job.keys, job.objs, strict=True):
            meta = self.disk.get(key)
            if meta is not None:
                meta.pin_count -= 1  # the pin batched_get_non_blocking took
            if not broken:
                failed = self.disk_fail_read
                self.disk_fail_read = False
                broken = meta is None or meta.damaged or failed
            if broken:  # L-08: the prefetch's chunks end before a damaged file or a failed read
                self._release(buf, self.prefetches[job.lookup_id])
            else:
                result.append((key, buf))
        self._finish_read(job.lookup_id, result)

    def _run_remote(self, job: _Job) -> None:
        if job.kind == "put":
            key = job.keys[0]
            failed = self.remote_fail_write
            self.remote_fail_write = False
            self.remote_puts.remove(key)
            self._ref_down(job.objs[0])
            if not failed:
                self.remote[key] = False
            return
        assert job.lookup_id is not None
        # L-25: every key's get runs (the connector gathers them, each allocating its buffer, in the job's
        # order); the consecutive prefix of hits is kept and every buffer after the first miss released.
        gets = [self._remote_read(key, self._tokens_of(key)) for key in job.keys]
        result: list[tuple[NodeId, MemoryObj]] = []
        missed = False
        for key, got in zip(job.keys, gets, strict=True):
            missed = missed or got is None
            if got is None:
                continue
            if missed:
                self._ref_down(got)
            else:
                result.append((key, got))
        self._finish_read(job.lookup_id, result)

    def _finish_read(self, lookup_id: int, result: list[tuple[NodeId, MemoryObj]]) -> None:
        prefetch = self.prefetches[lookup_id]
        index = prefetch.results.index(None)
        prefetch.results[index] = result
        self._maybe_answer(lookup_id)

    def _fault(self, tier: Tier, kind: FaultKind, index: int) -> None:
        if kind in (FaultKind.CORRUPT, FaultKind.DELETE):
            keys = sorted(self.disk if tier is Tier.DISK else self.remote)
            if not keys:
                return
            key = keys[index % len(keys)]
            if tier is Tier.DISK:
                self.disk[key].damaged = True  # the tier still lists it (LocalDiskBackend.dict)
            elif kind is FaultKind.DELETE:
                del self.remote[key]  # the remote tier is its files: the key is gone
            else:
                self.remote[key] = True
            return
        write = kind is FaultKind.FAIL_NEXT_WRITE
        if tier is Tier.DISK:
            if write:
                self.disk_fail_write = True
            else:
                self.disk_fail_read = True
        elif write:
            self.remote_fail_write = True
        else:
            self.remote_fail_read = True

    # --- snapshot ------------------------------------------------------------------------------------------

    def snapshot(self) -> LMCacheSnapshot:
        c = self.config
        cpu = CpuRecord(
            capacity=c.cpu_bytes,
            entries=tuple(
                CpuEntry(k, self.hot[k].address, self.cpu_policy.frequency(k))
                for k in self.cpu_policy.order(self.hot)
            ),
            objects=tuple(
                ObjectRecord(o.address, o.size, o.tokens, o.content, o.ref_count, o.pin_count)
                for o in self.alloc.live()
            ),
            free_list=tuple(self.alloc.free_list),
            allocated_bytes=self.alloc.allocated,
            touched=tuple(self.cpu_touched),
        )
        disk = None
        if c.disk:
            order = sorted(range(len(self.disk_jobs)), key=lambda i: (self.disk_jobs[i].kind != "read", i))
            disk = DiskRecord(
                capacity=c.disk_bytes,
                entries=tuple(
                    DiskEntry(k, self.disk[k].size, self.disk[k].pin_count, self.disk[k].damaged)
                    for k in self.disk_policy.order(self.disk)
                ),
                reserved=self.reserved,
                usage=self.usage,
                pending_puts=tuple(self.disk_puts),
                jobs=tuple(
                    DiskJob(j.kind, j.keys, tuple(o.address for o in j.objs), j.lookup_id)
                    for j in (self.disk_jobs[i] for i in order)
                ),
                fail_next_write=self.disk_fail_write,
                fail_next_read=self.disk_fail_read,
                touched=tuple(self.disk_touched),
            )
        remote = None
        if c.remote:
            remote = RemoteRecord(
                keys=tuple(sorted(self.remote)),
                damaged=tuple(sorted(k for k, bad in self.remote.items() if bad)),
                pending_puts=tuple(sorted(self.remote_puts)),
                jobs=tuple(
                    RemoteJob(j.kind, j.keys, j.lookup_id, tuple(o.address for o in j.objs))
                    for j in self.remote_jobs
                ),
                fail_next_write=self.remote_fail_write,
                fail_next_read=self.remote_fail_read,
            )
        pins = tuple(
            PinRecord(i, tier, tuple(keys))
            for i in sorted(self.lookup_pins)
            for tier, keys in self.lookup_pins[i].items()
        )
        prefetches = tuple(
            PrefetchRecord(
                i,
                tuple(p.expected),
                tuple(sorted((k, o.address) for r in p.results for k, o in r or [])),
                sum(1 for r in p.results if r is None),
                p.done,
                p.hit,
                tuple(p.pinned),
            )
            for i, p in sorted(self.prefetches.items())
        )
        return LMCacheSnapshot(c.chunk_size, cpu, disk, remote, pins, prefetches, tuple(self.warnings))
