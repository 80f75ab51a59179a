"""SGLang HiCache's engine family: a radix tree over device (L1), host (L2) and storage (L3) tiers.

``refcache.hicache.FAMILY`` is the family object the checking side is generic over (``refcache.family``):
the operation alphabet (``refcache.hicache.ops``), the snapshot (``refcache.hicache.snapshot``), the invariants
(``refcache.hicache.invariants``), the trace codec (``refcache.hicache.trace``), the snapshot diff and status line, the
comparison granularities and the directed conformance scenarios (``refcache.hicache.scenarios``). Its
systems are the reference model (``refcache.model``), the implementation (``refcache.gpu``) and SGLang
through its adapter (``refcache.engines.sglang``). vLLM's family is ``refcache.vllm``, with the same roles.
"""

from refcache.hicache.family import FAMILY, diff_snapshots, status_line, without_slots

__all__ = ["FAMILY", "diff_snapshots", "status_line", "without_slots"]
