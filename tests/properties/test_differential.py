"""Model and implementation side by side: the same random operations, compared after every step.

Each step applies one operation to ``HiCacheModel`` and ``HiCacheImpl`` (real tensors, Triton or torch
transfers, a file L3 in a temporary directory, N ranks with an in-process group and a manual executor),
then the harness compares observations and full snapshots and checks every invariant on both. A failure
writes the run as a JSONL trace (``$REFCACHE_TRACE_DIR``, default ./refcache-traces) that
``refcache replay --against both`` re-executes.
"""

from __future__ import annotations

from refcache.check import budget
from refcache.check.machines import DifferentialMachine, FaultyDifferentialMachine

TestDifferential = DifferentialMachine.TestCase
TestDifferential.settings = budget.DIFFERENTIAL.settings()

TestFaultyDifferential = FaultyDifferentialMachine.TestCase
TestFaultyDifferential.settings = budget.DIFFERENTIAL.settings()
