"""The table of SGLang releases (``refcache.engines.sglang.versions``): supported releases, install recipes,
the refusal of any other release at open — all without SGLang installed (the version is faked)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from refcache.config import PROFILES, HiCacheConfig
from refcache.engines.sglang import _compat as compat
from refcache.engines.sglang import versions
from refcache.errors import UnsupportedError, UsageError
from refcache.systems import SYSTEMS

ROOT = Path(__file__).resolve().parents[2]


def test_supported_is_ordered_and_every_row_has_its_constraints_file_and_system() -> None:
    assert tuple(sorted(versions.SUPPORTED, key=versions.parse)) == versions.SUPPORTED
    assert len(set(versions.SUPPORTED)) == len(versions.SUPPORTED)
    for v in versions.SUPPORTED:
        pins = ROOT / versions.constraints_file(v)
        assert pins.is_file(), pins
        assert "torch==2.13.0" in pins.read_text().split()
        assert versions.SYSTEM_BY_VERSION[v] in SYSTEMS
        assert f"sglang-{v}" in PROFILES


def test_systems_engine_field_is_the_table() -> None:
    driven = {v for name in ("sglang", "sglang-unified") for v in SYSTEMS[name].engine[1]}  # type: ignore[index]
    assert sorted(driven, key=versions.parse) == list(versions.SUPPORTED)
    for name in ("sglang", "sglang-unified", "sglang-0.5.23"):
        assert SYSTEMS[name].engine == ("sglang", versions.releases_of(name))
    # the former name drives what sglang-unified drives; 0.5.20 is driven by both cache classes' systems
    assert versions.releases_of("sglang-0.5.23") == versions.releases_of("sglang-unified")
    assert (
        versions.release("0.5.19").systems
        == versions.release("0.5.20").systems
        == ("sglang", "sglang-unified")
    )
    assert [r.version for r in versions.RELEASES if r.builds == "UnifiedRadixCache"][:2] == [
        "0.5.19",
        "0.5.20",
    ]


def test_the_unified_profile_of_0520_follows_its_unified_radix_cache() -> None:
    """0.5.20's UnifiedRadixCache splits before raising the priority (D-36), keeps a split prefix's creation
    time (D-45) and evicts a host shortfall (D-37) as 0.5.22 does; its HiRadixCache does none of them. 0.5.19's
    does D-45 and D-37 (D-36 not seen there)."""
    hi, uni, newer = PROFILES["sglang-0.5.20"], PROFILES["sglang-0.5.20-unified"], PROFILES["sglang-0.5.22"]
    for option in ("priority_after_split", "split_keeps_creation_time", "evict_host_shortfall"):
        assert uni[option] and newer[option] and not hi[option], option
    # a hit on a refilled node (D-50), none at a checkpoint (D-35 is 0.5.22's): specs/decisions.md
    assert uni["count_hits_on_refill"] and not uni["count_hits_per_request"]
    old = PROFILES["sglang-0.5.19-unified"]
    assert (
        old["split_keeps_creation_time"] and old["evict_host_shortfall"] and not old["priority_after_split"]
    )
    assert not PROFILES["sglang-0.5.19"]["split_keeps_creation_time"]
    # D-44, D-46..D-49 on the Unified path of 0.5.19 and 0.5.20 (tests/engines/sglang/test_fidelity_0522.py)
    for option in (
        "write_back_per_victim",
        "last_host_node_is_best_match",
        "load_back_evicts_shortfall",
        "reclaim_host_duplicates",
        "free_duplicates_per_node",
    ):
        assert old[option] and uni[option] and not hi[option] and not PROFILES["sglang-0.5.19"][option], (
            option
        )
    assert "sglang-0.5.22-unified" not in PROFILES  # 0.5.22's default system is the Unified one


def test_install_recipe_torch_first_wheel_last_without_deps() -> None:
    for v in versions.SUPPORTED:
        recipe = versions.install_recipe(v)
        assert recipe[0] == ("torch==2.13.0",)
        assert recipe[-1] == ("--no-deps", f"sglang=={v}")
        assert ("--no-deps", "-e", ".") in recipe
        resolving = [step for step in recipe if "--no-deps" not in step]
        assert recipe[: len(resolving)] == tuple(resolving)  # nothing resolves after a --no-deps install
        assert all(step[:2] == ("-c", versions.constraints_file(v)) for step in resolving[1:])
    assert "fastapi" in versions.install_recipe("0.5.7")[1]  # 0.5.7 imports it (versions.RELEASE_IMPORTS)
    assert "fastapi" not in versions.install_recipe("0.5.8")[1]


@pytest.mark.parametrize("version", ["0.5.0", "0.5.2", "0.6.0", "0.4.10"])
def test_an_unsupported_release_names_itself_and_the_range(version: str) -> None:
    with pytest.raises(UnsupportedError) as caught:
        versions.check_supported(version)
    message = str(caught.value)
    assert f"SGLang {version} " in message
    assert versions.SUPPORTED[0] in message and versions.SUPPORTED[-1] in message
    with pytest.raises(UnsupportedError):
        versions.install_recipe(version)


def test_ranges() -> None:
    r = versions.Releases("0.5.12", "0.5.16")
    assert "0.5.12" in r and "0.5.16" in r and "0.5.11" not in r and "0.5.17" not in r
    assert "0.5.100" in versions.Since("0.5.12") and "0.5.9" not in versions.Since("0.5.12")
    assert "0.5.16" in versions.Until("0.5.16") and "0.5.17" not in versions.Until("0.5.16")
    assert "0.5.9" in versions.Until("0.5.16")  # numbers, not strings
    with pytest.raises(UsageError):
        versions.Since("0.5")
    with pytest.raises(UsageError):
        versions.parse("0.5.20.dev1")


@pytest.mark.parametrize("version", ["0.5.2", "0.6.0"])
def test_opening_sglang_on_an_unsupported_release_is_unsupported_not_a_crash(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from refcache.engines.sglang import open_system

    monkeypatch.setattr(versions, "installed_version", lambda: version)
    for tp_size in (1, 2):
        with pytest.raises(UnsupportedError, match=f"SGLang {version} is not a release refcache drives"):
            open_system(HiCacheConfig(tp_size=tp_size))


def test_each_system_refuses_the_other_systems_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    from refcache.engines.sglang._unified import UnifiedSGLangSystem

    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.23")
    with pytest.raises(UnsupportedError, match=r"driven by the system 'sglang-unified', not 'sglang'"):
        SYSTEMS["sglang"].load("sglang")(HiCacheConfig())
    assert versions.check_installed("sglang-unified", tp_size=2, storage=False).ranks_on(
        "sglang-unified"
    ) == (1, 2)
    with pytest.raises(UnsupportedError, match="tp_size=4"):  # two ranks through _tp's workers, not four
        UnifiedSGLangSystem(HiCacheConfig(tp_size=4))
    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.5")
    with pytest.raises(UnsupportedError, match=r"driven by the system 'sglang', not 'sglang-unified'"):
        SYSTEMS["sglang-unified"].load("sglang-unified")(HiCacheConfig())
    # HiRadixCache's L3 and two ranks from 0.5.3, together too (0.5.3..0.5.5 with R-13, a tail released twice); the
    # ranks retire their loads each alone up to 0.5.12 (D-68), and up to 0.5.10 the prefetch thread's inline
    # all-reduce is routed through the gate ("prefetch_hits_all_reduce_inline")
    # 0.5.3..0.5.15: two ranks with L3 (allocated at admission) together
    for release in (
        "0.5.3",
        "0.5.5",
        "0.5.6",
        "0.5.7",
        "0.5.9",
        "0.5.10",
        "0.5.12",
        "0.5.13",
        "0.5.14",
        "0.5.15",
    ):
        monkeypatch.setattr(versions, "installed_version", lambda release=release: release)
        assert versions.check_installed("sglang", tp_size=2, storage=False).ranks_on("sglang") == (1, 2)
        assert versions.check_installed("sglang", tp_size=2, storage=True).l3_ranks_on("sglang") == (1, 2)
    # a row marked one_rank_l3 (none of 0.5.3..0.5.18 is now) refuses both together, naming the releases that open them
    row = versions.check_installed("sglang", tp_size=2, storage=True)
    with monkeypatch.context() as marked:
        marked.setattr(
            versions,
            "installed",
            lambda: versions.Placement("0.5.15", replace(row, one_rank_l3=True), "release"),
        )
        assert versions.check_installed("sglang", tp_size=2, storage=False).l3_ranks_on("sglang") == (1,)
        assert versions.check_installed("sglang", tp_size=1, storage=True).ranks_on("sglang") == (1, 2)
        with pytest.raises(
            UnsupportedError,
            match=r"tp_size=2 with L3: 'sglang' opens SGLang 0\.5\.15's L3 with tp_size 1; two ranks with L3 "
            r"on 0\.5\.3, 0\.5\.4, 0\.5\.5, 0\.5\.6, 0\.5\.7, 0\.5\.8, 0\.5\.9, 0\.5\.10, 0\.5\.11, 0\.5\.12, 0\.5\.13, 0\.5\.14, 0\.5\.15, "
            r"0\.5\.16, 0\.5\.17, 0\.5\.18, 0\.5\.19, 0\.5\.20 ",
        ):
            versions.check_installed("sglang", tp_size=2, storage=True)
    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.16")
    assert versions.check_installed("sglang", tp_size=2, storage=True).l3_ranks_on("sglang") == (1, 2)
    # both drive 0.5.19; Unified: two ranks, L3
    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.19")
    row = versions.check_installed("sglang-unified", tp_size=2, storage=True)
    assert row.ranks_on("sglang-unified") == row.ranks_on("sglang") == (1, 2) and row.l3_on("sglang-unified")
    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.20")  # Unified: two ranks, L3 (also_*)
    assert versions.check_installed("sglang-unified", tp_size=1, storage=True).l3_on("sglang-unified")
    row = versions.check_installed("sglang-unified", tp_size=2, storage=True)
    assert row.ranks_on("sglang-unified") == row.ranks_on("sglang") == (1, 2)
    assert versions.check_installed("sglang-0.5.23", tp_size=1, storage=False).version == "0.5.20"
    monkeypatch.setenv("REFCACHE_SGLANG_SYSTEM", "sglang-unified")
    assert versions.installed_system() == "sglang-unified"
    assert versions.installed_unified_profile() == "sglang-0.5.20-unified"
    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.18")
    with pytest.raises(UnsupportedError, match=r"does not drive SGLang 0\.5\.18"):
        versions.installed_system()


def test_the_table_imports_neither_torch_nor_sglang() -> None:
    code = (
        "import sys, refcache.engines.sglang.versions, refcache.systems\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'torch', 'numpy'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_a_trace_records_the_release_it_was_made_against(tmp_path: Path) -> None:
    from refcache.errors import TraceFormatError
    from refcache.hicache.ops import Evict
    from refcache.hicache.trace import read_trace, stamp_release, trace_release, write_trace

    path = tmp_path / "t.jsonl"
    write_trace(path, HiCacheConfig(), [Evict(1)])
    assert trace_release(path) is None  # an older trace: none, and it reads as before
    stamp_release(path, "sglang", "0.5.16")
    assert trace_release(path) == ("sglang", "0.5.16")
    assert read_trace(path) == (HiCacheConfig(), [Evict(1)])
    text = path.read_text().replace('"version": "0.5.16"', '"version": 16')
    path.write_text(text)
    with pytest.raises(TraceFormatError, match="release"):
        read_trace(path)


def test_every_compatibility_row_is_live_and_consulted() -> None:
    """A row applies to some supported release but not to all of them (else it is dead, or no difference),
    and the adapter names it somewhere (``compat.has("ROW")`` or, for a duck-typed field, its docstring)."""
    from refcache.engines.sglang import _compat

    sources = "".join(p.read_text() for p in (ROOT / "refcache" / "engines" / "sglang").glob("*.py"))
    table = (ROOT / "refcache/engines/sglang/_compat.py").read_text()  # the rows' own names do not count
    sources = sources.replace(
        table[table.index("\nROWS: ") : table.index("\n)\n", table.index("\nROWS: "))], ""
    )
    driven = [*versions.SUPPORTED, *(p for p in versions.POST_RELEASES if p not in versions.POSTS_NOT_DRIVEN)]
    for row in _compat.ROWS:
        applies = [v for v in driven if v in row.releases]
        assert applies and len(applies) < len(driven), (row.name, applies)
        assert f'"{row.name}"' in sources, f"no adapter code consults {row.name}"
    for role, places in _compat.MODULES.items():
        for v in driven:  # every driven release and post release has exactly one place for each role
            assert sum(v in releases for releases, _module in places) == 1, (role, v)
    assert _compat.Compat("0.5.16").module("host_mha") == "sglang.srt.mem_cache.pool_host.mha"
    assert _compat.Compat("0.5.15").module("l2_transfer") is None
    with pytest.raises(UsageError):
        _compat.Compat("0.5.16").has("no such row")


BEFORE_0510 = {
    "0.5.9": ("init_load_back_positional", "request_dllm_query"),
    "0.5.8": (
        "storage_threads_on_stop_event",
        "drain_without_impl",
        "io_thread_unnamed",
        "no_storage_detach",
        "no_loaded_tokens_count",
        "insert_positional",
        "evict_returns_nothing",
        "req_pool_by_count",
        "tree_frees_request_row",
        "no_leaf_sets",
    ),
    "0.5.7": ("match_prefix_by_key",),
    "0.5.6": ("host_pin_inline",),
}
"""The _compat rows marked "before 0.5.10": each release -> the rows that start applying there."""

L3_BEFORE_0510 = frozenset({"0.5.6", "0.5.7", "0.5.8", "0.5.9"})
"""The releases before 0.5.10 whose L3 'sglang' drives (one rank or two: the prefetch thread's inline all-reduce
routed through the gate, _compat "prefetch_hits_all_reduce_inline"): 0.5.9's storage pipeline is 0.5.10's
(specs/sglang-adapter.md, 'L3 before 0.5.10'; its EAGLE prefetch keys are R-9, a known finding, not a row); 0.5.6..0.5.8's
with five L3 rows up to 0.5.8 and D-67 (0.5.7 and 0.5.6 need no L3 row of their own)."""


@pytest.mark.parametrize("old", sorted(BEFORE_0510))
def test_releases_before_0_5_10_are_driven_by_the_hiradix_adapter_with_their_rows(old: str) -> None:
    """0.5.6 to 0.5.9 (0.5.5, 0.5.4 and 0.5.3 have rows of their own, below; 0.5.2 and before are
    refused, specs/sglang-adapter.md "Releases"):
    HiRadixCache, two ranks (D-68), L3 (with one or two ranks) on those of ``L3_BEFORE_0510`` only; each release's rows apply to it
    and to the older releases, to no later one, and its profile is 0.5.10's, with D-67 up to 0.5.8 (the
    behaviour ranges were read in its wheel)."""
    from refcache.engines.sglang import _compat

    row = versions.release(old)
    l3 = old in L3_BEFORE_0510
    assert (row.system, row.l3, row.ranks, row.builds) == ("sglang", l3, (1, 2), "HiRadixCache")
    assert row.l3_ranks_on("sglang") == ((1, 2) if l3 else ())
    newer = f"0.5.{versions.parse(old)[2] + 1}"
    older, next_one = _compat.Compat(old), _compat.Compat(newer)
    for name in BEFORE_0510[old]:
        assert older.has(name) and not next_one.has(name), name
    assert older.rows - set(BEFORE_0510[old]) == next_one.rows
    d67 = old in ("0.5.6", "0.5.7", "0.5.8")  # write_back's flush queues no L3 backup up to 0.5.8
    assert PROFILES[f"sglang-{old}"] == {**PROFILES["sglang-0.5.10"], "write_back_flush_skips_storage": d67}


BEFORE_056 = (
    "constructor_arguments",
    "finished_len_from_output",
    "prefix_from_prefix_indices",
    "no_node_priority",
    "no_priority_policy",
    "no_page_head_layout",
    "host_pin_always",
    "controller_cuda_streams",
)
"""The _compat rows marked "before 0.5.6": they apply to 0.5.5 and no later release (0.5.4 has all but
"host_pin_always", below)."""


def test_0_5_5_is_driven_with_its_rows_its_exclusions_and_its_host_pool_rounding() -> None:
    """0.5.5: HiRadixCache, L3 on one rank (two ranks without), 0.5.6's rows plus its own; the priority eviction policy and the
    page_head layout, which it lacks, are excluded from the draws (and refused at open); its profile is 0.5.6's
    with D-56 (its host pool holds whole pages only), read in the wheel."""
    from refcache.engines.sglang import _compat

    row = versions.release("0.5.5")
    assert (row.system, row.l3, row.ranks, row.builds) == ("sglang", True, (1, 2), "HiRadixCache")
    assert row.l3_ranks_on("sglang") == (1, 2)
    old, newer = _compat.Compat("0.5.5"), _compat.Compat("0.5.6")
    assert old.rows - set(BEFORE_056) == newer.rows and set(BEFORE_056) <= old.rows
    assert compat.excluded_values("0.5.5") == {
        "radix_eviction_policy": ("priority",),
        "hicache_mem_layout": ("page_head",),
    }
    assert compat.excluded_values("0.5.6") == {}
    assert "fastapi" in versions.install_recipe("0.5.5")[1]
    profile, next_profile = PROFILES["sglang-0.5.5"], PROFILES["sglang-0.5.6"]
    # D-62 from 0.5.6: 0.5.5's nodes have no priority (``_compat`` "no_node_priority")
    assert {k for k in profile if profile[k] != next_profile[k]} == {
        "host_pool_rounded_down",
        "prefetch_takes_root_priority",
    }
    assert profile["host_pool_rounded_down"]
    # D-56: 0.5.5 holds the whole pages of the sized capacity; later releases one page more
    config = HiCacheConfig(device_size=16, page_size=4, hicache_ratio=1.5)
    assert config.host_size == 28 and config.with_fidelity(profile).host_size == 24


BEFORE_055 = ("host_pin_at_allocation",)
"""The _compat rows marked "before 0.5.5": they apply to 0.5.4 and no later release."""


def test_0_5_4_is_driven_as_0_5_5_but_for_how_its_host_pools_pin() -> None:
    """0.5.4: its HiCache modules are 0.5.5's (hiradix_cache.py, cache_controller.py, allocator.py byte for byte)
    but for the host pools, which pin by allocating with ``pin_memory=True`` instead of registering afterwards:
    0.5.5's rows, that one replaced by its own; the same exclusions and the same profile (D-56 included)."""
    from refcache.engines.sglang import _compat

    row = versions.release("0.5.4")
    assert (row.system, row.l3, row.ranks, row.builds) == ("sglang", True, (1, 2), "HiRadixCache")
    assert row.l3_ranks_on("sglang") == (1, 2)
    old, newer = _compat.Compat("0.5.4"), _compat.Compat("0.5.5")
    assert old.rows - set(BEFORE_055) == newer.rows - {"host_pin_always"}
    assert set(BEFORE_055) <= old.rows and "host_pin_always" not in old.rows
    assert compat.excluded_values("0.5.4") == compat.excluded_values("0.5.5")
    assert "fastapi" in versions.install_recipe("0.5.4")[1]
    assert versions.constraints_file("0.5.4") == "constraints/sglang-0.5.4.txt"
    assert PROFILES["sglang-0.5.4"] == PROFILES["sglang-0.5.5"]
    # 0.5.4.post2 and .post3, snapshots towards 0.5.5, have 0.5.5's host pool: its rows (0.5.4.post1: 0.5.4's)
    for post in ("0.5.4.post2", "0.5.4.post3"):
        assert (
            _compat.Compat(post).rows == newer.rows and PROFILES[f"sglang-{post}"] == PROFILES["sglang-0.5.5"]
        )
    assert _compat.Compat("0.5.4.post1").rows == old.rows


BEFORE_054 = (
    "no_global_server_args",
    "release_by_retraction",
    "lru_lfu_policies_only",
    "prefetch_without_prefix_keys",
    "evict_in_schedule_batch",
)
"""The _compat rows marked "before 0.5.4": they apply to 0.5.3 and no later release."""


def test_0_5_3_is_driven_with_its_rows_and_only_lru_and_lfu() -> None:
    """0.5.3: HiRadixCache, L3 on one rank, 0.5.4's rows plus five of its own (one of L3: no prefix_keys); of the eviction policies it has
    only lru and lfu, so fifo, mru, filo (and priority, as up to 0.5.5) are excluded from the draws and refused at
    open; its profile is 0.5.4's with D-65 (a finish frees the unaligned tail before its insert), read in the
    wheels."""
    from refcache.engines.sglang import _compat

    row = versions.release("0.5.3")
    assert (row.system, row.l3, row.ranks, row.builds) == ("sglang", True, (1, 2), "HiRadixCache")
    assert row.l3_ranks_on("sglang") == (1, 2)
    old, newer = _compat.Compat("0.5.3"), _compat.Compat("0.5.4")
    assert old.rows - set(BEFORE_054) == newer.rows and set(BEFORE_054) <= old.rows
    assert compat.excluded_values("0.5.3") == {
        "radix_eviction_policy": ("fifo", "mru", "filo", "priority"),
        "hicache_mem_layout": ("page_head",),
    }
    assert "fastapi" in versions.install_recipe("0.5.3")[1]
    profile, next_profile = PROFILES["sglang-0.5.3"], PROFILES["sglang-0.5.4"]
    assert {k for k in profile if profile[k] != next_profile[k]} == {"tail_freed_before_insert"}  # D-65


def test_the_machines_draw_no_value_a_system_excludes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``SystemEntry.excludes`` of ``sglang`` is the installed release's ``excluded_values``; the configuration
    strategy draws none of them (and every value without exclusions)."""
    from hypothesis import given, settings

    from refcache.check.configs import configs
    from refcache.config import EvictionPolicy, MemLayout
    from refcache.systems import excluded_values

    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.5")
    excluded = excluded_values(("model", "sglang"))
    assert excluded == compat.excluded_values("0.5.5")
    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.6")
    assert excluded_values(("model", "sglang")) == {}
    seen: set[object] = set()

    @settings(max_examples=200, database=None, derandomize=True)
    @given(configs(excluded=excluded), configs())
    def draw(kept: HiCacheConfig, free: HiCacheConfig) -> None:
        assert kept.radix_eviction_policy is not EvictionPolicy.PRIORITY
        assert kept.hicache_mem_layout is not MemLayout.PAGE_HEAD
        seen.update((free.radix_eviction_policy, free.hicache_mem_layout))

    draw()
    assert EvictionPolicy.PRIORITY in seen and MemLayout.PAGE_HEAD in seen
