"""``refcache.hashing`` against the golden vectors of ``specs/golden-hashes.json``.

The vectors are computed by ``specs/gen_golden_hashes.py`` with plain ``hashlib``, written from
reference/sglang.md §4.1 independently of ``refcache.hashing``; both derivations must agree.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TypedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refcache.hashing import (
    Token,
    get_hash_str,
    page_hashes,
    storage_key,
    storage_namespace_seed,
    to_bigram,
)

SPECS = Path(__file__).resolve().parents[2] / "specs"
U32 = 2**32 - 1


class Storage(TypedDict):
    model_name: str
    mla: bool
    tp_rank: int
    tp_size: int
    keys: list[str]


class Golden(TypedDict):
    name: str
    tokens: list[int]
    page_size: int
    namespace: str | None
    bigram: bool
    namespace_seed: str | None
    keys: list[str]
    storage: Storage


def _load() -> list[Golden]:
    data: list[Golden] = json.loads((SPECS / "golden-hashes.json").read_text(encoding="utf-8"))
    return data


GOLDEN = _load()


def _key(case: Golden) -> tuple[Token, ...]:
    return to_bigram(case["tokens"]) if case["bigram"] else tuple(case["tokens"])


def test_golden_file_is_current() -> None:
    """The committed vectors are exactly what the independent generator computes."""
    spec = importlib.util.spec_from_file_location("gen_golden_hashes", SPECS / "gen_golden_hashes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rendered = module.render()
    assert isinstance(rendered, str)
    assert (SPECS / "golden-hashes.json").read_text(encoding="utf-8") == rendered, (
        "specs/golden-hashes.json is stale: run python specs/gen_golden_hashes.py"
    )


def test_golden_cases_cover_the_scheme() -> None:
    assert {c["page_size"] for c in GOLDEN} >= {1, 2, 4}
    assert any(len(_key(c)) % c["page_size"] for c in GOLDEN), "a partial last page"
    assert any(c["namespace"] is None for c in GOLDEN) and any(c["namespace"] for c in GOLDEN)
    assert any(c["bigram"] for c in GOLDEN) and any(c["bigram"] and c["namespace"] for c in GOLDEN)
    assert any(max(c["tokens"]) == U32 for c in GOLDEN), "token ids near 2**32 - 1"
    assert any(c["storage"]["mla"] for c in GOLDEN) and any(not c["storage"]["mla"] for c in GOLDEN)


@pytest.mark.parametrize("case", GOLDEN, ids=[c["name"] for c in GOLDEN])
def test_page_hashes_reproduce_golden(case: Golden) -> None:
    seed = storage_namespace_seed(case["namespace"])
    assert seed == case["namespace_seed"]
    key = _key(case)
    assert page_hashes(key, case["page_size"], seed) == case["keys"]
    assert len(case["keys"]) == -(-len(key) // case["page_size"])
    # Hashing page by page with get_hash_str gives the same chain.
    prior = seed
    for i, expected in enumerate(case["keys"]):
        prior = get_hash_str(key[i * case["page_size"] : (i + 1) * case["page_size"]], prior)
        assert prior == expected


@pytest.mark.parametrize("case", GOLDEN, ids=[c["name"] for c in GOLDEN])
def test_storage_key_reproduces_golden(case: Golden) -> None:
    s = case["storage"]
    keys = [
        storage_key(h, model_name=s["model_name"], mla=s["mla"], tp_rank=s["tp_rank"], tp_size=s["tp_size"])
        for h in case["keys"]
    ]
    assert keys == s["keys"]


def test_to_bigram() -> None:
    assert to_bigram([1, 2, 3]) == ((1, 2), (2, 3))
    assert to_bigram([7]) == ()
    assert to_bigram([]) == ()


def test_namespaced_and_plain_keys_differ() -> None:
    """Identical tokens under different namespaces never share an L3 key (sglang.md §9 #16)."""
    tokens = tuple(range(16))
    plain = page_hashes(tokens, 4, storage_namespace_seed(None))
    a = page_hashes(tokens, 4, storage_namespace_seed("lora-a"))
    b = page_hashes(tokens, 4, storage_namespace_seed("lora-b"))
    salted = page_hashes(tokens, 4, storage_namespace_seed("lora-a", "salt"))
    chains = [plain, a, b, salted]
    for i, x in enumerate(chains):
        for y in chains[i + 1 :]:
            assert not set(x) & set(y)
    assert storage_namespace_seed(None) is None and storage_namespace_seed(None, None) is None
    # The two parts are length-prefixed: moving text between them changes the seed.
    assert storage_namespace_seed("ab", "c") != storage_namespace_seed("a", "bc")
    assert storage_namespace_seed("x", None) != storage_namespace_seed(None, "x")


@settings(deadline=None)
@given(
    tokens=st.lists(st.integers(0, U32), min_size=1, max_size=24),
    page_size=st.sampled_from([1, 2, 4]),
    position=st.integers(0, 23),
    delta=st.integers(1, U32),
    namespace=st.sampled_from([None, "lora-a"]),
)
def test_changed_token_changes_every_later_page(
    tokens: list[int], page_size: int, position: int, delta: int, namespace: str | None
) -> None:
    """A page's key encodes every token before it (sglang.md §9 #17): changing token ``position``
    changes the key of its page and of every later page, and no earlier one."""
    position %= len(tokens)
    changed = list(tokens)
    changed[position] = (tokens[position] + delta) % (U32 + 1)
    seed = storage_namespace_seed(namespace)
    before = page_hashes(tokens, page_size, seed)
    after = page_hashes(changed, page_size, seed)
    page = position // page_size
    assert before[:page] == after[:page]
    assert all(x != y for x, y in zip(before[page:], after[page:], strict=True))


@settings(deadline=None)
@given(
    tokens=st.lists(st.integers(0, U32), min_size=0, max_size=20),
    page_size=st.sampled_from([1, 2, 4]),
    cut_pages=st.integers(0, 5),
)
def test_chain_continues_across_a_page_aligned_cut(tokens: list[int], page_size: int, cut_pages: int) -> None:
    """Hashing a node below its parent (continuing from the parent's last hash) equals hashing the
    whole path from the root: what the tree relies on when it hashes only a new leaf."""
    cut = min(cut_pages * page_size, len(tokens) - len(tokens) % page_size)
    head = page_hashes(tokens[:cut], page_size, None)
    tail = page_hashes(tokens[cut:], page_size, head[-1] if head else None)
    assert head + tail == page_hashes(tokens, page_size, None)


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
def test_token_ids_outside_uint32_are_rejected(bad: int) -> None:
    with pytest.raises(ValueError, match="uint32"):
        page_hashes([1, bad], 1, None)
    with pytest.raises(ValueError, match="uint32"):
        get_hash_str([(1, bad)], None)
