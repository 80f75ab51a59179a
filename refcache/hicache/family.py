"""HiCache's ``Family``: what the checking side needs of its operations, snapshots and invariants."""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import fields
from typing import Final

from refcache.family import Family, field_diff
from refcache.hicache.invariants import Violation, check_all, check_step
from refcache.hicache.ops import OPS, Observation, Op, Reset
from refcache.hicache.scenarios import scenarios
from refcache.hicache.snapshot import NodeRecord, PoolRecord, RankSnapshot, Snapshot
from refcache.hicache.trace import FORMAT, dumps_trace, read_trace

__all__ = ["FAMILY", "NO_SLOTS", "diff_snapshots", "status_line", "without_slots"]


def _fmt_node(node: NodeRecord) -> str:
    return f"{node.id.namespace or '-'}:{list(node.id.path)}"


def _rank_diff(a: RankSnapshot, b: RankSnapshot, name_a: str, name_b: str) -> list[str]:
    out: list[str] = []
    nodes_a = {n.id: n for n in a.nodes}
    nodes_b = {n.id: n for n in b.nodes}
    for node_id in sorted(set(nodes_a) | set(nodes_b)):
        na, nb = nodes_a.get(node_id), nodes_b.get(node_id)
        if na is None or nb is None:
            present = name_a if na is not None else name_b
            node = na or nb
            assert node is not None
            out.append(f"rank {a.rank} node {_fmt_node(node)}: only in {present}")
        else:
            out += field_diff(f"rank {a.rank} node {_fmt_node(na)}", na, nb, name_a, name_b)
    for f in fields(a):
        if f.name not in ("nodes", "rank"):
            out += field_diff(
                f"rank {a.rank} {f.name}", getattr(a, f.name), getattr(b, f.name), name_a, name_b
            )
    return out


def diff_snapshots(a: Snapshot, b: Snapshot, name_a: str = "model", name_b: str = "impl") -> list[str]:
    """Readable differences between two snapshots: which node (by token path), which field, both values."""
    out: list[str] = []
    for f in fields(a):
        if f.name != "ranks":
            out += field_diff(f.name, getattr(a, f.name), getattr(b, f.name), name_a, name_b)
    if len(a.ranks) != len(b.ranks):
        return [*out, f"ranks: {name_a} has {len(a.ranks)}, {name_b} has {len(b.ranks)}"]
    for ra, rb in zip(a.ranks, b.ranks, strict=True):
        out += _rank_diff(ra, rb, name_a, name_b)
    return out


def status_line(snap: Snapshot) -> str:
    """One line per step in the spirit of TigerBeetle's VOPR, per rank: tokens in use of L1 and L2, L3 objects,
    nodes, then the in-flight tables' sizes — ``wt`` write-through (L1→L2), ``lb`` load back (L2→L1), ``bk``
    backup (L2→L3), ``pf`` prefetch (L3→L2) — and ``rq`` running requests; non-empty queues in brackets."""
    parts = []
    for r in snap.ranks:
        d = r.device.size - len(r.device.free)
        h = r.host.size - len(r.host.free)
        q = ",".join(f"{name}={n}" for name, n in r.queues if n)
        parts.append(
            f"r{r.rank} L1 {d}/{r.device.size} L2 {h}/{r.host.size} L3 {len(r.l3_keys)} n{len(r.nodes)} "
            f"wt{len(r.ongoing_write_through)} lb{len(r.ongoing_load_back)} bk{len(r.ongoing_backup)} "
            f"pf{len(r.ongoing_prefetch)} rq{len(r.requests)}" + (f" [{q}]" if q else "")
        )
    return f"t={snap.clock_us}us " + " | ".join(parts)


def _step(before: Snapshot, after: Snapshot, op: Op) -> list[Violation]:
    return [] if isinstance(op, Reset) else check_step(before, after)


def _zeros(slots: tuple[int, ...] | None) -> tuple[int, ...] | None:
    return None if slots is None else (0,) * len(slots)


def _pool(pool: PoolRecord) -> PoolRecord:
    held = tuple((owner, (0,) * len(slots)) for owner, slots in pool.held)
    return dataclasses.replace(pool, free=(0,) * len(pool.free), held=held)


def without_slots(snap: Snapshot) -> Snapshot:
    """``snap`` with every slot number replaced by 0 and so free lists without order: how many slots each
    node, pool and owner holds is still compared, which slots are not (``NO_SLOTS``: an engine whose
    allocator hands out other slots than SGLang's, or in another order)."""
    ranks = tuple(
        dataclasses.replace(
            r,
            nodes=tuple(
                dataclasses.replace(n, value=_zeros(n.value), host_value=_zeros(n.host_value))
                for n in r.nodes
            ),
            device=_pool(r.device),
            host=_pool(r.host),
            backup_host_indices=tuple((0,) * len(slots) for slots in r.backup_host_indices),
        )
        for r in snap.ranks
    )
    return dataclasses.replace(snap, ranks=ranks)


NO_SLOTS: Final = "no-slots"


def is_trace(first: str) -> bool:
    """Whether ``first`` (a trace's first line) is a HiCache trace's header: refcache's trace format with no
    ``family`` key (another family's header names its family)."""
    try:
        head = json.loads(first)
    except ValueError:
        return False
    return isinstance(head, dict) and head.get("format") == FORMAT and "family" not in head


OBSERVATIONS: Final[tuple[type[Observation], ...]] = typing.get_args(Observation)


FAMILY: Final[Family[Op, Observation, Snapshot]] = Family(
    name="hicache",
    summary="HiCache (refcache.hicache.ops)",
    ops=OPS,
    observation=OBSERVATIONS,
    snapshot=Snapshot,
    check=check_all,
    check_step=_step,
    diff=diff_snapshots,
    status_line=status_line,
    dumps_trace=dumps_trace,
    read_trace=read_trace,
    is_trace=is_trace,
    scenarios=scenarios,
    reference="model",
    granularities={NO_SLOTS: without_slots},
)
"""HiCache's family: ``refcache.hicache.invariants`` over ``Snapshot``, traces of ``refcache.hicache.ops``."""
