"""The harness catches every bug of the zoo (tests/quality/zoo.py), within the default run's budget.

For each bug: the default differential machine, derandomized, fails within ``bug.budget`` examples (the
default run gives each machine 150); the failure is the expected kind of check; the shrunk trace is
short; ``refcache replay --against both`` of that trace fails with the bug applied and passes without
it, so the trace pins down this bug and nothing else. ``specs/bug-zoo.md`` holds the measured table
(regenerate it with ``python -m tests.quality.measure_zoo``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from refcache.cli import app

from .zoo import ZOO, Bug, Edit, hunt

TABLE = Path(__file__).resolve().parents[2] / "specs" / "bug-zoo.md"


@pytest.mark.parametrize("bug", ZOO, ids=lambda bug: bug.slug)
def test_the_default_harness_catches(bug: Bug, tmp_path: Path) -> None:
    catch = hunt(bug, tmp_path)
    assert catch.caught, f"{bug.slug} survived {bug.budget} examples of the default run"
    assert bug.caught_by in catch.message, catch.message
    assert 1 <= catch.examples <= bug.budget
    assert catch.trace is not None and catch.trace_ops <= bug.max_trace_ops, catch

    replay = ["replay", str(catch.trace), "--against", "both", "--quiet"]
    runner = CliRunner()
    with bug.applied():
        buggy = runner.invoke(app, replay)
    assert buggy.exit_code == 1, buggy.output
    clean = runner.invoke(app, replay)
    assert clean.exit_code == 0, clean.output


def test_every_edit_still_applies() -> None:
    """Each patch quotes the product's current source exactly once (else ``applied`` raises)."""
    for bug in ZOO:
        with bug.applied():
            pass


def test_the_table_lists_exactly_the_zoo() -> None:
    rows = re.findall(r"^\| `([a-z0-9-]+)` \|", TABLE.read_text(), flags=re.MULTILINE)
    assert sorted(rows) == sorted(bug.slug for bug in ZOO)
    assert len(ZOO) >= 15


LITERAL_HOST_LEAF = Bug(
    "host-leaf-literal-upstream",
    "the host-leaf test checks the children's 'evicted' where 'backed up' is meant (sglang.md §9 #5 as filed)",
    "issue #19212",
    (
        Edit(
            "refcache.gpu.hiradix_cache:HiRadixCache._update_leaf_status",
            "not any(c.state.backuped for c in node.children.values())",
            "not any(c.state.evicted for c in node.children.values())",
        ),
    ),
    caught_by="",
    budget=20,
)


def test_an_equivalent_edit_is_not_caught(tmp_path: Path) -> None:
    """The hunt can come back empty: the literal upstream host-leaf swap is equivalent in this design
    (specs/bug-zoo.md, EVICTED-SUFFIX), so the machine finds nothing, and ``test_the_default_harness_catches``
    would fail on it."""
    catch = hunt(LITERAL_HOST_LEAF, tmp_path)
    assert not catch.caught and catch.trace is None and catch.examples == 0
