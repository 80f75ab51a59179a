"""The recorder (``refcache.engines.sglang.record``) on ``UnifiedRadixCache`` (system ``sglang-unified``, 0.5.19 to
0.5.23; on 0.5.19 and 0.5.20 under ``REFCACHE_SGLANG_SYSTEM=sglang-unified``), one rank, L1 and L2: its trace of an
adapter run is the adapter's (operations, observations, snapshots) and replays clean on the model; it does not
change what SGLang does; ``refcache record --engine sglang-unified`` over a Mooncake trace replays clean; a run of a
deliberately broken eviction diverges, replayed, at the step the model-versus-SGLang harness finds; what it cannot
record (a bare host lock, a release step outside ``release_kv_cache``) raises ``RecordingError``; with L3 its trace
of a directed run is the adapter's too. Two ranks (``_tp``'s workers, a recorder in each, merged): the merged trace
of a run is the adapter's and replays clean."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Final

import pytest

from refcache.check.harness import Divergence, Harness
from refcache.check.recorded import replay_recorded
from refcache.config import PROFILES, AttentionKind, HiCacheConfig, WritePolicy
from refcache.engines.sglang import _compat, versions
from refcache.engines.sglang.record import RecordingError, record
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import (
    AbortRequest,
    AdvanceClock,
    CacheUnfinishedRequest,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    EventsResult,
    Evict,
    EvictHost,
    FinishRequest,
    IOQueue,
    IOResult,
    MatchPrefix,
    Op,
    PrefetchFromStorage,
    ProgressResult,
    StartRequest,
    StartResult,
)
from refcache.hicache.recording import Recording, read_recording
from refcache.systems import open_systems

from .test_l3 import A
from .test_record import HEAD, OPS, W1, _cli, _source, _steps
from .test_record import _run as record_run

SYSTEM: Final = "sglang-unified"
RELEASE: Final = versions.installed().row
pytestmark = pytest.mark.skipif(
    SYSTEM not in RELEASE.systems,
    reason=f"SGLang {RELEASE.version} has no UnifiedRadixCache the adapter drives",
)


def _config(**options: Any) -> HiCacheConfig:
    base: dict[str, Any] = {
        "page_size": 1,
        "device_size": 8,
        "hicache_write_policy": WritePolicy.WRITE_THROUGH,
        "load_back_threshold": 1,
    }
    profile = versions.installed_unified_profile() if SYSTEM in RELEASE.systems else "sglang-0.5.23"
    return HiCacheConfig(**{**base, **options}).with_fidelity(PROFILES[profile])


CONFIG: Final = _config()

U_OPS: Final[list[Op]] = [
    *OPS,  # a load back (request 3), an eviction of each tier, a bare match, the clock
    StartRequest(4, (1, 2, 3, 4, 11, 12), prompt_len=5),
    CacheUnfinishedRequest(4),  # checkpoint_kv_cache (0.5.22 on) / cache_unfinished_req
    W1,
    CheckHicacheEvents(),
    FinishRequest(4),
    StartRequest(5, (20, 21)),
    AbortRequest(5),  # release_kv_cache(checkpoint=False)
    StartRequest(6, tuple(range(30, 42))),  # more than the device holds: not admitted
    CheckHicacheEvents(),
]
"""Every admission path (device hit, load back, refused), every kind of release (finish, abort, checkpoint), each
tier's eviction, a bare match: what the recorder tells apart on Unified."""


def _run(
    ops: list[Op], recorded: Path | None, config: HiCacheConfig = CONFIG
) -> tuple[list[object], list[object]]:
    from refcache.engines.sglang._unified import UnifiedSGLangSystem

    return record_run(ops, recorded, config, UnifiedSGLangSystem)


def test_the_recorder_does_not_change_behaviour_and_records_the_operations(tmp_path: Path) -> None:
    plain = _run(U_OPS, None)
    assert plain[0][10] == StartResult(True, 0, 4, 1), "request 3 loads its prefix back from the host"
    assert plain[0][-2] == StartResult(False, 0, 0, 0), "request 6 does not fit"
    path = tmp_path / "run.jsonl"
    recorded = _run(U_OPS, path)
    assert recorded == plain, "observations and snapshots with the recorder equal those without"
    rec = read_recording(path)
    assert rec.source == _source()
    assert rec.config == CONFIG.resolve().with_fidelity(PROFILES[versions.installed_unified_profile()])
    assert rec.ops == U_OPS, "the recorder's trace is the adapter's trace of the same operations"
    assert rec.observed == plain[0]
    assert rec.snapshots == plain[1]
    assert replay_recorded(rec) == len(U_OPS)


def test_l3_is_recorded_as_the_adapter_runs_it(tmp_path: Path) -> None:
    """L3 (HiCacheFile through the gate): a request backed up to L3 and dropped from L1 and L2, prefetched back
    whole, a prefetch of tokens L3 lacks revoked by the drain, the first request again (its prefix loaded back).
    The operations are the adapter's with each completion's count the one it ran (the recorder sees what ran)."""
    from .test_unified_l3 import config as l3_config
    from .test_unified_l3 import prefetch, to_l3

    if not RELEASE.l3_on(SYSTEM):
        pytest.skip(f"SGLang {RELEASE.version}'s Unified L3 is not driven")
    cfg = l3_config()
    a, d = tuple(range(1, 9)), tuple(range(60, 68))
    asked: list[Op] = [
        *to_l3(a),
        *prefetch(a, rid=2),
        PrefetchFromStorage(3, d),
        CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1),
        CheckHicacheEvents(),  # d is nowhere: revoked
        StartRequest(4, a),
        FinishRequest(4),
        CompleteIO(IOQueue.WRITE, 0, 8),
        CheckHicacheEvents(),
    ]
    first = _run(asked, None, cfg)[0]
    ran: list[Op] = []
    for op, seen in zip(asked, first, strict=True):
        if not isinstance(op, CompleteIO):
            ran.append(op)
        elif isinstance(seen, IOResult) and seen.completed:
            ran.append(dataclasses.replace(op, count=seen.completed))
    plain = _run(ran, None, cfg)
    assert any(isinstance(o, ProgressResult) and o.inserted == len(a) for o in plain[0]), plain[0]
    assert any(isinstance(o, EventsResult) and o.revoked == 1 for o in plain[0]), plain[0]
    path = tmp_path / "l3.jsonl"
    recorded = _run(ran, path, cfg)
    assert recorded == plain, "observations and snapshots with the recorder equal those without"
    rec = read_recording(path)
    assert rec.ops == ran, "the recorder's trace is the adapter's trace of the same operations"
    assert rec.observed == plain[0]
    assert rec.snapshots == plain[1]
    assert replay_recorded(rec) == len(ran)


def test_storage_threads_running_free_are_recorded_in_the_order_they_ran(tmp_path: Path) -> None:
    """As on a live engine: the gate lets Unified's storage threads run untokened, so the recorder writes the steps it
    saw them make (the backup, the hit query, the batch read), after the call that caused them, and the recording
    replays clean."""
    from refcache.engines.sglang._unified import UnifiedSGLangSystem

    from .test_unified_l3 import config as l3_config

    if not RELEASE.l3_on(SYSTEM):
        pytest.skip(f"SGLang {RELEASE.version}'s Unified L3 is not driven")
    a = tuple(range(1, 9))
    ops: list[Op] = [
        StartRequest(1, a),
        FinishRequest(1),
        CompleteIO(IOQueue.WRITE, 0, 1),  # the write acks are the fake device stream's, not a thread's
        CheckHicacheEvents(),  # queues the backup: the backup thread runs it at once
        CheckHicacheEvents(),
        Evict(1000),
        EvictHost(1000),
        PrefetchFromStorage(3, a),  # the hit query runs at once
        CheckHicacheEvents(),  # allocates: the batch is read at once
        CheckHicacheEvents(),
        CheckPrefetchProgress(3),
    ]
    path = tmp_path / "free.jsonl"
    with UnifiedSGLangSystem(l3_config()) as system:
        assert system.gate is not None
        with record(system, path):  # no snapshots: threads running free change the state under the reader
            with system.gate.cond:
                system.gate.tokens = dict.fromkeys(system.gate.tokens, 10**9)
            observed = [system.apply(op) for op in ops]
    assert observed[-1] == ProgressResult(True, len(a))
    rec = read_recording(path)
    assert rec.ops == [
        *ops[:4],
        CompleteIO(IOQueue.BACKUP, 0, 1),
        *ops[4:8],
        CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1),
        ops[8],
        CompleteIO(IOQueue.PREFETCH_IO, 0, 1),
        *ops[9:],
    ]
    assert replay_recorded(rec) == len(rec.ops)


def test_what_the_alphabet_cannot_express_is_refused(tmp_path: Path) -> None:
    """A host lock outside a load back's admission, and (0.5.21 on) a release step outside ``release_kv_cache`` and a
    decode retraction's KV backup, raise before SGLang runs them; the admission the test opened is written as what it was."""
    from refcache.engines.sglang._unified import UnifiedSGLangSystem

    rows = _compat.Compat(versions.installed().rows)
    with UnifiedSGLangSystem(CONFIG) as system, record(system, tmp_path / "run.jsonl"):
        cache = system.cache
        root = cache.root_node if hasattr(cache.root_node, "parent") else cache.tree_core.root_node
        node = getattr(root, "node_id", root) if not rows.has("lock_by_node_id") else cache.root_node
        with pytest.raises(RecordingError, match="inc_host_lock_ref outside a load back"):
            cache.inc_host_lock_ref(node)
        if not rows.has("backups_unbatched"):  # a release_kv_cache of its own steps (0.5.21 on)
            with pytest.raises(RecordingError, match="free_kv_row outside release_kv_cache"):
                cache.free_kv_row(None, [])
        if hasattr(cache, "backup_kv_cache"):  # a decode retraction (0.5.21 on)
            with pytest.raises(RecordingError, match="retraction"):
                cache.backup_kv_cache(None)
    rec = read_recording(tmp_path / "run.jsonl")
    assert rec.ops == []


def test_a_recorded_mooncake_run_replays_clean_on_the_model(tmp_path: Path) -> None:
    out = tmp_path / "run.jsonl"
    run = _cli("record", str(HEAD), "-o", str(out), "--engine", SYSTEM, "--limit", "40")
    assert run.returncode == 0, run.stdout + run.stderr
    rec = read_recording(out)
    assert len(rec.ops) > 100 and rec.source == _source()
    kinds = {type(op).__name__ for op in rec.ops}
    assert {"StartRequest", "FinishRequest", "CompleteIO", "CheckHicacheEvents", "AdvanceClock"} <= kinds
    replay = _cli("replay", str(out), "--against", "model", "--quiet")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "no divergence" in replay.stdout


def test_a_recorded_l3_run_replays_clean_on_the_model(tmp_path: Path) -> None:
    """``refcache record --engine sglang-unified --l3`` over four 40-block documents requested twice in turn (L1 and
    L2 hold about two): in the second round Unified's own storage threads query and read the others from L3 (every
    queue stepped), the requests load them back, and the recording replays clean."""
    if not RELEASE.l3_on(SYSTEM):
        pytest.skip(f"SGLang {RELEASE.version}'s Unified L3 is not driven")
    trace, out = tmp_path / "documents.jsonl", tmp_path / "run.jsonl"
    requests = [
        {"timestamp": i, "input_length": 40 * 512, "output_length": 8, "hash_ids": list(range(d, d + 40))}
        for i, d in enumerate(1000 * (i % 4) for i in range(8))
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in requests))
    options = ("--l1-tokens", "1024", "--hicache-ratio", "1.2", "--l3")
    run = _cli("record", str(trace), "-o", str(out), "--engine", SYSTEM, *options)
    assert run.returncode == 0, run.stdout + run.stderr
    rec = read_recording(out)
    steps = {op.queue for op in rec.ops if isinstance(op, CompleteIO)}
    assert steps == {IOQueue.WRITE, IOQueue.LOAD, IOQueue.BACKUP, IOQueue.PREFETCH_QUERY, IOQueue.PREFETCH_IO}
    inserted = [obs.inserted for obs in rec.observed if isinstance(obs, ProgressResult)]
    assert sum(inserted) > 0, inserted
    assert sum(obs.loaded for obs in rec.observed if isinstance(obs, StartResult)) > 0
    assert replay_recorded(rec) == len(rec.ops)


@pytest.fixture
def broken_eviction(monkeypatch: pytest.MonkeyPatch) -> None:
    """UnifiedRadixCache's eviction never gives the device slots it evicted back (``_drain_device_frees`` does
    nothing): the evicted nodes leave the tree, their slots stay allocated."""
    from refcache.engines.sglang._unified import UnifiedSGLangSystem

    UnifiedSGLangSystem(CONFIG).close()  # SGLang's modules import only behind the adapter's shim
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    monkeypatch.setattr(UnifiedRadixCache, "_drain_device_frees", lambda self, frees: None)


def test_a_broken_eviction_diverges_at_the_step_the_harness_finds(
    tmp_path: Path, broken_eviction: None
) -> None:
    ops: list[Op] = [
        StartRequest(1, (1, 2, 3, 4)),
        FinishRequest(1),
        W1,
        CheckHicacheEvents(),
        StartRequest(2, (5, 6, 7, 8)),
        FinishRequest(2),
        W1,
        CheckHicacheEvents(),
        Evict(4),
        MatchPrefix((1, 2, 3, 4)),
        EvictHost(1),
    ]
    path = tmp_path / "broken.jsonl"
    _run(ops, path)
    rec = read_recording(path)
    assert rec.ops == ops
    with pytest.raises(Divergence) as replayed:
        replay_recorded(rec)
    with open_systems(("model", SYSTEM), rec.config) as systems:
        harness = Harness(rec.config, systems, write_trace=False, family=HICACHE)
        with pytest.raises(Divergence) as differential:
            _steps(harness, rec.ops)
    assert replayed.value.step == differential.value.step == 9, "the Evict: its slots were not freed"
    assert "device" in replayed.value.summary


def _on_both(ops: list[Op]) -> list[Op]:
    """``ops`` with every CompleteIO run on rank 0, then on rank 1 (each rank's acks are its own)."""
    out: list[Op] = []
    for op in ops:
        out += [op, dataclasses.replace(op, rank=1)] if isinstance(op, CompleteIO) else [op]
    return out


TWO_RANK_OPS: Final[list[Op]] = [*_on_both(U_OPS), AdvanceClock(300, rank=1), AdvanceClock(5)]
"""``U_OPS`` on two ranks (each completion on rank 0, then on rank 1), then rank 1's clock alone and both (D-41)."""
needs_two_ranks = pytest.mark.skipif(
    2 not in RELEASE.ranks_on(SYSTEM), reason=f"{SYSTEM} opens SGLang {RELEASE.version} with one rank"
)


def _run_ranks(
    ops: list[Op], recorded: Path | None, config: HiCacheConfig
) -> tuple[list[object], list[object], Recording | None]:
    """``ops`` on two UnifiedRadixCache ranks (``SGLangRanks``, a worker process each), recorded into ``recorded``
    when given: the observations, the joined snapshots and the merged recording."""
    from refcache.engines.sglang._tp import SGLangRanks

    observations: list[object] = []
    snapshots: list[object] = []
    with SGLangRanks(config, system=SYSTEM) as ranks:
        if recorded is None:
            for op in ops:
                observations.append(ranks.apply(op))
                snapshots.append(ranks.snapshot())
            return observations, snapshots, None
        with record(ranks, recorded, snapshots=True) as recorder:
            for op in ops:
                observations.append(ranks.apply(op))
                snapshots.append(ranks.snapshot())
    return observations, snapshots, recorder.recording()


@needs_two_ranks
def test_two_ranks_are_recorded_as_the_adapter_runs_them(tmp_path: Path) -> None:
    """Two ranks (``_tp``'s workers, one recorder each, merged in the order driven): every admission path, every
    kind of release, each tier's eviction and each rank's own completions and clock record the adapter's
    operations, observations and joined snapshots, unchanged by the recorders, and replay clean on the model; with
    one rank's completion credited to the other, the replay diverges at it."""
    cfg = _config(tp_size=2).resolve()
    plain = _run_ranks(TWO_RANK_OPS, None, cfg)
    assert plain[0][_on_both(U_OPS).index(StartRequest(3, (1, 2, 3, 4, 11), prompt_len=3))] == StartResult(
        True, 0, 4, 1
    ), "request 3 loads its prefix back from the host on both ranks"
    path = tmp_path / "tp2.jsonl"
    *recorded, rec = _run_ranks(TWO_RANK_OPS, path, cfg)
    assert recorded == list(plain[:2]), "observations and snapshots with the recorders equal those without"
    assert rec is not None and read_recording(path) == rec
    assert rec.source == _source()
    assert rec.ops == TWO_RANK_OPS, "the merged trace is the adapter's trace of the same operations"
    assert rec.observed == plain[0]
    assert rec.snapshots == plain[1]
    assert all(s is not None and [r.rank for r in s.ranks] == [0, 1] for s in rec.snapshots)
    assert replay_recorded(rec) == len(TWO_RANK_OPS)

    second = TWO_RANK_OPS.index(CompleteIO(IOQueue.WRITE, 1, 1))
    wrong = [*TWO_RANK_OPS]
    wrong[second] = CompleteIO(IOQueue.WRITE, 0, 1)  # rank 0's write, where rank 1's finished
    with pytest.raises(Divergence, match="outcomes differ") as caught:  # rank 0 has no write left
        replay_recorded(dataclasses.replace(rec, ops=wrong))
    assert caught.value.step == second + 1


@pytest.mark.parametrize("attention", [AttentionKind.MHA, AttentionKind.MLA])
def test_two_ranks_with_l3_are_recorded_as_the_adapter_runs_them(
    attention: AttentionKind, tmp_path: Path
) -> None:
    """Two ranks with L3 (``test_two_ranks_l3``'s run on UnifiedRadixCache: a prefetch whose every storage step
    waits in the Hybrid controller's all-reduce for the peer's): the merged trace is the operations driven, each
    storage completion as the steps it ran, with the adapter's observations and joined snapshots, unchanged by the
    recorders (MLA: a rank's backup changes its peer's view of the shared L3 keys), and replays clean on the model;
    with one hit query credited to the other rank, or one batch read dropped, the replay diverges there."""
    from .test_two_ranks_l3 import RECORDED as L3_OPS
    from .test_two_ranks_l3 import _as_recorded, misplaced_steps_diverge
    from .test_unified_l3 import config as l3_config

    if 2 not in RELEASE.l3_ranks_on(SYSTEM):
        pytest.skip(f"{SYSTEM} does not open SGLang {RELEASE.version}'s L3 with two ranks")
    cfg = l3_config(1, storage_batch_size=4, tp_size=2, attention=attention).resolve()
    plain = _run_ranks(L3_OPS, None, cfg)
    assert plain[0][-2] == ProgressResult(True, len(A)), "the prefetch read A back whole on both ranks"
    *recorded, rec = _run_ranks(L3_OPS, tmp_path / "tp2-l3.jsonl", cfg)
    assert recorded == list(plain[:2]), "observations and snapshots with the recorders equal those without"
    assert rec is not None and read_recording(tmp_path / "tp2-l3.jsonl") == rec
    assert rec.ops == _as_recorded(L3_OPS, plain[0])
    ends = [len(_as_recorded(L3_OPS[: k + 1], plain[0][: k + 1])) - 1 for k in range(len(L3_OPS))]
    driven = {end: k for k, end in enumerate(ends) if k == 0 or end != ends[k - 1]}
    for line, k in driven.items():  # each operation's last line: what it returned, and the state after it
        op = L3_OPS[k]
        stepped = isinstance(op, CompleteIO) and op.queue in (
            IOQueue.PREFETCH_QUERY,
            IOQueue.PREFETCH_IO,
            IOQueue.BACKUP,
        )
        assert rec.observed[line] == (IOResult(1) if stepped else plain[0][k]), (line, op)
        # a step that waited in its all-reduce carries no snapshot (its rank's recorder sees it later)
        assert rec.snapshots[line] == plain[1][k] or (stepped and rec.snapshots[line] is None), (line, op)
    assert replay_recorded(rec) == len(rec.ops)

    misplaced_steps_diverge(rec)


def test_refcache_record_runs_two_unified_ranks_with_l3(tmp_path: Path) -> None:
    """``refcache record --engine sglang-unified --l3 --tp-size 2 --snapshots`` over four 40-block documents
    requested twice in turn (``test_two_ranks_l3``'s run of HiRadixCache): both ranks' storage threads query, read
    and back up, the second round's prefetches insert pages, and the merged recording, snapshots and all, replays
    clean on the model."""
    from .test_record import record_documents

    if 2 not in RELEASE.l3_ranks_on(SYSTEM):
        pytest.skip(f"{SYSTEM} does not open SGLang {RELEASE.version}'s L3 with two ranks")
    rec = record_documents(tmp_path, "--engine", SYSTEM, "--tp-size", "2")
    assert rec.source == _source() and rec.config.tp_size == 2
    steps = {(op.queue, op.rank) for op in rec.ops if isinstance(op, CompleteIO)}
    storage = (IOQueue.BACKUP, IOQueue.PREFETCH_QUERY, IOQueue.PREFETCH_IO)
    assert steps >= {(queue, rank) for queue in storage for rank in (0, 1)}, steps
    inserted = [obs.inserted for obs in rec.observed if isinstance(obs, ProgressResult)]
    assert sum(inserted) > 0, inserted
    assert replay_recorded(rec) == len(rec.ops)
