"""The errors refcache raises.

A small hierarchy, in the spirit of Hypothesis' ``errors.py``: every class says when it is raised and
what to do about it. Every error raised at a public boundary leaves the cache exactly as it was.

``RefcacheException``: every exception class refcache defines (a catch-all; rarely what a caller wants).
    ``RefcacheError``: a typed outcome of an operation. A system may raise one instead of returning an
    observation, and the harness compares it across systems like an observation (``check.harness``).
        ``ConfigError`` (also a ``ValueError``): a configuration that cannot work.
            ``UnsupportedError``: a name that SGLang accepts but refcache deliberately does not model.
        ``UsageError``: an operation that is not valid in the current state (the caller's mistake). The
        command line reports it as a usage error, exit status 2.
        ``TransitionError``: a node state transition that the transition table does not allow (a bug in
        the system that raises it, never the caller's mistake; the machines fail on it).
        ``CorruptionError``: stored bytes do not match what was written (never expected).
        ``StorageIOError`` (also an ``OSError``): the L3 backend failed to read or write.
        ``TraceFormatError``: a trace file that this version cannot read.
        ``RecordingError``: an engine's calls that a recorder cannot express as operations.
    ``EngineFailure``: an engine's own machinery broke (not an outcome: the harness reports it as a crash
    of that system, which is then unusable).
        ``RankError`` (also a ``RuntimeError``): an engine's rank worker failed.
        ``refcache.engines.sglang._storage.EngineThreadError`` (also a ``RuntimeError``): one of SGLang's
        storage threads died or did not park.
    ``refcache.gpu.native.NativeUnavailable`` (also a ``RuntimeError``): ``REFCACHE_NATIVE=require`` and a C
    fast path could not be built or loaded.
    ``refcache.gpu.kv_oracle.NativeDisagreement`` (also an ``AssertionError``): the KV oracle's C path and
    its torch path disagree on one read (a bug in one of them).
    ``refcache.check.harness.Divergence`` (also an ``AssertionError``, so that Hypothesis and pytest report
    it as a failed check and shrink it): systems disagreed or an invariant broke.
    ``refcache.conformance.ConformanceError`` (also an ``AssertionError``, so that a third party's pytest
    reports a failed test): a system under the conformance kit broke its family's contract.

Outside it: ``refcache.check.run.BudgetSpent``, a ``KeyboardInterrupt`` that ends a run whose time budget is
spent — an ``Exception`` would be taken by Hypothesis for a failing example instead of stopping the run; and
``refcache.engines.lmcache._driver.WouldBlock`` and its private ``_Wait``, ``BaseException``s raised inside
LMCache's allocator when it would busy-wait for ever, so that LMCache's own ``except Exception`` handlers
cannot turn the hang into a quiet miss (the adapter reports it as an observation).

The classes outside this module subclass ``RefcacheException`` beside the base they had (``RuntimeError``,
``AssertionError``), so every ``except`` written against that base still catches them; they live with the
code that raises them because only that code (or an engine's tests) can raise them. None of them is a
``RefcacheError``: an outcome is something a system may rightly answer and another system must answer
alike, while these say the system, its C path or the check itself broke.

``RankError`` and ``RecordingError`` are raised by the engine adapters; they live here so that the command
line reports them without importing an engine. ``NeverReturned`` (what a recording writes for an operation
the engine never returned from, ``refcache.hicache.recording``) is defined here because ``RankError`` carries one;
this module imports nothing of refcache, so the vocabulary above it has no import circle.

No class says "capacity exhausted" (a ``CapacityError`` was listed here once and never raised): a pool that
cannot satisfy a request even after eviction is an observation in SGLang's semantics, never an exception —
a request not admitted (``StartResult.admitted``), a write-back that finds no host memory dropping its leaf
(D-10), a prefetch refused (``PrefetchResult.reason``). Raising instead would change the observations every
system, trace and recording agrees on.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ConfigError",
    "CorruptionError",
    "EngineFailure",
    "NeverReturned",
    "RankError",
    "RecordingError",
    "RefcacheError",
    "RefcacheException",
    "StorageIOError",
    "TraceFormatError",
    "TransitionError",
    "UnsupportedError",
    "UsageError",
]


class RefcacheException(Exception):
    """Base class of every exception class refcache defines, outcomes (``RefcacheError``) and failures
    alike. Catch it only where anything refcache raises is handled the same way (a top-level report)."""


class RefcacheError(RefcacheException):
    """Base class of the typed outcomes: an operation's error a system raises on purpose and leaves its state
    unchanged. The harness compares them across systems; catch this to handle every outcome error."""


class ConfigError(RefcacheError, ValueError):
    """Raised by ``HiCacheConfig`` validation when options contradict each other or are out of range.

    The message names the option, the value given and what would work. Nothing has been built yet, so
    fixing the option and constructing again is always safe.
    """


class UnsupportedError(ConfigError):
    """Raised for names SGLang accepts but that are outside refcache's scope (Ascend NPU backends, SWA and
    Mamba caches, ...). Pick one of the supported values the message lists."""


class UsageError(RefcacheError):
    """Raised when an operation is not valid in the current state: an unknown request id, a request that
    is already running, a rank or queue that does not exist. The cache is unchanged; fix the caller. The
    command line reports it as a usage error (exit status 2)."""


class TransitionError(RefcacheError):
    """Raised by ``refcache.hicache.states.next_state`` (``next_stage``) when a node (a prefetch operation's
    stage) would move along an edge its transition table does not have.

    This is a bug in the system that raised it (the model or the implementation; a bug zoo entry shows it
    as that system's outcome), never bad input: it is not a ``UsageError``. The node (stage) is unchanged. A
    checking run fails on it even when every system raises it alike; report the trace.
    """


class CorruptionError(RefcacheError):
    """Raised when bytes read back differ from what was written (checksum, key or content mismatch).

    Never expected. The object in question is treated as absent; report the message, which names the
    key and the mismatching field.
    """


class StorageIOError(RefcacheError, OSError):
    """Raised when the L3 backend cannot read or write (no space, read-only directory, vanished file).
    The page in question is reported as not stored; nothing half-written is visible."""


class TraceFormatError(RefcacheError, ValueError):
    """Raised when a trace file is malformed or was written by an incompatible format version. The
    message names the line and what was expected."""


class RecordingError(RefcacheError):
    """Raised by a recorder (``refcache.engines.sglang.record``) before the engine runs a call, when the
    engine's call sequence is one the operation alphabet cannot express (the message says which, and for
    an admission the stages it could have taken). Nothing is recorded for the call; the recording so far
    stays valid (it is written on exit)."""


class EngineFailure(RefcacheException):
    """Base class of an engine's own failures (a rank worker, a storage thread). Not an outcome: the harness
    reports it as a crash of that system. The system is unusable; close it and open a new one."""


@dataclass(frozen=True)
class NeverReturned:
    """What a recorder writes as the observation of an operation the engine never returned from: rank
    ``rank`` waits in its all-reduce number ``all_reduce`` (called from ``called_from``, innermost first),
    which rank ``peer`` never entered (it returned after ``peer_all_reduces``; both count the scheduler's
    all-reduces since the recording began, so they do not depend on what the pooled rank worker ran before)
    — a hang (under NCCL; the two-rank adapter ends the workers there, ``refcache.engines.sglang._tp``). No
    system returns it, so a replay diverges at this line; nothing is recorded after it. ``RankError.hang``
    carries one; ``refcache.hicache.recording`` re-exports it (its public home)."""

    rank: int
    all_reduce: int
    called_from: str
    peer: int
    peer_all_reduces: int


class RankError(EngineFailure, RuntimeError):
    """A rank worker failed: it raised something other than an error every rank raised alike, the ranks
    answered differently, it died, or it did not answer in time. ``rank`` is the rank (None: all of them)
    and ``remote_traceback`` the worker's traceback when it had one; ``hang``, for a rank stuck in an
    all-reduce its peer never entered, says which (what a recording writes for the operation). The workers
    are ended; the system is unusable (open a new one). Raised by ``refcache.engines.sglang``."""

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        remote_traceback: str = "",
        hang: NeverReturned | None = None,
    ) -> None:
        super().__init__(
            message + (f"\n--- rank {rank} traceback ---\n{remote_traceback}" if remote_traceback else "")
        )
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.hang = hang
