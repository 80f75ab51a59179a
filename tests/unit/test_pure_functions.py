"""The model's pure specification functions as properties, and the host allocator's double-free check.

Written for mutants ``nox -s mutants`` found surviving (specs/mutation.md lists them).

The specification functions of ``refcache.model._pure`` (``split_pages``, ``chain``,
``chain_is_prefix_closed``, ``eviction_before``) state properties of code written inline elsewhere; only
CrossHair (``nox -s contracts``) checked them, so no pytest test reached them. Here their contracts run
as Hypothesis properties, with a few exact values that pin the arithmetic.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refcache.errors import UsageError
from refcache.model._pools import HostAllocator
from refcache.model._pure import chain, chain_is_prefix_closed, eviction_before, split_pages

small = st.integers(0, 9)


def _step(prior: int, page: tuple[int, ...]) -> int:
    return prior * 1000 + sum(page) + len(page)


def test_chain_exact_values() -> None:
    assert chain((), 2, 5, _step) == []
    assert chain((1, 2, 3), 2, 5, _step) == [5005, 5005 * 1000 + 4]  # (1, 2) then the partial page (3,)
    assert chain((4,), 1, 0, _step) == [5]


@given(st.lists(small, max_size=12), st.integers(1, 4), st.integers(0, 3))
def test_chain_has_one_hash_per_started_page_and_continues_from_a_cut(
    tokens: list[int], page_size: int, cut_pages: int
) -> None:
    out = chain(tokens, page_size, 1, _step)
    assert len(out) == -(-len(tokens) // page_size)
    cut = min(cut_pages * page_size, len(tokens) - len(tokens) % page_size)
    head = chain(tokens[:cut], page_size, 1, _step)
    assert head + chain(tokens[cut:], page_size, head[-1] if head else 1, _step) == out


@given(st.lists(small, max_size=12), st.integers(1, 4), st.integers(0, 4))
def test_chain_is_prefix_closed_holds(tokens: list[int], page_size: int, cut_pages: int) -> None:
    if cut_pages * page_size <= len(tokens):
        assert chain_is_prefix_closed(tuple(tokens), cut_pages, page_size)


def test_chain_is_prefix_closed_exact_cases() -> None:
    assert chain_is_prefix_closed((1, 2, 3, 4), 0, 2)  # a cut before the first page continues from 1
    assert chain_is_prefix_closed((1, 2, 3, 4), 1, 2)
    assert chain_is_prefix_closed((1, 2, 3), 1, 2)  # and a partial last page


def test_split_pages_exact() -> None:
    assert split_pages((10, 11, 12), 2, 1) == ((10, 11), (12,))
    assert split_pages((10, 11, 12), 4, 2) == ((10, 11), (12,))
    assert split_pages([10, 11], 2, 2) == ((10,), (11,))


@given(st.lists(st.integers(), min_size=2, max_size=8), st.integers(1, 4), st.data())
def test_split_pages_contract(hashes: list[int], page_size: int, data: st.DataObject) -> None:
    pages = data.draw(st.integers(1, len(hashes) - 1))
    head, tail = split_pages(hashes, pages * page_size, page_size)
    assert head + tail == tuple(hashes) and len(head) == pages


@given(st.tuples(small, small), st.integers(0, 5), st.tuples(small, small), st.integers(0, 5))
def test_eviction_before_is_priority_then_age(
    a: tuple[int, int], a_id: int, b: tuple[int, int], b_id: int
) -> None:
    if a_id != b_id:
        assert eviction_before(a, a_id, b, b_id) == ((*a, a_id) < (*b, b_id))
        assert eviction_before(a, a_id, b, b_id) != eviction_before(b, b_id, a, a_id)


def test_eviction_before_exact() -> None:
    assert eviction_before((1, 5), 9, (2, 0), 0)  # priority first
    assert eviction_before((1, 5), 3, (1, 5), 4)  # the older node on ties
    assert not eviction_before((1, 5), 4, (1, 5), 3)
    assert not eviction_before((1, 6), 0, (1, 5), 1)


def test_host_double_free_raises_and_changes_nothing() -> None:
    """Both halves of the double-free check: a slot listed twice, and a slot already free."""
    host = HostAllocator(8, 2)
    slots = host.alloc(4)
    assert slots is not None
    before = host.free_slots()
    with pytest.raises(UsageError):
        host.free([slots[0], slots[0]])  # listed twice, not yet free
    with pytest.raises(UsageError):
        host.free([before[0]])  # already free, listed once
    assert host.free_slots() == before
    host.free(slots)
    with pytest.raises(UsageError):
        host.free(slots[:2])  # freed slots are marked free: a second free is caught
