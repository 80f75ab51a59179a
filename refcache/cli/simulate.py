"""``refcache simulate``: a Mooncake request trace through the cache tiers of one system, with a report of
where every input token came from; ``--sweep`` runs a grid and plots it (``refcache.sim.command``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from refcache.check.plan import config_with
from refcache.cli import options as o
from refcache.config import AttentionKind, EvictionPolicy, IOBackend, MemLayout, PrefetchPolicy
from refcache.errors import ConfigError, UsageError
from refcache.sim import SimOptions, SweepGrid, run_command
from refcache.systems import SYSTEMS

SHORT_HELP = "Replay a Mooncake request trace through the cache tiers."


def simulate(
    trace: o.MooncakeTrace = None,
    l1_tokens: o.L1Tokens = o.DEFAULT_L1_TOKENS,
    hicache_ratio: o.HiCacheRatio = 2.0,
    hicache_size: o.HiCacheSize = 0.0,
    hicache_storage_backend: o.StorageBackendOption = None,
    l3: o.L3Alias = None,
    page_size: o.PageSize = 16,
    block_tokens: o.BlockTokens = 16,
    hicache_write_policy: o.WritePolicyDefaulted = o.DEFAULT_WRITE_POLICY,
    radix_eviction_policy: o.EvictionPolicyOption = EvictionPolicy.LRU,
    hicache_storage_prefetch_policy: o.PrefetchPolicyOption = PrefetchPolicy.BEST_EFFORT,
    prefetch_threshold: o.PrefetchThreshold = 16,
    prefetch_timeout_base: o.PrefetchTimeoutBase = 1.0,
    prefetch_timeout_per_ki_token: o.PrefetchTimeoutPerKiToken = 0.25,
    load_back_threshold: o.LoadBackThreshold = 10,
    storage_batch_size: o.StorageBatchSize = 128,
    hicache_io_backend: Annotated[
        IOBackend | None,
        o._enum_option(
            o._IO, IOBackend, "BACKEND", " Default: kernel; direct for --against impl without CUDA."
        ),
    ] = None,
    hicache_mem_layout: o.MemLayoutOption = MemLayout.LAYER_FIRST,
    tp_size: o.TpSize = 1,
    attention: o.Attention = AttentionKind.MHA,
    limit: o.Limit = 0,
    against: o.AgainstOne = "model",
    queue_delay_us: Annotated[
        int, typer.Option(metavar="N", min=0, help="Arrival to first admission check (prefetch I/O runs).")
    ] = 10_000,
    l3_batch_us: Annotated[
        int, typer.Option(metavar="N", min=1, help="Logical time of one L3 read batch.")
    ] = 1_000,
    drain_every: Annotated[
        int, typer.Option(metavar="N", min=1, help="Requests between background I/O drains.")
    ] = 1,
    audit_every: Annotated[
        int,
        typer.Option(
            metavar="N",
            min=0,
            help="Count L1→L2 copies and L2 evictions from a snapshot every N requests: 1 is exact, more "
            "gives lower bounds, 0 (the default) does not count them. Snapshots make a run several times "
            "slower.",
        ),
    ] = 0,
    check_invariants: Annotated[
        bool, typer.Option(help="Check every invariant after every request (slow).")
    ] = False,
    as_json: o.Json = False,
    per_request: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE.csv",
            help="Write one CSV row per request: hit tokens and pages per tier, computed, evicted, prefetch "
            "outcome. Takes a snapshot after every request (as --audit-every 1).",
        ),
    ] = None,
    run_sweep: Annotated[
        bool,
        typer.Option(
            "--sweep",
            help="Run the grid of L2 ratio × eviction × write policy (default 16 configurations). Time: a "
            "configuration of the 12,031-request conversation trace takes about 10-20 s on a quiet 2-core "
            "machine, so the default grid 3-5 minutes, several times that under load: use --limit, a "
            "smaller grid or --jobs. Off a terminal it prints a line per configuration.",
        ),
    ] = False,
    jobs: o.Jobs = 1,
    sweep_l2_ratios: Annotated[
        str, typer.Option(metavar="X,Y,...", help="Comma-separated L2 ratios for --sweep.")
    ] = "1.5,2,4,8",
    sweep_evictions: Annotated[
        str, typer.Option(metavar="POLICY,...", help="Comma-separated eviction strategies for --sweep.")
    ] = "lru,lfu",
    sweep_write_policies: Annotated[
        str, typer.Option(metavar="POLICY,...", help="Comma-separated write policies for --sweep.")
    ] = "write_through,write_back",
    plot: Annotated[Path, typer.Option(metavar="FILE.png", help="PNG written by --sweep.")] = Path(
        "simulate-sweep.png"
    ),
    oracle: o.Oracle = "full",
) -> None:
    """Replay a Mooncake request trace through the cache and report where every input token came from
    (L1, L2, L3 or computed), the bytes moved between tiers, evictions, prefetch outcomes, and Belady's
    offline-optimal hit rate at the same capacities. With --sweep, run a grid and plot it."""
    trace = o.trace_or_bundled(trace)
    systems = o.against_systems(against)
    if len(systems) != 1:
        raise typer.BadParameter(
            f"simulate replays on one system, not {', '.join(systems)}", param_hint="--against"
        )
    if per_request is not None and run_sweep:
        raise typer.BadParameter("--per-request writes one run's requests; --sweep runs many")
    fields: dict[str, object] = {
        "device_size": l1_tokens,
        "hicache_ratio": hicache_ratio,
        "hicache_size": hicache_size,
        "hicache_storage_backend": o.storage_backend(hicache_storage_backend, l3)[0],
        "page_size": page_size,
        "hicache_write_policy": hicache_write_policy,
        "radix_eviction_policy": radix_eviction_policy,
        "hicache_storage_prefetch_policy": hicache_storage_prefetch_policy,
        "prefetch_threshold": prefetch_threshold,
        "prefetch_timeout_base": prefetch_timeout_base,
        "prefetch_timeout_per_ki_token": prefetch_timeout_per_ki_token,
        "load_back_threshold": load_back_threshold,
        "storage_batch_size": storage_batch_size,
        "hicache_mem_layout": hicache_mem_layout,
        "tp_size": tp_size,
        "attention": attention,
    }
    if hicache_io_backend is not None:
        fields["hicache_io_backend"] = hicache_io_backend
    option_names = [*fields, "hicache_io_backend", *(f.name for f in dataclasses.fields(SimOptions))]
    o.require_installed(systems)
    try:  # bad values and impossible combinations are usage o.errors, reported before the trace is read
        for name, (value, why) in SYSTEMS[systems[0]].host_defaults(systems[0]).items():
            if name not in fields:  # the user's choice wins
                fields[name] = value
                o.errors.print(why, highlight=False, soft_wrap=True)
        config = config_with(fields)
        options = SimOptions(
            system=systems[0],
            queue_delay_us=queue_delay_us,
            l3_batch_us=l3_batch_us,
            drain_every=drain_every,
            audit_every=1 if per_request is not None else audit_every,
            check_invariants=check_invariants,
            system_options=tuple(o.system_options_of(systems, oracle).get(systems[0], {}).items()),
        )
        grid = SweepGrid.parse(sweep_l2_ratios, sweep_evictions, sweep_write_policies) if run_sweep else None
    except (ConfigError, UsageError) as error:
        raise o.fail(o._option_message(str(error), option_names)) from error
    status = run_command(
        trace,
        config,
        options,
        block_tokens=block_tokens,
        limit=limit or None,
        grid=grid,
        plot=plot,
        as_json=as_json,
        per_request=per_request,
        jobs=jobs,
    )
    if status:
        raise typer.Exit(status)
