"""tests/impl: the implementation (refcache.gpu driver, tree, controller), the seams of refcache.runtime and
their test doubles in refcache.testing.

Without CUDA the Triton kernels run under the interpreter: importing ``refcache.gpu`` chooses it.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "config(**options): HiCacheConfig overrides for the impl fixture")


@pytest.fixture(params=["c", "torch"])
def oracle_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the content oracle's C path for CPU pools (``csrc/oracle.c``), then with its torch
    path (``REFCACHE_NATIVE=off``): each oracle reads the variable when it is built."""
    from refcache.gpu import native

    if request.param == "torch":
        monkeypatch.setenv(native.NATIVE_ENV, "off")
    else:
        if native.mode() == "off":
            monkeypatch.setenv(native.NATIVE_ENV, "auto")
        if native.load("oracle") is None:
            pytest.skip(f"no C oracle: {native.why_not('oracle')}")
    return str(request.param)
