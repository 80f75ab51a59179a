"""Every vLLM zoo bug is caught by the default differential budget, with a short shrunk trace."""

from __future__ import annotations

from pathlib import Path

import pytest
from quality.zoo import Bug

from .zoo import ZOO, hunt


@pytest.mark.parametrize("bug", ZOO, ids=[b.slug for b in ZOO])
def test_zoo_bug_is_caught(bug: Bug, tmp_path: Path) -> None:
    catch = hunt(bug, tmp_path)
    print(f"{bug.slug}: examples={catch.examples} ops={catch.raw_ops}->{catch.trace_ops} "
          f"seconds={catch.seconds:.1f}: {catch.message}")  # fmt: skip
    assert catch.caught, bug.slug
    assert bug.caught_by in catch.message
    assert catch.trace_ops <= bug.max_trace_ops
    assert catch.trace is not None
    print(catch.trace.read_text())
