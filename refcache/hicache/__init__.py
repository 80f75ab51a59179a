"""SGLang HiCache's engine family: a radix tree over device (L1), host (L2) and storage (L3) tiers.

``refcache.hicache.FAMILY`` is the family object the checking side is generic over (``refcache.family``).
Its modules, with the same names as vLLM's (``refcache.vllm``) for the same roles:

* ``ops``: the operation alphabet and its observations, with their JSON codec;
* ``snapshot``: the plain-data snapshot, per rank;
* ``invariants``: the named invariants over a snapshot (``specs/invariants.md``);
* ``states``: the node states and the prefetch stages as transition tables;
* ``trace``: the trace codec; ``recording``: traces recorded on an engine, with what it observed;
* ``scenarios``: the directed conformance scenarios;
* ``family``: ``FAMILY``, the snapshot diff, the status line and the ``no-slots`` granularity.

Its systems are the reference model (``refcache.model``), the implementation (``refcache.gpu``) and SGLang
through its adapter (``refcache.engines.sglang``).
"""

from refcache.hicache.family import FAMILY, diff_snapshots, status_line, without_slots

__all__ = ["FAMILY", "diff_snapshots", "status_line", "without_slots"]
