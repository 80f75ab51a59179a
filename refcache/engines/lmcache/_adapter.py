"""``LMCacheSystem``: LMCache 0.5.6's own engine (``_driver.LMCacheDriver``) behind refcache's LMCache operation
alphabet (``refcache.lmcache.ops``), reporting ``refcache.lmcache.snapshot.LMCacheSnapshot``.

The adapter plays the serving engine's connector: it checks the alphabet's preconditions (``check_op``, the
same ones the reference model checks) before it calls LMCache, maps each operation onto one engine call or one
background step, and reads the snapshot from LMCache's own structures: the CPU hot cache and its policy, every
live memory object (allocator address, counts, the chunk it was allocated for), the allocator's free list,
the disk index and its byte accounting, the gated jobs, the lookup pins, the prefetches the event manager
still holds, and the alarms LMCache logged. Chunk hashes are mapped back to the tokens they stand for.

A retrieve whose KV is not what was stored for those tokens (the content oracle), an operation LMCache would
wait on for ever (``Blocked``) and an exception out of LMCache are reported, never hidden: the first two as the
observation (``Blocked``) or as a warning in the snapshot, the last by raising.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Final, Self

from lmcache.v1.event_manager import EventStatus, EventType

from refcache.config import HiCacheConfig
from refcache.engines.lmcache._driver import LMCacheDriver, WouldBlock
from refcache.family import NodeId
from refcache.lmcache.config import CachePolicy, LMCacheConfig
from refcache.lmcache.ops import (
    NAMESPACE,
    Blocked,
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

__all__ = ["SUPPORTED", "LMCacheSystem"]

SUPPORTED: Final = ("0.5.6",)
"""The LMCache releases whose internals this adapter reads (specs/lmcache.md)."""

_TIERS: Final = {"LocalCPUBackend": "cpu", "LocalDiskBackend": "disk", "RemoteBackend": "remote"}


class LMCacheSystem:
    """LMCache's own engine as an LMCache-family system (module docstring)."""

    def __init__(self, config: HiCacheConfig) -> None:
        self.config = LMCacheConfig.of(config)
        c = self.config
        self.driver = LMCacheDriver(
            chunk_size=c.chunk_size,
            layers=config.layer_num,
            heads=config.head_num,
            head_dim=config.head_dim,
            dtype=config.dtype,
            cpu_bytes=c.cpu_bytes,
            disk_bytes=c.disk_bytes,
            remote=c.remote,
            policy=c.cache_policy.value,
            save_unfull_chunk=c.save_unfull_chunk,
            async_loading=c.async_loading,
        )
        self.prefetch_ids: set[int] = set()  # started and not yet consumed (the alphabet's protocol)
        self.damaged: dict[str, set[int]] = {"disk": set(), "remote": set()}  # chunk hashes a fault damaged
        self.wrong: list[str] = []  # content oracle failures, reported as warnings

    # -- the System protocol ---------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self.driver.close()

    def _answered(self) -> frozenset[int]:
        """The prefetches answered with a hit (``check_op``: only those can be retrieved)."""
        replies = self.driver.lookup_server.replies
        return frozenset(i for i in self.prefetch_ids if replies.get(str(i), 0) > 0)

    def _replied(self) -> frozenset[int]:
        replies = self.driver.lookup_server.replies
        return frozenset(i for i in self.prefetch_ids if str(i) in replies)

    def apply(self, op: LMCacheOp) -> LMCacheObservation:
        d = self.driver
        check_op(
            op,
            self.config,
            frozenset(int(i) for i in d.engine.lookup_pins),
            frozenset(self.prefetch_ids),
            {Queue.DISK: len(d.queued("disk")), Queue.REMOTE: len(d.queued("remote"))},
            self._answered(),
        )
        if d.stuck():
            return Blocked(d.stuck())
        d.listen(True)
        try:
            return self._apply(op)
        except WouldBlock as blocked:
            d.settle()
            return Blocked(str(blocked))
        finally:
            d.listen(False)

    def _apply(self, op: LMCacheOp) -> LMCacheObservation:
        d = self.driver
        match op:
            case Store(tokens, skip):
                return StoreResult(d.store(tokens, skip))
            case Lookup(tokens, lookup_id, pin):
                return LookupResult(d.lookup(tokens, None if lookup_id is None else str(lookup_id), pin))
            case Retrieve(tokens, skip, lookup_id):
                got, wrong = d.retrieve(tokens, skip, None if lookup_id is None else str(lookup_id))
                self.wrong += [f"Retrieve{list(tokens)}: {line}" for line in wrong]
                if self.config.async_loading and lookup_id is not None:
                    self.prefetch_ids.discard(lookup_id)
                return RetrieveResult(got)
            case LookupUnpin(lookup_id):
                if lookup_id in self._replied():
                    self.prefetch_ids.discard(lookup_id)
                d.lookup_unpin(str(lookup_id))
                return Done()
            case Prefetch(tokens, lookup_id, pin):
                self.prefetch_ids.add(lookup_id)
                d.prefetch(tokens, str(lookup_id), pin)
                return Done()
            case PollPrefetch(lookup_id):
                reply = d.lookup_server.replies.get(str(lookup_id))
                return PrefetchResult(reply is not None, reply or 0)
            case Clear(tokens):
                return ClearResult(d.clear(tokens))
            case Step(queue, count):
                ran = d.run(queue.value, count)
                return StepResult(tuple(self._node(h) for job in ran for h in job.keys))
            case StorageFault(tier, kind, index):
                self._fault(tier, kind, index)
                return Done()
        raise AssertionError(f"not an LMCache operation: {op!r}")  # pragma: no cover - check_op refused it

    def _fault(self, tier: Tier, kind: FaultKind, index: int) -> None:
        d = self.driver
        name = tier.value
        if kind in (FaultKind.FAIL_NEXT_WRITE, FaultKind.FAIL_NEXT_READ):
            d.arm(name, "write" if kind is FaultKind.FAIL_NEXT_WRITE else "read")
            return
        if tier is Tier.DISK:
            assert d.disk is not None
            hashes = [k.chunk_hash for k in d.disk.dict]
        else:
            hashes = d.remote_keys()
        if not hashes:
            return
        ordered = sorted(hashes, key=self._node)
        chosen = ordered[index % len(ordered)]
        d.damage(name, chosen, delete=kind is FaultKind.DELETE)
        self.damaged[name].add(chosen)

    # -- snapshot --------------------------------------------------------------------------------------------

    def _node(self, chunk_hash: int) -> NodeId:
        path = self.driver.names.get(chunk_hash)
        if path is None:  # a hash refcache never computed: it cannot name its tokens
            return NodeId(f"?{chunk_hash:x}", ())
        return NodeId(NAMESPACE, path)

    def _policy_order(self, policy: Any, mapping: dict[Any, Any]) -> list[Any]:  # LMCache's own keys
        kind = self.config.cache_policy
        if kind in (CachePolicy.LRU, CachePolicy.FIFO):
            return list(mapping)
        if kind is CachePolicy.MRU:
            return list(mapping)[::-1]
        buckets = policy.freq_to_keys
        scanned = [k for freq in buckets for k in buckets[freq] if k in mapping]
        return scanned + [k for k in mapping if k not in scanned]

    def snapshot(self) -> LMCacheSnapshot:
        d = self.driver
        c = self.config
        node = self._node
        cpu = d.cpu
        lfu = c.cache_policy is CachePolicy.LFU
        held = cpu.cpu_lock.acquire(blocking=False)  # as for the disk lock below
        try:
            hot = dict(cpu.hot_cache)
            order = self._policy_order(cpu.cache_policy, hot)
            freq = dict(cpu.cache_policy.key_to_freq) if lfu else {}
            touched = tuple(node(k.chunk_hash) for k in cpu.keys_in_request)
        finally:
            if held:
                cpu.cpu_lock.release()
        manager = cpu.memory_allocator.pin_allocator.address_manager
        objects = tuple(
            ObjectRecord(
                o.meta.address,  # type: ignore[attr-defined]
                o.meta.phy_size,  # type: ignore[attr-defined]
                o.get_num_tokens(),  # type: ignore[attr-defined]
                node(d.content_of[id(o)]) if id(o) in d.content_of else NodeId("?", ()),
                o.meta.ref_count,  # type: ignore[attr-defined]
                o.meta.pin_count,  # type: ignore[attr-defined]
            )
            for o in d.live_objects()
        )
        cpu_record = CpuRecord(
            capacity=c.cpu_bytes,
            entries=tuple(CpuEntry(node(k.chunk_hash), hot[k].meta.address, freq.get(k, 0)) for k in order),
            objects=objects,
            free_list=tuple((b.start, b.size) for b in manager._explicit_list),
            allocated_bytes=int(manager.total_allocated_size),
            touched=touched,
        )
        disk_record = None
        if d.disk is not None:
            disk = d.disk
            # Nothing of LMCache's runs between operations, so a held disk lock is one it never released
            # (d.stuck()); read past it rather than deadlock as LMCache's next disk operation would.
            held = disk.disk_lock.acquire(blocking=False)
            try:
                entries = dict(disk.dict)
                disk_order = self._policy_order(disk.cache_policy, entries)
                disk_touched = tuple(node(k.chunk_hash) for k in disk.keys_in_request)
            finally:
                if held:
                    disk.disk_lock.release()
            present = {k.chunk_hash for k in entries}
            self.damaged["disk"] &= present
            disk_record = DiskRecord(
                capacity=c.disk_bytes,
                entries=tuple(
                    DiskEntry(
                        node(k.chunk_hash),
                        int(entries[k].size),
                        int(entries[k].pin_count),
                        k.chunk_hash in self.damaged["disk"],
                    )
                    for k in disk_order
                ),
                reserved=int(disk.current_cache_size),
                usage=int(disk.usage),
                pending_puts=tuple(node(k.chunk_hash) for k in disk.disk_worker.put_tasks),
                jobs=tuple(
                    DiskJob(
                        j.kind,
                        tuple(node(h) for h in j.keys),
                        j.addresses,
                        None if j.lookup_id is None else int(j.lookup_id),
                    )
                    for j in d.queued("disk")
                ),
                fail_next_write=d.fail.get(("disk", "write"), False),
                fail_next_read=d.fail.get(("disk", "read"), False),
                touched=disk_touched,
            )
        remote_record = None
        if d.remote is not None:
            stored = set(d.remote_keys())
            self.damaged["remote"] &= stored
            tasks = {k.chunk_hash for k in d.remote.put_tasks}
            seen = sorted(tasks, key=node)  # put_tasks is a set: no order to compare
            remote_record = RemoteRecord(
                keys=tuple(sorted(node(h) for h in stored)),
                damaged=tuple(sorted(node(h) for h in self.damaged["remote"])),
                pending_puts=tuple(node(h) for h in seen),
                jobs=tuple(
                    RemoteJob(
                        j.kind,
                        tuple(node(h) for h in j.keys),
                        None if j.lookup_id is None else int(j.lookup_id),
                        j.addresses,
                    )
                    for j in d.queued("remote")
                ),
                fail_next_write=d.fail.get(("remote", "write"), False),
                fail_next_read=d.fail.get(("remote", "read"), False),
            )
        pins = tuple(
            PinRecord(int(lookup_id), _TIERS.get(location, location), tuple(node(k.chunk_hash) for k in keys))
            for lookup_id in sorted(d.engine.lookup_pins, key=int)
            for location, keys in d.engine.lookup_pins[lookup_id].items()
        )
        return LMCacheSnapshot(
            c.chunk_size,
            cpu_record,
            disk_record,
            remote_record,
            pins,
            self._prefetches(),
            tuple(d.alarms) + tuple(self.wrong) + ((d.stuck(),) if d.stuck() else ()),
        )

    def _prefetches(self) -> tuple[PrefetchRecord, ...]:
        """The prefetches LMCache's event manager still holds (ongoing or done), by lookup id."""
        d = self.driver
        events = d.engine.event_manager
        out = []
        for lookup_id, log in sorted(d.prefetch_logs.items(), key=lambda item: int(item[0])):
            status = events.get_event_status(EventType.LOADING, lookup_id)
            reply = d.lookup_server.replies.get(lookup_id)
            if status is EventStatus.NOT_FOUND and lookup_id not in self._pending_ids():
                continue  # consumed (or never started): LMCache holds nothing for it
            waiting = sum(1 for j in d.jobs if j.kind == "read" and j.lookup_id == lookup_id)
            out.append(
                PrefetchRecord(
                    int(lookup_id),
                    tuple(log.expected),
                    tuple(sorted((self._node(h), o.meta.address) for h, o in log.loaded)),  # type: ignore[attr-defined]
                    waiting,
                    reply is not None,
                    reply or 0,
                    tuple(self._node(h) for h in log.pinned_disk),
                )
            )
        return tuple(out)

    def _pending_ids(self) -> set[str]:
        return {str(i) for i in self.prefetch_ids}
