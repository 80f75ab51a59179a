"""Every LMCache zoo bug is caught by CI's sample of the LMCache session past the known findings, by a divergence
that no known finding explains, with a short shrunk trace."""

from __future__ import annotations

from pathlib import Path

import pytest
from quality.zoo import Bug

from .zoo import ZOO, hunt


@pytest.mark.parametrize("bug", ZOO, ids=[b.slug for b in ZOO])
def test_zoo_bug_is_caught_past_the_known_findings(bug: Bug, tmp_path: Path) -> None:
    catch = hunt(bug, tmp_path, shrink_seconds=30)
    print(f"{bug.slug}: examples={catch.examples} ops={catch.raw_ops}->{catch.trace_ops} "
          f"seconds={catch.seconds:.1f}: {catch.message}")  # fmt: skip
    assert catch.caught, bug.slug
    assert bug.caught_by in catch.message
    assert catch.examples <= bug.budget
    assert catch.trace_ops <= bug.max_trace_ops
    assert catch.trace is not None
    assert catch.known == "", f"the shrunk trace shows known finding {catch.known}, not {bug.slug}"
    print(catch.trace.read_text())
