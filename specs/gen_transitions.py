"""Generate ``specs/transitions.md`` and ``specs/prefetch-stages.md`` from the tables of ``refcache.hicache.states``.

    python specs/gen_transitions.py          # rewrite both files
    python specs/gen_transitions.py --check  # exit 1 if a committed file is stale

``tests/unit/test_states.py`` runs ``render()`` and ``render_prefetch()`` and compares them with the
committed files, so the tables cannot drift from the code.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Final, TypeVar

from refcache.hicache.states import (
    PREFETCH_TRANSITIONS,
    TRANSITIONS,
    NodeEvent,
    NodeState,
    PrefetchEvent,
    PrefetchStage,
)

__all__ = ["OUTPUT", "PREFETCH_OUTPUT", "render", "render_prefetch"]

OUTPUT: Final = Path(__file__).with_name("transitions.md")
PREFETCH_OUTPUT: Final = Path(__file__).with_name("prefetch-stages.md")

_STATE_MEANING: Final[dict[NodeState, str]] = {
    NodeState.DEVICE: "GpuOnly: device slots (`value`), no host copy",
    NodeState.BOTH: "device slots and host slots (`host_value`)",
    NodeState.HOST: "HostOnly: host slots only (`evicted`); still matchable, loaded back on a hit",
    NodeState.GONE: "not in the tree (before creation, after removal)",
}

_EVENT_MEANING: Final[dict[NodeEvent, str]] = {
    NodeEvent.INSERT_LEAF: "`insert`: the unmatched rest of a key becomes a new device leaf (seed §1.2)",
    NodeEvent.PREFETCH_INSERT: "`_insert_helper_host`: pages fetched from L3 become a host-only node (seed §2.2)",
    NodeEvent.WRITE_BACKUP: "`write_backup`: host slots assigned when the L1→L2 copy is queued (seed §2.4)",
    NodeEvent.EVICT_BACKUPED: "`_evict_backuped`: device slots freed, host copy kept (seed §3.1)",
    NodeEvent.EVICT_REGULAR: "`_evict_regular`: device slots freed, node removed (seed §3.1)",
    NodeEvent.LOAD_BACK: "`load_back`: device slots assigned when the L2→L1 copy is queued (seed §2.3)",
    NodeEvent.INSERT_REFILL: "`insert` over a host-only node: recomputed device slots, host copy kept (D-03)",
    NodeEvent.EVICT_HOST: "`evict_host`: host slots freed, node removed (seed §3.2)",
    NodeEvent.DROP_NO_HOST: "write_back eviction found no host memory: the device leaf is dropped (D-10, D-11)",
    NodeEvent.SPLIT: "`_split_node`: the node keeps its state; the new prefix fragment copies it (seed §2.1)",
    NodeEvent.RESET: "`reset` (flush_cache): the whole tree is discarded (sglang.md §2.13, D-16)",
    NodeEvent.RECLAIM_HOST_DUPLICATE: (
        "write_back `evict_host` frees the host copy of a node also on the device, which stays device-only "
        "(SGLang 0.5.22 on, `_release_full_host_duplicate`; only under `reclaim_host_duplicates`, D-48)"
    ),
}


_STAGE_MEANING: Final[dict[PrefetchStage, str]] = {
    PrefetchStage.QUERY: "created at admission; the L3 hit query (and its MIN over ranks) has not resolved",
    PrefetchStage.IO: "admitted by the query: the I/O helper reads its pages into host memory, batch by batch",
    PrefetchStage.DONE: "revoked at the query, or the I/O helper has finished; what it holds waits for the tree",
}

_PREFETCH_EVENT_MEANING: Final[dict[PrefetchEvent, str]] = {
    PrefetchEvent.QUERY_HIT: "the hit query resolved at or above `prefetch_threshold`: reading starts (seed §2.2; "
    "under D-01 when the scheduler's drain has allocated host memory)",
    PrefetchEvent.QUERY_MISS: "the hit query resolved below `prefetch_threshold`: revoked, host memory released "
    "(seed §2.2)",
    PrefetchEvent.IO_END: "the I/O helper's last batch: every page read, a short batch, or terminated (seed §3.6)",
}


_S = TypeVar("_S", bound=StrEnum)
_E = TypeVar("_E", bound=StrEnum)


def _sections(
    word: str,
    states: Sequence[_S],
    state_meaning: Mapping[_S, str],
    events: Sequence[_E],
    event_meaning: Mapping[_E, str],
    table: Mapping[tuple[_S, _E], _S],
) -> list[str]:
    """The states, events and table sections of one machine (``word``: what a row is, "state" or "stage")."""
    out = ["## " + word.capitalize() + "s", "", f"| {word} | meaning |", "|---|---|"]
    out += [f"| `{s.value}` | {state_meaning[s]} |" for s in states]
    out += ["", "## Events", "", "| event | what happens |", "|---|---|"]
    out += [f"| `{e.value}` | {event_meaning[e]} |" for e in events]
    out += [
        "",
        "## Table",
        "",
        f"Rows: the {word} before; columns: the event; cells: the {word} after, or — where the event is illegal.",
        "",
        f"| {word} \\ event | " + " | ".join(f"`{e.value}`" for e in events) + " |",
        "|---|" + "---|" * len(events),
    ]
    for state in states:
        cells = []
        for event in events:
            after = table.get((state, event))
            cells.append("—" if after is None else f"`{after.value}`")
        out.append(f"| `{state.value}` | " + " | ".join(cells) + " |")
    out += ["", f"{len(table)} legal pairs out of {len(states) * len(events)}."]
    return out


def render_prefetch() -> str:
    """The full text of ``specs/prefetch-stages.md``."""
    out = [
        "# Prefetch operation stages",
        "",
        "<!-- Generated by specs/gen_transitions.py from refcache.hicache.states.PREFETCH_TRANSITIONS; do not edit. -->",
        "",
        "An L3→L2 prefetch operation's `stage` (the snapshot's `PrefetchRecord.stage`) changes only through this",
        "table (`refcache.hicache.states.next_stage`, called by `PrefetchOperation.move` in the model and the",
        "implementation); a pair that is not listed raises `TransitionError` and leaves the stage unchanged.",
        "`tests/unit/test_states.py` checks every (stage, event) pair and that this file is current.",
        "",
    ]
    stages, events = list(PrefetchStage), list(PrefetchEvent)
    out += _sections("stage", stages, _STAGE_MEANING, events, _PREFETCH_EVENT_MEANING, PREFETCH_TRANSITIONS)
    out += ["", "## Diagram", "", "```mermaid", "stateDiagram-v2", f"    [*] --> {PrefetchStage.QUERY.value}"]
    for (stage, event), after in PREFETCH_TRANSITIONS.items():
        out.append(f"    {stage.value} --> {after.value}: {event.value}")
    out += [f"    {PrefetchStage.DONE.value} --> [*]", "```", ""]
    return "\n".join(out)


def _mermaid_name(state: NodeState) -> str:
    return "[*]" if state is NodeState.GONE else state.value


def render() -> str:
    """The full text of ``specs/transitions.md``."""
    out = [
        "# Node state transitions",
        "",
        "<!-- Generated by specs/gen_transitions.py from refcache.hicache.states.TRANSITIONS; do not edit. -->",
        "",
        "Every change of a radix-tree node's state goes through this table (`refcache.hicache.states.next_state`);",
        "a pair that is not listed raises `TransitionError` and leaves the node unchanged.",
        "`tests/unit/test_states.py` checks every (state, event) pair and that this file is current.",
        "",
    ]
    out += _sections("state", list(NodeState), _STATE_MEANING, list(NodeEvent), _EVENT_MEANING, TRANSITIONS)
    out += [
        "",
        "## Diagram",
        "",
        "`[*]` is `gone`: the start before a node is created and the end after it is removed.",
        "",
        "```mermaid",
        "stateDiagram-v2",
    ]
    for (state, event), after in TRANSITIONS.items():
        out.append(f"    {_mermaid_name(state)} --> {_mermaid_name(after)}: {event.value}")
    out += ["```", ""]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    stale = 0
    for output, text in ((OUTPUT, render()), (PREFETCH_OUTPUT, render_prefetch())):
        if "--check" in argv:
            current = output.read_text(encoding="utf-8") if output.exists() else ""
            if current != text:
                sys.stderr.write(f"{output} is stale; run python specs/gen_transitions.py\n")
                stale = 1
        else:
            output.write_text(text, encoding="utf-8")
    return stale


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
