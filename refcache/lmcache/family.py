"""LMCache's ``Family``: what the checking side needs of its operations, snapshots and invariants (its directed
conformance scenarios are ``refcache.lmcache.scenarios``)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Final

from refcache.family import Family, field_diff
from refcache.lmcache.invariants import check_all, check_step
from refcache.lmcache.ops import OPS, LMCacheObservation, LMCacheOp, op_from_json, op_to_json
from refcache.lmcache.scenarios import scenarios
from refcache.lmcache.snapshot import LMCacheSnapshot
from refcache.tagged_trace import TaggedTraces

__all__ = ["FAMILY", "NO_ADDRESSES", "TRACES", "diff_lmcache_snapshots", "status_line", "without_addresses"]

TRACES: Final = TaggedTraces[LMCacheOp]("lmcache", "an LMCache", op_to_json, op_from_json)
"""LMCache's traces: the refcache trace format whose header also says ``"family": "lmcache"``, one
``refcache.lmcache.ops.op_to_json`` object per further line (``refcache.tagged_trace``); ``FAMILY`` reads
and writes them with it."""

NO_ADDRESSES: Final = "no-addresses"
"""The granularity that compares without allocator addresses and free list (an allocator that places
objects elsewhere): objects, entries and jobs keep everything else."""


def diff_lmcache_snapshots(
    a: LMCacheSnapshot, b: LMCacheSnapshot, name_a: str = "lmcache-model", name_b: str = "lmcache"
) -> list[str]:
    """Readable differences between two LMCache snapshots: which field (tier, entry, object, job), both values."""
    return field_diff("snapshot", a, b, name_a, name_b)


def status_line(snap: LMCacheSnapshot) -> str:
    """One line per step: CPU entries, objects and bytes allocated of the capacity, pinned lookups; with a
    disk tier its files, reserved bytes and jobs; with a remote tier its objects and jobs; prefetches."""
    cpu = snap.cpu
    line = (
        f"cpu {len(cpu.entries)} entries {len(cpu.objects)} objs {cpu.allocated_bytes}/{cpu.capacity}B "
        f"pins {len(snap.lookup_pins)}"
    )
    if snap.disk is not None:
        d = snap.disk
        line += f" | disk {len(d.entries)} files {d.reserved}/{d.capacity}B jobs {len(d.jobs)}"
    if snap.remote is not None:
        line += f" | remote {len(snap.remote.keys)} jobs {len(snap.remote.jobs)}"
    return line + f" | pf {len(snap.prefetches)}"


def without_addresses(snap: LMCacheSnapshot) -> LMCacheSnapshot:
    """``snap`` with every address 0 and no free list: what ``NO_ADDRESSES`` compares. Objects are listed by
    content instead of address."""
    cpu = snap.cpu
    objects = tuple(sorted((dataclasses.replace(o, address=0) for o in cpu.objects), key=lambda o: o.content))
    entries = tuple(dataclasses.replace(e, address=0) for e in cpu.entries)
    disk = snap.disk
    if disk is not None:
        jobs = tuple(dataclasses.replace(j, addresses=(0,) * len(j.addresses)) for j in disk.jobs)
        disk = dataclasses.replace(disk, jobs=jobs)
    remote = snap.remote
    if remote is not None:
        rjobs = tuple(dataclasses.replace(j, addresses=(0,) * len(j.addresses)) for j in remote.jobs)
        remote = dataclasses.replace(remote, jobs=rjobs)
    prefetches = tuple(
        dataclasses.replace(p, loaded=tuple((k, 0) for k, _ in p.loaded)) for p in snap.prefetches
    )
    return dataclasses.replace(
        snap,
        cpu=dataclasses.replace(cpu, entries=entries, objects=objects, free_list=()),
        disk=disk,
        remote=remote,
        prefetches=prefetches,
    )


OBSERVATIONS: Final[tuple[type[LMCacheObservation], ...]] = typing.get_args(LMCacheObservation)

FAMILY: Final[Family[LMCacheOp, LMCacheObservation, LMCacheSnapshot]] = Family(
    name="lmcache",
    summary="LMCache (refcache.lmcache.ops)",
    ops=OPS,
    observation=OBSERVATIONS,
    snapshot=LMCacheSnapshot,
    check=check_all,
    check_step=check_step,
    diff=diff_lmcache_snapshots,
    status_line=status_line,
    dumps_trace=TRACES.dumps,
    read_trace=TRACES.read,
    is_trace=TRACES.is_trace,
    scenarios=scenarios,
    reference="lmcache-model",
    granularities={NO_ADDRESSES: without_addresses},
)
"""LMCache's family: ``refcache.lmcache.invariants`` over ``LMCacheSnapshot``, traces of ``refcache.lmcache.ops``."""
