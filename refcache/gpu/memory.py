"""Where KV bytes live: device choice, dtype names, pinned host allocation and bit views.

On a machine with CUDA the device pools live on ``cuda`` and host pools in pinned (page-locked) memory;
without CUDA both are plain CPU tensors and every code path stays the same.
"""

from __future__ import annotations

import torch

from refcache.errors import ConfigError

__all__ = ["as_bits", "default_device", "empty_kv", "torch_dtype"]

# Transfers move bits, never values: an integer view of the same width copies NaN payloads, -0.0 and
# fp8 codes exactly and lets one Triton kernel serve every dtype.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def default_device() -> torch.device:
    """``cuda`` (the current device) when CUDA is available, else ``cpu``."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``HiCacheConfig.dtype`` name. Raises ``ConfigError`` for an unknown name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype={name!r} is not a torch dtype")
    return dtype


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the unsigned/signed integer type of the same width (no copy)."""
    return t.view(_BITS[t.element_size()])


def empty_kv(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin_memory: bool = False
) -> torch.Tensor:
    """A zero-filled buffer; ``pin_memory`` only applies to CPU buffers and only when CUDA exists.

    Zero-filled rather than ``torch.empty`` so that runs are reproducible byte for byte.
    """
    pin = pin_memory and device.type == "cpu" and torch.cuda.is_available()
    return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
