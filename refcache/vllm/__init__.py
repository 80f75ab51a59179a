"""vLLM v1's KV cache as refcache's second engine family: vocabulary and reference model, pure Python.

vLLM's prefix cache is not a tree, so it gets its own small vocabulary beside HiCache's
(``specs/vllm.md``):

* ``config``: ``VllmConfig``, derived from a ``HiCacheConfig`` (block size, blocks, offload chunks and
  policy), so the registry, the trace header, replay and shrink keep taking one configuration type;
* ``ops``: the operation alphabet (scheduler calls, offload completions) with its JSON codec and the
  preconditions every vLLM system checks;
* ``snapshot``: ``VllmSnapshot``, a block pool and offload manager as plain data;
* ``invariants``: the vLLM invariant family (``specs/invariants.md``, section "vLLM");
* ``trace``: traces of vLLM operations (the header names the family);
* ``scenarios``: the directed conformance scenarios; ``family``: ``FAMILY``, the ``refcache.family.Family``
  the checking side is generic over (its snapshot diff and status line);
* ``model``: ``VllmModel``, an executable reference model of the block pool (``_pool``) and the CPU
  offload manager with its LRU and ARC policies (``_offload``).

Nothing here imports torch, numpy or vLLM; ``refcache.engines.vllm`` drives vLLM's own code.
"""

from __future__ import annotations

from refcache.vllm.config import OffloadPolicy, VllmConfig
from refcache.vllm.snapshot import VllmSnapshot

__all__ = ["OffloadPolicy", "VllmConfig", "VllmSnapshot"]
