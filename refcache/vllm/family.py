"""vLLM's ``Family``: what the checking side needs of its operations, snapshots and invariants (its directed
conformance scenarios are ``refcache.vllm.scenarios``)."""

from __future__ import annotations

import typing
from typing import Final

from refcache.family import Family, field_diff
from refcache.tagged_trace import TaggedTraces
from refcache.vllm.invariants import check_all, check_step
from refcache.vllm.ops import (
    OPS,
    VllmObservation,
    VllmOp,
    op_from_json,
    op_to_json,
)
from refcache.vllm.scenarios import scenarios
from refcache.vllm.snapshot import VllmSnapshot

__all__ = ["FAMILY", "TRACES", "diff_vllm_snapshots", "status_line"]

TRACES: Final = TaggedTraces[VllmOp]("vllm", "a vLLM", op_to_json, op_from_json)
"""vLLM's traces: the refcache trace format whose header also says ``"family": "vllm"``, one
``refcache.vllm.ops.op_to_json`` object per further line (``refcache.tagged_trace``); ``FAMILY`` reads and
writes them with it."""


def diff_vllm_snapshots(
    a: VllmSnapshot, b: VllmSnapshot, name_a: str = "vllm-model", name_b: str = "vllm"
) -> list[str]:
    """Readable differences between two vLLM snapshots: which field (block, request, chunk), both values."""
    return field_diff("snapshot", a, b, name_a, name_b)


def status_line(snap: VllmSnapshot) -> str:
    """One line per step: GPU blocks in use of the usable ones, blocks holding a cached hash, the free queue's
    length and ``rq`` running requests; with offloading, CPU chunks of the capacity, stores not yet
    complete, and ``st``/``ld`` queued store and load jobs."""
    used = sum(1 for b in snap.blocks if b.ref_cnt > 0)
    cached = sum(1 for b in snap.blocks if b.key is not None)
    line = f"blocks used {used}/{len(snap.blocks) - 1} cached {cached} free {snap.num_free} rq{len(snap.requests)}"
    off = snap.offload
    if off is not None:
        line += (
            f" | chunks {len(off.chunks)}/{off.capacity} pending {off.num_write_pending} "
            f"st{len(off.pending_stores)} ld{len(off.pending_loads)}"
        )
    return line


OBSERVATIONS: Final[tuple[type[VllmObservation], ...]] = typing.get_args(VllmObservation)

FAMILY: Final[Family[VllmOp, VllmObservation, VllmSnapshot]] = Family(
    name="vllm",
    summary="vLLM (refcache.vllm.ops)",
    ops=OPS,
    observation=OBSERVATIONS,
    snapshot=VllmSnapshot,
    check=check_all,
    check_step=check_step,
    diff=diff_vllm_snapshots,
    status_line=status_line,
    dumps_trace=TRACES.dumps,
    read_trace=TRACES.read,
    is_trace=TRACES.is_trace,
    scenarios=scenarios,
    reference="vllm-model",
    granularities={},
)
"""vLLM's family: ``refcache.vllm.invariants`` over ``VllmSnapshot``, traces of ``refcache.vllm.ops``."""
