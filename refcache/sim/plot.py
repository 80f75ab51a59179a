"""The sweep plot: hit rate against L2 size, one panel per tier (matplotlib, imported only when drawing)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, NamedTuple

from refcache.config import EvictionPolicy, WritePolicy
from refcache.errors import UsageError
from refcache.sim.mooncake import TRACE_BLOCK_TOKENS
from refcache.sim.render import identical_series, policy_name
from refcache.sim.report import SimReport

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["SeriesStyle", "draw_sweep", "plot_sweep", "require_matplotlib", "series_styles"]

# How a series is told apart without colour (greyscale print, every kind of colour blindness): the marker
# names the eviction strategy; the line style and the marker's fill name the write policy. So (marker, line
# style, fill) differs between any two series, and colour only adds to it.
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
_FILLS: Final = {
    WritePolicy.WRITE_THROUGH: "full",
    WritePolicy.WRITE_THROUGH_SELECTIVE: "top",  # half filled
    WritePolicy.WRITE_BACK: "none",  # hollow
}
# Okabe and Ito's palette for colour-blind readers (without its yellow, too faint on white), one colour per
# series in the order they are drawn; none of them is the offline bound's grey.
_PALETTE: Final = ("#000000", "#E69F00", "#56B4E9", "#009E73", "#0072B2", "#D55E00", "#CC79A7")
_BOUND_COLOR: Final = "0.6"


class SeriesStyle(NamedTuple):
    """How one sweep series (an eviction strategy with a write policy) is drawn."""

    marker: str  # matplotlib marker: the eviction strategy
    linestyle: str  # the write policy
    fillstyle: str  # the write policy again, on the marker: full, top (half) or none (hollow)
    color: str  # from _PALETTE, in drawing order


def series_styles(reports: Sequence[SimReport]) -> dict[str, SeriesStyle]:
    """The style of each series of a sweep (``policy_name`` -> style), in drawing order (by name)."""
    policies: dict[str, tuple[EvictionPolicy, WritePolicy]] = {}
    for r in reports:
        policies[policy_name(r)] = (r.config.radix_eviction_policy, r.config.hicache_write_policy)
    return {
        name: SeriesStyle(_MARKERS[eviction], _LINE_STYLES[write], _FILLS[write], _PALETTE[i % len(_PALETTE)])
        for i, (name, (eviction, write)) in enumerate(sorted(policies.items()))
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
    policy styled by ``series_styles`` (marker: eviction; line style and marker fill: write policy;
    colour: the series), the offline bound wide, dashed and grey beneath them, and one legend for all
    panels outside them, below. A series equal to another everywhere is drawn beneath the others
    with larger markers and says so in the legend; the y axis leaves a fifth above the highest line.
    Needs matplotlib (imported here only).

    Raises ``UsageError`` when ``reports`` is empty or matplotlib is missing.
    """
    fig = draw_sweep(reports)  # checks reports and matplotlib first
    import matplotlib.pyplot as plt

    try:
        fig.savefig(os.fspath(path), dpi=100, bbox_inches="tight")  # the legend, below, included whole
    finally:
        plt.close(fig)


def draw_sweep(reports: Sequence[SimReport]) -> Figure:
    """The figure ``plot_sweep`` writes (the caller closes it: ``matplotlib.pyplot.close``). Raises as
    ``plot_sweep`` does."""
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
    styles = series_styles(reports)
    same = identical_series(reports)  # drawn beneath, larger, so that the series over them still shows
    panels = (
        ("L1 (device hit)", "l1", "belady_l1", "Belady"),
        ("L2 (loaded back)", "l2", None, ""),
        ("L1 + L2", "l1_l2", "belady_l1_l2", "Belady"),
        (f"total (L3 {l3})", "total", "infinite", "infinite cache"),
    )
    # constrained layout keeps the legend of the whole figure outside every panel ("outside lower center")
    fig, axes = plt.subplots(2, 2, figsize=(12, 10), sharex=True, layout="constrained")
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
                color=_BOUND_COLOR,
                zorder=1,
                label="offline bound (Belady; in the total panel, an infinite cache)",
            )
            top = max(top, *values)
            title = f"{title}; bound: {bound_label}"
        # Markers shrink from the first series drawn to the last, each on top of the one before: where
        # two series nearly meet, the earlier one's marker still rings the later one's.
        for index, (name, runs) in enumerate(sorted(by_policy.items())):
            runs = sorted(runs, key=lambda r: r.config.host_size)
            values = [r.hit_rates[key] for r in runs]
            top = max(top, *values)
            style = styles[name]
            hidden = name in same
            ax.plot(
                [r.config.host_size for r in runs],
                values,
                color=style.color,
                linestyle=style.linestyle,
                linewidth=1.8,
                marker=style.marker,
                fillstyle=style.fillstyle,
                markeredgewidth=1.5,
                markersize=14 if hidden else max(10 - 1.0 * index, 5),
                zorder=2 if hidden else 3 + index,
                label=f"{name} (= {same[name]}, beneath it)" if hidden else name,
            )
        ax.set_title(title)
        ax.set_ylabel("share of input tokens")
        ax.set_ylim(0, max(top * 1.2, 0.01))  # room above the highest line and the bound
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.grid(alpha=0.3)
        sizes = sorted({r.config.host_size for r in reports})
        ax.set_xscale("log", base=2)  # ratios are usually doublings: evenly spaced
        ax.set_xticks(sizes, [f"{size:,}" for size in sizes], fontsize=8)
        ax.minorticks_off()
    for ax in axes[1]:
        ax.set_xlabel("L2 capacity (simulated tokens)")
    # One legend for the four panels (the same series in each; the L1 panel's handles include the bound)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        loc="outside lower center",
        ncols=2,
        fontsize=9,
        title="eviction / write policy (marker: eviction; line and fill: write policy)",
        title_fontsize=9,
    )
    fig.suptitle(
        f"{first.trace}: {first.requests} requests, L1 {first.config.device_size} tokens, "
        f"block {TRACE_BLOCK_TOKENS}→{first.block_tokens}, L3 {l3}"
    )
    return fig
