"""vLLM 0.33's offloading connector scheduler, built on CPU (``connector.py``), and the two scheduler-side
bugs of the issue that live there, re-introduced as source patches: each caught by a directed scenario and
by ``ConnectorMachine`` (random scheduler steps, PREEMPT-FLUSH and STORE-CURSOR checked) at the default
budget. That machine checks invariants only: there is no reference model of the connector
(``specs/vllm.md``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis.stateful import run_state_machine_as_test
from quality.zoo import Bug, Edit

from refcache.check import budget

from .connector import ConnectorMachine, Engine, preempt_flush, store_cursor
from .zoo import vllm_bug

CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:OffloadingConnectorScheduler"

CONNECTOR_ZOO: tuple[tuple[Bug, Callable[[Engine], list[str]], int], ...] = (
    (
        vllm_bug(
            "preempted-stores-not-flushed",
            "a preempted request's pending store jobs are not flushed: the worker may read its freed, "
            "reallocated blocks",
            "PR #29870 (fix of the handling of preemptions); later #39186, #46014",
            (
                Edit(
                    f"{CONNECTOR}._build_connector_meta",
                    "            self._current_batch_jobs_to_flush.update(jobs_to_flush)\n",
                    "            pass\n",
                ),
            ),
            "PREEMPT-FLUSH",
        ),
        preempt_flush,
        12,
    ),
    (
        vllm_bug(
            "store-cursor-before-queue",
            "the store cursor advances before prepare_store queues the store, so a refused store leaves a "
            "permanent gap in the offloaded prefix",
            "the design PR #50087 states (cursors not advanced on allocation failure); related #49146, #52211",
            (
                Edit(
                    f"{CONNECTOR}._build_store_jobs",
                    "            store_output = self.manager.prepare_store(",
                    "            req_status.advance_stored_idx(num_offloadable_tokens)\n"
                    "            store_output = self.manager.prepare_store(",
                ),
            ),
            "STORE-CURSOR",
        ),
        store_cursor,
        3,
    ),
)


def test_connector_scheduler_builds_on_cpu_and_flushes_a_preempted_store() -> None:
    engine = Engine()
    engine.admit("a", list(range(8)))
    step = engine.step()
    (job,) = step.store_jobs
    assert engine.pending_store_jobs("a") == {job}
    assert [r.name for r in engine.lookups("a")] == ["HIT_PENDING"] * 4
    assert engine.step(preempted=("a",)).jobs_to_flush == {job}


@pytest.mark.parametrize("entry", CONNECTOR_ZOO, ids=[bug.slug for bug, _, _ in CONNECTOR_ZOO])
def test_connector_bug_is_caught(
    entry: tuple[Bug, Callable[[Engine], list[str]], int],
) -> None:
    bug, scenario, chunks = entry
    assert scenario(Engine(chunks=chunks)) == []
    with bug.applied():
        found = scenario(Engine(chunks=chunks))
    print(f"{bug.slug}: {found}")
    assert len(found) == 1 and found[0].startswith(bug.caught_by)


def _machine() -> type[ConnectorMachine]:
    return type("ConnectorMachine", (ConnectorMachine,), {"failures": [], "runs": []})


def test_connector_machine_holds_at_the_default_budget() -> None:
    machine = _machine()
    run_state_machine_as_test(machine, settings=budget.DIFFERENTIAL.settings(derandomize=True))
    print(f"connector machine: {len(machine.runs)} examples started")
    assert len(machine.runs) >= budget.DIFFERENTIAL.examples


@pytest.mark.parametrize("entry", CONNECTOR_ZOO, ids=[bug.slug for bug, _, _ in CONNECTOR_ZOO])
def test_connector_bug_is_caught_by_the_machine(
    entry: tuple[Bug, Callable[[Engine], list[str]], int],
) -> None:
    bug, _, _ = entry
    machine = _machine()
    with bug.applied(), pytest.raises(AssertionError, match=bug.caught_by):
        run_state_machine_as_test(
            machine, settings=budget.DIFFERENTIAL.settings(derandomize=True, shrink=False)
        )
    print(f"{bug.slug}: examples={len(machine.runs)} steps={machine.failures[-1]}")
    assert len(machine.runs) <= budget.DIFFERENTIAL.examples
