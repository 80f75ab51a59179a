"""The running requests of one rank on real pools: start (with the fake forward pass's KV), chunked insert,
finish, abort (sglang.md §2.12, §2.16).

``RequestCache`` is the scheduler's side of SGLang's tree cache: it matches a request's tokens, loads back
a host hit, allocates (evicting the shortfall), writes the oracle's KV for the computed tokens and checks a
device hit's KV, and locks the node it holds; a chunked prefill inserts what it computed and moves its
lock; a finished request inserts its page-aligned KV, frees duplicates and the pages it still owns, and
unlocks. It uses the tree and the tiers below it and no prefetch state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from refcache.config import HiCacheConfig
from refcache.gpu.allocator import sorted_unique
from refcache.gpu.cache_controller import HiCacheController
from refcache.gpu.hiradix_prefetch import PrefetchingTree
from refcache.gpu.hiradix_tree import EMPTY, Key, MatchResult, TreeNode
from refcache.gpu.kv_oracle import KVOracle, Picked, States

__all__ = ["Req", "RequestCache"]


@dataclass
class Req:
    """A running request (the scheduler's view)."""

    rid: int
    tokens: tuple[int, ...]
    namespace: str | None
    key: Key
    kv_indices: torch.Tensor  # one device slot per token; [:cache_protected_len] belong to the tree
    cache_protected_len: int
    owned: torch.Tensor  # slots of the device pages the request owns (freed on finish/abort)
    last_node: TreeNode  # the node it holds a lock on
    prompt_len: int | None  # how many tokens are the prompt (None: all); read only by cache_finished_req
    # The oracle's chain states and seeds of the computed positions (key position ``computed_from`` on),
    # derived once for the fake forward pass and handed to the nodes insert creates for them.
    computed_from: int = 0
    computed: tuple[States, torch.Tensor] | None = None


class RequestCache(PrefetchingTree):
    """The tree, its tiers and prefetches, and the running requests (see the module docstring)."""

    def __init__(self, config: HiCacheConfig, rank: int, controller: HiCacheController, oracle: KVOracle):
        PrefetchingTree.__init__(self, config, rank, controller, oracle)

    def _reset_requests(self) -> None:
        self.requests: dict[int, Req] = {}

    def alloc_token_slots(self, num_tokens: int) -> torch.Tensor | None:
        """Allocate device slots, evicting the shortfall from the tree first."""
        allocator = self.token_to_kv_pool_allocator
        needed = -(-num_tokens // self.page_size) * self.page_size
        if allocator.available_size() < needed:
            self.evict(needed - allocator.available_size())
        slots = allocator.alloc(num_tokens)
        return None if slots is None else slots.cpu()  # slot numbers live on the host (see Req)

    def start_request(
        self, rid: int, tokens: tuple[int, ...], namespace: str | None, prompt_len: int | None = None
    ) -> tuple[bool, int, int, int]:
        """Admit a request: match, lock, load back the host hit, allocate and compute the rest.
        Returns ``(admitted, device_hit, loaded, computed)``."""
        key = self.key_of(tokens)
        match = self.match_prefix(key, namespace)
        device_hit = match.device_indices.shape[0]  # (a tensor's len is a slow Python-level call)
        self._check_device_hit(match)
        loaded, lock_node = EMPTY, match.last_node
        if match.host_hit_length > 0:
            loaded, lock_node = self.init_load_back(match.last_node)
        self.inc_lock_ref(lock_node)
        prefix = torch.cat((match.device_indices, loaded)) if loaded.shape[0] else match.device_indices
        done = prefix.shape[0]
        new_slots = self.alloc_token_slots(len(tokens) - done)
        if new_slots is None:
            self.dec_lock_ref(lock_node)
            self.ready_to_load_host_cache()
            return False, device_hit, loaded.shape[0], 0
        computed: tuple[States, torch.Tensor] | None = None
        if self.oracle.enabled:
            # The fake forward pass: the KV of every computed token, continuing the chain of the prefix.
            if not done:
                prior = self.oracle.root_state(namespace)
            elif match.host_hit_length == 0:  # the hit is the whole path to last_node: its last state
                prior = int(self._kv_states(match.last_node)[-1])
            else:
                prior = self._path_state_at(match.last_node, done - 1)
            states, seeds = self.oracle.advance_seeds(prior, key[done:], tokens[len(key) :], position=done)
            self.oracle.write_device(self.cache_controller.mem_pool_device, new_slots, seeds)
            computed = states, seeds
        self.requests[rid] = Req(
            rid,
            tokens,
            namespace,
            key,
            torch.cat((prefix, new_slots)),
            done,
            _whole_pages(new_slots, self.page_size),
            lock_node,
            prompt_len,
            done,
            computed,
        )
        self.ready_to_load_host_cache()
        return True, device_hit, loaded.shape[0], new_slots.shape[0]

    def _check_device_hit(self, match: MatchResult) -> None:
        """Read the matched device slots (those no pending load is still writing) against the oracle."""
        n = match.device_indices.shape[0]
        if n == 0 or not self.oracle.enabled:
            return
        node = match.last_node
        while node.evicted:
            assert node.parent is not None
            node = node.parent
        check = self._path_check(node)
        assert len(check.seeds) == n, "the device hit is the path to the last non-evicted node"
        pending = self.cache_controller.pending_load_slots()
        if not pending:  # the common case: read every matched slot
            self.oracle.check_device(
                self.cache_controller.mem_pool_device, match.device_indices, check.seeds, check.what
            )
            return
        keep = [i for i, s in enumerate(match.device_indices.tolist()) if s not in pending]
        if keep:
            self.oracle.check_device(
                self.cache_controller.mem_pool_device,
                match.device_indices[keep],
                torch.as_tensor(check.seeds)[keep],
                Picked(check.what, keep),
            )

    def _cache_req(self, req: Req, chunked: bool) -> tuple[int, int]:
        """Insert a request's page-aligned KV and free its duplicates; returns (prefix_len, freed)."""
        key = self._page_aligned(req.key)
        prefix_len = self.insert(
            key,
            req.kv_indices[: len(key)],
            req.namespace,
            chunked=chunked,
            computed=None if req.computed is None else (req.computed_from, *req.computed),
        )
        freed = max(prefix_len - req.cache_protected_len, 0)  # the duplicates (tensor slices only when any)
        if freed:
            self.token_to_kv_pool_allocator.free(req.kv_indices[req.cache_protected_len : prefix_len])
        tail = len(key) < req.kv_indices.shape[0]
        req.owned = _whole_pages(req.kv_indices[len(key) :], self.page_size) if tail else EMPTY
        return prefix_len, freed

    def cache_finished_req(self, rid: int) -> tuple[int, int]:
        """Insert, free duplicates and the unaligned tail, unlock. Returns (prefix_len, freed)."""
        req = self.requests.pop(rid)
        prefix_len, freed = self._cache_req(req, chunked=False)
        if self.config.reinsert_prompt_prefix and req.prompt_len is not None:
            # SGLang 0.5.20 (D-24): the aligned prompt again, priority + 1, chunked (no hit), when it is a
            # proper prefix of the cached key; it splits a node at the prompt boundary.
            prompt = self._page_aligned(self.key_of(req.tokens[: req.prompt_len]))
            if 0 < len(prompt) < len(self._page_aligned(req.key)):
                self.insert(prompt, req.kv_indices[: len(prompt)], req.namespace, chunked=True, priority=1)
        if req.owned.shape[0]:
            self.token_to_kv_pool_allocator.free(req.owned)
            freed += req.kv_indices.shape[0] - len(self._page_aligned(req.key))
        self.dec_lock_ref(req.last_node)
        return prefix_len, freed

    def cache_unfinished_req(self, rid: int) -> None:
        """Insert the KV so far (chunked), re-match and move the lock to the new last node."""
        req = self.requests[rid]
        self._cache_req(req, chunked=True)
        key = self._page_aligned(req.key)
        match = self.match_prefix(key, req.namespace)
        assert len(match.device_indices) == len(key), "re-match after insert must cover the aligned key"
        req.kv_indices[: len(key)] = match.device_indices
        req.cache_protected_len = len(key)
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(match.last_node)
        req.last_node = match.last_node

    def abort_req(self, rid: int) -> None:
        req = self.requests.pop(rid)
        if len(req.owned):
            self.token_to_kv_pool_allocator.free(req.owned)
        self.dec_lock_ref(req.last_node)


def _whole_pages(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every slot of the pages ``slots`` touch, in page order (a request owns whole pages)."""
    slot_numbers = slots.cpu().numpy().astype(np.int64, copy=False)
    pages = sorted_unique(slot_numbers // page_size if page_size > 1 else slot_numbers)  # (sorting copies)
    if page_size > 1:
        pages = (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)).ravel()
    return torch.from_numpy(pages.astype(np.int64, copy=False))
