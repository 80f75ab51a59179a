"""tests/impl: the implementation (refcache.gpu driver, tree, controller), the seams of refcache.runtime and
their test doubles in refcache.testing.

Without CUDA the Triton kernels run under the interpreter; ``TRITON_INTERPRET`` must be set before
``refcache.gpu.kernels`` is imported (``triton.jit`` picks compile-or-interpret at decoration).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "config(**options): HiCacheConfig overrides for the impl fixture")
