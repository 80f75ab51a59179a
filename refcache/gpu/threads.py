"""How many intra-op threads torch uses for refcache's small tensors (specs/data-plane.md, "Torch threads").

refcache's tensors are small (a request's slots, one page's KV): each torch call costs microseconds, and
torch's default intra-op pool (one thread per core) turns each into a hand-off that, on a busy 2-core
machine, waits milliseconds for a core (measured: a request loop 2.5-11x slower with two threads than with
one under load). The rule:

* ``REFCACHE_TORCH_THREADS=N`` (N >= 1) sets torch's intra-op threads to N when ``refcache.gpu`` is
  imported; ``0`` (or unset) leaves torch as it is. A library import changes nothing on its own.
* refcache's own entry points — the ``refcache`` command, the test suite (``tests/conftest.py``) and the
  benchmarks — set ``REFCACHE_TORCH_THREADS=1`` before torch loads, unless the user set it or
  ``OMP_NUM_THREADS`` (then the user's choice stands). They do so without importing torch (the command
  line and the checking side never import it), hence an environment variable rather than a call.
* A program can call ``configure_torch_threads(n)`` at any time.
"""

from __future__ import annotations

import os
from typing import Final

import torch

__all__ = ["TORCH_THREADS_ENV", "configure_torch_threads"]

TORCH_THREADS_ENV: Final = "REFCACHE_TORCH_THREADS"


def configure_torch_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads to ``threads``, or to ``REFCACHE_TORCH_THREADS`` when None (unset or 0:
    no change). Returns the number torch now uses."""
    if threads is None:
        raw = os.environ.get(TORCH_THREADS_ENV, "").strip()
        try:
            threads = int(raw) if raw else 0
        except ValueError:
            raise ValueError(f"{TORCH_THREADS_ENV}={raw!r} is not a whole number of threads") from None
    if threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
