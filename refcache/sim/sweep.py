"""Sweeps: one simulation per point of a grid of L2 size × eviction strategy × write policy.

``SweepGrid.parse`` reads a grid from the command line's comma-separated lists; ``sweep`` runs one, each
point on a fresh system, and returns the reports in the grid's nesting order (``refcache.sim.plot``
draws them, ``refcache.sim.render`` tabulates them).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from refcache.config import EvictionPolicy, HiCacheConfig, WritePolicy
from refcache.errors import UsageError
from refcache.sim.report import SimReport
from refcache.sim.simulator import SimOptions, simulate
from refcache.sim.workload import Workload

__all__ = ["SweepGrid", "sweep"]

_T = TypeVar("_T")


def _split(text: str, kind: Callable[[str], _T], option: str) -> tuple[_T, ...]:
    """The comma-separated values of ``option``, each converted by ``kind``. Raises ``UsageError`` naming
    the option for an empty list or a value ``kind`` refuses (``ValueError``)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise UsageError(f"{option} needs at least one value")
    values: list[_T] = []
    for item in items:
        try:
            values.append(kind(item))
        except ValueError:
            raise UsageError(f"{option}: {item!r} is not valid") from None
    return tuple(values)


@dataclass(frozen=True)
class SweepGrid:
    """The points of a sweep: every L2 ratio × eviction strategy × write policy (``sweep``'s order)."""

    l2_ratios: tuple[float, ...]
    evictions: tuple[EvictionPolicy, ...]
    write_policies: tuple[WritePolicy, ...]

    @classmethod
    def parse(cls, l2_ratios: str, evictions: str, write_policies: str) -> SweepGrid:
        """A grid from comma-separated lists (``"1.5,2,4"``, ``"lru,lfu"``, ``"write_back"``). Raises
        ``UsageError`` naming the command-line option (``--sweep-l2-ratios``, ``--sweep-evictions``,
        ``--sweep-write-policies``) whose list is empty or holds a value that is not valid."""
        return cls(
            _split(l2_ratios, float, "--sweep-l2-ratios"),
            _split(evictions, EvictionPolicy, "--sweep-evictions"),
            _split(write_policies, WritePolicy, "--sweep-write-policies"),
        )

    @property
    def runs(self) -> int:
        """Simulations in the sweep."""
        return len(self.l2_ratios) * len(self.evictions) * len(self.write_policies)


def sweep(
    workload: Workload,
    base: HiCacheConfig,
    *,
    l2_ratios: Sequence[float],
    evictions: Sequence[EvictionPolicy | str],
    write_policies: Sequence[WritePolicy | str],
    options: SimOptions | None = None,
    trace_name: str = "trace",
    on_request: Callable[[int], None] | None = None,
    on_run: Callable[[SimReport], None] | None = None,
    jobs: int = 1,
) -> list[SimReport]:
    """One ``simulate`` per (L2 ratio, eviction strategy, write policy), in that nesting order, each on a
    fresh system ``options.system`` (closed after its run).

    ``on_run`` is called after each run, in grid order. ``jobs`` > 1 runs the configurations in that many
    spawned worker processes (they are independent; the reports are the same as with one, in the same
    order; ``on_request`` is then not called). Raises what ``simulate`` raises.
    """
    configs = [
        dataclasses.replace(
            base,
            hicache_ratio=ratio,
            hicache_size=0.0,
            radix_eviction_policy=EvictionPolicy(eviction),
            hicache_write_policy=WritePolicy(write_policy),
        )
        for ratio in l2_ratios
        for eviction in evictions
        for write_policy in write_policies
    ]
    reports: list[SimReport] = []
    if jobs > 1:
        context = multiprocessing.get_context("spawn")  # torch is not fork-safe once it has run
        with ProcessPoolExecutor(max_workers=min(jobs, len(configs)), mp_context=context) as pool:
            runs = pool.map(_simulate_one, [(workload, c, options, trace_name) for c in configs])
            for report in runs:
                reports.append(report)
                if on_run is not None:
                    on_run(report)
        return reports
    for config in configs:
        report = simulate(workload, config, options, trace_name=trace_name, on_request=on_request)
        reports.append(report)
        if on_run is not None:
            on_run(report)
    return reports


def _simulate_one(job: tuple[Workload, HiCacheConfig, SimOptions | None, str]) -> SimReport:
    """One configuration of a sweep, in a worker process."""
    workload, config, options, trace_name = job
    return simulate(workload, config, options, trace_name=trace_name)
