"""A toy engine, written only against refcache's public conformance names, as a third party would write one.

``ToyCache`` is "the engine": its own API (``lookup``, ``admit``, ``release``, ``drop``, ``background``),
over the reference model's tree as its storage layer — what matters here is the plumbing a porter writes,
not a second HiCache. ``ToyAdapter`` is the adapter the conformance kit drives: it translates refcache's
operations into the engine's calls and reports the engine's state as a snapshot. The toy runs without L3,
so it answers every operation but the storage ones (``ANSWERS``), and the kit draws only those.

``PLANTED`` switches on one realistic porting bug: ``drop`` (eviction) rounds the request up to a whole page
and then one page more, so it evicts more than asked; ``tests/conformance/test_toy_engine.py`` shows the kit
passes the toy without it and fails it, with a shrunk trace, with it.

This file is also what ``tests/conformance/test_plugin.py`` installs as a package, with an entry point in the
``refcache.systems`` group (``ENTRY``), to fuzz it through ``refcache fuzz --against model,toy``.
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import Final, Self

from refcache.config import HiCacheConfig
from refcache.hicache.ops import (
    OPS,
    AbortPrefetch,
    AbortRequest,
    CheckPrefetchProgress,
    Evict,
    FinishRequest,
    MatchPrefix,
    Observation,
    Op,
    PrefetchFromStorage,
    StartRequest,
    StorageFault,
)
from refcache.hicache.snapshot import Snapshot
from refcache.model import HiCacheModel
from refcache.systems import SystemEntry

__all__ = ["ANSWERS", "ENTRY", "PLANTED", "ToyAdapter", "ToyCache"]

PLANTED: Final = "REFCACHE_TOY_BUG"
"""Set this environment variable to 1 to plant the toy's bug (read when a ``ToyCache`` is built)."""

ANSWERS: Final = frozenset(
    kind.__name__
    for kind in OPS
    if kind not in (PrefetchFromStorage, CheckPrefetchProgress, AbortPrefetch, StorageFault)
)
"""Every operation but the L3 ones: the toy has no storage tier."""


class ToyCache:
    """The engine. Its scheduler calls ``lookup`` before ``admit``; ``release`` ends a request; ``drop`` makes
    room on the device; ``background`` runs what its copy threads would."""

    def __init__(self, config: HiCacheConfig) -> None:
        self.page = config.page_size
        self._tree = HiCacheModel(config)  # the engine's storage layer
        self.planted = os.environ.get(PLANTED) == "1"

    def lookup(self, tokens: tuple[int, ...], namespace: str | None) -> Observation:
        return self._tree.apply(MatchPrefix(tokens, namespace))

    def admit(
        self, rid: int, tokens: tuple[int, ...], namespace: str | None, prompt: int | None
    ) -> Observation:
        return self._tree.apply(StartRequest(rid, tokens, namespace, prompt))

    def release(self, rid: int, *, finished: bool) -> Observation:
        return self._tree.apply(FinishRequest(rid) if finished else AbortRequest(rid))

    def drop(self, tokens: int) -> Observation:
        if self.planted and tokens > 0:  # the porting bug: a whole page more than asked
            tokens = (tokens + self.page - 1) // self.page * self.page + self.page
        return self._tree.apply(Evict(tokens))

    def background(self, op: Op) -> Observation:
        return self._tree.apply(op)

    def state(self) -> Snapshot:
        return self._tree.snapshot()

    def shutdown(self) -> None:
        self._tree.close()


class ToyAdapter:
    """refcache's operations on a ``ToyCache`` (what ``check_system`` and ``refcache fuzz`` drive)."""

    def __init__(self, config: HiCacheConfig) -> None:
        self.engine = ToyCache(config)

    def apply(self, op: Op) -> Observation:
        match op:
            case MatchPrefix(tokens, extra_key):
                return self.engine.lookup(tokens, extra_key)
            case StartRequest(rid, tokens, extra_key, prompt_len):
                return self.engine.admit(rid, tokens, extra_key, prompt_len)
            case FinishRequest(rid):
                return self.engine.release(rid, finished=True)
            case AbortRequest(rid):
                return self.engine.release(rid, finished=False)
            case Evict(num_tokens):
                return self.engine.drop(num_tokens)
            case _:  # background completions, host eviction, clock steps, reset: the engine's own loop
                return self.engine.background(op)

    def snapshot(self) -> Snapshot:
        return self.engine.state()

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


ENTRY: Final = SystemEntry(
    "a toy engine over the reference tree (tests/conformance/toy_engine.py)",
    f"{__name__}:ToyAdapter",
    install="pip install the toy package (tests/conformance/test_plugin.py builds it)",
    answers=ANSWERS,
    constraints={"hicache_storage_backend": None},
)
"""The toy's registry entry, as a plugin package names it in its ``refcache.systems`` entry point."""
