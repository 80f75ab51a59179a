"""D-57, ``anchor_pin_follows_split`` (SGLang 0.5.22 on): a host lock is a segment, and a split of a locked node
copies its ``host_lock_ref`` to the new prefix and moves the lock's boundary there
(``FullComponent.redistribute_on_node_split``, ``unified_cache/components/full.py`` 0.5.22:151, 0.5.23:154), so a
request that splits a prefetch's anchor leaves the new prefix pinned until the prefetch ends; up to 0.5.21 (and in
refcache) the anchor alone stays pinned. Both ways, on the model: counters, the snapshot's record, the invariants
after every step, and every pin released at the prefetch's end."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from refcache.config import FIDELITY_OPTIONS, PROFILES, HiCacheConfig, IOBackend, WritePolicy
from refcache.errors import UnsupportedError
from refcache.hicache.invariants import check_all
from refcache.hicache.ops import (
    AbortPrefetch,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    Evict,
    EvictHost,
    FinishRequest,
    IOQueue,
    Op,
    PrefetchFromStorage,
    ProgressResult,
    StartRequest,
)
from refcache.hicache.snapshot import NodeId, Snapshot
from refcache.model import HiCacheModel

A = tuple(range(1, 9))
B = tuple(range(20, 24))
TO_L3: Sequence[Op] = (
    StartRequest(1, A + B),
    FinishRequest(1),
    CompleteIO(IOQueue.WRITE, 0, 8),
    CheckHicacheEvents(),  # the write-through ack starts the backup
    CompleteIO(IOQueue.BACKUP, 0, 8),
    CheckHicacheEvents(),
    Evict(1000),
    EvictHost(1000),  # A + B is in L3 only
)
ANCHORED: Sequence[Op] = (
    *TO_L3,
    StartRequest(3, A),
    FinishRequest(3),
    CompleteIO(IOQueue.WRITE, 0, 8),
    CheckHicacheEvents(),  # A on both tiers (its own L3 backup pins it until its ack)
    CompleteIO(IOQueue.BACKUP, 0, 8),
    CheckHicacheEvents(),
    PrefetchFromStorage(2, A + B),  # anchored at A, fetches B
)
SPLIT: Sequence[Op] = (*ANCHORED, StartRequest(6, A[:4]), FinishRequest(6))  # splits A at 4
SPLIT_TWICE: Sequence[Op] = (*SPLIT, StartRequest(7, A[:2]), FinishRequest(7))  # splits A[:4] at 2
FETCHED: Sequence[Op] = (
    CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1),
    CheckHicacheEvents(),  # B's hits allocated
    CompleteIO(IOQueue.PREFETCH_IO, 0, 1),
    CheckHicacheEvents(),
    CheckPrefetchProgress(2),  # B inserted below the anchor; the entry goes
)
PREFIX = NodeId("", A[:4])
ANCHOR = NodeId("", A)


def _config(**options: bool) -> HiCacheConfig:
    """0.5.23's profile (D-57 on) with ``options``."""
    return HiCacheConfig(
        device_size=32,
        page_size=1,
        hicache_io_backend=IOBackend.DIRECT,
        load_back_threshold=1,
        hicache_write_policy=WritePolicy.WRITE_THROUGH,
        hicache_storage_backend="file",
        prefetch_threshold=1,
    ).with_fidelity({**PROFILES["sglang-0.5.23"], **options})


def _snapshots(config: HiCacheConfig, ops: Sequence[Op]) -> list[Snapshot]:
    """The model's snapshot after each of ``ops``, every invariant checked on each."""
    out = []
    with HiCacheModel(config) as model:
        for op in ops:
            model.apply(op)
            snap = model.snapshot()
            assert check_all(snap) == [], (op, check_all(snap))
            out.append(snap)
    return out


def _pins(snap: Snapshot) -> dict[NodeId, int]:
    return {n.id: n.host_ref_counter for n in snap.ranks[0].nodes if n.host_ref_counter}


def test_the_option_is_followed_from_0_5_22() -> None:
    assert FIDELITY_OPTIONS["D-57"] == "anchor_pin_follows_split"
    for profile in ("sglang-0.5.22", "sglang-0.5.23"):
        assert PROFILES[profile]["anchor_pin_follows_split"], profile
    for profile in (
        "sglang-0.5.21",
        "sglang-0.5.20-unified",
        "sglang-0.5.19-unified",
        "sglang-0.5.20",
        "refcache",
    ):
        assert not PROFILES[profile]["anchor_pin_follows_split"], profile


def test_a_split_of_the_anchor_pins_the_new_prefix_with_it() -> None:
    followed = _snapshots(_config(), SPLIT)[-1]
    assert _pins(followed) == {PREFIX: 1, ANCHOR: 1}
    (record,) = followed.ranks[0].ongoing_prefetch
    assert record.anchor == ANCHOR and record.split_off == (PREFIX,)
    refcache = _snapshots(_config(anchor_pin_follows_split=False), SPLIT)[-1]
    assert _pins(refcache) == {ANCHOR: 1}
    assert refcache.ranks[0].ongoing_prefetch[0].split_off == ()


def test_a_second_split_pins_every_prefix_root_side_first() -> None:
    snap = _snapshots(_config(), SPLIT_TWICE)[-1]
    first = NodeId("", A[:2])
    assert _pins(snap) == {first: 1, PREFIX: 1, ANCHOR: 1}
    assert snap.ranks[0].ongoing_prefetch[0].split_off == (first, PREFIX)


@pytest.mark.parametrize(
    "end",
    [pytest.param(FETCHED, id="inserted"), pytest.param((AbortPrefetch(2),), id="aborted")],
)
@pytest.mark.parametrize("follows", [True, False])
def test_the_prefetch_s_end_releases_every_pin(end: Sequence[Op], follows: bool) -> None:
    snaps = _snapshots(_config(anchor_pin_follows_split=follows), [*SPLIT_TWICE, *end])
    assert _pins(snaps[-1]) == {} and snaps[-1].ranks[0].ongoing_prefetch == ()


def test_the_fetched_pages_land_below_the_anchor_both_ways() -> None:
    ops = [*SPLIT, *FETCHED]
    with HiCacheModel(_config()) as on, HiCacheModel(_config(anchor_pin_follows_split=False)) as off:
        obs_on = [on.apply(op) for op in ops]
        obs_off = [off.apply(op) for op in ops]
        assert obs_on == obs_off and obs_on[-1] == ProgressResult(True, len(B))
        assert on.snapshot().ranks[0].nodes == off.snapshot().ranks[0].nodes


def test_in_flight_counts_the_split_off_prefixes_as_holders() -> None:
    """The mutation: a record that forgets the prefixes split off its anchor breaks IN-FLIGHT's holder count."""
    snap = _snapshots(_config(), SPLIT)[-1]
    rank = snap.ranks[0]
    forgot = dataclasses.replace(
        snap,
        ranks=(
            dataclasses.replace(
                rank,
                ongoing_prefetch=tuple(dataclasses.replace(p, split_off=()) for p in rank.ongoing_prefetch),
            ),
        ),
    )
    assert [(v.invariant, v.node) for v in check_all(forgot)] == [("IN-FLIGHT", PREFIX)]


def test_the_implementation_refuses_it_with_l3() -> None:
    from refcache.gpu.driver import HiCacheImpl

    cfg = HiCacheConfig(hicache_storage_backend="file").with_fidelity({"anchor_pin_follows_split": True})
    with pytest.raises(UnsupportedError, match="D-57"):
        HiCacheImpl(cfg)
