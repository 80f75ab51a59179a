"""The LMCache family's random draws: the LMCache reference model and LMCache's own code, step by step.

``RULES`` (``refcache.check.machine.Rules``, registered on the family's ``FamilyChecks``) is what the
family's machine (``refcache.check.machine.family_machine``) draws: registry systems of the LMCache family
(``"lmcache-model"``, ``"lmcache"``) get random sequences of ``refcache.lmcache.ops`` operations through the
differential ``Harness``: every step's outcomes and snapshots are compared and every LMCache invariant is
checked. Capacities are a few chunks per tier
(``lmcache_configs``) so that CPU eviction under every policy, stores cut short, disk eviction and refused
writes, promotions and prefetches happen within a few steps; token sequences reuse earlier ones' prefixes cut
at chunk boundaries (±1 token) over a small alphabet, so chains share chunks.

``LMCacheModelMachine`` (the model alone, torch-free) runs in the default test session; the adapter's
machine (model and LMCache) runs in LMCache's own nox session.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Final

from hypothesis import strategies as st

from refcache.check.machine import Draws, Rules, RulesMachine, family_machine
from refcache.config import EvictionPolicy, HiCacheConfig
from refcache.errors import RefcacheError
from refcache.family import NodeId
from refcache.lmcache.config import LMCacheConfig
from refcache.lmcache.family import FAMILY as LMCACHE
from refcache.lmcache.ops import (
    Clear,
    ClearResult,
    FaultKind,
    LMCacheObservation,
    LMCacheOp,
    Lookup,
    LookupResult,
    LookupUnpin,
    PollPrefetch,
    Prefetch,
    PrefetchResult,
    Queue,
    Retrieve,
    RetrieveResult,
    Step,
    StorageFault,
    Store,
    StoreResult,
    Tier,
    chunk_keys,
)
from refcache.lmcache.scenarios import config as lmcache_config
from refcache.lmcache.snapshot import LMCacheSnapshot

__all__ = [
    "KINDS",
    "KIND_OPS",
    "LMCACHE_SITUATIONS",
    "RULES",
    "LMCacheDraws",
    "LMCacheModelMachine",
    "lmcache_configs",
]

_POLICIES: Final = (EvictionPolicy.LRU, EvictionPolicy.LFU, EvictionPolicy.FIFO, EvictionPolicy.MRU)


@st.composite
def lmcache_configs(draw: st.DrawFn) -> HiCacheConfig:
    """Small LMCache configurations: chunks of 2 or 4 tokens, 2 to 6 CPU chunks, no disk or 2 to 8 disk chunks,
    a remote tier or not, each of the four policies, save_unfull_chunk and async loading on or off."""
    chunk = draw(st.sampled_from((2, 4)), label="chunk_size")
    cpu = draw(st.integers(2, 6), label="cpu_chunks")
    disk = draw(st.sampled_from((0, 0, 2, 3, 4, 8)), label="disk_chunks")
    remote = draw(st.booleans(), label="remote")
    return lmcache_config(
        cpu,
        disk_chunks=disk,
        remote=remote,
        policy=draw(st.sampled_from(_POLICIES), label="policy"),
        async_loading=draw(st.booleans(), label="async_loading"),
        chunk_size=chunk,
        save_unfull_chunk=draw(st.booleans(), label="save_unfull_chunk"),
    )


# The operation kinds a step draws from, with their weights (one rule, as in refcache.check.machines). The
# order is part of every derandomized run: append new kinds at the end.
KINDS: Final = {
    "store": 6, "lookup": 2, "lookup_pin": 2, "unpin": 2, "retrieve": 4, "prefetch": 2, "poll": 2,
    "clear": 1, "clear_tokens": 1, "step_disk": 4, "step_remote": 3, "fault": 1,
    "damaged_read": 1, "pinned_prefetch_evicted": 1,
}  # fmt: skip

KIND_OPS: Final[dict[str, frozenset[type[LMCacheOp]]]] = {
    "store": frozenset({Store}), "lookup": frozenset({Lookup}), "lookup_pin": frozenset({Lookup}),
    "unpin": frozenset({LookupUnpin}), "retrieve": frozenset({Retrieve}), "prefetch": frozenset({Prefetch}),
    "poll": frozenset({PollPrefetch}), "clear": frozenset({Clear}), "clear_tokens": frozenset({Clear}),
    "step_disk": frozenset({Step}), "step_remote": frozenset({Step}), "fault": frozenset({StorageFault}),
    "damaged_read": frozenset({Store, Step, StorageFault, Retrieve, Prefetch, PollPrefetch}),
    "pinned_prefetch_evicted": frozenset({Prefetch, LookupUnpin, Step, Store, Lookup}),
}  # fmt: skip
"""The operations each kind applies: a machine over systems that answer only some (``SystemEntry.answers``)
draws only the kinds whose operations they all answer."""

LMCACHE_SITUATIONS: Final[Mapping[str, str]] = {
    "damaged-chunk-read": "a Retrieve or Prefetch reaches a chunk whose disk file or remote object a fault "
    "damaged: every chunk before it is held by some tier, and the CPU tier does not hold that one",
    "pinned-lookup-touches-evicted": "a pinned Lookup while keys_in_request holds a key an earlier pinned hit "
    "left there and the CPU tier no longer holds (its touch_cache meets a key that is gone)",
}
"""The LMCache family's ledger situations (``LMCacheDraws.observe``): states the random draws rarely reach
by chance, each with a kind aimed at it (``damaged_read``, ``pinned_prefetch_evicted``)."""


class LMCacheDraws(Draws[LMCacheOp, LMCacheObservation, LMCacheSnapshot]):
    """One example's draws over the LMCache family (``RULES``): the token sequences stored so far and the
    lookup ids handed out."""

    def __init__(
        self, machine: RulesMachine[LMCacheOp, LMCacheObservation, LMCacheSnapshot], config: HiCacheConfig
    ) -> None:
        super().__init__(machine, config)
        self.lconfig = LMCacheConfig.of(config)
        self.cpu_chunks = self.lconfig.cpu_bytes // self.lconfig.aligned(self.lconfig.chunk_bytes)
        self.sequences: list[tuple[int, ...]] = []
        self.prefetched: dict[int, tuple[int, ...]] = {}  # lookup id -> the tokens its prefetch asked for
        self.next_id = 0

    def _tokens(self, data: st.DataObject, *, reading: bool = False) -> tuple[int, ...]:
        """A token sequence: mostly an earlier one's prefix cut near a chunk boundary plus a short tail (a read
        mostly asks for what was stored), else a fresh one of at least one chunk."""
        cs = self.lconfig.chunk_size
        prefix: tuple[int, ...] = ()
        odds = (True, True, True, False) if reading else (True, False)
        reuse: bool = data.draw(st.sampled_from(odds), label="reuse") if self.sequences else False
        if reuse:
            base = data.draw(st.sampled_from(self.sequences), label="base")
            chunks = data.draw(st.integers(0, len(base) // cs), label="chunks")
            shift = data.draw(st.sampled_from((-1, 0, 0, 0, 1)), label="shift")
            prefix = base[: max(0, min(len(base), chunks * cs + shift))]
        tail = data.draw(
            st.lists(st.integers(0, 3), min_size=0 if prefix else cs, max_size=(1 if reading else 3) * cs),
            label="tail",
        )
        tokens = prefix + tuple(tail)
        if not tokens:
            tokens = (0,)
        if not reading:
            self.sequences.append(tokens)
        return tokens

    def _skip(self, data: st.DataObject, tokens: tuple[int, ...]) -> int:
        cs = self.lconfig.chunk_size
        return cs * data.draw(st.sampled_from((0, 0, 0, 1)), label="skip_chunks") if len(tokens) >= cs else 0

    def step(self, data: st.DataObject) -> None:
        c = self.lconfig
        snap = self.snapshot()
        pinned = sorted({p.lookup_id for p in snap.lookup_pins})
        prefetches = sorted(p.lookup_id for p in snap.prefetches)
        answered = sorted(p.lookup_id for p in snap.prefetches if p.done and p.hit)
        kind = self.draw_kind(data)
        if kind == "unpin" and not (pinned or prefetches):
            kind = "lookup_pin"
        if kind in ("prefetch", "poll") and not c.async_loading:
            kind = "lookup_pin" if kind == "prefetch" else "lookup"
        if kind == "poll" and not prefetches:
            kind = "prefetch"
        if kind == "retrieve" and c.async_loading and not answered:
            kind = "poll" if prefetches else "prefetch"
        if kind == "step_disk" and not (snap.disk is not None and snap.disk.jobs):
            kind = "store"
        if kind == "step_remote" and not (snap.remote is not None and snap.remote.jobs):
            kind = "store"
        if kind in ("fault", "damaged_read") and not (c.disk or c.remote):
            kind = "clear_tokens"
        if kind == "pinned_prefetch_evicted" and not c.async_loading:
            kind = "lookup_pin"
        if kind not in self.kinds:
            return  # redirected to a kind the systems do not answer (SystemEntry.answers): nothing this step
        if kind == "store":
            tokens = self._tokens(data)
            self.run(Store(tokens, self._skip(data, tokens)))
        elif kind == "lookup":
            self.run(Lookup(self._tokens(data, reading=True)))
        elif kind == "lookup_pin":
            self.run(Lookup(self._tokens(data, reading=True), self._new_id(), pin=True))
        elif kind == "unpin":
            self.run(LookupUnpin(data.draw(st.sampled_from(pinned + prefetches), label="lookup_id")))
        elif kind == "retrieve":
            if c.async_loading:  # the request the prefetch was for is loaded (a serving engine's connector)
                answer: int = data.draw(st.sampled_from(answered), label="lookup_id")
                tokens = self.prefetched[answer]
                self.run(Retrieve(tokens, self._skip(data, tokens), answer))
            else:
                tokens = self._tokens(data, reading=True)
                pinned_id: int | None = data.draw(st.sampled_from([None, None, *pinned]), label="lookup_id")
                self.run(Retrieve(tokens, self._skip(data, tokens), pinned_id))
        elif kind == "prefetch":
            tokens = self._tokens(data, reading=True)
            lookup_id = self._new_id()
            self.prefetched[lookup_id] = tokens
            self.run(Prefetch(tokens, lookup_id, pin=data.draw(st.booleans(), label="pin")))
        elif kind == "poll":
            self.run(PollPrefetch(data.draw(st.sampled_from(prefetches), label="lookup_id")))
        elif kind == "clear":
            self.run(Clear())
        elif kind == "clear_tokens":
            self.run(Clear(self._tokens(data, reading=True)))
        elif kind == "damaged_read":
            self.damaged_read(data)
        elif kind == "pinned_prefetch_evicted":
            self.pinned_prefetch_evicted(data)
        elif kind in ("step_disk", "step_remote"):
            count = data.draw(st.sampled_from((1, 1, 2, 8)), label="count")
            self.run(Step(Queue.DISK if kind == "step_disk" else Queue.REMOTE, count))
        else:
            tiers = ([Tier.DISK] if c.disk else []) + ([Tier.REMOTE] if c.remote else [])
            tier = data.draw(st.sampled_from(tiers), label="tier")
            fault = data.draw(st.sampled_from(tuple(FaultKind)), label="fault")
            self.run(StorageFault(tier, fault, data.draw(st.integers(0, 7), label="index")))

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _drain(self, *, disk: bool) -> None:
        """Run the remote queue's jobs, and the disk queue's when ``disk`` (a few rounds). The disk queue is
        left alone otherwise: against LMCache 0.5.6 a disk write ends the example at finding F1, before the
        situation a macro kind aims at."""
        for _ in range(4):
            snap = self.snapshot()
            if disk and snap.disk is not None and snap.disk.jobs:
                self.run(Step(Queue.DISK, 8))
            elif snap.remote is not None and snap.remote.jobs:
                self.run(Step(Queue.REMOTE, 8))
            else:
                return

    def _evict_cpu(self, data: st.DataObject) -> None:
        """Store a fresh sequence of the CPU tier's size in chunks, or one less, over tokens no other sequence
        uses: it evicts what the CPU tier held before (what nothing pins or references)."""
        chunks = data.draw(st.integers(max(1, self.cpu_chunks - 1), self.cpu_chunks), label="evict_chunks")
        first = data.draw(st.integers(4, 7), label="evict_token")
        tokens = (first,) * (chunks * self.lconfig.chunk_size)
        self.sequences.append(tokens)
        self.run(Store(tokens))

    def damaged_read(self, data: st.DataObject) -> None:
        """A stored sequence written to the disk or remote tier, pushed out of the CPU tier, one of its chunks'
        copies damaged (a CORRUPT fault on that copy), then read back: a blocking Retrieve, or a Prefetch,
        its reads run and polled (``LMCACHE_SITUATIONS``: damaged-chunk-read)."""
        c = self.lconfig
        tiers = ([Tier.DISK] if c.disk else []) + ([Tier.REMOTE] if c.remote else [])
        tier = data.draw(st.sampled_from(tiers), label="tier")
        tokens = self._tokens(data)
        self.run(Store(tokens))
        self._drain(disk=tier is Tier.DISK)
        self._evict_cpu(data)
        self._drain(disk=tier is Tier.DISK)
        snap = self.snapshot()
        held: list[NodeId] = []
        if tier is Tier.DISK and snap.disk is not None:
            held = sorted(e.key for e in snap.disk.entries)
        elif tier is Tier.REMOTE and snap.remote is not None:
            held = sorted(snap.remote.keys)
        mine = [held.index(k) for k in chunk_keys(tokens, c.chunk_size, c.save_unfull_chunk) if k in held]
        index = data.draw(st.sampled_from(mine), label="index") if mine else 0
        self.run(StorageFault(tier, FaultKind.CORRUPT, index))
        if not c.async_loading:
            self.run(Retrieve(tokens))
            return
        lookup_id = self._new_id()
        self.prefetched[lookup_id] = tokens
        self.run(Prefetch(tokens, lookup_id, pin=data.draw(st.booleans(), label="pin")))
        self._drain(disk=tier is Tier.DISK)
        self.run(PollPrefetch(lookup_id))

    def pinned_prefetch_evicted(self, data: st.DataObject) -> None:
        """A sequence stored and prefetched with pins, its pins released (LookupUnpin), the queues run, the
        CPU tier's chunks pushed out by a fresh store, then a pinned Lookup (``LMCACHE_SITUATIONS``:
        pinned-lookup-touches-evicted)."""
        tokens = self._tokens(data)
        self.run(Store(tokens))
        lookup_id = self._new_id()
        self.prefetched[lookup_id] = tokens
        self.run(Prefetch(tokens, lookup_id, pin=True))
        self.run(LookupUnpin(lookup_id))
        self._drain(disk=False)
        self._evict_cpu(data)
        self.run(Lookup(self._tokens(data, reading=True), self._new_id(), pin=True))

    def observe(
        self,
        op: LMCacheOp,
        outcome: LMCacheObservation | RefcacheError,
        before: LMCacheSnapshot,
        after: LMCacheSnapshot,
    ) -> Iterator[str]:
        """The situations of ``LMCACHE_SITUATIONS`` this step reached (the reference system's snapshots)."""
        cpu = {e.key for e in before.cpu.entries}
        if isinstance(op, Lookup) and op.pin and set(before.cpu.touched) - cpu:
            yield "pinned-lookup-touches-evicted"
        if isinstance(op, Retrieve | Prefetch):
            c = self.lconfig
            disk = {e.key: e.damaged for e in before.disk.entries} if before.disk is not None else {}
            remote = set(before.remote.keys) if before.remote is not None else set()
            damaged = set(before.remote.damaged) if before.remote is not None else set()
            for key in chunk_keys(op.tokens, c.chunk_size, c.save_unfull_chunk):
                if key in cpu:
                    continue
                if disk.get(key) or (key not in disk and key in damaged):
                    yield "damaged-chunk-read"
                    return
                if key not in disk and key not in remote:
                    return


def _detail(result: LMCacheObservation) -> str:
    """The outcome's class, for the coverage ledger."""
    match result:
        case StoreResult(stored):
            return ":stored" if stored else ":none"
        case LookupResult(hit) | RetrieveResult(hit):
            return ":hit" if hit else ":miss"
        case PrefetchResult(done, hit):
            return ":waiting" if not done else (":hit" if hit else ":miss")
        case ClearResult(removed):
            return ":removed" if removed else ":none"
        case _:
            return ""


RULES: Final = Rules[LMCacheOp, LMCacheObservation, LMCacheSnapshot](
    KINDS, KIND_OPS, lmcache_configs(), _detail, LMCacheDraws
)
"""What the LMCache family's machine draws and counts (``refcache.check.machine.Rules``)."""

LMCacheModelMachine: Final = family_machine(LMCACHE, RULES, ("lmcache-model",), name="LMCacheModelMachine")
