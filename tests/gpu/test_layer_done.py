"""LayerDoneCounter: rotating slots, one event per layer, accessors that wait for their own layer only."""

from __future__ import annotations

import functools
import threading

import pytest

from refcache.config import AttentionKind, IOBackend, MemLayout
from refcache.errors import UsageError
from refcache.gpu import CPUEvent, LayerDoneCounter

from .gpu_helpers import assert_same_bytes, fill_random_, make_config, make_pools, page_slots

WAIT = 5.0  # seconds; generous, only reached when something is broken


def test_cpu_event_semantics() -> None:
    e = CPUEvent()
    assert e.query()  # never recorded: complete, like a fresh CUDA event
    e.arm()
    assert not e.query()
    e.record()
    assert e.query()
    e.wait()
    e.synchronize()


def test_counter_rotates_over_three_slots() -> None:
    counter = LayerDoneCounter(2, "cpu")
    ids = []
    for _ in range(4):
        ids.append(counter.update_producer())
        for layer in range(2):
            counter.events[ids[-1]].complete(layer)
    assert ids == [0, 1, 2, 0]
    counter.reset()
    assert (counter.producer_index, counter.consumer_index) == (-1, -1)


def test_update_producer_refuses_a_slot_still_loading() -> None:
    counter = LayerDoneCounter(2, "cpu")
    for _ in range(3):
        counter.update_producer()  # three loads in flight, none completed
    with pytest.raises(UsageError, match="still loading"):
        counter.update_producer()
    assert counter.producer_index == 2  # unchanged
    counter.events[0].complete(1)  # the finish event (last layer) of slot 0
    assert counter.update_producer() == 0


def test_wait_until_without_consumer_is_a_no_op() -> None:
    counter = LayerDoneCounter(2, "cpu")
    counter.update_producer()  # armed, never completed
    counter.wait_until(1)  # consumer -1: returns at once
    with pytest.raises(UsageError):
        counter.set_consumer(3)
    with pytest.raises(UsageError):
        counter.events[0].complete(2)


def test_accessors_wait_only_for_their_own_layer() -> None:
    """A background loader copies layer 0, then holds layer 1 until released; the forward thread can read
    layer 0's buffers meanwhile, and its read of layer 1 returns only after layer 1 was loaded."""
    config = make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 4, io_backend=IOBackend.DIRECT)
    device, host = make_pools(config)
    fill_random_(host.kv_buffer, 1)
    counter = LayerDoneCounter(device.layer_num, "cpu")  # CPU events: the thread blocks
    device.register_layer_transfer_counter(counter)
    h, d = page_slots([2], 4), page_slots([1], 4)
    producer = counter.update_producer()
    release_layer_1 = threading.Event()
    log: list[str] = []

    def loader() -> None:
        for layer in range(device.layer_num):
            if layer == 1:
                assert release_layer_1.wait(WAIT)
            host.load_to_device_per_layer(device, h, d, layer, IOBackend.DIRECT)
            log.append(f"loaded {layer}")
            counter.events[producer].complete(layer)

    counter.set_consumer(producer)
    thread = threading.Thread(target=loader)
    thread.start()
    k0 = device.get_key_buffer(0)  # returns once layer 0 is loaded
    log.append("read 0")
    assert_same_bytes(k0[d], host.kv_buffer[0, 0, h], "layer 0 K")
    assert "loaded 1" not in log

    reader_done = threading.Event()

    def read_layer_1() -> None:
        device.get_value_buffer(1)
        log.append("read 1")
        reader_done.set()

    reader = threading.Thread(target=read_layer_1)
    reader.start()
    assert not reader_done.wait(0.2)  # still blocked: layer 1 is not loaded
    release_layer_1.set()
    assert reader_done.wait(WAIT)
    thread.join(WAIT)
    reader.join(WAIT)
    assert log == ["loaded 0", "read 0", "loaded 1", "read 1"]
    assert_same_bytes(device.get_value_buffer(1)[d], host.kv_buffer[1, 1, h], "layer 1 V")


def test_mla_accessors_wait_too() -> None:
    config = make_config(AttentionKind.MLA, MemLayout.LAYER_FIRST, 1)
    device, _ = make_pools(config)
    counter = LayerDoneCounter(device.layer_num, "cpu")  # CPU events: the thread blocks
    device.register_layer_transfer_counter(counter)
    counter.set_consumer(counter.update_producer())
    done = threading.Event()

    def read() -> None:
        device.get_kv_buffer(0)
        done.set()

    t = threading.Thread(target=read)
    t.start()
    assert not done.wait(0.1)
    counter.events[0].complete(0)
    assert done.wait(WAIT)
    t.join(WAIT)


def test_issued_copies_run_when_a_reader_waits_for_their_layer() -> None:
    """Single-threaded producers only issue each layer's copy; a wait on layer i runs copies 0..i, a
    reader that does not wait finds nothing copied (the CPU stand-in for an asynchronous stream)."""
    counter = LayerDoneCounter(3, "cpu")
    slot = counter.update_producer()
    ran: list[int] = []
    for layer in range(3):
        counter.events[slot].complete(layer, issued=functools.partial(ran.append, layer))
    assert ran == []  # issued, not run: a reader skipping wait_until sees stale bytes
    counter.set_consumer(slot)
    counter.wait_until(1)
    assert ran == [0, 1]
    counter.wait_until(0)
    assert ran == [0, 1]  # each copy runs once
    with pytest.raises(UsageError, match="never ran"):
        counter.events[slot].arm()  # re-arming would lose layer 2's copy
    counter.events[slot].drain()
    assert ran == [0, 1, 2]
    counter.events[slot].arm()
