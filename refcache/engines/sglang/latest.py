"""What the installed SGLang still has of what the adapters drive: ``python -m refcache.engines.sglang.latest``.

Reads the installed distribution's files (nothing is imported, so a release the shim does not know cannot
fail here) and reports, for each module and name the 0.5.20 adapter (``DRIVEN``) and the 0.5.23 adapter
(``DRIVEN_0_5_23``) use, whether it is still there. ``nox -s sglang_latest`` installs the newest release and
runs this before the 0.5.23 adapter's tests; the findings are in ``specs/sglang-adapter.md`` ("Newer
releases").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import metadata
from typing import Any, Final

__all__ = ["DRIVEN", "DRIVEN_0_5_23", "report"]

DRIVEN: Final[dict[str, tuple[str, ...]]] = {
    "sglang/srt/mem_cache/hiradix_cache.py": (
        "class HiRadixCache",
        "def init_load_back",
        "def check_hicache_events",
        "def _drop_subtree_no_host",
        "def evict_host",
    ),
    "sglang/srt/mem_cache/radix_cache.py": (
        "class RadixKey",
        "def cache_finished_req",
        "def cache_unfinished_req",
    ),
    "sglang/srt/managers/cache_controller.py": (
        "class HiCacheController",
        "class LayerDoneCounter",
        "device_module = ",
        "def start_loading",
    ),
    "sglang/srt/mem_cache/l2_transfer.py": ("device_module = ", "class L2TransferEngine"),
    "sglang/srt/mem_cache/pool_host/mha.py": ("class MHATokenToKVPoolHost", "transfer_kv_direct"),
    "sglang/srt/mem_cache/pool_host/mla.py": ("class MLATokenToKVPoolHost", "transfer_kv_direct"),
    "sglang/srt/mem_cache/pool_host/common.py": ("ALLOC_MEMORY_FUNCS",),
    "sglang/srt/mem_cache/common.py": ("def evict_from_tree_cache",),
    "sglang/srt/mem_cache/unified_radix_cache.py": ("class UnifiedRadixCache",),
}
"""Source file -> what the 0.5.20 adapter uses there (the last entry: where HiCache went after 0.5.20)."""

DRIVEN_0_5_23: Final[dict[str, tuple[str, ...]]] = {
    "sglang/srt/mem_cache/unified_radix_cache.py": (
        "class UnifiedRadixCache",
        "def init_hicache",
        "def init_load_back",
        "def checkpoint_into_tree",
        "def check_hicache_events",
        "def flush_pending_backups",
        "def has_free_load_back_slot",
        "def evict_host",
    ),
    "sglang/srt/mem_cache/common.py": (
        "def release_kv_cache",
        "def checkpoint_kv_cache",
        "def evict_from_tree_cache",
    ),
    "sglang/srt/mem_cache/unified_cache/unified_tree_core.py": ("class UnifiedTreeCore", "def node_by_id"),
    "sglang/srt/managers/cache_controller.py": ("device_module = ", "class LayerDoneCounter"),
    "sglang/srt/mem_cache/l2_transfer.py": ("device_module = ",),
    "sglang/srt/mem_cache/pool_host/common.py": ("ALLOC_MEMORY_FUNCS",),
    "sglang/srt/runtime_context.py": ("def snapshot_context", "def restore_context"),
}
"""Source file -> what the 0.5.23 adapter (``_unified``) uses there."""


def report() -> list[str]:
    """One line per driven file: present or missing, and which names are missing."""
    dist = metadata.distribution("sglang")
    files = {str(f): f for f in dist.files or ()}
    lines = [f"sglang {dist.version}"]
    for title, driven in (("the 0.5.20 adapter", DRIVEN), ("the 0.5.23 adapter", DRIVEN_0_5_23)):
        lines.append(f" {title}:")
        lines.extend(_check(files, driven))
    return lines


def _check(files: Mapping[str, object], driven: dict[str, tuple[str, ...]]) -> list[str]:
    lines = []
    for path, names in driven.items():
        file: Any = files.get(path)
        if file is None:
            lines.append(f"  MISSING  {path}")
            continue
        text = file.read_text()
        missing = [n for n in names if not re.search(re.escape(n), text)]
        status = "ok      " if not missing else "CHANGED "
        lines.append(f"  {status} {path}" + (f" (no {', '.join(missing)})" if missing else ""))
    return lines


if __name__ == "__main__":
    print("\n".join(report()))  # noqa: T201 - a command-line report
