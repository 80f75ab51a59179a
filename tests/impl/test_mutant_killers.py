"""Implementation tests that kill mutants ``nox -s mutants`` found surviving (specs/mutation.md)."""

from __future__ import annotations

from .test_impl_tree import computed, make


def test_a_split_inside_a_namespace_keeps_the_suffix_reachable() -> None:
    """The new prefix node files its child under the child's namespace: a match in that namespace walks
    through the split to the whole key (the random machines rarely split under a namespace)."""
    cache, _ = make(hicache_write_policy="write_through_selective")
    a = computed(cache, 4)
    assert cache.insert((1, 2, 3, 4), a, "lora-a") == 0
    b = computed(cache, 4)
    assert cache.insert((1, 2, 9, 9), b, "lora-a") == 2
    assert cache.match_prefix((1, 2, 3, 4), "lora-a").device_indices.tolist() == a.tolist()
    assert cache.match_prefix((1, 2, 9, 9), "lora-a").device_indices.tolist() == [
        *a[:2].tolist(),
        *b[2:].tolist(),
    ]
    assert cache.match_prefix((1, 2, 3, 4), None).device_indices.tolist() == []
