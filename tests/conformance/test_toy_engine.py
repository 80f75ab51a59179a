"""The conformance kit from outside: a toy engine written only against its public names passes, and the same
engine with a planted bug fails with a shrunk trace that replays."""

from __future__ import annotations

from pathlib import Path

import pytest

from refcache.check.shrink import failure_of, systems_named
from refcache.conformance import ConformanceError, check_system
from refcache.errors import UsageError
from refcache.hicache import FAMILY
from refcache.hicache.family import NO_SLOTS
from refcache.hicache.trace import read_trace
from refcache.systems import SYSTEMS, registered

from .toy_engine import ANSWERS, ENTRY, PLANTED, ToyAdapter

NO_L3 = {"hicache_storage_backend": None}


def test_the_toy_conforms(tmp_path: Path) -> None:
    report = check_system(
        ToyAdapter,
        family=FAMILY,
        name="toy",
        answers=ANSWERS,
        constraints=NO_L3,
        examples=25,
        trace_dir=tmp_path,
    )
    every = [s.name for s in FAMILY.scenarios()]
    assert report.skipped == ("backup-then-prefetch",)  # it needs PrefetchFromStorage, which the toy lacks
    assert list(report.scenarios) == [n for n in every if n not in report.skipped]
    assert 50 <= report.examples <= 52 and report.steps > 500  # two machines (with and without faults) x 25
    assert not any(op.startswith(("PrefetchFromStorage", "StorageFault")) for op in report.outcomes)
    assert "toy conforms to the hicache family against model" in str(report)
    assert "toy" not in SYSTEMS  # registered only while it ran


def test_alone_and_at_a_coarser_granularity_it_conforms_too(tmp_path: Path) -> None:
    alone = check_system(ToyAdapter, family=FAMILY, name="toy", reference=None, answers=ANSWERS,
                         constraints=NO_L3, examples=10, trace_dir=tmp_path)  # fmt: skip
    assert alone.reference is None and "alone (invariants only)" in str(alone)
    coarse = check_system(ToyAdapter, family=FAMILY, name="toy", answers=ANSWERS, compare=NO_SLOTS,
                          constraints=NO_L3, examples=10, trace_dir=tmp_path)  # fmt: skip
    assert 20 <= coarse.examples <= 22


def test_the_planted_bug_fails_with_a_shrunk_trace_that_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PLANTED, "1")
    with pytest.raises(ConformanceError) as caught:
        check_system(ToyAdapter, family=FAMILY, name="toy", answers=ANSWERS, constraints=NO_L3,
                     scenarios=False, examples=50, trace_dir=tmp_path)  # fmt: skip
    error = caught.value
    assert error.check.startswith("random machine") and error.kind == "outcomes differ"
    assert error.trace is not None and error.trace.name.endswith(".min.jsonl")
    assert "refcache replay" in str(error) and "--against model,toy" in str(error)
    config, ops = read_trace(error.trace)
    assert 1 <= len(ops) <= 12, ops  # shrunk from a 40-step example
    with registered("toy", ENTRY):
        again = failure_of(config, ops, systems_named(("model", "toy")), family=FAMILY)
        assert again is not None and again.kind == "outcomes differ"
        monkeypatch.delenv(PLANTED)
        assert failure_of(config, ops, systems_named(("model", "toy")), family=FAMILY) is None


def test_a_planted_bug_a_scenario_reaches_is_named_by_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PLANTED, "1")
    with pytest.raises(ConformanceError) as caught:
        check_system(ToyAdapter, family=FAMILY, name="toy", answers=ANSWERS, constraints=NO_L3,
                     random=False, trace_dir=tmp_path)  # fmt: skip
    assert caught.value.check.startswith("scenario ")
    assert caught.value.trace is not None and caught.value.trace.exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"answers": ["Teleport"]}, "'Teleport' is not an operation of the hicache family"),
        ({"compare": "roughly"}, "'roughly' is not one of them"),
        ({"name": "model"}, "cannot be named 'model'"),
        ({"name": "impl", "reference": None}, "is registered already"),
    ],
)
def test_bad_arguments_are_usage_errors(kwargs: dict[str, object], message: str, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=message):
        check_system(ToyAdapter, family=FAMILY, examples=1, trace_dir=tmp_path, **kwargs)  # type: ignore[arg-type]
    assert "candidate" not in SYSTEMS
