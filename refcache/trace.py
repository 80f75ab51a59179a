"""Moved to ``refcache.hicache.trace`` (HiCache's family package, specs/architecture.md); this path
re-exports its public names for one release (README, "Import paths")."""

from refcache.hicache.trace import *  # noqa: F403
from refcache.hicache.trace import __all__ as __all__
