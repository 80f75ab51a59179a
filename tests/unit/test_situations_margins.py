"""The situations of issue #30 item 6 (thin margins), recognised on short model traces, and the draws aimed at
them: a load back under write-back whose eviction must back a device-only leaf up while the host is full but
for the pages being loaded, and a prefetch read that meets an object whose payload a fault flipped. Each is
shown recognised and shown not recognised where one fact differs (the host has an unpinned node to give; the
damage is a zeroed checksum, or the damaged object is never read)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis.stateful import run_state_machine_as_test

from refcache.check import budget
from refcache.check.configs import configs
from refcache.check.coverage import Coverage
from refcache.check.machines import FAULT_KINDS, LOAD_KINDS, machine
from refcache.check.situations import SituationTracker
from refcache.config import HiCacheConfig, WritePolicy
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    Evict,
    EvictHost,
    FaultKind,
    FinishRequest,
    IOQueue,
    Op,
    PrefetchFromStorage,
    StartRequest,
    StorageFault,
)
from refcache.model import HiCacheModel


def reached(ops: Sequence[Op], config: HiCacheConfig) -> list[set[str]]:
    """The situations each operation reached, on the model."""
    model = HiCacheModel(config)
    tracker = SituationTracker(config)
    before = model.snapshot()
    out: list[set[str]] = []
    for op in ops:
        outcome = model.apply(op)
        after = model.snapshot()
        out.append(set(tracker.observe(op, outcome, before, after)))
        before = after
    return out


def run(rid: int, tokens: tuple[int, ...]) -> list[Op]:
    return [StartRequest(rid, tokens), FinishRequest(rid)]


def backups_done() -> list[Op]:
    return [CompleteIO(IOQueue.BACKUP, 0, 64), CheckHicacheEvents()]


# Device 8 tokens, host 17; R (3 tokens) goes to the host with its L3 backup finished, F (8) with its backup
# pending (pinned), D (7) fills the device; R runs again: its load back evicts D, whose write-back needs 7
# host slots with 6 free and nothing but R's pages to take.
WRITE_BACK = HiCacheConfig(
    page_size=1,
    device_size=8,
    hicache_ratio=2.0,
    hicache_write_policy=WritePolicy.WRITE_BACK,
    hicache_storage_backend="file",
    load_back_threshold=1,
).resolve()
R, F, D = (1, 2, 3), tuple(range(10, 18)), tuple(range(20, 27))


def test_a_load_back_whose_write_back_finds_the_host_full_but_for_the_pages_loaded() -> None:
    ops = [
        *run(0, R),
        Evict(10_000),
        *backups_done(),
        *run(1, F),
        Evict(10_000),
        *run(2, D),
        StartRequest(3, R),
    ]
    seen = reached(ops, WRITE_BACK)
    assert "load-back-write-back-short-of-host" in seen[-1]
    assert "write-back-drops-for-host" in seen[-1]  # the pages loaded stay pinned: D is dropped
    assert not any("load-back-write-back-short-of-host" in s for s in seen[:-1])


def test_an_unpinned_host_node_off_the_loaded_path_is_room() -> None:
    # F's backup finished: evict_host may take F, and D's write-back finds room without R's pages.
    ops = [*run(0, R), Evict(10_000), *backups_done(), *run(1, F), Evict(10_000), *backups_done()]
    seen = reached([*ops, *run(2, D), StartRequest(3, R)], WRITE_BACK)
    assert "load-back-write-back-short-of-host" not in seen[-1]
    assert "load-back-evicts-device" in seen[-1]


# A chain of four pages in L3 (write-through), L1 and L2 emptied, a fault on one of its objects, a prefetch of it.
L3 = HiCacheConfig(
    page_size=1,
    device_size=8,
    hicache_storage_backend="file",
    hicache_write_policy=WritePolicy.WRITE_THROUGH,
    prefetch_threshold=1,
).resolve()
A = (1, 2, 3, 4)


def damaged_then_read(kind: FaultKind, read: bool = True) -> list[set[str]]:
    ops: list[Op] = [*run(0, A), CompleteIO(IOQueue.WRITE, 0, 64), CheckHicacheEvents(), *backups_done()]
    ops += [Evict(10_000), EvictHost(10_000), StorageFault(kind, 0, 1), PrefetchFromStorage(1, A)]
    ops += [CompleteIO(IOQueue.PREFETCH_QUERY, 0, 64)]
    if read:
        ops += [CompleteIO(IOQueue.PREFETCH_IO, 0, 64)]
    return reached([*ops, CheckPrefetchProgress(1)], L3)


def test_a_read_that_meets_a_flipped_payload() -> None:
    seen = damaged_then_read(FaultKind.FLIP_PAYLOAD)
    assert seen[-2] == {"flipped-payload-read"}  # the CompleteIO of the reads
    assert sum("flipped-payload-read" in s for s in seen) == 1


def test_a_zeroed_checksum_or_an_unread_flip_is_not_one() -> None:
    assert not any("flipped-payload-read" in s for s in damaged_then_read(FaultKind.CORRUPT))
    assert not any("flipped-payload-read" in s for s in damaged_then_read(FaultKind.FLIP_PAYLOAD, read=False))


def _ledger(kind: str, faults: bool, constraints: dict[str, object]) -> Coverage:
    """A short run of the model machine drawing ``kind`` only, under ``constraints``."""
    ledger = Coverage()
    probe = machine(
        faults=faults, coverage=ledger, name="MarginsProbe", configs=configs(constraints=constraints)
    )
    probe.kinds = {kind: 1}
    run_state_machine_as_test(  # type: ignore[no-untyped-call, unused-ignore]
        probe, settings=budget.Budget(6, 3).settings(derandomize=True, shrink=False)
    )
    return ledger


def test_the_draws_reach_their_situations() -> None:
    """Each new kind reaches its situation within a few examples where its configuration allows it; the
    default machines draw them (the clean ones the load back, the faulty ones the damaged read)."""
    assert "load_back_short_of_host" in LOAD_KINDS and "damaged_read" in FAULT_KINDS
    assert "load_back_short_of_host" in machine().kinds and "damaged_read" in machine(faults=True).kinds
    squeezed = _ledger(
        "load_back_short_of_host",
        False,
        {"hicache_write_policy": WritePolicy.WRITE_BACK, "hicache_storage_backend": "file"},
    )
    assert squeezed.situations["load-back-write-back-short-of-host"] >= 3
    flipped = _ledger("damaged_read", True, {"hicache_storage_backend": "file"})
    assert flipped.situations["flipped-payload-read"] + flipped.situations["misplaced-object-read"] >= 3
