"""L3 directory hygiene (#30, item 3): every file in the L3 directory is a published object or a write in
flight. A failed write that leaves its temporary file behind breaks no other check (reads and key listings
never look at such names), so the implementation checks its directory at every snapshot; a planted
version of that bug is caught there, and only there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from quality.zoo import Edit, _patched, _resolve

from refcache.check.harness import Divergence, Harness
from refcache.config import HiCacheConfig, IOBackend, WritePolicy
from refcache.gpu.driver import HiCacheImpl
from refcache.gpu.storage import stray_files
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CompleteIO,
    FaultKind,
    FinishRequest,
    IOQueue,
    Op,
    StartRequest,
    StorageFault,
)
from refcache.model import HiCacheModel
from refcache.systems import HiCacheSystem, OpenSystems

CONFIG = HiCacheConfig(
    device_size=32,
    hicache_ratio=2.0,
    page_size=2,
    hicache_storage_backend="file",
    hicache_write_policy=WritePolicy.WRITE_THROUGH,
    hicache_io_backend=IOBackend.DIRECT,
)
# A backup whose publishing rename fails: the write fails, and its temporary file must go with it.
FAILED_BACKUP: tuple[Op, ...] = (
    StorageFault(FaultKind.FAIL_PUBLISH, 0, 0),
    StartRequest(0, tuple(range(1, 9))),
    FinishRequest(0),
    CompleteIO(IOQueue.WRITE),
    CheckHicacheEvents(),
    CompleteIO(IOQueue.BACKUP),
    CheckHicacheEvents(),
)
# The planted bug: a failed write no longer removes its temporary file.
LEAVES_TEMP = Edit(
    "refcache.gpu.storage:HiCacheFile._write_tmp",
    "            with contextlib.suppress(OSError):\n                self.ops.unlink(tmp)\n",
    "            pass\n",
)


def _replay(ops: tuple[Op, ...]) -> None:
    opened: dict[str, HiCacheSystem] = {"model": HiCacheModel(CONFIG), "impl": HiCacheImpl(CONFIG)}
    with OpenSystems(opened) as systems:
        harness = Harness(CONFIG, systems, family=HICACHE, write_trace=False)
        for op in ops:
            harness.step(op)


@pytest.fixture
def leaves_temp(monkeypatch: pytest.MonkeyPatch) -> None:
    owner, name, original = _resolve(LEAVES_TEMP.target)
    monkeypatch.setattr(owner, name, _patched("leaves-temp", original, [LEAVES_TEMP]))


def test_a_failed_backup_leaves_a_clean_directory() -> None:
    _replay(FAILED_BACKUP)


def test_a_temporary_file_left_by_a_failed_write_is_caught(leaves_temp: None) -> None:
    with pytest.raises(Divergence) as caught:
        _replay(FAILED_BACKUP)
    assert caught.value.kind == "impl crashed" and caught.value.step == 6  # right after the failed backup
    assert "neither a published object nor a write in flight" in str(caught.value)


def test_only_the_new_check_sees_it(leaves_temp: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the directory check, the same trace passes every other check: the bug was invisible."""
    monkeypatch.setattr(HiCacheImpl, "_check_l3_directory", lambda self: None)
    _replay(FAILED_BACKUP)


def test_stray_files_names_what_is_neither_published_nor_in_flight(tmp_path: Path) -> None:
    published = "ab" * 32 + "_refcache_0_1.bin"
    (tmp_path / published).write_bytes(b"x")
    (tmp_path / f".{published[:-4]}.123-abc-0.tmp").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("x")
    assert stray_files(tmp_path, []) == [f".{published[:-4]}.123-abc-0.tmp", "notes.txt"]
    os.remove(tmp_path / "notes.txt")
    (tmp_path / f".{published[:-4]}.123-abc-0.tmp").unlink()
    assert stray_files(tmp_path, []) == []


def test_a_write_in_flight_is_not_stray(tmp_path: Path) -> None:
    """Seen from inside a write (the file operations' ``writev``), its temporary file is in flight, not
    stray; once the write is published, only the object is there."""
    import torch

    from refcache.gpu.storage import FileOps, HiCacheFile

    seen: list[list[str]] = []

    class Watching(FileOps):
        def writev(self, fd: int, buffers: object) -> int:
            seen.append(stray_files(tmp_path, [store]))
            assert any(name.endswith(".tmp") for name in os.listdir(tmp_path))  # it is there, in flight
            return super().writev(fd, buffers)  # type: ignore[arg-type]

    config = HiCacheConfig(page_size=2, hicache_storage_backend="file")
    store = HiCacheFile(tmp_path, config, 0, Watching())
    page = torch.zeros(store.page_bytes, dtype=torch.uint8)
    assert store.set("cd" * 32, page)
    assert seen and all(found == [] for found in seen)
    assert stray_files(tmp_path, [store]) == [] and len(os.listdir(tmp_path)) == 1
