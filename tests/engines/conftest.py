"""tests/engines: adapters over other engines' own code. Collected only where the engine is installed on
purpose: ``nox -s sglang`` sets ``REFCACHE_ENGINE_TESTS=sglang``, ``nox -s vllm`` sets it to ``vllm``,
``nox -s lmcache`` to ``lmcache`` (the default ``tests`` session, whose environment has none of them,
collects nothing here — nothing is skipped for lack of them)."""

from __future__ import annotations

import os

ENGINES = ("sglang", "vllm", "lmcache")
collect_ignore_glob = [
    f"{engine}/*" for engine in ENGINES if os.environ.get("REFCACHE_ENGINE_TESTS") != engine
]
