"""The ``_compat`` rows the UnifiedRadixCache adapter (``_unified``) consults, checked against the installed
release's own API: each row says whether a release does it the older way, and a probe of the installed SGLang
(a field, a method, a parameter, a name in its source) says the same. A row whose range is wrong for the
installed release (0.5.21 kept 0.5.20's ``tree_core_backend_from_env`` and ``backups_unbatched`` rows up to
0.5.21, though it has ``CacheInitParams.tree_core_backend`` and ``flush_pending_backups``) fails here, by name,
before a differential run diverges on it. Runs where ``sglang-unified`` drives the installed release (0.5.19
on)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Final

import pytest

from refcache.engines.sglang import versions
from refcache.engines.sglang._compat import ROWS, Compat

DRIVEN: Final = "sglang-unified" in versions.installed().row.systems
pytestmark = pytest.mark.skipif(not DRIVEN, reason="sglang-unified does not drive the installed release")


@pytest.fixture(autouse=True, scope="module")
def _imported() -> None:
    """SGLang imported as the adapter imports it (the shim first: the release's modules need it)."""
    from refcache.engines.sglang._unified import ensure_ready

    ensure_ready()


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _tree_core_backend_from_env() -> bool:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    return "tree_core_backend" not in _fields(CacheInitParams)


def _match_device_indices() -> bool:
    from sglang.srt.mem_cache.base_prefix_cache import MatchResult

    return "device_indices" in MatchResult._fields  # a NamedTuple


def _cache_has(name: str) -> Callable[[], bool]:
    def absent() -> bool:
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        return not hasattr(UnifiedRadixCache, name)

    return absent


def _request_lock_fields() -> bool:
    import sglang.srt.managers.schedule_batch as schedule_batch

    return "self.swa_uuid_for_lock" in inspect.getsource(schedule_batch.Req)


def _load_back_under_device_lock() -> bool:
    import sglang.srt.managers.schedule_policy as schedule_policy

    return "inc_host_lock_ref" not in inspect.getsource(schedule_policy)


def _host_lock_single_node() -> bool:
    from sglang.srt.mem_cache.unified_cache.components import FullComponent

    return "host_uuid" not in inspect.getsource(FullComponent)


def _cache_req_calls() -> bool:
    from sglang.srt.mem_cache.common import release_kv_cache

    return "is_insert" in inspect.signature(release_kv_cache).parameters


def _host_duplicate_reclaim_always() -> bool:
    from sglang.srt.environ import envs

    return not hasattr(envs, "SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM")


def _plain_request_ids() -> bool:
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return "req_id" in inspect.signature(UnifiedRadixCache.prefetch_from_storage).parameters


def _storage_config_without_dcp_rank() -> bool:
    from sglang.srt.managers.cache_controller import HiCacheController

    return "attn_dcp_rank" not in inspect.getsource(HiCacheController._generate_storage_config)


PROBES: Final[dict[str, Callable[[], bool]]] = {
    "tree_core_backend_from_env": _tree_core_backend_from_env,
    "match_device_indices": _match_device_indices,
    "lock_by_node_id": _cache_has("lock"),
    "request_lock_fields": _request_lock_fields,
    "load_back_under_device_lock": _load_back_under_device_lock,
    "host_lock_single_node": _host_lock_single_node,
    "cache_req_calls": _cache_req_calls,
    "host_duplicate_reclaim_always": _host_duplicate_reclaim_always,
    "backups_unbatched": _cache_has("flush_pending_backups"),
    "no_load_back_slot_query": _cache_has("has_free_load_back_slot"),
    "prefetch_timeout_from_start": _cache_has("_start_storage_prefetch_wait"),  # D-55's PollTimer wait
    # consulted by the shared L3 code of _adapter, which _unified drives through
    "plain_request_ids": _plain_request_ids,
    "storage_config_without_dcp_rank": _storage_config_without_dcp_rank,
}
"""Each row ``_unified`` consults -> whether the installed SGLang does it the older way (the row applies)."""


def _consulted() -> set[str]:
    source = (Path(__file__).parents[3] / "refcache" / "engines" / "sglang" / "_unified.py").read_text()
    return set(re.findall(r'compat\.has\(\s*"([a-z_]+)"', source))


def test_every_row_the_unified_adapter_consults_has_a_probe() -> None:
    assert _consulted(), "no compat.has(...) found in _unified.py"
    assert _consulted() <= set(PROBES), sorted(_consulted() - set(PROBES))
    assert set(PROBES) <= {row.name for row in ROWS}


@pytest.mark.parametrize("row", sorted(PROBES))
def test_the_row_says_what_the_installed_release_does(row: str) -> None:
    version = versions.installed().rows  # a post release as itself, main as the newest release
    compat = Compat(version)
    assert compat.has(row) == PROBES[row](), (
        f"_compat row {row!r} ({next(r.releases for r in ROWS if r.name == row)}) "
        f"{'applies' if compat.has(row) else 'does not apply'} to SGLang {version}, whose API says otherwise"
    )
