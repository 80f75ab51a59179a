"""L3 on UnifiedRadixCache (system ``sglang-unified``): the release's own ``HybridCacheController`` storage threads
(``prefetch_thread_func``, ``prefetch_io_aux_func``, ``prefetch_sync_thread_func``, Hybrid's ``backup_thread_func``)
stepped by ``CompleteIO`` through the gate that drives HiRadixCache's (``_storage``), ``HiCacheFile`` writing real
files, against the model under the ``sglang-X.Y.Z-unified`` profile: the directed traces of ``test_l3.py``, each
step's observations, whole snapshots and every invariant compared (``Harness``).

Three decisions came out of them and of fuzzing (specs/decisions.md): D-51 (a prefetch below the root takes the
priority the inserts left there), D-52 (a prefetch's unread slots are released by the next drain) and D-53 (a split
write-through is backed up to L3 per fragment); each is checked here both ways, as is D-55 (0.5.23's ``timeout``
policy runs from the first blocked progress check) and D-57 (from 0.5.22 a split of a prefetch's anchor pins the new
prefix with it). Releases whose Unified L3 is not driven (``Release.l3_on``) must refuse it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import pytest

from refcache.check.harness import Divergence, Harness, Outcome
from refcache.config import PROFILES, AttentionKind, HiCacheConfig, IOBackend, PrefetchPolicy, WritePolicy
from refcache.engines.sglang import versions
from refcache.errors import UnsupportedError
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import (
    AbortPrefetch,
    AdvanceClock,
    CacheUnfinishedRequest,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    EventsResult,
    Evict,
    EvictHost,
    EvictHostResult,
    FaultKind,
    FinishRequest,
    IOQueue,
    IOResult,
    MatchPrefix,
    MatchResult,
    Op,
    PrefetchFromStorage,
    PrefetchResult,
    ProgressResult,
    Reset,
    StartRequest,
    StorageFault,
)
from refcache.model import HiCacheModel

SYSTEM: Final = "sglang-unified"
RELEASE: Final = versions.installed().row
DRIVEN: Final = SYSTEM in RELEASE.systems
L3: Final = DRIVEN and RELEASE.l3_on(SYSTEM)
needs_l3 = pytest.mark.skipif(not L3, reason=f"{SYSTEM} does not drive SGLang {RELEASE.version}'s L3")
A: Final = tuple(range(1, 9))


def config(page_size: int = 1, **options: Any) -> HiCacheConfig:
    """test_l3's configuration (write_through, HiCacheFile, every hit worth a prefetch) under the installed
    release's Unified profile."""
    base: dict[str, Any] = {
        "page_size": page_size,
        "device_size": 16,
        "hicache_io_backend": IOBackend.DIRECT,
        "load_back_threshold": 1,
        "hicache_write_policy": WritePolicy.WRITE_THROUGH,
        "hicache_storage_backend": "file",
        "prefetch_threshold": 1,
    }
    return HiCacheConfig(**{**base, **options}).with_fidelity(PROFILES[versions.installed_unified_profile()])


def to_l3(tokens: Sequence[int], rid: int = 1) -> list[Op]:
    """A request cached, written through to L2, backed up to L3, then dropped from L1 and L2."""
    return [
        StartRequest(rid, tuple(tokens)),
        FinishRequest(rid),
        CompleteIO(IOQueue.WRITE, 0, 8),
        CheckHicacheEvents(),  # the write-through ack starts the backup (_finish_write_through_ack)
        CompleteIO(IOQueue.BACKUP, 0, 8),
        CheckHicacheEvents(),  # the backup ack
        Evict(1000),
        EvictHost(1000),
    ]


def prefetch(tokens: Sequence[int], rid: int = 2, before_io: Sequence[Op] = ()) -> list[Op]:
    """``_prefetch_kvcache``, then the scheduler's order: the hit query, the drain that allocates host memory,
    the batch read, the drain of its acks, ``check_prefetch_progress``, a match."""
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


def harness_run(cfg: HiCacheConfig, ops: Sequence[Op]) -> list[Outcome]:
    """``ops`` on the model and SGLang's UnifiedRadixCache through the harness: observations and whole snapshots
    (L3 keys, in-flight backups and prefetches, host slots a prefetch holds) compared, every invariant checked,
    after each step."""
    from refcache.engines.sglang._unified import UnifiedSGLangSystem

    with HiCacheModel(cfg) as model, UnifiedSGLangSystem(cfg) as sglang:
        harness = Harness(cfg, {"model": model, SYSTEM: sglang}, write_trace=False, family=HICACHE)
        return [harness.step(op) for op in ops]


@needs_l3
@pytest.mark.parametrize(("page_size", "attention"), [(1, AttentionKind.MHA), (4, AttentionKind.MLA)])
def test_backup_to_l3_and_prefetch_back(page_size: int, attention: AttentionKind) -> None:
    tokens = tuple(range(1, 1 + 2 * page_size))
    obs = harness_run(config(page_size, attention=attention), [*to_l3(tokens), *prefetch(tokens), Reset()])
    assert obs[4] == IOResult(1)  # the backup thread ran one operation
    assert obs[5] == EventsResult(0, 0, 0, 1, 0)  # and its ack was drained
    assert obs[8] == PrefetchResult(True, "admitted", len(tokens))
    assert obs[-3] == ProgressResult(done=True, inserted=len(tokens))
    assert obs[-2] == MatchResult(0, len(tokens), len(tokens), len(tokens))


@needs_l3
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
def test_under_the_unified_profile_the_model_follows_the_pipeline(extra: list[Op]) -> None:
    """test_l3's traces with 4 pages per batch: a read fault, a deleted object, an abort and an early progress
    check before the reads."""
    ops = [*to_l3(A), *prefetch(A, before_io=extra)]
    ops.insert(-2, CompleteIO(IOQueue.PREFETCH_IO, 0, 4))
    ops.insert(-2, CheckHicacheEvents())
    harness_run(config(1, storage_batch_size=4), [*ops, CheckHicacheEvents(), Reset()])


@needs_l3
def test_without_d51_the_harness_sees_the_root_priority() -> None:
    """D-51 off: the prefetched node's priority differs (-sys.maxsize in the model, 0 in SGLang, whose root the
    first insert raised), so the agreement above is not vacuous."""
    cfg = config(1).with_fidelity({"root_priority_from_inserts": False})
    with pytest.raises(Divergence, match="priority"):
        harness_run(cfg, [*to_l3(A[:2]), *prefetch(A[:2])])


@needs_l3
def test_without_d52_the_harness_sees_the_queued_tail() -> None:
    """D-52 off: an aborted prefetch's unread slots are freed at its final ack in the model, queued for the next
    drain in SGLang."""
    cfg = config(1, storage_batch_size=4).with_fidelity({"release_unread_prefetch_tail": False})
    ops = [*to_l3(A), *prefetch(A, before_io=[AbortPrefetch(2)]), CheckHicacheEvents()]
    with pytest.raises(Divergence, match="host"):
        harness_run(cfg, ops)


SPLIT: Final[Sequence[Op]] = (
    StartRequest(2, (1200, 1201, 1202)),
    FinishRequest(2),
    StartRequest(3, (1200, 1201)),  # splits the node under its pending write-through
    CompleteIO(IOQueue.WRITE, 0, 64),
    CheckHicacheEvents(),  # the ack: one L3 backup per fragment (D-53), each pinning its node
    CompleteIO(IOQueue.BACKUP, 0, 8),
    CheckHicacheEvents(),
)
"""The shrunk trace of ``refcache fuzz --against model,sglang-unified --profile sglang-0.5.20-unified
--hicache-storage-backend file --hicache-write-policy write_through`` (seed 1, example 4: 14 -> 5 operations),
with the backups run and acked."""


@needs_l3
def test_a_split_write_through_is_backed_up_per_fragment() -> None:
    obs = harness_run(config(1, device_size=8, hicache_ratio=1.5), [*SPLIT, FinishRequest(3), Reset()])
    assert obs[5] == IOResult(2) and obs[6] == EventsResult(0, 0, 0, 2, 0)


@needs_l3
def test_without_d53_the_harness_sees_one_backup_per_fragment() -> None:
    cfg = config(1, device_size=8, hicache_ratio=1.5).with_fidelity({"backup_per_fragment": False})
    with pytest.raises(Divergence, match="ongoing_backup"):
        harness_run(cfg, SPLIT)


@needs_l3
def test_a_leaf_pinned_by_its_l3_backup_stays_a_host_leaf_in_the_snapshot() -> None:
    """The shrunk trace of the same fuzzing (seed 1, example 6: 226 -> 6 operations): request 22's node is
    written through, its L3 backup pins it, request 24's admission evicts its device copy. UnifiedRadixCache keeps
    a host-locked node out of ``evictable_host_leaves`` (``_is_host_leaf``), refcache (as HiRadixCache) keeps it in
    the set and skips it at ``evict_host``: the snapshot reports refcache's set (``_unified._pinned_host_leaf``);
    then the backup's ack unpins it and ``EvictHost`` takes it on both."""
    ops: list[Op] = [
        StartRequest(21, tuple(range(3100, 3108))),
        StartRequest(22, (2400, 2401)),
        FinishRequest(22),
        CompleteIO(IOQueue.WRITE, 0, 64),
        CheckHicacheEvents(),  # the L3 backup starts: the node is host-locked
        StartRequest(24, tuple(range(3400, 3406))),  # evicts its device copy: host-only, still pinned
        EvictHost(100),  # skipped while pinned
        CompleteIO(IOQueue.BACKUP, 0, 8),
        CheckHicacheEvents(),
        EvictHost(100),
    ]
    obs = harness_run(config(2, device_size=10, storage_batch_size=1), ops)
    assert obs[6] == EvictHostResult(0) and obs[-1] == EvictHostResult(2)


D13: Final[Sequence[Op]] = (
    StartRequest(46, (7, 8)),
    CacheUnfinishedRequest(46),  # (7, 8) cached, its write-through not even started: device-only
    PrefetchFromStorage(48, (7, 5, 4, 3, 1, 3)),  # the match splits it; the best match (7) is device-only
)
"""The shrunk trace of the same fuzzing (seed 1, example 40, with storage faults: 625 -> 3 operations)."""


@needs_l3
def test_a_prefetch_below_a_device_only_best_match_is_refused() -> None:
    """UnifiedRadixCache's ``last_host_node`` is the best match (D-46), which ``_prefetch_kvcache``'s
    ``is_backuped`` test refuses when it is device-only: the seed's test, D-13 off in the Unified profiles (on
    HiRadixCache's ``last_host_node`` is always backed up, so 0.5.20's ``sglang`` profile turns D-13 on)."""
    # write_back: (7, 8) stays device-only on every release (from 0.5.22 a checkpoint counts a hit, D-35, and
    # write_through would back it up at once)
    cfg = config(
        1, device_size=7, hicache_ratio=1.5, prefetch_threshold=2, hicache_write_policy=WritePolicy.WRITE_BACK
    )
    assert harness_run(cfg, D13)[-1] == PrefetchResult(False, "last_node_not_backuped", 5)
    with pytest.raises(Divergence, match="last_node_not_backuped"):
        harness_run(cfg.with_fidelity({"prefetch_below_last_host_node": True}), D13)


@needs_l3
def test_u2_s_trace_diverges_up_to_0_5_21_and_replays_clean_from_0_5_22() -> None:
    """U-2 (specs/sglang-known.json): a split while the L3 backup is pending leaves the prefix unlocked up to 0.5.21;
    0.5.22's segment lock covers it (the snapshot lists the segment's nodes with the backup, D-07 off from 0.5.22)."""
    from refcache.hicache.trace import read_trace

    root = Path(__file__).resolve().parents[3]
    cfg, ops = read_trace(root / "tests/regressions/sglang/known/u2-l3-backup-split-fragment-unlocked.jsonl")
    if versions.parse(RELEASE.version) <= (0, 5, 21):
        with pytest.raises(Divergence, match="host_ref_counter"):
            harness_run(cfg, ops)
    else:
        harness_run(cfg, ops)


@needs_l3
@pytest.mark.parametrize("name", ["u3-l3-key-ignores-namespace", "u3-l3-prefetch-hits-unnamespaced-object"])
def test_u3_s_traces_diverge_on_0_5_19_and_replay_clean_from_0_5_20(name: str) -> None:
    """U-3 (R-1 on UnifiedRadixCache, specs/sglang-known.json): 0.5.19 hashes a namespaced node's pages as the same
    tokens without a namespace, and a namespaced prefetch's hit query finds the unnamespaced objects; 0.5.20 seeds
    the chain with the namespace. Both fuzz-shrunk traces (write_through: the node's hash; write_back: the hit)."""
    from refcache.hicache.trace import read_trace

    root = Path(__file__).resolve().parents[3]
    cfg, ops = read_trace(root / f"tests/regressions/sglang/known/{name}.jsonl")
    if RELEASE.version == "0.5.19":
        with pytest.raises(Divergence, match=r"hash_value|hit_pages"):
            harness_run(cfg, ops)
    else:
        harness_run(cfg, ops)


TIMED_OUT: Final[Sequence[Op]] = (
    *to_l3(A),
    PrefetchFromStorage(2, A),  # its hit query never runs: no hits
    AdvanceClock(1_000_001),  # past the base since the prefetch's start
    CheckPrefetchProgress(2),  # up to 0.5.22 timed out here; 0.5.23's wait starts here
    AdvanceClock(1_001_954),  # past 0.5.23's budget for the 8 pages asked for (1.001953125 s) since then
    CheckPrefetchProgress(2),
    PrefetchFromStorage(2, A),  # 0.5.23: declined while the request's wait is expired
    AbortPrefetch(2),  # ends the wait (or the new prefetch)
    PrefetchFromStorage(2, A),
)


@needs_l3
def test_the_timeout_policy_follows_d55_s_start_both_ways() -> None:
    """D-55: under ``timeout`` 0.5.23 times a prefetch from its first blocked progress check (a ``PollTimer`` read
    through the logical clock), with a budget of the pages it asked for, and declines the request's next prefetch
    once it timed out; up to 0.5.22 it runs from the prefetch's start. The release's profile agrees with the
    engine, the option flipped does not."""
    cfg = config(1, hicache_storage_prefetch_policy=PrefetchPolicy.TIMEOUT, prefetch_timeout_base=1.0)
    obs = harness_run(cfg, [*TIMED_OUT, Reset()])
    follows = cfg.prefetch_timeout_from_first_poll
    assert follows == (versions.parse(RELEASE.version) >= (0, 5, 23))
    assert obs[10] == ProgressResult(not follows, 0) and obs[12] == ProgressResult(True, 0)
    assert obs[13] == PrefetchResult(not follows, "deadline_expired" if follows else "admitted", len(A))
    with pytest.raises(Divergence, match="CheckPrefetchProgress"):
        harness_run(cfg.with_fidelity({"prefetch_timeout_from_first_poll": not follows}), TIMED_OUT)


U2_RECLAIMED: Final = "tests/regressions/sglang/known/u2-l3-backup-split-fragment-reclaimed.jsonl"


@needs_l3
def test_u2_s_data_loss_breaks_backup_source_on_the_engine_alone_up_to_0_5_21() -> None:
    """U-2's data loss (specs/sglang-known.json, ``...-reclaimed``): the split under the pending L3 backup, then
    ``evict_host`` reclaims the unlocked prefix's host copy (a device duplicate, D-48) while the backup has still to
    read its slots. The engine alone, every invariant on its own snapshot: up to 0.5.21 BACKUP-SOURCE at that
    ``EvictHost`` (step 9: slots 0..7 the backup reads are free); 0.5.22's lock segment keeps the prefix's host copy
    and every invariant holds."""
    from refcache.check.shrink import Failure
    from refcache.engines.sglang._unified import UnifiedSGLangSystem
    from refcache.hicache.trace import read_trace

    cfg, ops = read_trace(Path(__file__).resolve().parents[3] / U2_RECLAIMED)

    def engine_alone() -> None:
        with UnifiedSGLangSystem(cfg) as sglang:
            harness = Harness(cfg, {SYSTEM: sglang}, write_trace=False, family=HICACHE)
            for op in ops:
                harness.step(op)

    if versions.parse(RELEASE.version) > (0, 5, 21):
        engine_alone()
        return
    with pytest.raises(Divergence) as caught:
        engine_alone()
    failure = Failure.of(caught.value)
    assert (failure.step, failure.kind) == (9, f"invariant violated on {SYSTEM}")
    prefix = ", ".join(str(t) for t in range(2700, 2708))
    assert failure.detail == (
        f"[BACKUP-SOURCE] rank 0 node -:[{prefix}]: backup 0 reads host slots [0, 1, 2, 3, 4, 5, 6, 7] for this "
        "node's pages, but it has no host copy (those slots are now free)"
    )


@needs_l3
def test_u2_s_data_loss_under_the_release_s_profile_is_the_known_finding_up_to_0_5_21() -> None:
    """The same operations against the model under the installed release's profile: up to 0.5.21 the model follows
    the one-node pin (D-07's option), agrees with the engine at every step and breaks BACKUP-SOURCE with it, which
    ``--known specs/sglang-known.json`` names U-2; from 0.5.22 (the option off) both keep the prefix: clean."""
    from refcache.check.known import load_known, system_releases
    from refcache.hicache.trace import read_trace

    root = Path(__file__).resolve().parents[3]
    cfg, ops = read_trace(root / U2_RECLAIMED)
    cfg = cfg.with_fidelity(PROFILES[versions.installed_unified_profile()])
    if versions.parse(RELEASE.version) > (0, 5, 21):
        harness_run(cfg, ops)
        return
    with pytest.raises(Divergence) as caught:
        harness_run(cfg, ops)
    assert caught.value.step == 9 and caught.value.kind == "invariant violated on model"
    known = load_known([root / "specs/sglang-known.json"])
    found = known.explain(caught.value, system_releases(["model", SYSTEM]))
    assert [f.id for f in found] == ["sglang-U2-l3-backup-split-fragment-unlocked-reclaimed"]


@pytest.mark.skipif(not DRIVEN or L3, reason=f"{SYSTEM} drives this release's L3 (or not the release)")
def test_a_release_whose_unified_l3_is_not_driven_refuses_it() -> None:
    from refcache.engines.sglang._unified import UnifiedSGLangSystem

    with pytest.raises(UnsupportedError, match="L3"):
        UnifiedSGLangSystem(config(1))


D57: Final = "tests/regressions/sglang/decisions/d57-prefetch-anchor-split-pins-prefix.jsonl"


@needs_l3
@pytest.mark.parametrize(
    "end",
    [
        pytest.param([AbortPrefetch(4)], id="abort"),
        pytest.param([CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1), CheckHicacheEvents()], id="revoked"),
    ],
)
def test_a_split_prefetch_anchor_pins_the_new_prefix_from_0_5_22_both_ways(end: list[Op]) -> None:
    """D-57: a request splits a prefetch's anchor (fuzz 0.5.23 ``write_through``, seed 1, shrunk 21 -> 4 operations);
    from 0.5.22 the anchor's host lock is a segment, so the new prefix is pinned with it until the prefetch ends (its
    abort, or its revoke on no hits), up to 0.5.21 the anchor alone. The installed release's profile replays the
    trace and its end clean; the option flipped diverges on the new prefix's ``host_ref_counter``."""
    from refcache.hicache.trace import read_trace

    root = Path(__file__).resolve().parents[3]
    cfg, ops = read_trace(root / D57)
    cfg = cfg.with_fidelity(PROFILES[versions.installed_unified_profile()])
    assert cfg.anchor_pin_follows_split == (versions.parse(RELEASE.version) >= (0, 5, 22))
    harness_run(cfg, [*ops, *end, Reset()])
    flipped = cfg.with_fidelity({"anchor_pin_follows_split": not cfg.anchor_pin_follows_split})
    with pytest.raises(Divergence, match="host_ref_counter"):
        harness_run(flipped, ops)
