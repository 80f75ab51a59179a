"""The vLLM bug zoo: real scheduler-side vLLM bugs, re-introduced one at a time as source patches on vLLM
0.33's own functions (the ``Edit`` mechanism of ``tests/quality/zoo.py``: an exact snippet of one
function's source replaced and the function recompiled in its module, for the duration of ``applied()``).

Each bug is a ``quality.zoo.Bug`` of the vLLM family: ``hunt`` (the zoo's one, for every family) runs the
machine the vLLM session runs (``VllmDifferentialMachine``: the same class name, hence the same derandomized
sample, at the default differential budget) against patched vLLM, counts the examples up to the first
failure with a coverage ledger, and shrinks that example's trace under the vLLM family. ``specs/vllm-zoo.md`` tabulates the results.
"""

from __future__ import annotations

from quality.zoo import Bug, Edit, hunt

__all__ = ["ZOO", "hunt", "vllm_bug"]

SYSTEMS = ("vllm-model", "vllm")
KV_UTILS = "vllm.v1.core.kv_cache_utils"
POOL = "vllm.v1.core.block_pool:BlockPool"
SINGLE = "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager"
OFFLOAD = "vllm.v1.kv_offload.cpu.manager:CPUOffloadingManager"
COORDINATOR = "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator"
ARC = "vllm.v1.kv_offload.cpu.policies.arc:ARCCachePolicy"


def vllm_bug(
    slug: str, what: str, upstream: str, edits: tuple[Edit, ...], caught_by: str, max_trace_ops: int = 12
) -> Bug:
    """A zoo bug of vLLM's own code, hunted by the machine the vLLM session runs (``VllmDifferentialMachine``)."""
    return Bug(
        slug,
        what,
        upstream,
        edits,
        caught_by,
        max_trace_ops=max_trace_ops,
        family="vllm",
        systems=SYSTEMS,
        machine_name="VllmDifferentialMachine",
    )


ZOO: tuple[Bug, ...] = (
    vllm_bug(
        "double-free",
        "a request's first block is freed twice: ref_cnt goes to -1 while the block stays queued once",
        "no upstream guard in free_blocks; field reports vllm-ascend #15990, guards vllm-ascend PR #14301 and "
        "UCM PR #1053; the issue's note",
        (
            Edit(
                f"{SINGLE}.pop_blocks_for_free",
                "return trim_null_head(req_blocks)",
                "return trim_null_head(req_blocks + req_blocks[:1])",
            ),
        ),
        "snapshots differ",
    ),
    vllm_bug(
        "touch-keeps-queued",
        "a prefix hit on a free cached block does not unlink it from the free queue: the block is both in a "
        "table and queued (the corruption the #15990 / PR #14301 guards prevent)",
        "vllm-ascend #15990 (symptom), PR #14301",
        (Edit(f"{POOL}.touch", "if block.ref_cnt == 0:\n", "if block.ref_cnt == 0 and False:\n"),),
        "Admit(rid=",
    ),
    vllm_bug(
        "lora-salt-one-domain",
        "LoRA name and cache_salt share one hash domain (the LoRA key is written as a salt key): a salt 'x' "
        "request hits a LoRA 'x' block",
        "issue #44701, fixed by PR #44706 (tagged extra keys)",
        (
            Edit(
                f"{KV_UTILS}:_gen_lora_extra_hash_keys",
                'return [("lora", lora_request.lora_name, lora_request.lora_path)]',
                'return [("cache_salt", lora_request.lora_name)]',
            ),
        ),
        "differ",
    ),
    vllm_bug(
        "recache-hit-blocks",
        "the cached-block count is not set after a prefix hit, so cache_full_blocks hashes the hit blocks again",
        "PR #14073 (only cache blocks that are not in the prefix cache)",
        (
            Edit(
                f"{SINGLE}.add_local_computed_blocks",
                "self.num_cached_block[request_id] = len(req_blocks)",
                "self.num_cached_block[request_id] = 0",
            ),
        ),
        "vllm crashed",
    ),
    vllm_bug(
        "queue-counter-drift",
        "the free queue's counter is not updated where the list is (remove() forgets to decrement)",
        "the class of PR #24228 (num_free_blocks updated before its check in popleft)",
        (
            Edit(
                "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue.remove",
                "self.num_free_blocks -= 1",
                "pass",
            ),
        ),
        "snapshots differ",
    ),
    vllm_bug(
        "group-evicts-group-hit",
        "one KV cache group's blocks for external tokens are allocated before the next group's prefix hit is "
        "touched, so get_new_blocks can hand out (and strip) that group's just-hit free cached block",
        "issue #33775, fixed by PR #44409 (two-phase allocate_new_computed_blocks); symptom #43884",
        (
            Edit(
                f"{COORDINATOR}.allocate_new_computed_blocks",
                "            )\n"
                "        if num_external_computed_tokens > 0:\n"
                "            for i, manager in enumerate(self.single_type_managers):\n"
                "                manager.allocate_external_computed_blocks(",
                "            )\n"
                "            if num_external_computed_tokens > 0:\n"
                "                manager.allocate_external_computed_blocks(",
            ),
        ),
        "differ",
    ),
    vllm_bug(
        "failed-store-leaks-chunk",
        "complete_store(success=False) drops the chunk from the policy but never frees its slot",
        "no upstream fix pinned: the failure path of per-job store completion (PR #39186)",
        (Edit(f"{OFFLOAD}.complete_store", "self._free_chunk(chunk)", "pass"),),
        "",
    ),
    vllm_bug(
        "store-evicts-own-offer",
        "prepare_store protects only the keys it is about to store from its own eviction, not the ready "
        "chunks it offers again, so a store that needs room can evict a chunk of its own offer",
        "no upstream fix pinned: the rule the 0.33 comment states ('a chunk that was already stored must "
        "remain in the cache after this call'); issue #30 item 7 (a store competing with its own chunks)",
        (Edit(f"{OFFLOAD}.prepare_store", "protected = set(keys)", "protected = set(keys_to_store)"),),
        "differ",
        max_trace_ops=24,  # filling the manager takes most of them (STORE-KEEPS-OFFER on vLLM alone)
    ),
    vllm_bug(
        "arc-ghosts-untrimmed",
        "ARC's eviction never trims its ghost lists to the cache capacity, so B1 / B2 grow without bound",
        "no upstream fix pinned: an invented mutant of ARCCachePolicy.evict's trim (issue #30 item 7: ARC "
        "with a ghost list full at the moment of eviction)",
        (Edit(f"{ARC}.evict", "ghost.popitem(last=False)", "pass"),),
        "differ",
        max_trace_ops=16,  # capacity + 1 evictions from T1 (OFFLOAD-POLICY on vLLM alone)
    ),
)
