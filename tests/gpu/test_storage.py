"""File L3: SGLang's HiCacheFile semantics, and faults that must end in a miss or a clean error.

The safety property checked everywhere: a page reported as a hit holds exactly the bytes that were
stored under its key. Misses are always allowed under faults; without a fault, a stored key must hit.
"""

from __future__ import annotations

import errno
import itertools
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refcache.config import AttentionKind, HiCacheConfig, MemLayout
from refcache.errors import UsageError
from refcache.gpu import FileOps, HiCacheFile, checksum, storage
from refcache.gpu.faults import FaultyFileOps, flip_byte, swap_files, truncate_file, write_partial_object

from .gpu_helpers import LAYOUTS, assert_same_bytes, fill_random_, make_config, make_pools

KEYS = [f"{i:064x}" for i in range(1, 9)]  # hash-like keys


class L3:
    """A host pool with random content and an L3 in a fresh directory."""

    def __init__(
        self, directory: str, attention: AttentionKind, layout: MemLayout, page_size: int, ops: FileOps
    ) -> None:
        self.config = make_config(attention, layout, page_size)
        _, self.host = make_pools(self.config)
        fill_random_(self.host.kv_buffer, 1)
        self.file = HiCacheFile(directory, self.config, tp_rank=0, file_ops=ops)
        self.file.register_mem_pool_host(self.host)
        self.ps = page_size

    def pages(self, *pages: int) -> torch.Tensor:
        return torch.tensor([p * self.ps + o for p in pages for o in range(self.ps)], dtype=torch.int64)

    def page(self, p: int) -> torch.Tensor:
        return self.host.get_data_page(p * self.ps)

    def path(self, key: str) -> str:
        return os.path.join(self.file.file_path, f"{key}{self.file.config_suffix}.bin")


@pytest.fixture
def l3(tmp_path: Path) -> L3:
    return L3(str(tmp_path), AttentionKind.MHA, MemLayout.PAGE_FIRST, 4, FaultyFileOps())


def _ops(l3: L3) -> FaultyFileOps:
    assert isinstance(l3.file.ops, FaultyFileOps)
    return l3.file.ops


def _no_temp_files(directory: str) -> bool:
    return not [n for n in os.listdir(directory) if n.endswith(".tmp")]


# --- SGLang semantics -----------------------------------------------------------------------------------


def test_key_suffixes(tmp_path: Path) -> None:
    mha = HiCacheFile(tmp_path, HiCacheConfig(model_name="org/model", tp_size=4), tp_rank=2)
    assert mha.config_suffix == "_org-model_2_4"
    assert mha._get_path("abc").endswith("abc_org-model_2_4.bin")
    mla = HiCacheFile(
        tmp_path, HiCacheConfig(model_name="org/model", tp_size=4, attention=AttentionKind.MLA), tp_rank=2
    )
    assert mla.config_suffix == "_org-model"
    assert mla.is_mla_model
    with pytest.raises(UsageError):
        mha.exists("a/b")


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(("attention", "layout"), LAYOUTS, ids=str)
def test_round_trip_and_both_paths_agree(attention: AttentionKind, layout: MemLayout, page_size: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        l3 = L3(d, attention, layout, page_size, FileOps())
        src = [l3.page(p) for p in (0, 1, 2)]
        assert l3.file.batch_set_v1(KEYS[:2], l3.pages(0, 1)) == [True, True]
        assert l3.file.batch_set(KEYS[2:3], [src[2]])  # generic path
        assert l3.file.batch_exists(KEYS[:4]) == 3
        # v1 read into other pages, generic read into fresh tensors: identical bytes either way.
        assert l3.file.batch_get_v1(KEYS[:3], l3.pages(5, 6, 7)) == [True, True, True]
        for i, p in enumerate((5, 6, 7)):
            assert_same_bytes(l3.page(p), src[i], f"v1 read of key {i}")
        targets = [l3.host.get_dummy_flat_data_page() for _ in range(3)]
        got = l3.file.batch_get(KEYS[:3], targets)
        for i in range(3):
            assert got[i] is not None
            assert_same_bytes(targets[i], src[i], f"generic read of key {i}")


def test_batch_exists_counts_leading_keys(l3: L3) -> None:
    assert l3.file.batch_exists(KEYS[:3]) == 0
    l3.file.batch_set_v1(KEYS[:3], l3.pages(0, 1, 2))
    assert l3.file.batch_exists(KEYS[:3]) == 3
    os.unlink(l3.path(KEYS[1]))
    assert l3.file.batch_exists(KEYS[:3]) == 1
    assert l3.file.batch_exists([]) == 0


def test_set_never_overwrites(l3: L3) -> None:
    assert l3.file.batch_set_v1(KEYS[:1], l3.pages(0)) == [True]
    assert l3.file.batch_set_v1(KEYS[:1], l3.pages(1)) == [True]  # exists: reported stored, not rewritten
    assert l3.file.batch_get_v1(KEYS[:1], l3.pages(3)) == [True]
    assert_same_bytes(l3.page(3), l3.page(0), "the first value stays")


def test_generic_batch_set_stops_at_the_first_failure(l3: L3) -> None:
    pages = [l3.page(p) for p in range(3)]
    assert l3.file.set(KEYS[0], pages[0])
    size = os.path.getsize(l3.path(KEYS[0]))
    os.unlink(l3.path(KEYS[0]))
    _ops(l3).space_left = size + 10  # the second object runs out of space
    assert not l3.file.batch_set(KEYS[:3], pages)
    assert [l3.file.exists(k) for k in KEYS[:3]] == [True, False, False]
    assert _no_temp_files(l3.file.file_path)


def test_clear_deletes_everything(l3: L3) -> None:
    l3.file.batch_set_v1(KEYS[:2], l3.pages(0, 1))
    open(os.path.join(l3.file.file_path, ".orphan.tmp"), "w").close()
    l3.file.clear()
    assert os.listdir(l3.file.file_path) == []
    assert l3.file.batch_exists(KEYS[:2]) == 0


def test_usage_errors(tmp_path: Path) -> None:
    config = make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 4)
    _, host = make_pools(config)
    file = HiCacheFile(tmp_path, config)
    with pytest.raises(UsageError, match="register_mem_pool_host"):
        file.batch_get_v1(KEYS[:1], torch.arange(4))
    file.register_mem_pool_host(host)
    with pytest.raises(UsageError, match="host indices"):
        file.batch_set_v1(KEYS[:2], torch.arange(4))
    with pytest.raises(UsageError):
        file.set(KEYS[0], torch.zeros(3, dtype=torch.float16))


# --- faults ---------------------------------------------------------------------------------------------


def _stored(l3: L3, n: int = 2) -> list[torch.Tensor]:
    assert l3.file.batch_set_v1(KEYS[:n], l3.pages(*range(n))) == [True] * n
    return [l3.page(p) for p in range(n)]


@settings(max_examples=25, deadline=None)
@given(cut=st.floats(0, 1, exclude_max=True))
def test_truncated_object_is_a_miss_and_leaves_the_page_untouched(cut: float) -> None:
    with tempfile.TemporaryDirectory() as d:
        l3 = L3(d, AttentionKind.MLA, MemLayout.LAYER_FIRST, 4, FileOps())
        src = _stored(l3, 1)
        size = os.path.getsize(l3.path(KEYS[0]))
        truncate_file(l3.path(KEYS[0]), int(cut * size))
        before = l3.page(4)
        assert l3.file.batch_exists(KEYS[:1]) == 0
        assert l3.file.batch_get_v1(KEYS[:1], l3.pages(4)) == [False]
        assert_same_bytes(l3.page(4), before, "destination of a truncated object")
        # A later set repairs it.
        assert l3.file.batch_set_v1(KEYS[:1], l3.pages(0)) == [True]
        assert l3.file.batch_get_v1(KEYS[:1], l3.pages(4)) == [True]
        assert_same_bytes(l3.page(4), src[0], "after repair")


@settings(max_examples=40, deadline=None)
@given(where=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255), generic=st.booleans())
def test_flipped_byte_anywhere_is_a_miss(where: float, mask: int, generic: bool) -> None:
    with tempfile.TemporaryDirectory() as d:
        l3 = L3(d, AttentionKind.MHA, MemLayout.LAYER_FIRST, 4, FileOps())
        src = _stored(l3, 1)
        path = l3.path(KEYS[0])
        flip_byte(path, int(where * os.path.getsize(path)), mask)
        if generic:
            assert l3.file.get(KEYS[0], l3.host.get_dummy_flat_data_page()) is None
        else:
            assert l3.file.batch_get_v1(KEYS[:1], l3.pages(4)) == [False]
        assert not os.path.exists(path)  # quarantined, so the next set rewrites it
        assert l3.file.batch_set_v1(KEYS[:1], l3.pages(0)) == [True]
        assert l3.file.batch_get_v1(KEYS[:1], l3.pages(4)) == [True]
        assert_same_bytes(l3.page(4), src[0], "after repair")


def test_swapped_files_are_misses(l3: L3) -> None:
    _stored(l3, 2)
    swap_files(l3.path(KEYS[0]), l3.path(KEYS[1]))
    assert l3.file.batch_exists(KEYS[:2]) == 2  # same sizes: only the content check can tell
    assert l3.file.batch_get_v1(KEYS[:2], l3.pages(4, 5)) == [False, False]


def test_object_of_another_layout_is_a_miss(tmp_path: Path) -> None:
    writer = L3(str(tmp_path), AttentionKind.MHA, MemLayout.PAGE_HEAD, 4, FileOps())
    reader = L3(str(tmp_path), AttentionKind.MHA, MemLayout.PAGE_FIRST, 4, FileOps())
    writer.file.batch_set_v1(KEYS[:1], writer.pages(0))
    assert reader.file.batch_get_v1(KEYS[:1], reader.pages(0)) == [False]


def test_delete_between_exists_and_get(l3: L3) -> None:
    src = _stored(l3, 2)
    assert l3.file.batch_exists(KEYS[:2]) == 2
    os.unlink(l3.path(KEYS[1]))
    assert l3.file.batch_get_v1(KEYS[:2], l3.pages(4, 5)) == [True, False]
    assert_same_bytes(l3.page(4), src[0], "the surviving page")


def test_half_written_object_is_a_miss(l3: L3) -> None:
    _stored(l3, 2)
    path = l3.path(KEYS[1])
    os.unlink(path)
    write_partial_object(l3.path(KEYS[0]), path, 100)  # a non-atomic writer that crashed
    assert l3.file.batch_exists(KEYS[:2]) == 1
    assert l3.file.batch_get_v1(KEYS[1:2], l3.pages(5)) == [False]


@settings(max_examples=25, deadline=None)
@given(room=st.floats(0, 3, exclude_max=True))
def test_failed_write_leaves_nothing_visible(room: float) -> None:
    with tempfile.TemporaryDirectory() as d:
        ops = FaultyFileOps()
        l3 = L3(d, AttentionKind.MHA, MemLayout.PAGE_FIRST_DIRECT, 4, ops)
        probe = L3(tempfile.mkdtemp(dir=d), AttentionKind.MHA, MemLayout.PAGE_FIRST_DIRECT, 4, FileOps())
        _stored(probe, 1)
        size = os.path.getsize(probe.path(KEYS[0]))
        ops.space_left = int(room * size)  # no space after this many bytes
        ok = l3.file.batch_set_v1(KEYS[:3], l3.pages(0, 1, 2))
        assert ok == [i < int(room) for i in range(3)]
        assert _no_temp_files(d)
        assert [os.path.exists(l3.path(k)) for k in KEYS[:3]] == ok
        ops.space_left = None
        got = l3.file.batch_get_v1(KEYS[:3], l3.pages(4, 5, 6))
        assert got == ok
        for i, hit in enumerate(got):
            if hit:
                assert_same_bytes(l3.page(4 + i), l3.page(i), f"page {i}")


def test_read_only_directory_through_the_seam(l3: L3) -> None:
    _ops(l3).read_only = True
    assert l3.file.batch_set_v1(KEYS[:2], l3.pages(0, 1)) == [False, False]
    assert os.listdir(l3.file.file_path) == []
    assert l3.file.batch_get_v1(KEYS[:1], l3.pages(4)) == [False]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_for_real(tmp_path: Path) -> None:
    l3 = L3(str(tmp_path), AttentionKind.MHA, MemLayout.PAGE_FIRST, 4, FileOps())
    os.chmod(tmp_path, 0o555)
    try:
        assert l3.file.batch_set_v1(KEYS[:1], l3.pages(0)) == [False]
        assert os.listdir(tmp_path) == []
    finally:
        os.chmod(tmp_path, 0o755)


def test_failed_publish_and_failed_read(l3: L3) -> None:
    _ops(l3).fail_replace = True
    assert l3.file.batch_set_v1(KEYS[:1], l3.pages(0)) == [False]
    assert os.listdir(l3.file.file_path) == []
    _ops(l3).fail_replace = False
    _stored(l3, 1)
    _ops(l3).fail_reads = 1
    assert l3.file.batch_get_v1(KEYS[:1], l3.pages(4)) == [False]  # an I/O error is a miss
    assert l3.file.batch_get_v1(KEYS[:1], l3.pages(4)) == [True]  # and does not delete a good object


def test_injected_faults_say_they_were_injected(l3: L3, caplog: pytest.LogCaptureFixture) -> None:
    """The L3 logs failed reads and writes as warnings; an injected fault must not read like a real disk
    error in the middle of a fuzz run."""
    _stored(l3, 1)
    _ops(l3).fail_reads = 1
    _ops(l3).read_only = True
    with caplog.at_level("WARNING", logger=storage.__name__):
        assert l3.file.batch_get_v1(KEYS[:1], l3.pages(4)) == [False]
        assert l3.file.batch_set_v1(KEYS[1:2], l3.pages(1)) == [False]
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2, messages
    assert all("injected fault: " in message for message in messages), messages
    assert "[Errno 5] injected fault: Input/output error" in messages[0]
    assert "[Errno 30] injected fault: Read-only file system" in messages[1]


FAULTS = ["none", "truncate", "flip", "swap", "delete", "enospc", "read_only"]


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["set", "get", "fault"]),
            st.integers(0, 3),
            st.sampled_from(FAULTS),
            st.integers(0, 10**6),
        ),
        max_size=25,
    )
)
def test_fault_storm_never_returns_wrong_bytes(steps: list[tuple[str, int, str, int]]) -> None:
    """Random sets, gets and faults on four keys. Each key's page content is fixed (set never
    overwrites, so a hit must always return exactly the content of the key); a key with no fault since
    its last successful set must hit."""
    with tempfile.TemporaryDirectory() as d:
        ops = FaultyFileOps()
        l3 = L3(d, AttentionKind.MHA, MemLayout.LAYER_FIRST, 2, ops)
        content = {k: l3.page(i) for i, k in enumerate(KEYS[:4])}
        healthy: set[str] = set()
        wrong = 0
        for action, i, fault, r in steps:
            key, path = KEYS[i], l3.path(KEYS[i])
            ops.space_left, ops.read_only = None, False
            if action == "set":
                ok = l3.file.batch_set_v1([key], l3.pages(i))
                if ok == [True] and _intact(l3, key, content[key]):
                    healthy.add(key)
            elif action == "get":
                hit = l3.file.batch_get_v1([key], l3.pages(8))[0]
                if hit:
                    wrong += not _same(l3.page(8), content[key])
                if key in healthy:
                    assert hit, f"{key[-2:]} was stored and not damaged, but missed"
            elif fault != "none" and os.path.exists(path):
                healthy.discard(key)
                size = os.path.getsize(path)
                if fault == "truncate":
                    truncate_file(path, r % size)
                elif fault == "flip":
                    flip_byte(path, r % size, 1 + r % 255)
                elif fault == "swap":
                    other = KEYS[(i + 1 + r % 3) % 4]
                    if os.path.exists(l3.path(other)):
                        healthy.discard(other)
                        swap_files(path, l3.path(other))
                elif fault == "delete":
                    os.unlink(path)
            elif fault in ("enospc", "read_only"):
                ops.space_left = r % 600 if fault == "enospc" else None
                ops.read_only = fault == "read_only"
                ok = l3.file.batch_set_v1([key], l3.pages(i))
                ops.space_left, ops.read_only = None, False
                if ok == [True] and _intact(l3, key, content[key]):
                    healthy.add(key)
            assert _no_temp_files(d)
        assert wrong == 0, f"{wrong} hits returned wrong bytes"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        assert_same_bytes(a, b, "")
    except AssertionError:
        return False
    return True


def _intact(l3: L3, key: str, content: torch.Tensor) -> bool:
    """Whether ``key``'s object reads back as ``content`` (used to learn if a set left a good object)."""
    target = l3.host.get_dummy_flat_data_page()
    return l3.file.get(key, target) is not None and _same(target, content)


class _NoChecksum(HiCacheFile):
    """A deliberately broken reader that trusts any object of the right size (the classic HiCacheFile)."""

    def _mismatch(self, name: str, got: bytes) -> str:
        return ""


def test_the_wrong_bytes_check_catches_a_reader_without_checks(tmp_path: Path) -> None:
    l3 = L3(str(tmp_path), AttentionKind.MHA, MemLayout.LAYER_FIRST, 2, FileOps())
    src = _stored(l3, 2)
    broken = _NoChecksum(l3.file.file_path, l3.config)
    broken.register_mem_pool_host(l3.host)
    swap_files(l3.path(KEYS[0]), l3.path(KEYS[1]))
    assert broken.batch_get_v1(KEYS[:1], l3.pages(8)) == [True]  # a hit ...
    assert not _same(l3.page(8), src[0])  # ... with another key's bytes: what the real reader prevents
    assert l3.file.batch_get_v1(KEYS[:1], l3.pages(8)) == [False]


# --- pages read and hashed in chunks ---------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=8), limit=st.integers(1, 400))
def test_split_cuts_segments_into_chunks_in_order(sizes: list[int], limit: int) -> None:
    segments = list(
        zip(itertools.accumulate([1000, *sizes[:-1]], lambda a, n: a + n + 7), sizes, strict=True)
    )
    chunks = storage._split(segments, limit)
    assert all(0 < sum(n for _, n in chunk) <= limit for chunk in chunks)
    assert all(sum(n for _, n in chunk) == limit for chunk in chunks[:-1])  # only the last one is short
    flat = [(ptr + i, 1) for chunk in chunks for ptr, n in chunk for i in range(n)]
    assert flat == [(ptr + i, 1) for ptr, n in segments for i in range(n)]


class _CountingOps(FileOps):
    """Counts ``readv`` calls and fails the ``fail_at``-th one with EIO (1-based; 0: never)."""

    def __init__(self) -> None:
        self.reads, self.fail_at = 0, 0

    def readv(self, fd: int, buffers: Sequence[memoryview]) -> int:
        self.reads += 1
        if self.reads == self.fail_at:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super().readv(fd, buffers)


@pytest.mark.parametrize("chunk", [64, 100, 1 << 20])
@pytest.mark.parametrize(("attention", "layout"), LAYOUTS, ids=str)
def test_a_page_larger_than_a_chunk_reads_in_chunks(
    attention: AttentionKind, layout: MemLayout, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With pages of several chunks (the limit patched down from 512 KiB; 100 splits segments), both read
    paths return the stored bytes in one ``readv`` per chunk; a byte flipped in any chunk is a miss,
    and a read error in a later chunk is a miss that keeps the object."""
    monkeypatch.setattr(storage, "_HASH_CHUNK", chunk)
    with tempfile.TemporaryDirectory() as d:
        ops = _CountingOps()
        l3 = L3(d, attention, layout, 4, ops)
        src = _stored(l3, 2)
        page_bytes = l3.file.page_bytes
        assert page_bytes > 100  # MHA 512, MLA 192 bytes: chunks of 64 and 100 bytes split every layout
        ops.reads = 0
        assert l3.file.batch_get_v1(KEYS[:1], l3.pages(5)) == [True]
        assert ops.reads == -(-page_bytes // chunk)
        assert_same_bytes(l3.page(5), src[0], "v1 read in chunks")
        target = l3.host.get_dummy_flat_data_page()
        assert l3.file.get(KEYS[1], target) is not None
        assert_same_bytes(target, src[1], "generic read in chunks")
        for where in (0, page_bytes // 2, page_bytes - 1):
            flip_byte(l3.path(KEYS[0]), where, 0x10)
            assert l3.file.batch_get_v1(KEYS[:1], l3.pages(5)) == [False]
            assert not os.path.exists(l3.path(KEYS[0]))
            assert l3.file.batch_set_v1(KEYS[:1], l3.pages(0)) == [True]
        if page_bytes > chunk:
            ops.reads, ops.fail_at = 0, 2
            assert l3.file.batch_get_v1(KEYS[:1], l3.pages(5)) == [False]
            assert os.path.exists(l3.path(KEYS[0]))
        ops.fail_at = 0
        assert l3.file.batch_get_v1(KEYS[:1], l3.pages(5)) == [True]


@pytest.mark.parametrize("chunk", [100, 1 << 20])
def test_an_object_of_the_other_checksum_is_hashed_again(
    l3: L3, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """A read hashes with the algorithm this process writes; an object another process wrote with the
    other one (CRC-32 without libxxhash, XXH3 with it) is verified by hashing again, in chunks or not."""
    monkeypatch.setattr(storage, "_HASH_CHUNK", chunk)
    other = checksum.CRC32 if checksum.preferred() == checksum.XXH3 else checksum.XXH3
    if other not in checksum.available():
        pytest.skip("only one checksum algorithm is available")
    with monkeypatch.context() as m:
        m.setattr(checksum, "preferred", lambda: other)
        src = _stored(l3, 1)
    assert l3.file.batch_get_v1(KEYS[:1], l3.pages(4)) == [True]
    assert_same_bytes(l3.page(4), src[0], "object of the other algorithm")
    flip_byte(l3.path(KEYS[0]), 300, 0x01)
    assert l3.file.batch_get_v1(KEYS[:1], l3.pages(4)) == [False]


# --- checksums and ranks --------------------------------------------------------------------------------


@pytest.mark.skipif(checksum.XXH3 not in checksum.available(), reason="libxxhash is not installed")
def test_an_unverifiable_object_is_a_miss_but_is_kept(l3: L3, monkeypatch: pytest.MonkeyPatch) -> None:
    _stored(l3, 1)  # written with XXH3
    monkeypatch.setattr(checksum, "available", lambda: frozenset({checksum.CRC32}))
    assert l3.file.batch_get_v1(KEYS[:1], l3.pages(4)) == [False]
    assert os.path.exists(l3.path(KEYS[0]))  # another process may well read it


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_digest_does_not_depend_on_the_split_or_the_thread(data: st.DataObject) -> None:
    """``checksum.digest`` (one reused state per thread) equals a fresh streaming hasher, however the
    bytes are split into segments and whichever thread asks; a flipped bit changes it."""
    payload = torch.tensor(
        data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=600)), dtype=torch.uint8
    )
    n = payload.numel()
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=5), label="cuts"))
    bounds = [0, *cuts, n]
    base = payload.data_ptr()
    segments = [(base + a, b - a) for a, b in itertools.pairwise(bounds)]
    for algorithm in checksum.available():
        hasher = checksum.new(algorithm)
        hasher.update(base, n)
        whole = hasher.digest()
        assert checksum.digest(algorithm, segments) == whole
        assert checksum.digest(algorithm, [(base, n)]) == whole  # the reused state was reset
        results: list[int] = []
        worker = threading.Thread(
            target=lambda a=algorithm, r=results: r.append(checksum.digest(a, segments))
        )
        worker.start()
        worker.join()
        assert results == [whole]
        payload[n // 2] ^= 1
        assert checksum.digest(algorithm, segments) != whole
        payload[n // 2] ^= 1


def test_mla_ranks_share_objects_mha_ranks_do_not(tmp_path: Path) -> None:
    for attention, shared in ((AttentionKind.MLA, True), (AttentionKind.MHA, False)):
        config = make_config(attention, MemLayout.LAYER_FIRST, 4, tp_size=2)
        ranks = []
        for rank in range(2):
            _, host = make_pools(config)
            fill_random_(host.kv_buffer, rank)
            file = HiCacheFile(tmp_path / attention.value, config, tp_rank=rank)
            file.register_mem_pool_host(host)
            ranks.append((file, host))
        assert ranks[0][0].batch_set_v1(KEYS[:1], torch.arange(4)) == [True]
        assert ranks[1][0].batch_exists(KEYS[:1]) == int(shared)
        if shared:
            assert ranks[1][0].batch_get_v1(KEYS[:1], torch.arange(4, 8)) == [True]
            assert_same_bytes(
                ranks[1][1].get_data_page(4), ranks[0][1].get_data_page(0), "rank 1 reads rank 0"
            )
