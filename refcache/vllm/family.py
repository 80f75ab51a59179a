"""vLLM's ``Family``: what the checking side needs of its operations, snapshots and invariants (its directed
conformance scenarios are ``refcache.vllm.scenarios``)."""

from __future__ import annotations

import typing
from typing import Final

from refcache.family import Family, field_diff
from refcache.vllm.invariants import check_all, check_step
from refcache.vllm.ops import (
    OPS,
    VllmObservation,
    VllmOp,
)
from refcache.vllm.scenarios import scenarios
from refcache.vllm.snapshot import VllmSnapshot
from refcache.vllm.trace import dumps_trace, is_vllm_trace, read_trace

__all__ = ["FAMILY", "diff_vllm_snapshots", "status_line"]


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
    dumps_trace=dumps_trace,
    read_trace=read_trace,
    is_trace=is_vllm_trace,
    scenarios=scenarios,
    reference="vllm-model",
    granularities={},
)
"""vLLM's family: ``refcache.vllm.invariants`` over ``VllmSnapshot``, traces of ``refcache.vllm.ops``."""
