"""The harness against SGLang finds a deliberately wrong model, no decision explains it, and the shrunk
counterexample replays through the command line on SGLang."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis.stateful import run_state_machine_as_test

from refcache.check.budget import Budget
from refcache.check.explain import explain
from refcache.check.harness import Divergence
from refcache.check.shrink import failure_of, shrink_trace, systems_named
from refcache.config import EvictionPolicy
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.trace import read_trace, write_trace
from refcache.model import _eviction

from .sglang_machines import SGLANG, SYSTEMS, sglang_machine


def test_a_wrong_eviction_order_in_the_model_is_caught_shrunk_and_replayed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("REFCACHE_TRACE_DIR", str(tmp_path))
    # The model evicts the most recently used node under LRU: SGLang evicts the least recently used.
    monkeypatch.setitem(_eviction.PRIORITY_FUNCTIONS, EvictionPolicy.LRU, lambda n: (-n.last_access_time,))
    wrong = sglang_machine("WrongModelMachine", radix_eviction_policy=EvictionPolicy.LRU)
    with pytest.raises(Divergence) as caught:
        run_state_machine_as_test(wrong, settings=Budget(50, 40).settings(derandomize=True, shrink=False))
    assert caught.value.trace_path is not None
    config, ops = read_trace(caught.value.trace_path)
    assert explain(config, ops, SYSTEMS) == [], "no decision explains a wrong eviction order"

    shrunk = shrink_trace(config, ops, systems_named(SYSTEMS), family=HICACHE, seconds=60)
    assert shrunk.complete and len(shrunk.ops) < len(ops)
    trace = tmp_path / "shrunk.jsonl"
    write_trace(trace, config, shrunk.ops)

    # The healthy model (in a fresh process) and SGLang agree on the shrunk trace: the bug was the model's.
    monkeypatch.undo()
    assert failure_of(config, shrunk.ops, systems_named(SYSTEMS), family=HICACHE) is None
    for against in (f"model,{SGLANG}", SGLANG):
        replay = subprocess.run(
            [sys.executable, "-m", "refcache.cli", "replay", str(trace), "--against", against, "--quiet"],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
            check=False,
        )
        assert replay.returncode == 0, replay.stdout + replay.stderr
