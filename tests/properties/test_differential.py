"""Model and implementation side by side: the same random operations, compared after every step.

Each step applies one operation to ``HiCacheModel`` and ``HiCacheImpl`` (real tensors, Triton or torch
transfers, a file L3 in a temporary directory, N ranks with an in-process group and a manual executor),
then the harness compares observations and full snapshots and checks every invariant on both. A failure
writes the shrunk run as a JSONL trace (``$REFCACHE_TRACE_DIR``, default ./refcache-traces) that
``refcache replay --against both`` re-executes.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from refcache.differential import DifferentialMachine, FaultyDifferentialMachine

_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)

TestDifferential = DifferentialMachine.TestCase
TestDifferential.settings = _SETTINGS

TestFaultyDifferential = FaultyDifferentialMachine.TestCase
TestFaultyDifferential.settings = _SETTINGS
