"""Moved to ``refcache.hicache.recording`` (HiCache's family package, specs/architecture.md); this path
re-exports its public names for one release (README, "Import paths")."""

from refcache.hicache.recording import *  # noqa: F403
from refcache.hicache.recording import __all__ as __all__
