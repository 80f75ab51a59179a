"""The LMCache operation alphabet: the serving engine's calls into ``LMCacheEngine`` and the background
executors' steps, as data.

An LMCache system (the reference model, the adapter over LMCache's own code) exposes ``apply(op) ->
observation``. It plays the serving engine's connector: ``Store`` and ``Retrieve`` move a request's KV between
the engine's paged buffer and LMCache (``LMCacheEngine.store`` / ``retrieve``), ``Lookup`` is the scheduler's
``lookup`` (optionally pinning the hit under a lookup id), ``LookupUnpin`` releases those pins, ``Prefetch``
is ``async_lookup_and_prefetch`` and ``PollPrefetch`` the scheduler reading the lookup server's answer.

What LMCache runs in the background is gated: a write to the local disk or the remote tier, and a
prefetch's read from either, is a job in a queue (``Queue``) that runs only when ``Step(queue, count)`` says
so, so every interleaving is an explicit, shrinkable step. ``StorageFault`` damages the disk or remote tier
the way HiCache's L3 fault kinds do (``refcache.hicache.ops.FaultKind``).

Every operation is a frozen dataclass whose ``repr`` is valid Python and which round-trips through
``op_to_json`` / ``op_from_json`` (traces: ``refcache.lmcache.family.TRACES``). Cached content is named by
``NodeId`` (namespace and the tokens from the first one to the chunk's end), never by LMCache's chunk
hashes, so the model needs no hash function and an adapter maps each ``CacheEngineKey`` back to the
content it stands for. Lookup ids are integers (an adapter passes ``str(lookup_id)``).
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass
from typing import Final

from refcache.errors import TraceFormatError, UsageError
from refcache.family import NodeId
from refcache.lmcache.config import LMCacheConfig

__all__ = [
    "NAMESPACE",
    "OPS",
    "Blocked",
    "Clear",
    "ClearResult",
    "Done",
    "FaultKind",
    "LMCacheObservation",
    "LMCacheOp",
    "Lookup",
    "LookupResult",
    "LookupUnpin",
    "PollPrefetch",
    "Prefetch",
    "PrefetchResult",
    "Queue",
    "Retrieve",
    "RetrieveResult",
    "Step",
    "StepResult",
    "StorageFault",
    "Store",
    "StoreResult",
    "Tier",
    "check_op",
    "chunk_key",
    "chunk_keys",
    "op_from_json",
    "op_to_json",
]

Tokens = tuple[int, ...]

NAMESPACE: Final = ""
"""The ``NodeId.namespace`` of every chunk: LMCache's key also holds the model name, world size, worker id,
dtype and request tags, which are the same for every operation of one system."""


def chunk_keys(tokens: Tokens, chunk_size: int, save_unfull_chunk: bool) -> tuple[NodeId, ...]:
    """The chain of chunk keys of ``tokens`` (``ChunkedTokenDatabase.process_tokens``): one per full chunk,
    plus the trailing partial chunk when ``save_unfull_chunk``; each names the tokens from the first one to
    the chunk's end (LMCache's prefix hash chain stands for exactly that)."""
    end = len(tokens) if save_unfull_chunk else len(tokens) - len(tokens) % chunk_size
    return tuple(chunk_key(tokens[: min(i + chunk_size, end)]) for i in range(0, end, chunk_size))


def chunk_key(path: Tokens) -> NodeId:
    """The key of the chunk that ends where ``path`` ends."""
    return NodeId(NAMESPACE, path)


class _ReprEnum(enum.StrEnum):
    """A string enum whose ``repr`` is valid Python (``Queue.DISK``), so printed programs replay."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class Queue(_ReprEnum):
    """A background executor whose jobs run only when ``Step`` says so."""

    DISK = "disk"  # LocalDiskWorker's executor: puts (write a file, then publish the key) and prefetch reads;
    #                it runs prefetch reads before puts, each kind in submission order (its priority queue)
    REMOTE = "remote"  # the remote connector's puts and prefetch reads on the storage manager's loop, FIFO


class Tier(_ReprEnum):
    """A storage tier below CPU memory that faults can be injected into."""

    DISK = "disk"  # LocalDiskBackend
    REMOTE = "remote"  # RemoteBackend (fs:// in the adapter)


class FaultKind(_ReprEnum):
    """Storage faults on one tier (the names and meanings of ``refcache.hicache.ops.FaultKind``)."""

    CORRUPT = "corrupt"  # the object at ``index`` still exists but its bytes are damaged
    DELETE = "delete"  # the object at ``index`` vanishes behind the tier's back (a deleted file)
    FAIL_NEXT_WRITE = "fail_next_write"  # the tier's next write fails (the job raises)
    FAIL_NEXT_READ = "fail_next_read"  # the tier's next read fails (the job raises)


# --- the serving engine's calls ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Store:
    """``store(tokens, mask)``: the KV of ``tokens`` is copied out of the engine's buffer chunk by chunk, the
    first ``skip`` tokens (a multiple of the chunk size: LMCache's mask) excepted, and written through every
    tier (``StorageManager.batched_put``)."""

    tokens: Tokens
    skip: int = 0


@dataclass(frozen=True)
class Lookup:
    """``lookup(tokens, lookup_id=..., pin=...)``: how many prefix tokens LMCache holds, over every tier in
    order; with ``pin`` the hit chunks are pinned under ``lookup_id`` until ``LookupUnpin``."""

    tokens: Tokens
    lookup_id: int | None = None
    pin: bool = False


@dataclass(frozen=True)
class Retrieve:
    """``retrieve(tokens, mask, req_id=lookup_id)``: the longest cached prefix of ``tokens`` after ``skip``
    (a multiple of the chunk size) is copied into the engine's buffer; a hit below CPU is promoted into CPU.
    With async loading it takes what the prefetch under ``lookup_id`` loaded."""

    tokens: Tokens
    skip: int = 0
    lookup_id: int | None = None


@dataclass(frozen=True)
class LookupUnpin:
    """``lookup_unpin(lookup_id)``: release the pins of a pinned lookup, or the objects a prefetch under that
    id loaded (``cleanup_memory_objs``). An id that holds nothing is a no-op."""

    lookup_id: int


@dataclass(frozen=True)
class Prefetch:
    """``async_lookup_and_prefetch(lookup_id, tokens, pin=...)`` (async loading only): the prefix hit of every
    tier is found and its loads start (CPU hits at once; disk and remote reads as ``Queue`` jobs)."""

    tokens: Tokens
    lookup_id: int
    pin: bool = False


@dataclass(frozen=True)
class PollPrefetch:
    """The scheduler asks whether the prefetch under ``lookup_id`` answered (the lookup server's reply)."""

    lookup_id: int


@dataclass(frozen=True)
class Clear:
    """``clear(tokens)``: with ``tokens``, remove their chunks from every tier; with none, clear every tier
    that supports it."""

    tokens: Tokens | None = None


# --- background steps and faults ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """Run the next ``count`` jobs of ``queue`` to completion, in its order (``Queue``)."""

    queue: Queue
    count: int = 1


@dataclass(frozen=True)
class StorageFault:
    """Inject a fault into ``tier``; ``index`` picks an object of the tier's sorted key view (CORRUPT, DELETE;
    nothing happens on an empty tier)."""

    tier: Tier
    kind: FaultKind
    index: int = 0


LMCacheOp = Store | Lookup | Retrieve | LookupUnpin | Prefetch | PollPrefetch | Clear | Step | StorageFault
OPS: Final[tuple[type[LMCacheOp], ...]] = typing.get_args(LMCacheOp)

# --- observations --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreResult:
    stored: int  # tokens whose chunks were allocated and handed to batched_put (allocation stops at a miss)


@dataclass(frozen=True)
class LookupResult:
    hit: int  # prefix tokens held, over the tiers in order (a chunk boundary, or the end of the tokens)


@dataclass(frozen=True)
class RetrieveResult:
    retrieved: int  # tokens of ret_mask set: a prefix of the chunks after ``skip``


@dataclass(frozen=True)
class PrefetchResult:
    done: bool  # the lookup server has answered
    hit: int  # its answer: the prefix tokens the prefetch loaded (0 until done)


@dataclass(frozen=True)
class StepResult:
    done: tuple[NodeId, ...]  # the keys of the jobs that ran, in the order they ran


@dataclass(frozen=True)
class ClearResult:
    removed: int  # clear()'s return value: tokens cleared (no tokens) or entries removed (tokens given)


@dataclass(frozen=True)
class Blocked:
    """An operation that would wait forever (the CPU allocator's busy-wait when nothing can be evicted).
    Only an adapter reports it; the reference model never blocks, so it is always a divergence."""

    where: str


@dataclass(frozen=True)
class Done:
    """Operations with nothing to report."""


LMCacheObservation = (
    StoreResult | LookupResult | RetrieveResult | PrefetchResult | StepResult | ClearResult | Blocked | Done
)

# --- preconditions -------------------------------------------------------------------------------------------


def _check_tokens(tokens: Tokens) -> None:
    if not tokens:
        raise UsageError("an operation on tokens needs at least one token")
    bad = [t for t in tokens if not 0 <= t < 2**32]
    if bad:
        raise UsageError(f"token ids must fit in uint32; got {bad[:3]}")


def check_op(
    op: LMCacheOp,
    config: LMCacheConfig,
    pinned_ids: frozenset[int],
    prefetch_ids: frozenset[int],
    queued: typing.Mapping[Queue, int],
    answered: frozenset[int] = frozenset(),
) -> None:
    """The alphabet's preconditions, shared by every LMCache system so that all reject the same operations:
    ``pinned_ids`` are the lookup ids holding pins, ``prefetch_ids`` those with a prefetch started and not
    yet released, ``answered`` those of them whose prefetch has answered with a hit (LMCache registers no
    loading event for a prefetch that found nothing, so a ``Retrieve`` under it has nothing to take; a serving
    engine never loads a request whose lookup found nothing), ``queued`` the jobs waiting in each queue.

    Raises ``UsageError`` naming what is wrong; callers check before changing anything.
    """
    match op:
        case Store(tokens, skip) | Retrieve(tokens, skip, _):
            _check_tokens(tokens)
            if skip < 0 or skip % config.chunk_size or skip > len(tokens):
                raise UsageError(
                    f"skip must be a multiple of the chunk size {config.chunk_size} within the tokens; got {skip}"
                )
            if (
                isinstance(op, Retrieve)
                and config.async_loading
                and (op.lookup_id is None or op.lookup_id not in answered)
            ):
                raise UsageError(
                    "with async loading a Retrieve takes what a prefetch loaded: give the lookup_id of a Prefetch "
                    "that has answered with a hit (PollPrefetch)"
                )
        case Lookup(tokens, lookup_id, pin):
            _check_tokens(tokens)
            if pin and lookup_id is None:
                raise UsageError("a pinned lookup needs a lookup_id (lookup_unpin releases its pins)")
            if pin and lookup_id in pinned_ids | prefetch_ids:
                raise UsageError(
                    f"lookup id {lookup_id} already holds pins or a prefetch; LookupUnpin it first"
                )
        case Prefetch(tokens, lookup_id, _):
            _check_tokens(tokens)
            if not config.async_loading:
                raise UsageError(
                    "Prefetch needs async loading (hicache_storage_prefetch_policy=wait_complete)"
                )
            if lookup_id in pinned_ids | prefetch_ids:
                raise UsageError(
                    f"lookup id {lookup_id} already holds pins or a prefetch; LookupUnpin it first"
                )
        case PollPrefetch(lookup_id):
            if lookup_id not in prefetch_ids:
                raise UsageError(f"no prefetch under lookup id {lookup_id}; start one with Prefetch")
        case Clear(tokens):
            if tokens is not None:
                _check_tokens(tokens)
        case Step(queue, count):
            if count < 1:
                raise UsageError(f"Step runs at least one job; got count={count}")
            if not queued.get(queue, 0):
                raise UsageError(f"no job is waiting in the {queue.value} queue")
        case StorageFault(tier, _, index):
            if index < 0:
                raise UsageError(f"index must be >= 0; got {index}")
            if tier is Tier.DISK and not config.disk:
                raise UsageError("this configuration has no local disk tier")
            if tier is Tier.REMOTE and not config.remote:
                raise UsageError("this configuration has no remote tier")
        case _:
            pass


# --- JSON codec ----------------------------------------------------------------------------------------------

_BY_NAME: Final[dict[str, type[LMCacheOp]]] = {cls.__name__: cls for cls in OPS}
_ENUMS: Final[dict[object, type[_ReprEnum]]] = {Queue: Queue, Tier: Tier, FaultKind: FaultKind}


def op_to_json(op: LMCacheOp) -> dict[str, object]:
    """``{"op": "ClassName", field: value, ...}`` with tuples as lists and enums as their values."""
    out: dict[str, object] = {"op": type(op).__name__}
    for field in dataclasses.fields(op):
        value = getattr(op, field.name)
        if isinstance(value, tuple):
            out[field.name] = list(value)
        elif isinstance(value, enum.Enum):
            out[field.name] = value.value
        else:
            out[field.name] = value
    return out


def _is_int(raw: object) -> bool:
    return isinstance(raw, int) and not isinstance(raw, bool)


def _decode_field(where: str, hint: object, raw: object) -> object:
    if hint is int:
        if not _is_int(raw):
            raise TraceFormatError(f"{where} must be an integer, got {raw!r}")
        return raw
    if hint == int | None:
        if raw is not None and not _is_int(raw):
            raise TraceFormatError(f"{where} must be an integer or null, got {raw!r}")
        return raw
    if hint is bool:
        if not isinstance(raw, bool):
            raise TraceFormatError(f"{where} must be true or false, got {raw!r}")
        return raw
    if hint in (Tokens, Tokens | None):
        if raw is None and hint == Tokens | None:
            return None
        if not isinstance(raw, list) or not all(_is_int(t) for t in raw):
            raise TraceFormatError(f"{where} must be a list of integers, got {raw!r}")
        return tuple(raw)
    kind = _ENUMS.get(hint)
    if kind is not None:
        try:
            return kind(str(raw))
        except ValueError:
            choices = ", ".join(repr(m.value) for m in kind)
            raise TraceFormatError(f"{where} must be one of {choices}, got {raw!r}") from None
    raise TraceFormatError(f"{where}: no decoder for {hint!r}")  # pragma: no cover - a new field type


def op_from_json(data: dict[str, object]) -> LMCacheOp:
    """Inverse of ``op_to_json``. Raises ``TraceFormatError`` naming the bad field."""
    name = data.get("op")
    if not isinstance(name, str) or name not in _BY_NAME:
        raise TraceFormatError(f"unknown LMCache operation {name!r}; known: {sorted(_BY_NAME)}")
    cls = _BY_NAME[name]
    hints = typing.get_type_hints(cls)
    extra = sorted(set(data) - {f.name for f in dataclasses.fields(cls)} - {"op"})
    if extra:
        raise TraceFormatError(f"{name} has no fields {extra}")
    kwargs: dict[str, object] = {}
    for field in dataclasses.fields(cls):
        if field.name in data:
            kwargs[field.name] = _decode_field(f"{name}.{field.name}", hints[field.name], data[field.name])
        elif field.default is dataclasses.MISSING:
            raise TraceFormatError(f"{name} is missing field {field.name!r}")
    return cls(**kwargs)  # type: ignore[arg-type]
