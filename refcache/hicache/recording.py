"""Recorded traces: a trace (``refcache.hicache.trace``) whose operations were observed on a live engine.

A recorder (``refcache.engines.sglang.record``) writes the ordinary trace format with two optional
additions (``specs/trace-format.md``, "Recorded traces"):

* the header's ``source``: ``{"engine": "sglang", "version": "0.5.20"}``, the engine that ran;
* on an operation line, ``observed``: what the engine returned for it (an observation of
  ``refcache.hicache.ops`` as ``{"type": "StartResult", field: value, ...}``; or ``NeverReturned``: the engine never
  returned from it, the recording's last line), and ``snapshot``: the engine's ``Snapshot`` after it (only
  when the recorder was asked to take snapshots).

``refcache.hicache.trace.loads_trace`` ignores both (a recorded trace replays as any trace); ``loads_recording``
reads them, and ``refcache.check.recorded.replay_recorded`` compares a system's outcomes and snapshots
with them step by step. Nothing here imports an engine, the model or torch.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import os
import types
import typing
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

from refcache.config import HiCacheConfig
from refcache.errors import NeverReturned, TraceFormatError
from refcache.hicache.ops import (
    Done,
    EventsResult,
    EvictHostResult,
    EvictResult,
    FinishResult,
    IOResult,
    MatchResult,
    Observation,
    Op,
    PrefetchResult,
    ProgressResult,
    ResetResult,
    StartResult,
    omitted,
    op_to_json,
)
from refcache.hicache.snapshot import Snapshot, SnapshotInterner
from refcache.hicache.trace import _dump_line, header, open_trace, parse_lines

__all__ = [
    "NeverReturned",
    "Observed",
    "Recording",
    "dumps_recording",
    "from_json",
    "is_recorded",
    "loads_recording",
    "observation_from_json",
    "observation_to_json",
    "read_recording",
    "to_json",
    "write_recording",
]


Observed = Observation | NeverReturned
"""What a recorded line says the engine did: an observation, or that it never returned."""

_OBSERVATIONS: Final[dict[str, type[Any]]] = {
    cls.__name__: cls
    for cls in (
        MatchResult,
        StartResult,
        FinishResult,
        EvictResult,
        EvictHostResult,
        PrefetchResult,
        ProgressResult,
        EventsResult,
        IOResult,
        ResetResult,
        Done,
        NeverReturned,
    )
}


@dataclass
class Recording:
    """A recorded trace: the configuration, the operations, and per operation what the engine observed
    (``None``: not recorded; ``NeverReturned``: the engine never returned from it) and its snapshot after
    the operation (``None``: not taken)."""

    config: HiCacheConfig
    ops: list[Op]
    observed: list[Observed | None]
    snapshots: list[Snapshot | None]
    source: dict[str, str] | None = None
    notes: list[str] = dataclasses.field(default_factory=list)  # not written: what the recorder said

    @property
    def engine(self) -> str:
        """How reports name the engine: ``sglang-0.5.20 (recorded)``."""
        if self.source is None:
            return "recorded"
        return f"{self.source['engine']}-{self.source['version']} (recorded)"


# --- a generic codec for the frozen dataclasses of refcache.hicache.ops and refcache.hicache.snapshot ------------------------


def to_json(value: object) -> object:
    """Dataclasses as objects of their fields, tuples as arrays, enums as their values. A field marked
    ``omit_default`` (as ``refcache.hicache.ops.op_to_json`` omits them) is left out at its default, which
    ``from_json`` then gives it: files without a field added later keep their exact form."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: to_json(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not omitted(f, getattr(value, f.name))
        }
    if isinstance(value, tuple | list):
        return [to_json(item) for item in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value


@functools.cache
def _fields(cls: type) -> tuple[dict[str, Any], frozenset[str]]:
    """A dataclass's field types and names, read once per class (``typing.get_type_hints`` evaluates every
    annotation each time: reading a recorded trace's snapshots spent most of its time there)."""
    return typing.get_type_hints(cls), frozenset(f.name for f in dataclasses.fields(cls))


@functools.cache
def _scalars(hint: object) -> frozenset[type]:
    """The plain JSON types (``int``, ``str``, ``bool``) a value of type ``hint`` may be as it is read."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return frozenset(t for t in options if t in (int, str, bool))


def from_json(hint: object, raw: object, where: str = "value") -> Any:
    """Inverse of ``to_json`` for a value of type ``hint``. Raises ``TraceFormatError``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if raw is None and type(None) in args:
            return None
        for inner in [a for a in args if a is not type(None)]:
            try:
                return from_json(inner, raw, where)
            except TraceFormatError:
                continue
        raise TraceFormatError(f"{where}: {raw!r} is none of {hint}")
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(raw, list):
            raise TraceFormatError(f"{where} must be an array, got {raw!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            scalars = _scalars(args[0])  # slot and token tuples: thousands of plain items, taken as they are
            if scalars and scalars.issuperset(map(type, raw)):
                return tuple(raw)
            return tuple(from_json(args[0], item, where) for item in raw)
        if len(args) != len(raw):
            raise TraceFormatError(f"{where} must have {len(args)} items, got {raw!r}")
        return tuple(from_json(a, item, where) for a, item in zip(args, raw, strict=True))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(raw, dict):
            raise TraceFormatError(f"{where} must be an object, got {raw!r}")
        hints, names = _fields(hint)
        if set(raw) - names:
            raise TraceFormatError(f"{where}: {hint.__name__} has no fields {sorted(set(raw) - names)}")
        return hint(**{name: from_json(hints[name], raw[name], f"{where}.{name}") for name in raw})
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(raw)
        except ValueError:
            raise TraceFormatError(f"{where}={raw!r} is not a {hint.__name__}") from None
    if hint in (int, str, bool) and type(raw) is hint:
        return raw
    raise TraceFormatError(f"{where} must be a {getattr(hint, '__name__', hint)}, got {raw!r}")


def observation_to_json(observation: Observed) -> dict[str, object]:
    fields = to_json(observation)
    assert isinstance(fields, dict)
    return {"type": type(observation).__name__, **fields}


def observation_from_json(raw: object, where: str = "observed") -> Observed:
    if not isinstance(raw, dict) or raw.get("type") not in _OBSERVATIONS:
        raise TraceFormatError(f"{where} must be an observation object with a known type, got {raw!r}")
    fields = {k: v for k, v in raw.items() if k != "type"}
    value: Observed = from_json(_OBSERVATIONS[raw["type"]], fields, where)
    return value


# --- reading and writing ----------------------------------------------------------------------------------


def _recording_lines(
    config: HiCacheConfig,
    ops: Sequence[Op],
    observed: Sequence[Observed | None],
    snapshots: Sequence[Snapshot | None],
    source: dict[str, str] | None,
) -> Iterator[str]:
    yield _dump_line(header(config, source))
    for op, seen, snap in zip(ops, observed, snapshots, strict=True):
        line = op_to_json(op)
        if seen is not None:
            line["observed"] = observation_to_json(seen)
        if snap is not None:
            line["snapshot"] = to_json(snap)
        yield _dump_line(line)


def dumps_recording(
    config: HiCacheConfig,
    ops: Sequence[Op],
    observed: Sequence[Observed | None],
    snapshots: Sequence[Snapshot | None],
    source: dict[str, str] | None,
) -> str:
    """A recorded trace as text (the trace format; ``observed`` / ``snapshot`` where given)."""
    return "".join(line + "\n" for line in _recording_lines(config, ops, observed, snapshots, source))


def _recording(lines: Iterable[str], source: str) -> Recording:
    head, config, parsed = parse_lines(lines, source)
    engine = head.get("source")
    ops: list[Op] = []
    observed: list[Observed | None] = []
    snapshots: list[Snapshot | None] = []
    shared = SnapshotInterner()  # successive snapshots share their unchanged nodes and pools
    for op, recorded, where in parsed:
        ops.append(op)
        seen, snap = recorded.get("observed"), recorded.get("snapshot")
        observed.append(None if seen is None else observation_from_json(seen, f"{where}: observed"))
        snapshots.append(None if snap is None else shared(from_json(Snapshot, snap, f"{where}: snapshot")))
    src = {str(k): str(v) for k, v in engine.items()} if isinstance(engine, dict) else None
    return Recording(config, ops, observed, snapshots, src)


def loads_recording(text: str, *, source: str = "trace") -> Recording:
    """Parse a (possibly recorded) trace. A trace without recorded fields gives ``None`` everywhere."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    return _recording(lines, source)


def write_recording(path: str | os.PathLike[str], rec: Recording) -> None:
    """Write ``rec`` to ``path`` as a recorded trace (``dumps_recording``; ``read_recording`` reads it)."""
    with open_trace(path, "w", newline="\n") as file:
        for line in _recording_lines(rec.config, rec.ops, rec.observed, rec.snapshots, rec.source):
            file.write(line + "\n")


def read_recording(path: str | os.PathLike[str]) -> Recording:
    # line by line: a recording with snapshots is a gigabyte of text, which is not held whole
    with open_trace(path, newline="") as file:
        try:
            return _recording((line.removesuffix("\n") for line in file), os.fspath(path))
        except UnicodeDecodeError as error:
            raise TraceFormatError(f"{os.fspath(path)}: not UTF-8 text ({error})") from None


def is_recorded(path: str | os.PathLike[str]) -> bool:
    """Whether the trace at ``path`` names a ``source`` in its header (a recorded trace)."""
    with open_trace(path) as file:
        first = file.readline()
    try:
        return isinstance(json.loads(first), dict) and "source" in json.loads(first)
    except ValueError:
        return False
