"""The bug zoo: real HiCache bugs, re-introduced one at a time as source patches applied at test time.

Each ``Bug`` is a list of ``Edit``s: replace one exact snippet of one function's source by another,
recompile that function in its module's namespace and swap it in for the duration of a ``with
bug.applied():`` block. Product code carries no bug switches; an edit whose snippet is not found exactly
once fails loudly, so a refactoring of the product cannot silently turn a zoo bug into a no-op.

``hunt`` runs the default differential machine CI runs — the same class name, hence the same
derandomized sample, configurations, step count and budget as ``tests/properties/test_differential.py``
(``refcache.check.budget.DIFFERENTIAL``) — against the patched implementation and reports the first
failing example (counted by a coverage ledger, not by a renamed subclass), the shrunk trace and what
caught it; ``examples_to_catch`` runs the same machine under other seeds (the robustness figure). ``tests/quality/test_zoo.py``
asserts every bug is caught within its budget; ``tests/quality/measure_zoo.py`` regenerates the table in
``specs/bug-zoo.md`` from these measurements.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import textwrap
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from refcache.check import budget
from refcache.check.coverage import Coverage
from refcache.check.families import FamilyChecks, family_checks
from refcache.check.harness import TRACE_DIR_ENV, Divergence, Harness
from refcache.check.known import KnownFindings, load_known, system_releases
from refcache.check.machines import DifferentialMachine, FaultyDifferentialMachine
from refcache.check.parallel import run_plan
from refcache.check.plan import ConfigOverrides, fuzz_plan
from refcache.check.shrink import Failure, shrink_trace, systems_named
from refcache.config import HiCacheConfig
from refcache.errors import RefcacheError
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import Op
from refcache.hicache.trace import read_trace
from refcache.systems import open_systems

__all__ = [
    "ZOO",
    "Bug",
    "Catch",
    "Edit",
    "examples_past_known",
    "examples_to_catch",
    "first_divergence",
    "hunt",
    "hunted",
]


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` (exactly one occurrence) by ``new`` in the source of ``target``
    (``"module:Class.method"`` or ``"module:function"``)."""

    target: str
    old: str
    new: str


@dataclass(frozen=True)
class Bug:
    """One zoo bug of any engine family: the edits that re-introduce it, what must catch it, and the machine
    CI runs that hunts it (``family``'s, over ``systems``, under the class name ``machine_name``)."""

    slug: str
    what: str  # the bug, in one line
    upstream: str  # where it shipped (reference/sglang.md §9 row, peers, PRs/issues)
    edits: tuple[Edit, ...]
    caught_by: str  # a substring of the first line of the Divergence the harness raises
    faulty: bool = False  # needs storage faults: hunt with FaultyDifferentialMachine
    budget: int = budget.DIFFERENTIAL.examples  # examples the default run may need
    max_trace_ops: int = 40  # the shrunk trace must be at most this long
    notes: str = ""
    family: str = "hicache"  # a family of refcache.check.families.family_names()
    systems: tuple[str, ...] = ("model", "impl")  # the reference first
    machine_name: str = ""  # the hunting machine's class name ("": HiCache's default differential machine)
    known: Path | None = None  # known findings (refcache.check.known): hunt as `refcache fuzz --known` does

    @property
    def machine(self) -> str:
        """The class name of the machine CI runs that hunts this bug (it fixes the derandomized sample)."""
        if self.machine_name:
            return self.machine_name
        return (FaultyDifferentialMachine if self.faulty else DifferentialMachine).__name__

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Swap the patched functions in; restore the originals on exit."""
        by_target: dict[str, list[Edit]] = {}
        for edit in self.edits:
            by_target.setdefault(edit.target, []).append(edit)
        originals: list[tuple[object, str, object]] = []
        try:
            for target, edits in by_target.items():
                owner, name, original = _resolve(target)
                originals.append((owner, name, original))
                setattr(owner, name, _patched(self.slug, original, edits))
            yield
        finally:
            for owner, name, original in reversed(originals):
                setattr(owner, name, original)


def _resolve(target: str) -> tuple[object, str, object]:
    module_name, _, qualname = target.partition(":")
    owner: object = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name, inspect.getattr_static(owner, name)


def _patched(slug: str, original: object, edits: list[Edit]) -> object:
    if not inspect.isfunction(original):
        raise TypeError(f"zoo bug {slug}: {original!r} is not a plain function")
    source = inspect.getsource(original)  # edits quote the file, indentation included
    for edit in edits:
        count = source.count(edit.old)
        if count != 1:
            raise LookupError(
                f"zoo bug {slug}: {edit.old!r} occurs {count} times in {edit.target}; update the edit"
            )
        source = source.replace(edit.old, edit.new)
    namespace = dict(vars(inspect.getmodule(original)))
    exec(compile(textwrap.dedent(source), f"<zoo:{slug}>", "exec"), namespace)
    patched = namespace[original.__name__]
    patched.__qualname__ = original.__qualname__
    return patched


# --- hunting ----------------------------------------------------------------------------------------------


@dataclass
class Catch:
    """What one hunt measured."""

    caught: bool
    examples: int  # examples run up to and including the first failing one (0: none failed)
    seconds: float  # the whole hunt, shrinking included
    trace: Path | None  # the shrunk trace
    raw_ops: int  # operations in the first failing example's trace
    trace_ops: int  # ... after shrinking
    message: str  # first line of the shrunk trace's divergence
    detail: str = ""  # what differed (the divergence's next lines)
    minimal: bool = False  # the shrinker reached a 1-minimal trace within its time budget
    without_model: str = ""  # what the implementation's own checks see on the shrunk trace (see there)
    known: str = ""  # the id of the known finding the shrunk trace's failure matches ("": none; Bug.known)

    def __str__(self) -> str:
        return (
            f"caught={self.caught} examples={self.examples} ops={self.raw_ops}->{self.trace_ops} "
            f"seconds={self.seconds:.1f}: {self.message}"
        )


def hunted(bug: Bug, ledger: Coverage, seed: int | None = None) -> type[RuleBasedStateMachine]:
    """The machine CI runs for ``bug`` — the same systems, kinds, configurations and class name, hence
    the same derandomized sample — filling ``ledger``; ``seed`` runs another sample of it."""
    return family_checks(bug.family).hunter(bug.systems, ledger, bug.machine, seed, faults=bug.faulty)


def examples_to_catch(bug: Bug, trace_dir: Path, seed: int | None = None) -> int:
    """Examples the machine (CI's sample, or ``seed``'s) ran up to and including the first one that
    caught ``bug``, within the default budget; 0 if none did. No shrinking."""
    ledger = Coverage()
    with bug.applied():
        first_divergence(hunted(bug, ledger, seed), budget.DIFFERENTIAL.examples, trace_dir)
    return ledger.first_failure


def first_divergence(hunter: type[RuleBasedStateMachine], examples: int, trace_dir: Path) -> str:
    """Run the machine class ``hunter`` derandomized and unshrunk, for at most ``examples`` examples of the
    default run's length, its failing trace written under ``trace_dir``; the divergence that stopped it,
    its first line (what fired on which operation) then what differed ("" if none did). The caller applies
    the bug and reads the ledger."""
    settings = budget.Budget(examples, budget.DIFFERENTIAL.steps).settings(derandomize=True, shrink=False)
    with mock.patch.dict(os.environ, {TRACE_DIR_ENV: str(trace_dir)}):
        try:
            run_state_machine_as_test(hunter, settings=settings)
        except Divergence as error:
            return str(error)
    return ""


def hunt(bug: Bug, trace_dir: Path, max_examples: int | None = None, shrink_seconds: float = 60.0) -> Catch:
    """Run the machine CI runs (``hunted``: same class, same derandomized sample) against the patched
    system, up to ``max_examples`` (default: the bug's budget, the default run's) examples of the default
    run's length; a coverage ledger says which example failed first. That example's trace is then shrunk
    by ``refcache.check.shrink`` under the bug's family (with the bug still applied) for at most
    ``shrink_seconds``: replaying an operation list is far cheaper than Hypothesis re-running the machine,
    which took minutes per bug. For HiCache bugs, ``Catch.without_model`` says what the implementation's own
    checks see on the shrunk trace."""
    if bug.known is not None:
        return _hunt_past_known(bug, load_known([bug.known]), trace_dir, max_examples, shrink_seconds)
    ledger = Coverage()
    hunter = hunted(bug, ledger)
    checks = family_checks(bug.family)
    started = time.perf_counter()
    with bug.applied():
        message = first_divergence(hunter, max_examples or bug.budget, trace_dir)
        trace = trace_dir / f"{bug.machine}.jsonl"
        if not message or not trace.exists():
            return Catch(False, 0, time.perf_counter() - started, None, 0, 0, message)
        shrunk = trace_dir / f"{bug.machine}.min.jsonl"
        result = checks.shrink(trace, shrunk, bug.systems, seconds=shrink_seconds)
        alone = without_model(*read_trace(shrunk)) if bug.family == "hicache" else ""
    return Catch(
        True,
        ledger.first_failure,
        time.perf_counter() - started,
        shrunk,
        result.original_length,
        result.length,
        result.failure.message,
        result.failure.detail,
        result.complete,
        alone,
    )


KNOWN_SEED = 0
"""The seed of CI's sample for an engine whose findings are known data: its session runs ``refcache fuzz --seed 0
--known FILE`` (``tests/engines/lmcache/test_differential.py``)."""


def _run_past_known(
    bug: Bug, known: KnownFindings, trace_dir: Path, examples: int, seed: int
) -> tuple[str | None, str | None, Coverage]:
    """The run CI's session makes for an engine with known findings (``refcache fuzz --seed SEED --known FILE``:
    ``fuzz_plan`` and ``run_plan``, ``examples`` examples of ``FUZZ_STEPS``) against the patched engine: a
    divergence that matches a known finding ends its example and the run goes on. The first other failure's
    message and trace (None, None if none) and the run's ledger (``runs``: the examples started)."""
    plan = fuzz_plan(
        bug.systems,
        ConfigOverrides(),
        steps=budget.FUZZ_STEPS,
        examples=examples,
        seconds=None,
        database=trace_dir / "hypothesis-db",
        seed=seed,
    )
    ledger = Coverage()
    with bug.applied(), mock.patch.dict(os.environ, {TRACE_DIR_ENV: str(trace_dir)}):
        outcome = run_plan(plan, ledger, known=known, report=lambda _message: None)
    return outcome.failure, outcome.trace_path, ledger


def examples_past_known(bug: Bug, trace_dir: Path, seed: int) -> int:
    """``examples_to_catch`` for a bug with ``known`` findings: the examples ``seed``'s run (``_run_past_known``,
    the bug's budget) started up to and including the one an unknown divergence ended; 0 if none did."""
    assert bug.known is not None
    failure, _trace, ledger = _run_past_known(bug, load_known([bug.known]), trace_dir, bug.budget, seed)
    return ledger.runs if failure is not None else 0


def _hunt_past_known(
    bug: Bug, known: KnownFindings, trace_dir: Path, max_examples: int | None, shrink_seconds: float
) -> Catch:
    """``hunt`` for an engine with known findings: CI's run (``_run_past_known`` with ``KNOWN_SEED``); the bug is
    caught by the first divergence no known finding explains. Its trace is shrunk keeping only candidates
    whose failure no known finding explains either, so the shrinker cannot trade the bug for a known one."""
    entry = family_checks(bug.family)
    assert isinstance(entry, FamilyChecks)  # every registered family's checks are one
    started = time.perf_counter()
    examples = max_examples or bug.budget
    failure, trace, ledger = _run_past_known(bug, known, trace_dir, examples, KNOWN_SEED)
    if failure is None or trace is None:
        return Catch(False, 0, time.perf_counter() - started, None, 0, 0, failure or "")
    releases = system_releases(bug.systems)

    def unknown(candidate: Failure) -> bool:
        return known.match(candidate, releases) is None

    config, ops = entry.family.read_trace(trace)
    with bug.applied():
        result = shrink_trace(
            config,
            ops,
            systems_named(bug.systems, family=entry.family),
            family=entry.family,
            seconds=shrink_seconds,
            keep=unknown,
        )
    shrunk = trace_dir / f"{Path(trace).stem}.min.jsonl"
    shrunk.write_text(entry.family.dumps_trace(config, result.ops))
    matched = known.match(result.failure, releases)
    return Catch(
        True,
        ledger.runs,
        time.perf_counter() - started,
        shrunk,
        result.original_length,
        len(result.ops),
        result.failure.message,
        result.failure.detail,
        result.complete,
        known="" if matched is None else matched.id,
    )


def without_model(config: HiCacheConfig, ops: Sequence[Op]) -> str:
    """What the implementation's own checks report on ``ops`` with no model beside it: every invariant
    of ``refcache.hicache.invariants``, the step invariants, its internal errors (transition table, lock and
    collective guards) and the KV content oracle. "" when they see nothing: only the comparison with
    the model catches the bug on this trace. This is what an engine porting the invariants, without
    the reference model, would find."""
    with open_systems(["impl"], config) as systems:
        try:
            harness = Harness(config, systems, write_trace=False, family=HICACHE)
            for op in ops:
                outcome = harness.step(op)
                if isinstance(
                    outcome, RefcacheError
                ):  # shrunk traces keep no operation invalid for the model
                    return f"{type(outcome).__name__} on {op!r}: {outcome}"
        except Divergence as error:
            lines = str(error).splitlines()
            return f"{lines[0].split(': ', 1)[-1]} {lines[1].strip() if len(lines) > 1 else ''}".strip()
    return ""


# --- the zoo ----------------------------------------------------------------------------------------------

_TREE = "refcache.gpu.hiradix_cache:HiRadixCache"
_CTRL = "refcache.gpu.cache_controller:HiCacheController"

ZOO: tuple[Bug, ...] = (
    Bug(
        "collective-skipped-when-queues-empty",
        "drain_storage_control_queues returns before its MIN all-reduce when this rank's control queues "
        "are empty",
        "sglang.md §9 #1: issue #26921 / PR #26923, issue #28429 / PR #28430 (writing_check skipped its "
        "all-reduce when the local ongoing_write_through was empty; TP hang)",
        (
            Edit(
                f"{_TREE}.drain_storage_control_queues",
                "        ctrl = self.cache_controller\n",
                "        ctrl = self.cache_controller\n"
                "        if not any(ctrl.control_queue_sizes()):\n"
                "            return 0, 0, 0, 0\n",
            ),
        ),
        caught_by="outcomes differ on CheckHicacheEvents",
        notes="needs tp >= 2 with one rank's backup/release finished before the other's",
    ),
    Bug(
        "prefetch-progress-early-return",
        "check_prefetch_progress returns 'not done' before the MAX all-reduce when this rank cannot "
        "terminate yet",
        "sglang.md §9 #2: issue #30760, PRs #38268/#38270/#38273 (early return before the all-reduce in "
        "check_prefetch_progress; TP deadlock)",
        (
            Edit(
                f"{_TREE}.check_prefetch_progress",
                "            can, terminated = self._can_terminate_prefetch(entry.op)\n",
                "            can, terminated = self._can_terminate_prefetch(entry.op)\n"
                "            if not can and not terminated:\n"
                "                return False, 0\n",
            ),
        ),
        caught_by="outcomes differ on CheckPrefetchProgress",
        notes="needs tp >= 2, a wait_complete or timeout policy and ranks that read different amounts",
    ),
    Bug(
        "host-leaf-predicate-swapped",
        "the host-eviction leaf test checks 'backed up' where it must check 'evicted' (a node still on "
        "the device becomes a host-eviction candidate)",
        "sglang.md §9 #5: issue #19212 / PR #23537 (host-leaf test used child.evicted instead of "
        "child.backuped)",
        (
            Edit(
                f"{_TREE}._update_leaf_status",
                "            if node.state.evicted:\n"
                "                host_leaf = not any(c.state.backuped for c in node.children.values())\n"
                "            else:\n",
                "            if node.state.backuped:\n"
                "                host_leaf = not any(c.state.backuped for c in node.children.values())\n"
                "            if not node.state.evicted:\n",
            ),
        ),
        caught_by="snapshots differ",
        notes="the literal upstream swap (child.evicted for child.backuped) is equivalent here: the "
        "EVICTED-SUFFIX invariant makes every child of an evicted node evicted, hence backed up",
    ),
    Bug(
        "prefetch-host-under-device-node",
        "a prefetch attaches its host-only nodes under a device-only node that a request inserted on the "
        "prefetched path meanwhile",
        "sglang.md §9 #6: PR #22062, PR #30106, PR #31902 (_insert_helper_host still does this in 0.5.20)",
        (
            Edit(
                f"{_TREE}._insert_helper_host",
                "        if not node.backuped:\n",
                "        if False:\n",
            ),
        ),
        caught_by="outcomes differ on CheckPrefetchProgress",
    ),
    Bug(
        "write-back-failed-backup-as-done",
        "write-back eviction evicts a node whose backup found no host memory as if it had been backed up",
        "sglang.md §9 #7: PR #27108, PR #28614 (write_backup(write_back=True) returns 0 when host "
        "allocation fails; the caller still evicts)",
        (
            Edit(
                f"{_TREE}.evict",
                "elif self.write_backup(x, write_back=True) > 0:",
                "elif self.write_backup(x, write_back=True) >= 0:",
            ),
        ),
        # The eviction runs in an Evict or in a StartRequest's allocation; either fails on the node left on the
        # device by the backup that never started (no transition from 'device' on 'evict_backuped').
        caught_by="outcomes differ on ",
    ),
    Bug(
        "host-pages-freed-under-load",
        "load_back does not pin the host pages it is about to copy, so the nested eviction (write-back "
        "-> write_backup -> evict_host) frees them before the host->device copy",
        "sglang.md §9 #8: PR #27631, PR #27562, PR #31427 / issue #30321 (host pages of nodes being "
        "loaded freed by re-entrant evict -> write_backup -> evict_host)",
        (
            Edit(f"{_TREE}.load_back", "            n.protect_host()\n", "            pass\n"),
            Edit(f"{_TREE}.load_back", "            n.release_host()\n", "            pass\n"),
        ),
        caught_by="outcomes differ on StartRequest",
    ),
    Bug(
        "missing-per-layer-wait",
        "the device pool's per-layer accessors read a layer without waiting for its load event",
        "sglang.md §9 #10: PR #22811 (NSA indexer buffer accessors lacked layer_transfer_counter."
        "wait_until; garbled output at a 1e-4 rate)",
        (
            Edit(
                "refcache.gpu.device_pool:KVCache._wait",
                "            self.layer_transfer_counter.wait_until(local)\n",
                "            pass\n",
            ),
        ),
        caught_by="outcomes differ on CompleteIO(queue=IOQueue.LOAD",
    ),
    Bug(
        "prefetch-tail-released-twice",
        "releasing a prefetch's unread tail does not shrink what the operation owns, so a later release "
        "frees the same host slots again",
        "sglang.md §9 #11: issue #13483, PR #31296 (tail of prefetch host indices released twice; host "
        "memory corruption / double free)",
        (Edit(f"{_CTRL}._release_tail_locked", "            op.owned_hi = cut\n", "            pass\n"),),
        caught_by="snapshots differ",
    ),
    Bug(
        "wait-complete-on-empty-hashes",
        "wait_complete counts a prefetch as complete on 0 == 0 before its hit query produced any hash",
        "sglang.md §9 #13: PR #9397 (completed_tokens == len(hash_value) * page_size held for 0 == 0)",
        (
            Edit(
                f"{_TREE}._can_terminate_prefetch",
                "completed = len(op.hash_value) > 0 and op.completed_tokens",
                "completed = op.completed_tokens",
            ),
        ),
        caught_by="outcomes differ on CheckPrefetchProgress",
    ),
    Bug(
        "split-loses-write-through-fragment",
        "splitting a node whose write-through is pending leaves the new prefix fragment out of the "
        "pending entry",
        "sglang.md §9 #15: PR #27072, PR #38480 (split while the D2H ack / L3 SET was pending: the ack "
        "referenced only the suffix)",
        (
            Edit(
                f"{_TREE}._split_inflight",
                "                entry.fragments.insert(entry.fragments.index(child), new_node)\n",
                "                pass\n",
            ),
        ),
        caught_by="snapshots differ",
    ),
    Bug(
        "l3-keys-ignore-namespace",
        "page hashes of a namespace (extra_key / cache_salt) start from the default seed, so two tenants' "
        "identical tokens share L3 objects",
        "sglang.md §9 #16: issue #26747, PRs #37058, #38577, #28931 (L3 page hashes ignored extra_key)",
        (
            Edit(
                f"{_TREE}._prior_hash",
                "        return storage_namespace_seed(namespace)\n",
                "        return storage_namespace_seed(None)\n",
            ),
        ),
        caught_by="snapshots differ",
    ),
    Bug(
        "hash-chain-restarted",
        "a node's page hashes restart the chain instead of continuing from its parent's last hash (as "
        "below a node that has no hashes), so an L3 key encodes a suffix only",
        "sglang.md §9 #17: PR #35269 (nodes inserted before a runtime attach have no hash; their "
        "children restart the chain)",
        (
            Edit(
                f"{_TREE}._prior_hash",
                "        if parent is not self.root_node:\n",
                "        if False:\n",
            ),
        ),
        caught_by="snapshots differ",
    ),
    Bug(
        "evict-host-never-counts",
        "evict_host never adds what it freed to its count, so it evicts every host-only leaf",
        "sglang.md §9 #18: issue #4987 / PR #4989 (num_evicted never incremented)",
        (
            Edit(
                f"{_TREE}.evict_host", "            num_evicted += len(x.host_value)\n", "            pass\n"
            ),
        ),
        caught_by="outcomes differ on EvictHost",
    ),
    Bug(
        "unlock-never-locked",
        "retiring a write-back backup decrements lock_ref of a node the backup never locked",
        "sglang.md §9 #21: bytedance-iaas/sglang#748 (writing_check(write_back=False) on write-back "
        "nodes: dec_lock_ref of unlocked nodes, 'pool memory leak detected')",
        (Edit(f"{_TREE}._finish_write_through", "            if entry.locked:\n", "            if True:\n"),),
        # The backup retires in the write-back eviction's blocking flush, in an Evict or in a StartRequest's
        # allocation: either fails on the dec_lock_ref of the unlocked node.
        caught_by="outcomes differ on ",
    ),
    Bug(
        "eviction-ignores-priority",
        "the eviction heaps order leaves by creation only, ignoring the policy's priority (LRU, LFU, "
        "priority, ...)",
        "peers.md §4 (eviction-policy bugs); sglang.md §3 (priority key of each strategy)",
        (
            Edit(
                "refcache.gpu.hiradix_tree:_LeafHeap._key",
                "        return (*self._priority(node), node.id)\n",
                "        return (node.id,)\n",
            ),
        ),
        caught_by="snapshots differ",
    ),
    Bug(
        "l3-checksum-ignored",
        "an L3 read returns the object's payload even though its checksum does not match",
        "peers.md §4 (silent corruption from storage tiers); the file backend's footer check "
        "(specs/data-plane.md)",
        (
            Edit(
                "refcache.gpu.storage:HiCacheFile._read",
                "elif (actual := self._verify(algorithm, hashed, segments)) != stored:",
                "elif (actual := self._verify(algorithm, hashed, segments)) != stored and False:",
            ),
        ),
        # A payload flip (FaultKind.FLIP_PAYLOAD) makes the unchecked read return wrong bytes, which the
        # implementation's KV content oracle rejects; a zeroed checksum alone would differ only in snapshots.
        caught_by="outcomes differ on CompleteIO(queue=IOQueue.PREFETCH_IO",
        faulty=True,
    ),
    Bug(
        "l3-read-checks-fixed-header-only",
        "an L3 read validates only its object's fixed footer (magic, version, lengths), not the key and page "
        "format, so another key's intact object (a misplaced file) is returned as the requested page",
        "peers.md §4 (silent corruption from storage tiers: objects swapped or renamed); issue #30 item 2 "
        "(a misplaced object was never read back in CI's sample)",
        (
            Edit(
                "refcache.gpu.storage:HiCacheFile._read",
                "        if not problem and not footer.startswith(prefix):\n",
                "        if not problem and not footer.startswith(prefix[: _FIXED.size]):\n",
            ),
        ),
        # The read-back identity check (KVOracle.check_identity) names the object the read returned; before
        # the misplaced fault was aimed modulo the view's length less one, no example read one back.
        caught_by="outcomes differ on CompleteIO(queue=IOQueue.PREFETCH_IO",
        faulty=True,
    ),
    Bug(
        "prefetch-hits-reduced-by-max",
        "the prefetch thread reduces the ranks' storage hit counts with MAX instead of MIN, so a rank whose "
        "L3 view lacks a page the others have is told to read pages it never found",
        "sglang.md (prefetch thread: MIN all-reduce of storage_hit_count over prefetch_hits_sync_groups, so "
        "that every rank fetches the same prefix length); issue #30 item 1 (the ranks' L3 views never "
        "differed at a hit query)",
        (
            Edit(
                f"{_CTRL}._prefetch_query_job",
                'yield AllReduce(ReduceOp.MIN, (local_hits,), channel="prefetch")',
                'yield AllReduce(ReduceOp.MAX, (local_hits,), channel="prefetch")',
            ),
        ),
        caught_by="snapshots differ after CompleteIO(queue=IOQueue.PREFETCH_QUERY",
        faulty=True,
        # CI's sample catches it on four ranks, ~700 operations: ddmin's 60 s left 348 on 2 loaded cores.
        max_trace_ops=400,
        notes="needs tp >= 2 and a page present in one rank's L3 view only when the hit query is answered "
        "(situation l3-hit-ranks-disagree)",
    ),
    Bug(
        "prefetch-release-by-min-completed",
        "a finished prefetch takes its host slots up to the MIN over ranks of the completed tokens instead of "
        "this rank's own completed tokens, so the pages a rank read beyond the MIN are never released",
        "sglang.md (check_prefetch_progress: append_host_mem_release(host[min:completed]); the [min, "
        "completed) range leaked in 0.5.20 under sidecar clamps, PR #30738); issue #30 item 1",
        (
            Edit(
                f"{_TREE}._handle_prefetch_result",
                "taken = self.cache_controller.take(op, completed)",
                "taken = self.cache_controller.take(op, min_completed)",
            ),
        ),
        caught_by="snapshots differ",
        faulty=True,
        notes="needs tp >= 2 and a prefetch released while the ranks had read different amounts "
        "(situation prefetch-released-ranks-differ)",
    ),
    Bug(
        "load-stream-newest-first",
        "a finished host->device copy marks the newest unfinished load done instead of its own, so with two "
        "loads in flight the load stream retires them newest first (the older one's lock is held past its copy)",
        "seed §2.3 (one load_stream, per-layer events: copies retire in issue order); issue #30 item 4 (two "
        "or more loads in flight with a completion between them were rarely reached)",
        (
            Edit(
                f"{_CTRL}._load_job",
                "        op.ack.finish_event.set()\n",
                "        next(a for a in reversed(self.ack_load_queue) if not a.finish_event.is_set())"
                ".finish_event.set()\n",
            ),
        ),
        # The load_finished flags (LOAD-STREAM-ORDER, and the snapshot comparison) tell right after the
        # completion; before them only a CheckHicacheEvents between the two completions did.
        caught_by="snapshots differ after CompleteIO(queue=IOQueue.LOAD",
    ),
    Bug(
        "prefetch-anchor-not-touched",
        "a prefetch insert does not refresh its anchor's access time (D-33), so an eviction right after it "
        "takes the anchor, which a request is about to read, before an older leaf",
        "D-33 (0.5.20's _insert_helper_host stamps last_host_node first; refcache touched only the matched "
        "children before); issue #30 item 5 (no prefetch inserted below a non-root anchor before)",
        (
            Edit(
                f"{_TREE}._insert_helper_host",
                "        self._touch(node)\n        matched = 0\n",
                "        matched = 0\n",
            ),
        ),
        # The snapshot carries no access times: only the eviction right after the insert tells (how much and
        # which leaf left the device, the free list's order): outcomes or snapshots differ on that Evict.
        caught_by="Evict(num_tokens=",
    ),
    Bug(
        "split-drops-priority",
        "a split's new node (the prefix part) starts at priority 0 instead of inheriting the split node's",
        "sglang.md §3 (the priority strategy; _split_node copies priority); issue #30 item 5 (priorities "
        "were never non-zero in the default configurations)",
        (
            Edit(
                f"{_TREE}._split_node",
                "        new_node.priority = child.priority\n",
                "        new_node.priority = 0\n",
            ),
        ),
        caught_by="snapshots differ",
    ),
)
