"""``refcache bisect``: a trace replayed (or a fuzz budget spent) on each release of an engine, in an environment
per release built from the engine's install recipe and cached (``refcache.check.bisect``); a table of release
-> clean / same failure / different failure / known finding / cannot drive (why)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from refcache.check.bisect import (
    EnvError,
    ReleaseResult,
    Verdict,
    Versions,
    bisect_releases,
    cache_root,
    choose_releases,
    ensure_env,
    given_env,
    run_release,
    system_for,
    versions_of,
)
from refcache.cli.options import Engine, Known, Minutes, Seed, console, errors, fail
from refcache.config import FIDELITY_OPTIONS
from refcache.errors import ConfigError, UsageError

SHORT_HELP = "Replay a trace (or fuzz) on each release of an engine; find the first bad one."

_STYLE = {
    Verdict.CLEAN: "green",
    Verdict.SAME: "red",
    Verdict.DIFFERENT: "magenta",
    Verdict.KNOWN: "yellow",
    Verdict.CANNOT: "dim",
    Verdict.FAILED: "red",
}


def bisect(
    trace: Annotated[
        Path | None,
        typer.Argument(
            exists=True,
            dir_okay=False,
            metavar="[TRACE]",
            help="A refcache JSONL trace to replay on each release (none with --fuzz).",
        ),
    ] = None,
    engine: Engine = "sglang",
    releases: Annotated[
        str | None,
        typer.Option(
            metavar="A..B",
            help="The releases: 'A..B' (inclusive), one release, or '*' (default: every supported release). "
            "An end that is not supported is listed as 'cannot drive'.",
        ),
    ] = None,
    post: Annotated[
        bool,
        typer.Option(
            "--post",
            help="List the post releases in the range too (e.g. 0.5.10.post1 between 0.5.10 and 0.5.11); "
            "without it only releases, and an end named as a post release.",
        ),
    ] = False,
    checkout: Annotated[
        Path | None,
        typer.Option(
            "--checkout",
            exists=True,
            file_okay=False,
            metavar="DIR",
            help="A source checkout of the engine (SGLang: the repository, or its python/ folder) run after "
            "the releases, in an environment built from it (pip install --no-deps -e); newer than the newest "
            "release it is driven as main with that release's rows.",
        ),
    ] = None,
    first_bad: Annotated[
        bool,
        typer.Option(
            "--first-bad",
            help="Binary-search for the first release that fails as the last one does (the first must be clean).",
        ),
    ] = False,
    fuzz_mode: Annotated[
        bool,
        typer.Option("--fuzz", help="Fuzz each release for --minutes instead of replaying a trace."),
    ] = False,
    minutes: Minutes = 1.0,
    seed: Seed = None,
    known: Known = None,
    as_recorded: Annotated[
        bool,
        typer.Option(
            "--as-recorded",
            help="Replay the trace under its own configuration on every release (default: with the "
            "fidelity profile each release's system follows, e.g. sglang-0.5.23, so that a decision is not "
            "shown as a failure).",
        ),
    ] = False,
    fidelity: Annotated[
        list[str] | None,
        typer.Option(
            "--fidelity",
            metavar="OPTION=on|off",
            help="A fidelity option set over each release's profile (repeatable), e.g. "
            "backup_protects_passed_node_only=off to look for the §9 bug the profiles follow (D-07).",
        ),
    ] = None,
    system: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            help="The system to compare with the model on every release (default: the registered system "
            "whose entry drives that release, else the engine's name).",
        ),
    ] = None,
    envs: Annotated[
        list[str] | None,
        typer.Option(
            "--env",
            metavar="RELEASE=PATH",
            help="An environment of one release to use as it is instead of building one (repeatable): a "
            "virtualenv made otherwise, e.g. a nox session's; checked to have the engine at that release.",
        ),
    ] = None,
    versions_module: Annotated[
        str | None,
        typer.Option(
            metavar="MODULE",
            help="The engine's versions API (SUPPORTED, install_recipe, check_supported); default "
            "refcache.engines.ENGINE.versions.",
        ),
    ] = None,
) -> None:
    """Replay TRACE against the model and the engine on each release (or, with --fuzz, fuzz each for
    --minutes), each release in its own virtualenv built from the engine's install recipe and cached under
    $REFCACHE_CACHE/envs (default ~/.cache/refcache/envs), keyed by a hash of the recipe and its constraints
    files: pip runs only to build one, never for a warm one (--env RELEASE=PATH: an environment made
    otherwise, used as it is once it shows that release installed). Then print a table: release -> clean, same
    failure (the step, kind, operation and field of the last failing release's), different failure, known
    finding (--known), or cannot drive (unsupported, install failed, import failed), with the seconds spent
    on the environment and on the run.

    --first-bad binary-searches instead: the first release is expected clean and the last to fail; the
    releases between are tried by halves, and the first one that fails the same way is printed.
    """
    if (trace is None) == (not fuzz_mode):
        raise fail("give a TRACE to replay, or --fuzz (and no trace) to fuzz each release")
    if fuzz_mode and first_bad:
        raise fail("--first-bad needs a TRACE: a fuzz run has no failure to look for on other releases")
    if fuzz_mode and not minutes:
        raise fail("--fuzz --minutes 0 sets no budget")
    try:
        versions = versions_of(engine, versions_module)
        chosen = choose_releases(versions, releases, post=post)
        source = _checkout(versions, checkout) if checkout is not None else None
    except UsageError as error:
        raise fail(str(error)) from error
    if source is not None:
        chosen = [*(r for r in chosen if r != source[0]), source[0]]  # the checkout last: the newest
    if not chosen:
        raise fail(
            f"no supported release of {engine} in {releases!r} (supported: {', '.join(versions.SUPPORTED)})"
        )
    given = _given(envs or [], chosen)
    known_files = [path.resolve() for path in known or []]
    overrides = _fidelity(fidelity or [])
    if overrides and fuzz_mode:
        raise fail("--fidelity applies to a replayed trace, not to --fuzz (fuzz takes a --profile only)")
    fuzz_seed = seed if seed is not None else 0
    where = trace.resolve() if trace is not None else None
    mode = f"fuzz {minutes:g} min, seed {fuzz_seed}" if fuzz_mode else f"replay {trace}"
    console.print(
        f"bisect {engine}: {', '.join(chosen)}; {mode}; environments in {cache_root()}",
        highlight=False,
        soft_wrap=True,
    )

    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=errors
    ) as bar:

        def check(release: str) -> ReleaseResult:
            task = bar.add_task(f"{release}: environment", total=None)
            started = time.monotonic()
            try:
                if release in given:
                    env, built = given_env(engine, release, given[release]), False
                else:
                    env, built = ensure_env(
                        engine,
                        release,
                        versions,
                        log=lambda line: bar.update(task, description=f"{release}: {line}"),
                        recipe=source[1] if source is not None and release == source[0] else None,
                    )
            except EnvError as error:
                bar.remove_task(task)
                result = ReleaseResult(release, Verdict.CANNOT, f"{error.reason}: {error}")
                result.env_seconds = time.monotonic() - started
                return result
            env_seconds = time.monotonic() - started
            name = system or system_for(engine, release, versions)
            bar.update(
                task, description=f"{release}: {'fuzz' if fuzz_mode else 'replay'} against model,{name}"
            )
            started = time.monotonic()
            verdict, detail, failure, raw = run_release(
                env,
                where,
                name,
                known=known_files,
                minutes=minutes if fuzz_mode else 0.0,
                seed=fuzz_seed,
                as_recorded=as_recorded,
                fidelity=overrides,
            )
            bar.remove_task(task)
            run_seconds = time.monotonic() - started
            return ReleaseResult(
                release, verdict, detail, failure, env_seconds, built, run_seconds, raw, release in given
            )

        results, first = bisect_releases(chosen, check, first_bad=first_bad, on_result=_line)
    console.print(_table(results), soft_wrap=True)
    if first_bad:
        if first is not None and ".." in first:
            console.print(
                f"first bad release: one of {first} (the ones between cannot be driven)", highlight=False
            )
        elif first is not None:
            console.print(f"first bad release: {first}", highlight=False)
        else:
            console.print(
                "no first bad release: the last release does not fail, or the first already fails (see the table)",
                highlight=False,
            )


def _checkout(versions: Versions, directory: Path) -> tuple[str, tuple[tuple[str, ...], ...]]:
    """(the version a source checkout installs as, the recipe that builds its environment): the versions API's
    ``checkout_version`` and ``checkout_recipe``. Raises ``UsageError`` when the API builds no checkout, or
    this one is no source tree or cannot be placed (``UnsupportedError``, naming the supported releases)."""
    version, recipe = getattr(versions, "checkout_version", None), getattr(versions, "checkout_recipe", None)
    if not callable(version) or not callable(recipe):
        raise UsageError(
            "--checkout: this engine's versions API builds no environment from a source checkout"
        )
    try:
        label, steps = str(version(directory)), recipe(directory)
    except ConfigError as error:  # UnsupportedError: a version it cannot place
        raise UsageError(f"--checkout {directory}: {error}") from error
    return label, tuple(tuple(str(arg) for arg in step) for step in steps)


def _line(result: ReleaseResult) -> None:
    """One line per release as it is done (the progress of a long run)."""
    env = f"env {result.env_seconds:.1f} s {_env_state(result)}"
    console.print(
        f"{result.release}: {result.verdict} ({env}, run {result.run_seconds:.1f} s)"
        + (f": {result.detail}" if result.detail else ""),
        highlight=False,
        markup=False,
        soft_wrap=True,
    )


def _table(results: list[ReleaseResult]) -> Table:
    table = Table("release", "verdict", "failure / why", "env", "run")
    for result in results:
        what = str(result.failure) if result.failure is not None else ""
        if result.verdict in (Verdict.CANNOT, Verdict.KNOWN) or not what:
            what = result.detail or what
        env = f"{result.env_seconds:.1f} s {_env_state(result)}"
        style = _STYLE[result.verdict]
        table.add_row(
            result.release, f"[{style}]{result.verdict}[/{style}]", what, env, f"{result.run_seconds:.1f} s"
        )
    return table


def _env_state(result: ReleaseResult) -> str:
    if result.verdict is Verdict.CANNOT and not result.run_seconds:  # refused or not built
        return "none"
    return "given" if result.env_given else "built" if result.env_built else "cached"


def _given(items: list[str], chosen: list[str]) -> dict[str, Path]:
    """``--env``'s RELEASE=PATH pairs; one that names no chosen release, or no directory, is a usage error."""
    out: dict[str, Path] = {}
    for item in items:
        release, _, path = item.partition("=")
        if release not in chosen or not path or not Path(path).is_dir():
            raise fail(
                f"--env {item!r}: give RELEASE=PATH, RELEASE one of the releases run ({', '.join(chosen)}) "
                "and PATH the directory of its environment"
            )
        out[release] = Path(path).resolve()
    return out


def _fidelity(items: list[str]) -> dict[str, bool]:
    """``--fidelity``'s OPTION=on|off pairs; a bad one is a usage error naming the options."""
    out: dict[str, bool] = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in FIDELITY_OPTIONS.values() or value not in ("on", "off"):
            raise fail(
                f"--fidelity {item!r}: give OPTION=on or OPTION=off, OPTION one of "
                f"{', '.join(sorted(FIDELITY_OPTIONS.values()))}"
            )
        out[name] = value == "on"
    return out
