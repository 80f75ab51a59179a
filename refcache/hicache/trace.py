"""The trace format: a configuration and a sequence of operations as versioned JSON Lines.

A trace is what a failing run shrinks to and what ``tests/regressions/`` replays: line 1 is a header
object naming the format, its version, the refcache version that wrote it and the configuration
(``HiCacheConfig.to_json()``); every further line is one operation as ``refcache.hicache.ops.op_to_json``
writes it. ``specs/trace-format.md`` describes the format and ``specs/trace.schema.json`` is its JSON
Schema.

Reading is strict: a line that is not a JSON object, a duplicate key, a header for another format or
version, an unknown operation or a field of the wrong type raises ``TraceFormatError`` naming the line
number (and the file, when reading one) and what was expected. Nothing here imports the model or the
implementation, so any engine can read and write traces.
"""

from __future__ import annotations

import dataclasses
import enum
import gzip
import io
import json
import os
import typing
from collections.abc import Iterable, Iterator
from typing import Final, Literal, TextIO

import refcache
from refcache.config import HiCacheConfig
from refcache.errors import ConfigError, TraceFormatError
from refcache.hicache.ops import Op, op_from_json, op_to_json

__all__ = [
    "FORMAT",
    "VERSION",
    "dumps_trace",
    "header",
    "loads_trace",
    "read_trace",
    "stamp_release",
    "stamp_seed",
    "trace_release",
    "write_trace",
]

FORMAT: Final = "refcache-trace"
"""The value of the header's ``format`` field."""

VERSION: Final = 1
"""The format version this module writes and the only one it reads."""

_HEADER_KEYS: Final = frozenset({"format", "version", "package_version", "config"})
_OPTIONAL_HEADER_KEYS: Final = frozenset({"source", "seed", "release"})
RELEASE_KEYS: Final = frozenset({"engine", "version"})
"""The keys of the optional header field ``release``: the engine release a trace was made against (``refcache
fuzz`` against an engine's adapter, e.g. ``{"engine": "sglang", "version": "0.5.16"}``, the version exactly as
installed); older traces have none and read unchanged."""
SOURCE_KEYS: Final = frozenset({"engine", "version"})
"""The keys of the optional header field ``source`` (a recorded trace: which engine, which version)."""
PLACED_KEY: Final = "placed"
"""An optional key of ``release`` and ``source``: where the engine was not a release as published, how it was
placed among the releases, in words (``SystemEntry.placed``: "SGLang main (0.5.24.dev3+gabc123), driven with
0.5.23's rows", "SGLang 0.5.10.post1 (a post release of 0.5.10), driven with its row")."""
RECORDED_KEYS: Final = frozenset({"observed", "snapshot"})
"""Optional keys of an operation line of a recorded trace (``refcache.hicache.recording``); ``loads_trace``
ignores them."""


def header(
    config: HiCacheConfig,
    source: dict[str, str] | None = None,
    seed: int | None = None,
    release: dict[str, str] | None = None,
) -> dict[str, object]:
    """The header object (line 1) of a trace of ``config``; ``source`` (``{"engine", "version"}``) only in
    a trace recorded from an engine, ``seed`` only in one written by ``refcache fuzz`` (its ``--seed``),
    ``release`` (``{"engine", "version"}``) only in one made against an engine's adapter."""
    out: dict[str, object] = {
        "format": FORMAT,
        "version": VERSION,
        "package_version": refcache.__version__,
        "config": config.to_json(),
    }
    if source is not None:
        out["source"] = dict(source)
    if seed is not None:
        out["seed"] = seed
    if release is not None:
        out["release"] = dict(release)
    return out


def _dump_line(obj: dict[str, object]) -> str:
    try:
        return json.dumps(obj, allow_nan=False)
    except ValueError as error:  # NaN or infinity: not JSON
        raise TraceFormatError(f"cannot write {obj!r} as JSON: {error}") from None


def dumps_trace(config: HiCacheConfig, ops: Iterable[Op]) -> str:
    """The trace of ``config`` and ``ops`` as text: one JSON object per line, newline-terminated.

    Raises ``TraceFormatError`` if the configuration holds a value JSON cannot represent (NaN, infinity).
    """
    lines = [_dump_line(header(config))]
    lines.extend(_dump_line(op_to_json(op)) for op in ops)
    return "\n".join(lines) + "\n"


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _parse_object(line: str, where: str) -> dict[str, object]:
    if not line.strip():
        raise TraceFormatError(f"{where}: empty line; every line of a trace is one JSON object")
    try:
        value: object = json.loads(line, object_pairs_hook=_unique_keys, parse_constant=_reject_constant)
    except ValueError as error:  # json.JSONDecodeError is a ValueError, and so are the hooks' errors
        raise TraceFormatError(f"{where}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return {str(key): item for key, item in value.items()}


def _json_type_ok(hint: object, value: object) -> bool:
    """Whether a JSON value has the type of a ``HiCacheConfig`` field (ints count as floats)."""
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint == str | None:
        return value is None or isinstance(value, str)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, str)  # the value itself is checked by HiCacheConfig
    return True  # pragma: no cover - a new field type; HiCacheConfig still validates it


def _check_config(config: dict[str, object], where: str) -> None:
    hints = typing.get_type_hints(HiCacheConfig)
    for field in dataclasses.fields(HiCacheConfig):
        if field.name in config and not _json_type_ok(hints[field.name], config[field.name]):
            raise TraceFormatError(
                f"{where}: config.{field.name} has the wrong type: {config[field.name]!r} "
                f"(expected {getattr(hints[field.name], '__name__', hints[field.name])})"
            )


def _parse_header(data: dict[str, object], where: str) -> HiCacheConfig:
    fmt = data.get("format")
    if fmt is None and {"hash_ids", "input_length"} <= data.keys():
        raise TraceFormatError(
            f"{where}: this is a Mooncake request trace (timestamp, input_length, output_length, "
            f"hash_ids), not a refcache operation trace (a header with format {FORMAT!r}, then one "
            "operation per line; specs/trace-format.md); replay a request trace with `refcache simulate`"
        )
    if fmt != FORMAT:
        raise TraceFormatError(
            f"{where}: not a refcache trace (header format is {fmt!r}, expected {FORMAT!r})"
        )
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise TraceFormatError(f"{where}: header version must be an integer, got {version!r}")
    if version != VERSION:
        raise TraceFormatError(
            f"{where}: trace format version {version} is not supported; this refcache "
            f"({refcache.__version__}) reads version {VERSION} only"
        )
    missing = sorted(_HEADER_KEYS - set(data))
    extra = sorted(set(data) - _HEADER_KEYS - _OPTIONAL_HEADER_KEYS)
    if missing or extra:
        raise TraceFormatError(f"{where}: header is missing keys {missing} / has unknown keys {extra}")
    seed = data.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise TraceFormatError(f"{where}: seed must be a non-negative integer, got {seed!r}")
    if not isinstance(data["package_version"], str):
        raise TraceFormatError(f"{where}: package_version must be a string, got {data['package_version']!r}")
    source = data.get("source")
    if source is not None and not (
        isinstance(source, dict)
        and set(source) - {PLACED_KEY} == SOURCE_KEYS
        and all(isinstance(value, str) for value in source.values())
    ):
        raise TraceFormatError(
            f"{where}: source must be an object with string fields engine and version, got {source!r}"
        )
    release = data.get("release")
    if release is not None and not (
        isinstance(release, dict)
        and set(release) - {PLACED_KEY} == RELEASE_KEYS
        and all(isinstance(value, str) for value in release.values())
    ):
        raise TraceFormatError(
            f"{where}: release must be an object with string fields engine and version, got {release!r}"
        )
    config = data["config"]
    if not isinstance(config, dict):
        raise TraceFormatError(f"{where}: config must be a JSON object, got {config!r}")
    fields = {str(key): value for key, value in config.items()}
    _check_config(fields, where)
    try:
        return HiCacheConfig.from_json(fields)
    except (ConfigError, TypeError) as error:
        raise TraceFormatError(f"{where}: bad config: {error}") from None


def parse_lines(
    lines: Iterable[str], source: str = "trace"
) -> tuple[dict[str, object], HiCacheConfig, Iterator[tuple[Op, dict[str, object], str]]]:
    """A trace's lines (without their ends) parsed as they are read: its header object and configuration, and
    per further line its operation, what a recorder added to it (``RECORDED_KEYS``) and where it is
    (``source:line``). Raises ``TraceFormatError`` naming the line, as the iterator reaches it."""
    numbered = enumerate(lines, start=1)
    _, first = next(numbered, (1, None))
    if first is None:
        raise TraceFormatError(f"{source}: empty; line 1 must be the trace header")
    head = _parse_object(first, f"{source}:1")
    config = _parse_header(head, f"{source}:1")

    def ops() -> Iterator[tuple[Op, dict[str, object], str]]:
        for number, line in numbered:
            where = f"{source}:{number}"
            data = _parse_object(line, where)
            # what a recorder observed (refcache.hicache.recording): not part of the operation
            recorded = {key: data.pop(key) for key in RECORDED_KEYS if key in data}
            try:
                op = op_from_json(data)
            except TraceFormatError as error:
                raise TraceFormatError(f"{where}: {error}") from None
            yield op, recorded, where

    return head, config, ops()


def loads_trace(text: str, *, source: str = "trace") -> tuple[HiCacheConfig, list[Op]]:
    """Parse a trace; ``source`` names it in error messages. Returns the configuration (as written,
    not resolved) and the operations in order.

    Raises ``TraceFormatError`` naming ``source``, the 1-based line number and the problem.
    """
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    _, config, ops = parse_lines(lines, source)
    return config, [op for op, _, _ in ops]


def open_trace(
    path: str | os.PathLike[str], mode: Literal["r", "w"] = "r", newline: str | None = None
) -> TextIO:
    """A trace file opened as UTF-8 text; a path ending in ``.gz`` is compressed as it is written and
    decompressed as it is read (a recording with snapshots of a few hundred requests is a gigabyte of JSON)."""
    if os.fspath(path).endswith(".gz"):
        # level 1: 300 requests of the real trace recorded with snapshots, 1.0 GB, compress to 368 MB in 11 s of
        # CPU at level 1 and to 362 MB in 34 s at level 6
        compressed = gzip.GzipFile(path, f"{mode}b", compresslevel=1)
        return io.TextIOWrapper(compressed, encoding="utf-8", newline=newline)
    return open(path, mode, encoding="utf-8", newline=newline)


def write_trace(path: str | os.PathLike[str], config: HiCacheConfig, ops: Iterable[Op]) -> None:
    """Write the trace of ``config`` and ``ops`` to ``path`` (UTF-8, ``\\n`` line ends)."""
    text = dumps_trace(config, ops)
    with open_trace(path, "w", newline="\n") as file:
        file.write(text)


def read_trace(path: str | os.PathLike[str]) -> tuple[HiCacheConfig, list[Op]]:
    """Read a trace file. Raises ``TraceFormatError`` (naming the file and line) if it is malformed, and
    ``OSError`` if it cannot be read."""
    with open_trace(path, newline="") as file:
        try:
            text = file.read()
        except UnicodeDecodeError as error:
            raise TraceFormatError(f"{os.fspath(path)}: not UTF-8 text ({error})") from None
    return loads_trace(text, source=os.fspath(path))


def stamp_seed(path: str | os.PathLike[str], seed: int) -> None:
    """Write ``seed`` (the ``refcache fuzz --seed`` of the run that found it) into the header of the trace
    at ``path``, keeping every other byte: the optional header field ``seed``, which readers of either
    family accept and ignore. Raises ``TraceFormatError`` if line 1 is not a JSON object."""
    with open_trace(path) as file:
        first, rest = file.readline(), file.read()
    head = _parse_object(first, f"{os.fspath(path)}:1")
    head["seed"] = seed
    with open_trace(path, "w") as file:
        file.write(_dump_line(head) + "\n" + rest)


def stamp_release(path: str | os.PathLike[str], engine: str, version: str, placed: str = "") -> None:
    """Write the engine release the trace at ``path`` was made against into its header (the optional field
    ``release``; ``placed``: how a post release or a source checkout was placed, ``PLACED_KEY``), keeping every
    other byte. Raises ``TraceFormatError`` if line 1 is not a JSON object."""
    with open_trace(path) as file:
        first, rest = file.readline(), file.read()
    head = _parse_object(first, f"{os.fspath(path)}:1")
    head["release"] = {"engine": engine, "version": version, **({PLACED_KEY: placed} if placed else {})}
    with open_trace(path, "w") as file:
        file.write(_dump_line(head) + "\n" + rest)


def trace_release(path: str | os.PathLike[str]) -> tuple[str, str] | None:
    """The (engine, version) the trace at ``path`` was made against (its header's ``release``); None for a
    trace without one. Raises ``TraceFormatError`` for a header that is not a JSON object or a bad field."""
    with open_trace(path) as file:
        first = file.readline()
    head = _parse_object(first, f"{os.fspath(path)}:1")
    release = head.get("release")
    if release is None:
        return None
    if not (isinstance(release, dict) and set(release) - {PLACED_KEY} == RELEASE_KEYS):
        raise TraceFormatError(f"{os.fspath(path)}:1: release must have string fields engine and version")
    engine, version = release["engine"], release["version"]
    if not isinstance(engine, str) or not isinstance(version, str):
        raise TraceFormatError(f"{os.fspath(path)}:1: release must have string fields engine and version")
    return engine, version
