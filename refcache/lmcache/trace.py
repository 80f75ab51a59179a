"""Traces of LMCache operations: the refcache trace format (``specs/trace-format.md``) with a header that
also says ``"family": "lmcache"``, and one ``refcache.lmcache.ops.op_to_json`` object per further line.

HiCache's reader (``refcache.hicache.trace``) rejects the extra header key, so an LMCache trace is never replayed as
HiCache operations by mistake; ``is_lmcache_trace`` tells the two apart.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from refcache.config import HiCacheConfig
from refcache.errors import TraceFormatError
from refcache.hicache.trace import FORMAT, VERSION, header
from refcache.lmcache.ops import LMCacheOp, op_from_json, op_to_json

__all__ = ["FAMILY", "dumps_trace", "is_lmcache_trace", "loads_trace", "read_trace", "write_trace"]

FAMILY = "lmcache"


def dumps_trace(config: HiCacheConfig, ops: Iterable[LMCacheOp]) -> str:
    lines = [json.dumps({**header(config), "family": FAMILY})]
    lines.extend(json.dumps(op_to_json(op)) for op in ops)
    return "\n".join(lines) + "\n"


def is_lmcache_trace(text: str) -> bool:
    """Whether the first line of ``text`` is an LMCache trace header."""
    try:
        first = json.loads(text.split("\n", 1)[0])
    except ValueError:
        return False
    return isinstance(first, dict) and first.get("family") == FAMILY


def loads_trace(text: str, where: str = "trace") -> tuple[HiCacheConfig, list[LMCacheOp]]:
    """Parse an LMCache trace. Raises ``TraceFormatError`` naming the line for anything malformed."""
    lines = text.splitlines()
    if not lines:
        raise TraceFormatError(f"{where}: empty; line 1 must be the header")
    try:
        head = json.loads(lines[0])
    except ValueError as error:
        raise TraceFormatError(f"{where}:1: not valid JSON ({error})") from None
    if not isinstance(head, dict) or head.get("format") != FORMAT or head.get("version") != VERSION:
        raise TraceFormatError(f"{where}:1: not a {FORMAT} version {VERSION} header")
    if head.get("family") != FAMILY:
        raise TraceFormatError(f'{where}:1: not an LMCache trace (the header has no "family": "{FAMILY}")')
    config_json = head.get("config")
    if not isinstance(config_json, dict):
        raise TraceFormatError(f"{where}:1: the header's config must be an object")
    config = HiCacheConfig.from_json(config_json)
    ops: list[LMCacheOp] = []
    for number, line in enumerate(lines[1:], start=2):
        try:
            data = json.loads(line)
        except ValueError as error:
            raise TraceFormatError(f"{where}:{number}: not valid JSON ({error})") from None
        if not isinstance(data, dict):
            raise TraceFormatError(f"{where}:{number}: expected a JSON object")
        try:
            ops.append(op_from_json(data))
        except TraceFormatError as error:
            raise TraceFormatError(f"{where}:{number}: {error}") from None
    return config, ops


def read_trace(path: str | os.PathLike[str]) -> tuple[HiCacheConfig, list[LMCacheOp]]:
    return loads_trace(Path(path).read_text(), str(path))


def write_trace(path: str | os.PathLike[str], config: HiCacheConfig, ops: Iterable[LMCacheOp]) -> None:
    Path(path).write_text(dumps_trace(config, ops))
