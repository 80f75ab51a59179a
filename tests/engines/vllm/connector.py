"""vLLM 0.33's offloading connector scheduler (``OffloadingConnectorScheduler``) built and driven on CPU.

``VllmConfig()`` cannot be built here ("Failed to infer device type"), but the connector scheduler reads five
names of it, so it is built with vLLM's own ``OffloadingConfig`` dataclasses, a one-method
``OffloadingSpec`` and a duck-typed config. Every stubbed name (``specs/vllm.md``, "The offloading
connector's scheduler"):

* ``vllm_config``: ``cache_config.prefix_cache_retention_interval`` (None), ``cache_config.enable_prefix_caching``
  (True), ``speculative_config`` (None), ``parallel_config.world_size`` (1),
  ``parallel_config.decode_context_parallel_size`` (1);
* the spec: ``OffloadingSpec.get_manager`` returns vLLM's ``CPUOffloadingManager``; ``get_worker`` (worker
  side) raises;
* each step's ``SchedulerOutput``: ``scheduled_new_reqs`` (``req_id``, ``block_ids``),
  ``scheduled_cached_reqs`` (``req_ids``, ``new_block_ids``, ``resumed_req_ids``), ``num_scheduled_tokens``,
  ``finished_req_ids``, ``preempted_req_ids``, ``kv_cache_block_copies`` (None),
  ``kv_connector_block_state`` (None).

``Engine`` plays vLLM's scheduler around it: the ``KVCacheManager`` allocates, the connector's hooks run in
the scheduler's order (``on_new_request``, ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``update_connector_output``), and a test plays the worker by reporting jobs done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import ClassVar

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

import refcache.engines.vllm  # noqa: F401  (version check, hash seed)

__all__ = ["ConnectorMachine", "Engine", "Step", "connector_violations", "preempt_flush", "store_cursor"]


class _Spec(OffloadingSpec):  # type: ignore[misc]
    """vLLM's spec ABC with the scheduler-side manager given; the worker side is not built."""

    manager: OffloadingManager

    def get_manager(self) -> OffloadingManager:
        return self.manager

    def get_worker(self, kv_caches: object) -> object:
        raise NotImplementedError("the worker side is not driven")


@dataclass
class Step:
    """What one ``build_connector_meta`` returned."""

    store_jobs: dict[int, object]
    jobs_to_flush: set[int]


@dataclass
class Engine:
    """A KV cache manager and the offloading connector scheduler, with vLLM's scheduler played by hand."""

    block_size: int = 2
    num_blocks: int = 12
    chunks: int = 4
    requests: dict[str, Request] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bs = self.block_size
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)
        kv_config = KVCacheConfig(
            num_blocks=self.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer0"], kv_cache_spec=spec)],
        )
        self.kv = KVCacheManager(
            kv_config,
            max_model_len=1 << 12,
            scheduler_block_size=bs,
            hash_block_size=bs,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=bs, layer_names=("layer0",), group_id=0),),
            worker_kv_bytes_per_block=0,
            enable_kv_cache_events=True,
            extra_config={},
            engine_id="refcache",
            model=OffloadingModelConfig("refcache", "float32"),
            cache=OffloadingCacheConfig(tokens_per_hash=bs, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
        )
        offloading_spec = _Spec(config)
        self.offload = CPUOffloadingManager(self.chunks, cache_policy="lru", enable_events=True)
        offloading_spec.manager = self.offload
        vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(prefix_cache_retention_interval=None, enable_prefix_caching=True),
            speculative_config=None,
            parallel_config=SimpleNamespace(world_size=1, decode_context_parallel_size=1),
        )
        self.connector = OffloadingConnectorScheduler(offloading_spec, vllm_config, kv_config)
        self._hasher = get_request_block_hasher(bs, sha256_cbor)
        # Every key some prepare_store of a request accepted (stored, or already present), by request id.
        self.accepted: dict[str, set[object]] = {}
        prepare_store = self.offload.prepare_store

        def recording_prepare_store(keys: list[object], context: ReqContext) -> object:
            out = prepare_store(keys, context)
            if out is not None:
                self.accepted.setdefault(context.req_id, set()).update(keys)
            return out

        self.offload.prepare_store = recording_prepare_store  # type: ignore[method-assign, unused-ignore]
        self.running: set[str] = set()
        self._new: list[SimpleNamespace] = []
        self._decoded: dict[str, list[int]] = {}  # running requests decoding this step -> their new blocks

    def admit(self, rid: str, tokens: list[int]) -> bool:
        """Schedule a new request's whole prompt this step; the scheduler loads nothing from the offload
        tier (``max_num_new_tokens=0``). False: its blocks do not fit, it stays waiting."""
        request = Request(
            request_id=rid,
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=64),
            pooling_params=None,
            block_hasher=self._hasher,
        )
        self.requests[rid] = request
        self.connector.on_new_request(request)
        blocks, hit, _ = self.kv.get_computed_blocks(request)
        external, _ = self.connector.get_num_new_matched_tokens(request, hit, max_num_new_tokens=0)
        assert not external
        new = self.kv.allocate_slots(
            request, request.num_tokens - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks
        )
        if new is None:
            return False
        self.connector.update_state_after_alloc(request, self.kv.get_blocks(rid), 0)
        request.status = RequestStatus.RUNNING
        table = [b.block_id for b in self.kv.coordinator.single_type_managers[0].req_to_blocks[rid]]
        self._new.append(SimpleNamespace(req_id=rid, block_ids=(table,), num_tokens=request.num_tokens - hit))
        self.running.add(rid)
        return True

    def decode(self, rid: str, token: int) -> bool:
        """Schedule one decode token of a running request this step; False: its block does not fit (the
        token stays unscheduled)."""
        request = self.requests[rid]
        if request.num_tokens == request.num_computed_tokens:
            request.append_output_token_ids(token)
        new = self.kv.allocate_slots(request, 1)
        if new is None:
            return False
        self.connector.update_state_after_alloc(request, new, 0)
        self._decoded[rid] = [b.block_id for b in new.blocks[0]]
        return True

    def step(self, preempted: tuple[str, ...] = ()) -> Step:
        """``build_connector_meta`` for this step: the requests admitted since the last step run their prompt;
        ``preempted`` were preempted (their blocks freed, to be recomputed)."""
        for rid in preempted:
            request = self.requests[rid]
            self.running.discard(rid)
            self.kv.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
        output = SimpleNamespace(
            scheduled_new_reqs=self._new,
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=list(self._decoded),
                new_block_ids=[(ids,) if ids else None for ids in self._decoded.values()],
                resumed_req_ids=set(),
            ),
            num_scheduled_tokens={n.req_id: n.num_tokens for n in self._new}
            | dict.fromkeys(self._decoded, 1),
            finished_req_ids=set(),
            preempted_req_ids=set(preempted),
            kv_cache_block_copies=None,
            kv_connector_block_state=None,
        )
        meta = self.connector.build_connector_meta(output)
        for new in self._new:
            self.requests[new.req_id].num_computed_tokens += new.num_tokens
        for rid in self._decoded:
            self.requests[rid].num_computed_tokens += 1
        self._new, self._decoded = [], {}
        return Step(dict(meta.store_jobs), set(meta.jobs_to_flush))

    def complete(self, *job_ids: int) -> None:
        """The worker reports these jobs done."""
        worker = OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(job_ids, 1))
        self.connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker))

    def lookups(self, rid: str) -> list[LookupResult]:
        """The offload manager's lookup of each of ``rid``'s full blocks."""
        context = ReqContext(req_id=rid)
        return [self.offload.lookup(make_offload_key(h, 0), context) for h in self.requests[rid].block_hashes]

    def pending_store_jobs(self, rid: str) -> set[int]:
        """The connector's store jobs of ``rid`` not yet reported done."""
        status = self.connector._req_status.get(rid)
        return {j for j in status.transfer_jobs if self.connector._jobs[j].is_store} if status else set()


# --- two scheduler-side checks, each over one scenario ------------------------------------------------------


def preempt_flush(engine: Engine) -> list[str]:
    """PREEMPT-FLUSH: the step that reports a request preempted (its blocks freed, to be reused) flushes
    every store job of that request not yet done, so no store reads a block after it is reallocated.
    Scenario: request ``a`` (4 full blocks) is stored, then preempted before the worker reports the job."""
    engine.admit("a", list(range(8)))
    stored = engine.step()
    assert stored.store_jobs, "the prompt's chunks are offered for storing"
    pending = engine.pending_store_jobs("a")
    flushed = engine.step(preempted=("a",)).jobs_to_flush
    missing = sorted(pending - flushed)
    return (
        [f"PREEMPT-FLUSH: store jobs {missing} of preempted request a neither flushed nor done"]
        if missing
        else []
    )


def store_cursor(engine: Engine) -> list[str]:
    """STORE-CURSOR: a request's store cursor passes a chunk only once ``prepare_store`` accepted it; a
    refused store is offered again at the request's next step (the design PR #50087 states).
    Scenario: 3 chunks; ``a`` stores 2 (write-pending), ``b``'s 2 are refused; once ``a``'s job is done,
    ``b``'s next step stores them."""
    engine.admit("a", [1, 2, 3, 4, 5])
    engine.step()
    engine.admit("b", [9, 9, 8, 8, 7])
    refused = engine.step()
    assert not refused.store_jobs and engine.lookups("b") == [LookupResult.MISS] * 2
    engine.complete(*engine.pending_store_jobs("a"))
    engine.decode("b", 1)
    engine.step()
    skipped = [i for i, r in enumerate(engine.lookups("b")[:2]) if r is LookupResult.MISS]
    return (
        [f"STORE-CURSOR: request b's prompt chunks {skipped} were passed without a store"] if skipped else []
    )


def connector_violations(engine: Engine) -> list[str]:
    """STORE-CURSOR over every running request: each chunk below its store cursor was accepted by a
    ``prepare_store`` of that request (stored, or already present)."""
    out: list[str] = []
    for rid in sorted(engine.running):
        status = engine.connector._req_status[rid]
        for group in status.group_states:
            accepted = engine.accepted.get(rid, set())
            passed = [i for i in range(group.next_stored_chunk_idx) if group.offload_keys[i] not in accepted]
            if passed:
                out.append(f"STORE-CURSOR: request {rid}'s chunks {passed} were passed without a store")
    return out


class ConnectorMachine(RuleBasedStateMachine):
    """Random scheduler steps over ``Engine`` (admit, decode, preempt, a worker reporting a job done), with
    PREEMPT-FLUSH checked on every preemption step and STORE-CURSOR after every step. Preempted requests are
    not resumed. ``failures`` keeps the steps of the last failing run (after Hypothesis shrank it)."""

    failures: ClassVar[list[list[str]]] = []
    runs: ClassVar[list[int]] = []  # one entry per example started

    def __init__(self) -> None:
        super().__init__()
        self.engine: Engine | None = None
        self.prompts: list[list[int]] = []
        self.steps: list[str] = []
        self.next_rid = 0

    @initialize(num_blocks=st.integers(6, 12), chunks=st.integers(2, 6))
    def setup(self, num_blocks: int, chunks: int) -> None:
        type(self).runs.append(1)
        self.engine = Engine(num_blocks=num_blocks, chunks=chunks)
        self.steps.append(f"Engine(num_blocks={num_blocks}, chunks={chunks})")

    def _check(self, violations: list[str]) -> None:
        assert self.engine is not None
        violations = violations + connector_violations(self.engine)
        if violations:
            type(self).failures.append(list(self.steps))
        assert not violations, violations

    @precondition(lambda self: self.engine is not None)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        assert self.engine is not None
        prefix: list[int] = []
        reuse: bool = data.draw(st.booleans(), label="reuse") if self.prompts else False
        if reuse:
            base = data.draw(st.sampled_from(self.prompts), label="base")
            prefix = base[: data.draw(st.integers(0, len(base)), label="cut")]
        tokens = prefix + data.draw(st.lists(st.integers(0, 3), min_size=0 if prefix else 1, max_size=6))
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        self.prompts.append(tokens)
        self.steps.append(f"admit({rid!r}, {tokens})")
        self.engine.admit(rid, tokens)
        self.steps.append("step()")
        self.engine.step()
        self._check([])

    @precondition(lambda self: self.engine is not None and self.engine.running)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        assert self.engine is not None
        rid = data.draw(st.sampled_from(sorted(self.engine.running)), label="rid")
        self.steps.append(f"decode({rid!r}); step()")
        self.engine.decode(rid, data.draw(st.integers(0, 3), label="token"))
        self.engine.step()
        self._check([])

    @precondition(lambda self: self.engine is not None and self.engine.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        assert self.engine is not None
        rid = data.draw(st.sampled_from(sorted(self.engine.running)), label="rid")
        self.steps.append(f"step(preempted=({rid!r},))")
        pending = self.engine.pending_store_jobs(rid)
        flushed = self.engine.step(preempted=(rid,)).jobs_to_flush
        missing = sorted(pending - flushed)
        self._check(
            [f"PREEMPT-FLUSH: store jobs {missing} of preempted {rid} neither flushed nor done"]
            if missing
            else []
        )

    @precondition(lambda self: self.engine is not None and self.engine.connector._jobs)
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        assert self.engine is not None
        job = data.draw(st.sampled_from(sorted(self.engine.connector._jobs)), label="job")
        self.steps.append(f"complete({job})")
        self.engine.complete(job)
        self._check([])
