"""The registry of families (``refcache.check.families``): each family's checks found by name through a
"module:attribute" string or a plugin's entry point, imported on first use; an unknown name or a broken entry
is a ``UsageError`` that says which; and ``FamilyChecks.from_rules``, the one way a family whose machine is
``family_machine`` over its ``Rules`` gets its two factories."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from importlib import metadata

import pytest

from refcache.check import families
from refcache.check.coverage import Coverage
from refcache.check.families import (
    ENTRY_POINT_GROUP,
    FAMILIES,
    FamilyChecks,
    family_checks,
    family_names,
    family_of,
)
from refcache.check.machine import RulesMachine
from refcache.errors import UsageError
from refcache.lmcache.family import FAMILY as LMCACHE
from refcache.rules.lmcache import CHECKS as LMCACHE_CHECKS
from refcache.rules.lmcache import RULES as LMCACHE_RULES
from refcache.rules.lmcache import lmcache_coverage_report
from refcache.systems import SYSTEMS, SystemEntry

TOY = FamilyChecks.from_rules(
    dataclasses.replace(LMCACHE, name="toy"), LMCACHE_RULES, lmcache_coverage_report
)
"""A plugin's family: LMCache's vocabulary and rules under another name."""


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[metadata.EntryPoint]]:
    """The entry points of ``ENTRY_POINT_GROUP`` as the test lists them (looked up afresh)."""
    points: list[metadata.EntryPoint] = []

    def entry_points(*, group: str) -> list[metadata.EntryPoint]:
        return points if group == ENTRY_POINT_GROUP else []

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    families._plugins.cache_clear()
    yield points
    families._plugins.cache_clear()


def test_every_family_is_found_by_name_in_its_rules_module() -> None:
    assert family_names()[: len(FAMILIES)] == ("hicache", "vllm", "lmcache")
    for name, target in FAMILIES.items():
        checks = family_checks(name)
        assert isinstance(checks, FamilyChecks) and checks.name == name
        assert target == f"refcache.rules.{name}:CHECKS"
        assert family_checks(name) is checks  # imported once
    assert family_checks("lmcache") is LMCACHE_CHECKS


def test_an_unknown_family_is_a_usage_error_naming_the_known_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match=r"no checks for the 'nowhere' family: hicache, vllm, lmcache"):
        family_checks("nowhere")
    monkeypatch.setitem(
        SYSTEMS,
        "stray-system",
        SystemEntry("a stray system", "refcache.model:HiCacheModel", family="nowhere"),
    )
    with pytest.raises(UsageError, match=r"'nowhere' family, which refcache does not know \(hicache, vllm"):
        family_of(["stray-system"])


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("refcache.rules.nowhere:CHECKS", r"FAMILIES\['lmcache'\] = 'refcache.rules.nowhere:CHECKS'\) cannot be imported"),
        ("refcache.rules.lmcache:CHEKS", r"refcache.rules.lmcache has no 'CHEKS', not a refcache.check.families.FamilyChecks"),
        ("refcache.rules.lmcache:RULES", r"refcache.rules.lmcache names a Rules, not a refcache.check.families.FamilyChecks"),
        ("refcache.rules.vllm:CHECKS", r"are the 'vllm' family's; register them under 'vllm'"),
    ],
)  # fmt: skip
def test_a_broken_registry_entry_says_what_is_wrong(
    monkeypatch: pytest.MonkeyPatch, target: str, message: str
) -> None:
    monkeypatch.setitem(FAMILIES, "lmcache", target)
    with pytest.raises(UsageError, match=message):
        family_checks("lmcache")
    with pytest.raises(UsageError, match=message):
        family_of(["lmcache-model"])  # a command fails the same way


def test_a_plugin_registers_a_family_through_its_entry_point(plugins: list[metadata.EntryPoint]) -> None:
    assert "toy" not in family_names()
    plugins.append(metadata.EntryPoint("toy", f"{__name__}:TOY", ENTRY_POINT_GROUP))
    families._plugins.cache_clear()
    assert family_names() == (*FAMILIES, "toy")
    assert family_checks("toy") is TOY


def test_a_plugin_may_not_take_a_family_name(plugins: list[metadata.EntryPoint]) -> None:
    plugins.append(metadata.EntryPoint("vllm", f"{__name__}:TOY", ENTRY_POINT_GROUP))
    with pytest.raises(UsageError, match="a family named 'vllm' exists already"):
        family_names()


def test_a_broken_plugin_says_which_entry_point(plugins: list[metadata.EntryPoint]) -> None:
    plugins.append(metadata.EntryPoint("toy", f"{__name__}:NOTHING", ENTRY_POINT_GROUP))
    with pytest.raises(UsageError, match=rf"entry point 'toy' = '{__name__}:NOTHING'\): .* has no 'NOTHING'"):
        family_checks("toy")


def test_from_rules_builds_both_factories_over_family_machine() -> None:
    """A family with ``Rules``: a fuzz run takes turns with one ``family_machine`` named by the systems (its
    trace by the name and the suffix), the zoo hunts with the one it names (CI's sample, or a seed's), and the
    HiCache configuration options do not apply."""
    checks = FamilyChecks.from_rules(LMCACHE, LMCACHE_RULES, lmcache_coverage_report)
    ledger = Coverage()
    assert checks.constrained is False and checks.report(ledger) == lmcache_coverage_report(ledger)
    [made] = checks.machines(("lmcache-model",), {"page_size": 4}, ledger, "-worker-3", {})
    assert issubclass(made, RulesMachine) and made.__name__ == "LmcacheModelMachine"
    assert made.trace_name == "LmcacheModelMachine-worker-3" and made.coverage is ledger
    assert made.family_rules is LMCACHE_RULES and made.the_family is LMCACHE
    assert not hasattr(made, "_hypothesis_internal_use_seed")  # CI's derandomized sample
    hunter = checks.hunter(("lmcache-model",), ledger, "LMCacheModelMachine", 7)
    assert issubclass(hunter, RulesMachine) and hunter.__name__ == "LMCacheModelMachine"
    assert hunter.coverage is ledger and hunter.family_rules is LMCACHE_RULES
    assert getattr(hunter, "_hypothesis_internal_use_seed") == 7  # noqa: B009 - Hypothesis' @seed
    assert not hasattr(checks.hunter(("lmcache-model",), ledger, "X"), "_hypothesis_internal_use_seed")
