"""Workload simulation: replay a real request trace through a system and account for every tier.

Theory of operation
-------------------
A run is a pipeline; each stage's module says how it works and why it is right:

1. **Trace** (``refcache.sim.mooncake``): a Mooncake trace, JSON Lines of arrival time, input and output
   lengths and one prefix-encoding id per 512-token block, is read and validated line by line.
2. **Workload** (``refcache.sim.workload``): the trace is put in arrival order and scaled to
   ``block_tokens`` simulated tokens per block, so that a token id names its whole prefix; Belady's
   offline rule over the block sequence gives upper bounds on the hits any cache of a capacity can get.
3. **Simulator** (``refcache.sim.simulator``): ``simulate`` drives a ``refcache.systems.System`` (the
   reference model by default, or the implementation) request by request, as a scheduler would: L3
   prefetch, admission, finish and background I/O drains on a logical clock. It does not re-implement
   the cache: every counter is taken from an observation or derived from snapshot deltas, and its
   docstring says which, and on which property of the system a derivation relies.
4. **Report** (``refcache.sim.report``): ``SimReport`` holds the counters (input tokens served from L1,
   L2, L3 or computed; tokens moved between tiers; evictions; prefetch outcomes) next to the offline
   bounds, in simulated tokens and bytes per rank, with its JSON form.
5. **Sweep, plot, render** (``refcache.sim.sweep``, ``refcache.sim.plot``, ``refcache.sim.render``): a
   grid of L2 size × eviction strategy × write policy, its PNG (matplotlib, imported only to draw) and
   rich tables for the terminal.
6. **Command** (``refcache.sim.command``): what ``refcache simulate`` runs once ``refcache.cli`` has
   parsed its options.
"""

from __future__ import annotations

from refcache.sim.command import run_command
from refcache.sim.mooncake import TRACE_BLOCK_TOKENS, TraceRequest, parse_mooncake, read_mooncake_trace
from refcache.sim.plot import plot_sweep
from refcache.sim.render import identical_series, render_report, render_sweep, report_notes
from refcache.sim.report import (
    Bounds,
    Evicted,
    Moved,
    Prefetches,
    RequestRecord,
    Served,
    SimReport,
    write_csv,
)
from refcache.sim.simulator import SimOptions, simulate
from refcache.sim.sweep import SweepGrid, sweep
from refcache.sim.workload import SimRequest, Workload, belady_hits

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "Bounds",
    "Evicted",
    "Moved",
    "Prefetches",
    "RequestRecord",
    "Served",
    "SimOptions",
    "SimReport",
    "SimRequest",
    "SweepGrid",
    "TraceRequest",
    "Workload",
    "belady_hits",
    "identical_series",
    "parse_mooncake",
    "plot_sweep",
    "read_mooncake_trace",
    "render_report",
    "render_sweep",
    "report_notes",
    "run_command",
    "simulate",
    "sweep",
    "write_csv",
]
