"""Mooncake request traces: reading and validating them.

A Mooncake trace (``read_mooncake_trace``) is JSON Lines: ``timestamp`` (arrival, ms), ``input_length``
and ``output_length`` (tokens) and ``hash_ids``, one id per 512-token block of the input. Ids encode the
whole prefix, so equal ids mean equal blocks at equal positions and every block id occurs at exactly one
position. A path ending in ``.gz`` is read through gzip.

``bundled_trace`` is the Mooncake "conversation" trace that ships inside the package (12,031 requests,
gzipped; Apache-2.0, attribution in ``refcache/data/README.md``), the default workload of the commands.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from refcache.errors import TraceFormatError
from refcache.hicache.trace import FORMAT as REFCACHE_TRACE_FORMAT

__all__ = [
    "BUNDLED_TRACE_NAME",
    "TRACE_BLOCK_TOKENS",
    "TraceRequest",
    "bundled_trace",
    "parse_mooncake",
    "read_mooncake_trace",
]

TRACE_BLOCK_TOKENS: Final = 512
"""Tokens per ``hash_ids`` block in Mooncake traces."""

BUNDLED_TRACE_NAME: Final = "mooncake_conversation_trace.jsonl.gz"
"""The file name of the bundled trace, in the package folder ``refcache/data``."""


@dataclass(frozen=True)
class TraceRequest:
    """One line of a Mooncake trace, validated."""

    line: int  # 1-based line number in the source
    timestamp_ms: float  # arrival time
    input_length: int  # prompt tokens
    output_length: int  # generated tokens
    hash_ids: tuple[int, ...]  # one id per TRACE_BLOCK_TOKENS-token block of the prompt


def _int_field(data: dict[str, object], name: str, where: str, *, minimum: int) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceFormatError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_mooncake(
    lines: Iterable[str], *, source: str = "trace", limit: int | None = None
) -> list[TraceRequest]:
    """Parse Mooncake trace lines (blank lines are skipped); stop after ``limit`` requests.

    Raises ``TraceFormatError`` naming ``source``, the 1-based line number and the problem: not a JSON
    object, a missing or mistyped field, or ``hash_ids`` whose length is not
    ``ceil(input_length / 512)``. Unknown extra fields are ignored (other Mooncake traces carry some).
    """
    out: list[TraceRequest] = []
    for number, raw in enumerate(lines, start=1):
        if limit is not None and len(out) >= limit:
            break
        if not raw.strip():
            continue
        where = f"{source}:{number}"
        try:
            data: object = json.loads(raw)
        except ValueError as error:
            raise TraceFormatError(f"{where}: not valid JSON ({error})") from None
        if not isinstance(data, dict):
            raise TraceFormatError(f"{where}: expected a JSON object, got {type(data).__name__}")
        fields = {str(k): v for k, v in data.items()}
        if fields.get("format") == REFCACHE_TRACE_FORMAT:
            raise TraceFormatError(
                f"{where}: this is a refcache operation trace (header format {REFCACHE_TRACE_FORMAT!r}); "
                "simulate expects a Mooncake request trace (timestamp, input_length, output_length, "
                "hash_ids on every line); re-execute an operation trace with `refcache replay`"
            )
        timestamp = fields.get("timestamp")
        if not isinstance(timestamp, int | float) or isinstance(timestamp, bool) or not timestamp >= 0:
            raise TraceFormatError(f"{where}: timestamp must be a number >= 0 (ms), got {timestamp!r}")
        input_length = _int_field(fields, "input_length", where, minimum=1)
        output_length = _int_field(fields, "output_length", where, minimum=0)
        hash_ids = fields.get("hash_ids")
        if not isinstance(hash_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
        ):
            raise TraceFormatError(f"{where}: hash_ids must be a list of integers >= 0, got {hash_ids!r}")
        blocks = -(-input_length // TRACE_BLOCK_TOKENS)
        if len(hash_ids) != blocks:
            raise TraceFormatError(
                f"{where}: {len(hash_ids)} hash_ids for input_length {input_length}; expected {blocks} "
                f"(one per {TRACE_BLOCK_TOKENS}-token block)"
            )
        out.append(TraceRequest(number, float(timestamp), input_length, output_length, tuple(hash_ids)))
    return out


def read_mooncake_trace(path: str | os.PathLike[str], *, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake trace file (see ``parse_mooncake``); a path ending in ``.gz`` is decompressed as it
    is read. Raises ``TraceFormatError`` naming the file (and the line, for a bad line; for a ``.gz`` file
    that is not gzip or is cut short, what is wrong with it), and ``OSError`` if the file cannot be read."""
    source = os.fspath(path)
    try:
        if source.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as file:
                return parse_mooncake(file, source=source, limit=limit)
        with open(path, encoding="utf-8") as file:
            return parse_mooncake(file, source=source, limit=limit)
    except UnicodeDecodeError as error:
        raise TraceFormatError(f"{source}: not UTF-8 text ({error})") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        # BadGzipFile: not gzip at all; EOFError: cut short; zlib.error: corrupt compressed data
        raise TraceFormatError(f"{source}: not a readable gzip file ({error})") from None


def bundled_trace() -> Path:
    """The path of the Mooncake conversation trace shipped in the package (``BUNDLED_TRACE_NAME`` under
    ``refcache/data``), for ``read_mooncake_trace``.

    Raises ``FileNotFoundError`` when the installed package lacks the file (a build that dropped its
    package data) or when the package is not installed as plain files (a zip import), naming the file.
    """
    resource = importlib.resources.files("refcache").joinpath("data", BUNDLED_TRACE_NAME)
    if not isinstance(resource, Path):
        raise FileNotFoundError(
            f"refcache is installed in a form without plain files ({resource!r}); install it from a wheel "
            "or a source checkout to use the bundled trace"
        )
    if not resource.is_file():
        raise FileNotFoundError(
            f"the bundled trace {resource} is missing: this refcache was built without its package data; "
            "reinstall it (pip install refcache) or pass a trace path"
        )
    return resource
