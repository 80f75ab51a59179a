"""The differential state machines: the model and the implementation side by side.

``DifferentialMachine`` is ``ModelMachine`` with ``HiCacheImpl`` added as a second system: every step is
applied to both, the harness compares observations and full snapshots and checks every invariant on both
(``refcache.harness``). ``FaultyDifferentialMachine`` adds storage faults. The implementation runs on CPU
tensors with a manual executor and a temporary L3 directory per example.
"""

from __future__ import annotations

import os
import tempfile

import torch

# Without CUDA the Triton kernels run under the interpreter, which must be chosen before Triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from refcache.config import HiCacheConfig
from refcache.gpu.driver import HiCacheImpl
from refcache.harness import System
from refcache.model import HiCacheModel
from refcache.strategies import FaultyModelMachine, ModelMachine

__all__ = ["DifferentialMachine", "FaultyDifferentialMachine", "model_and_implementation"]


def model_and_implementation(config: HiCacheConfig) -> dict[str, System]:
    """Fresh model and implementation for one replay (``refcache.shrink.SystemsFactory``); the
    implementation owns a temporary L3 directory that its ``close()`` removes."""
    return {"model": HiCacheModel(config), "impl": HiCacheImpl(config)}


class DifferentialMachine(ModelMachine):
    """Model versus implementation, fault-free."""

    impl: HiCacheImpl | None = None

    def make_systems(self, config: HiCacheConfig) -> dict[str, System]:
        self._l3 = tempfile.TemporaryDirectory(prefix="refcache-l3-")
        self.impl = HiCacheImpl(config, l3_dir=self._l3.name)
        return {**super().make_systems(config), "impl": self.impl}

    def teardown(self) -> None:
        super().teardown()
        if self.impl is not None:
            self.impl.close()
            self._l3.cleanup()


class FaultyDifferentialMachine(FaultyModelMachine, DifferentialMachine):
    """Storage faults too: after a fault a prefetch may miss, never return wrong bytes."""
