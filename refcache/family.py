"""An engine family: the operations its systems speak, what they report, and what must hold of it.

Theory of operation. refcache checks *systems* (its reference model, its implementation, another engine
through an adapter) by applying the same operations to each and comparing what comes back. Which operations,
which snapshots and which invariants depends on the kind of cache: SGLang's HiCache is a radix tree over
three tiers (``refcache.hicache``), vLLM's prefix cache is a block pool with a CPU offload manager
(``refcache.vllm``). A ``Family[Op, Obs, Snap]`` is everything the checking side needs to know about one
such kind, as plain data and pure functions, typed over the family's own three types:

- the operation alphabet (``ops``) and its observation and snapshot types;
- the state invariants (``check``: a snapshot's violations) and the step invariants (``check_step``: what
  must hold between two snapshots across one operation);
- a readable snapshot diff (``diff``), a one-line status per step (``status_line``) and the comparison
  granularities an adapter may choose (``granularities``: e.g. without slot numbers);
- the trace codec (``dumps_trace``, ``read_trace``, ``is_trace``: whose header starts a trace file);
- the directed conformance scenarios (``scenarios``): short operation sequences every system of the family
  must run, each through the situation it is named after.

The checking side (``refcache.check``) is generic over ``Family``: one harness, one shrink, one replay, one
conformance kit (``refcache.conformance``). What it draws (the random machine's rules and weights) and what
it counts (the coverage ledger's situations) are the family's too; they live above the generic machine, in one
module of ``refcache.rules`` per family, because they are Hypothesis strategies over the harness, and
``refcache.check.families.FAMILIES`` finds them by name. Adding a family is a package with a ``FAMILY``
object, one module of rules and one registry line (specs/architecture.md counts the files).

Nothing here imports torch, numpy or an engine; a family package may not import the checking side.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import Final, Generic, TypeVar

from refcache.config import HiCacheConfig
from refcache.errors import UsageError
from refcache.hashing import Token

__all__ = ["EXACT", "Family", "NodeId", "Scenario", "Violation", "field_diff"]

OpT = TypeVar("OpT")
ObsT = TypeVar("ObsT")
SnapT = TypeVar("SnapT")


@dataclass(frozen=True, order=True)
class NodeId:
    """Cached content's name in every family: its namespace (SGLang's ``extra_key``; vLLM's LoRA and salt) and
    the key tokens from the first one to its end (a HiCache node's token path; a vLLM block's prefix)."""

    namespace: str
    path: tuple[Token, ...]

    @property
    def depth(self) -> int:
        return len(self.path)


@dataclass(frozen=True)
class Violation:
    """One broken invariant, in any family: which, on which rank and node (or content), and what differs."""

    invariant: str
    rank: int | None
    node: NodeId | None
    message: str

    def __str__(self) -> str:
        where = "" if self.rank is None else f" rank {self.rank}"
        if self.node is not None:
            where += f" node {self.node.namespace or '-'}:{list(self.node.path)}"
        return f"[{self.invariant}]{where}: {self.message}"


EXACT: Final = "exact"
"""The granularity every family has: snapshots compared field by field, as they are."""


@dataclass(frozen=True)
class Scenario(Generic[OpT]):
    """A directed conformance scenario: a configuration and the operations that take a system through one
    named situation (``refcache.conformance`` runs each on a system under test, invariants checked after
    every step, and compares it with the reference system when there is one)."""

    name: str  # kebab-case, unique in its family: "evict-to-host-and-load-back"
    what: str  # one line: the situation it takes the system through
    config: HiCacheConfig
    ops: tuple[OpT, ...]


@dataclass(frozen=True)
class Family(Generic[OpT, ObsT, SnapT]):
    """One engine family (see the module docstring). Every function is pure: it reads its arguments only."""

    name: str  # the registry's key and ``SystemEntry.family``: "hicache", "vllm"
    summary: str  # for error messages: "HiCache (refcache.hicache.ops)"
    ops: tuple[type[OpT], ...]  # the operation alphabet, in its documented order
    observation: type[ObsT] | tuple[type[ObsT], ...]  # what ``System.apply`` returns (isinstance-able)
    snapshot: type[SnapT]  # what ``System.snapshot`` returns
    check: Callable[[SnapT], list[Violation]]  # the state invariants
    check_step: Callable[[SnapT, SnapT, OpT], list[Violation]]  # the step invariants (before, after, op)
    diff: Callable[[SnapT, SnapT, str, str], list[str]]  # readable differences (a, b, name of a, name of b)
    status_line: Callable[[SnapT], str]  # one line per step: occupancy and in-flight counts
    dumps_trace: Callable[[HiCacheConfig, Sequence[OpT]], str]  # a run as JSONL text, header first
    read_trace: Callable[[str | os.PathLike[str]], tuple[HiCacheConfig, list[OpT]]]
    is_trace: Callable[[str], bool]  # whether a trace's first line is this family's header
    scenarios: Callable[[], tuple[Scenario[OpT], ...]]  # the directed conformance scenarios
    reference: str  # the registry name of the family's reference model ("model", "vllm-model")
    # Coarser comparisons an adapter may ask for (``SystemEntry.compare``): name -> the projection applied
    # to both snapshots before they are compared. Invariants always read the whole snapshot.
    granularities: Mapping[str, Callable[[SnapT], SnapT]]

    def project(self, granularity: str) -> Callable[[SnapT], SnapT] | None:
        """The projection for ``granularity`` (None for ``EXACT``). Raises ``UsageError`` naming the
        family's granularities for an unknown one."""
        if granularity == EXACT:
            return None
        try:
            return self.granularities[granularity]
        except KeyError:
            known = ", ".join([EXACT, *self.granularities])
            raise UsageError(
                f"the {self.name} family compares at {known}; {granularity!r} is not one of them"
            ) from None

    def op_named(self, name: str) -> type[OpT]:
        """The operation class called ``name`` (``SystemEntry.answers`` names operations by class name).
        Raises ``UsageError`` naming the alphabet."""
        for kind in self.ops:
            if kind.__name__ == name:
                return kind
        alphabet = ", ".join(k.__name__ for k in self.ops)
        raise UsageError(f"{name!r} is not an operation of the {self.name} family: {alphabet}")


def field_diff(prefix: str, a: object, b: object, name_a: str, name_b: str) -> list[str]:
    """Readable differences between two plain-data values: dataclasses field by field, equal-length tuples
    of dataclasses element by element, anything else as both values. Every family's ``diff`` builds on it."""
    if a == b:
        return []
    if is_dataclass(a) and is_dataclass(b) and type(a) is type(b) and not isinstance(a, type):
        out: list[str] = []
        for f in fields(a):
            out += field_diff(f"{prefix}.{f.name}", getattr(a, f.name), getattr(b, f.name), name_a, name_b)
        return out
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and a and is_dataclass(a[0]):
        return [
            line
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for line in field_diff(f"{prefix}[{i}]", x, y, name_a, name_b)
        ]
    return [f"{prefix}: {name_a}={a!r} {name_b}={b!r}"]
