"""The sweep plot: hit rate against L2 size, one panel per tier (matplotlib, imported only when drawing)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Final

from refcache.config import EvictionPolicy, WritePolicy
from refcache.errors import UsageError
from refcache.sim.mooncake import TRACE_BLOCK_TOKENS
from refcache.sim.render import identical_series, policy_name
from refcache.sim.report import SimReport

__all__ = ["plot_sweep", "require_matplotlib"]

_COLORS: Final = {
    EvictionPolicy.LRU: "tab:red",
    EvictionPolicy.LFU: "tab:blue",
    EvictionPolicy.FIFO: "tab:green",
    EvictionPolicy.MRU: "tab:purple",
    EvictionPolicy.FILO: "tab:brown",
    EvictionPolicy.PRIORITY: "tab:olive",
}
_MARKERS: Final = {
    EvictionPolicy.LRU: "o",
    EvictionPolicy.LFU: "s",
    EvictionPolicy.FIFO: "D",
    EvictionPolicy.MRU: "v",
    EvictionPolicy.FILO: "P",
    EvictionPolicy.PRIORITY: "X",
}
_LINE_STYLES: Final = {
    WritePolicy.WRITE_THROUGH: "-",
    WritePolicy.WRITE_THROUGH_SELECTIVE: "-.",
    WritePolicy.WRITE_BACK: ":",
}


def require_matplotlib() -> None:
    """Raise ``UsageError`` saying how to install matplotlib when it does not import (the sweep checks
    this before it simulates anything)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise UsageError(
            f"--sweep draws its plot with matplotlib, which does not import here ({error}); "
            "install it with: pip install 'matplotlib>=3.7'"
        ) from None


def plot_sweep(reports: Sequence[SimReport], path: str | os.PathLike[str]) -> None:
    """Write a PNG of hit rate against L2 size: one panel per tier, one line per (eviction, write)
    policy (colour and marker: eviction; line style: write policy), the offline bound wide, dashed and
    grey beneath them. A series equal to another everywhere is drawn with larger hollow markers and says
    so in the legend; the y axis leaves a fifth above the highest line. Needs matplotlib (imported here
    only).

    Raises ``UsageError`` when ``reports`` is empty or matplotlib is missing.
    """
    if not reports:
        raise UsageError("nothing to plot: the sweep produced no runs")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on CI machines
        import matplotlib.pyplot as plt
        from matplotlib.ticker import PercentFormatter
    except ImportError as error:
        raise UsageError(f"the sweep plot needs matplotlib ({error}); pip install matplotlib") from error
    first = reports[0]
    l3 = "on" if first.config.enable_storage else "off"
    by_policy: dict[str, list[SimReport]] = {}
    for r in reports:
        by_policy.setdefault(policy_name(r), []).append(r)
    same = identical_series(reports)  # drawn hollow and larger, so the series under them still shows
    panels = (
        ("L1 (device hit)", "l1", "belady_l1", "Belady, L1"),
        ("L2 (loaded back)", "l2", None, ""),
        ("L1 + L2", "l1_l2", "belady_l1_l2", "Belady, L1+L2"),
        (f"total (L3 {l3})", "total", "infinite", "infinite cache (every repeat)"),
    )
    fig, axes = plt.subplots(2, 2, figsize=(11, 8.5), sharex=True)
    for ax, (title, key, bound, bound_label) in zip(axes.flat, panels, strict=True):
        top = 0.0
        if bound is not None:  # under the series: wide and light, so that a series on it stays visible
            runs = sorted(reports, key=lambda r: r.config.host_size)
            values = [r.hit_rates[bound] for r in runs]
            ax.plot(
                [r.config.host_size for r in runs],
                values,
                linestyle="--",
                linewidth=3,
                color="0.6",
                zorder=1,
                label=bound_label,
            )
            top = max(top, *values)
        # Markers shrink from the first series drawn to the last, each on top of the one before: where
        # two series nearly meet, the earlier one's marker still rings the later one's.
        for index, (name, runs) in enumerate(sorted(by_policy.items())):
            runs = sorted(runs, key=lambda r: r.config.host_size)
            values = [r.hit_rates[key] for r in runs]
            top = max(top, *values)
            hollow = name in same
            ax.plot(
                [r.config.host_size for r in runs],
                values,
                color=_COLORS[runs[0].config.radix_eviction_policy],
                linestyle=_LINE_STYLES[runs[0].config.hicache_write_policy],
                marker=_MARKERS[runs[0].config.radix_eviction_policy],
                markersize=12 if hollow else max(9 - 1.5 * index, 3),
                markerfacecolor="none" if hollow else None,
                zorder=2 if hollow else 3 + index,
                label=f"{name} (= {same[name]})" if hollow else name,
            )
        ax.set_title(title)
        ax.set_ylabel("share of input tokens")
        ax.set_ylim(0, max(top * 1.2, 0.01))  # room above the highest line and the bound
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
        sizes = sorted({r.config.host_size for r in reports})
        ax.set_xscale("log", base=2)  # ratios are usually doublings: evenly spaced
        ax.set_xticks(sizes, [f"{size:,}" for size in sizes], fontsize=8)
        ax.minorticks_off()
    for ax in axes[1]:
        ax.set_xlabel("L2 capacity (simulated tokens)")
    fig.suptitle(
        f"{first.trace}: {first.requests} requests, L1 {first.config.device_size} tokens, "
        f"block {TRACE_BLOCK_TOKENS}→{first.block_tokens}, L3 {l3}"
    )
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)
    plt.close(fig)
