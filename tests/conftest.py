"""The whole suite: torch with one intra-op thread (refcache.gpu.threads), unless the environment says otherwise.

Set before any test module imports ``refcache.gpu`` (which applies ``REFCACHE_TORCH_THREADS``); torch-free
here, so the model-only sessions do not load torch.
"""

from __future__ import annotations

import os

if "REFCACHE_TORCH_THREADS" not in os.environ and "OMP_NUM_THREADS" not in os.environ:
    os.environ["REFCACHE_TORCH_THREADS"] = "1"
