"""One option table for every command (#29 item 6): an option two commands share has the same names
(aliases included), the same help and the same default; ``fuzz``'s drawn options differ only by drawing
when unset. The exceptions are listed with their reason."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import typer
from typer.core import TyperGroup, TyperOption
from typer.testing import CliRunner

import refcache
from refcache.cli import app
from refcache.config import PROFILES

EXCERPT = Path(__file__).parent.parent / "data" / "mooncake_conversation_head300.jsonl"

DIFFERENT_ON_PURPOSE: Mapping[str, frozenset[str]] = {
    # simulate runs a trace on one system; the other commands compare several. explore searches the model's
    # states and runs other systems in lock step only when asked (every transition replayed: minutes).
    "--against": frozenset({"simulate", "explore"}),
    # explore's configuration is the smallest that exercises L3 prefetch and write-back (specs/exploration.md);
    # record's and simulate's a production-sized cache; and it stops after a depth's chunk, not an example.
    "--page-size": frozenset({"explore"}),
    "--hicache-write-policy": frozenset({"explore"}),
    "--write-policy": frozenset({"explore"}),
    "--l3": frozenset({"explore"}),
    "--no-l3": frozenset({"explore"}),
    "--minutes": frozenset({"explore"}),
    # coverage counts examples per machine (Hypothesis' max_examples); fuzz the whole run's.
    "--examples": frozenset({"coverage"}),
    # what each command writes there differs (a shrunk trace, a recording).
    "--out": frozenset({"shrink", "record"}),
    "-o": frozenset({"shrink", "record"}),
}


def _base(help_text: str) -> str:
    """The help without what a command says about an unset value (``Unset: ...``, ``Default ...``)."""
    for cut in (" Unset:", " Default"):
        help_text = help_text.split(cut)[0]
    return help_text


def disagreements(group: TyperGroup) -> list[str]:
    """Every option two commands of ``group`` share (by any of its names) but declare differently."""
    by_name: dict[str, list[tuple[str, TyperOption]]] = defaultdict(list)
    for command_name, command in group.commands.items():
        for param in command.params:
            if isinstance(param, TyperOption):
                for name in {*param.opts, *param.secondary_opts}:
                    by_name[name].append((command_name, param))
    found: list[str] = []
    for name, uses in sorted(by_name.items()):
        uses = [(c, p) for c, p in uses if c not in DIFFERENT_ON_PURPOSE.get(name, frozenset())]
        for (first, a), (other, b) in itertools.pairwise(uses):
            drawn = any("Unset: drawn" in (p.help or "") for p in (a, b))
            if {*a.opts, *a.secondary_opts} != {*b.opts, *b.secondary_opts}:
                found.append(
                    f"{name}: {first} names it {a.opts + a.secondary_opts}, {other} {b.opts + b.secondary_opts}"
                )
            elif _base(a.help or "") != _base(b.help or ""):
                found.append(f"{name}: {first} and {other} say different things: {a.help!r} / {b.help!r}")
            elif not drawn and a.default != b.default:
                found.append(f"{name}: {first} defaults to {a.default!r}, {other} to {b.default!r}")
            elif a.metavar != b.metavar:
                found.append(f"{name}: {first} shows {a.metavar!r}, {other} {b.metavar!r}")
    return found


def test_every_shared_option_is_declared_once() -> None:
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    assert disagreements(group) == []


def test_the_check_fails_when_two_commands_disagree() -> None:
    toy = typer.Typer()

    @toy.command()
    def one(l1_tokens: int = typer.Option(16384, help="L1 tokens.")) -> None: ...

    @toy.command()
    def two(l1_tokens: int = typer.Option(4096, help="L1 tokens.")) -> None: ...

    @toy.command()
    def three(l1_tokens: int = typer.Option(4096, "--l1-tokens", "--l1", help="L1 tokens.")) -> None: ...

    group = typer.main.get_command(toy)
    assert isinstance(group, TyperGroup)
    found = disagreements(group)
    assert any("defaults to 16384" in f for f in found) and any("names it" in f for f in found), found


def test_simulate_and_record_agree_on_l1_write_policy_and_l3() -> None:
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    for command in ("simulate", "record"):
        options = {p.name: p for p in group.commands[command].params}
        assert options["l1_tokens"].default == 16384
        assert options["hicache_write_policy"].default == "write_through"
        assert {"--l3", "--hicache-storage-backend", "--hicache-ratio", "--l2-ratio"} <= {
            n for p in options.values() if isinstance(p, TyperOption) for n in (*p.opts, *p.secondary_opts)
        }
    assert group.commands["fuzz"].params and any(
        "--l3" in p.opts for p in group.commands["fuzz"].params if isinstance(p, TyperOption)
    )


def test_against_defaults_to_one_value_wherever_it_compares() -> None:
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    defaults = {
        name: p.default
        for name, command in group.commands.items()
        for p in command.params
        if p.name == "against" and name not in DIFFERENT_ON_PURPOSE["--against"]
    }
    assert set(defaults) == {"fuzz", "replay", "shrink"} and set(defaults.values()) == {"both"}


def test_help_names_every_profile_shows_metavars_and_version() -> None:
    runner = CliRunner()
    fuzz_help = runner.invoke(app, ["fuzz", "--help"], terminal_width=200).output
    assert "--profile refcache|sglang-X.Y.Z" in fuzz_help, fuzz_help
    for profile in PROFILES:
        assert profile in fuzz_help, fuzz_help  # every profile by name in the help
    simulate_help = runner.invoke(app, ["simulate", "--help"], terminal_width=200).output
    assert "<str>" not in simulate_help and "--sweep-l2-ratios X,Y,..." in simulate_help
    version = runner.invoke(app, ["--version"])
    assert version.exit_code == 0 and version.output.strip() == f"refcache {refcache.__version__}"


def _report(*args: str) -> dict[str, object]:
    result = CliRunner().invoke(app, ["simulate", str(EXCERPT), "--limit", "40", "--json", *args])
    assert result.exit_code == 0, result.output
    report: dict[str, object] = json.loads(result.stdout)
    return {k: v for k, v in report.items() if k not in ("seconds", "requests_per_second")}


def test_l3_alias_and_the_storage_flag_are_one_option() -> None:
    assert _report("--hicache-storage-backend", "file") == _report("--l3") != _report()
    assert _report("--l2-ratio", "4") == _report("--hicache-ratio", "4") != _report()
    args = ["simulate", str(EXCERPT), "--hicache-storage-backend", "file", "--no-l3"]
    clash = CliRunner().invoke(app, args)
    assert clash.exit_code == 2, clash.output
    assert "error: --hicache-storage-backend file and --no-l3 disagree" in clash.output
