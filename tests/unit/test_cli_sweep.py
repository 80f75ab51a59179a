"""``refcache simulate --sweep`` (#29 item 7): a line per configuration off a terminal, a time estimate in
``--help``, and ``--jobs N`` with the same results as ``--jobs 1``."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from refcache.cli import app

EXCERPT = Path(__file__).parent.parent / "data" / "mooncake_conversation_head300.jsonl"
GRID = [
    "--sweep-l2-ratios",
    "1.5,4",
    "--sweep-evictions",
    "lru",
    "--sweep-write-policies",
    "write_through,write_back",
]


def _sweep(jobs: int, tmp_path: Path) -> tuple[list[dict[str, object]], str]:
    args = ["simulate", str(EXCERPT), "--limit", "80", "--sweep", *GRID, "--json", "--jobs", str(jobs)]
    result = CliRunner().invoke(app, [*args, "--plot", str(tmp_path / f"sweep{jobs}.png")])
    assert result.exit_code == 0, result.output
    reports = json.loads(result.stdout)
    for report in reports:  # wall-clock figures differ from run to run
        report.pop("seconds")
        report.pop("requests_per_second")
    return reports, result.stderr


def test_a_sweep_with_jobs_gives_the_same_reports_and_a_line_per_configuration(tmp_path: Path) -> None:
    one, progress = _sweep(1, tmp_path)
    two, progress_two = _sweep(2, tmp_path)
    assert len(one) == 4 and one == two
    for lines in (progress, progress_two):
        done = [line for line in lines.splitlines() if line.startswith("simulate: ")]
        assert [line.split(" done")[0] for line in done] == [f"simulate: {k}/4" for k in range(1, 5)], lines


def test_sweep_help_gives_a_time_estimate() -> None:
    result = CliRunner().invoke(app, ["simulate", "--help"], terminal_width=200)
    assert "minutes" in result.output and "--jobs" in result.output
