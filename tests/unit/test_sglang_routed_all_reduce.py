"""``_storage.route_all_reduce``: up to 0.5.10 SGLang's prefetch thread calls ``torch.distributed.all_reduce`` on
``prefetch_tp_group`` itself (``_compat`` "prefetch_hits_all_reduce_inline"); the adapter routes that group's
all-reduces to the gate and leaves every other call to the real one."""

from __future__ import annotations

from typing import Any

import pytest


def test_an_all_reduce_over_a_routed_group_goes_to_its_route_until_the_gate_is_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch
    import torch.distributed as dist

    from refcache.engines.sglang import _storage

    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(
        dist, "all_reduce", lambda *args, **kwargs: calls.append(("real", kwargs.get("group")))
    )
    monkeypatch.setattr(_storage, "_ROUTING", [])
    monkeypatch.setattr(_storage, "_ROUTES", {})
    gate, group, other = _storage.Gate(), object(), object()

    def route(tensor: Any, op: Any) -> None:
        calls.append(("routed", op))
        tensor.fill_(7)

    _storage.route_all_reduce(gate, group, route)
    hits = torch.tensor(3, dtype=torch.int)
    dist.all_reduce(hits, op=dist.ReduceOp.MIN, group=group)  # 0.5.10's call (cache_controller.py:958)
    assert hits.item() == 7 and calls == [("routed", dist.ReduceOp.MIN)]
    dist.all_reduce(hits, dist.ReduceOp.MAX, group)  # positional
    assert calls[-1] == ("routed", dist.ReduceOp.MAX)
    with pytest.raises(_storage.EngineThreadError, match="asynchronous"):
        dist.all_reduce(hits, op=dist.ReduceOp.MIN, group=group, async_op=True)
    dist.all_reduce(hits, op=dist.ReduceOp.MIN, group=other)  # another group: the real one
    dist.all_reduce(hits, op=dist.ReduceOp.MIN)
    assert calls[-2:] == [("real", other), ("real", None)]
    _storage.unwatch(gate)  # the adapter's close
    dist.all_reduce(hits, op=dist.ReduceOp.MIN, group=group)
    assert calls[-1] == ("real", group) and hits.item() == 7
