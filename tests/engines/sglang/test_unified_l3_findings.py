"""Whether UnifiedRadixCache's L3 path has F1, F2 and R-1 (specs/sglang-findings.md, found on 0.5.19/0.5.20's
``HiRadixCache``): each finding's mechanism run on the installed release's own ``UnifiedRadixCache`` code on the
CPU, at the unit where the finding lives. The Unified adapter drives no L3 (no storage threads, no backend), so
each test calls the one SGLang function the storage pipeline calls at that point, on a tree the adapter built:

* F1: ``UnifiedTreeCore.insert_host``, what ``_handle_prefetch_result`` calls with a finished prefetch's pages
  (``unified_radix_cache.py`` 0.5.20:2168): under ``write_back`` it attaches them as a host-only node below a
  device-only one (present on every release 0.5.19..0.5.23); under the write-through policies it drops them.
* F2: ``UnifiedRadixCache.write_backup_storage`` (its controller's ``write_storage`` recorded, not run), then a
  match that splits the node under backup: up to 0.5.21 the prefix fragment keeps no host lock (present), from
  0.5.22 ``redistribute_on_node_split`` copies it (fixed). Under write_back ``evict_host`` then reclaims the
  unlocked fragment's host copy (a device duplicate) while the backup still lists its slots: host pages an L3
  write is about to read go back to the pool (up to 0.5.21). F2's own trace (the split during the write-through,
  before the backup starts) is fixed on every release: the ack backs up and locks each fragment.
* R-1: ``UnifiedTreeCore.backfill_missing_hash_values`` (what attaching storage runs, and the same
  ``compute_node_hash_values`` an insert under storage runs) on a node under namespace ``lora-a``: 0.5.19 hashes
  it as the same tokens without a namespace (present), 0.5.20 on seeds the chain with the namespace (fixed).

Runs where ``sglang-unified`` drives the installed release (0.5.19 on); the expectations are per release. The page
hashes come from the adapter's ``_runtime._PageHash`` (checked equal to SGLang's compiled extension,
specs/sglang-adapter.md 'L3'), put in place of the extension the hashing module would compile."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

import pytest

from refcache.config import HiCacheConfig, IOBackend, WritePolicy
from refcache.engines.sglang import _runtime, versions
from refcache.hashing import page_hashes, storage_namespace_seed
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CompleteIO,
    Evict,
    EvictHost,
    FinishRequest,
    IOQueue,
    MatchPrefix,
    StartRequest,
)

INSTALLED: Final = versions.installed().row.version
DRIVEN: Final = "sglang-unified" in versions.installed().row.systems
pytestmark = pytest.mark.skipif(not DRIVEN, reason="sglang-unified does not drive the installed release")
RELEASE: Final = tuple(int(part) for part in INSTALLED.split(".")[:3])


def _open(policy: WritePolicy, page_size: int = 1) -> Any:
    from refcache.engines.sglang._unified import UnifiedSGLangSystem

    cfg = HiCacheConfig(
        page_size=page_size,
        device_size=32 * page_size,
        hicache_io_backend=IOBackend.DIRECT,
        load_back_threshold=1,
        hicache_write_policy=policy,
    )
    return UnifiedSGLangSystem(cfg)


@pytest.fixture(autouse=True, scope="module")
def _imported() -> None:
    """SGLang imported as the adapter imports it (the shim first: the release's modules need it)."""
    from refcache.engines.sglang._unified import ensure_ready

    ensure_ready()


@pytest.fixture
def python_page_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's page hash without compiling its extension."""
    import sglang.srt.mem_cache.cpp_utils.native_hash as native_hash

    monkeypatch.setattr(native_hash, "_load_native_hash_module", lambda: _runtime._PageHash)


@pytest.fixture
def systems() -> Iterator[list[Any]]:
    opened: list[Any] = []
    yield opened
    for system in opened:
        system.close()


def _only_child(node: Any) -> Any:
    (child,) = node.children.values()
    return child


def _full(node: Any) -> Any:
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    return node.component_data[ComponentType.FULL]


# --- F1 ---------------------------------------------------------------------------------------------------------


def _prefetch_insert(policy: WritePolicy, systems: list[Any]) -> tuple[Any, Any]:
    """F1's trace at its last step, on the Unified tree core: a device-only node ``[2100..2103]`` (request 24),
    then the 5 pages a prefetch anchored at the root fetched, ``[2100..2104]``, inserted as
    ``_handle_prefetch_result`` inserts them (``tree_core.insert_host(anchor, key, host_indices, hashes)``)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    system = _open(policy)
    systems.append(system)
    system.apply(StartRequest(24, (2100, 2101, 2102, 2103)))
    system.apply(FinishRequest(24))
    tree = system.tree
    device_node = _only_child(tree.root_node)
    assert list(device_node.key.token_ids) == [2100, 2101, 2102, 2103]
    fetched = [2100, 2101, 2102, 2103, 2104]
    host_indices = system.host_pool.alloc(len(fetched))
    result = tree.insert_host(
        tree.root_node.id, RadixKey(fetched), host_indices, page_hashes(fetched, 1, None)
    )
    return device_node, result


def test_f1_a_prefetch_hangs_its_pages_below_a_device_only_node_under_write_back(systems: list[Any]) -> None:
    """Present on every release the Unified adapter opens: ``insert_host`` drops a refill under a node that is not
    backed up only when the policy is not write_back (``unified_tree_core.py`` 0.5.20:2154-2163)."""
    device_node, result = _prefetch_insert(WritePolicy.WRITE_BACK, systems)
    assert not device_node.backuped  # write_back: nothing backed up before eviction
    assert not result.host_insert_dropped
    below = _only_child(device_node)
    assert list(below.key.token_ids) == [2104]
    assert below.backuped and below.evicted  # a host-only node below a device-only one: D-06 inserts nothing


def test_f1_under_write_through_selective_the_refill_is_dropped(systems: list[Any]) -> None:
    """Fixed for the write-through policies: the device-only anchor path drops the whole refill (D-06's rule).
    From 0.5.22 one finished request already backs its node up under write_through_selective (its insert counts
    the request's hit, D-35), so these two operations leave no device-only node to test the drop with there."""
    device_node, result = _prefetch_insert(WritePolicy.WRITE_THROUGH_SELECTIVE, systems)
    if RELEASE >= (0, 5, 22):
        assert device_node.backuped
        pytest.skip(
            "0.5.22 on: the node is backed up at its first finish (D-35); the drop is read in the code"
        )
    assert not device_node.backuped  # one hit, below write_through_selective's threshold of 2
    assert result.host_insert_dropped
    assert not device_node.children


# --- F2 ---------------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("python_page_hash")
def test_f2_a_split_during_an_l3_backup_leaves_the_prefix_fragment_unlocked_up_to_0_5_21(
    systems: list[Any],
) -> None:
    """A node backed up to host (write-through acked) starts its L3 backup (``write_backup_storage``: the
    operation lists the node and takes one host lock on it), then a match of its first 8 tokens splits it while
    the backup thread would still read all 12 host pages. Up to 0.5.21 ``FullComponent.redistribute_on_node_split``
    copies ``lock_ref`` but not ``host_lock_ref``: the prefix fragment is neither locked nor listed (F2's shape);
    0.5.22 copies it and moves the lock segment's ``host_uuid`` to the prefix (``components/full.py``
    0.5.22:151-157)."""
    system = _open(WritePolicy.WRITE_THROUGH)
    systems.append(system)
    tokens = tuple(range(2700, 2712))
    for op in (StartRequest(18, tokens), FinishRequest(18), CompleteIO(IOQueue.WRITE), CheckHicacheEvents()):
        system.apply(op)
    cache, tree = system.cache, system.tree
    node = _only_child(tree.root_node)
    assert node.backuped
    tree.backfill_missing_hash_values()  # as attaching storage does; build_storage_backup_spec reads them
    written: list[list[int]] = []

    def write_storage(host_indices: Any, token_ids: Any, hash_value: Any, prefix_keys: Any, **_: Any) -> int:
        written.append([int(i) for i in host_indices.tolist()])
        return 7

    cache.cache_controller.write_storage = write_storage
    cache.enable_storage = True
    cache.write_backup_storage(node.id)
    assert len(written) == 1 and len(written[0]) == 12  # the backup reads all 12 host pages
    assert [entry[0] for entry in cache.ongoing_backup.values()] == [node.id]

    system.apply(MatchPrefix(tokens[:8]))
    prefix = _only_child(tree.root_node)
    suffix = _only_child(prefix)
    assert (len(prefix.key), len(suffix.key)) == (8, 4) and suffix is node
    assert _full(suffix).host_lock_ref == 1
    assert [entry[0] for entry in cache.ongoing_backup.values()] == [
        node.id
    ]  # the backup lists the suffix only
    if RELEASE <= (0, 5, 21):
        assert _full(prefix).host_lock_ref == 0  # present: 8 of the 12 pages under backup are unprotected
    else:
        assert _full(prefix).host_lock_ref == 1  # fixed in 0.5.22: the lock covers both fragments


@pytest.mark.usefixtures("python_page_hash")
def test_f2_under_write_back_evict_host_frees_host_pages_an_l3_backup_still_reads_up_to_0_5_21(
    systems: list[Any],
) -> None:
    """Where F2's unlocked fragment loses data (sglang.md section 9 #15, PR #38480's symptom: wrong bytes written to
    L3). write_back: a 12-token node is evicted (backed up to host on eviction), its write ack starts its L3
    backup (``write_storage`` reads host slots 0..11; the operation locks the node), a request of its first 8
    tokens splits it and loads the prefix back, and ``evict_host`` then reclaims the prefix's host copy, now a
    device duplicate (D-48): up to 0.5.21 slots 0..7 go back to the host pool while the backup still lists
    them; from 0.5.22 the prefix holds the backup's lock and nothing is reclaimed."""
    system = _open(WritePolicy.WRITE_BACK)
    systems.append(system)
    cache, tree = system.cache, system.tree
    read: list[list[int]] = []

    def write_storage(host_indices: Any, token_ids: Any, hash_value: Any, prefix_keys: Any, **_: Any) -> int:
        read.append([int(i) for i in host_indices.tolist()])
        return 7

    cache.cache_controller.write_storage = write_storage
    tokens = tuple(range(2700, 2712))
    system.apply(StartRequest(18, tokens))
    system.apply(FinishRequest(18))
    tree.backfill_missing_hash_values()
    cache.enable_storage = True
    system.apply(Evict(12))
    system.apply(CompleteIO(IOQueue.WRITE))
    cache.writing_check()  # the write-back ack starts the L3 backup (check_hicache_events' storage drain needs
    # the storage threads, so its write-ack half is called alone)
    assert read == [list(range(12))] and list(cache.ongoing_backup) == [7]
    system.apply(StartRequest(2, tokens[:8]))  # splits the host-only node, loads the prefix back
    system.apply(CompleteIO(IOQueue.LOAD))
    cache.loading_check()
    system.apply(FinishRequest(2))
    prefix = _only_child(tree.root_node)
    assert len(prefix.key) == 8 and _full(prefix).value is not None
    assert _full(prefix).host_value.tolist() == list(range(8))
    available = system.host_pool.available_size()
    system.apply(EvictHost(8))
    assert list(cache.ongoing_backup) == [7]  # the backup has not run: it will read slots 0..11
    if RELEASE <= (0, 5, 21):
        assert _full(prefix).host_value is None  # present: the prefix's host copy was reclaimed ...
        assert system.host_pool.available_size() == available + 8  # ... and slots 0..7 are free to reuse
    else:
        assert _full(prefix).host_value.tolist() == list(range(8))  # fixed in 0.5.22: locked, kept
        assert system.host_pool.available_size() == available


@pytest.mark.usefixtures("python_page_hash")
def test_f2_s_own_trace_a_split_during_the_write_through_backs_up_and_locks_each_fragment(
    systems: list[Any],
) -> None:
    """F2's kept trace (the node split by a second request while its write-through is pending, then the ack):
    on every Unified release the ack (``_finish_write_through_ack``, 0.5.20:1630-1645) starts one L3 backup per
    fragment of its publish list, each with its own host lock, so this shape of F2 is fixed there. (The model's
    D-07 lists both fragments in one backup: driving Unified's L3 needs that difference as a decision.)"""
    system = _open(WritePolicy.WRITE_THROUGH)
    systems.append(system)
    cache, tree = system.cache, system.tree
    written: list[int] = []

    def write_storage(host_indices: Any, token_ids: Any, hash_value: Any, prefix_keys: Any, **_: Any) -> int:
        written.append(len(token_ids))
        return 100 + len(written)

    cache.cache_controller.write_storage = write_storage
    tokens = tuple(range(2700, 2712))
    system.apply(StartRequest(18, tokens))
    system.apply(FinishRequest(18))
    cache.enable_storage = True
    tree.backfill_missing_hash_values()
    system.apply(StartRequest(19, tokens[:8]))  # splits the node while its write-through is pending
    system.apply(CompleteIO(IOQueue.WRITE))
    cache.writing_check()  # check_hicache_events' write acks (its storage drain needs the storage threads)
    prefix = _only_child(tree.root_node)
    suffix = _only_child(prefix)
    assert written == [8, 4]
    assert sorted(entry[0] for entry in cache.ongoing_backup.values()) == sorted([prefix.id, suffix.id])
    assert (_full(prefix).host_lock_ref, _full(suffix).host_lock_ref) == (1, 1)


# --- R-1 --------------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("python_page_hash")
def test_r1_a_namespaced_node_s_l3_keys_ignore_the_namespace_on_0_5_19_only(systems: list[Any]) -> None:
    """R-1's trace (page size 2, ``StartRequest(0, (4, 0, 3), "lora-a")``) on the Unified tree, its node hashed
    by SGLang's ``compute_node_hash_values`` (``mem_cache/utils.py``: 0.5.19:127 chains from no seed,
    0.5.20:164 through ``get_storage_hash_str``, seeded by ``storage_namespace_seed``)."""
    system = _open(WritePolicy.WRITE_THROUGH, page_size=2)
    systems.append(system)
    system.apply(StartRequest(0, (4, 0, 3), "lora-a"))
    system.apply(FinishRequest(0))
    assert system.tree.backfill_missing_hash_values() == 1
    node = _only_child(system.tree.root_node)
    assert list(node.key.token_ids) == [4, 0] and node.key.extra_key == "lora-a"
    plain = page_hashes((4, 0), 2, None)
    namespaced = page_hashes((4, 0), 2, storage_namespace_seed("lora-a"))
    assert plain != namespaced
    if RELEASE <= (0, 5, 19):
        assert node.hash_value == plain  # present: the base model's key for a LoRA adapter's page
    else:
        assert node.hash_value == namespaced  # fixed from 0.5.20 (the model's key)
