"""The running requests of one rank: start, chunked insert, finish, abort (sglang.md §2.12, §2.16).

``RequestCache`` is the scheduler's side of SGLang's tree cache: it matches a request's tokens, loads
back a host hit, allocates (evicting the shortfall) and locks the node it holds; a chunked prefill inserts
what it computed and moves its lock; a finished request inserts its page-aligned KV, frees duplicates and
the pages it still owns, and unlocks. It uses the tree and the tiers below it and no prefetch state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from refcache.config import HiCacheConfig
from refcache.model._controller import L3Store
from refcache.model._prefetch import PrefetchingTree
from refcache.model._tree import Key, TreeNode

__all__ = ["RequestCache"]


@dataclass(slots=True)
class _Request:
    """A running request: its slots (tree prefix first), the pages it owns and the node it locks."""

    rid: int
    tokens: tuple[int, ...]
    namespace: str | None
    slots: list[int]  # one device slot per token; only cache_unfinished_request rewrites the prefix
    protected_len: int  # slots[:protected_len] belong to the tree; only cache_unfinished_request moves it
    owned: list[int]  # slots of the device pages it owns (freed on finish/abort); only _cache_request cuts it
    lock_node: TreeNode  # the node it holds a lock on; only cache_unfinished_request moves it
    prompt_len: int | None  # how many tokens are the prompt (None: all); read only by finish_request
    inserted_len: int = 0  # the key it already inserted (D-35, ``count_hits_per_request``)


class RequestCache(PrefetchingTree):
    """The tree, its tiers and prefetches, and the running requests (see the module docstring)."""

    def __init__(self, config: HiCacheConfig, rank: int, l3: L3Store) -> None:
        PrefetchingTree.__init__(self, config, rank, l3)
        self._reset_requests()

    def _reset_requests(self) -> None:
        self.requests: dict[int, _Request] = {}

    def allocate_device(self, n: int) -> list[int] | None:
        """``alloc`` with ``evict_from_tree_cache`` of the shortfall first (D-42: of the whole size, as SGLang
        up to 0.5.16 does, under ``evict_request_size_on_admission``)."""
        needed = -(-n // self.ps) * self.ps
        if self.device.available_size() < needed:
            short = 0 if self.cfg.evict_request_size_on_admission else self.device.available_size()
            self.evict(needed - short)
        return self.device.alloc(n)

    def start_request(
        self, rid: int, tokens: tuple[int, ...], namespace: str | None, prompt_len: int | None = None
    ) -> tuple[bool, int, int, int]:
        key = self.key_of(tokens)
        values, last_node, host_hit_length, _ = self.match_prefix(key, namespace)
        device_hit = len(values)
        loaded: list[int] = []
        lock_node = last_node
        if host_hit_length > 0:
            loaded_or_none = self.load_back(last_node)
            if loaded_or_none is None:
                while lock_node.evicted:
                    assert lock_node.parent is not None
                    lock_node = lock_node.parent
            else:
                loaded = loaded_or_none
        self.inc_lock_ref(lock_node)
        prefix = values + loaded
        new_slots = self.allocate_device(len(tokens) - len(prefix))
        if new_slots is None:
            self.dec_lock_ref(lock_node)
            return False, device_hit, len(loaded), 0
        owned = _whole_pages(new_slots, self.ps)
        self.requests[rid] = _Request(
            rid, tokens, namespace, prefix + new_slots, len(prefix), owned, lock_node, prompt_len
        )
        self.prefetch_waits.pop(rid, None)  # D-55: the admission ends the request's prefetch wait
        return True, device_hit, len(loaded), len(new_slots)

    def _cache_request(self, req: _Request, *, chunked: bool) -> tuple[int, int]:
        """Insert a request's aligned KV; free duplicates. Returns (prefix_len, tokens freed)."""
        key = self.page_aligned(self.key_of(req.tokens))
        prefix_len = self.insert(
            key, req.slots[: len(key)], req.namespace, chunked=chunked, inserted_len=req.inserted_len
        )
        req.inserted_len = max(req.inserted_len, len(key))
        duplicates = req.slots[req.protected_len : prefix_len]
        if duplicates and self.cfg.free_duplicates_per_node:
            # D-49: SGLang 0.5.22 on frees each matched node's duplicates as the insert walk passes it.
            for start, end in self._node_spans(key, req.namespace, req.protected_len, prefix_len):
                self.device.free(req.slots[start:end])
        elif duplicates:
            self.device.free(duplicates)
        # What the request still owns: the pages after the aligned key (the unaligned tail).
        req.owned = _whole_pages(req.slots[len(key) :], self.ps) if len(key) < len(req.slots) else []
        return prefix_len, len(duplicates)

    def _node_spans(self, key: Key, namespace: str | None, lo: int, hi: int) -> list[tuple[int, int]]:
        """The parts of ``key[lo:hi]`` that each node on ``key``'s path holds, in key order (the path covers
        ``key[:hi]``: the key was just inserted)."""
        spans: list[tuple[int, int]] = []
        node, pos = self.root, 0
        while pos < hi:
            node = node.children[self._child_key(namespace, key, pos)]
            end = pos + len(node.key)
            if max(pos, lo) < min(end, hi):
                spans.append((max(pos, lo), min(end, hi)))
            pos = end
        return spans

    def finish_request(self, rid: int) -> tuple[int, int]:
        req = self.requests.pop(rid)
        tail: list[int] = []
        if self.cfg.tail_freed_before_insert:
            # D-65: SGLang up to 0.5.3 frees the unaligned tail before the insert, and its duplicates after.
            aligned = len(self.page_aligned(self.key_of(req.tokens)))
            tail = _whole_pages(req.slots[aligned:], self.ps) if aligned < len(req.slots) else []
            if tail:
                self.device.free(tail)
        prefix_len, freed = self._cache_request(req, chunked=False)
        if tail:  # the tail is already free: what the insert left the request owning
            assert req.owned == tail
            req.owned = []
            freed += len(req.slots) - len(self.page_aligned(self.key_of(req.tokens)))
        if self.cfg.reinsert_prompt_prefix and req.prompt_len is not None:
            self._reinsert_prompt(req)
        if req.owned:
            self.device.free(req.owned)
            freed += len(req.slots) - len(self.page_aligned(self.key_of(req.tokens)))
        self.dec_lock_ref(req.lock_node)
        return prefix_len, freed

    def _reinsert_prompt(self, req: _Request) -> None:
        """SGLang 0.5.20: insert the page-aligned prompt again when it is a proper prefix of the cached key,
        with priority + 1 and ``chunked`` (no hit counted), which splits a node at the prompt boundary
        (D-24; ``reinsert_prompt_prefix``). Every node on that path exists: nothing is allocated."""
        assert req.prompt_len is not None
        prompt = self.page_aligned(self.key_of(req.tokens[: req.prompt_len]))
        if 0 < len(prompt) < len(self.page_aligned(self.key_of(req.tokens))):
            self.insert(prompt, req.slots[: len(prompt)], req.namespace, chunked=True, priority=1)

    def cache_unfinished_request(self, rid: int) -> None:
        req = self.requests[rid]
        self._cache_request(req, chunked=True)
        if self.cfg.count_hits_per_request and self.cfg.reinsert_prompt_prefix and req.prompt_len is not None:
            self._reinsert_prompt(req)  # 0.5.23's checkpoint is the finished insert (D-35)
        key = self.page_aligned(self.key_of(req.tokens))
        values, last_node, _, _ = self.match_prefix(key, req.namespace)
        assert len(values) == len(key), "re-match after insert must cover the whole aligned key"
        req.slots[: len(key)] = values
        req.protected_len = len(key)
        self.dec_lock_ref(req.lock_node)
        self.inc_lock_ref(last_node)
        req.lock_node = last_node

    def abort_request(self, rid: int) -> None:
        req = self.requests.pop(rid)
        if req.owned:
            self.device.free(req.owned)
        self.dec_lock_ref(req.lock_node)


def _whole_pages(slots: Sequence[int], page_size: int) -> list[int]:
    """All slots of the pages that ``slots`` touch, in page order (a request owns whole pages)."""
    if page_size == 1:
        return sorted(set(slots))
    pages = sorted({s // page_size for s in slots})
    return [p * page_size + i for p in pages for i in range(page_size)]
