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
from refcache.check.families import Family, check_trace_family
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
from refcache.ops import Op
from refcache.systems import SYSTEMS, SystemOptions, parse_against, system_options

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


StorageBackendOrDrawn = Annotated[
    StorageBackend | None,
    typer.Option(
        "--hicache-storage-backend",
        metavar="BACKEND",
        help="SGLang --hicache-storage-backend: file (L3 in files). Unset: drawn at random for each example "
        "(no L3 for an engine adapter).",
    ),
]

_SYSTEM_NAMES = ", ".join(SYSTEMS)
Against = Annotated[
    str,
    typer.Option(
        "--against",
        metavar="SYSTEMS",
        help=f"The systems to run, comma-separated, the first is the reference ({_SYSTEM_NAMES}); "
        "both = model,impl.",
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

Profile = Annotated[
    str,
    typer.Option(
        metavar="|".join(PROFILES),
        help="Where refcache decided otherwise than SGLang (specs/decisions.md): follow refcache's "
        "decisions, or SGLang 0.5.20 or 0.5.23 at each one.",
    ),
]

Verbose = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Show the implementation's warnings, among them the storage faults the machines inject "
        "(each says 'injected fault').",
    ),
]

TraceArgument = Annotated[
    Path,
    typer.Argument(
        exists=True, dir_okay=False, metavar="TRACE", help="A refcache JSONL trace (specs/trace-format.md)."
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


def read_trace_of(trace: Path, systems: tuple[str, ...]) -> tuple[Family, HiCacheConfig, list[Op]]:
    """Read a refcache trace of the family ``systems`` speak; a malformed one, or one of another family, is
    one error line (it names the file and line), exit 2."""
    try:
        family = check_trace_family(trace, systems)
        config, ops = family.read_trace(trace)
    except (TraceFormatError, UsageError, OSError) as error:
        raise fail(str(error)) from error
    return family, config, list(ops)
