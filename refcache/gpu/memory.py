"""Where KV bytes live: device choice, dtype names, pinned host allocation and bit views.

On a machine with CUDA the device pools live on ``cuda`` and host pools in pinned (page-locked) memory;
without CUDA both are plain CPU tensors and every code path stays the same.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from collections.abc import Callable
from typing import Final

import torch

from refcache.errors import ConfigError

__all__ = ["INT_OF_SIZE", "as_bits", "default_device", "empty_kv", "raw_bytes", "torch_dtype"]

# Transfers move bits, never values: an integer view of the same width copies NaN payloads, -0.0 and
# fp8 codes exactly and lets one Triton kernel serve every dtype. The integer type of each byte width:
INT_OF_SIZE: Final = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def default_device() -> torch.device:
    """``cuda`` (the current device) when CUDA is available, else ``cpu``."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``HiCacheConfig.dtype`` name. Raises ``ConfigError`` for an unknown name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype={name!r} is not a torch dtype")
    return dtype


def raw_bytes(ptr: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` of CPU memory at address ``ptr`` (a pool or a tensor that the
    caller keeps alive meanwhile). Slices of it stay inside those bytes."""
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the unsigned/signed integer type of the same width (no copy)."""
    return t.view(INT_OF_SIZE[t.element_size()])


HUGE_PAGE: Final = 2 << 20  # transparent huge page size with 4 KiB base pages (x86-64, most arm64)
_MADV_HUGEPAGE: Final = 14


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` (from the symbols the interpreter already has), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def _madvise_hugepage(address: int, length: int) -> bool:
    """Ask Linux to back ``[address, address + length)`` with transparent huge pages; False elsewhere or
    when the kernel refuses (THP off, or an old kernel)."""
    madvise = _madvise()
    return madvise is not None and madvise(address, length, _MADV_HUGEPAGE) == 0


def empty_kv(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin_memory: bool = False
) -> torch.Tensor:
    """A zero-filled buffer; ``pin_memory`` only applies to CPU buffers and only when CUDA exists.

    Zero-filled rather than ``torch.empty`` so that runs are reproducible byte for byte. A plain CPU
    buffer of at least a huge page starts on a huge-page boundary and is advised into transparent huge
    pages before it is first touched: a transfer of scattered pages otherwise pays a TLB miss every
    4 KiB on both sides (specs/data-plane.md §9). The buffer is then a view into a slightly larger
    allocation (its ``data_ptr()`` aligned); nothing reads past its last element.
    """
    pin = pin_memory and device.type == "cpu" and torch.cuda.is_available()
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or pin or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    buffer = raw[skip : skip + nbytes]
    _madvise_hugepage(buffer.data_ptr(), nbytes)
    return buffer.zero_().view(dtype).view(shape)
