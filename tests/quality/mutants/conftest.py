"""Under ``nox -s mutants`` (``REFCACHE_MUTANTS=1``): the fast example tests first, the state machines last.

mutmut hands each mutant's tests to pytest in no particular order and stops at the first failure, so a
mutant that a unit test kills should not wait for the machines' seconds first. Other runs keep pytest's
order.
"""

from __future__ import annotations

import os

import pytest

_LAST = "tests/quality/mutants/"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.environ.get("REFCACHE_MUTANTS"):
        items.sort(key=lambda item: item.nodeid.startswith(_LAST))
