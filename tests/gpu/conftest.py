"""tests/gpu: pools, layouts, transfers, layer events and the file L3, on CUDA or on the CPU.

Without CUDA the Triton kernels run under the interpreter: importing ``refcache.gpu`` chooses it.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
