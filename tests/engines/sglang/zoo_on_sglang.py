"""The SGLang zoo (``sglang_zoo.SGLANG_ZOO``) hunted two ways, shared by ``test_zoo_on_sglang.py`` and the
table generator ``measure_zoo_sglang.py``:

- ``hunt_on_sglang``: the model-versus-SGLang machine (``sglang_machines.sglang_machine``) under the
  ``sglang-0.5.20`` profile, derandomized, over ``refcache.check.budget.DIFFERENTIAL`` (or fewer examples),
  with the bug patched into SGLang; a coverage ledger says which example failed first.
- ``record_patched``: a run of the patched engine over the first requests of the Mooncake head trace
  (``refcache.sim.record``, the driver of ``refcache record``), replayed on the model
  (``refcache.check.recorded``); the step where the recorded run leaves the model.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hypothesis.stateful import run_state_machine_as_test
from quality.zoo import Bug

from refcache.check import budget
from refcache.check.coverage import Coverage
from refcache.check.harness import TRACE_DIR_ENV, Divergence
from refcache.check.recorded import replay_recorded
from refcache.config import PROFILES, HiCacheConfig, WritePolicy
from refcache.engines.sglang import SGLangSystem
from refcache.sim.record import record_run
from refcache.trace import read_trace

from .sglang_machines import sglang_machine

__all__ = ["HEAD", "RECORD_CONFIGS", "Hunt", "Recorded", "hunt_on_sglang", "record_patched", "sglang_ready"]

HEAD = Path(__file__).resolve().parents[2] / "data" / "mooncake_conversation_head300.jsonl"
PROFILE = PROFILES["sglang-0.5.20"]
BLOCK_TOKENS = 4
"""Simulated tokens per 512-token block of the recorded runs (the longest of the first requests fits L1)."""
MACHINE = "SGLangZooMachine"
"""One class name for every bug: the same derandomized sample of the profile machine."""


def _record_config(policy: WritePolicy, device: int) -> HiCacheConfig:
    return HiCacheConfig(
        device_size=device, hicache_ratio=2.0, page_size=16, hicache_write_policy=policy
    ).with_fidelity(PROFILE)


RECORD_CONFIGS: dict[str, HiCacheConfig] = {
    "write_through": _record_config(WritePolicy.WRITE_THROUGH, 1024),
    "write_back": _record_config(WritePolicy.WRITE_BACK, 1024),
}
"""The recorded runs: ``refcache record``'s configuration with a small L1 (1024 tokens, L2 twice that,
pages of 16) and ``BLOCK_TOKENS`` per trace block, so that the first requests of the head trace evict on both
tiers."""


def sglang_ready() -> None:
    """Import SGLang's modules (behind the adapter's shim) so a zoo patch can resolve its target."""
    SGLangSystem(RECORD_CONFIGS["write_through"]).close()


@dataclass
class Hunt:
    caught: bool
    examples: int  # examples up to and including the first failing one (0: none failed)
    ops: int  # operations of the failing example's trace
    message: str  # the divergence's first line
    trace: Path | None


def hunt_on_sglang(bug: Bug, trace_dir: Path, examples: int | None = None) -> Hunt:
    ledger = Coverage()
    hunter = sglang_machine(MACHINE, ledger, **PROFILE)
    steps = budget.DIFFERENTIAL
    settings = budget.Budget(examples or steps.examples, steps.steps).settings(derandomize=True, shrink=False)
    sglang_ready()
    message = ""
    with bug.applied(), _environ(TRACE_DIR_ENV, str(trace_dir)):
        try:
            run_state_machine_as_test(hunter, settings=settings)
        except Divergence as error:
            message = str(error).splitlines()[0]
    trace = trace_dir / f"{hunter.trace_name}.jsonl"
    if not message or not trace.exists():
        return Hunt(False, 0, 0, message, None)
    return Hunt(True, ledger.first_failure, len(read_trace(trace)[1]), message, trace)


@dataclass
class Recorded:
    caught: bool
    step: int  # the step of the recorded run where the model disagrees (0: none)
    ops: int  # operations recorded
    kind: str
    message: str


def record_patched(bug: Bug, out: Path, policy: str, requests: int = 60) -> Recorded:
    config = RECORD_CONFIGS[policy]
    sglang_ready()
    with bug.applied():
        run = record_run(HEAD, out, config, block_tokens=BLOCK_TOKENS, limit=requests, snapshots=True)
    try:
        replay_recorded(run.recording)
    except Divergence as error:
        return Recorded(
            True, error.step or 0, len(run.recording.ops), error.kind, error.summary.splitlines()[0]
        )
    return Recorded(False, 0, len(run.recording.ops), "", "")


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved
