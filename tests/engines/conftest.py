"""tests/engines: adapters over other engines' own code. Collected only where the engine is installed on
purpose: ``nox -s sglang`` sets ``REFCACHE_ENGINE_TESTS=sglang`` (the default ``tests`` session, whose
environment has no SGLang, collects nothing here — nothing is skipped for lack of it)."""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("REFCACHE_ENGINE_TESTS") == "sglang" else ["sglang/*"]
