"""The trace format for a family other than HiCache's: the refcache trace format (``specs/trace-format.md``)
whose header also says ``"family": NAME``, and one of the family's ``op_to_json`` objects per further line.

HiCache's reader (``refcache.hicache.trace``) rejects the extra header key, so another family's trace is never
replayed as HiCache operations by mistake; ``TaggedTraces.is_trace`` tells the families apart. Each such
family's ``family`` module holds one ``TaggedTraces`` over its operation codec (``TRACES`` in
``refcache.vllm.family``, ``refcache.lmcache.family``), and its ``FAMILY``'s ``dumps_trace``, ``read_trace``
and ``is_trace`` are that object's: the commands and the tests reach a family's traces through its ``Family``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from refcache.config import HiCacheConfig
from refcache.errors import TraceFormatError
from refcache.hicache.trace import FORMAT, VERSION, header, open_trace

__all__ = ["TaggedTraces"]

OpT = TypeVar("OpT")


class TaggedTraces(Generic[OpT]):
    """Reads and writes the traces of the family ``family`` (the header's tag), whose operations ``op_to_json``
    and ``op_from_json`` encode; ``label`` names the family in an error ("an LMCache", "a vLLM")."""

    def __init__(
        self,
        family: str,
        label: str,
        op_to_json: Callable[[OpT], dict[str, object]],
        op_from_json: Callable[[dict[str, object]], OpT],
    ) -> None:
        self.family = family
        self.label = label
        self._to_json = op_to_json
        self._from_json = op_from_json

    def dumps(self, config: HiCacheConfig, ops: Iterable[OpT]) -> str:
        lines = [json.dumps({**header(config), "family": self.family})]
        lines.extend(json.dumps(self._to_json(op)) for op in ops)
        return "\n".join(lines) + "\n"

    def is_trace(self, text: str) -> bool:
        """Whether the first line of ``text`` is a header of this family's traces."""
        try:
            first = json.loads(text.split("\n", 1)[0])
        except ValueError:
            return False
        return isinstance(first, dict) and first.get("family") == self.family

    def loads(self, text: str, where: str = "trace") -> tuple[HiCacheConfig, list[OpT]]:
        """Parse a trace of this family. Raises ``TraceFormatError`` naming the line for anything malformed."""
        lines = text.splitlines()
        if not lines:
            raise TraceFormatError(f"{where}: empty; line 1 must be the header")
        try:
            head = json.loads(lines[0])
        except ValueError as error:
            raise TraceFormatError(f"{where}:1: not valid JSON ({error})") from None
        if not isinstance(head, dict) or head.get("format") != FORMAT or head.get("version") != VERSION:
            raise TraceFormatError(f"{where}:1: not a {FORMAT} version {VERSION} header")
        if head.get("family") != self.family:
            raise TraceFormatError(
                f'{where}:1: not {self.label} trace (the header has no "family": "{self.family}")'
            )
        config_json = head.get("config")
        if not isinstance(config_json, dict):
            raise TraceFormatError(f"{where}:1: the header's config must be an object")
        config = HiCacheConfig.from_json(config_json)
        ops: list[OpT] = []
        for number, line in enumerate(lines[1:], start=2):
            try:
                data = json.loads(line)
            except ValueError as error:
                raise TraceFormatError(f"{where}:{number}: not valid JSON ({error})") from None
            if not isinstance(data, dict):
                raise TraceFormatError(f"{where}:{number}: expected a JSON object")
            try:
                ops.append(self._from_json(data))
            except TraceFormatError as error:
                raise TraceFormatError(f"{where}:{number}: {error}") from None
        return config, ops

    def read(self, path: str | os.PathLike[str]) -> tuple[HiCacheConfig, list[OpT]]:
        with open_trace(path) as file:
            return self.loads(file.read(), str(path))

    def write(self, path: str | os.PathLike[str], config: HiCacheConfig, ops: Iterable[OpT]) -> None:
        with open_trace(path, "w") as file:
            file.write(self.dumps(config, ops))
