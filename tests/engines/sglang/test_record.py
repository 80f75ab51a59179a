"""The recorder (``refcache.engines.sglang.record``) and ``refcache record``: a recorded clean run replays
clean on the model; the recorder does not change SGLang's behaviour; its trace of a run is the trace of the
operations that drove it; a run of a patched SGLang diverges, on replay against the model, at the step the
differential harness finds."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from refcache.check.harness import Divergence, Harness, HiCacheHarness
from refcache.check.recorded import replay_recorded
from refcache.config import PROFILES, HiCacheConfig, WritePolicy
from refcache.engines.sglang import SGLangSystem, _compat, versions
from refcache.engines.sglang.record import SOURCE, Recorder, RecordingError, record
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
    FinishRequest,
    IOQueue,
    MatchPrefix,
    Op,
    PrefetchFromStorage,
    PrefetchResult,
    ProgressResult,
    Reset,
    ResetResult,
    StartRequest,
    StartResult,
)
from refcache.hicache.recording import Recording, read_recording
from refcache.systems import open_systems

from .sglang_zoo import SGLANG_ZOO

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(
    _compat.Compat(versions.installed().rows).has("init_load_back_positional"),
    reason="the recorder refuses SGLang up to 0.5.9 (positional scheduler calls; test_record_releases.py)",
)
ADMISSION_ERA = pytest.mark.skipif(
    _compat.Compat(versions.installed().rows).has("prefetch_allocated_at_admission"),
    reason="recording L3 up to 0.5.15 (host memory allocated at admission) is not done: the recorder refuses it",
)
HEAD = ROOT / "tests" / "data" / "mooncake_conversation_head300.jsonl"
CONFIG = HiCacheConfig(
    page_size=1, device_size=8, hicache_write_policy=WritePolicy.WRITE_THROUGH
).with_fidelity(PROFILES["sglang-0.5.20"])

W1 = CompleteIO(IOQueue.WRITE, 0, 1)
OPS: list[Op] = [
    StartRequest(1, (1, 2, 3, 4)),
    FinishRequest(1),
    W1,
    CheckHicacheEvents(),
    StartRequest(2, (5, 6, 7, 8, 9, 10)),
    FinishRequest(2),
    Evict(4),
    CheckHicacheEvents(),
    W1,
    CheckHicacheEvents(),
    StartRequest(3, (1, 2, 3, 4, 11), prompt_len=3),
    FinishRequest(3),
    MatchPrefix((5, 6)),
    EvictHost(3),
    AdvanceClock(7),
    CheckHicacheEvents(),
]
"""Every completion completes exactly its count and every admission is admitted: the operations the
recorder can tell apart (it sees a completion, not a request to complete nothing)."""


def _run(
    ops: list[Op],
    recorded: Path | None,
    config: HiCacheConfig = CONFIG,
    adapter: type[SGLangSystem] = SGLangSystem,
) -> tuple[list[object], list[object]]:
    """``ops`` on ``adapter``, each observation and snapshot kept; recorded to ``recorded`` when given (also
    ``test_record_unified``'s, with the UnifiedRadixCache adapter)."""
    observations: list[object] = []
    snapshots: list[object] = []
    with adapter(config) as system:
        if recorded is None:
            for op in ops:
                observations.append(system.apply(op))
                snapshots.append(system.snapshot())
        else:
            with record(system, recorded, snapshots=True):
                for op in ops:
                    observations.append(system.apply(op))
                    snapshots.append(system.snapshot())
    return observations, snapshots


def _source() -> dict[str, str]:
    """The source a recording of the installed SGLang names: its exact version, and its placement where
    another release's row drives it (a post release, a source checkout)."""
    placed = versions.installed()
    out = {**SOURCE, "version": versions.installed_version()}
    return out if placed.kind == "release" and placed.source is None else {**out, "placed": str(placed)}


def test_the_recorder_does_not_change_behaviour_and_records_the_operations(tmp_path: Path) -> None:
    plain = _run(OPS, None)
    path = tmp_path / "run.jsonl"
    recorded = _run(OPS, path)
    assert recorded == plain, "observations and snapshots with the recorder equal those without"
    rec = read_recording(path)
    assert rec.source == _source()
    assert rec.config == CONFIG.resolve().with_fidelity(PROFILES[versions.installed_profile()])
    assert rec.ops == OPS, "the recorder's trace is the adapter's trace of the same operations"
    assert rec.observed == plain[0]
    assert rec.snapshots == plain[1]
    assert replay_recorded(rec) == len(OPS)


def test_the_recorders_snapshots_share_what_they_have_in_common() -> None:
    """The recorder passes each snapshot it reads through a ``SnapshotInterner``: a node or pool record
    unchanged from one line's snapshot to the next is one object (60 requests of the real trace: 1.64 GB
    recorded with snapshots before, 0.66 GB after, 0.58 GB without snapshots)."""
    with SGLangSystem(CONFIG) as system, record(system, snapshots=True) as recorder:
        for op in OPS:
            system.apply(op)
        assert isinstance(recorder, Recorder)
        rec = recorder.recording()
    snaps = [s for s in rec.snapshots if s is not None]
    same = [
        (x, y)
        for a, b in itertools.pairwise(snaps)
        for x, y in [
            *zip(a.ranks[0].nodes, b.ranks[0].nodes, strict=False),
            (a.ranks[0].host, b.ranks[0].host),
        ]
        if x == y
    ]
    assert same and all(x is y for x, y in same)


L3_CONFIG = HiCacheConfig(
    page_size=1,
    device_size=24,
    hicache_write_policy=WritePolicy.WRITE_THROUGH,
    hicache_storage_backend="file",
    prefetch_threshold=1,
    storage_batch_size=4,
    load_back_threshold=1,
).with_fidelity(PROFILES["sglang-0.5.20"])
A, C, D = tuple(range(1, 9)), tuple(range(40, 48)), tuple(range(60, 68))


def _io(queue: IOQueue, count: int = 1) -> CompleteIO:
    return CompleteIO(queue, 0, count)


L3_OPS: list[Op] = [
    # A and C written through to L2, backed up to L3, dropped from L1 and L2
    StartRequest(1, A),
    FinishRequest(1),
    StartRequest(2, C),
    FinishRequest(2),
    _io(IOQueue.WRITE, 2),
    CheckHicacheEvents(),  # the write-through acks queue two backups
    _io(IOQueue.BACKUP, 2),
    CheckHicacheEvents(),
    Evict(1000),
    EvictHost(1000),
    # A prefetched whole: the hit query, the drain that allocates, two batch reads, their acks
    PrefetchFromStorage(3, A),
    _io(IOQueue.PREFETCH_QUERY),
    CheckHicacheEvents(),
    _io(IOQueue.PREFETCH_IO),
    CheckHicacheEvents(),
    _io(IOQueue.PREFETCH_IO),
    CheckHicacheEvents(),
    CheckPrefetchProgress(3),
    MatchPrefix(A),
    PrefetchFromStorage(4, A),  # all of it on the host now: refused, below the threshold
    # D is nowhere: its prefetch is revoked by the drain after the query
    PrefetchFromStorage(5, D),
    _io(IOQueue.PREFETCH_QUERY),
    CheckHicacheEvents(),
    # C: aborted after one batch was read, so its read slots go back through the release queue
    PrefetchFromStorage(6, C),
    _io(IOQueue.PREFETCH_QUERY),
    CheckHicacheEvents(),
    _io(IOQueue.PREFETCH_IO),
    CheckHicacheEvents(),
    AbortPrefetch(6),
    CheckHicacheEvents(),
    _io(IOQueue.PREFETCH_IO),
    CheckHicacheEvents(),
    Reset(),
]
"""L3 under write_through, one rank: every storage queue stepped, each step a lone background operation
between two scheduler calls, every completion of exactly the items runnable (the recorder sees the steps
that ran, not the steps asked for), and no ``StorageFault`` (a live engine is not injected faults)."""


@ADMISSION_ERA
def test_the_recorder_records_l3_as_the_adapter_runs_it(tmp_path: Path) -> None:
    plain = _run(L3_OPS, None, L3_CONFIG)
    observed = dict(zip(map(repr, L3_OPS), plain[0], strict=False))
    assert observed[repr(PrefetchFromStorage(4, A))] == PrefetchResult(False, "below_threshold", 0)
    assert plain[0][17] == ProgressResult(True, len(A))
    assert plain[0][22] == EventsResult(0, 0, 1, 0, 0), "D's prefetch is revoked"
    assert plain[0][29] == EventsResult(0, 0, 0, 0, 4), "C's four read slots released"
    assert plain[0][-1] == ResetResult(True)
    path = tmp_path / "l3.jsonl"
    recorded = _run(L3_OPS, path, L3_CONFIG)
    assert recorded == plain, "observations and snapshots with the recorder equal those without"
    rec = read_recording(path)
    assert rec.ops == L3_OPS, "the recorder's trace is the adapter's trace of the same operations"
    assert rec.observed == plain[0]
    assert rec.snapshots[:-1] == plain[1][:-1] and rec.snapshots[-1] is None  # Reset: none (record.py)
    assert replay_recorded(rec) == len(L3_OPS)


@ADMISSION_ERA
def test_storage_threads_running_free_are_recorded_in_the_order_they_ran(tmp_path: Path) -> None:
    """The storage threads are not stepped by CompleteIO here: the gate lets them run (as on a live
    engine), so the recorder writes the steps it saw them make, after the call that caused them."""
    ops: list[Op] = [
        StartRequest(1, A),
        FinishRequest(1),
        _io(IOQueue.WRITE),  # the write acks are the fake device stream's, not a thread's
        CheckHicacheEvents(),  # queues the backup: the backup thread runs it at once
        CheckHicacheEvents(),
        Evict(1000),
        EvictHost(1000),
        PrefetchFromStorage(3, A),  # the hit query runs at once
        CheckHicacheEvents(),  # allocates: both batches are read at once
        CheckHicacheEvents(),
        CheckPrefetchProgress(3),
    ]
    path = tmp_path / "free.jsonl"
    with SGLangSystem(L3_CONFIG) as system:
        assert system.gate is not None
        with record(system, path):  # no snapshots: threads running free change the state under the reader
            with system.gate.cond:
                system.gate.tokens = dict.fromkeys(system.gate.tokens, 10**9)
            observed = [system.apply(op) for op in ops]
    assert observed[-1] == ProgressResult(True, len(A))
    rec = read_recording(path)
    assert rec.ops == [
        *ops[:4],
        _io(IOQueue.BACKUP),
        *ops[4:8],
        _io(IOQueue.PREFETCH_QUERY),
        ops[8],
        _io(IOQueue.PREFETCH_IO, 2),
        *ops[9:],
    ]
    assert replay_recorded(rec) == len(rec.ops)


@ADMISSION_ERA
def test_a_step_the_call_took_is_written_before_the_call(tmp_path: Path) -> None:
    """On a live engine a storage step can land during a call, before its drain counts the queue: the drain
    takes its result, so the recording has the step before the call (else the model, replaying, would
    drain nothing there). Here the backup thread is let run inside ``check_hicache_events``, just before
    ``_sync_hicache_ready_counts`` reads the queue sizes."""
    path = tmp_path / "late.jsonl"
    with SGLangSystem(L3_CONFIG) as system:
        gate, cache = system.gate, system.cache
        assert gate is not None
        with record(system, path):
            for op in (StartRequest(1, A), FinishRequest(1), _io(IOQueue.WRITE), CheckHicacheEvents()):
                system.apply(op)
            assert system.controller.backup_queue.qsize() == 1
            counts = cache._sync_hicache_ready_counts

            def late() -> object:
                gate.grant(IOQueue.BACKUP)
                system._settle()
                assert gate.spent(IOQueue.BACKUP)
                return counts()

            cache._sync_hicache_ready_counts = late
            # (The adapter's own observation, a queue length delta, misses the backup that came and went
            # within the call; the recorder counts what the drain took.)
            system.apply(CheckHicacheEvents())
            del cache._sync_hicache_ready_counts
    rec = read_recording(path)
    assert rec.ops[-2:] == [_io(IOQueue.BACKUP), CheckHicacheEvents()]
    assert rec.observed[-1] == EventsResult(0, 0, 0, 1, 0)
    assert replay_recorded(rec) == len(rec.ops)


@ADMISSION_ERA
def test_a_prefetch_without_its_match_is_refused(tmp_path: Path) -> None:
    """``PrefetchFromStorage`` is the match and the prefetch: a bare ``prefetch_from_storage`` raises
    before SGLang runs it (nothing is admitted). The request is named as the installed release names it (a
    ``CacheRequestHandle``; up to 0.5.19 the id string)."""
    with SGLangSystem(L3_CONFIG) as system, record(system, tmp_path / "run.jsonl"):
        cache = system.cache
        with pytest.raises(RecordingError, match="without the match_prefix"):
            cache.prefetch_from_storage(system._handle(7), cache.root_node, list(A))
        assert not cache.ongoing_prefetch


def test_an_admission_step_the_table_lacks_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """The admission stages are ``refcache.engines.admission.TRANSITIONS``: a lock with no admission open, or
    an unlock of another node than the request's, raises before SGLang runs it, naming the events legal from
    the stage the recorder is in, which stays as it was (the request's own unlock still refuses it)."""
    path = tmp_path / "run.jsonl"
    with SGLangSystem(CONFIG) as system, record(system, path):
        cache = system.cache
        locks = cache.root_node.lock_ref
        with pytest.raises(
            RecordingError,
            match=r"^inc_lock_ref outside an admission .*from 'none' the legal events are \['match', 'ready', 'end'\]$",
        ):
            cache.inc_lock_ref(cache.root_node)
        assert cache.root_node.lock_ref == locks
        node = system._match_result((1, 2, 3, 4), None).last_device_node
        cache.inc_lock_ref(node)  # the request's lock: stage locked
        with pytest.raises(
            RecordingError,
            match=r"^dec_lock_ref outside an admission: .*from 'locked' the legal events are "
            r"\['refuse', 'evict', 'ready', 'end'\]$",
        ):
            cache.dec_lock_ref(None)
        cache.dec_lock_ref(node)  # still locked, so this is the request's refusal
    rec = read_recording(path)
    assert rec.ops == [StartRequest(2_000_000, (1, 2, 3, 4))]
    assert rec.observed == [StartResult(False, 0, 0, 0)]


def test_the_schedulers_pin_without_a_host_hit_is_the_admission(tmp_path: Path) -> None:
    """0.5.20's scheduler pins the match's last device node around every admission (``_lock_node``,
    ``schedule_policy.py`` 0.5.20:1190-1203, 1377), host hit or not, then locks the request's node: the lock, its
    release and the lock again are one admitted ``StartRequest`` (the recorder raised ``no admission step from
    'refused' on 'lock'`` at the second lock before; the adapter locks once where there is no host hit)."""
    path = tmp_path / "run.jsonl"
    with SGLangSystem(CONFIG) as system, record(system, path):
        system.apply(StartRequest(1, (1, 2, 3, 4)))
        system.apply(FinishRequest(1))
        cache = system.cache
        node = system._match_result((1, 2, 3, 4, 5), None).last_device_node  # a device hit, no host hit
        pin = cache.inc_lock_ref(node)
        if hasattr(pin, "to_dec_params"):
            cache.dec_lock_ref(node, pin.to_dec_params())
        else:
            cache.dec_lock_ref(node)
        cache.inc_lock_ref(node)
    rec = read_recording(path)
    assert rec.ops[-1] == StartRequest(3_000_000 + 2, (1, 2, 3, 4, 5))  # admitted, its request never named
    assert rec.observed[-1] == StartResult(True, 4, 0, 1)


def test_a_recorded_mooncake_run_replays_clean_on_the_model(tmp_path: Path) -> None:
    out = tmp_path / "run.jsonl"
    run = _cli("record", str(HEAD), "-o", str(out), "--limit", "40")
    assert run.returncode == 0, run.stdout + run.stderr
    rec = read_recording(out)
    assert len(rec.ops) > 100 and rec.source == _source()
    kinds = {type(op).__name__ for op in rec.ops}
    assert {"StartRequest", "FinishRequest", "CompleteIO", "CheckHicacheEvents", "AdvanceClock"} <= kinds
    replay = _cli("replay", str(out), "--against", "model", "--quiet")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "no divergence" in replay.stdout


def record_documents(tmp_path: Path, *options: str) -> Recording:
    """``refcache record --l3 --snapshots`` (and ``options``) over a Mooncake-format trace of four 40-block
    documents requested twice in turn, with L1 and L2 small enough that the second round reads from L3."""
    from typer.testing import CliRunner

    from refcache.cli import app

    trace, out = tmp_path / "documents.jsonl", tmp_path / "run.jsonl"
    requests = [
        {"timestamp": i, "input_length": 40 * 512, "output_length": 8, "hash_ids": list(range(d, d + 40))}
        for i, d in enumerate(1000 * (i % 4) for i in range(8))
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in requests))
    args = ["record", str(trace), "-o", str(out), "--l1-tokens", "1024", "--hicache-ratio", "1.2", "--l3"]
    run = CliRunner().invoke(app, [*args, "--snapshots", *options])
    assert run.exit_code == 0, run.output
    return read_recording(out)


@ADMISSION_ERA
def test_a_recorded_l3_run_replays_clean_on_the_model(tmp_path: Path) -> None:
    """``refcache record --l3`` over a Mooncake-format trace of four 40-block documents requested twice in
    turn: L1 and L2 hold about two, so in the second round SGLang's own storage threads query and read the
    others from L3 (every storage queue is stepped) into host memory, and the requests load them back: the
    simulator's loop drains the acks before each progress check, as the scheduler does, so 0.5.20 counts
    the pages read. The recording, snapshots and all, replays clean."""
    rec = record_documents(tmp_path)
    steps = {op.queue for op in rec.ops if isinstance(op, CompleteIO)}
    assert steps == {IOQueue.WRITE, IOQueue.LOAD, IOQueue.BACKUP, IOQueue.PREFETCH_QUERY, IOQueue.PREFETCH_IO}
    inserted = [obs.inserted for obs in rec.observed if isinstance(obs, ProgressResult)]
    assert sum(inserted) > 0, inserted
    assert replay_recorded(rec) == len(rec.ops)


@pytest.fixture
def patched() -> Iterator[None]:
    bug = SGLANG_ZOO["evict-host-never-counts"]
    SGLangSystem(CONFIG).close()  # SGLang's modules import only behind the adapter's shim
    with bug.applied():
        yield


def test_a_patched_run_diverges_at_the_step_the_harness_finds(tmp_path: Path, patched: None) -> None:
    ops: list[Op] = [
        StartRequest(1, (1, 2, 3, 4)),
        FinishRequest(1),
        W1,
        CheckHicacheEvents(),
        StartRequest(2, (5, 6, 7, 8)),
        FinishRequest(2),
        W1,
        CheckHicacheEvents(),
        Evict(8),
        EvictHost(1),
        CheckHicacheEvents(),
    ]
    path = tmp_path / "patched.jsonl"
    _run(ops, path)
    rec = read_recording(path)
    with pytest.raises(Divergence) as replayed:
        replay_recorded(rec)
    with open_systems(("model", "sglang"), rec.config) as systems:
        harness = Harness(rec.config, systems, write_trace=False, family=HICACHE)
        with pytest.raises(Divergence) as differential:
            _steps(harness, rec.ops)
    assert replayed.value.step == differential.value.step == 10
    assert replayed.value.kind == "outcomes differ"
    assert "EvictHostResult(num_evicted=1)" not in replayed.value.summary.split("\n")[-1]


def _steps(harness: HiCacheHarness, ops: list[Op]) -> None:
    for op in ops:
        harness.step(op)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "refcache.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
        cwd=ROOT,
    )


@pytest.mark.skipif(not ADMISSION_ERA.args[0], reason="the recorder records L3 on this release")
def test_recording_l3_up_to_0_5_15_is_refused(tmp_path: Path) -> None:
    with (
        SGLangSystem(L3_CONFIG) as sglang,
        pytest.raises(UnsupportedError, match="allocated at admission"),
        record(sglang, tmp_path / "l3.jsonl"),
    ):
        pass
