"""vLLM 0.33 through the conformance kit, as an engine's own suite would run it: the vLLM family's directed
scenarios and its random machine, against the vLLM reference model."""

from __future__ import annotations

from pathlib import Path

from refcache.conformance import check_system
from refcache.engines.vllm import VllmSystem
from refcache.vllm.family import FAMILY


def test_vllm_conforms_through_the_kit(tmp_path: Path) -> None:
    report = check_system(VllmSystem, family=FAMILY, name="vllm-under-test", examples=40, trace_dir=tmp_path)
    print(report)
    assert report.skipped == () and len(report.scenarios) == len(FAMILY.scenarios())
    assert report.examples >= 40 and report.outcomes["Store:evicted"] + report.outcomes["Admit:hit"] > 0
