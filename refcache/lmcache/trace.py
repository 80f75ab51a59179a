"""Traces of LMCache operations: the refcache trace format with a header that also says ``"family": "lmcache"``, and
one ``refcache.lmcache.ops.op_to_json`` object per further line (``refcache.tagged_trace``); ``is_lmcache_trace`` tells
them from HiCache's and the other families' traces.
"""

from __future__ import annotations

from typing import Final

from refcache.lmcache.ops import LMCacheOp, op_from_json, op_to_json
from refcache.tagged_trace import TaggedTraces

__all__ = ["FAMILY", "TRACES", "dumps_trace", "is_lmcache_trace", "loads_trace", "read_trace", "write_trace"]

TRACES: Final = TaggedTraces[LMCacheOp]("lmcache", "an LMCache", op_to_json, op_from_json)
FAMILY: Final = TRACES.family

dumps_trace = TRACES.dumps
is_lmcache_trace = TRACES.is_trace
loads_trace = TRACES.loads
read_trace = TRACES.read
write_trace = TRACES.write
