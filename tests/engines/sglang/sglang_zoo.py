"""The bug zoo on SGLang 0.5.20 itself: the zoo bugs (``tests/quality/zoo.py``) that have a counterpart in
SGLang's code, re-introduced into SGLang's ``HiRadixCache`` with the same ``Edit`` mechanism (source patch of
one function, swapped in for a ``with bug.applied():`` block). Apply only after an ``SGLangSystem`` was
built once (SGLang's modules import behind the adapter's shim)."""

from __future__ import annotations

from typing import Final

from quality.zoo import ZOO, Bug, Edit

__all__ = ["SGLANG_ZOO"]

_TREE: Final = "sglang.srt.mem_cache.hiradix_cache:HiRadixCache"
_BY_SLUG: Final = {bug.slug: bug for bug in ZOO}


def _on_sglang(slug: str, *edits: Edit, caught_by: str) -> Bug:
    bug = _BY_SLUG[slug]
    return Bug(slug, bug.what, bug.upstream, edits, caught_by, notes="SGLang 0.5.20 counterpart")


SGLANG_ZOO: Final[dict[str, Bug]] = {
    bug.slug: bug
    for bug in (
        _on_sglang(
            "evict-host-never-counts",
            Edit(
                f"{_TREE}.evict_host",
                "            num_evicted += self.cache_controller.evict_host(x.host_value)\n",
                "            self.cache_controller.evict_host(x.host_value)\n",
            ),
            caught_by="outcomes differ on EvictHost",
        ),
        _on_sglang(
            "host-leaf-predicate-swapped",
            Edit(
                f"{_TREE}._update_host_leaf_status",
                "        if not node.evicted or node.lock_ref > 0:\n",
                "        if not node.backuped or node.lock_ref > 0:\n",
            ),
            caught_by="snapshots differ",
        ),
        _on_sglang(
            "write-back-failed-backup-as-done",
            Edit(
                f"{_TREE}.evict",
                "elif self.write_backup(x, write_back=True) > 0:",
                "elif self.write_backup(x, write_back=True) >= 0:",
            ),
            caught_by="outcomes differ",
        ),
        _on_sglang(
            "eviction-ignores-priority",
            Edit(
                f"{_TREE}._make_eviction_heap",
                "            (self.eviction_strategy.get_priority(node), node)\n",
                "            ((node.id,), node)\n",
            ),
            caught_by="snapshots differ",
        ),
    )
}
