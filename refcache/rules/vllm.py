"""The vLLM family's checking side: what its random machine draws, the situations its ledger counts, and its
registration (``CHECKS``, found by ``refcache.check.families.FAMILIES``).

``RULES`` (``refcache.check.machine.Rules``) is what the family's machine
(``refcache.check.machine.family_machine``) draws: registry systems of the vLLM family (``"vllm-model"``,
``"vllm"``) get random sequences of ``refcache.vllm.ops`` operations through the differential ``Harness``:
every step's outcomes and snapshots are compared and every vLLM invariant is checked. Capacities are a few
blocks and chunks (``vllm_configs``) so that lazy eviction, refused admissions, offload eviction and failed
stores happen within a few steps; prompts reuse earlier prompts' prefixes cut near block boundaries (±1
token), and a few requests carry a LoRA adapter or a cache salt of the same name. ``VLLM_SITUATIONS`` (the CPU
offload manager's edge states when a store needs room, recognised by ``VllmSituationTracker``) is what the
ledger counts beside the outcomes; ``vllm_coverage_report`` prints it.

``VllmModelMachine`` (the model alone, torch-free) runs in the default test session;
``VllmDifferentialMachine`` (model and vLLM) runs under ``nox -s vllm``. Both are built by
``refcache.check.machine.build``, so their module is ``refcache.check.machine`` wherever they are named: their
derandomized samples depend on the class name only, and moving these rules here from
``refcache.check.vllm_machines`` left them as they were.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Final

from hypothesis import strategies as st

from refcache.check.coverage import Coverage, ledger_report
from refcache.check.families import FamilyChecks
from refcache.check.harness import expect
from refcache.check.machine import Draws, Rules, RulesMachine, family_machine
from refcache.config import EvictionPolicy, HiCacheConfig
from refcache.errors import RefcacheError
from refcache.vllm.config import OffloadPolicy, VllmConfig
from refcache.vllm.family import FAMILY as VLLM
from refcache.vllm.ops import (
    Admit,
    AdmitResult,
    CompleteLoad,
    CompleteStore,
    Decode,
    DecodeResult,
    EvictBlocks,
    Free,
    HitResult,
    Load,
    LoadResult,
    Lookup,
    ResetPrefixCache,
    Store,
    StoreResult,
    TakeEvents,
    VllmObservation,
    VllmOp,
)
from refcache.vllm.snapshot import VllmSnapshot

__all__ = [
    "CHECKS",
    "KINDS",
    "KIND_OPS",
    "RULES",
    "VLLM_SITUATIONS",
    "VllmDifferentialMachine",
    "VllmDraws",
    "VllmModelMachine",
    "VllmSituationTracker",
    "vllm_configs",
    "vllm_coverage_report",
]


@st.composite
def vllm_configs(draw: st.DrawFn) -> HiCacheConfig:
    """Small vLLM configurations: block size 1, 2 or 4, one or two full-attention KV cache groups
    (``layer_num``), 3 to 8 usable blocks per group, an offload manager of about one more chunk than
    blocks, or about 1.5 times as many, LRU (``lru``) or ARC (``lfu``)."""
    page_size = draw(st.sampled_from((1, 2, 4)), label="block_size")
    blocks = draw(st.integers(3, 8), label="usable_blocks")
    ratio = draw(st.sampled_from((1.0, 1.5)), label="hicache_ratio")
    policy = draw(st.sampled_from((EvictionPolicy.LRU, EvictionPolicy.LFU)), label="policy")
    groups = draw(st.sampled_from((1, 2)), label="kv_groups")
    return HiCacheConfig(
        page_size=page_size,
        device_size=page_size * blocks * groups,
        hicache_ratio=ratio,
        radix_eviction_policy=policy,
        layer_num=groups,
    )


# The operation kinds a step draws from, with their weights (one rule, as in refcache.check.machines). The
# order is part of every derandomized run: append new kinds at the end.
KINDS: Final[Mapping[str, int]] = {
    "take_events": 2, "lookup": 1, "admit": 5, "decode": 4, "free": 3, "evict_blocks": 1, "reset": 1,
    "store": 3, "complete_store": 3, "fail_store": 1, "load": 2, "complete_load": 2, "resume": 3,
    "offload_pressure": 3,
}  # fmt: skip

KIND_OPS: Final[Mapping[str, frozenset[type[VllmOp]]]] = {
    "take_events": frozenset({TakeEvents}), "lookup": frozenset({Lookup}), "admit": frozenset({Admit}),
    "decode": frozenset({Decode}), "free": frozenset({Free}), "evict_blocks": frozenset({EvictBlocks}),
    "reset": frozenset({ResetPrefixCache}), "store": frozenset({Store}), "complete_store": frozenset({CompleteStore}),
    "fail_store": frozenset({CompleteStore}), "load": frozenset({Load}), "complete_load": frozenset({CompleteLoad}),
    "resume": frozenset({Admit}),
    "offload_pressure": frozenset({Admit, CompleteStore, Decode, Free, Store}),
}  # fmt: skip
"""The operations each kind applies: a machine over systems that answer only some (``SystemEntry.answers``)
draws only the kinds whose operations they all answer, and ``run`` refuses any other."""

_NAMESPACES: Final = ((None, None),) * 4 + (("x", None), (None, "x"))


VLLM_SITUATIONS: Final[Mapping[str, str]] = {
    "store-evicts-beside-own-chunks": "a store evicts while chunks it offers again are ready in the manager "
    "(it must not evict them: issue #30 item 7)",
    "store-refused-by-own-chunks": "a store is refused although ready chunks exist: every one is a chunk it "
    "offers again (the count of evictable chunks fits, the policy finds too few)",
    "arc-evicts-t1-empty": "ARC evicts with T1 (seen once) empty: the victims come from T2",
    "arc-evicts-t2-empty": "ARC evicts with T2 (reused) empty",
    "arc-evicts-t1-full": "ARC evicts with every chunk in T1",
    "arc-evicts-t2-full": "ARC evicts with every chunk in T2",
    "arc-evicts-b1-empty": "ARC evicts with ghost list B1 empty",
    "arc-evicts-b2-empty": "ARC evicts with ghost list B2 empty",
    "arc-evicts-b1-full": "ARC evicts with ghost list B1 at capacity (its oldest ghost must go)",
    "arc-evicts-b2-full": "ARC evicts with ghost list B2 at capacity (its oldest ghost must go)",
}
"""The situations of vLLM's ledger (``VllmSituationTracker``): the CPU offload manager's edge states at the
moment a store needs room."""


class VllmSituationTracker:
    """Recognises ``VLLM_SITUATIONS`` from a vLLM-family step: the operation, its outcome and the reference
    system's snapshots before and after; ``arc`` says the offload manager runs
    ARC (the policy's lists are empty under LRU but for its recency order)."""

    def __init__(self, arc: bool) -> None:
        self.arc = arc

    def observe(
        self, op: VllmOp, outcome: VllmObservation | Exception, before: VllmSnapshot, after: VllmSnapshot
    ) -> Iterator[str]:
        off = before.offload
        if not isinstance(op, Store) or not isinstance(outcome, StoreResult) or off is None:
            return
        request = next((r for r in before.requests if r.rid == op.rid), None)
        if request is None:
            return
        offered = set(request.keys[: request.num_computed // before.block_size])
        ready = {c.key for c in off.chunks if c.ref_cnt == 0}
        if outcome.evicted and ready & offered:
            yield "store-evicts-beside-own-chunks"
        if not outcome.accepted and ready and ready <= offered:
            yield "store-refused-by-own-chunks"
        if outcome.evicted and self.arc:
            t1, t2, (b1, b2) = off.recency, off.frequent, off.ghosts
            for name, size in (("t1", len(t1)), ("t2", len(t2)), ("b1", len(b1)), ("b2", len(b2))):
                if size == 0:
                    yield f"arc-evicts-{name}-empty"
                elif size >= off.capacity:
                    yield f"arc-evicts-{name}-full"


class VllmDraws(Draws[VllmOp, VllmObservation, VllmSnapshot]):
    """One example's draws over the vLLM family (``RULES``): the prompts so far, the running and the freed
    requests, and the situation tracker of ``VLLM_SITUATIONS``."""

    def __init__(
        self, machine: RulesMachine[VllmOp, VllmObservation, VllmSnapshot], config: HiCacheConfig
    ) -> None:
        super().__init__(machine, config)
        self.vconfig = VllmConfig.of(config)
        self.prompts: list[tuple[int, ...]] = []
        self.running: list[int] = []
        self.admitted: dict[
            int, tuple[tuple[int, ...], str | None, str | None]
        ] = {}  # rid -> prompt, namespace
        self.freed: list[tuple[tuple[int, ...], str | None, str | None]] = []  # prompts of freed requests
        self.next_rid = 0
        self.tracker = VllmSituationTracker(self.vconfig.offload_policy is OffloadPolicy.ARC)

    def observe(
        self, op: VllmOp, outcome: VllmObservation | RefcacheError, before: VllmSnapshot, after: VllmSnapshot
    ) -> Iterator[str]:
        return self.tracker.observe(op, outcome, before, after)

    def _tokens(self, data: st.DataObject) -> tuple[int, ...]:
        bs = self.vconfig.block_size
        reuse: bool = data.draw(st.booleans(), label="reuse") if self.prompts else False
        if reuse:
            base = data.draw(st.sampled_from(self.prompts), label="base")
            blocks = data.draw(st.integers(0, len(base) // bs), label="blocks")
            cut = max(
                0, min(len(base), blocks * bs + data.draw(st.sampled_from((-1, 0, 0, 1)), label="shift"))
            )
            prefix = base[:cut]
        else:
            prefix = ()
        tail = data.draw(
            st.lists(st.integers(0, 3), min_size=0 if prefix else 1, max_size=3 * bs), label="tail"
        )
        return prefix + tuple(tail)

    def step(self, data: st.DataObject) -> None:
        kind = self.draw_kind(data)
        if kind in ("decode", "free", "store", "load") and not self.running:
            kind = "admit"
        if kind == "complete_store" and not self.snapshot_pending(stores=True):
            kind = "store" if self.running else "admit"
        if kind == "fail_store" and not self.snapshot_pending(stores=True):
            kind = "take_events"
        if kind == "complete_load" and not self.snapshot_pending(stores=False):
            kind = "load" if self.running else "admit"
        if kind == "resume" and not self.freed:
            kind = "admit"
        if kind not in self.kinds:
            return  # redirected to a kind the systems do not answer (SystemEntry.answers): nothing this step
        if kind == "offload_pressure":
            self.offload_pressure(data)
        elif kind == "resume":
            # A freed request's conversation continues: its prompt again plus new tokens, everything after
            # the local prefix hit supplied by a KV connector (the #33775 shape: the hit blocks of every
            # group are free cached blocks, and the external blocks are allocated next).
            prompt, lora, salt = data.draw(st.sampled_from(self.freed), label="freed")
            tail = data.draw(st.lists(st.integers(0, 3), max_size=3 * self.vconfig.block_size), label="tail")
            self._admit(prompt + tuple(tail), lora, salt, 4 * self.vconfig.block_size)
        elif kind == "admit":
            tokens = self._tokens(data)
            lora, salt = data.draw(st.sampled_from(_NAMESPACES), label="namespace")
            bs = self.vconfig.block_size
            external = data.draw(st.sampled_from((0, 0, bs, bs + 1, 2 * bs, 4 * bs)), label="external")
            self._admit(tokens, lora, salt, external)
        elif kind == "lookup":
            tokens = self._tokens(data)
            lora, salt = data.draw(st.sampled_from(_NAMESPACES), label="namespace")
            self.run(Lookup(tokens, lora, salt))
        elif kind == "decode":
            rid = data.draw(st.sampled_from(self.running), label="rid")
            self.run(Decode(rid, data.draw(st.integers(0, 3), label="token")))
        elif kind == "free":
            self._free(data.draw(st.sampled_from(self.running), label="rid"))
        elif kind == "evict_blocks":
            ids = data.draw(
                st.lists(st.integers(0, self.vconfig.num_blocks - 1), min_size=1, max_size=3), label="ids"
            )
            self.run(EvictBlocks(tuple(ids)))
        elif kind == "reset":
            self.run(ResetPrefixCache())
        elif kind == "take_events":
            self.run(TakeEvents())
        elif kind == "store":
            self.run(Store(data.draw(st.sampled_from(self.running), label="rid")))
        elif kind in ("complete_store", "fail_store"):
            self.run(CompleteStore(kind == "complete_store"))
        elif kind == "load":
            self.run(Load(data.draw(st.sampled_from(self.running), label="rid")))
        else:
            self.run(CompleteLoad())

    def _admit(
        self, tokens: tuple[int, ...], lora: str | None, salt: str | None, external: int
    ) -> int | None:
        """Admit a request; its id when it runs."""
        rid = self.next_rid
        self.next_rid += 1
        self.prompts.append(tokens)
        if expect(self.run(Admit(rid, tokens, lora, salt, external)), AdmitResult).admitted:
            self.running.append(rid)
            self.admitted[rid] = (tokens, lora, salt)
            return rid
        return None

    def _free(self, rid: int) -> None:
        self.run(Free(rid))
        self.running.remove(rid)
        self.freed.append(self.admitted.pop(rid))

    def _fresh(self, blocks: int) -> int | None:
        """Admit a request of ``blocks`` full blocks of tokens no earlier request has (at most what the
        free queue can give every group); its id when it runs."""
        snap = self.snapshot()
        blocks = min(blocks, snap.num_free // self.vconfig.kv_groups - 1)
        if blocks < 1:
            return None
        base = 100 + 50 * self.next_rid
        return self._admit(tuple(range(base, base + blocks * self.vconfig.block_size)), None, None, 0)

    def _drain_stores(self) -> None:
        while self.snapshot_pending(stores=True):
            self.run(CompleteStore(True))

    def offload_pressure(self, data: st.DataObject) -> None:
        """The offload manager full when a store needs room (issue #30 item 7). Fresh requests are stored,
        most run again by a twin that offers the ready chunks once more (ARC promotes them to T2 when the
        twin finishes: T1 empties, and later victims come from T2 into B2; the others go from T1 to B1).
        Then a request's chunks are stored, fresh requests fill the manager (their stores completed, or left
        write-pending until the request's own ready chunks are the only evictable ones), and the request
        grows by a block and offers every chunk again: the store evicts beside its own ready chunks, or is
        refused when only they could go."""
        if self.snapshot().offload is None:
            return
        self._drain_stores()
        for _ in range(data.draw(st.integers(0, 6), label="promotions")):
            first = self._fresh(data.draw(st.integers(1, 3), label="blocks"))
            if first is None:
                break
            prompt = self.admitted[first]
            self.run(Store(first))
            self._drain_stores()
            self._free(first)
            if data.draw(st.sampled_from((True, True, True, False)), label="twin_run"):
                twin = self._admit(*prompt, 0)
                if twin is not None:
                    self.run(Store(twin))
                    self._drain_stores()
                    self._free(twin)
        own = self._fresh(data.draw(st.integers(1, 3), label="own_blocks"))
        if own is None:
            return
        self.run(Store(own))
        self._drain_stores()
        mine = {k for r in self.snapshot().requests if r.rid == own for k in r.keys}
        pending = data.draw(st.booleans(), label="fill_pending")
        for _ in range(8 if pending else data.draw(st.integers(1, 3), label="fillers")):
            off = self.snapshot().offload
            assert off is not None
            room = off.capacity - off.num_allocated + len(off.free_list)
            others = sum(1 for c in off.chunks if c.ref_cnt == 0 and c.key not in mine)
            if pending and room + others <= 0:
                break  # the request's own ready chunks are the only evictable ones, and no room is left
            filler = self._fresh(room + others if pending else data.draw(st.integers(1, 3), label="fill"))
            if filler is None:
                break
            self.run(Store(filler))
            if not pending:
                self._drain_stores()
            self._free(filler)
        for _ in range(self.vconfig.block_size):
            self.run(Decode(own, data.draw(st.integers(0, 3), label="token")))
        self.run(Store(own))

    def snapshot_pending(self, *, stores: bool) -> bool:
        off = self.snapshot().offload
        return off is not None and bool(off.pending_stores if stores else off.pending_loads)


def _detail(result: VllmObservation) -> str:
    """The outcome's class, for the coverage ledger."""
    match result:
        case AdmitResult(admitted, hit, _):
            return ":full" if not admitted else (":hit" if hit else ":miss")
        case DecodeResult(scheduled, _):
            return "" if scheduled else ":full"
        case HitResult(hit):
            return ":hit" if hit else ":miss"
        case StoreResult(accepted, stored, evicted):
            return (
                ":refused"
                if not accepted
                else (":evicted" if evicted else (":stored" if stored else ":present"))
            )
        case LoadResult(_, loading):
            return ":hit" if loading else ":miss"
        case _:
            return ""


RULES: Final = Rules[VllmOp, VllmObservation, VllmSnapshot](
    KINDS, KIND_OPS, vllm_configs(), _detail, VllmDraws
)
"""What the vLLM family's machine draws and counts (``refcache.check.machine.Rules``)."""

VllmModelMachine: Final = family_machine(VLLM, RULES, ("vllm-model",), name="VllmModelMachine")
VllmDifferentialMachine: Final = family_machine(
    VLLM, RULES, ("vllm-model", "vllm"), name="VllmDifferentialMachine"
)


def vllm_coverage_report(cov: Coverage) -> str:
    """The vLLM family's ledger: its situations (``VLLM_SITUATIONS``) and outcomes; what was never reached."""
    return ledger_report(cov, VLLM_SITUATIONS)


CHECKS: Final = FamilyChecks.from_rules(VLLM, RULES, vllm_coverage_report)
"""The vLLM family's checking side, as ``refcache.check.families.FAMILIES`` finds it."""
