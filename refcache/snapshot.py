"""Moved to ``refcache.hicache.snapshot`` (HiCache's family package, specs/architecture.md); this path
re-exports its public names for one release (README, "Import paths")."""

from refcache.hicache.snapshot import *  # noqa: F403
from refcache.hicache.snapshot import __all__ as __all__
