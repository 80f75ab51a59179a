"""The import shim: what SGLang 0.5.20's HiCache modules need on a machine without CUDA, and nothing more.

``install()`` runs before the first ``import sglang`` and stubs only when the real ``torchvision`` fails to
import (on a GPU machine with SGLang fully installed nothing here is used). It stubs exactly the names in
``STUBBED``; no SGLang module and no ``sgl_kernel`` module is stubbed (0.5.20 imports ``sgl_kernel`` only
behind its CUDA/ROCm platform checks; the transfer functions it would provide come from ``_cpu``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Final
from unittest import mock

__all__ = ["STUBBED", "install", "installed"]

STUBBED: Final[dict[str, str]] = {
    "torchvision": (
        "a package (and every submodule) whose attributes are MagicMocks. No CPU wheel of torchvision pairs "
        "with torch 2.13.0+cpu on the registries (0.28.0 is a CUDA build that fails to import; 0.29 pulls "
        "another torch). SGLang imports it at module level (srt/utils/common.py, the multimodal "
        "processors reached from srt/configs); HiCache never calls it."
    ),
    "transformers.AutoImageProcessor": (
        "an object whose register() does nothing, set only when transformers made it a dummy (it does so "
        "when torchvision is absent); srt/configs/janus_pro.py registers an image processor at import time."
    ),
}
"""Every stubbed name, with what replaces it and why."""

_installed = False


class _StubModule(types.ModuleType):
    """A package whose every public attribute is a ``MagicMock``."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, prefixes: Sequence[str]) -> None:
        self.prefixes = tuple(prefixes)

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in self.prefixes:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__dict__["__refcache_stub__"] = True
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def installed() -> bool:
    """Whether ``install`` had to stub anything in this process."""
    return _installed


def install() -> None:
    """Make SGLang's HiCache modules importable here: stub ``STUBBED`` only if ``torchvision`` itself fails
    to import (where SGLang is fully installed, on a GPU machine, it imports and nothing is stubbed).

    Idempotent; must run before the first ``import sglang``.
    """
    if _installed or "sglang" in sys.modules:
        return
    try:
        importlib.import_module("torchvision")
        return  # a working torchvision: SGLang imports as it is
    except Exception:  # ImportError, or the RuntimeError of a CUDA build (missing torchvision::nms)
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    _stub()


def _stub() -> None:
    global _installed
    _installed = True
    # transformers probes torchvision once and caches the answer: ask before the stub exists, so that
    # transformers keeps treating torchvision as absent.
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    # transformers/processing_utils.py re-executes transformers/__init__ (a fresh lazy module replaces
    # sys.modules["transformers"]): import it first so that the patch below lands on the module that stays.
    importlib.import_module("transformers.processing_utils")
    transformers = sys.modules["transformers"]
    if isinstance(getattr(transformers, "AutoImageProcessor", None), import_utils.DummyObject):
        no_op = types.SimpleNamespace(register=lambda *args, **kwargs: None)
        setattr(transformers, "AutoImageProcessor", no_op)  # noqa: B010 - a module attribute mypy cannot see
    sys.meta_path.insert(0, _StubFinder(["torchvision"]))
