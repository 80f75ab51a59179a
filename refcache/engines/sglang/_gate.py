"""Fake device streams and events: SGLang's L1<->L2 copies run only when a ``CompleteIO`` says so.

SGLang's ``HiCacheController`` has no thread for L1<->L2 copies: ``write`` and ``start_loading`` submit the
host pool's copy calls on a device stream (``L2TransferEngine``) and queue an ack whose ``finish_event`` the
scheduler later queries (``writing_check``, ``loading_check``). On a GPU the copies then run
asynchronously; on a CPU ``torch.cpu``'s streams are synchronous and every ack would be ready at once.

``FAKE_DEVICE_MODULE`` replaces the ``device_module`` global of ``managers/cache_controller.py`` and
``mem_cache/l2_transfer.py`` (both resolve it at import time with ``get_device_module()``):

* a ``FakeStream`` is an in-order queue of deferred copies and event markers; the CPU transfer functions
  of ``_cpu`` append their copy to the stream that is current (``enqueue``) instead of running it, so the
  bytes move when the copy completes, as on a GPU;
* ``FakeEvent.record()`` appends a marker carrying a generation number (SGLang re-records the events of
  its ``LayerDoneCounter``, and a CUDA event reports the latest record); ``query()`` is True once the stream
  has executed that marker, and for a never-recorded event (as CUDA's); ``synchronize()`` runs the stream
  up to the marker (``writing_check(write_back=True)`` blocks this way, as in SGLang);
* ``complete(acks, count)`` is ``CompleteIO(WRITE|LOAD, 0, count)``: the stream runs through the ends of
  the next ``count`` copies (the markers of the acks' finish events, in stream order) and it returns how many
  it ran. Where every ack has an event of its own that is synchronising the first ``count`` unfinished acks;
  where acks share an event (up to 0.5.15 a load's ack holds its ``LayerDoneCounter`` slot's event, which the
  load three later records again: R-4, specs/sglang-findings-releases.md) an older ack may read unfinished
  again, and synchronising it would run the stream through that later load, several copies at once.

Everything after the event fires — retiring acks, unlocking nodes, releasing host slots — is SGLang's own
code. Nothing here is a thread: the gating is deterministic.
"""

from __future__ import annotations

import contextlib
import types
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Final, Protocol

__all__ = ["FAKE_DEVICE_MODULE", "FakeEvent", "FakeStream", "complete", "enqueue", "pending"]

_CURRENT: list[FakeStream] = []  # the streams entered with ``stream(...)``, innermost last


class FakeStream:
    """An in-order queue of deferred operations and event markers."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.items: deque[tuple[Callable[[], None] | None, FakeEvent | None, int]] = deque()

    def wait_stream(self, other: object) -> None:
        """Cross-stream ordering is not modelled: each stream runs in order, and the acks say when."""

    def wait_event(self, event: object) -> None:
        """As ``wait_stream``."""

    def run_until(self, target: FakeEvent | None = None) -> None:
        """Run queued operations in order, through ``target``'s latest marker (everything if None)."""
        while self.items:
            fn, event, generation = self.items.popleft()
            if fn is not None:
                fn()
            elif event is not None:
                if generation == event.generation:
                    event.fired = True
                if event is target and generation == target.generation:
                    return

    def run_through_next(self, ends: Sequence[FakeEvent]) -> bool:
        """Run queued operations in order through the next marker of any of ``ends`` (an older record's
        marker included); False if no such marker is queued (then everything ran)."""
        wanted = {id(event) for event in ends}
        while self.items:
            fn, event, generation = self.items.popleft()
            if fn is not None:
                fn()
            elif event is not None:
                if generation == event.generation:
                    event.fired = True
                if id(event) in wanted:
                    return True
        return False

    def synchronize(self) -> None:
        self.run_until(None)

    def query(self) -> bool:
        return not self.items


class FakeEvent:
    """A device event recorded on a ``FakeStream`` (see the module docstring)."""

    def __init__(self, enable_timing: bool = False, **kwargs: object) -> None:
        self.fired = True  # a never-recorded event reports done, as a CUDA event does
        self.generation = 0
        self.stream: FakeStream | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream if stream is not None else (_CURRENT[-1] if _CURRENT else None)
        self.generation += 1
        if stream is None:  # recorded outside any stream: the CPU is synchronous
            self.fired = True
            self.stream = None
            return
        self.fired = False
        self.stream = stream
        stream.items.append((None, self, self.generation))

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:
        if not self.fired and self.stream is not None:
            self.stream.run_until(self)

    def wait(self, stream: object = None) -> None:
        """Another stream waits for this event: ordering is not modelled (see ``FakeStream``)."""

    def elapsed_time(self, other: object) -> float:
        return 0.0


@contextlib.contextmanager
def _stream(stream: FakeStream) -> Iterator[None]:
    _CURRENT.append(stream)
    try:
        yield
    finally:
        _CURRENT.pop()


def _current_stream(*args: object, **kwargs: object) -> FakeStream:
    return _CURRENT[-1] if _CURRENT else FakeStream()


FAKE_DEVICE_MODULE: Final = types.SimpleNamespace(
    __name__="refcache.engines.sglang._gate",
    Event=FakeEvent,
    Stream=FakeStream,
    stream=_stream,
    current_stream=_current_stream,
    synchronize=lambda *args, **kwargs: None,
)
"""What ``device_module`` is in SGLang's controller and L2 transfer engine while the adapter runs."""


def enqueue(fn: Callable[[], None]) -> None:
    """Defer ``fn`` to the current fake stream, or run it now outside any stream."""
    if _CURRENT:
        _CURRENT[-1].items.append((fn, None, 0))
    else:
        fn()


class _Ack(Protocol):
    @property
    def finish_event(self) -> FakeEvent: ...


def pending(acks: Sequence[_Ack]) -> int:
    """How many of ``acks`` have an event that has not fired."""
    return sum(1 for ack in acks if not ack.finish_event.query())


def complete(acks: Sequence[_Ack], count: int) -> int:
    """Finish the next ``count`` copies of ``acks``: each time, the stream of the oldest ack whose event has
    not fired runs through the next marker of any such event (copies included). With one event per ack that
    fires the first ``count`` unfinished acks in order; an ack whose shared event a later copy recorded again
    (module docstring) stays unfinished until that copy's turn. Returns how many copies finished."""
    done = 0
    while done < count:
        ends = [ack.finish_event for ack in acks if not ack.finish_event.query()]
        stream = ends[0].stream if ends else None
        if stream is None or not stream.run_through_next(ends):
            break
        done += 1
    return done
