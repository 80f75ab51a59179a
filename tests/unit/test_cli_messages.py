"""The small things of #29 item 10: every error line starts with ``error:``, the ``NOT REACHED`` line says
what it means, and the report's lines are not wrapped mid-phrase when stdout is not a terminal."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from refcache.check.situations import SITUATIONS
from refcache.cli import app

EXCERPT = Path(__file__).parent.parent / "data" / "mooncake_conversation_head300.jsonl"


def test_a_bad_request_trace_and_a_bad_plot_path_are_error_lines(tmp_path: Path) -> None:
    bad = tmp_path / "badmooncake.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": -1}\n')
    result = CliRunner().invoke(app, ["simulate", str(bad)])
    assert result.exit_code == 2
    assert result.output.startswith(f"error: {bad}:1: input_length must be"), result.output
    sweep = [
        "--sweep",
        "--sweep-l2-ratios",
        "2",
        "--sweep-evictions",
        "lru",
        "--sweep-write-policies",
        "write_through",
    ]
    args = ["simulate", str(EXCERPT), "--limit", "10", *sweep, "--plot", str(tmp_path / "no" / "x.png")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "error: [Errno 2]" in result.output, result.output


def test_a_passing_fuzz_report_explains_not_reached_and_keeps_each_line_whole(tmp_path: Path) -> None:
    args = ["fuzz", "--against", "model", "--examples", "2", "--steps", "5", "--seed", "1"]
    result = CliRunner().invoke(app, [*args, "--database", str(tmp_path)])  # not a terminal: 80 columns
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    reached = [i for i, line in enumerate(lines) if line.startswith("NOT REACHED: ")]
    assert reached and "not a failure" in lines[reached[0] + 1], lines[-3:]
    for name, meaning in SITUATIONS.items():  # one line each, as long as it needs
        assert any(re.match(rf"  {re.escape(name)}\s+\d+  {re.escape(meaning)}$", line) for line in lines), (
            name
        )
