"""The oracle's per-node chain states and seeds (``TreeNode.kv_states`` / ``kv_seeds``), whether a node got
them from the request that computed its tokens or derived them itself, are the chain of its path: what
``KVOracle.advance`` gives from the root."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from refcache.config import HiCacheConfig, IOBackend
from refcache.gpu.driver import HiCacheImpl
from refcache.gpu.hiradix_cache import HiRadixCache, TreeNode
from refcache.hicache.ops import CheckHicacheEvents, CompleteIO, FinishRequest, IOQueue, StartRequest

# every test twice: the oracle's C path for CPU pools, then its torch path (tests/impl/conftest.py)
pytestmark = pytest.mark.usefixtures("oracle_path")


def _path(cache: HiRadixCache, node: TreeNode) -> list[TreeNode]:
    chain = []
    n: TreeNode | None = node
    while n is not None and n is not cache.root_node:
        chain.append(n)
        n = n.parent
    return chain[::-1]


def _stale_chains(cache: HiRadixCache) -> list[int]:
    """Ids of the nodes whose cached states or seeds differ from the chain derived from the root."""
    oracle, bad = cache.oracle, []
    for node in cache._nodes.values():
        if node is cache.root_node or node.kv_states is None:
            continue
        path = [t for c in _path(cache, node) for t in c.key]
        states = oracle.advance(oracle.root_state(node.namespace), path)[-len(node.key) :]
        seeds = oracle.seeds_of(states)
        if not np.array_equal(node.kv_states, states) or (
            node.kv_seeds is not None and not torch.equal(node.kv_seeds, seeds)
        ):
            bad.append(node.id)
    return bad


@pytest.mark.parametrize("page_size", [1, 4])
def test_cached_chains_are_the_paths_chains(page_size: int) -> None:
    rng = random.Random(page_size)
    config = HiCacheConfig(device_size=128, page_size=page_size, hicache_io_backend=IOBackend.DIRECT)
    prompts = [tuple(rng.randrange(1, 50) for _ in range(rng.randrange(4, 24))) for _ in range(4)]
    with HiCacheImpl(config) as impl:
        cache = impl.ranks[0]
        for rid in range(40):  # shared prompts, extensions and splits, with eviction and load-back
            tokens = rng.choice(prompts)[: rng.randrange(2, 24)] + tuple(
                rng.randrange(1, 50) for _ in range(rng.randrange(0, 12))
            )
            impl.apply(StartRequest(rid, tokens))
            impl.apply(FinishRequest(rid))
            impl.apply(CompleteIO(IOQueue.WRITE, 0, 1 << 20))
            impl.apply(CompleteIO(IOQueue.LOAD, 0, 1 << 20))
            impl.apply(CheckHicacheEvents())
        derived = [n for n in cache._nodes.values() if n.kv_states is not None and n is not cache.root_node]
        assert len(derived) > 5, "the workload caches chains on several nodes"
        assert _stale_chains(cache) == []
        victim = derived[-1]  # a chain handed over with one element off is caught
        assert victim.kv_states is not None
        victim.kv_states = victim.kv_states.copy()
        victim.kv_states[0] ^= np.uint64(1)
        assert _stale_chains(cache) == [victim.id]
