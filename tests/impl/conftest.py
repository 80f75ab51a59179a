"""tests/impl: the implementation (refcache.gpu driver, tree, controller), the seams of refcache.runtime and
their test doubles in refcache.testing.

Without CUDA the Triton kernels run under the interpreter: importing ``refcache.gpu`` chooses it.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "config(**options): HiCacheConfig overrides for the impl fixture")
