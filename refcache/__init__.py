"""refcache: a formally-tested reference implementation of SGLang's hierarchical KV cache (HiCache).

``refcache.model`` is the executable specification (pure Python); ``refcache.gpu`` is the real
implementation (torch, Triton, threads, files). They share only the vocabulary at this level:
``config``, ``errors``, ``hashing``, ``ops``, ``snapshot``, ``invariants`` and ``trace``.
"""

__version__ = "0.1.0"
