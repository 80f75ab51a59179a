"""vLLM 0.33's own KV cache manager and CPU offload manager behind refcache's vLLM operation alphabet.

``VllmSystem(config)`` builds vLLM's ``KVCacheManager`` (one full-attention group, prefix caching and KV
events on) and ``CPUOffloadingManager`` (LRU or ARC) from a ``HiCacheConfig`` (``refcache.vllm.config``),
plays vLLM's scheduler over ``refcache.vllm.ops`` and reports a ``VllmSnapshot``. Importing this package
imports vLLM (about 15 s, once per process); nothing is stubbed and ``vllm._C`` is never loaded.

Supported: vLLM 0.33.x (``SUPPORTED``), checked at import; see ``specs/vllm.md`` for which internals the
adapter reads and when they changed.
"""

from __future__ import annotations

from refcache.engines.vllm._adapter import SUPPORTED, VllmSystem

__all__ = ["SUPPORTED", "VllmSystem"]
