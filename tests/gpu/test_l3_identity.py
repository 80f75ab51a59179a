"""The read-back identity check of L3 objects (issue #30 item 2): the object a read returns is the key
requested — its key and page format, not only a footer of the right shape.

``KVOracle.check_identity`` compares the identity a read found in the object's footer with the one the
requested key's object carries. The file backend rejects another key's object on its own; the check is what
tells when that validation is broken (the zoo's ``l3-read-checks-fixed-header-only``, which compares only
the footer's fixed part): a misplaced object, intact under its own checksum, is then returned as a hit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from quality.zoo import ZOO

from refcache.config import AttentionKind, MemLayout
from refcache.errors import CorruptionError
from refcache.gpu.faults import FaultyFileOps
from refcache.gpu.kv_oracle import KVOracle
from refcache.gpu.storage import describe_identity

from .test_storage import KEYS, L3

HEADER_ONLY = next(b for b in ZOO if b.slug == "l3-read-checks-fixed-header-only")


@pytest.fixture
def l3(tmp_path: Path) -> L3:
    store = L3(str(tmp_path), AttentionKind.MHA, MemLayout.PAGE_FIRST, 4, FaultyFileOps())
    assert store.file.batch_set_v1(KEYS[:2], store.pages(0, 1)) == [True, True]
    shutil.copyfile(store.path(KEYS[1]), store.path(KEYS[0]))  # KEYS[0]'s file now holds KEYS[1]'s object
    return store


def _read(l3: L3) -> tuple[list[bool], list[bytes]]:
    found: list[bytes] = []
    return l3.file.batch_get_v1(KEYS[:1], l3.pages(4), found), found


def test_a_sound_read_returns_the_identity_requested(tmp_path: Path) -> None:
    store = L3(str(tmp_path), AttentionKind.MHA, MemLayout.PAGE_FIRST, 4, FaultyFileOps())
    assert store.file.batch_set_v1(KEYS[:1], store.pages(0)) == [True]
    found: list[bytes] = []
    assert store.file.batch_get_v1(KEYS[:1], store.pages(4), found) == [True]
    assert found == [store.file.identity(KEYS[0])]
    KVOracle(store.config, 0).check_identity(found, [store.file.identity(KEYS[0])], ["page 0"])


def test_the_backend_rejects_a_misplaced_object(l3: L3) -> None:
    assert _read(l3) == ([False], [])


def test_identity_check_catches_a_read_that_validates_only_the_fixed_footer(l3: L3) -> None:
    with HEADER_ONLY.applied():
        hits, found = _read(l3)
    assert hits == [True]  # the broken read returns another key's object as the page
    with pytest.raises(CorruptionError, match=f"holds key '{KEYS[1]}.*expected key '{KEYS[0]}"):
        KVOracle(l3.config, 0).check_identity(found, [l3.file.identity(KEYS[0])], ["page 0"])


def test_identity_check_names_another_page_format(l3: L3) -> None:
    wrong = l3.file.identity(KEYS[0]).replace(b"page_first", b"layer_first")
    assert "layer_first" in describe_identity(wrong)
    with pytest.raises(CorruptionError, match="page format"):
        KVOracle(l3.config, 0).check_identity([wrong], [l3.file.identity(KEYS[0])], ["page 0"])
    KVOracle(l3.config, 0, mode="off").check_identity([wrong], [l3.file.identity(KEYS[0])], ["page 0"])
