"""Moved to ``refcache.hicache.invariants`` (HiCache's family package, specs/architecture.md); this path
re-exports its public names for one release (README, "Import paths")."""

from refcache.hicache.invariants import *  # noqa: F403
from refcache.hicache.invariants import __all__ as __all__
