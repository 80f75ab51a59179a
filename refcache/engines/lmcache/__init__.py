"""LMCache 0.5.6's own cache engine behind refcache's LMCache operation alphabet (``refcache.lmcache.ops``).

``LMCacheSystem(config)`` builds LMCache's ``LMCacheEngine`` on CPU (local CPU tier, local disk tier and the
``fs://`` remote tier on temporary directories, as the configuration says; ``refcache.lmcache.config``), with
its background executors gated so that every write and prefetch read is an explicit ``Step``, and reports an
``LMCacheSnapshot`` read from LMCache's own structures. Importing this package imports torch and LMCache
(about 9 s); nothing of LMCache's cache logic is stubbed. ``specs/lmcache.md`` lists every stand-in and seam.

Supported: LMCache 0.5.6 (``SUPPORTED``). Give it its own virtualenv: with vLLM importable LMCache switches to
vLLM's hash function (``nox -s lmcache``).
"""

from __future__ import annotations

from refcache.engines.lmcache._adapter import SUPPORTED, LMCacheSystem

__all__ = ["SUPPORTED", "LMCacheSystem"]
