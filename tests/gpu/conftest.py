"""tests/gpu: pools, layouts, transfers, layer events and the file L3, on CUDA or on the CPU.

Without CUDA the Triton kernels run under the interpreter; ``TRITON_INTERPRET`` must be set before
``refcache.gpu.kernels`` is imported, because ``triton.jit`` picks compile-or-interpret at decoration.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
