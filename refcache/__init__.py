"""refcache: a formally-tested reference implementation of SGLang's hierarchical KV cache (HiCache).

``refcache.model`` is the executable specification (pure Python); ``refcache.gpu`` is the real
implementation (torch, Triton, threads, files). They share only the vocabulary: HiCache's family package,
``refcache.hicache`` (``ops``, ``snapshot``, ``invariants``, ``states``, ``trace``, ``recording``, and its
``FAMILY``), and at this level ``family`` (the interface every engine family fills), ``config``, ``errors``
and ``hashing``. vLLM's family is ``refcache.vllm``. ``refcache.conformance`` is the kit another engine's
tests call. ``refcache.ops``, ``snapshot``, ``invariants``, ``states``, ``trace`` and ``recording`` at this
level are the old paths, re-exporting ``refcache.hicache``'s for one release.
"""

__version__ = "0.1.0"
