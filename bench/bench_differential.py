"""Differential steps per second: model + implementation + checks, one rank, direct io backend.

Runs a seeded random workload (``refcache.check.generate``) through the harness with both systems and reports
steps per second and the share of time spent in the model, the implementation (apply + snapshot) and
the checks (comparison, invariants). Target: >= 500 steps/s on one core of the 2-core development machine.

    python bench/bench_differential.py [--steps 3000]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("REFCACHE_TORCH_THREADS", "1")  # refcache.gpu applies it (specs/data-plane.md §10)

from refcache.check.generate import random_ops
from refcache.check.harness import Harness
from refcache.config import HiCacheConfig, IOBackend, WritePolicy
from refcache.errors import UsageError
from refcache.hicache import FAMILY as HICACHE
from refcache.systems import open_systems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    config = HiCacheConfig(
        device_size=64,
        page_size=4,
        hicache_io_backend=IOBackend.DIRECT,
        hicache_write_policy=WritePolicy.WRITE_THROUGH,
        hicache_storage_backend="file",
        prefetch_threshold=4,
        load_back_threshold=4,
    )
    with open_systems(("model", "impl"), config) as systems:
        harness = Harness(config, systems, write_trace=False, family=HICACHE)
        started = time.perf_counter()
        errors = 0
        for op in random_ops(config, args.steps, seed=1):
            if isinstance(harness.step(op), UsageError):
                errors += 1
        elapsed = time.perf_counter() - started
    t = harness.timings
    checks = t.get("compare", 0.0) + t.get("invariants", 0.0)
    print(
        f"{args.steps} steps in {elapsed:.1f} s: {args.steps / elapsed:.0f} steps/s ({errors} expected usage errors)"
    )
    for name, spent in (("model", t["model"]), ("implementation", t["impl"]), ("checks", checks)):
        print(f"  {name:<15} {spent:6.2f} s  {100 * spent / elapsed:5.1f}%")


if __name__ == "__main__":
    main()
