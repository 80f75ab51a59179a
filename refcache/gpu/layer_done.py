"""Layer-wise load overlap (seed §2.3): layer ``i``'s attention waits only for layer ``i``'s H2D copy.

A load records one event per layer after copying that layer (``LayerLoadingEvent.complete``); the
device pool's per-layer buffer accessors call ``LayerDoneCounter.wait_until(layer)``, which waits for
that one event of the batch's consumer slot. Three slots rotate so that, with overlap scheduling, a
batch can still be reading while the next one loads.

On CUDA an event is a ``torch.cuda.Event`` and waiting enqueues a stream wait (the host never blocks).
Without CUDA there are no streams: ``CPUEvent`` is a thread-safe flag, ``update_producer`` arms the
slot's events, ``complete`` sets them, and waiting blocks the calling thread until the producer (for
example a background loading thread) has copied that layer.

A CPU copy is also synchronous, so a reader that forgets to wait would still find the bytes in place and
the bug would stay invisible. A single-threaded producer can therefore hand ``complete`` the layer's copy
instead of running it (``issued``): the copy is then only *issued*, as on a CUDA stream, and runs when a
consumer waits for that layer or a later one, or at ``drain``. A reader that skips ``wait_until`` reads
the layer before its bytes arrive, exactly as it would on a GPU (reference/sglang.md §9 #10).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from refcache.errors import UsageError
from refcache.gpu.memory import default_device

__all__ = ["CPUEvent", "CUDAEvent", "DeviceEvent", "LayerDoneCounter", "LayerLoadingEvent", "new_event"]


class DeviceEvent(Protocol):
    """The part of a CUDA event the loading protocol uses."""

    def arm(self) -> None:
        """Mark the event pending before a new round of work that will ``record`` it."""

    def record(self) -> None:
        """Mark everything issued so far (on the current stream or thread) as covered by this event."""

    def query(self) -> bool:
        """Whether the recorded work is done. A never-recorded event is done."""
        ...

    def wait(self) -> None:
        """Make the current stream (CUDA) or thread (CPU) wait until the recorded work is done."""

    def synchronize(self) -> None:
        """Block the host until the recorded work is done."""


class CPUEvent:
    """A thread-safe stand-in for a CUDA event: ``record`` sets a flag that ``wait`` blocks on."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._done.set()  # like a fresh CUDA event: never recorded, so complete

    def arm(self) -> None:
        self._done.clear()

    def record(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()

    def synchronize(self) -> None:
        self._done.wait()


class CUDAEvent:
    """A ``torch.cuda.Event``. Stream order makes arming unnecessary: a wait enqueued after ``record``
    was issued waits for that record."""

    def __init__(self) -> None:
        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]

    def arm(self) -> None:
        pass

    def record(self) -> None:
        self._event.record()

    def query(self) -> bool:
        return bool(self._event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._event)

    def synchronize(self) -> None:
        self._event.synchronize()


def new_event(device: torch.device) -> DeviceEvent:
    """A CUDA event for a CUDA device, a ``CPUEvent`` otherwise."""
    return CUDAEvent() if device.type == "cuda" else CPUEvent()


class LayerLoadingEvent:
    """One load's events: ``start_event`` and one ``load_events[i]`` per layer."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self._num_layers = num_layers
        self.load_events = [new_event(device) for _ in range(num_layers)]
        self.start_event = new_event(device)
        self._issued: deque[tuple[int, Callable[[], None]]] = deque()  # copies not run yet, layer order

    def arm(self) -> None:
        if self._issued:
            raise UsageError("re-arming a load whose issued copies never ran; drain it first")
        for event in self.load_events:
            event.arm()

    def complete(self, layer_index: int, issued: Callable[[], None] | None = None) -> None:
        """Record that layer ``layer_index``'s copy has been issued (call after issuing it).

        ``issued`` (single-threaded producers only): the copy itself, run later by the first ``wait`` on
        this layer or a later one, or by ``drain`` (see the module docstring)."""
        if not 0 <= layer_index < self._num_layers:
            raise UsageError(f"layer {layer_index} is outside [0, {self._num_layers})")
        if issued is not None:
            self._issued.append((layer_index, issued))
        self.load_events[layer_index].record()

    def wait(self, layer_index: int) -> None:
        self._run_issued(layer_index)
        self.load_events[layer_index].wait()

    def drain(self) -> None:
        """Run every issued copy (the end of a single-threaded load, like a stream synchronize)."""
        self._run_issued(self._num_layers)

    def _run_issued(self, upto: int) -> None:
        while self._issued and self._issued[0][0] <= upto:
            self._issued.popleft()[1]()

    @property
    def finish_event(self) -> DeviceEvent:
        return self.load_events[-1]


class LayerDoneCounter:
    """A ring of ``num_counters = 3`` ``LayerLoadingEvent`` slots, registered on the device pool.

    The loader calls ``update_producer()`` before a load and completes that slot's layer events; the
    batch that uses the loaded KV carries the returned index and sets it with ``set_consumer``; the
    device pool's buffer accessors then call ``wait_until(layer)``. ``device`` (default: CUDA when
    available) picks CUDA events or ``CPUEvent``; pass the device pool's device.
    """

    num_counters = 3

    def __init__(self, num_layers: int, device: torch.device | str | None = None) -> None:
        self.num_layers = num_layers
        self.device = default_device() if device is None else torch.device(device)
        self.events = [LayerLoadingEvent(num_layers, self.device) for _ in range(self.num_counters)]
        self.producer_index = -1  # only update_producer/reset write it
        self.consumer_index = -1  # only set_consumer/reset write it

    def update_producer(self) -> int:
        """Advance to the next slot, arm its events and return its index.

        Raises ``UsageError`` (and does not advance) when that slot's previous load has not finished:
        three loads in flight at once would overwrite events a batch may still wait on.
        """
        nxt = (self.producer_index + 1) % self.num_counters
        if not self.events[nxt].finish_event.query():
            raise UsageError(f"layer-done slot {nxt} is still loading; wait for its finish_event first")
        self.producer_index = nxt
        self.events[nxt].arm()
        return nxt

    def set_consumer(self, index: int) -> None:
        """Make the following forward pass wait on slot ``index`` (-1: wait for nothing)."""
        if not -1 <= index < self.num_counters:
            raise UsageError(f"consumer index {index} is outside [-1, {self.num_counters})")
        self.consumer_index = index

    def wait_until(self, threshold: int) -> None:
        """Wait until the consumer slot's layer ``threshold`` is loaded; no-op without a consumer."""
        if self.consumer_index < 0:
            return
        self.events[self.consumer_index].wait(threshold)

    def reset(self) -> None:
        self.producer_index = -1
        self.consumer_index = -1
