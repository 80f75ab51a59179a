"""Traces of vLLM operations: the refcache trace format with a header that also says ``"family": "vllm"``, and
one ``refcache.vllm.ops.op_to_json`` object per further line (``refcache.tagged_trace``); ``is_vllm_trace`` tells
them from HiCache's and the other families' traces.
"""

from __future__ import annotations

from typing import Final

from refcache.tagged_trace import TaggedTraces
from refcache.vllm.ops import VllmOp, op_from_json, op_to_json

__all__ = ["FAMILY", "TRACES", "dumps_trace", "is_vllm_trace", "loads_trace", "read_trace", "write_trace"]

TRACES: Final = TaggedTraces[VllmOp]("vllm", "a vLLM", op_to_json, op_from_json)
FAMILY: Final = TRACES.family

dumps_trace = TRACES.dumps
is_vllm_trace = TRACES.is_trace
loads_trace = TRACES.loads
read_trace = TRACES.read
write_trace = TRACES.write
