"""The vLLM operation alphabet: the scheduler's calls into ``KVCacheManager`` and the offload connector's
calls into the CPU offload manager, as data.

A vLLM system (the reference model, the adapter over vLLM's own code) exposes ``apply(op) ->
observation``. The system plays vLLM's scheduler: it builds each ``Request``, advances
``num_computed_tokens`` and keeps the offload jobs it started in two FIFO queues (stores, loads), which
``CompleteStore`` / ``CompleteLoad`` finish one at a time, so every background completion, and every
failed store, is an explicit, shrinkable step.

Every operation is a frozen dataclass whose ``repr`` is valid Python and which round-trips through
``op_to_json`` / ``op_from_json`` (traces: ``refcache.vllm.family.TRACES``). Observations name blocks by id and
cached content by ``NodeId`` (namespace and token path from the first token), never by vLLM's hash bytes,
so the model needs no hash function and an adapter maps each hash back to the content it stands for.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Container
from dataclasses import dataclass
from typing import Final

from refcache.errors import TraceFormatError, UsageError
from refcache.family import NodeId
from refcache.vllm.config import VllmConfig

__all__ = [
    "OPS",
    "Admit",
    "AdmitResult",
    "CompleteLoad",
    "CompleteStore",
    "Decode",
    "DecodeResult",
    "Done",
    "EventKind",
    "EventsResult",
    "EvictBlocks",
    "Free",
    "HitResult",
    "IOResult",
    "KvEvent",
    "Load",
    "LoadResult",
    "Lookup",
    "ResetPrefixCache",
    "ResetResult",
    "Store",
    "StoreResult",
    "TakeEvents",
    "VllmObservation",
    "VllmOp",
    "check_op",
    "group_namespace",
    "namespace_of",
    "op_from_json",
    "op_to_json",
]

Tokens = tuple[int, ...]


def namespace_of(lora: str | None, salt: str | None, group: int = 0) -> str:
    """The ``NodeId.namespace`` of a request's blocks in KV cache group ``group``: what vLLM's cache key
    holds besides the tokens: the ``extra_keys`` of the first hash of the chain (and, for LoRA, of every
    hash), and the group id of ``BlockHashWithGroupId``. ``""`` for group 0 with neither set."""
    parts = ([f"lora={lora}"] if lora is not None else []) + ([f"salt={salt}"] if salt is not None else [])
    return group_namespace(",".join(parts), group)


def group_namespace(namespace: str, group: int) -> str:
    """A request namespace (``namespace_of(lora, salt)``) as the namespace of its group-``group`` blocks:
    group 0's is the namespace itself, so a one-group system names content as before."""
    if not group:
        return namespace
    return f"{namespace},group={group}" if namespace else f"group={group}"


# --- scheduler operations ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lookup:
    """``get_computed_blocks`` for a request with these tokens that is never admitted (no side effect)."""

    tokens: Tokens
    lora: str | None = None  # LoRA adapter name (its path is derived from it)
    salt: str | None = None  # cache_salt


@dataclass(frozen=True)
class Admit:
    """Admit request ``rid`` whose prompt is ``tokens``: ``get_computed_blocks``, then ``allocate_slots`` for
    the whole prompt (the hit adopted, the rest computed in one step). When the blocks do not fit, nothing
    changes and the request is not running (``AdmitResult.admitted`` is False).

    ``external``: tokens after the prefix hit whose KV a KV connector supplies (loaded synchronously),
    passed as ``num_external_computed_tokens``, at most ``len(tokens) - 1 - hit`` of them (the rest are
    not external). Their blocks are allocated, per group, after every group's hit blocks are touched."""

    rid: int
    tokens: Tokens
    lora: str | None = None
    salt: str | None = None
    external: int = 0


@dataclass(frozen=True)
class Decode:
    """One decode step of ``rid``: ``token`` is appended, then ``allocate_slots`` for every token not yet
    computed (a step that did not fit leaves its token uncomputed for the next one)."""

    rid: int
    token: int


@dataclass(frozen=True)
class Free:
    """``free(request)`` for a finished or aborted request, then the offload manager's
    ``on_request_finished``. The request's offload jobs stay queued."""

    rid: int


@dataclass(frozen=True)
class EvictBlocks:
    """``evict_blocks(set(block_ids))``: drop these blocks' hashes, even of blocks in use (a connector
    invalidating blocks whose load failed)."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class ResetPrefixCache:
    """``reset_prefix_cache()``: refused (False) while any block is in use."""


@dataclass(frozen=True)
class TakeEvents:
    """``take_events()`` of the block pool and the offload manager, in the order they were emitted."""


# --- offload operations --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Store:
    """``prepare_store`` of ``rid``'s computed full blocks; a store job is queued for what it accepted."""

    rid: int


@dataclass(frozen=True)
class CompleteStore:
    """``complete_store`` of the oldest queued store job; ``success=False`` is a failed transfer."""

    success: bool = True


@dataclass(frozen=True)
class Load:
    """``lookup`` of ``rid``'s full blocks in order, up to the first that is not a ``HIT``; then
    ``prepare_load`` of the hits (pinned), queued as a load job."""

    rid: int


@dataclass(frozen=True)
class CompleteLoad:
    """``complete_load`` of the oldest queued load job (unpins its chunks)."""


VllmOp = (
    Lookup
    | Admit
    | Decode
    | Free
    | EvictBlocks
    | ResetPrefixCache
    | TakeEvents
    | Store
    | CompleteStore
    | Load
    | CompleteLoad
)
OPS: Final[tuple[type[VllmOp], ...]] = typing.get_args(VllmOp)

# --- observations --------------------------------------------------------------------------------------------


class EventKind(enum.StrEnum):
    """What a ``KvEvent`` reports."""

    STORED = "stored"  # BlockStored: blocks entered the prefix cache (``parent``: the block before them)
    REMOVED = "removed"  # BlockRemoved: one block's hash left the prefix cache
    CLEARED = "cleared"  # AllBlocksCleared: reset_prefix_cache succeeded
    OFFLOAD_STORED = "offload_stored"  # OffloadingEvent(removed=False): chunks became ready
    OFFLOAD_REMOVED = "offload_removed"  # OffloadingEvent(removed=True): chunks evicted or a store failed

    def __repr__(self) -> str:
        return f"EventKind.{self.name}"


@dataclass(frozen=True)
class KvEvent:
    kind: EventKind
    keys: tuple[NodeId, ...]  # the blocks' (or chunks') content, in the event's order
    parent: NodeId | None = None  # STORED only: the block the first key chains from (None: a first block)


@dataclass(frozen=True)
class HitResult:
    hit_tokens: int  # a multiple of block_size, at most (tokens - 1) rounded down to blocks


@dataclass(frozen=True)
class AdmitResult:
    admitted: bool  # False: the blocks did not fit (allocate_slots returned None)
    hit_tokens: int  # prefix-cache hit adopted (0 when not admitted)
    table: tuple[int, ...]  # the request's block table (empty when not admitted)


@dataclass(frozen=True)
class DecodeResult:
    scheduled: bool  # False: the new block did not fit; the token stays uncomputed
    table: tuple[int, ...]


@dataclass(frozen=True)
class ResetResult:
    ok: bool


@dataclass(frozen=True)
class EventsResult:
    events: tuple[KvEvent, ...]


@dataclass(frozen=True)
class StoreResult:
    accepted: bool  # False: prepare_store returned None (not enough evictable chunks)
    stored: tuple[NodeId, ...]  # chunks now write-pending (the queued job)
    evicted: tuple[NodeId, ...]  # ready chunks evicted to make room


@dataclass(frozen=True)
class LoadResult:
    lookups: tuple[str, ...]  # lookup results in block order, up to and including the first non-"hit"
    loading: tuple[NodeId, ...]  # the chunks pinned by the queued load job


@dataclass(frozen=True)
class IOResult:
    keys: tuple[NodeId, ...]  # the completed job's chunks


@dataclass(frozen=True)
class Done:
    """Operations with nothing to report."""


VllmObservation = (
    HitResult
    | AdmitResult
    | DecodeResult
    | ResetResult
    | EventsResult
    | StoreResult
    | LoadResult
    | IOResult
    | Done
)

# --- preconditions -------------------------------------------------------------------------------------------


def check_op(
    op: VllmOp, config: VllmConfig, running: Container[int], pending_stores: int, pending_loads: int
) -> None:
    """The alphabet's preconditions, shared by every vLLM system so that all reject the same operations.

    Raises ``UsageError`` naming what is wrong; callers check before changing anything.
    """
    match op:
        case Lookup(tokens, lora, salt) | Admit(_, tokens, lora, salt):
            if isinstance(op, Admit) and op.external < 0:
                raise UsageError(f"external must be >= 0 tokens; got {op.external}")
            if not tokens:
                raise UsageError("a request needs at least one token")
            if min(tokens) < 0 or max(tokens) >= 2**32:
                raise UsageError(
                    f"token ids must fit in uint32; got {[t for t in tokens if not 0 <= t < 2**32][:3]}"
                )
            if lora == "" or salt == "":
                raise UsageError("lora and salt must be None or non-empty strings")
            if isinstance(op, Admit) and op.rid in running:
                raise UsageError(f"request {op.rid} is already running")
        case Decode(rid, token):
            if rid not in running:
                raise UsageError(f"request {rid} is not running; admit it first")
            if not 0 <= token < 2**32:
                raise UsageError(f"token ids must fit in uint32; got {token}")
        case Free(rid) | Store(rid) | Load(rid):
            if rid not in running:
                raise UsageError(f"request {rid} is not running; admit it first")
        case EvictBlocks(block_ids):
            bad = [b for b in block_ids if not 0 <= b < config.num_blocks]
            if bad:
                raise UsageError(f"block ids {bad} do not exist; there are {config.num_blocks} blocks")
        case _:
            pass
    if isinstance(op, Store | Load | CompleteStore | CompleteLoad) and config.offload_chunks == 0:
        raise UsageError("this configuration has no offload manager (offload_chunks is 0)")
    if isinstance(op, CompleteStore) and not pending_stores:
        raise UsageError("no store job is queued; apply Store(rid) first")
    if isinstance(op, CompleteLoad) and not pending_loads:
        raise UsageError("no load job is queued; apply Load(rid) first")


# --- JSON codec ----------------------------------------------------------------------------------------------

_BY_NAME: Final[dict[str, type[VllmOp]]] = {cls.__name__: cls for cls in OPS}


def op_to_json(op: VllmOp) -> dict[str, object]:
    """``{"op": "ClassName", field: value, ...}`` with tuples as lists."""
    out: dict[str, object] = {"op": type(op).__name__}
    for field in dataclasses.fields(op):
        value = getattr(op, field.name)
        out[field.name] = list(value) if isinstance(value, tuple) else value
    return out


def _is_int(raw: object) -> bool:
    return isinstance(raw, int) and not isinstance(raw, bool)


def _decode_field(where: str, hint: object, raw: object) -> object:
    if hint is int:
        if not _is_int(raw):
            raise TraceFormatError(f"{where} must be an integer, got {raw!r}")
        return raw
    if hint is bool:
        if not isinstance(raw, bool):
            raise TraceFormatError(f"{where} must be true or false, got {raw!r}")
        return raw
    if hint in (Tokens, tuple[int, ...]):
        if not isinstance(raw, list) or not all(_is_int(t) for t in raw):
            raise TraceFormatError(f"{where} must be a list of integers, got {raw!r}")
        return tuple(raw)
    if hint == str | None:
        if raw is not None and not isinstance(raw, str):
            raise TraceFormatError(f"{where} must be a string or null, got {raw!r}")
        return raw
    raise TraceFormatError(f"{where}: no decoder for {hint!r}")  # pragma: no cover - a new field type


def op_from_json(data: dict[str, object]) -> VllmOp:
    """Inverse of ``op_to_json``. Raises ``TraceFormatError`` naming the bad field."""
    name = data.get("op")
    if not isinstance(name, str) or name not in _BY_NAME:
        raise TraceFormatError(f"unknown vLLM operation {name!r}; known: {sorted(_BY_NAME)}")
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
