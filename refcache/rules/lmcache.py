"""The LMCache family's checking side: what its random machine draws, and its registration (``CHECKS``, found by
``refcache.check.families.FAMILIES``).

``RULES`` (``refcache.check.machine.Rules``) is what the family's machine
(``refcache.check.machine.family_machine``) draws: registry systems of the LMCache family (``"lmcache-model"``,
``"lmcache"``) get random sequences of ``refcache.lmcache.ops`` operations through the differential
``Harness``: every step's outcomes and snapshots are compared and every LMCache invariant is checked.
Capacities are a few chunks per tier (``lmcache_configs``) so that CPU eviction under every policy, stores cut
short, disk eviction and refused writes, promotions and prefetches happen within a few steps; token sequences
reuse earlier ones' prefixes cut at chunk boundaries (±1 token) over a small alphabet, so chains share chunks.
The ledger counts outcomes only (``lmcache_coverage_report``): the family has no situations yet.

``LMCacheModelMachine`` (the model alone, torch-free) runs in the default test session; the adapter's
machine (model and LMCache) runs in LMCache's own nox session. Machines are built by
``refcache.check.machine.build``, so their module is ``refcache.check.machine`` wherever they are named: their
derandomized samples depend on the class name only, and moving these rules here from
``refcache.check.lmcache_machines`` left them as they were.
"""

from __future__ import annotations

from typing import Final

from hypothesis import strategies as st

from refcache.check.coverage import Coverage, ledger_report
from refcache.check.families import FamilyChecks
from refcache.check.machine import Draws, Rules, RulesMachine, family_machine
from refcache.config import EvictionPolicy, HiCacheConfig
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
)
from refcache.lmcache.scenarios import config as lmcache_config
from refcache.lmcache.snapshot import LMCacheSnapshot

__all__ = [
    "CHECKS",
    "KINDS",
    "KIND_OPS",
    "RULES",
    "LMCacheDraws",
    "LMCacheModelMachine",
    "lmcache_configs",
    "lmcache_coverage_report",
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
}  # fmt: skip

KIND_OPS: Final[dict[str, frozenset[type[LMCacheOp]]]] = {
    "store": frozenset({Store}), "lookup": frozenset({Lookup}), "lookup_pin": frozenset({Lookup}),
    "unpin": frozenset({LookupUnpin}), "retrieve": frozenset({Retrieve}), "prefetch": frozenset({Prefetch}),
    "poll": frozenset({PollPrefetch}), "clear": frozenset({Clear}), "clear_tokens": frozenset({Clear}),
    "step_disk": frozenset({Step}), "step_remote": frozenset({Step}), "fault": frozenset({StorageFault}),
}  # fmt: skip
"""The operations each kind applies: a machine over systems that answer only some (``SystemEntry.answers``)
draws only the kinds whose operations they all answer."""


class LMCacheDraws(Draws[LMCacheOp, LMCacheObservation, LMCacheSnapshot]):
    """One example's draws over the LMCache family (``RULES``): the token sequences stored so far and the
    lookup ids handed out."""

    def __init__(
        self, machine: RulesMachine[LMCacheOp, LMCacheObservation, LMCacheSnapshot], config: HiCacheConfig
    ) -> None:
        super().__init__(machine, config)
        self.lconfig = LMCacheConfig.of(config)
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
        if kind == "fault" and not (c.disk or c.remote):
            kind = "clear_tokens"
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


def lmcache_coverage_report(cov: Coverage) -> str:
    """The LMCache family's ledger: examples, steps and the outcomes counted (no situations yet)."""
    return ledger_report(cov, {})


CHECKS: Final = FamilyChecks.from_rules(LMCACHE, RULES, lmcache_coverage_report)
"""The LMCache family's checking side, as ``refcache.check.families.FAMILIES`` finds it."""
