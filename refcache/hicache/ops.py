"""The operation alphabet: every scheduler call and every background event, as data.

Model and implementation both expose ``apply(op) -> Observation``. Scheduler operations are applied to
every tensor-parallel rank in lock step (the scheduler runs the same program on each rank); background
operations name one rank and one I/O queue, so a test decides exactly which rank's copy, load, prefetch
or backup finishes when — each interleaving is an explicit, shrinkable, replayable step.

Every operation is a frozen dataclass whose ``repr`` is valid Python (Hypothesis prints failing runs as
programs) and which round-trips through ``op_to_json`` / ``op_from_json`` (the trace format,
``specs/trace-format.md``). Observations are frozen dataclasses too, compared field by field.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from array import array
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Final

from refcache.errors import TraceFormatError, UsageError

__all__ = [
    "OPS",
    "AbortPrefetch",
    "AbortRequest",
    "AdvanceClock",
    "CacheUnfinishedRequest",
    "CheckHicacheEvents",
    "CheckPrefetchProgress",
    "CompleteIO",
    "EventsResult",
    "Evict",
    "EvictHost",
    "EvictHostResult",
    "EvictResult",
    "FaultKind",
    "FinishRequest",
    "FinishResult",
    "IOQueue",
    "IOResult",
    "MatchPrefix",
    "MatchResult",
    "Observation",
    "Op",
    "PrefetchFromStorage",
    "PrefetchResult",
    "ProgressResult",
    "Reset",
    "ResetResult",
    "StartRequest",
    "StartResult",
    "StorageFault",
    "check_op",
    "omitted",
    "op_from_json",
    "op_to_json",
]

Tokens = tuple[int, ...]


def omitted(field: dataclasses.Field[object], value: object) -> bool:
    """Whether ``field`` is left out where it holds ``value``: a field marked ``omit_default`` (added after
    traces existed) at its default, so traces, recordings and printed programs without it keep their form."""
    return bool(field.metadata.get("omit_default")) and value == field.default


def _repr_omitting_defaults(self: object) -> str:
    """The dataclass ``repr`` (valid Python, so printed programs replay) without the ``omitted`` fields."""
    assert dataclasses.is_dataclass(self)
    values = ((f, getattr(self, f.name)) for f in dataclasses.fields(self))
    shown = ", ".join(f"{f.name}={value!r}" for f, value in values if not omitted(f, value))
    return f"{type(self).__name__}({shown})"


class _ReprEnum(enum.StrEnum):
    """A string enum whose ``repr`` is valid Python (``IOQueue.WRITE``), so printed programs replay."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class IOQueue(_ReprEnum):
    """The background queues of one rank's HiCacheController (seed §2, §3.7)."""

    WRITE = "write"  # L1→L2 device-to-host copy (ack_write_queue)
    LOAD = "load"  # L2→L1 host-to-device copy, all layers (ack_load_queue)
    PREFETCH_QUERY = "prefetch_query"  # prefetch thread: storage-hit query + MIN all-reduce over ranks
    PREFETCH_IO = "prefetch_io"  # prefetch I/O helper: one storage batch (storage_batch_size pages) L3→L2
    BACKUP = "backup"  # backup thread: one L2→L3 operation


class FaultKind(_ReprEnum):
    """Storage faults a test may inject into one rank's view of L3."""

    CORRUPT = "corrupt"  # the object at ``index`` still exists but can no longer be read (checksum mismatch)
    DELETE = "delete"  # the object at ``index`` vanishes (backend eviction, deleted file)
    FAIL_NEXT_WRITE = "fail_next_write"  # this rank's next L3 write batch fails
    FAIL_NEXT_READ = "fail_next_read"  # this rank's next L3 read batch fails
    # Real storage failures (appended: the older kinds keep their meaning in every trace). Each damaged
    # object stays present (the hit query counts it) and is a miss when read, which deletes it.
    FLIP_PAYLOAD = "flip_payload"  # one payload byte of the object at ``index`` changes (bit rot)
    MISPLACED = "misplaced"  # the object at ``index`` is overwritten by a copy of the next key's object
    STALE = "stale"  # the object at ``index`` is one an older writer left (an older format version)
    DISK_FULL = "disk_full"  # the disk has room for ``index % 3`` more pages; the next is cut short (ENOSPC)
    FAIL_PUBLISH = "fail_publish"  # the next write batch that writes a page cannot rename it into place


# --- scheduler operations (applied to every rank) ----------------------------------------------------------


@dataclass(frozen=True)
class MatchPrefix:
    """``match_prefix(key)``: look up the longest cached prefix (may split a node; never locks)."""

    tokens: Tokens
    extra_key: str | None = None


@dataclass(frozen=True)
class StartRequest:
    """Admit request ``rid``: match, lock, load back the host hit, allocate and compute the rest.

    ``prompt_len``: how many of ``tokens`` are the prompt (the rest is output); ``None`` when the trace does
    not say (all prompt). Only ``HiCacheConfig.reinsert_prompt_prefix`` reads it (D-24).
    """

    rid: int
    tokens: Tokens
    extra_key: str | None = None
    prompt_len: int | None = dataclasses.field(default=None, metadata={"omit_default": True})

    __repr__ = _repr_omitting_defaults


@dataclass(frozen=True)
class CacheUnfinishedRequest:
    """``cache_unfinished_req(chunked=True)``: insert the request's KV so far, keep it running."""

    rid: int


@dataclass(frozen=True)
class FinishRequest:
    """``cache_finished_req``: insert the request's KV, free duplicates and the unaligned tail, unlock."""

    rid: int


@dataclass(frozen=True)
class AbortRequest:
    """Drop a running request without caching its KV: free what the tree does not own, unlock."""

    rid: int


@dataclass(frozen=True)
class Evict:
    """``evict(num_tokens)``: L1 eviction (seed §3.1)."""

    num_tokens: int


@dataclass(frozen=True)
class EvictHost:
    """``evict_host(num_tokens)``: L2 eviction (seed §3.2)."""

    num_tokens: int


@dataclass(frozen=True)
class PrefetchFromStorage:
    """The scheduler's ``_prefetch_kvcache``: match, then ``prefetch_from_storage`` of the missing tail."""

    rid: int
    tokens: Tokens
    extra_key: str | None = None


@dataclass(frozen=True)
class CheckPrefetchProgress:
    """``check_prefetch_progress(rid)``: terminate and insert the prefetch if its policy allows."""

    rid: int


@dataclass(frozen=True)
class AbortPrefetch:
    """``release_aborted_request(rid)``: give up a prefetch whose request was aborted."""

    rid: int


@dataclass(frozen=True)
class CheckHicacheEvents:
    """``check_hicache_events``: writing_check, loading_check, drain_storage_control_queues."""


@dataclass(frozen=True)
class Reset:
    """``flush_cache`` → ``reset()``; refused (nothing changes) unless idle and drained."""


# --- background events (one rank, one queue) ---------------------------------------------------------------


@dataclass(frozen=True)
class CompleteIO:
    """The oldest ``count`` jobs of ``queue`` on ``rank`` finish (fewer if fewer are runnable)."""

    queue: IOQueue
    rank: int = 0
    count: int = 1


@dataclass(frozen=True)
class AdvanceClock:
    """The logical clock moves forward by ``us`` microseconds (prefetch timeouts): every rank's clock
    (``rank=None``), or only ``rank``'s, as each rank of a real scheduler reads its own ``time.monotonic()``
    (D-41: a prefetch may time out on one rank and not yet on another)."""

    us: int
    rank: int | None = dataclasses.field(default=None, metadata={"omit_default": True})

    __repr__ = _repr_omitting_defaults


@dataclass(frozen=True)
class StorageFault:
    """Inject a storage fault on ``rank``; ``index`` picks an object of the rank's sorted L3 view."""

    kind: FaultKind
    rank: int = 0
    index: int = 0


Op = (
    MatchPrefix
    | StartRequest
    | CacheUnfinishedRequest
    | FinishRequest
    | AbortRequest
    | Evict
    | EvictHost
    | PrefetchFromStorage
    | CheckPrefetchProgress
    | AbortPrefetch
    | CheckHicacheEvents
    | Reset
    | CompleteIO
    | AdvanceClock
    | StorageFault
)

OPS: Final[tuple[type[Op], ...]] = typing.get_args(Op)

# --- observations ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MatchResult:
    """``match_prefix``: device hit, host-only hit above it, and where the two nodes end (token depth)."""

    device_len: int
    host_hit_length: int
    last_node_depth: int
    last_host_node_depth: int


@dataclass(frozen=True)
class StartResult:
    """Admission: ``admitted`` is False when the device pool cannot hold the request even after eviction."""

    admitted: bool
    device_hit: int
    loaded: int
    computed: int


@dataclass(frozen=True)
class FinishResult:
    """``insert`` result for the request and how many of its device tokens went back to the pool."""

    prefix_len: int
    freed: int


@dataclass(frozen=True)
class EvictResult:
    num_evicted: int


@dataclass(frozen=True)
class EvictHostResult:
    num_evicted: int


@dataclass(frozen=True)
class PrefetchResult:
    """Whether the prefetch was admitted; ``reason`` says which admission layer refused it."""

    admitted: bool
    reason: str
    tokens: int


@dataclass(frozen=True)
class ProgressResult:
    """``done`` as ``check_prefetch_progress`` returns it; ``inserted`` host tokens newly in the tree."""

    done: bool
    inserted: int


@dataclass(frozen=True)
class EventsResult:
    """How many acknowledgements each part of ``check_hicache_events`` retired (same on every rank), but
    under D-68 (``loads_retired_per_rank``, SGLang up to 0.5.12) with two ranks or more, where each rank retires
    the loads its own stream finished: where the ranks' counts differ, ``loads_by_rank`` is each rank's in rank
    order and ``loads`` their minimum; ``()`` where every rank retired ``loads``."""

    writes: int
    loads: int
    revoked: int
    backups: int
    host_releases: int
    loads_by_rank: tuple[int, ...] = dataclasses.field(default=(), metadata={"omit_default": True})


@dataclass(frozen=True)
class IOResult:
    """How many jobs actually completed on that rank's queue."""

    completed: int


@dataclass(frozen=True)
class ResetResult:
    flushed: bool


@dataclass(frozen=True)
class Done:
    """Operations with nothing to report (clock, faults, unfinished-request caching, aborts)."""


Observation = (
    MatchResult
    | StartResult
    | FinishResult
    | EvictResult
    | EvictHostResult
    | PrefetchResult
    | ProgressResult
    | EventsResult
    | IOResult
    | ResetResult
    | Done
)

# --- JSON codec --------------------------------------------------------------------------------------------

_BY_NAME: Final[dict[str, type[Op]]] = {cls.__name__: cls for cls in OPS}


def op_to_json(op: Op) -> dict[str, object]:
    """``{"op": "ClassName", field: value, ...}`` with tuples as lists and enums as strings."""
    out: dict[str, object] = {"op": type(op).__name__}
    for field in dataclasses.fields(op):
        value = getattr(op, field.name)
        if omitted(field, value):
            continue  # a field added later: traces without it keep their exact form
        if isinstance(value, enum.Enum):
            out[field.name] = value.value
        elif isinstance(value, tuple):
            out[field.name] = list(value)
        else:
            out[field.name] = value
    return out


def _decode_field(cls: type[Op], name: str, hint: object, raw: object) -> object:
    where = f"{cls.__name__}.{name}"
    if hint is int:
        if not isinstance(raw, int) or isinstance(raw, bool):
            raise TraceFormatError(f"{where} must be an integer, got {raw!r}")
        return raw
    if hint == Tokens:
        if not isinstance(raw, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            raise TraceFormatError(f"{where} must be a list of integers, got {raw!r}")
        return tuple(raw)
    if hint == int | None:
        if raw is not None and (not isinstance(raw, int) or isinstance(raw, bool)):
            raise TraceFormatError(f"{where} must be an integer or null, got {raw!r}")
        return raw
    if hint == str | None:
        if raw is not None and not isinstance(raw, str):
            raise TraceFormatError(f"{where} must be a string or null, got {raw!r}")
        return raw
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(raw)
        except ValueError:
            raise TraceFormatError(f"{where}={raw!r} is not one of {[m.value for m in hint]}") from None
    raise TraceFormatError(f"{where}: no decoder for {hint!r}")  # pragma: no cover - a new field type


def op_from_json(data: dict[str, object]) -> Op:
    """Inverse of ``op_to_json``. Raises ``TraceFormatError`` naming the bad field."""
    name = data.get("op")
    if not isinstance(name, str) or name not in _BY_NAME:
        raise TraceFormatError(f"unknown operation {name!r}; known: {sorted(_BY_NAME)}")
    cls = _BY_NAME[name]
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(data) - fields - {"op"})
    if extra:
        raise TraceFormatError(f"{name} has no fields {extra}")
    kwargs: dict[str, object] = {}
    for field in dataclasses.fields(cls):
        if field.name in data:
            kwargs[field.name] = _decode_field(cls, field.name, hints[field.name], data[field.name])
        elif field.default is dataclasses.MISSING:
            raise TraceFormatError(f"{name} is missing field {field.name!r}")
    return cls(**kwargs)  # type: ignore[arg-type]


# --- preconditions ------------------------------------------------------------------------------------------

_UINT32: Final = next(code for code in "IL" if array(code).itemsize == 4)
"""The ``array`` type code of a 32-bit unsigned integer on this platform."""


def _all_uint32(tokens: Sequence[int]) -> bool:
    """Whether every token is an int in ``[0, 2**32)``: one pass in C (an ``array`` of uint32 refuses any
    other value), about three times faster than ``min`` and ``max`` over a long request."""
    try:
        array(_UINT32, tokens)
    except (OverflowError, TypeError):
        return False
    return True


def check_op(
    op: Op, *, tp_size: int, is_eagle: bool, running: Container[int], prefetching: Container[int]
) -> None:
    """The alphabet's preconditions, shared by every system so that all reject the same operations.

    ``running`` holds the ids of running requests and ``prefetching`` those with a prefetch in progress.
    Raises ``UsageError`` naming what is wrong; callers check before changing anything.
    """
    match op:
        case StartRequest(rid, tokens, extra_key) | PrefetchFromStorage(rid, tokens, extra_key):
            if extra_key == "":
                raise UsageError("extra_key must be None (no namespace) or a non-empty string")
            if len(tokens) < (2 if is_eagle else 1):
                raise UsageError("a request needs at least one token (two in EAGLE bigram mode)")
            bad = [] if _all_uint32(tokens) else [t for t in tokens if not 0 <= t < 2**32]
            if bad:
                raise UsageError(f"token ids must fit in uint32; got {bad[:3]}")
            prompt_len = op.prompt_len if isinstance(op, StartRequest) else None
            if prompt_len is not None and not 0 < prompt_len <= len(tokens):
                raise UsageError(
                    f"prompt_len must be between 1 and the number of tokens ({len(tokens)}), got {prompt_len}"
                )
            if rid in running:
                raise UsageError(f"request {rid} is already running")
            if rid in prefetching:
                raise UsageError(
                    f"request {rid} has a prefetch in progress; apply CheckPrefetchProgress({rid}) until it "
                    f"reports done, or AbortPrefetch({rid})"
                )
        case CacheUnfinishedRequest(rid) | FinishRequest(rid) | AbortRequest(rid):
            if rid not in running:
                raise UsageError(f"request {rid} is not running; start it with StartRequest first")
        case Evict(n) | EvictHost(n):
            if n < 0:
                raise UsageError(f"num_tokens must be >= 0, got {n}")
        case CompleteIO(_, rank, count) | StorageFault(_, rank, count):
            if not 0 <= rank < tp_size:
                raise UsageError(f"rank {rank} does not exist; tp_size is {tp_size}")
            if count < 0:
                raise UsageError(
                    f"{'count' if isinstance(op, CompleteIO) else 'index'} must be >= 0, got {count}"
                )
        case AdvanceClock(us, rank):
            if us < 0:
                raise UsageError(f"the clock only moves forward; got us={us}")
            if rank is not None and not 0 <= rank < tp_size:
                raise UsageError(f"rank {rank} does not exist; tp_size is {tp_size}")
        case _:
            pass
