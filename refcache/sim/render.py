"""Rendering: a report, or a sweep's reports, as rich tables for the terminal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.table import Table

from refcache.sim.mooncake import TRACE_BLOCK_TOKENS
from refcache.sim.report import SimReport

if TYPE_CHECKING:
    from rich.console import RenderableType

__all__ = ["identical_series", "render_report", "render_sweep", "report_notes"]


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def policy_name(report: SimReport) -> str:
    """``"lru / write_back"``: a sweep series' name."""
    return f"{report.config.radix_eviction_policy.value} / {report.config.hicache_write_policy.value}"


def identical_series(reports: Sequence[SimReport]) -> dict[str, str]:
    """Series (eviction / write policy) of a sweep whose hit rates equal an earlier series' at every L2
    size: series -> the earlier one it equals."""
    series: dict[str, list[tuple[int, tuple[float, ...]]]] = {}
    for r in reports:
        series.setdefault(policy_name(r), []).append((r.config.host_size, tuple(r.hit_rates.values())))
    out: dict[str, str] = {}
    names = sorted(series)
    for i, name in enumerate(names):
        for earlier in names[:i]:
            if earlier not in out and sorted(series[earlier]) == sorted(series[name]):
                out[name] = earlier
                break
    return out


def report_notes(reports: Sequence[SimReport]) -> list[str]:
    """What a reader of these reports asks first, answered from the reports themselves: how the L2 size
    is computed, why L3 served nothing under write-back, why the infinite-cache bound stays above every
    policy, and which sweep series coincide."""
    notes: list[str] = []
    sized = {r.config.hicache_ratio: r.config for r in reports if r.config.hicache_size <= 0}
    if sized:
        examples = [
            f"ratio {ratio:g}: {int(c.device_size * ratio):,} // {c.page_size} + 1 = "
            f"{int(c.device_size * ratio) // c.page_size + 1:,} pages = {c.host_size:,} tokens"
            for ratio, c in sorted(sized.items())
        ]
        notes.append(
            "L2 size: as SGLang sizes its host pool (seed §6), int(L1 × ratio) tokens rounded down to whole "
            f"pages plus one page, every slot usable; {'; '.join(examples)}."
        )
    starved = [
        r
        for r in reports
        if r.config.enable_storage
        and r.served.l3 == 0
        and r.prefetch.refused.get("last_node_not_backuped", 0) > r.prefetch.started
    ]
    if starved:
        policies = sorted({r.config.hicache_write_policy.value for r in starved})
        notes.append(
            f"L3 served nothing under {', '.join(policies)}: a prefetch from L3 starts only below a matched "
            "prefix that L2 holds (the last matched node is backed up; seed §2.2), and most prefetches "
            "were refused for that (last_node_not_backuped). Under write_back a prefix reaches L2 only "
            "when L1 evicts it, so the prefix a request shares with an earlier one is usually in L1 alone."
        )
    notes.append(
        "infinite: the input tokens whose block some earlier request held (a cache that never evicts and "
        "ignores pages and prefixes). A paged radix cache cannot reach it when requests end in a short "
        "last block: matching is page-aligned, so the partial last page of a request never hits, even "
        "when an earlier request holds that block whole; nor can it hit a block after a missed one."
    )
    for name, earlier in sorted(identical_series(reports).items()):
        notes.append(
            f"{name} equals {earlier} at every L2 size (the plot draws it beneath that series, with larger markers)."
        )
    return notes


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
        ("pages", "right"),
        ("share", "right"),
        ("offline bound", "right"),
    ):
        served.add_column(name, justify=justify)  # type: ignore[arg-type]
    ps = cfg.page_size

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    def hit(label: str, tokens: int, share: float, bound: str = "") -> None:
        served.add_row(label, f"{tokens:,}", f"{tokens // ps:,}", pct(share), bound)  # hits: whole pages

    hit("L1 device hit", s.l1, rates["l1"], f"Belady(L1) {pct(rates['belady_l1'])}")
    hit("L2 loaded back", s.l2, rates["l2"])
    hit("L1 + L2", s.l1 + s.l2, rates["l1_l2"], f"Belady(L1+L2) {pct(rates['belady_l1_l2'])}")
    if cfg.enable_storage:
        hit("L3 prefetched, loaded", s.l3, rates["l3"])
    hit("total hit", s.l1 + s.l2 + s.l3, rates["total"], f"infinite {pct(rates['infinite'])}")
    served.add_row(
        "computed (miss)", f"{s.computed:,}", f"{s.computed_pages:,}", pct(report.rate(s.computed)), ""
    )
    served.add_row("  of which recomputed", f"{s.recomputed:,}", "", pct(report.rate(s.recomputed)), "")
    if s.rejected:
        served.add_row(
            "[red]rejected requests[/red]", f"{s.rejected:,}", "", pct(report.rate(s.rejected)), ""
        )
    served.add_row("input / output", f"{s.input:,} / {s.output:,}", "", "", "")

    moved = Table(
        title=f"data movement per rank ({report.bytes_per_token} bytes/token)", title_justify="left"
    )
    for name in ("direction", "tokens", "pages", "bytes"):
        moved.add_column(name, justify="left" if name == "direction" else "right")
    audit_prefix = {"exact": "", "lower_bound": "≥ ", "off": None}[report.audit]

    def row(label: str, tokens: int, *, audited: bool = False, with_bytes: bool = True) -> None:
        prefix = audit_prefix if audited else ""
        if prefix is None:
            moved.add_row(label, "not counted*", "", "")
            return
        amount = f"{prefix}{_bytes(tokens * report.bytes_per_token)}" if with_bytes else ""
        moved.add_row(label, f"{prefix}{tokens:,}", f"{prefix}{tokens // ps:,}", amount)

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
    audit = {
        "exact": "exact",
        "lower_bound": f"lower bounds (a snapshot every {report.options.audit_every} requests)",
        "off": "* not counted: they need a snapshot per request, which makes a run several times slower; "
        "--audit-every 1 counts them",
    }[report.audit]
    renderables.append(
        f"{report.seconds:.1f} s, {rps:,.0f} requests/s, {report.snapshots} snapshots; "
        f"L1→L2 copies and L2 evictions: {audit}"
    )
    renderables.extend(f"[dim]note:[/dim] {note}" for note in report_notes([report]))
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
