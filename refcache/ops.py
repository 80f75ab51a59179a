"""Moved to ``refcache.hicache.ops`` (HiCache's family package, specs/architecture.md); this path
re-exports its public names for one release (README, "Import paths")."""

from refcache.hicache.ops import *  # noqa: F403
from refcache.hicache.ops import __all__ as __all__
