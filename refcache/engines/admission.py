"""The SGLang recorder's admission stages and their transition table, as data.

Theory of operation
-------------------
SGLang's scheduler admits a request by a sequence of cache calls, not by one: ``match_prefix``, perhaps a
temporary ``inc_lock_ref`` of the match's last device node around ``init_load_back``, its ``dec_lock_ref``,
the ``inc_lock_ref`` of the node the request keeps, evictions to make room, ``ready_to_load_host_cache``. The
recorder (``refcache.engines.sglang.record``, its module docstring's table) writes such a sequence as one
operation only once it ends: ``MatchPrefix`` when nothing followed the match, ``StartRequest`` (admitted or
not) when a node was locked, ``PrefetchFromStorage`` when a prefetch followed it. ``AdmissionStage`` is how
far a sequence got; every call the recorder sees while one is open is an ``AdmissionEvent``, and every change
of stage goes through ``TRANSITIONS`` (``next_stage``). A pair that the table does not list is a call
sequence the operation alphabet cannot express: ``next_stage`` raises ``RecordingError`` naming the legal
events, before SGLang runs the call, and the stage is unchanged.

``NONE`` stands for "no admission open": a ``match_prefix`` opens one from ``NONE``, and an admission that
is written (or became a prefetch) returns to ``NONE``. The same table drives the recorder, the generated
``specs/recorder-stages.md`` and the exhaustive (stage, event) test ``tests/unit/test_admission.py``.

This module imports no engine: the stages are tested, and their table generated, without SGLang (the
``refcache.engines.sglang`` package imports SGLang when it is imported, so they live beside it).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from refcache.errors import RecordingError

__all__ = ["ENDS", "TRANSITIONS", "AdmissionEvent", "AdmissionStage", "next_stage"]


class AdmissionStage(enum.StrEnum):
    """How far the call sequence since the last ``match_prefix`` got."""

    NONE = "none"  # no admission open: before a match_prefix, or after one was written
    MATCHED = "matched"  # match_prefix returned, nothing else yet: a MatchPrefix if it ends here
    TEMP_LOCKED = "temp_locked"  # the match's last device node locked around the load back that follows
    LOADED = "loaded"  # init_load_back returned; the request's lock must follow
    LOCKED = "locked"  # the node the request keeps is locked: a StartRequest, admitted
    REFUSED = "refused"  # that node was unlocked again (no room): a StartRequest, not admitted

    def __repr__(self) -> str:
        return f"AdmissionStage.{self.name}"


class AdmissionEvent(enum.StrEnum):
    """A top-level cache call the recorder sees, as it bears on the open admission."""

    MATCH = "match"  # match_prefix returned
    TEMP_LOCK = "temp_lock"  # inc_lock_ref(match.last_device_node) right after a match with a host hit (on
    # UnifiedRadixCache after every match, and from 0.5.22 lock(match.best_match_node) under it around a load back)
    LOCK = "lock"  # any other inc_lock_ref: the node the request keeps
    LOAD_BACK = "load_back"  # init_load_back returned
    UNLOCK = "unlock"  # dec_lock_ref of a node other than the request's (the temporary lock's release)
    REFUSE = "refuse"  # dec_lock_ref of the node the request locked: it is not admitted
    EVICT = "evict"  # evict / evict_for_alloc while the request's node is locked: room for it
    PREFETCH = "prefetch"  # prefetch_from_storage anchored at the match: a PrefetchFromStorage
    READY = "ready"  # ready_to_load_host_cache: ends an admission that locked its node
    END = "end"  # any other top-level call, or the end of an operation: the admission is written

    def __repr__(self) -> str:
        return f"AdmissionEvent.{self.name}"


_S = AdmissionStage
_E = AdmissionEvent

TRANSITIONS: Final[Mapping[tuple[AdmissionStage, AdmissionEvent], AdmissionStage]] = MappingProxyType(
    {
        (_S.NONE, _E.MATCH): _S.MATCHED,
        (_S.NONE, _E.READY): _S.NONE,
        (_S.NONE, _E.END): _S.NONE,
        (_S.MATCHED, _E.TEMP_LOCK): _S.TEMP_LOCKED,
        (_S.MATCHED, _E.LOCK): _S.LOCKED,  # no load back: the device hit's node
        (_S.MATCHED, _E.LOAD_BACK): _S.LOADED,
        (_S.MATCHED, _E.PREFETCH): _S.NONE,  # the match was the prefetch's, not an operation of its own
        (_S.MATCHED, _E.READY): _S.MATCHED,
        (_S.MATCHED, _E.END): _S.NONE,  # a MatchPrefix
        (_S.TEMP_LOCKED, _E.LOAD_BACK): _S.LOADED,
        (_S.TEMP_LOCKED, _E.TEMP_LOCK): _S.TEMP_LOCKED,  # UnifiedRadixCache 0.5.22 on: best_match_node's too
        (_S.TEMP_LOCKED, _E.LOCK): _S.LOCKED,  # UnifiedRadixCache pins the match's node with no load back too
        (_S.TEMP_LOCKED, _E.UNLOCK): _S.TEMP_LOCKED,
        (_S.TEMP_LOCKED, _E.READY): _S.TEMP_LOCKED,
        (_S.LOADED, _E.LOCK): _S.LOCKED,
        (_S.LOADED, _E.UNLOCK): _S.LOADED,  # the temporary lock released after the load back
        (_S.LOADED, _E.READY): _S.LOADED,
        (_S.LOCKED, _E.REFUSE): _S.REFUSED,
        (_S.LOCKED, _E.EVICT): _S.LOCKED,
        (_S.LOCKED, _E.READY): _S.NONE,  # a StartRequest, admitted
        (_S.LOCKED, _E.END): _S.NONE,  # a StartRequest, admitted
        (_S.REFUSED, _E.EVICT): _S.REFUSED,
        # the lock released was a pin: 0.5.20's scheduler pins the match's node around every admission
        # (_lock_node), host hit or not, then locks the request's
        (_S.REFUSED, _E.LOCK): _S.LOCKED,
        (_S.REFUSED, _E.READY): _S.NONE,  # a StartRequest, not admitted
        (_S.REFUSED, _E.END): _S.NONE,  # a StartRequest, not admitted
    }
)

ENDS: Final[Mapping[AdmissionStage, str]] = MappingProxyType(
    {
        _S.MATCHED: "MatchPrefix",
        _S.LOCKED: "StartRequest (admitted)",
        _S.REFUSED: "StartRequest (not admitted)",
    }
)
"""What an admission that ends (``END``, or ``READY`` after a lock) in a stage is written as."""


def next_stage(stage: AdmissionStage, event: AdmissionEvent, call: str = "") -> AdmissionStage:
    """The stage after ``event``; raises ``RecordingError`` for a pair the table does not list, naming the
    call (``call``, e.g. "inc_lock_ref outside an admission") and the events legal from ``stage``."""
    try:
        return TRANSITIONS[(stage, event)]
    except KeyError:
        legal = [e.value for e in AdmissionEvent if (stage, e) in TRANSITIONS]
        raise RecordingError(
            f"{call + ': ' if call else ''}no admission step from {stage.value!r} on {event.value!r}; from "
            f"{stage.value!r} the legal events are {legal}"
        ) from None
