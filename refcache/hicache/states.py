"""Node states and prefetch stages with their transition tables (seed §1.2, §2.2), as data.

A radix-tree node holds device slots (``value``), host slots (``host_value``), both, or — once removed
from the tree — neither. SGLang encodes this in two booleans (``evicted = value is None``,
``backuped = host_value is not None``); here the state is explicit and every change goes through
``TRANSITIONS``. The same table drives the model's ``transition()``, the generated
``specs/transitions.md`` and the exhaustive legal/illegal test.

``GONE`` stands for "not in the tree": a node is created from ``GONE`` and removed to ``GONE``. A split
(seed §2.1) is a self-loop on the split node; the new prefix fragment starts in the same state.

An L3→L2 prefetch operation (SGLang ``PrefetchOperation``) moves through three stages — its hit query
runs, then its pages are read, then it is done — and every move goes through ``PREFETCH_TRANSITIONS``
(``next_stage``), which drives the model, the implementation, the generated ``specs/prefetch-stages.md``
and the same exhaustive test. Snapshots and traces carry a stage as its string (a ``StrEnum`` equals it).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, TypeVar

from refcache.errors import TransitionError

__all__ = [
    "OPTION_TRANSITIONS",
    "PREFETCH_TRANSITIONS",
    "TRANSITIONS",
    "NodeEvent",
    "NodeState",
    "PrefetchEvent",
    "PrefetchStage",
    "next_stage",
    "next_state",
]


class NodeState(enum.StrEnum):
    """The four states of seed §1.2."""

    DEVICE = "device"  # GpuOnly: value set, host_value None
    BOTH = "both"  # value and host_value set
    HOST = "host"  # HostOnly: value None (evicted), host_value set
    GONE = "gone"  # not in the tree

    def __repr__(self) -> str:
        return f"NodeState.{self.name}"

    @property
    def evicted(self) -> bool:
        """SGLang's ``node.evicted``: no device copy."""
        return self is NodeState.HOST or self is NodeState.GONE  # identity: enum members are singletons

    @property
    def backuped(self) -> bool:
        """SGLang's ``node.backuped``: a host copy exists."""
        return self is NodeState.BOTH or self is NodeState.HOST


class NodeEvent(enum.StrEnum):
    """What moves a node; each names the SGLang code path (seed section in brackets)."""

    INSERT_LEAF = "insert_leaf"  # insert: remaining key becomes a new device leaf [§1.2]
    PREFETCH_INSERT = "prefetch_insert"  # _insert_helper_host: L3 data becomes a host-only node [§2.2]
    WRITE_BACKUP = "write_backup"  # host slots assigned at enqueue of the L1→L2 copy [§2.4]
    EVICT_BACKUPED = "evict_backuped"  # _evict_backuped: free device slots, keep host [§3.1]
    EVICT_REGULAR = "evict_regular"  # _evict_regular: free device slots and delete [§3.1]
    LOAD_BACK = "load_back"  # load_back: device slots assigned at enqueue of the L2→L1 copy [§2.3]
    INSERT_REFILL = "insert_refill"  # insert over a host-only node: recomputed device slots [§1.2]
    EVICT_HOST = "evict_host"  # evict_host: free host slots and delete [§3.2]
    DROP_NO_HOST = "drop_no_host"  # write_back could not get host memory: drop the leaf [sglang.md §2.6]
    SPLIT = "split"  # _split_node: the node keeps its state, the new prefix fragment copies it [§2.1]
    RESET = "reset"  # reset(): the whole tree is discarded [sglang.md §2.13]
    # _release_full_host_duplicate: write_back's evict_host frees the host copy of a node that is also on the
    # device, which stays in the tree device-only [SGLang 0.5.22 on; only under D-48's option]
    RECLAIM_HOST_DUPLICATE = "reclaim_host_duplicate"

    def __repr__(self) -> str:
        return f"NodeEvent.{self.name}"


_S = NodeState
_E = NodeEvent

TRANSITIONS: Final[Mapping[tuple[NodeState, NodeEvent], NodeState]] = MappingProxyType(
    {
        (_S.GONE, _E.INSERT_LEAF): _S.DEVICE,
        (_S.GONE, _E.PREFETCH_INSERT): _S.HOST,
        (_S.DEVICE, _E.WRITE_BACKUP): _S.BOTH,
        (_S.BOTH, _E.EVICT_BACKUPED): _S.HOST,
        (_S.DEVICE, _E.EVICT_REGULAR): _S.GONE,
        (_S.HOST, _E.LOAD_BACK): _S.BOTH,
        # The seed's diagram draws HostOnly --insert--> GpuOnly, but the host copy is kept (SGLang never
        # frees host_value here), so the node is in both tiers. specs/decisions.md D-03.
        (_S.HOST, _E.INSERT_REFILL): _S.BOTH,
        (_S.HOST, _E.EVICT_HOST): _S.GONE,
        # SGLang 0.5.20 drops the host-only subtree too; refcache drops only a childless device leaf and
        # keeps a node whose host-only children are pinned or were just written back. D-10.
        (_S.DEVICE, _E.DROP_NO_HOST): _S.GONE,
        (_S.DEVICE, _E.SPLIT): _S.DEVICE,
        (_S.BOTH, _E.SPLIT): _S.BOTH,
        (_S.HOST, _E.SPLIT): _S.HOST,
        (_S.DEVICE, _E.RESET): _S.GONE,
        (_S.BOTH, _E.RESET): _S.GONE,
        (_S.HOST, _E.RESET): _S.GONE,
        # SGLang 0.5.22 on, write_back: a host copy that duplicates the device copy goes first under host
        # pressure; no data is lost (the device copy stays). Only under ``reclaim_host_duplicates``. D-48.
        (_S.BOTH, _E.RECLAIM_HOST_DUPLICATE): _S.DEVICE,
    }
)

OPTION_TRANSITIONS: Final[Mapping[tuple[NodeState, NodeEvent], str]] = MappingProxyType(
    {(_S.BOTH, _E.RECLAIM_HOST_DUPLICATE): "reclaim_host_duplicates"}
)
"""The transitions of ``TRANSITIONS`` that only a fidelity option takes (pair -> the option,
``refcache.config.FIDELITY_OPTIONS``): the default configuration never reaches them, so a coverage ledger of
the default machines does not ask for them."""


def next_state(state: NodeState, event: NodeEvent) -> NodeState:
    """The state after ``event``; raises ``TransitionError`` for a pair the table does not list."""
    return _next(TRANSITIONS, state, event)


class PrefetchStage(enum.StrEnum):
    """Where an L3→L2 prefetch operation is (the snapshot's ``PrefetchRecord.stage``)."""

    QUERY = "query"  # created; its L3 hit query (and the MIN over ranks) has not resolved
    IO = "io"  # the query admitted it: the I/O helper reads its pages into host memory
    DONE = "done"  # revoked at the query, or the I/O helper has finished (read all, short or terminated)

    def __repr__(self) -> str:
        return f"PrefetchStage.{self.name}"


class PrefetchEvent(enum.StrEnum):
    """What moves a prefetch operation; each names the SGLang code path."""

    QUERY_HIT = "query_hit"  # the hit query resolved at or above the threshold (D-01: the drain allocated)
    QUERY_MISS = "query_miss"  # the hit query resolved below the threshold: revoked, memory released
    IO_END = "io_end"  # the I/O helper's last batch (all read, a short batch, or terminated)

    def __repr__(self) -> str:
        return f"PrefetchEvent.{self.name}"


_P = PrefetchStage
_PE = PrefetchEvent

PREFETCH_TRANSITIONS: Final[Mapping[tuple[PrefetchStage, PrefetchEvent], PrefetchStage]] = MappingProxyType(
    {
        (_P.QUERY, _PE.QUERY_HIT): _P.IO,
        (_P.QUERY, _PE.QUERY_MISS): _P.DONE,
        (_P.IO, _PE.IO_END): _P.DONE,
    }
)


def next_stage(stage: PrefetchStage, event: PrefetchEvent) -> PrefetchStage:
    """The stage after ``event``; raises ``TransitionError`` for a pair the table does not list."""
    return _next(PREFETCH_TRANSITIONS, stage, event)


_State = TypeVar("_State", NodeState, PrefetchStage)
_Event = TypeVar("_Event", NodeEvent, PrefetchEvent)


def _next(table: Mapping[tuple[_State, _Event], _State], state: _State, event: _Event) -> _State:
    try:
        return table[(state, event)]
    except KeyError:
        legal = sorted(e.value for (s, e) in table if s is state)
        raise TransitionError(
            f"no transition from {state.value!r} on {event.value!r}; from {state.value!r} the legal events are {legal}"
        ) from None
