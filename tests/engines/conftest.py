"""tests/engines: adapters over other engines' own code. Collected only where the engine is installed on
purpose: ``nox -s sglang`` sets ``REFCACHE_ENGINE_TESTS=sglang``, ``nox -s vllm`` sets it to ``vllm`` (the
default ``tests`` session, whose environment has neither, collects nothing here — nothing is skipped for
lack of them)."""

from __future__ import annotations

import os

ENGINES = ("sglang", "vllm")
collect_ignore_glob = [
    f"{engine}/*" for engine in ENGINES if os.environ.get("REFCACHE_ENGINE_TESTS") != engine
]
