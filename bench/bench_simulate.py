"""Workload simulation throughput: the Mooncake conversation trace through the model.

Replays the trace (``refcache.sim``) once per accounting mode and splits the wall time into the
system's ``apply`` (the cache itself), ``snapshot`` (the audit that counts L1→L2 copies and L2
evictions) and the simulator's own work, so a slow run says where its time went. Both modes run side by
side in one process: compare them as a ratio, not as absolute seconds.

    python bench/bench_simulate.py [--trace PATH] [--limit N] [--l3] [--modes 0,1] [--profile 25]

``--modes`` lists ``audit_every`` values (0: snapshots at the ends only; 1: one per request, exact).
``--profile N`` runs the last mode under cProfile and prints the N functions with the most own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from collections import Counter
from pathlib import Path
from types import TracebackType
from typing import Self

os.environ.setdefault("REFCACHE_TORCH_THREADS", "1")  # before refcache.gpu loads (specs/data-plane.md)

from refcache.config import HiCacheConfig
from refcache.hicache.ops import Observation, Op
from refcache.hicache.snapshot import Snapshot
from refcache.sim import SimOptions, SimReport, Workload, simulate
from refcache.systems import HiCacheSystem, open_systems

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
)


class TimedSystem:
    """A ``HiCacheSystem`` that adds up the time spent in ``apply`` (per operation) and ``snapshot``."""

    def __init__(self, system: HiCacheSystem) -> None:
        self.system = system
        self.apply_s: dict[str, float] = {}
        self.calls: Counter[str] = Counter()
        self.snapshot_s = 0.0
        self.snapshots = 0

    def apply(self, op: Op) -> Observation:
        start = time.perf_counter()
        try:
            return self.system.apply(op)
        finally:
            name = type(op).__name__
            self.apply_s[name] = self.apply_s.get(name, 0.0) + time.perf_counter() - start
            self.calls[name] += 1

    def snapshot(self) -> Snapshot:
        start = time.perf_counter()
        try:
            return self.system.snapshot()
        finally:
            self.snapshot_s += time.perf_counter() - start
            self.snapshots += 1

    def close(self) -> None:
        self.system.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def run(workload: Workload, config: HiCacheConfig, audit_every: int) -> tuple[SimReport, TimedSystem]:
    with open_systems(["model"], config) as systems:
        timed = TimedSystem(systems["model"])
        report = simulate(
            workload, config, SimOptions(audit_every=audit_every), system=timed, trace_name="bench"
        )
    return report, timed


def describe(report: SimReport, timed: TimedSystem, audit_every: int) -> str:
    apply_s = sum(timed.apply_s.values())
    own = report.seconds - apply_s - timed.snapshot_s
    top = ", ".join(
        f"{name} {seconds:.1f}s/{timed.calls[name]}"
        for name, seconds in sorted(timed.apply_s.items(), key=lambda kv: -kv[1])[:4]
    )
    rates = report.hit_rates
    return (
        f"audit_every={audit_every}: {report.seconds:6.1f} s  {report.requests / report.seconds:7.0f} req/s"
        f"  | apply {apply_s:5.1f} s  snapshot {timed.snapshot_s:5.1f} s ({timed.snapshots})"
        f"  simulator {own:4.1f} s\n"
        f"    apply by op: {top}\n"
        f"    hit L1 {rates['l1']:.3f} L2 {rates['l2']:.3f} L3 {rates['l3']:.3f} total {rates['total']:.3f} "
        f"(Belady L1 {rates['belady_l1']:.3f}, L1+L2 {rates['belady_l1_l2']:.3f}, "
        f"infinite {rates['infinite']:.3f})"
        + (
            f"  L1→L2 {report.moved.l1_to_l2:,}  L2 evicted {report.evicted.l2:,} ({report.audit})"
            if report.audit != "off"
            else ""
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--limit", type=int, default=0, help="first N requests (0: all)")
    parser.add_argument("--l1-tokens", type=int, default=16384)
    parser.add_argument("--hicache-ratio", "--l2-ratio", type=float, default=2.0)
    parser.add_argument("--hicache-write-policy", "--write-policy", default="write_through")
    parser.add_argument("--l3", action="store_true", help="enable L3 (prefetch and backup)")
    parser.add_argument("--modes", default="0,1", help="comma-separated audit_every values")
    parser.add_argument("--profile", type=int, default=0, help="profile the last mode, print N rows")
    args = parser.parse_args()

    start = time.perf_counter()
    workload = Workload.from_trace(args.trace, block_tokens=16, limit=args.limit or None)
    load_s = time.perf_counter() - start
    config = HiCacheConfig(
        device_size=args.l1_tokens,
        hicache_ratio=args.hicache_ratio,
        page_size=16,
        hicache_write_policy=args.hicache_write_policy,
        hicache_storage_backend="file" if args.l3 else None,
        prefetch_threshold=16,
    ).resolve()
    start = time.perf_counter()
    workload.optimal_hit_tokens(config.device_size)
    workload.optimal_hit_tokens(config.device_size + config.host_size)
    bound_s = time.perf_counter() - start
    print(
        f"{len(workload.requests)} requests, {workload.input_tokens:,} input tokens (block 512→16); "
        f"L1 {config.device_size}, L2 {config.host_size}, L3 {'on' if args.l3 else 'off'}, "
        f"{config.hicache_write_policy.value}; read+scale {load_s:.1f} s, Belady bounds {bound_s:.1f} s"
    )
    modes = [int(m) for m in args.modes.split(",")]
    for i, audit_every in enumerate(modes):
        if args.profile and i == len(modes) - 1:
            profiler = cProfile.Profile()
            report, timed = profiler.runcall(run, workload, config, audit_every)
            out = io.StringIO()
            stats = pstats.Stats(profiler, stream=out)
            stats.sort_stats("tottime").print_stats(args.profile)
            print(describe(report, timed, audit_every) + "  [under cProfile]")
            print(out.getvalue())
        else:
            report, timed = run(workload, config, audit_every)
            print(describe(report, timed, audit_every))


if __name__ == "__main__":
    main()
