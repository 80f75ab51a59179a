"""Rendering: a report, or a sweep's reports, as rich tables for the terminal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.table import Table

from refcache.sim.mooncake import TRACE_BLOCK_TOKENS
from refcache.sim.report import SimReport

if TYPE_CHECKING:
    from rich.console import RenderableType

__all__ = ["render_report", "render_sweep"]


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def render_report(report: SimReport) -> list[RenderableType]:
    """The report as rich renderables: a header line and three tables (served, moved, prefetch)."""
    cfg, s, rates = report.config, report.served, report.hit_rates
    l2 = f"ratio {cfg.hicache_ratio:g}" if cfg.hicache_size <= 0 else f"{cfg.hicache_size:g} GB"
    header = (
        f"[bold]{report.trace}[/bold]: {report.requests} requests, system {report.options.system}, "
        f"block {TRACE_BLOCK_TOKENS}→{report.block_tokens} "
        f"(1 token = {report.token_scale:g} trace tokens)\n"
        f"L1 {cfg.device_size} · L2 {cfg.host_size} ({l2}) · L3 {'on' if cfg.enable_storage else 'off'} · "
        f"page {cfg.page_size} · {cfg.hicache_write_policy.value} · {cfg.radix_eviction_policy.value} · "
        f"prefetch {cfg.hicache_storage_prefetch_policy.value} · TP {cfg.tp_size} {cfg.attention.value}"
    )
    served = Table(title="input tokens served", title_justify="left")
    for name, justify in (
        ("from", "left"),
        ("tokens", "right"),
        ("share", "right"),
        ("offline bound", "right"),
    ):
        served.add_column(name, justify=justify)  # type: ignore[arg-type]

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    served.add_row("L1 device hit", f"{s.l1:,}", pct(rates["l1"]), f"Belady(L1) {pct(rates['belady_l1'])}")
    served.add_row("L2 loaded back", f"{s.l2:,}", pct(rates["l2"]), "")
    served.add_row(
        "L1 + L2", f"{s.l1 + s.l2:,}", pct(rates["l1_l2"]), f"Belady(L1+L2) {pct(rates['belady_l1_l2'])}"
    )
    if cfg.enable_storage:
        served.add_row("L3 prefetched, loaded", f"{s.l3:,}", pct(rates["l3"]), "")
    served.add_row(
        "total hit", f"{s.l1 + s.l2 + s.l3:,}", pct(rates["total"]), f"infinite {pct(rates['infinite'])}"
    )
    served.add_row("computed (miss)", f"{s.computed:,}", pct(report.rate(s.computed)), "")
    served.add_row("  of which recomputed", f"{s.recomputed:,}", pct(report.rate(s.recomputed)), "")
    if s.rejected:
        served.add_row("[red]rejected requests[/red]", f"{s.rejected:,}", pct(report.rate(s.rejected)), "")
    served.add_row("input / output", f"{s.input:,} / {s.output:,}", "", "")

    moved = Table(
        title=f"data movement per rank ({report.bytes_per_token} bytes/token)", title_justify="left"
    )
    for name in ("direction", "tokens", "bytes"):
        moved.add_column(name, justify="left" if name == "direction" else "right")
    audit_prefix = {"exact": "", "lower_bound": "≥ ", "off": None}[report.audit]

    def row(label: str, tokens: int, *, audited: bool = False, with_bytes: bool = True) -> None:
        prefix = audit_prefix if audited else ""
        if prefix is None:
            moved.add_row(label, "not audited", "")
            return
        amount = f"{prefix}{_bytes(tokens * report.bytes_per_token)}" if with_bytes else ""
        moved.add_row(label, f"{prefix}{tokens:,}", amount)

    row("L1→L2 (write)", report.moved.l1_to_l2, audited=True)
    row("L2→L1 (load back)", report.moved.l2_to_l1)
    if cfg.enable_storage:
        row("L2→L3 (backup)", report.moved.l2_to_l3)
        row("L3→L2 (prefetch)", report.moved.l3_to_l2)
    row("evicted from L1", report.evicted.l1, with_bytes=False)
    row("evicted from L2", report.evicted.l2, audited=True, with_bytes=False)

    renderables: list[RenderableType] = [header, served, moved]
    if cfg.enable_storage:
        p = report.prefetch
        prefetch = Table(title="L3 prefetch", title_justify="left")
        prefetch.add_column("outcome")
        prefetch.add_column("count", justify="right")
        prefetch.add_row("started", f"{p.started:,}")
        for reason, count in p.refused.items():
            prefetch.add_row(f"refused: {reason}", f"{count:,}")
        prefetch.add_row("revoked (too few L3 hits)", f"{p.revoked:,}")
        prefetch.add_row("timed out", f"{p.timed_out:,}")
        prefetch.add_row("cut short (best effort)", f"{p.cut_short:,}")
        prefetch.add_row("tokens inserted into L2", f"{p.inserted:,}")
        renderables.append(prefetch)
    rps = report.requests / report.seconds if report.seconds else 0.0
    renderables.append(
        f"{report.seconds:.1f} s, {rps:,.0f} requests/s; L1→L2 / L2 eviction audit: "
        f"{report.audit.replace('_', ' ')} ({report.snapshots} snapshots)"
    )
    return renderables


def render_sweep(reports: Sequence[SimReport]) -> Table:
    """A sweep's reports as one table: a row per run, its hit rate per tier and the offline bounds."""
    table = Table(title="sweep: hit rate of input tokens", title_justify="left")
    for name in (
        "L2 tokens",
        "eviction",
        "write policy",
        "L1",
        "L2",
        "L3",
        "total",
        "Belady L1",
        "Belady L1+L2",
        "infinite",
    ):
        table.add_column(name, justify="right")
    for r in reports:
        h = r.hit_rates
        table.add_row(
            f"{r.config.host_size:,}",
            r.config.radix_eviction_policy.value,
            r.config.hicache_write_policy.value,
            *(
                f"{100 * h[k]:.1f}%"
                for k in ("l1", "l2", "l3", "total", "belady_l1", "belady_l1_l2", "infinite")
            ),
        )
    return table
