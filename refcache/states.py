"""Moved to ``refcache.hicache.states`` (HiCache's family package, specs/architecture.md); this path
re-exports its public names for one release (README, "Import paths")."""

from refcache.hicache.states import *  # noqa: F403
from refcache.hicache.states import __all__ as __all__
