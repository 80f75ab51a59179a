"""Two SGLang ranks, one worker process each, in a real gloo group (``refcache.engines.sglang._tp``): acks
that one rank finished are retired only when SGLang's MIN all-reduce says every rank has, the snapshot
shows both ranks, and a rank that dies or hangs ends as a ``RankError`` with no process left behind. The system
under test is the installed release's (``REFCACHE_SGLANG_SYSTEM=sglang-unified`` on 0.5.20: UnifiedRadixCache's
ranks); either cache class is recorded (``RECORDED``: a recorder in each worker, merged)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from refcache.check.harness import Divergence, Harness, HiCacheHarness
from refcache.check.recorded import replay_recorded
from refcache.config import PROFILES, HiCacheConfig, IOBackend, WritePolicy
from refcache.engines.sglang import RankError, SGLangRanks, _compat, versions
from refcache.engines.sglang._tp import live_workers, merge_ranks, rank_system
from refcache.engines.sglang.record import RecordingError, record
from refcache.errors import UsageError
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import (
    AdvanceClock,
    CheckHicacheEvents,
    CompleteIO,
    EventsResult,
    Evict,
    EvictResult,
    FinishRequest,
    IOQueue,
    IOResult,
    MatchPrefix,
    Observation,
    Op,
    StartRequest,
    StartResult,
)
from refcache.hicache.recording import NeverReturned, Recording, read_recording
from refcache.hicache.snapshot import InFlight, NodeId, Snapshot
from refcache.model import HiCacheModel
from refcache.systems import SYSTEMS, OpenSystems

from .sglang_machines import SGLANG

pytestmark = pytest.mark.skipif(
    2 not in versions.installed().row.ranks_on(SGLANG),
    reason=f"{SGLANG} opens this release with one rank (test_differential checks the refusal)",
)
open_system = SYSTEMS[SGLANG].load(SGLANG)
"""The registry's factory of the system under test (two ranks: ``SGLangRanks`` of that system)."""
RECORDED = rank_system(SGLANG).RECORDED
"""Whether ``record`` reads the system's cache on two ranks (HiRadixCache's and UnifiedRadixCache's)."""
needs_recorder = pytest.mark.skipif(not RECORDED, reason=f"{SGLANG} has no recorder")

TOKENS = (1, 2, 3, 4)
NODE = NodeId("", TOKENS)
LOADS_APART = _compat.Compat(versions.installed().rows).has("loads_retired_per_rank")
"""Up to 0.5.12 each rank retires its own finished loads (D-68): the model follows it under the option."""
_FOLLOWED = SYSTEMS[SGLANG].followed()
OLD_DECISIONS = (
    {
        option: PROFILES[_FOLLOWED][option]
        for option in ("loads_retired_per_rank", "host_pool_rounded_down", "tail_freed_before_insert")
    }
    if _FOLLOWED is not None
    else {}
)
"""The installed release's options of the decisions that only releases before 0.5.13 follow (D-68; D-56's host
pool of whole pages up to 0.5.5; D-65's free order up to 0.5.3), which these tests' steps reach there."""


def config(**options: Any) -> HiCacheConfig:
    base: dict[str, Any] = {
        "page_size": 1,
        "device_size": 8,
        "hicache_io_backend": IOBackend.DIRECT,
        "hicache_ratio": 2.0,
        "hicache_write_policy": WritePolicy.WRITE_THROUGH,
        "hicache_storage_backend": None,
        "load_back_threshold": 1,
        "tp_size": 2,
        **OLD_DECISIONS,
    }
    return HiCacheConfig(**{**base, **options}).resolve()


def queues(harness: HiCacheHarness, rank: int) -> dict[str, int]:
    return dict(harness.snapshots["sglang"].ranks[rank].queues)


def test_an_ack_one_rank_finished_waits_for_the_other() -> None:
    """Write-through, eviction and a load back, each rank's copies finished separately: the model's MIN
    reduction and SGLang's real all-reduce agree step by step (the harness compares observations and both
    ranks' snapshots after every operation, and checks every invariant on both)."""
    cfg = config()
    sglang = open_system(cfg)
    assert isinstance(sglang, SGLangRanks)
    with OpenSystems[Op, Observation, Snapshot]({"model": HiCacheModel(cfg), "sglang": sglang}) as systems:
        harness = Harness(cfg, systems, family=HICACHE)
        harness.step(StartRequest(1, TOKENS))
        harness.step(FinishRequest(1))  # hit_count 1 = write_through_threshold: the write starts
        assert harness.step(CompleteIO(IOQueue.WRITE, 0, 4)) == IOResult(1)
        assert queues(harness, 0)["write_pending"] == 0 and queues(harness, 1)["write_pending"] == 1
        assert harness.step(CheckHicacheEvents()) == EventsResult(0, 0, 0, 0, 0)  # MIN(1, 0)
        assert harness.step(CompleteIO(IOQueue.WRITE, 1, 4)) == IOResult(1)
        assert harness.step(CheckHicacheEvents()) == EventsResult(1, 0, 0, 0, 0)
        assert harness.step(Evict(8)) == EvictResult(4)

        assert harness.step(StartRequest(2, (*TOKENS, 5))) == StartResult(True, 0, 4, 1)
        assert harness.step(CompleteIO(IOQueue.LOAD, 1, 1)) == IOResult(1)
        if LOADS_APART:  # D-68: rank 1 retires the load its stream finished, rank 0 has not loaded
            assert harness.step(CheckHicacheEvents()) == EventsResult(0, 0, 0, 0, 0, loads_by_rank=(0, 1))
        else:
            assert harness.step(CheckHicacheEvents()) == EventsResult(0, 0, 0, 0, 0)  # rank 0 has not loaded
        snap = harness.snapshots["sglang"]
        assert [r.rank for r in snap.ranks] == [0, 1] and snap.tp_size == 2
        # the load is in flight on both ranks until both have finished it (D-68: until each has)
        for rank in snap.ranks[: 1 if LOADS_APART else 2]:
            assert rank.ongoing_load_back == (NODE,)
            node = rank.node(NODE)
            assert node is not None and InFlight.LOAD_BACK in node.in_flight
        if LOADS_APART:
            assert snap.ranks[1].ongoing_load_back == ()
            with pytest.raises(UsageError, match="D-68"):  # SGLang's forward pass would wait for rank 0
                sglang.apply(FinishRequest(2))
        assert queues(harness, 0)["load_pending"] == 1 and queues(harness, 1)["load_pending"] == 0
        assert harness.step(CompleteIO(IOQueue.LOAD, 0, 1)) == IOResult(1)
        if LOADS_APART:
            assert harness.step(CheckHicacheEvents()) == EventsResult(0, 0, 0, 0, 0, loads_by_rank=(1, 0))
        else:
            assert harness.step(CheckHicacheEvents()) == EventsResult(0, 1, 0, 0, 0)
        assert all(r.ongoing_load_back == () for r in harness.snapshots["sglang"].ranks)
        harness.step(FinishRequest(2))
        harness.step(MatchPrefix((*TOKENS, 5)))


def test_a_model_that_reduces_acks_with_max_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison is not vacuous: a model that retires an ack once any rank finished it (MAX instead of
    MIN) diverges from SGLang's all-reduce at the first check after one rank's copy."""
    import refcache.model._cache as model_cache

    monkeypatch.setattr(model_cache, "reduce_min", max)
    cfg = config()
    with OpenSystems[Op, Observation, Snapshot](
        {"model": HiCacheModel(cfg), "sglang": open_system(cfg)}
    ) as systems:
        harness = Harness(cfg, systems, family=HICACHE)
        harness.step(StartRequest(1, TOKENS))
        harness.step(FinishRequest(1))
        harness.step(CompleteIO(IOQueue.WRITE, 0, 4))
        with pytest.raises(Divergence, match="outcomes differ"):
            harness.step(CheckHicacheEvents())


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_system_opened_while_another_holds_the_workers_gets_a_second_pooled_set() -> None:
    """Replays that explain or shrink a two-rank divergence open systems while the fuzzed one is open: they take
    a second pooled set of workers (``_tp.POOLED_SETS``), kept for the next such replay, instead of starting two
    worker processes each (the two-rank differential on 0.5.5, five examples at one seed: over 480 s before,
    24 s after). A third system at once gets private workers, ended when it closes."""
    cfg = config()
    first = SGLangRanks(cfg, system=SGLANG)
    second = SGLangRanks(cfg, system=SGLANG)
    third = SGLangRanks(cfg, system=SGLANG)
    pooled, private = {*first.pids, *second.pids}, third.pids
    for system in (first, second, third):
        system.close()
    assert len(pooled) == 4 and pooled <= set(live_workers())
    assert all(_gone(pid) for pid in private)
    again = [SGLangRanks(cfg, system=SGLANG) for _ in range(2)]
    assert {pid for system in again for pid in system.pids} == pooled, "both sets served again"
    for system in again:
        system.close()


def test_a_rank_that_dies_or_hangs_is_a_rank_error_and_no_worker_is_left() -> None:
    """Private workers (another timeout than the pooled ones): one is killed, then, in a new system, one
    is stopped while its peer waits for it in the all-reduce. Both end as ``RankError`` within the timeout,
    and every worker process is gone."""
    cfg = config()
    dead = SGLangRanks(cfg, system=SGLANG, timeout_s=5)
    pids = dead.pids
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RankError, match="rank 1 died") as died:
        dead.apply(MatchPrefix(TOKENS))
    assert died.value.rank == 1
    dead.close()
    assert all(_gone(pid) for pid in pids)

    hung = SGLangRanks(cfg, system=SGLANG, timeout_s=5)
    pids = hung.pids
    os.kill(pids[1], signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(RankError) as stuck:  # rank 0 waits in SGLang's all-reduce for rank 1
        hung.apply(CheckHicacheEvents())
    assert time.monotonic() - started < 30
    assert stuck.value.rank in (0, 1)
    assert "did not answer" in str(stuck.value) or "Timed out" in stuck.value.remote_traceback
    with pytest.raises(RankError, match="ended"):
        hung.apply(MatchPrefix(TOKENS))
    hung.close()
    assert all(_gone(pid) for pid in pids)


def test_the_command_line_runs_two_sglang_ranks_and_refuses_four(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from refcache.cli import app

    monkeypatch.setenv("REFCACHE_TRACE_DIR", str(tmp_path))
    against = f"model,{SGLANG}"
    four = CliRunner().invoke(app, ["fuzz", "--against", against, "--tp-size", "4", "--examples", "1"])
    assert four.exit_code == 2 and "--tp-size 1 or 2" in four.output, four.output
    # up to 0.5.12 under the release's profile: without D-68 a check one rank acked alone diverges, and explain
    # (two fresh workers per decision it tries) spent the minute's budget on one example
    profile = ["--profile", _FOLLOWED] if LOADS_APART and _FOLLOWED is not None else []
    two = CliRunner().invoke(
        app, ["fuzz", "--against", against, "--tp-size", "2", "--examples", "2", "--steps", "15", *profile]
    )
    assert two.exit_code == 0, two.output
    assert "2 examples" in two.output, two.output


RECORDED_OPS: list[Op] = [
    StartRequest(1, TOKENS),
    FinishRequest(1),
    CompleteIO(IOQueue.WRITE, 0, 1),
    CheckHicacheEvents(),
    CompleteIO(IOQueue.WRITE, 1, 1),
    CheckHicacheEvents(),
    Evict(8),
    StartRequest(2, (*TOKENS, 5)),
    CompleteIO(IOQueue.LOAD, 1, 1),
    CheckHicacheEvents(),
    CompleteIO(IOQueue.LOAD, 0, 1),
    CheckHicacheEvents(),
    FinishRequest(2),
    MatchPrefix((*TOKENS, 5)),
    AdvanceClock(300, rank=1),
    AdvanceClock(100),
]
"""The run of the first test, each completion of exactly the acks pending (the recorder sees what
completed), then rank 1's clock alone and both clocks (D-41)."""


@needs_recorder
@pytest.mark.skipif(
    _compat.Compat(versions.installed().rows).has("init_load_back_positional"),
    reason="the recorder refuses SGLang up to 0.5.9 (positional scheduler calls; test_record_releases.py)",
)
def test_a_two_rank_run_is_recorded_merged_in_the_order_driven_and_replays_clean(tmp_path: Path) -> None:
    """``record`` on two ranks: a recorder in each worker, merged by the order the parent drove them (the
    lock-step operations once, each rank's completions with its rank, both ranks' snapshots on every line).
    The recording is the operations driven and replays clean on the model; with one completion credited to
    the other rank it does not (the ranks' snapshots are compared)."""
    cfg = config()
    out = tmp_path / "two-ranks.jsonl"
    sglang = open_system(cfg)
    assert isinstance(sglang, SGLangRanks)
    with sglang, record(sglang, out, snapshots=True) as recorder:
        for op in RECORDED_OPS:
            sglang.apply(op)
    recording = recorder.recording()
    assert recording.ops == RECORDED_OPS
    assert read_recording(out).ops == RECORDED_OPS
    assert all(s is not None and [r.rank for r in s.ranks] == [0, 1] for s in recording.snapshots)
    last = recording.snapshots[-1]
    assert last is not None and (last.clock_us, [r.clock_skew_us for r in last.ranks]) == (100, [0, 300])
    assert replay_recorded(recording) == len(RECORDED_OPS)

    wrong = list(RECORDED_OPS)
    wrong[2] = CompleteIO(IOQueue.WRITE, 1, 1)  # rank 1's write, where rank 0's finished
    with pytest.raises(Divergence, match="snapshots differ") as caught:
        replay_recorded(replace(recording, ops=wrong))
    assert caught.value.step == 3
    wrong = [*RECORDED_OPS[:-2], AdvanceClock(300, rank=0), RECORDED_OPS[-1]]  # the other rank's clock
    with pytest.raises(Divergence, match="snapshots differ") as caught:
        replay_recorded(replace(recording, ops=wrong))
    assert caught.value.step == len(RECORDED_OPS) - 1


def test_ranks_that_recorded_a_lock_step_operation_differently_are_refused() -> None:
    rank0 = Recording(config(), [MatchPrefix((1,))], [None], [None])
    rank1 = Recording(config(), [MatchPrefix((2,))], [None], [None])
    with pytest.raises(RecordingError, match="differently"):
        merge_ranks([None], [(rank0, [1]), (rank1, [1])], [])
    with pytest.raises(RecordingError, match="sent to it alone"):
        merge_ranks([1], [(rank0, []), (rank1, [1])], [])


def test_a_hang_ends_the_merged_recording_with_the_operation_that_never_returned() -> None:
    """``merge_ranks`` with a hang: the stuck rank marked no end for the last operation; its lines before
    the call must be the first of its peer's, and the operation is written observed as ``NeverReturned``
    (what the peer returned is not: the operation as a whole never did)."""
    hang = NeverReturned(0, 1, "hiradix_cache.py:226 _all_reduce_attn_groups", 1, 0)
    match, drain = MatchPrefix((1,)), CheckHicacheEvents()
    stuck = Recording(config(), [match], [None], [None])
    peer = Recording(config(), [match, drain], [None, EventsResult(0, 0, 0, 0, 0)], [None, None])
    merged = merge_ranks([None, None], [(stuck, [1]), (peer, [1, 2])], [], (drain, hang))
    assert (merged.ops, merged.observed, merged.snapshots) == ([match, drain], [None, hang], [None, None])
    ahead = Recording(config(), [match, CompleteIO(IOQueue.WRITE, 0, 1)], [None, IOResult(1)], [None, None])
    with pytest.raises(RecordingError, match="hung differently"):
        merge_ranks([None, None], [(ahead, [1]), (peer, [1, 2])], [], (drain, hang))


def test_the_collective_check_names_only_an_all_reduce_no_peer_can_join() -> None:
    """``_tp``'s rule, on its counts alone (no worker started): a busy rank inside all-reduce n is stuck
    only when a peer is idle after fewer than n; a peer still busy, or idle after n, may still join it."""
    from refcache.engines.sglang._tp import _Workers

    workers = object.__new__(_Workers)
    workers.size, workers.caller, workers.base = 2, ["a.py:1 f", "b.py:2 g"], [0, 0]
    workers.entered = [2, 1]
    stuck = workers._stuck("apply", {0})
    assert stuck is not None and stuck.rank == 0 and "rank 1 never entered (idle after 1;" in str(stuck)
    assert stuck.hang == NeverReturned(0, 2, "a.py:1 f", 1, 1)
    # Pooled workers served other systems first: the counts are the ones since the system (or its
    # recording) began, so a recording says the same whatever the worker did before.
    workers.entered, workers.base = [57, 56], [55, 55]
    stuck = workers._stuck("apply", {0})
    assert stuck is not None and stuck.hang == NeverReturned(0, 2, "a.py:1 f", 1, 1)
    assert "all-reduce #2, which rank 1 never entered (idle after 1;" in str(stuck)
    workers.base = [0, 0]
    assert workers._stuck("apply", {0, 1}) is None  # rank 1 is still working: it may yet enter #2
    workers.entered = [2, 2]
    assert workers._stuck("apply", {0}) is None  # rank 1 entered #2 before answering: rank 0 is finishing it
    assert workers._stuck("apply", set()) is None


_BUSY_RANK = """
import sys
from multiprocessing.connection import Connection
from refcache.engines.sglang._tp import _answer_while_busy, _Recording

class Broken:
    def recording(self):
        raise RuntimeError("a recorder that cannot say what it recorded")

rec = _Recording()
rec.recorder = Broken() if sys.argv[2] == "broken" else None
conn = Connection(int(sys.argv[1]))
conn.send("ready")
while True:
    _answer_while_busy(conn, rec)
"""


def test_a_rank_waiting_in_its_all_reduce_answers_salvage_and_leaves_on_exit_or_a_closed_pipe() -> None:
    """``_tp._answer_while_busy`` (what a recording rank does with its pipe while its all-reduce waits), in
    a stand-in worker process: ``salvage`` is always answered (None when the recorder fails: the parent then
    says the recording was lost, rather than waiting for an answer); ``exit``, a closed pipe or an unexpected
    command end the process at once instead of being dropped (or raising inside SGLang's call)."""
    import socket
    import subprocess
    import sys
    from multiprocessing.connection import Connection

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[3]), *sys.path])}
    procs: list[tuple[str, Connection, subprocess.Popen[bytes]]] = []
    for end in ("exit", "closed", "apply"):
        ours, theirs = socket.socketpair()
        kind = "broken" if end == "apply" else "plain"
        proc = subprocess.Popen(
            [sys.executable, "-c", _BUSY_RANK, str(theirs.fileno()), kind],
            pass_fds=(theirs.fileno(),),
            env=env,
            stderr=subprocess.PIPE,
        )
        theirs.close()
        procs.append((end, Connection(ours.detach()), proc))
    try:
        for end, conn, proc in procs:
            assert conn.poll(120) and conn.recv() == "ready"
            conn.send(("salvage", None))
            assert conn.poll(30)
            assert conn.recv() == (
                "salvaged",
                None,
            )  # not recording / a recorder that failed: still an answer
            assert proc.poll() is None  # salvage does not end it
            if end == "closed":
                conn.close()
            else:
                conn.send((end, None))
        codes = {end: proc.wait(30) for end, _, proc in procs}
        assert codes == {"exit": 0, "closed": 0, "apply": 1}
        stderr = {end: proc.stderr.read().decode() if proc.stderr else "" for end, _, proc in procs}
        assert "a recorder that cannot say what it recorded" in stderr["apply"]
        assert "'apply' sent while it waits in an all-reduce" in stderr["apply"]
    finally:
        for _, conn, proc in procs:
            proc.kill()
            proc.wait()
            conn.close()
