"""What the installed SGLang still has of what the adapter drives: ``python -m refcache.engines.sglang.latest``.

Reads the installed distribution's files (nothing is imported, so a release the shim does not know cannot
fail here) and reports, for each module and name the adapter uses with 0.5.20, whether it is still there.
``nox -s sglang_latest`` installs the newest release and runs this; the findings are in
``specs/sglang-adapter.md`` ("Newer releases").
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import Final

__all__ = ["DRIVEN", "report"]

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


def report() -> list[str]:
    """One line per driven file: present or missing, and which names are missing."""
    dist = metadata.distribution("sglang")
    files = {str(f): f for f in dist.files or ()}
    lines = [f"sglang {dist.version}"]
    for path, names in DRIVEN.items():
        file = files.get(path)
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
