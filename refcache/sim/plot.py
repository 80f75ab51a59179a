"""The sweep plot: hit rate against L2 size, one panel per tier (matplotlib, imported only when drawing)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Final

from refcache.config import EvictionPolicy, WritePolicy
from refcache.errors import UsageError
from refcache.sim.mooncake import TRACE_BLOCK_TOKENS
from refcache.sim.report import SimReport

__all__ = ["plot_sweep"]

_COLORS: Final = {
    EvictionPolicy.LRU: "tab:red",
    EvictionPolicy.LFU: "tab:blue",
    EvictionPolicy.FIFO: "tab:green",
    EvictionPolicy.MRU: "tab:purple",
    EvictionPolicy.FILO: "tab:brown",
    EvictionPolicy.PRIORITY: "tab:olive",
}
_LINE_STYLES: Final = {
    WritePolicy.WRITE_THROUGH: ("-", "o"),
    WritePolicy.WRITE_THROUGH_SELECTIVE: ("-.", "s"),
    WritePolicy.WRITE_BACK: (":", "^"),
}


def plot_sweep(reports: Sequence[SimReport], path: str | os.PathLike[str]) -> None:
    """Write a PNG of hit rate against L2 size: one panel per tier, one line per (eviction, write)
    policy, the offline bound dashed. Needs matplotlib (imported here only).

    Raises ``UsageError`` when ``reports`` is empty or matplotlib is missing.
    """
    if not reports:
        raise UsageError("nothing to plot: the sweep produced no runs")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on CI machines
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise UsageError(f"the sweep plot needs matplotlib ({error}); pip install matplotlib") from error
    first = reports[0]
    l3 = "on" if first.config.enable_storage else "off"
    by_policy: dict[str, list[SimReport]] = {}
    for r in reports:
        name = f"{r.config.radix_eviction_policy.value} / {r.config.hicache_write_policy.value}"
        by_policy.setdefault(name, []).append(r)
    panels = (
        ("L1 (device hit)", "l1", "belady_l1", "Belady, L1"),
        ("L2 (loaded back)", "l2", None, ""),
        ("L1 + L2", "l1_l2", "belady_l1_l2", "Belady, L1+L2"),
        (f"total (L3 {l3})", "total", "infinite", "every repeat (infinite cache)"),
    )
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for ax, (title, key, bound, bound_label) in zip(axes.flat, panels, strict=True):
        for name, runs in sorted(by_policy.items()):
            runs = sorted(runs, key=lambda r: r.config.host_size)
            style = _LINE_STYLES[runs[0].config.hicache_write_policy]  # equal lines stay distinguishable
            ax.plot(
                [r.config.host_size for r in runs],
                [r.hit_rates[key] for r in runs],
                color=_COLORS[runs[0].config.radix_eviction_policy],
                linestyle=style[0],
                marker=style[1],
                label=name,
            )
        if bound is not None:
            runs = sorted(reports, key=lambda r: r.config.host_size)
            ax.plot(
                [r.config.host_size for r in runs],
                [r.hit_rates[bound] for r in runs],
                linestyle="--",
                color="black",
                label=bound_label,
            )
        ax.set_title(title)
        ax.set_ylabel("fraction of input tokens")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("L2 capacity (simulated tokens)")
    fig.suptitle(
        f"{first.trace}: {first.requests} requests, L1 {first.config.device_size} tokens, "
        f"block {TRACE_BLOCK_TOKENS}→{first.block_tokens}, L3 {l3}"
    )
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)
    plt.close(fig)
