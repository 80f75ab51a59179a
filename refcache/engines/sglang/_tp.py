"""SGLang with two tensor-parallel ranks: one worker process per rank, joined in a real gloo group.

``SGLangRanks(config)`` (``config.tp_size == 2``) is the ``sglang`` system for two ranks (HiRadixCache, 0.5.13 to
0.5.20), ``SGLangRanks(config, system="sglang-unified")`` the ``sglang-unified`` one (UnifiedRadixCache, 0.5.19 to
0.5.23), where ``Release.ranks_on`` says: ``RANK_SYSTEMS``. Each rank is a spawned worker process that joins a
``torch.distributed`` gloo group of ``tp_size`` ranks (a ``file://`` rendezvous in a temporary directory) and
builds that system's one-rank adapter (``SGLangSystem``, ``UnifiedSGLangSystem``) there; the cache finds the
group through ``tp_cache_group`` and its own collectives run for real. 0.5.20's ``HiRadixCache`` issues the MIN
all-reduce of the ready write and load acks in ``check_hicache_events`` (``_sync_hicache_ready_counts``,
``hiradix_cache.py:1031-1040``, through ``_all_reduce``, ``:219-251``), and with L3 one more for the storage
queue sizes; ``UnifiedRadixCache`` one MIN over all of them (``_sync_hicache_ready_counts``, 0.5.20
``unified_radix_cache.py:3063-3118``, with its TP check of the write_back reclaim digest). Without L3 that is
every collective either issues. With L3 the storage threads' all-reduces (MIN of the storage hits, MIN of a read ack's
completed tokens) go through this process instead (``SGLangSystem._gate_collectives``): each rank's answer
carries what its threads contributed and wait for, and once every rank made the ``n``-th contribution of a
group, ``_reduce_storage`` hands them all the MIN; until then that step is in flight on its rank.

* A **lock-step** operation (every scheduler call) goes to every rank at once, since a collective blocks
  until all ranks call it; the ranks must answer alike (they see equal trees), else ``RankError``.
* A **per-rank** operation goes to its rank only: ``CompleteIO(queue, rank, count)`` (that rank's stream
  runs through its oldest acks), ``StorageFault(kind, rank, index)`` and ``AdvanceClock(us, rank)`` (each
  worker has its own logical clock, as each real rank reads its own ``time.monotonic()``; D-41).
* A ``StartRequest`` is refused (``UnsupportedError``, nothing sent) while any rank has
  ``MAX_PENDING_LOADS`` loads unfinished: 0.5.20's ``LayerDoneCounter`` asserts per rank.
* The **snapshot** is the ranks' snapshots side by side (``Snapshot.ranks[r]`` is rank ``r``), as the model
  reports N ranks; its ``clock_us`` is the earliest rank's clock, each rank's ``clock_skew_us`` how far its
  own is past that (``join_ranks``; a worker's own snapshot carries its clock as its skew).

Errors: a ``RefcacheError`` that every rank raises alike (an invalid operation, rejected before anything
changed) is re-raised as it is. Anything else — a rank that raises something else, ranks that disagree, a
worker that dies, or one that does not answer within ``timeout_s`` (a rank blocked in an all-reduce its peer
never joined ends there too: the gloo group's own timeout is ``timeout_s``) — raises ``RankError`` naming the
rank, with the worker's traceback, and ends the workers.

**Collectives in step.** Each worker wraps ``torch.distributed.all_reduce`` (the collective both caches issue,
``_all_reduce_attn_groups``, hiradix_cache.py:219-226, 0.5.20 unified_radix_cache.py:303-310) so that every call first tells the parent its
number on that rank and its caller. A rank that waits in all-reduce number *n* while a peer has answered
after fewer than *n* can never be joined (the peer gets no command before it answers): that is a
``RankError`` at once, naming the collective and its caller on both sides, instead of a hang until
``timeout_s`` (under NCCL, a hang for good). SGLang's own calls are unchanged.

**Recording.** ``record(ranks, path)`` (``refcache.engines.sglang.record``) records a two-rank run with a
recorder in each worker, merged in the order the operations were driven (``RanksRecorder``); the worker's
``Recorder`` reads whichever cache its system built (``_Calls`` for HiRadixCache, ``_UnifiedCalls`` for
UnifiedRadixCache), so the path is one for both systems. While it
records, a worker waits in a scheduler all-reduce listening to its pipe, and when the collective check
finds a rank stuck the parent first asks every rank for its recording (``salvage``): the recording keeps
every line before the operation that hung and ends with it, observed as ``NeverReturned`` (the rank, the
all-reduce and its caller, the peer that never entered it). With L3 a storage step that waits in its
all-reduce reaches the recorder when the parent hands in the MIN (``reduced``): each worker marks where that
ends too, and the merge writes the step where it was driven (``merge_ranks``).

**Worker set-up hook.** ``REFCACHE_SGLANG_RANK_SETUP`` (``SETUP_ENV``), when set, is ``MODULE:FUNCTION`` or
``MODULE:FUNCTION:ARGUMENT``: each worker imports it (with this process's ``sys.path`` appended to its own)
once it has imported SGLang and calls ``FUNCTION(ARGUMENT)`` (``FUNCTION()`` without one) before it serves
anything, so a test can patch SGLang's code in the ranks (the zoo, ``tests/engines/sglang``). ``rank_setup``
sets it for a block. A failing hook is a ``RankError`` at start.

Workers are expensive to start (each imports SGLang, ~10 s on two cores), so they are kept between systems:
closing a system closes its ranks' caches and leaves the workers for the next system of the same
``tp_size`` and the same set-up hook (the pool is keyed on both: a worker patched by a hook never serves a
system opened without it, nor the reverse). Up to ``POOLED_SETS`` sets are kept per key, so a system opened while
another holds a set reuses the second one: explaining a two-rank divergence replays its trace once per decision
while the fuzzed system is still open, and with one set each replay started two workers of its own (the two-rank
differential on 0.5.5 ran over ten minutes for three examples). They end with this process (``atexit``; a worker also exits when
its pipe closes, so it never outlives its parent), on any ``RankError``, at the end of ``rank_setup``'s block
(its hook's workers), and on ``shutdown_workers()``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as connection_wait
from typing import TYPE_CHECKING, Any, Final, Self, cast
from unittest import mock

from refcache.config import AttentionKind, HiCacheConfig
from refcache.engines.sglang import _compat, _storage, versions
from refcache.errors import RankError, RecordingError, RefcacheError, UnsupportedError, UsageError
from refcache.hicache.ops import (
    AbortRequest,
    AdvanceClock,
    CheckHicacheEvents,
    CompleteIO,
    EventsResult,
    FinishRequest,
    IOQueue,
    IOResult,
    Observation,
    Op,
    StartRequest,
    StorageFault,
)
from refcache.hicache.recording import NeverReturned
from refcache.hicache.snapshot import RankSnapshot, Snapshot, rank_clocks

if TYPE_CHECKING:
    from refcache.engines.sglang._adapter import SGLangSystem
    from refcache.engines.sglang._recorder import Recorder
    from refcache.hicache.recording import Recording

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RANK_SYSTEMS",
    "SETUP_ENV",
    "START_TIMEOUT_S",
    "RankError",
    "RanksRecorder",
    "SGLangRanks",
    "join_ranks",
    "live_workers",
    "rank_setup",
    "rank_system",
    "shutdown_workers",
]

DEFAULT_TIMEOUT_S = 120.0
"""How long a rank may take to answer one request (``REFCACHE_SGLANG_RANK_TIMEOUT`` overrides it)."""

START_TIMEOUT_S = 300.0
"""How long a worker may take to start (join the group, import SGLang): at least this, or twice the timeout."""

SETUP_ENV = "REFCACHE_SGLANG_RANK_SETUP"
"""``MODULE:FUNCTION[:ARGUMENT]`` each rank worker calls once it has imported SGLang (module docstring)."""

_PATH_ENV = "REFCACHE_SGLANG_RANK_PATH"  # the parent's sys.path, for the worker to import a set-up hook

_GRACE_S = 5.0  # once one rank failed, how long the others may still take to answer

RANK_SYSTEMS: Final[dict[str, str]] = {
    "sglang": "refcache.engines.sglang._adapter:SGLangSystem",  # HiRadixCache (0.5.13..0.5.20)
    "sglang-unified": "refcache.engines.sglang._unified:UnifiedSGLangSystem",  # UnifiedRadixCache
}
"""The systems whose ranks the workers run -> the one-rank adapter each worker builds (``Release.ranks_on`` says on
which releases). Both speak the same worker protocol: the gated streams, ``gate`` and ``settle`` for L3, the
controller's ``ack_load_queue``; SGLang's scheduler-thread all-reduces run for real (``_announce_collectives``)."""


def rank_system(name: str) -> type[SGLangSystem]:
    """The one-rank adapter class of the system ``name`` (``RANK_SYSTEMS``; a former name, ``ALIASES``, is its
    system's). Imports no SGLang. Raises ``UnsupportedError`` for a system whose ranks no worker runs."""
    name = versions.ALIASES.get(name, name)
    if name not in RANK_SYSTEMS:
        raise UnsupportedError(f"{name!r} runs one rank: the rank workers run {', '.join(RANK_SYSTEMS)}")
    module, _, attribute = RANK_SYSTEMS[name].partition(":")
    adapter: type[SGLangSystem] = getattr(importlib.import_module(module), attribute)
    return adapter


# --- the worker (runs in a spawned process) ----------------------------------------------------------------


class _Recording:
    """(In a worker) ``record``'s recorder of this rank and where each operation it was sent ended."""

    def __init__(self) -> None:
        self.recorder: Recorder | None = None
        self.marks: list[int] = []

    def salvage(self) -> tuple[Recording, list[int]] | None:
        """The recording so far and the marks, without stopping the recorder (None: not recording)."""
        return None if self.recorder is None else (self.recorder.recording(), list(self.marks))


def _serve(
    rank: int, size: int, init_file: str, conn: Connection, timeout_s: float, system_name: str
) -> None:
    """A rank worker of the system ``system_name`` (``RANK_SYSTEMS``): join the gloo group, import SGLang as
    that system's adapter does, then answer requests until ``exit`` or until the parent's end of the pipe
    closes."""
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout_s),
        )
        from refcache.engines.sglang import _gate
        from refcache.engines.sglang._recorder import Recorder

        adapter = rank_system(system_name)
        adapter._ready()  # this release's SGLang, imported and patched as the one-rank adapter does
        _run_setup(os.environ.get(SETUP_ENV, ""))
        rec = _Recording()  # record(): this rank's recorder, and where each operation ended
        _announce_collectives(conn, rec)
    except BaseException as error:  # reported to the parent, which raises RankError
        conn.send(("error", _portable(error), traceback.format_exc()))
        return
    conn.send(("ok", os.getpid()))
    system: SGLangSystem | None = None
    while True:
        try:
            command, argument = conn.recv()
        except (EOFError, OSError):
            break  # the parent is gone
        if command == "exit":
            break
        if command == "salvage":  # a peer is stuck: what this rank recorded (the parent ends the workers)
            _send_salvaged(conn, rec)
            continue
        try:
            result: object = None
            if command in ("open", "close") and rec.recorder is not None:
                rec.recorder.close()
                rec.recorder = None
            if command == "open":
                if system is not None:
                    system.close()
                system = None
                config, l3_dir = argument
                system = adapter(config, l3_dir=l3_dir)
            elif system is None:
                raise UsageError("no SGLang system is open on this rank")
            elif command == "apply":  # the snapshot after it rides along (the harness reads it next)
                try:
                    result = (system.apply(argument), system.snapshot(), _contributions(system))
                finally:
                    if rec.recorder is not None:
                        rec.marks.append(rec.recorder.flush())
            elif command == "snapshot":
                result = system.snapshot()
            elif command == "reduced":  # the storage threads' all-reduces the parent reduced
                try:
                    if system.gate is None:
                        raise UsageError("this rank runs no storage threads")
                    system.gate.resolve(argument)
                    system.settle()
                    result = (system.snapshot(), _contributions(system))
                finally:
                    if rec.recorder is not None:  # the steps the release let through: their own span
                        rec.marks.append(rec.recorder.flush())
            elif command == "pending_loads":
                result = _gate.pending(system.controller.ack_load_queue)
            elif command == "record":
                if rec.recorder is not None:
                    raise UsageError("this rank is already recording")
                if not adapter.RECORDED:
                    raise RecordingError(f"{system_name!r} has no recorder (its adapter's RECORDED is false)")
                rec.recorder, rec.marks = Recorder(system.cache, system.config, system, bool(argument)), []
                rec.recorder.install()
            elif command == "recorded":
                if rec.recorder is None:
                    raise UsageError("this rank is not recording")
                rec.recorder.close()
                result, rec.recorder = (rec.recorder.recording(), rec.marks), None
            elif command == "close":
                system.close()
                system = None
            else:
                raise UsageError(f"unknown command {command!r}")
            conn.send(("ok", result))
        except BaseException as error:  # every failure goes back to the parent
            conn.send(("error", _portable(error), traceback.format_exc()))
    if system is not None:
        system.close()
    with contextlib.suppress(Exception):  # the group may be broken; the process ends anyway
        dist.destroy_process_group()


def _contributions(system: Any) -> _storage.Contributions:
    """What this rank's storage threads contributed to all-reduces that wait for their result."""
    return system.gate.contributions() if system.gate is not None else {}


def _run_setup(hook: str) -> None:
    """Call the set-up hook ``MODULE:FUNCTION[:ARGUMENT]`` (nothing when empty)."""
    if not hook:
        return
    sys.path.extend(p for p in os.environ.get(_PATH_ENV, "").split(os.pathsep) if p and p not in sys.path)
    module, _, rest = hook.partition(":")
    function, has_argument, argument = rest.partition(":")
    if not module or not function:
        raise UsageError(f"{SETUP_ENV}={hook!r}: expected MODULE:FUNCTION or MODULE:FUNCTION:ARGUMENT")
    call = getattr(importlib.import_module(module), function)
    if has_argument:
        call(argument)
    else:
        call()


def _announce_collectives(conn: Connection, rec: _Recording) -> None:
    """Wrap ``torch.distributed.all_reduce`` in this worker: each call on the scheduler (main) thread first
    sends ``("collective", n, caller)`` to the parent (n: this rank's count of those all-reduces so far),
    then runs the real one. While ``rec`` records, the real one runs asynchronously and the rank waits for
    it listening to its pipe, so that when it is stuck there the parent's ``salvage`` still gets this
    rank's recording."""
    import torch.distributed as dist

    real = dist.all_reduce
    count = 0

    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        nonlocal count
        if threading.current_thread() is not threading.main_thread():
            # Not announced: the answers' pipe is the main thread's. The storage threads' all-reduces do not
            # reach here (the adapter reduces them through the parent: Gate.all_reduce).
            return real(*args, **kwargs)
        count += 1
        frames: list[str] = []
        frame: types.FrameType | None = sys._getframe(1)
        while frame is not None and len(frames) < 3:
            code = frame.f_code
            frames.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
            frame = frame.f_back
        conn.send(("collective", count, " < ".join(frames)))
        if rec.recorder is None or len(args) > 3 or kwargs.get("async_op"):
            return real(*args, **kwargs)
        work = real(*args, **{**kwargs, "async_op": True})
        delay = 0.0
        while not work.is_completed():
            if conn.poll(delay):  # the parent sends a busy rank nothing but salvage, then exit
                _answer_while_busy(conn, rec)
            delay = min(0.002, 2 * delay or 0.00005)
        work.wait()  # raises what the collective raised (the gloo group's timeout)
        return None

    dist.all_reduce = all_reduce


def _send_salvaged(conn: Connection, rec: _Recording) -> None:
    """Answer ``salvage`` with this rank's recording so far, or with None when taking or sending it failed
    (the traceback goes to stderr): the parent always gets an answer, and says the recording was lost."""
    try:
        conn.send(("salvaged", rec.salvage()))
    except Exception:
        traceback.print_exc()
        conn.send(("salvaged", None))


def _answer_while_busy(conn: Connection, rec: _Recording) -> None:
    """(In a worker waiting for its all-reduce) the parent's message: ``salvage`` is answered; ``exit``, a
    closed pipe or anything else ends the process at once (``os._exit``), as the parent ends a stuck rank,
    rather than raising inside SGLang's call or waiting on in a collective no peer will join."""
    try:
        command, _ = conn.recv()
    except (EOFError, OSError):
        os._exit(0)  # the parent is gone
    if command == "salvage":
        _send_salvaged(conn, rec)
        return
    if command != "exit":
        sys.stderr.write(f"rank worker: {command!r} sent while it waits in an all-reduce; ending\n")
    sys.stderr.flush()
    os._exit(0 if command == "exit" else 1)


def _portable(error: BaseException) -> BaseException | None:
    """``error`` if it survives pickling (so the parent can re-raise its type), else None."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return None
    return error


# --- the parent side -----------------------------------------------------------------------------------------


class _Workers:
    """``size`` rank workers of the system ``system`` (``RANK_SYSTEMS``; ``python -m
    refcache.engines.sglang._tp``, so nothing of the caller's main module runs again) and a socket pipe to each;
    a worker's stderr goes to a file quoted when it dies. ``setup``: the set-up hook the workers ran ("" for
    none); ``entered[r]``: the all-reduces rank ``r``
    announced so far (over the worker's life: workers are pooled across systems), ``caller[r]`` where its
    last one was called from, and ``base[r]`` its count when the system opened or its recording began (what a
    ``RankError``'s numbers and ``NeverReturned`` count from). ``salvage`` (set while
    ``record`` records): when an ``apply`` finds a rank stuck, every rank's recording is fetched into
    ``salvaged`` (the ``RankError`` and the answers by rank) before the workers end."""

    def __init__(self, size: int, timeout_s: float, setup: str = "", system: str = "sglang") -> None:
        self.size = size
        self.timeout_s = timeout_s
        self.setup = setup
        self.system = system
        self.in_use = False
        self.alive = True
        self.entered = [0] * size
        self.caller = [""] * size
        self.base = [0] * size
        self.salvage = False
        self.salvaged: tuple[RankError, dict[int, object]] | None = None
        self._dir = tempfile.mkdtemp(prefix="refcache-sglang-tp-")
        init_file = os.path.join(self._dir, "gloo-rendezvous")
        self.conns: list[Connection] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        env = {k: v for k, v in os.environ.items() if k not in (SETUP_ENV, _PATH_ENV)}
        if setup:
            env[SETUP_ENV] = setup
            env[_PATH_ENV] = os.pathsep.join(p for p in sys.path if p)
        try:
            for rank in range(size):
                ours, theirs = socket.socketpair()
                with open(os.path.join(self._dir, f"rank{rank}.stderr"), "wb") as stderr:
                    proc = subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            __name__,
                            str(rank),
                            str(size),
                            init_file,
                            str(theirs.fileno()),
                            str(timeout_s),
                            system,
                        ],
                        pass_fds=(theirs.fileno(),),
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=stderr,
                        env=env,
                    )
                theirs.close()
                self.conns.append(Connection(ours.detach()))
                self.procs.append(proc)
            self._collect(range(size), "start", max(2 * timeout_s, START_TIMEOUT_S))
        except BaseException:
            self.end()
            raise

    def _stderr(self, rank: int) -> str:
        try:
            with open(os.path.join(self._dir, f"rank{rank}.stderr"), errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def call(self, ranks: Sequence[int], command: str, argument: object = None) -> list[object]:
        """Send ``command`` to ``ranks`` at once and collect their answers in order (see the module
        docstring for the errors)."""
        if not self.alive:
            raise RankError("the rank workers have ended (an earlier failure); open a new system")
        for rank in ranks:
            try:
                self.conns[rank].send((command, argument))
            except (OSError, ValueError) as error:
                self.end()
                raise RankError(f"rank {rank} cannot be reached ({error}); it has died", rank) from None
        return self._collect(ranks, command, self.timeout_s)

    def _collect(self, ranks: Sequence[int], command: str, timeout_s: float) -> list[object]:
        """The answers of ``ranks``, whichever comes first; once one rank failed, the others have
        ``_GRACE_S`` more (a peer waiting in an all-reduce for it would otherwise wait out the timeout). The
        failure reported is the most telling: a rank's own error, then a death, then silence."""
        deadline = time.monotonic() + timeout_s
        answers: dict[int, tuple[str, Any, str]] = {}
        died: list[RankError] = []
        waiting = {self.conns[rank]: rank for rank in ranks}
        stuck: RankError | None = None
        while waiting and stuck is None:
            ready = connection_wait(list(waiting), max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for ready_conn in ready:
                conn = cast(Connection, ready_conn)
                rank = waiting.pop(conn)
                try:
                    answer: tuple[Any, ...] = conn.recv()
                    if answer[0] == "collective":  # the rank is entering an all-reduce; still working
                        self.entered[rank], self.caller[rank] = answer[1], answer[2]
                        waiting[conn] = rank
                        continue
                except (EOFError, OSError):
                    try:
                        code: int | None = self.procs[rank].wait(1.0)
                    except subprocess.TimeoutExpired:
                        code = None
                    message = f"rank {rank} died during {command!r} (exit code {code})"
                    died.append(RankError(message, rank, self._stderr(rank)))
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
                    continue
                answers[rank] = (answer[0], answer[1], answer[2] if len(answer) > 2 else "")
                if answer[0] == "error" and not isinstance(answer[1], RefcacheError):
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
            if not died:
                stuck = self._stuck(command, set(waiting.values()))
        if stuck is not None:
            if self.salvage and command == "apply":
                self._salvage(stuck)
            self.end(kill=list(waiting.values()))
            raise stuck
        failure = self._own_error(ranks, command, answers) or (died[0] if died else None)
        if failure is None and waiting:
            rank = min(waiting.values())
            failure = RankError(
                f"rank {rank} did not answer {command!r} within {timeout_s:.0f} s (a hang, or blocked in a "
                "collective its peer never joined)",
                rank,
            )
        if failure is None:
            failure = self._judge(ranks, command, answers)
        if failure is not None:
            self.end()
            raise failure
        errors = [answers[r] for r in ranks if answers[r][0] == "error"]
        if errors:  # every rank raised the same RefcacheError before changing anything
            raise errors[0][1]
        return [answers[r][1] for r in ranks]

    def _salvage(self, stuck: RankError) -> None:
        """Every rank's recording as it stands (``salvaged``), before the workers end: the idle ranks answer
        from their loop, the stuck one from inside its all-reduce (``_announce_collectives``)."""
        answers: dict[int, object] = {}
        waiting: dict[Connection, int] = {}
        for rank, conn in enumerate(self.conns):
            with contextlib.suppress(OSError, ValueError):
                conn.send(("salvage", None))
                waiting[conn] = rank
        deadline = time.monotonic() + 2 * _GRACE_S
        while waiting:
            ready = connection_wait(list(waiting), max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for ready_conn in ready:
                conn = cast(Connection, ready_conn)
                try:
                    answer: tuple[Any, ...] = conn.recv()
                except (EOFError, OSError):
                    waiting.pop(conn)
                    continue
                if answer[0] == "salvaged":
                    answers[waiting.pop(conn)] = answer[1]
        self.salvaged = (stuck, answers)

    def _stuck(self, command: str, busy: set[int]) -> RankError | None:
        """A rank waiting in an all-reduce that an idle peer (one that answered, or was not asked) never
        entered: nothing can join it, since the peer gets no command before the busy rank answers."""
        for rank in sorted(busy):
            for peer in range(self.size):
                if peer not in busy and self.entered[peer] < self.entered[rank]:
                    n, m = self.entered[rank] - self.base[rank], self.entered[peer] - self.base[peer]
                    return RankError(
                        f"rank {rank} waits in all-reduce #{n}, which rank {peer} never entered (idle after "
                        f"{m}; counted from the system's open or its recording's start): the ranks' "
                        f"collectives are out of step (under NCCL, a hang). Rank {rank}'s {command!r} called "
                        f"it from {self.caller[rank]}; rank {peer}'s last was from "
                        f"{self.caller[peer] or 'nowhere'}",
                        rank,
                        hang=NeverReturned(rank, n, self.caller[rank], peer, m),
                    )
        return None

    @staticmethod
    def _own_error(
        ranks: Sequence[int], command: str, answers: dict[int, tuple[str, Any, str]]
    ) -> RankError | None:
        """A rank that raised something other than a ``RefcacheError``, with its traceback."""
        for rank in ranks:
            kind, value, trace = answers.get(rank, ("ok", None, ""))
            if kind == "error" and not isinstance(value, RefcacheError):
                what = f"{type(value).__name__}: {value}" if value is not None else "an unpicklable error"
                return RankError(f"rank {rank} failed on {command!r}: {what}", rank, trace)
        return None

    @staticmethod
    def _judge(
        ranks: Sequence[int], command: str, answers: dict[int, tuple[str, Any, str]]
    ) -> RankError | None:
        """Every rank answered: None when all succeeded or all raised the same ``RefcacheError``; else the
        ``RankError`` that ends the workers."""
        errors = {(type(a[1]), str(a[1])) for a in answers.values() if a[0] == "error"}
        if errors and (len(errors) > 1 or any(a[0] == "ok" for a in answers.values())):
            summary = ", ".join(
                f"rank {r}: {answers[r][1]!r}" if answers[r][0] == "error" else f"rank {r}: ok" for r in ranks
            )
            return RankError(f"the ranks disagree on {command!r} ({summary}): they are out of step")
        return None

    def end(self, kill: Sequence[int] = ()) -> None:
        """Ask the workers to exit, then end any that do not (at once: the ranks ``kill``, blocked in a
        collective); idempotent."""
        self.alive = False
        for rank in kill:
            with contextlib.suppress(OSError, IndexError):
                self.procs[rank].kill()
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("exit", None))
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        shutil.rmtree(self._dir, ignore_errors=True)
        key = (self.size, self.setup, self.system)
        if self in _POOL.get(key, []):
            _POOL[key].remove(self)
            if not _POOL[key]:
                del _POOL[key]


_STORAGE_QUEUES: Final = (IOQueue.PREFETCH_QUERY, IOQueue.PREFETCH_IO, IOQueue.BACKUP)

RELEASED: Final = "released"
"""An entry of ``RanksRecorder.driven``: the parent handed every rank reduced storage all-reduces (L3)."""

_POOL: dict[tuple[int, str, str], list[_Workers]] = {}
"""Worker sets by tp_size, set-up hook and system (``RANK_SYSTEMS``: a HiRadixCache worker never serves a
UnifiedRadixCache system, nor the reverse), kept between systems (module docstring), at most ``POOLED_SETS`` each."""

POOLED_SETS: Final = 2
"""Worker sets kept per key: the system under test and one more (the replays that explain or shrink its
divergence while it is open)."""


def _timeout() -> float:
    text = os.environ.get("REFCACHE_SGLANG_RANK_TIMEOUT")
    return float(text) if text else DEFAULT_TIMEOUT_S


def _workers(size: int, timeout_s: float, system: str) -> tuple[_Workers, bool]:
    """Workers of ``system`` for ``size`` ranks under this process's set-up hook (``SETUP_ENV``) and whether
    they are pooled ones (kept in ``_POOL`` for the next system): with the default timeout, an idle, alive set
    of that size, hook and system, or a new pooled one while the key has fewer than ``POOLED_SETS`` (dead sets
    are ended and dropped first); else private ones, ended when their system closes."""
    key = (size, os.environ.get(SETUP_ENV, ""), system)
    if timeout_s != _timeout():
        return _Workers(size, timeout_s, key[1], system), False
    for dead in [w for w in _POOL.get(key, []) if not w.alive]:
        dead.end()
    sets = _POOL.get(key, [])
    idle = next((w for w in sets if not w.in_use), None)
    if idle is not None:
        return idle, True
    if len(sets) >= POOLED_SETS:
        return _Workers(size, timeout_s, key[1], system), False
    workers = _Workers(size, timeout_s, key[1], system)
    _POOL.setdefault(key, []).append(workers)
    return workers, True


def shutdown_workers(setup: str | None = None) -> None:
    """End every pooled rank worker (also run at exit); with ``setup``, only those of that set-up hook."""
    for (_, hook, _), sets in list(_POOL.items()):
        if setup is None or hook == setup:
            for workers in list(sets):
                workers.end()


@contextlib.contextmanager
def rank_setup(hook: str) -> Iterator[None]:
    """Rank workers started in the block run ``hook`` (``SETUP_ENV``'s form) before serving; at the end of
    the block the pooled workers of that hook end and the variable is put back."""
    before = os.environ.get(SETUP_ENV, "")
    try:
        with mock.patch.dict(os.environ, {SETUP_ENV: hook}):
            yield
    finally:
        if hook != before:
            shutdown_workers(hook)


def live_workers() -> list[int]:
    """Process ids of the pooled rank workers that are alive (for tests and diagnostics)."""
    return [p.pid for sets in _POOL.values() for w in sets for p in w.procs if p.poll() is None]


atexit.register(shutdown_workers)


class SGLangRanks:
    """The ``sglang`` system (HiRadixCache) or, with ``system="sglang-unified"``, the ``sglang-unified`` one
    (UnifiedRadixCache) for ``tp_size`` 2: ``apply(op) -> Observation``, ``snapshot() -> Snapshot``.

    ``timeout_s`` bounds each answer of a rank (default ``REFCACHE_SGLANG_RANK_TIMEOUT`` or
    ``DEFAULT_TIMEOUT_S``). Raises ``UnsupportedError`` for a configuration the adapter cannot run, or a
    release the system does not open with two ranks (``Release.ranks_on``), and ``RankError`` when a rank fails
    (module docstring).
    """

    def __init__(
        self, config: HiCacheConfig, *, system: str = "sglang", timeout_s: float | None = None
    ) -> None:
        from refcache.engines.sglang._adapter import MAX_PENDING_LOADS

        cfg = config.resolve()
        adapter = rank_system(system)
        why = adapter._why_unsupported(cfg)
        if why is not None:
            raise UnsupportedError(why)
        if cfg.tp_size < 2:
            raise UnsupportedError(f"SGLangRanks runs two ranks or more; tp_size 1 is {adapter.__name__}")
        versions.check_installed(adapter.SYSTEM, tp_size=cfg.tp_size, storage=cfg.enable_storage)
        self.config = cfg
        self.system = adapter.SYSTEM
        self.max_pending_loads = MAX_PENDING_LOADS
        # up to 0.5.12 each rank retires its own finished loads (D-68): the ranks' load counts are joined by rank
        self.loads_apart = _compat.Compat(versions.installed().rows).has("loads_retired_per_rank")
        self._workers, self._shared = _workers(cfg.tp_size, timeout_s or _timeout(), adapter.SYSTEM)
        self._workers.in_use = True
        self._closed = False
        self._snaps: list[Snapshot] | None = None  # the ranks' snapshots now, when known
        self._recorder: RanksRecorder | None = None  # record(): told what each apply was sent to
        # L3: one HiCacheFile directory for the ranks (each names its keys after its rank), and what each
        # rank's storage threads contributed to all-reduces not yet reduced
        self._l3_dir = tempfile.mkdtemp(prefix="refcache-sglang-l3-") if cfg.enable_storage else None
        self._waiting: list[_storage.Contributions] = [{} for _ in range(cfg.tp_size)]
        self._workers.base = list(self._workers.entered)  # this system's all-reduces count from here
        try:
            self._workers.call(range(cfg.tp_size), "open", (cfg, self._l3_dir))
        except BaseException:
            self._release()
            raise

    @property
    def pids(self) -> list[int]:
        """The rank workers' process ids, in rank order."""
        return [p.pid for p in self._workers.procs]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _release(self) -> None:
        if self._l3_dir is not None:
            shutil.rmtree(self._l3_dir, ignore_errors=True)
        self._workers.in_use = False
        if not self._shared:
            self._workers.end()

    def close(self) -> None:
        """Close every rank's cache; the workers stay for the next system (module docstring). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._workers.alive:
                self._workers.call(range(self.config.tp_size), "close")
        finally:
            self._release()

    def _all(self, command: str, argument: object = None) -> list[object]:
        if self._closed:
            raise UsageError("the SGLang system is closed")
        return self._workers.call(range(self.config.tp_size), command, argument)

    def apply(self, op: Op) -> Observation:
        """Apply ``op`` to every rank (lock step) or to its rank (``CompleteIO``, ``StorageFault``,
        ``AdvanceClock`` with a rank)."""
        if self._closed:
            raise UsageError("the SGLang system is closed")
        n = self.config.tp_size
        known, self._snaps = self._snaps, None
        if (
            isinstance(op, CompleteIO | StorageFault | AdvanceClock)
            and op.rank is not None
            and 0 <= op.rank < n
        ):
            if isinstance(op, CompleteIO) and op.queue in _STORAGE_QUEUES and self.config.enable_storage:
                # One step at a time: a step's all-reduce may let the thread take the next (as the model's
                # parked query resolves inside the step of the last rank to run it)
                done = 0
                while done < op.count:
                    one = cast(IOResult, self._on_rank(replace(op, count=1), known))
                    known = self._snaps
                    if not one.completed:
                        break
                    done += 1
                return IOResult(done)
            return self._on_rank(op, known)
        if isinstance(op, StartRequest):
            pending = cast(list[int], self._all("pending_loads"))
            if max(pending) >= self.max_pending_loads:
                raise UnsupportedError(
                    f"{self.max_pending_loads} load backs are still in flight on a rank (pending per rank: "
                    f"{pending}): SGLang 0.5.20 reuses the load event of the load three before "
                    "(LayerDoneCounter) and asserts it finished. Complete a load on that rank "
                    "(CompleteIO(LOAD, rank, 1)) first"
                )
        if self.loads_apart and isinstance(op, FinishRequest | AbortRequest):
            self._refuse_loads_apart(op, known)
        if self._recorder is not None:
            self._recorder.drove(None, op)
        answers: list[tuple[Observation, Snapshot, _storage.Contributions]]
        answers = self._all("apply", op)  # type: ignore[assignment]
        results = [result for result, _, _ in answers]
        if self.loads_apart and isinstance(op, CheckHicacheEvents):
            results = [_join_loads(cast(list[EventsResult], results))]
        if any(r != results[0] for r in results[1:]):
            self._workers.end()
            raise RankError(f"the ranks answered {op!r} differently: {results}")
        self._snaps = [snap for _, snap, _ in answers]
        self._waiting = [waiting for _, _, waiting in answers]
        self._reduce_storage()
        return results[0]

    def _refuse_loads_apart(self, op: FinishRequest | AbortRequest, known: list[Snapshot] | None) -> None:
        """D-68, as the model (``HiCacheModel._validate``): no request ends while a load back is in flight on a
        rank (SGLang's forward pass and its next check retire them on every rank first)."""
        snaps = known if known is not None else cast(list[Snapshot], self._all("snapshot"))
        self._snaps = snaps
        loads = [s.ranks[0].ongoing_load_back for s in snaps]
        if any(loads):
            raise UsageError(
                f"{op!r}: a load back is not retired on every rank (D-68, loads retired per rank up to SGLang "
                f"0.5.12: {loads}); finish every rank's loads (CompleteIO(LOAD, rank, n)) and "
                "CheckHicacheEvents() first, as SGLang's forward pass does"
            )

    def _on_rank(
        self, op: CompleteIO | StorageFault | AdvanceClock, known: list[Snapshot] | None
    ) -> Observation:
        assert op.rank is not None
        if self._recorder is not None:
            self._recorder.drove(op.rank, op)
        (answer,) = self._workers.call([op.rank], "apply", op)
        result, snap, waiting = cast(tuple[Observation, Snapshot, _storage.Contributions], answer)
        storage_step = isinstance(op, CompleteIO) and op.queue in _STORAGE_QUEUES
        if self._recorder is not None and storage_step and isinstance(result, IOResult) and result.completed:
            assert isinstance(op, CompleteIO)
            self._recorder.stepped[len(self._recorder.driven) - 1] = op.queue
        self._waiting[op.rank] = waiting
        # the other ranks did not move; but under MLA the ranks share their L3 keys (HiCacheFile names them
        # without the rank), so a backup or a deleted file on this rank changes the others' view too
        shared_l3 = self.config.enable_storage and self.config.attention is AttentionKind.MLA
        if self._recorder is not None and self._recorder.snapshots and shared_l3:
            self._snaps = cast(list[Snapshot], self._all("snapshot"))  # the merge's view of every rank
            self._recorder.after[len(self._recorder.driven) - 1] = [s.ranks[0] for s in self._snaps]
        elif known is None or shared_l3:
            self._snaps = None  # read every rank's again when asked
        else:
            self._snaps = [snap if rank == op.rank else other for rank, other in enumerate(known)]
        self._reduce_storage()
        return result

    def _reduce_storage(self) -> None:
        """The storage threads' all-reduces (L3; ``SGLangSystem._gate_collectives``): while every rank has made
        its ``n``-th contribution to a group, hand each rank the MIN (the threads go on, and may enter the
        next), with the ranks' snapshots after. A contribution a peer has not made yet stays in flight."""
        while True:
            ready = set(self._waiting[0]).intersection(*self._waiting[1:])
            if not ready:
                return
            # element by element: a thread may reduce a packed vector in one MIN (0.5.22's Unified hit query)
            reduced = {
                key: tuple(min(column) for column in zip(*(w[key] for w in self._waiting), strict=True))
                for key in sorted(ready)
            }
            if self._recorder is not None:
                self._recorder.driven.append(RELEASED)
            answers = cast(list[tuple[Snapshot, _storage.Contributions]], self._all("reduced", reduced))
            self._snaps = [snap for snap, _ in answers]
            self._waiting = [waiting for _, waiting in answers]
            if self._recorder is not None and self._recorder.snapshots:
                self._recorder.after[len(self._recorder.driven) - 1] = [s.ranks[0] for s in self._snaps]

    @contextlib.contextmanager
    def record(
        self, path: str | os.PathLike[str] | None = None, *, snapshots: bool = False
    ) -> Iterator[RanksRecorder]:
        """``refcache.engines.sglang.record.record`` for two ranks (``RanksRecorder``): record while the
        block runs, write the merged recording to ``path`` (if given) on exit."""
        recorder = RanksRecorder(self, snapshots)
        try:
            yield recorder
        finally:
            recorder.close()
            if path is not None and recorder.merged is not None:
                recorder.write(path)

    def snapshot(self) -> Snapshot:
        """Every rank's snapshot, in rank order (each rank sends its own with every answer to ``apply``)."""
        if self._snaps is None:
            self._snaps = self._all("snapshot")  # type: ignore[assignment]
        assert self._snaps is not None
        joined = join_ranks(self._snaps[0], [s.ranks[0] for s in self._snaps])
        return replace(joined, loads_retired_per_rank=True) if self.loads_apart else joined


def _join_loads(results: list[EventsResult]) -> EventsResult:
    """The ranks' ``CheckHicacheEvents`` answers where each retires its own finished loads (D-68, up to 0.5.12):
    ``loads`` their minimum and, where they differ, ``loads_by_rank`` in rank order; every other count is
    reduced by SGLang and must be equal (else ``RankError``)."""
    by_rank = tuple(r.loads for r in results)
    if all(count == by_rank[0] for count in by_rank):
        by_rank = ()  # every rank retired the same: the answer of a MIN
    joined = [replace(r, loads=min(x.loads for x in results), loads_by_rank=by_rank) for r in results]
    if any(r != joined[0] for r in joined[1:]):
        raise RankError(f"the ranks answered CheckHicacheEvents() differently beyond their loads: {results}")
    return joined[0]


def join_ranks(first: Snapshot, ranks: Sequence[RankSnapshot]) -> Snapshot:
    """The ranks side by side: ``first``'s fields and ``ranks`` in rank order, each as its worker reports it
    (its own clock as its ``clock_skew_us``, ``read_snapshot``), the clocks joined as the earliest
    (``clock_us``) and each rank's skew past it (D-41)."""
    clock_us, skews = rank_clocks([rank.clock_skew_us for rank in ranks])
    joined = tuple(
        rank if rank.clock_skew_us == skew else replace(rank, clock_skew_us=skew)
        for rank, skew in zip(ranks, skews, strict=True)
    )
    return replace(first, clock_us=clock_us, ranks=joined)


class RanksRecorder:
    """A two-rank run recorded (``SGLangRanks.record``, or ``record(ranks, ...)``): a ``Recorder`` in each
    rank worker, which marks where each operation the parent sent it ended (``Recorder.flush``), and the
    parent's list of what it sent each ``apply`` to (None: every rank, lock step; r: rank r). ``close``
    fetches the ranks' recordings and merges them in that order: a lock-step operation's lines once (every
    rank must have recorded the same operations and observations there, else ``RecordingError``), a rank's
    own lines (its completions) as ``CompleteIO(queue, rank, n)``, its clock's as ``AdvanceClock(us, rank)``
    (D-41); each line's snapshot is the ranks' latest
    side by side. With L3 the parent also notes each release of the storage threads' all-reduces
    (``RELEASED``), which storage steps ran (``stepped``) and, where a rank's lines do not show it, every
    rank's snapshot (``after``); ``merge_ranks`` places the steps. ``recording()`` is the merged recording,
    after ``close``. When an operation ends with a
    rank stuck in an all-reduce its peer never entered, the workers' recordings are fetched before they end
    (``_Workers.salvage``) and the recording ends with that operation, observed as ``NeverReturned``. If the
    workers end otherwise first (another ``RankError``), their lines are lost and ``recording()`` says
    so."""

    def __init__(self, ranks: SGLangRanks, snapshots: bool) -> None:
        self.ranks = ranks
        self.snapshots = snapshots
        self.driven: list[int | str | None] = []
        self.last: Op | None = None  # the operation driven last
        self.stepped: dict[int, IOQueue] = {}  # L3: driven index -> the queue of the storage step it ran
        self.after: dict[int, list[RankSnapshot]] = {}  # L3: driven index -> every rank's snapshot after it
        self.merged: Recording | None = None
        self._lost = ""
        if ranks._recorder is not None:
            raise UsageError("this SGLangRanks is already recording")
        initial = ranks.snapshot()  # each rank's clock as its skew, as the workers' own snapshots carry it
        self._initial = [
            replace(rank, clock_skew_us=initial.rank_clock_us(r)) for r, rank in enumerate(initial.ranks)
        ]
        ranks._all("record", snapshots)
        ranks._workers.base = list(ranks._workers.entered)  # NeverReturned counts from the recording's start
        ranks._recorder = self
        ranks._workers.salvage = True

    def drove(self, who: int | None, op: Op) -> None:
        """``SGLangRanks.apply`` sends ``op`` to every rank (None) or to rank ``who``."""
        self.driven.append(who)
        self.last = op

    def close(self) -> None:
        """Stop the ranks' recorders and merge their lines (idempotent)."""
        if self.ranks._recorder is not self:
            return
        self.ranks._recorder = None
        workers = self.ranks._workers
        workers.salvage = False
        if workers.salvaged is not None:
            error, salvaged = workers.salvaged
            got = [salvaged.get(rank) for rank in range(self.ranks.config.tp_size)]
            if error.hang is not None and self.last is not None and all(a is not None for a in got):
                fetched = cast(list[tuple["Recording", list[int]]], got)
                self.merged = merge_ranks(
                    self.driven,
                    fetched,
                    self._initial,
                    (self.last, error.hang),
                    stepped=self.stepped,
                    after=self.after,
                    loads_apart=self.ranks.loads_apart,
                )
                return
        if not workers.alive or self.ranks._closed:
            self._lost = "the rank workers ended (or the system closed) before the recording was fetched"
            return
        answers = cast(list[tuple["Recording", list[int]]], self.ranks._all("recorded"))
        self.merged = merge_ranks(
            self.driven,
            answers,
            self._initial,
            stepped=self.stepped,
            after=self.after,
            loads_apart=self.ranks.loads_apart,
        )

    def recording(self) -> Recording:
        if self.merged is None:
            raise RecordingError(self._lost or "the two-rank recording is merged when its block ends")
        return self.merged

    def write(self, path: str | os.PathLike[str]) -> Recording:
        from refcache.hicache.recording import write_recording

        rec = self.recording()
        write_recording(path, rec)
        return rec


def merge_ranks(
    driven: Sequence[int | str | None],
    answers: Sequence[tuple[Recording, Sequence[int]]],
    initial: Sequence[RankSnapshot],
    hang: tuple[Op, NeverReturned] | None = None,
    *,
    stepped: Mapping[int, IOQueue] | None = None,
    after: Mapping[int, Sequence[RankSnapshot]] | None = None,
    loads_apart: bool = False,
) -> Recording:
    """One recording of N ranks from each rank's recording and marks (``RanksRecorder``). ``driven[k]``:
    None, every rank (lock step); r, rank r alone; ``RELEASED``, the parent handed every rank reduced
    storage all-reduces (L3), whose lines are the steps that release let through. ``stepped[k]``: the queue
    of the storage step driven entry ``k`` ran (its result said so): the step is written there, as
    ``CompleteIO(queue, r, 1)``, and the rank's recorder must see it — in that entry's lines or a later
    release's, in order per rank and queue (a step waits in its all-reduce until the peer took the same
    step); a step seen that no entry ran is a ``RecordingError``. ``after[k]``: every rank's snapshot after
    entry ``k`` where its lines do not show them (a release: the state after the operation that caused it;
    under MLA a rank's backup changes its peers' view of L3), put on the operation's last line. ``hang``: the last operation driven
    never returned on rank ``hang[1].rank`` (which marked no end for it): its lines recorded before the
    call (on a lock-step operation, the first lines of every peer's, alike), then the operation observed as
    ``hang[1]``, with no snapshot, end the recording. ``loads_apart`` (D-68, up to 0.5.12: each rank retires
    its own finished loads): the ranks' ``CheckHicacheEvents`` answers are joined by rank (``_join_loads``) and
    the snapshots say so (``Snapshot.loads_retired_per_rank``)."""
    from refcache.hicache.recording import Recording

    def joined_ranks(first: Snapshot, ranks: Sequence[RankSnapshot]) -> Snapshot:
        joined = join_ranks(first, ranks)
        return replace(joined, loads_retired_per_rank=True) if loads_apart else joined

    recs = [rec for rec, _ in answers]
    marks = [list(m) for _, m in answers]
    at, sent, now = [0] * len(recs), [0] * len(recs), list(initial)
    merged = Recording(recs[0].config, [], [], [], recs[0].source)
    stepped = stepped or {}
    after = after or {}
    unseen: dict[
        tuple[int, IOQueue], list[int]
    ] = {}  # merged lines of storage steps not seen yet, oldest first
    op_lines = (0, 0)  # the merged lines of the last operation driven (a release belongs to it)

    def lines(rank: int) -> range:
        if sent[rank] >= len(marks[rank]):
            raise RecordingError(f"rank {rank} marked {len(marks[rank])} operations, fewer than were sent it")
        start, at[rank] = at[rank], marks[rank][sent[rank]]
        sent[rank] += 1
        return range(start, at[rank])

    def emit(op: Op, line: dict[int, int]) -> None:
        first = min(line)
        snap = recs[first].snapshots[line[first]]
        for rank, index in line.items():
            own = recs[rank].snapshots[index]
            if own is not None:
                now[rank] = own.ranks[0]
        merged.ops.append(op)
        merged.observed.append(recs[first].observed[line[first]])
        merged.snapshots.append(None if snap is None else joined_ranks(snap, now))

    def not_a_step(rank: int, op: Op) -> None:
        """A storage step belongs to the rank that ran it (written where it ran, ``stepped``): in a lock-step
        or hung operation's lines it would be credited to rank 0, or written twice."""
        if isinstance(op, CompleteIO) and op.queue in _STORAGE_QUEUES:
            raise RecordingError(
                f"rank {rank} recorded the storage step {op!r} among a lock-step or hung operation's lines"
            )

    def seen_step(rank: int, i: int) -> None:
        """Rank ``rank``'s line ``i``, ``CompleteIO(queue, 0, n)``: the ``n`` oldest unseen steps it ran."""
        op = recs[rank].ops[i]
        assert isinstance(op, CompleteIO)
        waiting = unseen.get((rank, op.queue), [])
        if len(waiting) < op.count:
            raise RecordingError(
                f"rank {rank} recorded {op.count} {op.queue.value} step(s) where {len(waiting)} it was sent "
                "were not seen yet"
            )
        line = waiting[op.count - 1]
        del waiting[: op.count]
        own = recs[rank].snapshots[i]
        if own is not None:
            now[rank] = own.ranks[0]
            if line == len(merged.ops) - 1:  # seen at once: the state right after it
                merged.snapshots[line] = joined_ranks(own, now)

    def peers_moved(index: int) -> None:
        """``after[index]``: every rank's state now, on the last line of the operation driven last."""
        nonlocal now
        if index in after:
            now = list(after[index])
            start, end = op_lines
            base = merged.snapshots[end - 1] if end > start else None
            if base is not None:
                merged.snapshots[end - 1] = joined_ranks(base, now)

    for index, who in enumerate(driven):
        if who == RELEASED:
            for rank in range(len(recs)):
                for i in lines(rank):
                    op = recs[rank].ops[i]
                    if not (isinstance(op, CompleteIO) and op.queue in _STORAGE_QUEUES):
                        raise RecordingError(f"rank {rank} recorded {op!r} when storage all-reduces returned")
                    seen_step(rank, i)
            peers_moved(index)
            continue
        op_lines = (len(merged.ops), len(merged.ops))
        if hang is not None and index == len(driven) - 1:
            stuck = hang[1].rank
            pending = range(at[stuck], len(recs[stuck].ops))
            at[stuck] = len(recs[stuck].ops)
            span_of = {stuck: pending}
            if who is None:  # the peers returned: their spans begin with what the stuck rank recorded
                span_of |= {r: lines(r) for r in range(len(recs)) if r != stuck and sent[r] < len(marks[r])}
            said = {r: [(recs[r].ops[i], recs[r].observed[i]) for i in span] for r, span in span_of.items()}
            if any(other[: len(pending)] != said[stuck] for other in said.values()):
                raise RecordingError(f"the ranks recorded the operation that hung differently: {said}")
            for k, i in enumerate(pending):
                op = recs[stuck].ops[i]
                not_a_step(stuck, op)
                if isinstance(who, int):
                    if not isinstance(op, CompleteIO | AdvanceClock):
                        raise RecordingError(f"rank {who} recorded {op!r} on an operation sent to it alone")
                    op = replace(op, rank=who)
                emit(op, {r: span[k] for r, span in span_of.items()})
            merged.ops.append(hang[0])
            merged.observed.append(hang[1])
            merged.snapshots.append(None)
            break
        if who is None:
            spans = [lines(rank) for rank in range(len(recs))]
            seen = [[(recs[r].ops[i], recs[r].observed[i]) for i in span] for r, span in enumerate(spans)]
            if loads_apart:  # each rank's loads, joined by rank on every rank's line
                for k in range(len(spans[0]) if all(len(x) == len(spans[0]) for x in spans) else 0):
                    told = [line[k][1] for line in seen]
                    if all(isinstance(a, EventsResult) for a in told):
                        try:
                            joined = _join_loads(cast(list[EventsResult], told))
                        except RankError as error:
                            raise RecordingError(str(error)) from None
                        for r, span in enumerate(spans):
                            recs[r].observed[span[k]] = joined
                            seen[r][k] = (seen[r][k][0], joined)
            if any(other != seen[0] for other in seen[1:]):
                raise RecordingError(f"the ranks recorded one lock-step operation differently: {seen}")
            for k in range(len(spans[0])):
                not_a_step(0, recs[0].ops[spans[0][k]])
                emit(recs[0].ops[spans[0][k]], {r: span[k] for r, span in enumerate(spans)})
        elif isinstance(who, int):
            if index in stepped:  # written where it ran; seen when its result reaches the scheduler
                merged.ops.append(CompleteIO(stepped[index], who, 1))
                merged.observed.append(IOResult(1))
                merged.snapshots.append(None)
                unseen.setdefault((who, stepped[index]), []).append(len(merged.ops) - 1)
            for i in lines(who):
                op = recs[who].ops[i]
                if not isinstance(op, CompleteIO | AdvanceClock):
                    raise RecordingError(f"rank {who} recorded {op!r} on an operation sent to it alone")
                if isinstance(op, CompleteIO) and op.queue in _STORAGE_QUEUES:
                    seen_step(who, i)
                else:
                    emit(replace(op, rank=who), {who: i})
        op_lines = (op_lines[0], len(merged.ops))
        peers_moved(index)
    for rank, rec in enumerate(recs):
        if sent[rank] != len(marks[rank]) or at[rank] != len(rec.ops):
            raise RecordingError(
                f"rank {rank} recorded {len(rec.ops)} lines in {len(marks[rank])} operations; the merge "
                f"took {at[rank]} in {sent[rank]}"
            )
    return merged


# a rank worker: python -m refcache.engines.sglang._tp RANK SIZE INIT FD TIMEOUT SYSTEM
if __name__ == "__main__":
    _rank, _size, _init, _fd, _timeout_s, _system = sys.argv[1:7]
    _serve(int(_rank), int(_size), _init, Connection(int(_fd)), float(_timeout_s), _system)
    sys.stderr.flush()
    os._exit(0)  # nothing is left to finalise; tearing down torch and SGLang would take seconds
