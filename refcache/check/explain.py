"""Explaining a divergence by a decision: is it a bug, or a place where refcache chose otherwise?

refcache follows the seed and records, in ``specs/decisions.md``, where it chose otherwise than SGLang
0.5.20; each such decision has an option that follows 0.5.20 instead (``refcache.config.FIDELITY_OPTIONS``).
A real engine does not read those options: it always behaves as its release does (``SystemEntry.follows``).
So when the model and such an engine diverge, ``explain`` replays the trace with each decision's option set
to what the engine does, one at a time: a decision whose option alone makes the trace replay clean explains
the divergence. When none does alone, two behaviours may meet in one trace (an EAGLE request's insert that both
re-inserts its prompt, D-24, and raises the matched part's priority after the split, D-36): then every
decision the profile sets otherwise is set at once, and when that replays clean the set is cut down to a
minimal one that still does (each decision dropped in turn and kept out when the rest stay clean); those
decisions explain it together. Only then is it a documented difference rather than a bug.
"""

from __future__ import annotations

from collections.abc import Sequence

from refcache.check.shrink import failure_of, systems_named
from refcache.config import FIDELITY_OPTIONS, PROFILES, HiCacheConfig
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import Op
from refcache.systems import SYSTEMS

__all__ = ["explain", "followed_profile", "follows_a_profile"]


def follows_a_profile(systems: Sequence[str]) -> bool:
    """Whether an engine among ``systems`` follows a fixed profile, decided from the registry alone (the
    engine is not asked which: a machine class is built where the engine is not installed too)."""
    return any(SYSTEMS[name].follows is not None for name in systems if name in SYSTEMS)


def followed_profile(systems: Sequence[str]) -> str | None:
    """The profile that the engines among ``systems`` always follow (None: every system reads the
    configuration, so a decision cannot explain a divergence between them)."""
    profiles = {SYSTEMS[name].followed() for name in systems if name in SYSTEMS} - {None}
    return next(iter(profiles)) if len(profiles) == 1 else None


def explain(config: HiCacheConfig, ops: Sequence[Op], systems: Sequence[str]) -> list[str]:
    """The decisions (``"D-10"``, ...) that explain why ``ops`` diverges on ``systems`` under ``config``:
    each one whose option, set as the followed profile sets it, makes the whole trace replay clean; when
    none does alone, a minimal set of them that does together (the module docstring). [] when no set does,
    or when no system follows a fixed profile. Replays: one per decision the profile sets otherwise, and
    when none explains alone, at most that many more."""
    profile = followed_profile(systems)
    if profile is None:
        return []
    wanted = PROFILES[profile]
    make = systems_named(systems)

    def clean(decisions: Sequence[str]) -> bool:
        options = {FIDELITY_OPTIONS[d]: wanted[FIDELITY_OPTIONS[d]] for d in decisions}
        return failure_of(config.with_fidelity(options), ops, make, family=HICACHE) is None

    differing = [d for d, option in FIDELITY_OPTIONS.items() if getattr(config, option) != wanted[option]]
    found = [d for d in differing if clean([d])]
    if found or len(differing) < 2 or not clean(differing):
        return found
    together = list(differing)
    for decision in differing:
        rest = [d for d in together if d != decision]
        if len(rest) >= 2 and clean(rest):
            together = rest
    return together
