"""What every command shares: the consoles, the one-line error, and one table of options.

Configuration options carry SGLang's server flag names (``--hicache-write-policy``, ...), with the short
names earlier refcache releases used as aliases; every command that takes an option takes it from here,
under the same name, default and help (``tests/unit/test_cli_options.py`` fails when two commands disagree).
Enum options name their choices in the help text and show a short metavar: typer's default metavar lists
every choice and cuts the option names short at 80 columns. In ``fuzz`` an option left unset is drawn at
random (the ``...OrDrawn`` forms: typer reads the option from ``Annotated[X | None, ...]``, not from
``Annotated[X, ...] | None``).
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Final

import typer
from rich.console import Console
from rich.progress import ProgressColumn, Task
from rich.text import Text
from typer.core import TyperCommand
from typer.models import OptionInfo

from refcache.check.coverage import Coverage
from refcache.check.families import Checks, check_trace_family
from refcache.check.known import KnownFindings, KnownFindingsError, load_known
from refcache.check.plan import PlanError, check_installed
from refcache.config import (
    PROFILES,
    AttentionKind,
    EvictionPolicy,
    HiCacheConfig,
    IOBackend,
    MemLayout,
    PrefetchPolicy,
    WritePolicy,
)
from refcache.errors import TraceFormatError, UsageError
from refcache.systems import BUILT_IN_SYSTEMS, SystemOptions, parse_against, system_options

console = Console()  # the reports
errors = Console(stderr=True)  # error lines and progress bars: stdout keeps the reports


class Command(TyperCommand):
    """A command whose usage line names its arguments plainly (``TRACE``), without the braces typer puts
    around required ones."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:  # typer's (vendored, private) click.Context
        return [
            piece[1:-1] if piece.startswith("{") and piece.endswith("}") else piece
            for piece in super().collect_usage_pieces(ctx)
        ]


def fail(message: str, status: int = 2) -> typer.Exit:
    """Print ``message`` as one error line on stderr; the ``typer.Exit`` to raise (default status 2)."""
    errors.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True, markup=True)
    return typer.Exit(status)


# Configuration fields whose command-line option is not ``--field-name``.
OPTION_NAMES: Final[Mapping[str, str]] = {
    "device_size": "--l1-tokens",
    "hicache_storage_backend": "--hicache-storage-backend",
}


def _option_message(message: str, fields: Iterable[str], names: Mapping[str, str] = OPTION_NAMES) -> str:
    """``message`` (a ``ConfigError`` or ``UsageError`` naming configuration fields, ``device_size=-5``)
    with each of ``fields`` named by its command-line option instead (``--l1-tokens -5``); ``names``: the
    options whose name is not ``--field-name``."""
    for name in sorted(fields, key=len, reverse=True):
        option = names.get(name, "--" + name.replace("_", "-"))
        message = re.sub(rf"\b{name}=", f"{option} ", message)
        message = re.sub(rf"\b{name}\b", option, message)
    return message


class LedgerColumn(ProgressColumn):
    """Examples and steps as a coverage ledger counts them: read at every refresh, so the numbers move
    while an example runs and end equal to the final report's."""

    def __init__(self, ledger: Coverage) -> None:
        super().__init__()
        self.ledger = ledger

    def render(self, task: Task) -> Text:
        return Text(f"{self.ledger.runs:,} examples, {self.ledger.steps:,} steps")


# --- the option table -------------------------------------------------------------------------------------
_DRAWN = " Unset: drawn at random for each example."


def _choices(kind: type[enum.StrEnum]) -> str:
    return ", ".join(member.value for member in kind)


def _page_size(extra: str = "") -> OptionInfo:
    info: OptionInfo = typer.Option(
        "--page-size", min=1, metavar="N", help="Tokens per page (SGLang --page-size)." + extra
    )
    return info


def _tp_size(extra: str = "") -> OptionInfo:
    info: OptionInfo = typer.Option(
        "--tp-size", "--tp", min=1, metavar="N", help="Tensor-parallel ranks (SGLang --tp-size)." + extra
    )
    return info


def _attention(extra: str = "") -> OptionInfo:
    info: OptionInfo = typer.Option(
        "--attention", metavar="KIND", case_sensitive=False, help="MHA or MLA." + extra
    )
    return info


def _enum_option(
    names: tuple[str, ...], kind: type[enum.StrEnum], metavar: str, extra: str = ""
) -> OptionInfo:
    info: OptionInfo = typer.Option(
        *names, metavar=metavar, help=f"SGLang {names[0]}: {_choices(kind)}.{extra}"
    )
    return info


_WRITE = ("--hicache-write-policy", "--write-policy")
_PREFETCH = ("--hicache-storage-prefetch-policy", "--prefetch-policy")
_EVICTION = ("--radix-eviction-policy", "--eviction-policy")
_IO = ("--hicache-io-backend", "--io-backend")
_LAYOUT = ("--hicache-mem-layout", "--mem-layout")

PageSize = Annotated[int, _page_size()]
TpSize = Annotated[int, _tp_size()]
Attention = Annotated[AttentionKind, _attention()]
WritePolicyOption = Annotated[WritePolicy, _enum_option(_WRITE, WritePolicy, "POLICY")]
PrefetchPolicyOption = Annotated[PrefetchPolicy, _enum_option(_PREFETCH, PrefetchPolicy, "POLICY")]
EvictionPolicyOption = Annotated[EvictionPolicy, _enum_option(_EVICTION, EvictionPolicy, "POLICY")]
MemLayoutOption = Annotated[MemLayout, _enum_option(_LAYOUT, MemLayout, "LAYOUT")]

PageSizeOrDrawn = Annotated[int | None, _page_size(_DRAWN)]
TpSizeOrDrawn = Annotated[int | None, _tp_size(_DRAWN)]
AttentionOrDrawn = Annotated[AttentionKind | None, _attention(_DRAWN)]
WritePolicyOrDrawn = Annotated[WritePolicy | None, _enum_option(_WRITE, WritePolicy, "POLICY", _DRAWN)]
PrefetchPolicyOrDrawn = Annotated[
    PrefetchPolicy | None, _enum_option(_PREFETCH, PrefetchPolicy, "POLICY", _DRAWN)
]
EvictionPolicyOrDrawn = Annotated[
    EvictionPolicy | None, _enum_option(_EVICTION, EvictionPolicy, "POLICY", _DRAWN)
]
IOBackendOrDrawn = Annotated[IOBackend | None, _enum_option(_IO, IOBackend, "BACKEND", _DRAWN)]
MemLayoutOrDrawn = Annotated[MemLayout | None, _enum_option(_LAYOUT, MemLayout, "LAYOUT", _DRAWN)]


class StorageBackend(enum.StrEnum):
    """``--hicache-storage-backend``: the L3 backends every system with L3 runs."""

    FILE = "file"


_STORAGE_HELP = "SGLang --hicache-storage-backend: file (L3 in files, with prefetch and backup)."
StorageBackendOption = Annotated[
    StorageBackend | None,
    typer.Option("--hicache-storage-backend", metavar="BACKEND", help=_STORAGE_HELP + " Unset: no L3."),
]
StorageBackendOrDrawn = Annotated[
    StorageBackend | None,
    typer.Option(
        "--hicache-storage-backend",
        metavar="BACKEND",
        help=_STORAGE_HELP + _DRAWN.removesuffix(".") + " (no L3 for an engine adapter, unless chosen).",
    ),
]
L3Alias = Annotated[
    bool | None,
    typer.Option("--l3/--no-l3", help="--l3 is --hicache-storage-backend file; --no-l3: no L3."),
]


def storage_backend(backend: StorageBackend | None, l3: bool | None) -> tuple[str | None, bool]:
    """``(value, chosen)`` of ``hicache_storage_backend`` from ``--hicache-storage-backend`` and its alias
    ``--l3/--no-l3``: ``("file", True)``, ``(None, True)`` for ``--no-l3``, ``(None, False)`` when neither
    was given. Both given and disagreeing: one error line, exit 2."""
    if backend is not None and l3 is False:
        raise fail(f"--hicache-storage-backend {backend.value} and --no-l3 disagree: give one of them")
    if backend is not None:
        return backend.value, True
    if l3 is None:
        return None, False
    return ("file" if l3 else None), True


# One set of defaults for the commands that build a configuration from options (simulate, record).
DEFAULT_L1_TOKENS: Final = 16_384
DEFAULT_WRITE_POLICY: Final = WritePolicy.WRITE_THROUGH

L1Tokens = Annotated[
    int,
    typer.Option(
        metavar="N",
        min=1,
        help="L1 (device) capacity, simulated tokens (default: the README's figures; a Mooncake trace at "
        "16 tokens per block fills it and reaches L2 and L3).",
    ),
]
HiCacheRatio = Annotated[
    float,
    typer.Option(
        "--hicache-ratio",
        "--l2-ratio",
        metavar="X",
        min=0,
        help="L2 capacity as a multiple of L1 (SGLang --hicache-ratio).",
    ),
]
WritePolicyDefaulted = Annotated[
    WritePolicy,
    _enum_option(
        _WRITE,
        WritePolicy,
        "POLICY",
        " Default write_through: an engine with a recorder runs L3 only under it (SGLang 0.5.20's "
        "upstream bug, specs/sglang-adapter.md 'L3'), and simulate then shows the same runs.",
    ),
]
BlockTokens = Annotated[
    int, typer.Option(metavar="N", min=1, max=512, help="Simulated tokens per 512-token trace block.")
]
PrefetchThreshold = Annotated[
    int, typer.Option(metavar="N", min=0, help="Smallest prefetch, simulated tokens (with L3).")
]
Limit = Annotated[int, typer.Option(metavar="N", min=0, help="Only the first N requests (0: all).")]
HiCacheSize = Annotated[
    float,
    typer.Option(
        "--hicache-size",
        "--l2-gb",
        metavar="X",
        min=0,
        help="L2 capacity in GB per rank (SGLang --hicache-size); wins over the ratio.",
    ),
]
PrefetchTimeoutBase = Annotated[float, typer.Option(metavar="X", min=0, help="Seconds (timeout policy).")]
PrefetchTimeoutPerKiToken = Annotated[
    float, typer.Option(metavar="X", min=0, help="Seconds per 1024 tokens (timeout policy).")
]
LoadBackThreshold = Annotated[
    int, typer.Option(metavar="N", min=0, help="Smallest host hit loaded back, tokens.")
]
StorageBatchSize = Annotated[int, typer.Option(metavar="N", min=1, help="Pages per L3 batch.")]
MooncakeTrace = Annotated[
    Path | None,
    typer.Argument(
        exists=True,
        dir_okay=False,
        metavar="TRACE",
        help="A Mooncake request trace (JSON Lines: timestamp, input_length, output_length, hash_ids; .jsonl.gz "
        "read as it is). Default: the Mooncake conversation trace shipped with refcache (12,031 requests, "
        "Apache-2.0, refcache/data/README.md).",
        show_default=False,
    ),
]


def trace_or_bundled(trace: Path | None) -> Path:
    """``trace``, or the bundled Mooncake conversation trace when none was given (one error line, exit 2, when
    the installed package lacks it)."""
    if trace is not None:
        return trace
    from refcache.sim.mooncake import bundled_trace

    try:
        return bundled_trace()
    except FileNotFoundError as error:
        raise fail(str(error)) from error


_SYSTEM_NAMES = ", ".join(BUILT_IN_SYSTEMS) + ", or a plugin's (refcache.systems entry points)"
DEFAULT_AGAINST: Final = "both"
Against = Annotated[
    str,
    typer.Option(
        "--against",
        metavar="SYSTEMS",
        help=f"The systems to run, comma-separated, the first is the reference ({_SYSTEM_NAMES}); "
        "both = model,impl.",
    ),
]
AgainstOne = Annotated[
    str,
    typer.Option(
        "--against",
        metavar="SYSTEM",
        help=f"The one system to run the trace on ({_SYSTEM_NAMES}): model (the reference model), impl (the "
        "implementation), an engine.",
    ),
]

_ORACLE_MODES = ("full", "sampled", "off")
Oracle = Annotated[
    str,
    typer.Option(
        "--oracle",
        metavar="|".join(_ORACLE_MODES),
        help="The implementation's KV content oracle (impl only): full checks every position of every "
        "read, sampled every 8th and the last of each read, off none (fastest).",
    ),
]


def _profile_help() -> str:
    releases = [name for name in PROFILES if name != "refcache"]
    return (
        "Where refcache decided otherwise than SGLang (specs/decisions.md), whose choice: 'refcache' "
        f"(refcache's own), or that of an SGLang release, one profile per supported release and post release: "
        f"{', '.join(releases)}."
    )


Profile = Annotated[str, typer.Option(metavar="refcache|sglang-X.Y.Z", help=_profile_help())]

Verbose = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Everything: the implementation's warnings (among them the storage faults the machines inject, "
        "each saying 'injected fault'), and in replay every step in full.",
    ),
]

TraceArgument = Annotated[
    Path,
    typer.Argument(
        exists=True, dir_okay=False, metavar="TRACE", help="A refcache JSONL trace (specs/trace-format.md)."
    ),
]


# --- fuzz's budget and run (refcache fuzz) ------------------------------------------------------------
Minutes = Annotated[
    float,
    typer.Option(
        metavar="MINUTES",
        min=0,
        help="Stop after this many minutes, checked before every example (0: no time limit).",
    ),
]
Examples = Annotated[
    int,
    typer.Option(
        metavar="N",
        min=0,
        help="Stop after this many examples, both machines together (0: only the time limit).",
    ),
]
Steps = Annotated[
    int,
    typer.Option(
        metavar="N",
        min=1,
        help="Rule steps per example, at most (a step applies one or more operations).",
    ),
]
Batch = Annotated[
    int, typer.Option(metavar="N", min=1, help="Examples one machine runs before the other takes over.")
]
ShrinkSeconds = Annotated[
    float,
    typer.Option(
        metavar="SECONDS",
        min=0,
        help="Shrink a failing run's trace for at most this long (0: keep it whole).",
    ),
]
Jobs = Annotated[
    int,
    typer.Option(
        "--jobs",
        "-j",
        metavar="N",
        min=1,
        help="Worker processes. fuzz: each its own fuzz loop with its own random examples, the budgets the "
        "whole run's. simulate --sweep: one configuration each at a time, the same report as with 1.",
    ),
]
Database = Annotated[
    Path | None,
    typer.Option(
        metavar="DIR",
        file_okay=False,
        help="Hypothesis' example database, shared by the workers (and by later runs, or other machines "
        "on a shared path): a failure found once is replayed first everywhere "
        "(default: hypothesis-db under the trace directory; only a failing example is written, beside "
        "its trace, so that the next run, with any --jobs, tries it first).",
    ),
]
Seed = Annotated[
    int | None,
    typer.Option(
        metavar="N",
        min=0,
        help="The run's seed: the same seed, options and budget draw the same examples (with --jobs, "
        "each worker's; which examples they reach depends on timing). Default: a random one. Printed "
        "when the run starts and written in the header of every trace it writes.",
    ),
]


def system_options_of(systems: tuple[str, ...], oracle: str) -> SystemOptions:
    """The per-system options the command line sets (``refcache.systems.system_options``); exit 2 for a
    bad value or one no system of the run takes."""
    if oracle not in _ORACLE_MODES:
        raise fail(f"--oracle {oracle!r} is not one of {', '.join(_ORACLE_MODES)}")
    if oracle == "full":  # the default: every system's own default
        return {}
    try:
        return system_options(systems, {"oracle": oracle})
    except UsageError as error:
        raise fail(_option_message(str(error), ["oracle"])) from error


def _log_level(verbose: bool) -> None:
    """Keep the implementation's warnings (``refcache.gpu`` loggers: failed L3 reads and writes, which
    the fault-injecting machines cause on purpose) out of the console unless ``verbose``."""
    logging.getLogger("refcache.gpu").setLevel(logging.WARNING if verbose else logging.ERROR)


def against_systems(text: str) -> tuple[str, ...]:
    """``--against``'s systems (``parse_against``); a bad name is a usage error naming the option."""
    try:
        return parse_against(text)
    except UsageError as error:
        raise typer.BadParameter(str(error), param_hint="--against") from error


def require_installed(systems: tuple[str, ...]) -> None:
    """Exit 2 with one error line naming the first package ``systems`` need that is not installed, and its
    install command (``check_installed``). Every command calls it once its options are checked, before it
    runs or writes anything."""
    try:
        check_installed(systems)
    except PlanError as error:
        raise fail(str(error)) from error


def read_trace_of(trace: Path, systems: tuple[str, ...]) -> tuple[Checks, HiCacheConfig, int]:
    """Read a refcache trace of the family ``systems`` speak: the family, the configuration and the number of
    operations. A malformed one, or one of another family, is one error line (it names the file and line),
    exit 2."""
    try:
        family = check_trace_family(trace, systems)
        config, length = family.read_config(trace)
    except (TraceFormatError, UsageError, OSError) as error:
        raise fail(str(error)) from error
    return family, config, length


Json = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print one JSON object instead: simulate, the report; replay, the verdict (clean, failed, known, "
        "crashed, cannot drive) and for a divergence its step, kind, operation, field and summary.",
    ),
]


Engine = Annotated[
    str,
    typer.Option(
        metavar="ENGINE",
        help="The engine: record, one with a recorder; bisect, one with a versions API "
        "(refcache.engines.ENGINE.versions: its releases and how to install each).",
    ),
]


# --- known findings (refcache fuzz, replay) -----------------------------------------------------------
Known = Annotated[
    list[Path] | None,
    typer.Option(
        "--known",
        metavar="FILE",
        exists=True,
        dir_okay=False,
        help="A known-findings file (specs/sglang-known.json; refcache.check.known), repeatable: a divergence "
        "that matches one of its findings is reported as that finding, not as a failure (fuzz goes on with "
        "the next example; the exit status counts only unknown divergences).",
    ),
]


def known_findings(paths: list[Path] | None) -> KnownFindings | None:
    """``--known``'s findings (None without the option); a bad file is one error line naming it, the entry
    and the field, exit 2."""
    if not paths:
        return None
    try:
        return load_known(paths)
    except KnownFindingsError as error:
        raise fail(str(error)) from error
