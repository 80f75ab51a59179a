"""The ``--sweep`` plot (``refcache.sim.plot``): every series can be told apart without colour (greyscale
print, colour-blind readers) and with it, and the legend covers no data."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from refcache.config import EvictionPolicy, HiCacheConfig, WritePolicy
from refcache.sim import SimReport, Workload, read_mooncake_trace, sweep
from refcache.sim.plot import _PALETTE, draw_sweep, plot_sweep, series_styles

EXCERPT = Path(__file__).parent.parent / "data" / "mooncake_conversation_head300.jsonl"


@pytest.fixture(scope="module")
def full_grid() -> list[SimReport]:
    """Every eviction strategy with every write policy (18 series) at two L2 sizes, on a small workload."""
    w = Workload(read_mooncake_trace(EXCERPT, limit=12), 2)
    return sweep(
        w,
        HiCacheConfig(device_size=512, page_size=2),
        l2_ratios=(1.5, 3.0),
        evictions=tuple(EvictionPolicy),
        write_policies=tuple(WritePolicy),
    )


def test_every_series_differs_in_marker_line_and_fill_and_in_colour_from_its_neighbours(
    full_grid: list[SimReport],
) -> None:
    styles = series_styles(full_grid)
    assert len(styles) == len(EvictionPolicy) * len(WritePolicy)
    # without colour (greyscale, any colour blindness): marker, line style and fill tell every pair apart
    without_colour = [(s.marker, s.linestyle, s.fillstyle) for s in styles.values()]
    assert len(set(without_colour)) == len(without_colour)
    # and each of the two dimensions is coded on its own: marker <-> eviction, line style and fill <-> write
    by_eviction: dict[str, set[str]] = {}
    by_write: dict[str, set[tuple[str, str]]] = {}
    for name, s in styles.items():
        eviction, write = name.split(" / ")
        by_eviction.setdefault(eviction, set()).add(s.marker)
        by_write.setdefault(write, set()).add((s.linestyle, s.fillstyle))
    assert all(len(markers) == 1 for markers in by_eviction.values())
    assert len({next(iter(m)) for m in by_eviction.values()}) == len(EvictionPolicy)
    assert all(len(lines) == 1 for lines in by_write.values())
    assert len({next(iter(w)) for w in by_write.values()}) == len(WritePolicy)
    # colours from the colour-blind-safe palette, every series of a sweep of up to 7 its own
    assert {s.color for s in styles.values()} <= set(_PALETTE)
    for first, second in itertools.pairwise(styles.values()):
        assert first.color != second.color
    small = series_styles([r for r in full_grid if r.config.radix_eviction_policy in ("lru", "lfu")])
    assert len({s.color for s in small.values()}) == len(small) == 6  # lfu/write_back vs lfu/write_through


def test_the_drawn_lines_carry_the_styles_and_the_legend_sits_outside_every_panel(
    full_grid: list[SimReport], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    styles = series_styles(full_grid)
    fig = draw_sweep(full_grid)
    try:
        for ax in fig.axes:
            drawn = {
                str(line.get_label()).split(" (= ")[0]: (
                    line.get_marker(),
                    line.get_linestyle(),
                    line.get_fillstyle(),
                    to_hex(line.get_color()),
                )
                for line in ax.get_lines()
                if str(line.get_label()) != "" and not str(line.get_label()).startswith("offline bound")
            }
            assert set(drawn) == set(styles), ax.get_title()
            for name, (marker, linestyle, fill, color) in drawn.items():
                expected = styles[name]
                assert (marker, fill, color) == (expected.marker, expected.fillstyle, to_hex(expected.color))
                assert linestyle == {"-": "-", "-.": "-.", ":": ":"}[expected.linestyle]
            triples = [(m, ls, c) for m, ls, _, c in drawn.values()]
            assert len(set(triples)) == len(triples)  # (marker, line style, colour) pairwise distinct
            assert ax.get_legend() is None  # no legend inside a panel
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
        assert len(fig.legends) == 1
        legend = fig.legends[0].get_window_extent(renderer)
        for ax in fig.axes:
            assert not legend.overlaps(ax.get_window_extent(renderer)), ax.get_title()
        figure = fig.bbox
        assert (
            figure.x0 <= legend.x0
            and legend.x1 <= figure.x1
            and figure.y0 <= legend.y0 <= legend.y1 <= figure.y1
        )
    finally:
        plt.close(fig)
    plot_sweep(full_grid, tmp_path / "grid.png")
    assert (tmp_path / "grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
