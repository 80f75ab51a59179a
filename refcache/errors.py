"""The errors refcache raises.

A small hierarchy, in the spirit of Hypothesis' ``errors.py``: every class says when it is raised and
what to do about it. Every error raised at a public boundary leaves the cache exactly as it was.

``RefcacheError``
    ``ConfigError`` (also a ``ValueError``): a configuration that cannot work.
        ``UnsupportedError``: a name that SGLang accepts but refcache deliberately does not model.
    ``UsageError``: an operation that is not valid in the current state (the caller's mistake).
        ``TransitionError``: a node state transition that the transition table does not allow.
    ``CapacityError``: a pool is exhausted even after eviction (expected, recoverable).
    ``CorruptionError``: stored bytes do not match what was written (never expected).
    ``StorageIOError`` (also an ``OSError``): the L3 backend failed to read or write.
    ``TraceFormatError``: a trace file that this version cannot read.
    ``RecordingError``: an engine's calls that a recorder cannot express as operations.

``RankError`` (a ``RuntimeError``, not a ``RefcacheError``): an engine's rank worker failed.

The engine adapters raise the last two; they live here so that the command line reports them without
importing an engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refcache.recording import NeverReturned

__all__ = [
    "CapacityError",
    "ConfigError",
    "CorruptionError",
    "RankError",
    "RecordingError",
    "RefcacheError",
    "StorageIOError",
    "TraceFormatError",
    "TransitionError",
    "UnsupportedError",
    "UsageError",
]


class RefcacheError(Exception):
    """Base class of every error refcache raises on purpose. Catch this to catch them all."""


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
    is already running, a rank or queue that does not exist. The cache is unchanged; fix the caller."""


class TransitionError(UsageError):
    """Raised when a node would move between states along an edge the transition table does not have.

    This signals a bug in the caller (the model or an implementation), never bad user input. The node is
    unchanged.
    """


class CapacityError(RefcacheError):
    """Raised when a pool cannot satisfy an allocation even after eviction. Expected under load: callers
    either retry after releasing something or report a miss. The pool is unchanged."""


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
    """The engine made a call sequence the operation alphabet cannot express (the message says which)."""


class RankError(RuntimeError):
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
