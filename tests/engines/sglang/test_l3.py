"""L3 on the SGLang adapter: SGLang 0.5.20's own ``HiCacheFile`` writing real files, its four storage threads
stepped by ``CompleteIO`` (``refcache.engines.sglang._storage``), and storage faults injected into its reads
and writes.

The model's prefetch pipeline is the seed's (D-01), not 0.5.20's, so these traces compare observations and
L3 keys with the model (not whole snapshots): they are written in the scheduler's order, where both
pipelines answer alike."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from refcache.check.harness import Divergence, Harness, Outcome
from refcache.check.known import load_known, system_releases
from refcache.config import PROFILES, AttentionKind, HiCacheConfig, IOBackend, PrefetchPolicy, WritePolicy
from refcache.engines.sglang import SGLangSystem, versions
from refcache.engines.sglang._storage import EngineThreadError
from refcache.errors import UnsupportedError
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import (
    AbortPrefetch,
    AdvanceClock,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    EventsResult,
    Evict,
    EvictHost,
    FaultKind,
    FinishRequest,
    IOQueue,
    IOResult,
    MatchPrefix,
    MatchResult,
    Observation,
    Op,
    PrefetchFromStorage,
    PrefetchResult,
    ProgressResult,
    Reset,
    ResetResult,
    StartRequest,
    StartResult,
    StorageFault,
)
from refcache.model import HiCacheModel

RELEASE = versions.installed().row
KNOWN = Path(__file__).resolve().parents[3] / "specs" / "sglang-known.json"
KNOWN_FINDINGS = load_known([KNOWN])
R13 = KNOWN_FINDINGS.get("sglang-R13-prefetch-tail-released-twice")
"""Up to 0.5.5 a prefetch's unread tail is released twice (``_page_transfer``, then ``prefetch_io_aux_func``)."""
# These traces drive HiRadixCache (``SGLangSystem``); on a release whose HiRadixCache L3 refcache does not drive
# (0.5.21 on have no HiRadixCache) they would fail at open, which reads like a finding: test_unified_l3.py runs
# them on UnifiedRadixCache.
pytestmark = pytest.mark.skipif(
    not RELEASE.l3_on("sglang"),
    reason=f"the sglang system (HiRadixCache) does not drive SGLang {RELEASE.version}'s L3",
)

A = tuple(range(1, 9))


def config(page_size: int = 1, **options: Any) -> HiCacheConfig:
    base: dict[str, Any] = {
        "page_size": page_size,
        "device_size": 16,
        "hicache_io_backend": IOBackend.DIRECT,
        "load_back_threshold": 1,
        "hicache_write_policy": WritePolicy.WRITE_THROUGH,
        "hicache_storage_backend": "file",
        "prefetch_threshold": 1,
    }
    return HiCacheConfig(**{**base, **options})


def to_l3(tokens: Sequence[int], rid: int = 1) -> list[Op]:
    """A request cached, written through to L2, backed up to L3, then dropped from L1 and L2."""
    return [
        StartRequest(rid, tuple(tokens)),
        FinishRequest(rid),
        CompleteIO(IOQueue.WRITE, 0, 8),
        CheckHicacheEvents(),  # write-through ack -> write_backup_storage
        CompleteIO(IOQueue.BACKUP, 0, 8),
        CheckHicacheEvents(),  # backup ack
        Evict(1000),
        EvictHost(1000),
    ]


def prefetch(tokens: Sequence[int], rid: int = 2, before_io: Sequence[Op] = ()) -> list[Op]:
    """``_prefetch_kvcache``, then the scheduler's order: the hit query, the drain that allocates host
    memory, the batch read, the drain of its acks, ``check_prefetch_progress``."""
    return [
        PrefetchFromStorage(rid, tuple(tokens)),
        CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1),
        CheckHicacheEvents(),
        *before_io,
        CompleteIO(IOQueue.PREFETCH_IO, 0, 1),
        CheckHicacheEvents(),
        CheckPrefetchProgress(rid),
        MatchPrefix(tuple(tokens)),
    ]


def side_by_side(cfg: HiCacheConfig, ops: Sequence[Op], *, unread_tail: bool = False) -> list[Observation]:
    """Apply ``ops`` to the model and SGLang; every observation, and the L3 keys after each step, must be
    equal. Returns the observations. ``unread_tail``: some prefetch reads less than it asked for, so host
    slots it does not fill go back through the release queue in refcache (the seed's pipeline allocates at
    admission, D-01, and queues the unread tail, D-25) where 0.5.20 allocates only the hits and frees the
    tail in the drain of the completion ack; ``host_releases`` is then not compared."""
    out: list[Observation] = []
    with HiCacheModel(cfg) as model, SGLangSystem(cfg) as sglang:
        for op in ops:
            expected, got = model.apply(op), sglang.apply(op)
            if unread_tail and isinstance(expected, EventsResult) and isinstance(got, EventsResult):
                expected = dataclasses.replace(expected, host_releases=got.host_releases)
            assert got == expected, f"on {op!r}: model {expected!r}, sglang {got!r}"
            keys = model.snapshot().ranks[0].l3_keys
            assert sglang.snapshot().ranks[0].l3_keys == keys, f"L3 keys after {op!r}"
            out.append(got)
    return out


@pytest.mark.parametrize(("page_size", "attention"), [(1, AttentionKind.MHA), (4, AttentionKind.MLA)])
def test_backup_writes_files_and_prefetch_brings_them_back(page_size: int, attention: AttentionKind) -> None:
    tokens = tuple(range(1, 1 + 2 * page_size))
    obs = side_by_side(config(page_size, attention=attention), [*to_l3(tokens), *prefetch(tokens)])
    pages = len(tokens) // page_size
    assert obs[4] == IOResult(1)  # the backup thread ran one operation
    assert obs[8] == PrefetchResult(True, "admitted", len(tokens))
    assert obs[-2] == ProgressResult(done=True, inserted=len(tokens))
    assert obs[-1] == MatchResult(0, len(tokens), len(tokens), len(tokens))
    assert pages >= 2


def test_the_bytes_are_in_files_and_a_prefetch_loads_the_right_kv() -> None:
    cfg = config(1)
    with SGLangSystem(cfg) as sglang:
        assert sglang.l3_dir is not None and os.path.isdir(sglang.l3_dir)
        sglang.apply(StartRequest(1, A))
        kv = sglang.cache.kv_cache
        layers = [*kv.k_buffer, *kv.v_buffer]
        row = sglang.requests[1].kv.req_pool_idx
        slots = sglang.req_to_token_pool.req_to_token[row, : len(A)].long()
        for i, layer in enumerate(layers):
            layer[slots] = (torch.arange(layer[slots].numel()).reshape(layer[slots].shape) % 97 + i).to(
                layer.dtype
            )
        expected = [layer[slots].clone() for layer in layers]
        for op in to_l3(A)[1:]:
            sglang.apply(op)
        files = sorted(os.listdir(sglang.l3_dir))
        assert [f[:-4] for f in files] == list(sglang.l3_keys()) and len(files) == len(A)
        page_bytes = sum(layer[0].numel() * layer.element_size() for layer in layers)
        assert all(os.path.getsize(os.path.join(sglang.l3_dir, f)) == page_bytes for f in files)
        sglang.host_pool.kv_buffer.fill_(0)  # nothing left in L2: the bytes must come from the files
        for layer in layers:
            layer.fill_(-1)
        for op in prefetch(A):
            sglang.apply(op)
        assert sglang.apply(StartRequest(3, A)) == StartResult(True, 0, len(A), 0)
        assert sglang.apply(CompleteIO(IOQueue.LOAD, 0, 1)) == IOResult(1)
        loaded = sglang.req_to_token_pool.req_to_token[sglang.requests[3].kv.req_pool_idx, : len(A)].long()
        for layer, want in zip(layers, expected, strict=True):
            assert torch.equal(layer[loaded], want)
    assert not os.path.exists(sglang.l3_dir), "the L3 directory outlives close()"


def test_the_threads_wait_for_complete_io() -> None:
    """Nothing is written, queried or read until the step that says so; each step runs one item."""
    with SGLangSystem(config(1, device_size=32)) as sglang:
        for rid, tokens in ((1, A), (2, tuple(range(50, 58)))):
            sglang.apply(StartRequest(rid, tokens))
            sglang.apply(FinishRequest(rid))
        sglang.apply(CompleteIO(IOQueue.WRITE, 0, 8))
        sglang.apply(CheckHicacheEvents())
        assert sglang.controller.backup_queue.qsize() == 2 and sglang.l3_keys() == ()
        assert sglang.apply(CompleteIO(IOQueue.BACKUP, 0, 1)) == IOResult(1)
        assert len(sglang.l3_keys()) == 8 and sglang.controller.ack_backup_queue.qsize() == 1
        assert sglang.apply(CompleteIO(IOQueue.BACKUP, 0, 5)) == IOResult(1)
        assert sglang.apply(CheckHicacheEvents()) == EventsResult(0, 0, 0, 2, 0)
        sglang.apply(Evict(1000))
        sglang.apply(EvictHost(1000))
        sglang.apply(PrefetchFromStorage(3, A))
        assert sglang.snapshot().ranks[0].ongoing_prefetch[0].stage == "query"
        assert sglang.apply(CompleteIO(IOQueue.PREFETCH_IO, 0, 1)) == IOResult(0)  # nothing to read yet
        assert sglang.apply(CompleteIO(IOQueue.PREFETCH_QUERY, 0, 3)) == IOResult(1)
        sglang.apply(CheckHicacheEvents())
        record = sglang.snapshot().ranks[0].ongoing_prefetch[0]
        assert (record.stage, record.hit_pages, record.completed_tokens) == ("io", 8, 0)


@pytest.mark.parametrize(
    ("fault", "inserted"),
    [
        (StorageFault(FaultKind.FAIL_NEXT_READ, 0, 0), 0),
        (StorageFault(FaultKind.DELETE, 0, 3), None),  # the chain breaks at the deleted page
    ],
)
def test_a_read_fault_is_handled_as_the_model_handles_it(fault: StorageFault, inserted: int | None) -> None:
    cfg = config(1, storage_batch_size=4)
    ops = [*to_l3(A), *prefetch(A, before_io=[fault])]
    ops.insert(-2, CompleteIO(IOQueue.PREFETCH_IO, 0, 4))  # the second batch, if the first was whole
    ops.insert(-2, CheckHicacheEvents())
    obs = side_by_side(cfg, ops, unread_tail=True)
    progress = obs[-2]
    assert isinstance(progress, ProgressResult) and progress.done
    if inserted is not None:
        assert progress.inserted == inserted
    else:  # some page of the 8 is gone: the prefetch stops there
        assert progress.inserted < len(A)


@pytest.mark.parametrize("kind", [FaultKind.FAIL_NEXT_WRITE, FaultKind.DISK_FULL, FaultKind.FAIL_PUBLISH])
def test_a_write_fault_is_handled_as_the_model_handles_it(kind: FaultKind) -> None:
    ops = [*to_l3(A)]
    ops.insert(4, StorageFault(kind, 0, 2))  # before the backup step
    obs = side_by_side(config(1, storage_batch_size=4), [*ops, *prefetch(A)], unread_tail=True)
    progress = obs[-2]
    assert isinstance(progress, ProgressResult) and progress.inserted < len(A)  # the backup was cut short


def test_damage_faults_are_refused_hicachefile_has_no_checksum() -> None:
    with SGLangSystem(config(1)) as sglang:
        for kind in (FaultKind.CORRUPT, FaultKind.FLIP_PAYLOAD, FaultKind.MISPLACED, FaultKind.STALE):
            with pytest.raises(UnsupportedError, match="checksum"):
                sglang.apply(StorageFault(kind, 0, 0))


def test_timeout_policy_reads_the_logical_clock() -> None:
    """Under ``timeout``, a prefetch whose read has not run terminates only once the clock passes 0.5.20's
    limit (base 1 s here, no pages read yet); it then inserts what it read: nothing."""
    cfg = config(1, hicache_storage_prefetch_policy=PrefetchPolicy.TIMEOUT, prefetch_timeout_base=1.0)
    with SGLangSystem(cfg) as sglang:
        for op in to_l3(A):
            sglang.apply(op)
        sglang.apply(PrefetchFromStorage(2, A))
        assert sglang.apply(CheckPrefetchProgress(2)) == ProgressResult(False, 0)
        sglang.apply(AdvanceClock(1_000_000))
        assert sglang.apply(CheckPrefetchProgress(2)) == ProgressResult(False, 0)
        sglang.apply(AdvanceClock(1))
        assert sglang.apply(CheckPrefetchProgress(2)) == ProgressResult(True, 0)


def test_reset_restarts_the_gated_threads() -> None:
    with SGLangSystem(config(1)) as sglang:
        for op in to_l3(A):
            sglang.apply(op)
        sglang.apply(PrefetchFromStorage(2, A))
        assert sglang.apply(Reset()) == ResetResult(False)  # a prefetch in flight (D-16)
        # best_effort stops it at once; no host memory was allocated yet, so it is revoked
        assert sglang.apply(CheckPrefetchProgress(2)) == ProgressResult(True, 0)
        assert sglang.apply(Reset()) == ResetResult(False)  # its hit query is still queued
        assert sglang.apply(CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1)) == IOResult(1)
        sglang.apply(CheckHicacheEvents())  # the drain skips the revoked operation
        if not PROFILE["allocate_prefetch_after_query"]:
            # up to 0.5.15 (D-01 off) the terminated operation kept the host memory of its hits, which the query
            # buffered for the I/O thread: its one step reads nothing and releases them
            assert sglang.apply(Reset()) == ResetResult(False)
            assert sglang.apply(CompleteIO(IOQueue.PREFETCH_IO, 0, 1)) == IOResult(1)
            sglang.apply(CheckHicacheEvents())
        assert sglang.apply(Reset()) == ResetResult(True)
        for op in to_l3(A, rid=5)[:5]:
            sglang.apply(op)
        assert len(sglang.l3_keys()) == len(A)


def test_a_dead_storage_thread_is_an_engine_failure_not_a_hang() -> None:
    with SGLangSystem(config(1)) as sglang:
        for op in to_l3(A)[:4]:
            sglang.apply(op)

        def broken(*args: Any, **kwargs: Any) -> bool:
            raise OSError("disk on fire")

        sglang.controller.page_set_func = broken
        with pytest.raises(EngineThreadError, match=r"backup_thread_func.*disk on fire"):
            sglang.apply(CompleteIO(IOQueue.BACKUP, 0, 1))


def test_only_the_file_backend_is_driven() -> None:
    with pytest.raises(UnsupportedError, match="HiCacheFile"):
        SGLangSystem(config(1, hicache_storage_backend="memory"))


PROFILE = PROFILES[versions.installed_profile()]
"""What the installed release does where refcache decided otherwise (up to 0.5.18 its prefetch pipeline has no
acks, D-54)."""


def harness_run(cfg: HiCacheConfig, ops: Sequence[Op]) -> list[Outcome]:
    """``ops`` on the model and SGLang through the harness: observations and whole snapshots compared, every
    invariant checked, after each step."""
    with HiCacheModel(cfg) as model, SGLangSystem(cfg) as sglang:
        harness = Harness(cfg, {"model": model, "sglang": sglang}, write_trace=False, family=HICACHE)
        return [harness.step(op) for op in ops]


@contextmanager
def stops_on_r13(leaves_a_tail: bool = True) -> Iterator[None]:
    """A block whose read leaves an unread tail (a failed read, a deleted page, an abort, a termination): up to
    0.5.5 the I/O thread queues the tail for release twice (R-13); there the block must stop on that known finding
    and on nothing else, and after 0.5.5 (or without a tail) run through. Also ``test_two_ranks_l3``'s."""
    if not (leaves_a_tail and RELEASE.version in R13.releases):
        yield
        return
    with pytest.raises(Divergence) as stopped:
        yield
    explained = KNOWN_FINDINGS.explain(stopped.value, system_releases(["model", "sglang"]))
    assert explained == (R13,), str(stopped.value)


@pytest.mark.parametrize(
    "extra",
    [
        [],
        [StorageFault(FaultKind.FAIL_NEXT_READ, 0, 0)],
        [StorageFault(FaultKind.DELETE, 0, 5)],
        [AbortPrefetch(2)],
        [CheckPrefetchProgress(2)],
    ],
)
def test_under_the_sglang_profile_the_model_follows_the_pipeline(extra: list[Op]) -> None:
    """The whole read, then a read fault, a deleted page, an abort and a termination before the read: each but the
    first leaves an unread tail, which up to 0.5.5 the I/O thread queues for release twice (R-13): there the trace
    must stop on that known finding and on nothing else."""
    cfg = config(1, storage_batch_size=4).with_fidelity(PROFILE)
    ops = [*to_l3(A), *prefetch(A, before_io=extra)]
    ops.insert(-2, CompleteIO(IOQueue.PREFETCH_IO, 0, 4))
    ops.insert(-2, CheckHicacheEvents())
    with stops_on_r13(leaves_a_tail=bool(extra)):
        harness_run(cfg, [*ops, CheckHicacheEvents(), Reset()])


def test_without_the_pipeline_option_the_harness_sees_the_difference() -> None:
    """The same trace with the model on the other pipeline (D-01 flipped: the seed's from 0.5.16, 0.5.16's up to
    0.5.15): the harness must report it (the host memory a prefetch holds right after admission differs), so the
    agreement above is not vacuous."""
    flipped = {**PROFILE, "allocate_prefetch_after_query": not PROFILE["allocate_prefetch_after_query"]}
    cfg = config(1, storage_batch_size=4).with_fidelity(flipped)
    with pytest.raises(Divergence, match="host"):
        harness_run(cfg, [*to_l3(A), *prefetch(A)])


Y = tuple(range(11, 19))
REVOKE_ORDER: Sequence[Op] = (
    *to_l3(A[:4]),  # 4 tokens in L3 only
    StartRequest(2, Y),
    FinishRequest(2),
    CompleteIO(IOQueue.WRITE, 0, 8),
    CheckHicacheEvents(),
    CompleteIO(IOQueue.BACKUP, 0, 8),
    CheckHicacheEvents(),
    Evict(1000),  # Y host only: 8 of the 11 host tokens
    PrefetchFromStorage(3, A[:4]),  # 4 hits
    PrefetchFromStorage(4, (*Y, 21, 22)),  # anchored at Y: no hit, below the threshold
    CompleteIO(IOQueue.PREFETCH_QUERY, 0, 2),
    CheckHicacheEvents(),  # up to 0.5.17 the miss is revoked first and the hit's evict_host takes Y (D-58)
    CompleteIO(IOQueue.PREFETCH_IO, 0, 4),
    CheckHicacheEvents(),
    CheckPrefetchProgress(3),
)
REVOKE_CONFIG = config(device_size=8, hicache_ratio=1.25, prefetch_threshold=2)


def test_a_miss_and_a_hit_drained_together_follow_the_release() -> None:
    """D-58: a miss queried after a hit; the drain's order of the revoke and the allocation (which evicts the
    miss's anchor only once revoked) is the installed release's, whole snapshots compared."""
    harness_run(REVOKE_CONFIG.with_fidelity(PROFILE), REVOKE_ORDER)


@pytest.mark.skipif(
    not (PROFILE["prefetch_progress_in_operation"] and PROFILE["allocate_prefetch_after_query"]),
    reason="D-58 refines D-54's pipeline (0.5.16 to 0.5.18)",
)
def test_the_other_revoke_order_is_seen() -> None:
    """The same trace with D-58 flipped, so the agreement above is not vacuous: the harness sees the revoke
    queue after the queries (0.5.16, 0.5.17), or the hit's allocation after the drain (0.5.18: 4 pages or 3)."""
    flipped = {**PROFILE, "revoke_at_query": not PROFILE["revoke_at_query"]}
    with pytest.raises(Divergence, match=r"queues: model=.*\('revoke'|hit_pages"):
        harness_run(REVOKE_CONFIG.with_fidelity(flipped), REVOKE_ORDER)


Y_TAIL = (*Y, 21, 22, 23, 24)  # 4 tokens below the host-only Y, which the prefetch host-protects
HOST_ONLY_Y: Sequence[Op] = (
    StartRequest(1, Y),
    FinishRequest(1),
    CompleteIO(IOQueue.WRITE, 0, 8),
    CheckHicacheEvents(),
    CompleteIO(IOQueue.BACKUP, 0, 8),
    CheckHicacheEvents(),
    Evict(1000),  # Y host only: 8 of the 11 host tokens, 3 free
)
ADMISSION_LIMITS: dict[str, tuple[HiCacheConfig, Sequence[Op], str]] = {
    # D-59: the 4 tokens need 4 host slots, 3 are free and Y cannot go: 0.5.15 prefetches 3, the seed refuses
    "prefetch_admission_falls_back": (
        REVOKE_CONFIG,
        (
            *HOST_ONLY_Y,
            PrefetchFromStorage(2, Y_TAIL),
            CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1),
            CheckHicacheEvents(),
        ),
        "PrefetchResult",
    ),
    # D-60: host 11, device 8: a second 4-token prefetch goes on under int(0.5 * 11), not under int(0.8 * 3)
    "prefetch_cap_half_host": (
        REVOKE_CONFIG,
        (PrefetchFromStorage(1, A[:4]), PrefetchFromStorage(2, A[4:])),
        "PrefetchResult",
    ),
    # D-61: a 40 s base; 0.5.15 stops the prefetch after 30 s (min(max, ...)), the seed after 40 s
    "prefetch_timeout_capped": (
        config(1, hicache_storage_prefetch_policy=PrefetchPolicy.TIMEOUT, prefetch_timeout_base=40.0),
        (PrefetchFromStorage(2, A), AdvanceClock(31_000_000), CheckPrefetchProgress(2)),
        "ProgressResult",
    ),
    # D-63: the batch of a prefetch terminated before its read is still read, and takes the armed read fault
    "terminated_prefetch_reads_batch": (
        config(1),
        (
            *to_l3(A),
            StorageFault(FaultKind.FAIL_NEXT_READ, 0, 0),
            PrefetchFromStorage(2, A),
            CheckPrefetchProgress(2),
            CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1),
            CompleteIO(IOQueue.PREFETCH_IO, 0, 1),
            CheckHicacheEvents(),
            *prefetch(A, rid=3),
        ),
        "completed_tokens|ProgressResult",
    ),
    # D-64: the seed's timeout in floats: 0.052 - 0.051 is past a 1 ms base (D-61 supersedes it from 0.5.12)
    "prefetch_timeout_in_floats": (
        config(1, hicache_storage_prefetch_policy=PrefetchPolicy.TIMEOUT, prefetch_timeout_base=0.001),
        (AdvanceClock(51_000), PrefetchFromStorage(2, A), AdvanceClock(1_000), CheckPrefetchProgress(2)),
        "ProgressResult",
    ),
    # D-62: the pages inserted below the root take its priority, -sys.maxsize
    "prefetch_takes_root_priority": (config(1), (*to_l3(A), *prefetch(A)), "priority"),
}


R6 = KNOWN_FINDINGS.get("sglang-R6-prefetch-fallback-keeps-whole-key")


@pytest.mark.skipif(
    PROFILE["allocate_prefetch_after_query"],
    reason="D-59..D-64: host memory allocated at admission (up to 0.5.15)",
)
@pytest.mark.parametrize("option", sorted(ADMISSION_LIMITS))
def test_the_admission_limits_follow_the_release_both_ways(option: str) -> None:
    """D-59..D-64 on the engine (D-63 also holds on 0.5.16..0.5.18, whose I/O code is the same, but their pipeline
    revokes a prefetch terminated before the drain): each trace agrees with the model under the installed release's
    profile, whichever way it sets the option (whole snapshots compared), and diverges with the option flipped."""
    cfg, ops, seen = ADMISSION_LIMITS[option]
    if option == "prefetch_admission_falls_back" and RELEASE.version in R6.releases:
        pytest.skip(f"{R6.id}: {RELEASE.version}'s fallback keeps the whole key (a known finding, not D-59)")
    if option == "terminated_prefetch_reads_batch" and RELEASE.version in R13.releases:
        pytest.skip(f"{R13.id}: {RELEASE.version} releases the terminated read's tail twice at its one batch")
    if option == "prefetch_timeout_in_floats" and PROFILE["prefetch_timeout_capped"]:
        pytest.skip("D-61's timeout supersedes D-64's from 0.5.12")
    harness_run(cfg.with_fidelity(PROFILE), [*ops, CheckHicacheEvents()])
    with pytest.raises(Divergence, match=seen):
        harness_run(cfg.with_fidelity({**PROFILE, option: not PROFILE[option]}), [*ops, CheckHicacheEvents()])
