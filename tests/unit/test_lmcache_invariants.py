"""The LMCache invariant family: every invariant holds on the model's snapshots and fails, by name, on a
deliberately broken one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from refcache.family import NodeId
from refcache.lmcache.family import FAMILY, NO_ADDRESSES, without_addresses
from refcache.lmcache.invariants import INVARIANTS, NOT_APPLICABLE, check_all, check_step
from refcache.lmcache.model import LMCacheModel
from refcache.lmcache.ops import Lookup, Prefetch, Queue, Step, Store
from refcache.lmcache.scenarios import A, B, config
from refcache.lmcache.snapshot import DiskRecord, LMCacheSnapshot, PinRecord

replace = dataclasses.replace


def busy() -> LMCacheSnapshot:
    """CPU entries (two pinned by lookup 1), published disk files, disk writes in flight, remote puts queued,
    a prefetch that loaded two CPU chunks, two free chunks in one block."""
    model = LMCacheModel(config(6, disk_chunks=4, remote=True, async_loading=True))
    for op in (Store(A), Step(Queue.DISK, 2), Lookup(A, 1, pin=True), Store(B), Prefetch(A, 2)):
        model.apply(op)
    snap = model.snapshot()
    assert snap.disk is not None and snap.disk.jobs and snap.lookup_pins and snap.prefetches
    assert snap.cpu.free_list == ((16384, 8192),)
    return snap


def disk(snap: LMCacheSnapshot) -> DiskRecord:
    assert snap.disk is not None
    return snap.disk


def key(snap: LMCacheSnapshot) -> NodeId:
    return snap.cpu.entries[0].key


BREAKS: dict[str, Callable[[LMCacheSnapshot], LMCacheSnapshot]] = {
    "CPU-BUDGET": lambda s: replace(s, cpu=replace(s.cpu, allocated_bytes=s.cpu.allocated_bytes + 4096)),
    "FREE-LIST": lambda s: replace(
        s, cpu=replace(s.cpu, free_list=((s.cpu.free_list[0][0], 4096), (s.cpu.free_list[0][0] + 4096, 4096)))
    ),
    "HOT-CACHE": lambda s: replace(
        s, cpu=replace(s.cpu, entries=(*s.cpu.entries[:-1], replace(s.cpu.entries[-1], key=NodeId("", (99,)))))
    ),
    "REF-COUNTS": lambda s: replace(
        s, cpu=replace(s.cpu, objects=(replace(s.cpu.objects[0], ref_count=s.cpu.objects[0].ref_count + 1), *s.cpu.objects[1:]))
    ),
    "PINS": lambda s: replace(s, lookup_pins=(*s.lookup_pins, PinRecord(9, "cpu", (key(s),)))),
    "DISK-ACCOUNTING": lambda s: replace(s, disk=replace(disk(s), reserved=disk(s).reserved - 4096)),
    "IN-FLIGHT": lambda s: replace(s, prefetches=(replace(s.prefetches[0], waiting=1),)),
    "CHUNK-SHAPE": lambda s: replace(
        s, cpu=replace(s.cpu, objects=(replace(s.cpu.objects[0], tokens=s.cpu.objects[0].tokens + 1), *s.cpu.objects[1:]))
    ),
    "POLICY-ORDER": lambda s: replace(
        s, cpu=replace(s.cpu, entries=(replace(s.cpu.entries[0], freq=5), *s.cpu.entries[1:]))
    ),
    "NO-WARNINGS": lambda s: replace(s, warnings=("double free: object at 0",)),
}  # fmt: skip


def test_the_invariants_hold_on_a_busy_snapshot_and_each_is_tested() -> None:
    assert check_all(busy()) == []
    names = {inv.__doc__.split(":")[0].split(" (")[0] for inv in INVARIANTS if inv.__doc__}
    assert names == set(BREAKS) and not names & set(NOT_APPLICABLE)


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_each_invariant_fails_on_a_broken_snapshot(name: str) -> None:
    violations = check_all(BREAKS[name](busy()))
    assert violations and {v.invariant for v in violations} == {name}, [str(v) for v in violations]


def test_pinned_kept_fails_when_a_pinned_chunk_goes() -> None:
    before = busy()
    pinned = before.lookup_pins[0].keys[0]
    after = replace(
        before, cpu=replace(before.cpu, entries=tuple(e for e in before.cpu.entries if e.key != pinned))
    )
    violations = check_step(before, after, Store((1,)))
    assert [v.invariant for v in violations] == ["PINNED-KEPT"] and violations[0].node == pinned
    assert check_step(before, before, Store((1,))) == []


def test_the_no_addresses_granularity_forgets_only_addresses() -> None:
    snap = busy()
    moved = replace(
        snap,
        cpu=replace(
            snap.cpu,
            free_list=(),
            entries=tuple(replace(e, address=e.address + 4096) for e in snap.cpu.entries),
        ),
    )
    project = FAMILY.project(NO_ADDRESSES)
    assert project is without_addresses and project(moved).cpu.entries == project(snap).cpu.entries
    assert project(replace(snap, warnings=("x",))) != project(snap)
