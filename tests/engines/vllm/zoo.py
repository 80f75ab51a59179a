"""The vLLM bug zoo: real scheduler-side vLLM bugs, re-introduced one at a time as source patches on vLLM
0.33's own functions (the ``Edit`` mechanism of ``tests/quality/zoo.py``: an exact snippet of one
function's source replaced and the function recompiled in its module, for the duration of ``applied()``).

``hunt`` runs the machine the vLLM session runs (``VllmDifferentialMachine``: the same class name, hence the
same derandomized sample, at the default differential budget) against patched vLLM, counts the examples
up to the first failure with a coverage ledger, and shrinks that example's trace with
``refcache.check.shrink`` under the vLLM family. ``specs/vllm-zoo.md`` tabulates the results.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hypothesis.stateful import run_state_machine_as_test
from quality.zoo import Edit, _patched, _resolve

from refcache.check import budget
from refcache.check.coverage import Coverage
from refcache.check.harness import TRACE_DIR_ENV, Divergence
from refcache.check.shrink import shrink_trace, systems_named
from refcache.check.vllm_machines import VLLM, vllm_machine
from refcache.vllm.trace import read_trace, write_trace

__all__ = ["ZOO", "VllmBug", "VllmCatch", "hunt"]

SYSTEMS = ("vllm-model", "vllm")
KV_UTILS = "vllm.v1.core.kv_cache_utils"
POOL = "vllm.v1.core.block_pool:BlockPool"
SINGLE = "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager"
OFFLOAD = "vllm.v1.kv_offload.cpu.manager:CPUOffloadingManager"
COORDINATOR = "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator"


@dataclass(frozen=True)
class VllmBug:
    slug: str
    what: str  # the bug, in one line
    upstream: str  # where it shipped or was fixed
    edits: tuple[Edit, ...]
    caught_by: str  # a substring of the first line of the divergence
    max_trace_ops: int = 12

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        originals: list[tuple[object, str, object]] = []
        by_target: dict[str, list[Edit]] = {}
        for edit in self.edits:
            by_target.setdefault(edit.target, []).append(edit)
        try:
            for target, edits in by_target.items():
                owner, name, original = _resolve(target)
                originals.append((owner, name, original))
                setattr(owner, name, _patched(self.slug, original, edits))
            yield
        finally:
            for owner, name, original in reversed(originals):
                setattr(owner, name, original)


ZOO: tuple[VllmBug, ...] = (
    VllmBug(
        "double-free",
        "a request's first block is freed twice: ref_cnt goes to -1 while the block stays queued once",
        "no upstream guard in free_blocks; field reports vllm-ascend #15990, guards vllm-ascend PR #14301 and "
        "UCM PR #1053; the issue's note",
        (
            Edit(
                f"{SINGLE}.pop_blocks_for_free",
                "return trim_null_head(req_blocks)",
                "return trim_null_head(req_blocks + req_blocks[:1])",
            ),
        ),
        "snapshots differ",
    ),
    VllmBug(
        "touch-keeps-queued",
        "a prefix hit on a free cached block does not unlink it from the free queue: the block is both in a "
        "table and queued (the corruption the #15990 / PR #14301 guards prevent)",
        "vllm-ascend #15990 (symptom), PR #14301",
        (Edit(f"{POOL}.touch", "if block.ref_cnt == 0:\n", "if block.ref_cnt == 0 and False:\n"),),
        "snapshots differ",
    ),
    VllmBug(
        "lora-salt-one-domain",
        "LoRA name and cache_salt share one hash domain (the LoRA key is written as a salt key): a salt 'x' "
        "request hits a LoRA 'x' block",
        "issue #44701, fixed by PR #44706 (tagged extra keys)",
        (
            Edit(
                f"{KV_UTILS}:_gen_lora_extra_hash_keys",
                'return [("lora", lora_request.lora_name, lora_request.lora_path)]',
                'return [("cache_salt", lora_request.lora_name)]',
            ),
        ),
        "differ",
    ),
    VllmBug(
        "recache-hit-blocks",
        "the cached-block count is not set after a prefix hit, so cache_full_blocks hashes the hit blocks again",
        "PR #14073 (only cache blocks that are not in the prefix cache)",
        (
            Edit(
                f"{SINGLE}.add_local_computed_blocks",
                "self.num_cached_block[request_id] = len(req_blocks)",
                "self.num_cached_block[request_id] = 0",
            ),
        ),
        "vllm crashed",
    ),
    VllmBug(
        "queue-counter-drift",
        "the free queue's counter is not updated where the list is (remove() forgets to decrement)",
        "the class of PR #24228 (num_free_blocks updated before its check in popleft)",
        (
            Edit(
                "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue.remove",
                "self.num_free_blocks -= 1",
                "pass",
            ),
        ),
        "snapshots differ",
    ),
    VllmBug(
        "group-evicts-group-hit",
        "one KV cache group's blocks for external tokens are allocated before the next group's prefix hit is "
        "touched, so get_new_blocks can hand out (and strip) that group's just-hit free cached block",
        "issue #33775, fixed by PR #44409 (two-phase allocate_new_computed_blocks); symptom #43884",
        (
            Edit(
                f"{COORDINATOR}.allocate_new_computed_blocks",
                "            )\n"
                "        if num_external_computed_tokens > 0:\n"
                "            for i, manager in enumerate(self.single_type_managers):\n"
                "                manager.allocate_external_computed_blocks(",
                "            )\n"
                "            if num_external_computed_tokens > 0:\n"
                "                manager.allocate_external_computed_blocks(",
            ),
        ),
        "differ",
    ),
    VllmBug(
        "failed-store-leaks-chunk",
        "complete_store(success=False) drops the chunk from the policy but never frees its slot",
        "no upstream fix pinned: the failure path of per-job store completion (PR #39186)",
        (Edit(f"{OFFLOAD}.complete_store", "self._free_chunk(chunk)", "pass"),),
        "",
    ),
)


@dataclass
class VllmCatch:
    caught: bool
    examples: int  # examples up to and including the first failing one
    seconds: float
    raw_ops: int
    trace_ops: int
    message: str
    trace: Path | None


def hunt(bug: VllmBug, trace_dir: Path, shrink_seconds: float = 60.0) -> VllmCatch:
    ledger = Coverage()
    machine = vllm_machine(SYSTEMS, coverage=ledger, name="VllmDifferentialMachine")
    settings = budget.DIFFERENTIAL.settings(derandomize=True, shrink=False)
    started = time.perf_counter()
    message = ""
    old = os.environ.get(TRACE_DIR_ENV)
    os.environ[TRACE_DIR_ENV] = str(trace_dir)
    try:
        with bug.applied():
            try:
                run_state_machine_as_test(machine, settings=settings)
            except Divergence as error:
                message = str(error).splitlines()[0]
            trace = trace_dir / f"{machine.trace_name}.jsonl"
            if not message or not trace.exists():
                return VllmCatch(False, 0, time.perf_counter() - started, 0, 0, message, None)
            config, ops = read_trace(trace)
            result = shrink_trace(
                config, ops, systems_named(SYSTEMS, family=VLLM), family=VLLM, seconds=shrink_seconds
            )
    finally:
        if old is None:
            os.environ.pop(TRACE_DIR_ENV, None)
        else:
            os.environ[TRACE_DIR_ENV] = old
    shrunk = trace_dir / f"{bug.slug}.min.jsonl"
    write_trace(shrunk, config, result.ops)
    return VllmCatch(
        True,
        ledger.first_failure,
        time.perf_counter() - started,
        len(ops),
        len(result.ops),
        result.failure.message,
        shrunk,
    )
