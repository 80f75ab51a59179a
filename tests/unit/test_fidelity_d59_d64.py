"""D-59..D-64: the limits of SGLang's prefetch admission before 0.5.16 (refcache's pipeline, D-01 off: host
memory for the whole key at admission), read in the wheels of 0.5.10 to 0.5.15.

* D-59 ``prefetch_admission_falls_back`` (0.5.11..0.5.15, ``hiradix_cache.py`` 0.5.15:1609
  ``prefetch_from_storage``): when ``evict_host`` cannot free the whole key, the prefetch takes the page-aligned
  part of what the host pool has left, if it reaches the threshold; the seed (and 0.5.10) refuses.
* D-60 ``prefetch_cap_half_host`` (0.5.15, ``cache_controller.py`` 0.5.15:467): admission stops once the
  in-flight prefetch tokens reach ``int(0.5 * host_size)``; the seed's (and up to 0.5.14) ``int(0.8 * (L2 - L1))``.
* D-61 ``prefetch_timeout_capped`` (0.5.12..0.5.15, ``hiradix_cache.py`` 0.5.15:1432): the ``timeout`` policy's
  budget is ``min(max, base + per_ki_token * tokens / 1024)`` with ``max`` 30 s, in floats; the seed's (and
  0.5.10/0.5.11's) ``base + pages * per_page`` has no cap.
* D-62 ``prefetch_takes_root_priority`` (0.5.6..0.5.15): pages a prefetch inserts below the root take the root's
  priority, ``-sys.maxsize`` (``radix_cache.py`` 0.5.15:333, ``_insert_helper_host`` 0.5.15:1644).
* D-64 ``prefetch_timeout_in_floats`` (up to 0.5.11): the seed's timeout compared on the clock's seconds in floats.
* D-63 ``terminated_prefetch_reads_batch`` (up to 0.5.18, ``cache_controller.py`` 0.5.15/0.5.18 ``_page_transfer``):
  the I/O thread still reads the next batch of an operation terminated before it, so the read consumes a read fault.

Each case runs under 0.5.15's profile and fails with its option flipped."""

from __future__ import annotations

from collections.abc import Sequence

from refcache.config import FIDELITY_OPTIONS, PROFILES, HiCacheConfig, IOBackend, PrefetchPolicy, WritePolicy
from refcache.hicache.ops import (
    AdvanceClock,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    Evict,
    EvictHost,
    FaultKind,
    FinishRequest,
    IOQueue,
    MatchPrefix,
    Observation,
    Op,
    PrefetchFromStorage,
    PrefetchResult,
    ProgressResult,
    StartRequest,
    StorageFault,
)
from refcache.hicache.snapshot import Snapshot
from refcache.model import HiCacheModel

Y = tuple(range(11, 19))  # 8 tokens, host only: the anchor (host-protected by the prefetch)
HOST_ONLY_Y: Sequence[Op] = (
    StartRequest(1, Y),
    FinishRequest(1),
    CompleteIO(IOQueue.WRITE, 0, 8),
    CheckHicacheEvents(),
    Evict(1000),  # Y is host only: 8 of the 11 host tokens, 3 free
)


def _config(
    policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT,
    *,
    threshold: int = 2,
    base: float = 1.0,
    **options: bool,
) -> HiCacheConfig:
    """0.5.15's profile with ``options``: device 8, host 11 (page size 1), threshold 2, a 1 s timeout base."""
    return HiCacheConfig(
        device_size=8,
        hicache_ratio=1.25,
        page_size=1,
        hicache_io_backend=IOBackend.DIRECT,
        load_back_threshold=1,
        hicache_write_policy=WritePolicy.WRITE_THROUGH,
        hicache_storage_backend="file",
        hicache_storage_prefetch_policy=policy,
        prefetch_threshold=threshold,
        prefetch_timeout_base=base,
    ).with_fidelity({**PROFILES["sglang-0.5.15"], **options})


def _run(config: HiCacheConfig, ops: Sequence[Op]) -> tuple[list[Observation], Snapshot]:
    with HiCacheModel(config) as model:
        return [model.apply(op) for op in ops], model.snapshot()


def test_the_options_follow_their_release_ranges() -> None:
    assert [FIDELITY_OPTIONS[f"D-{n}"] for n in range(59, 65)] == [
        "prefetch_admission_falls_back",
        "prefetch_cap_half_host",
        "prefetch_timeout_capped",
        "prefetch_takes_root_priority",
        "terminated_prefetch_reads_batch",
        "prefetch_timeout_in_floats",
    ]
    on = {
        "prefetch_admission_falls_back": ("0.5.11", "0.5.12", "0.5.15"),
        "prefetch_cap_half_host": ("0.5.15",),
        "prefetch_timeout_capped": ("0.5.12", "0.5.15"),
        "prefetch_takes_root_priority": ("0.5.10", "0.5.11", "0.5.12", "0.5.15"),
        "terminated_prefetch_reads_batch": ("0.5.5", "0.5.10", "0.5.11", "0.5.12", "0.5.15", "0.5.16"),
        "prefetch_timeout_in_floats": ("0.5.5", "0.5.10", "0.5.11"),
    }
    for option, versions in on.items():
        for version in ("0.5.5", "0.5.10", "0.5.11", "0.5.12", "0.5.15", "0.5.16", "0.5.20", "0.5.23"):
            assert PROFILES[f"sglang-{version}"][option] == (version in versions), (option, version)
        assert not PROFILES["refcache"][option]


def test_d59_admission_falls_back_to_what_the_host_pool_has_left() -> None:
    """The 4-token tail below Y needs 4 host slots; 3 are free and Y (the anchor) cannot be evicted: 0.5.15
    prefetches the first 3 tokens, the seed refuses."""
    ops: list[Op] = [*HOST_ONLY_Y, PrefetchFromStorage(2, (*Y, 21, 22, 23, 24))]
    fell_back, snap = _run(_config(), ops)
    refused, snap_seed = _run(_config(prefetch_admission_falls_back=False), ops)
    assert fell_back[-1] == PrefetchResult(True, "admitted", 4)
    assert [(p.rid, p.tokens) for p in snap.ranks[0].ongoing_prefetch] == [(2, 3)]
    assert snap.ranks[0].prefetch_tokens_occupied == 3
    assert refused[-1] == PrefetchResult(False, "no_host_memory", 4)
    assert not snap_seed.ranks[0].ongoing_prefetch


def test_d59_the_fallback_still_needs_the_threshold() -> None:
    """With a threshold of 4 the 3 free slots are too few: refused either way."""
    ops: list[Op] = [*HOST_ONLY_Y, PrefetchFromStorage(2, (*Y, 21, 22, 23, 24))]
    for option in (True, False):
        observed, _ = _run(_config(threshold=4, prefetch_admission_falls_back=option), ops)
        assert observed[-1] == PrefetchResult(False, "no_host_memory", 4)


def test_d60_the_cap_is_half_the_host_pool() -> None:
    """Host 11, device 8: 0.5.15 caps in-flight prefetch tokens at int(0.5 * 11) = 5, the seed at
    int(0.8 * (11 - 8)) = 2; a second 4-token prefetch after a first one goes on only under 0.5.15's."""
    ops: list[Op] = [PrefetchFromStorage(1, (1, 2, 3, 4)), PrefetchFromStorage(2, (5, 6, 7, 8))]
    half, _ = _run(_config(), ops)
    seed, _ = _run(_config(prefetch_cap_half_host=False), ops)
    assert half == [PrefetchResult(True, "admitted", 4)] * 2
    assert seed == [PrefetchResult(True, "admitted", 4), PrefetchResult(False, "rate_limited", 4)]


def test_d61_the_timeout_is_capped_at_30_seconds() -> None:
    """A 40 s base: 0.5.15 stops the prefetch after 30 s (``min(max, ...)``), the seed only after 40 s."""
    ops: list[Op] = [PrefetchFromStorage(1, (1, 2, 3, 4)), AdvanceClock(31_000_000), CheckPrefetchProgress(1)]
    policy = PrefetchPolicy.TIMEOUT
    capped, _ = _run(_config(policy, base=40.0), ops)
    seed, _ = _run(_config(policy, base=40.0, prefetch_timeout_capped=False), ops)
    assert capped[-1] == ProgressResult(done=True, inserted=0)
    assert seed[-1] == ProgressResult(done=False, inserted=0)


def test_d62_pages_below_the_root_take_its_priority() -> None:
    a = (1, 2, 3, 4)
    ops: list[Op] = [*_to_l3(a), PrefetchFromStorage(2, a), *_read_and_insert(2)]
    _, snap = _run(_config(), ops)
    _, snap_seed = _run(_config(prefetch_takes_root_priority=False), ops)
    assert [n.priority for n in snap.ranks[0].nodes] == [-(2**63 - 1)]
    assert [n.priority for n in snap_seed.ranks[0].nodes] == [0]


def test_d63_a_terminated_prefetch_still_reads_a_batch_and_takes_the_read_fault() -> None:
    """A read fault armed, then a prefetch terminated before its read (best_effort, at once): 0.5.15's I/O thread
    reads its batch anyway, which takes the fault, so the next prefetch reads all 4 pages; the seed's reads
    nothing for it, and the next prefetch's read fails."""
    a = (1, 2, 3, 4)
    ops: list[Op] = [
        *_to_l3(a),
        StorageFault(FaultKind.FAIL_NEXT_READ, 0, 0),
        PrefetchFromStorage(2, a),
        CheckPrefetchProgress(2),  # terminated before its query: nothing read, nothing inserted
        CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1),
        CompleteIO(IOQueue.PREFETCH_IO, 0, 1),
        CheckHicacheEvents(),
        PrefetchFromStorage(3, a),
        *_read_and_insert(3),
        MatchPrefix(a),
    ]
    observed, _ = _run(_config(), ops)
    seed, _ = _run(_config(terminated_prefetch_reads_batch=False), ops)
    assert observed[-2] == ProgressResult(done=True, inserted=4)
    assert seed[-2] == ProgressResult(done=True, inserted=0)


def test_d64_the_seed_timeout_in_floats_rounds_past_its_boundary() -> None:
    """A 1 ms base, nothing queried, exactly 1 ms later: up to 0.5.11 SGLang compares ``0.052 - 0.051`` (just above
    0.001 in floats) and stops the prefetch; D-26's integers do not (1000 us is not past 1000 us)."""
    ops: list[Op] = [
        AdvanceClock(51_000),
        PrefetchFromStorage(1, (1, 2, 3, 4)),
        AdvanceClock(1_000),
        CheckPrefetchProgress(1),
    ]
    policy = PrefetchPolicy.TIMEOUT
    floats, _ = _run(
        _config(policy, base=0.001, prefetch_timeout_capped=False, prefetch_timeout_in_floats=True), ops
    )
    exact, _ = _run(_config(policy, base=0.001, prefetch_timeout_capped=False), ops)
    assert floats[-1] == ProgressResult(done=True, inserted=0)
    assert exact[-1] == ProgressResult(done=False, inserted=0)


def _to_l3(tokens: tuple[int, ...]) -> list[Op]:
    """A request's pages written through, backed up to L3, then dropped from L1 and L2."""
    return [
        StartRequest(1, tokens),
        FinishRequest(1),
        CompleteIO(IOQueue.WRITE, 0, 8),
        CheckHicacheEvents(),
        CompleteIO(IOQueue.BACKUP, 0, 8),
        CheckHicacheEvents(),
        Evict(1000),
        EvictHost(1000),
    ]


def _read_and_insert(rid: int) -> list[Op]:
    return [
        CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1),
        CompleteIO(IOQueue.PREFETCH_IO, 0, 1),
        CheckHicacheEvents(),
        CheckPrefetchProgress(rid),
    ]
