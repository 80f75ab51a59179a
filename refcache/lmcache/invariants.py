"""The LMCache invariant family: named functions over an ``LMCacheSnapshot``.

LMCache's cache is a set of tiers over one CPU address space, with reference and pin counts on its memory
objects, so HiCache's tree invariants are restated for it here (which HiCache invariant each one restates,
and those that do not apply and why: ``NOT_APPLICABLE``; ``specs/lmcache-model.md``). Each function returns
the ``Violation``\\ s it finds.

``INVARIANTS`` are state invariants (one snapshot); ``STEP_INVARIANTS`` relate a snapshot to the one before
it and the operation between them.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from typing import Final

from refcache.family import NodeId, Violation
from refcache.lmcache.config import ALIGN_BYTES
from refcache.lmcache.ops import Clear, LMCacheOp
from refcache.lmcache.snapshot import DiskJob, LMCacheSnapshot, RemoteJob

__all__ = ["INVARIANTS", "NOT_APPLICABLE", "STEP_INVARIANTS", "check_all", "check_step"]

Invariant = Callable[[LMCacheSnapshot], list[Violation]]
StepInvariant = Callable[[LMCacheSnapshot, LMCacheSnapshot, LMCacheOp], list[Violation]]


def _v(inv: str, message: str, node: NodeId | None = None) -> Violation:
    return Violation(inv, None, node, message)


def inv_cpu_budget(snap: LMCacheSnapshot) -> list[Violation]:
    """CPU-BUDGET (restates HiCache's capacity bound): the allocator never hands out more than its capacity;
    its counter equals the live objects' sizes, and free plus allocated bytes are the capacity."""
    cpu = snap.cpu
    live = sum(o.size for o in cpu.objects)
    free = sum(size for _, size in cpu.free_list)
    out: list[Violation] = []
    if cpu.allocated_bytes > cpu.capacity:
        out.append(_v("CPU-BUDGET", f"{cpu.allocated_bytes} bytes allocated of {cpu.capacity}"))
    if live != cpu.allocated_bytes:
        out.append(
            _v("CPU-BUDGET", f"live objects hold {live} bytes, the allocator counts {cpu.allocated_bytes}")
        )
    if free + live != cpu.capacity:
        out.append(_v("CPU-BUDGET", f"free {free} + live {live} bytes != capacity {cpu.capacity}"))
    return out


def inv_free_list(snap: LMCacheSnapshot) -> list[Violation]:
    """FREE-LIST: free blocks and live objects are aligned, inside the address space and pairwise disjoint;
    free blocks are sorted and coalesced (no two adjacent)."""
    cpu = snap.cpu
    spans = [(s, n, f"free block at {s}") for s, n in cpu.free_list]
    spans += [(o.address, o.size, f"object at {o.address} ({o.content.path})") for o in cpu.objects]
    out: list[Violation] = []
    for start, size, what in spans:
        if size <= 0 or start % ALIGN_BYTES or size % ALIGN_BYTES or start < 0 or start + size > cpu.capacity:
            out.append(_v("FREE-LIST", f"{what}: {size} bytes is not an aligned span of the address space"))
    ordered = sorted(spans)
    for (a, n, what), (b, _, other) in itertools.pairwise(ordered):
        if a + n > b:
            out.append(_v("FREE-LIST", f"{what} overlaps {other}"))
    if list(cpu.free_list) != sorted(cpu.free_list):
        out.append(_v("FREE-LIST", "the free list is not sorted by address"))
    for (a, n), (b, _) in itertools.pairwise(cpu.free_list):
        if a + n == b:
            out.append(_v("FREE-LIST", f"free blocks at {a} and {b} are adjacent and were not coalesced"))
    return out


def inv_hot_cache(snap: LMCacheSnapshot) -> list[Violation]:
    """HOT-CACHE (restates HOST-VALUE): every CPU entry maps to a live object that holds its key's chunk,
    no object is mapped twice and no key is listed twice."""
    objects = {o.address: o for o in snap.cpu.objects}
    out: list[Violation] = []
    for entry in snap.cpu.entries:
        obj = objects.get(entry.address)
        if obj is None:
            out.append(_v("HOT-CACHE", f"entry maps to address {entry.address}, which is free", entry.key))
        elif obj.content != entry.key:
            out.append(_v("HOT-CACHE", f"entry maps to the object of {obj.content.path}", entry.key))
    for what, values in (
        ("key", [e.key for e in snap.cpu.entries]),
        ("object", [e.address for e in snap.cpu.entries]),
    ):
        dup = [x for x, n in Counter(values).items() if n > 1]
        if dup:
            out.append(_v("HOT-CACHE", f"{what}s listed more than once: {dup}"))
    return out


def _holders(snap: LMCacheSnapshot) -> Counter[int]:
    """The references every object must carry: its hot-cache entry, the disk and remote jobs holding it,
    the prefetches that loaded it."""
    held: Counter[int] = Counter(e.address for e in snap.cpu.entries)
    if snap.disk is not None:
        held.update(a for job in snap.disk.jobs for a in job.addresses)
    if snap.remote is not None:
        held.update(a for job in snap.remote.jobs for a in job.addresses)
    held.update(a for p in snap.prefetches for _, a in p.loaded)
    return held


def inv_ref_counts(snap: LMCacheSnapshot) -> list[Violation]:
    """REF-COUNTS (restates LOCKS): counts are never negative; an object's reference count is the number of
    its holders (its CPU entry, the disk and remote jobs and prefetches holding it), and an object nothing
    references or pins has been freed (no leak)."""
    held = _holders(snap)
    out: list[Violation] = []
    for o in snap.cpu.objects:
        if o.ref_count < 0 or o.pin_count < 0:
            out.append(
                _v("REF-COUNTS", f"object at {o.address}: ref {o.ref_count} pin {o.pin_count}", o.content)
            )
        elif o.ref_count != held[o.address]:
            out.append(
                _v(
                    "REF-COUNTS",
                    f"object at {o.address}: ref_count {o.ref_count}, held by {held[o.address]}",
                    o.content,
                )
            )
        elif o.ref_count == 0 and o.pin_count == 0:
            out.append(
                _v("REF-COUNTS", f"object at {o.address} is neither referenced nor pinned: a leak", o.content)
            )
    live = {o.address for o in snap.cpu.objects}
    out += [
        _v("REF-COUNTS", f"address {a} is held but free (a use after free)") for a in sorted(set(held) - live)
    ]
    return out


def inv_pins(snap: LMCacheSnapshot) -> list[Violation]:
    """PINS: a CPU object carries at least the pins of the pinned lookups naming its entry (a lost pin lets a
    pinned chunk be evicted) and at most those plus one per prefetch holding it (more is a leak); a disk
    entry carries exactly its pinned lookups', its prefetches' and its queued reads' pins."""
    out: list[Violation] = []
    cpu_pins: Counter[NodeId] = Counter(k for p in snap.lookup_pins if p.tier == "cpu" for k in p.keys)
    loads: Counter[int] = Counter(a for p in snap.prefetches for _, a in p.loaded)
    if snap.disk is not None:
        loads.update(a for job in snap.disk.jobs for a in job.addresses if job.kind == "read")
    by_address = {e.address: e.key for e in snap.cpu.entries}
    for o in snap.cpu.objects:
        key = by_address.get(o.address)
        least = cpu_pins[key] if key is not None else 0
        if not least <= o.pin_count <= least + loads[o.address]:
            out.append(
                _v(
                    "PINS",
                    f"object at {o.address}: pin_count {o.pin_count}; its lookups pin it {least} times "
                    f"and {loads[o.address]} prefetch loads may",
                    o.content,
                )
            )
    if snap.disk is not None:
        want: Counter[NodeId] = Counter(k for p in snap.lookup_pins if p.tier == "disk" for k in p.keys)
        want.update(k for p in snap.prefetches for k in p.pinned)
        want.update(k for job in snap.disk.jobs if job.kind == "read" for k in job.keys)
        out += [
            _v("PINS", f"disk entry pin_count {e.pin_count}, pinned by {want[e.key]} holders", e.key)
            for e in snap.disk.entries
            if e.pin_count != want[e.key]
        ]
    return out


def inv_disk_accounting(snap: LMCacheSnapshot) -> list[Violation]:
    """DISK-ACCOUNTING: the reservation is the published files' sizes plus the admitted writes' and never
    exceeds the budget; ``usage`` is the published files' sizes; the pending puts are the put jobs' keys, none
    of them already published."""
    disk = snap.disk
    if disk is None:
        return []
    objects = {o.address: o for o in snap.cpu.objects}
    puts = [job for job in disk.jobs if job.kind == "put"]
    in_flight = sum(objects[a].size for job in puts for a in job.addresses if a in objects)
    published = sum(e.size for e in disk.entries)
    out: list[Violation] = []
    if disk.reserved > disk.capacity:
        out.append(_v("DISK-ACCOUNTING", f"{disk.reserved} bytes reserved of {disk.capacity}"))
    if disk.reserved != published + in_flight:
        out.append(
            _v(
                "DISK-ACCOUNTING",
                f"reserved {disk.reserved} != published {published} + in flight {in_flight}",
            )
        )
    if disk.usage != published:
        out.append(_v("DISK-ACCOUNTING", f"usage {disk.usage} != published {published}"))
    if sorted(disk.pending_puts) != sorted(job.keys[0] for job in puts):
        out.append(_v("DISK-ACCOUNTING", f"pending puts {disk.pending_puts} are not the put jobs"))
    on_disk = {e.key for e in disk.entries}
    out += [
        _v("DISK-ACCOUNTING", "a key is both published and being written", key)
        for key in disk.pending_puts
        if key in on_disk
    ]
    return out


def inv_in_flight(snap: LMCacheSnapshot) -> list[Violation]:
    """IN-FLIGHT: every job's objects are live and hold its keys' chunks; a read job belongs to a prefetch
    that has not answered; a prefetch answers exactly when none of its reads is waiting; the remote pending
    puts are its put jobs."""
    objects = {o.address: o for o in snap.cpu.objects}
    prefetches = {p.lookup_id: p for p in snap.prefetches}
    out: list[Violation] = []
    waiting: Counter[int] = Counter()
    jobs = [*(snap.disk.jobs if snap.disk else ())]
    every: list[DiskJob | RemoteJob] = [*jobs, *(snap.remote.jobs if snap.remote else ())]
    for job in every:
        for key, address in zip(job.keys, job.addresses, strict=False):
            obj = objects.get(address)
            if obj is None or obj.content != key:
                out.append(
                    _v("IN-FLIGHT", f"{job.kind} job holds address {address}, not an object of the key", key)
                )
    remote_jobs = snap.remote.jobs if snap.remote is not None else ()
    for lookup_id in [j.lookup_id for j in jobs if j.kind == "read"] + [
        j.lookup_id for j in remote_jobs if j.kind == "read"
    ]:
        if lookup_id is None or lookup_id not in prefetches:
            out.append(_v("IN-FLIGHT", f"a read job belongs to no prefetch ({lookup_id})"))
        else:
            waiting[lookup_id] += 1
    out += [
        _v(
            "IN-FLIGHT",
            f"prefetch {p.lookup_id}: waiting {p.waiting}, {waiting[p.lookup_id]} reads queued, done {p.done}",
        )
        for p in snap.prefetches
        if p.waiting != waiting[p.lookup_id] or p.done == (p.waiting > 0)
    ]
    if snap.remote is not None:
        puts = [j.keys[0] for j in snap.remote.jobs if j.kind == "put"]
        if sorted(snap.remote.pending_puts) != sorted(puts):
            out.append(
                _v("IN-FLIGHT", f"remote pending puts {snap.remote.pending_puts} are not its put jobs {puts}")
            )
    return out


def inv_chunk_shape(snap: LMCacheSnapshot) -> list[Violation]:
    """CHUNK-SHAPE (restates HASH-CHAIN): an object holds the tokens of its chunk: its key's length less the
    chunk's start; every published key is a chain prefix (no empty key)."""
    cs = snap.chunk_size
    out: list[Violation] = []
    for o in snap.cpu.objects:
        depth = o.content.depth
        expected = depth - (depth - 1) // cs * cs if depth else 0
        if depth == 0 or o.tokens != expected:
            out.append(
                _v(
                    "CHUNK-SHAPE",
                    f"object at {o.address} holds {o.tokens} tokens, its chunk {expected}",
                    o.content,
                )
            )
    return out


def inv_policy_order(snap: LMCacheSnapshot) -> list[Violation]:
    """POLICY-ORDER: under LFU the tiers list their CPU entries by non-decreasing frequency (the scan
    order); under the other policies frequencies are 0."""
    freqs = [e.freq for e in snap.cpu.entries]
    if freqs != sorted(freqs):
        return [_v("POLICY-ORDER", f"CPU entries out of frequency order: {freqs}")]
    return []


def inv_no_warnings(snap: LMCacheSnapshot) -> list[Violation]:
    """NO-WARNINGS: LMCache never reported a double free, a double unpin or an invalidated object (it clamps
    the count and carries on, which hides the bug)."""
    return [_v("NO-WARNINGS", w) for w in snap.warnings]


def step_pinned_kept(before: LMCacheSnapshot, after: LMCacheSnapshot, op: LMCacheOp) -> list[Violation]:
    """PINNED-KEPT (restates EVICTED-UNLOCKED): a chunk a lookup pins that was in its tier before the step is
    still there after it, unless the step was a ``Clear`` (a forced remove releases pins)."""
    if isinstance(op, Clear):
        return []
    still = {(p.lookup_id, p.tier) for p in after.lookup_pins}

    def keys(snap: LMCacheSnapshot, tier: str) -> set[NodeId]:
        if tier == "cpu":
            return {e.key for e in snap.cpu.entries}
        return {e.key for e in snap.disk.entries} if tier == "disk" and snap.disk is not None else set()

    return [
        _v("PINNED-KEPT", f"pinned by lookup {p.lookup_id} in {p.tier} and gone after {op!r}", key)
        for p in before.lookup_pins
        if (p.lookup_id, p.tier) in still and p.tier in ("cpu", "disk")
        for key in set(p.keys) & keys(before, p.tier) - keys(after, p.tier)
    ]


INVARIANTS: Final[tuple[Invariant, ...]] = (
    inv_cpu_budget,
    inv_free_list,
    inv_hot_cache,
    inv_ref_counts,
    inv_pins,
    inv_disk_accounting,
    inv_in_flight,
    inv_chunk_shape,
    inv_policy_order,
    inv_no_warnings,
)
STEP_INVARIANTS: Final[tuple[StepInvariant, ...]] = (step_pinned_kept,)

NOT_APPLICABLE: Final[dict[str, str]] = {
    "EVICTED-SUFFIX": "LMCache evicts chunks one policy candidate at a time with no prefix contract: a chain's "
    "later chunks can stay cached after an earlier one is gone (a lookup stops at the gap)",
    "EVICTED-BACKUPED": "a CPU entry is evicted whether or not the disk or remote tier holds a copy",
    "BACKUP-CONTIGUITY": "writes through the tiers are per chunk; a disk tier full of pinned files refuses one",
    "RANKS-EQUAL": "one worker's engine is modelled; LMCache's ranks share nothing it checks",
}
"""HiCache invariants with no LMCache counterpart, and why."""


def check_all(snap: LMCacheSnapshot) -> list[Violation]:
    """Every state invariant."""
    return [v for inv in INVARIANTS for v in inv(snap)]


def check_step(before: LMCacheSnapshot, after: LMCacheSnapshot, op: LMCacheOp) -> list[Violation]:
    """Every step invariant between two consecutive snapshots."""
    return [v for inv in STEP_INVARIANTS for v in inv(before, after, op)]
