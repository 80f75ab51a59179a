"""CUDA-only checks (skipped without a GPU): real device pools, pinned host memory, native Triton, events.

Everything else in tests/gpu also runs on a GPU machine unchanged (pools then live on CUDA); these add
what only exists there.
"""

from __future__ import annotations

import pytest
import torch

from refcache.config import AttentionKind, IOBackend, MemLayout
from refcache.gpu import LayerDoneCounter
from refcache.gpu.kernels import INTERPRETED

from .gpu_helpers import (
    ROWS,
    backup_and_check,
    fill_random_,
    load_and_check,
    make_config,
    make_pools,
    page_slots,
)

pytestmark = pytest.mark.gpu


def test_pools_live_on_cuda_and_the_host_pool_is_pinned() -> None:
    device, host = make_pools(make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 4))
    assert device.kv_buffer.is_cuda
    assert host.kv_buffer.is_pinned()


@pytest.mark.parametrize(("attention", "layout", "io_backend"), ROWS, ids=lambda v: str(v))
@pytest.mark.parametrize("page_size", [1, 16])
def test_native_round_trip(
    attention: AttentionKind, layout: MemLayout, io_backend: IOBackend, page_size: int
) -> None:
    assert not INTERPRETED or io_backend is IOBackend.DIRECT
    device, host = make_pools(make_config(attention, layout, page_size, "bfloat16", io_backend))
    fill_random_(device.kv_buffer, 1)
    fill_random_(host.kv_buffer, 2)
    h, d = page_slots([5, 0, 2], page_size), page_slots([3, 1, 2], page_size)
    backup_and_check(host, device, h, d, io_backend)
    load_and_check(host, device, h, page_slots([0, 2, 3], page_size), io_backend)
    torch.cuda.synchronize()


def test_layer_events_order_a_side_stream_load_before_the_read() -> None:
    device, host = make_pools(
        make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 4, io_backend=IOBackend.KERNEL)
    )
    fill_random_(host.kv_buffer, 3)
    counter = LayerDoneCounter(device.layer_num, device.device)
    device.register_layer_transfer_counter(counter)
    h, d = page_slots([1], 4), page_slots([0], 4)
    producer = counter.update_producer()
    load_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(load_stream):
        for layer in range(device.layer_num):
            # Delay the copy: a read that did not wait for the layer's event would see zeros.
            torch.cuda._sleep(10_000_000)  # type: ignore[no-untyped-call]
            host.load_to_device_per_layer(device, h, d, layer, IOBackend.KERNEL)
            counter.events[producer].complete(layer)
    counter.set_consumer(producer)
    k = device.get_key_buffer(device.layer_num - 1)[d].clone()  # enqueued after the stream wait
    torch.cuda.synchronize()
    assert torch.equal(
        k.cpu().view(torch.int16), host.kv_buffer[0, device.layer_num - 1, h].view(torch.int16)
    )
