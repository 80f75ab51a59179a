"""``refcache bisect``: a trace replayed (or a fuzz budget spent) on each release of an engine, each in an
environment of its own, built from the engine's install recipe and cached.

The engine's releases come from its versions API: the module ``refcache.engines.NAME.versions`` (or another
one named by the caller), which has ``SUPPORTED`` (the releases, oldest first), ``install_recipe(release)``
(the pip argument lists, in order, that build an environment for it, run in refcache's source root) and
``check_supported(release)`` (raises for a release it does not drive). It is imported by name, as the registry
imports an adapter: the checking side names no engine module.

Environments (``ensure_env``): a virtualenv per release under ``$REFCACHE_CACHE/envs`` (default
``~/.cache/refcache/envs``), named ``ENGINE-RELEASE-KEY``, where KEY is a hash of the recipe, of the
constraints files it names (``-c FILE``) and of the Python version. It is made without pip
(``venv --without-pip``) and filled by this interpreter's pip (``pip --python ENV``), in a temporary
directory renamed into place only when every step succeeded, with ``refcache-env.json`` written last: an
environment that is there is complete, and a warm one is used as it is, without calling pip. Building one
removes the release's environments of older recipes (an SGLang one is about 2.5 GB). An environment made
otherwise (a nox session's, one per release a team keeps) is used as it is when given (``given_env``,
``refcache bisect --env RELEASE=PATH``), once its Python shows the engine's distribution at that release.

A run (``run_release``) is ``ENV/bin/python -m refcache.cli replay TRACE --against model,SYSTEM --json`` (or
``fuzz --profile P``), with this refcache's source first on ``PYTHONPATH``, so every release is driven by the
same refcache; SYSTEM is the registered system whose ``engine`` entry drives that release (else the engine's
name). The model is told where the release behaves otherwise than refcache decided: the trace is replayed
with the fidelity profile SYSTEM follows in that environment (``SystemEntry.followed()``, e.g. the installed
release's ``sglang-0.5.16``) set in its configuration, unless the caller asks for the configuration as recorded (then a release whose behaviour
changed by a decision shows a failure that is that decision, not a bug). Its verdict, compared with the failure of the trace on the reference release (the last release
asked for, unless given), is one of ``Verdict``.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import importlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol

from refcache.check.known import Release, ReleaseRange
from refcache.config import PROFILES
from refcache.errors import TraceFormatError, UsageError
from refcache.hicache.trace import read_trace, write_trace
from refcache.systems import SYSTEMS

__all__ = [
    "CACHE_ENV",
    "EnvError",
    "FailureKey",
    "ReleaseResult",
    "Verdict",
    "Versions",
    "bisect_releases",
    "cache_root",
    "choose_releases",
    "ensure_env",
    "followed",
    "given_env",
    "profiled",
    "recipe_key",
    "run_release",
    "source_root",
    "system_for",
    "versions_of",
]

CACHE_ENV: Final = "REFCACHE_CACHE"
_KEYED: Final = re.compile(r"[0-9a-f]{12}")  # an environment's key (``recipe_key``)
_SPENT: Final = re.compile(r"^[\d,]+ examples, [\d,]+ steps")  # the first line of fuzz's report
MARKER: Final = "refcache-env.json"


class Versions(Protocol):
    """An engine's versions API (module docstring)."""

    @property
    def SUPPORTED(self) -> tuple[str, ...]: ...

    def install_recipe(self, version: str) -> tuple[tuple[str, ...], ...]: ...

    def check_supported(self, version: str) -> None: ...


class EnvError(UsageError):
    """An environment for a release could not be built (``reason``: "unsupported" or "install failed")."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Verdict(enum.StrEnum):
    CLEAN = "clean"  # every step agreed, every invariant held
    SAME = "same failure"  # failed at the reference's step, with its kind, operation and field
    DIFFERENT = "different failure"  # failed otherwise
    KNOWN = "known finding"  # failed with a divergence a --known file lists (fuzz: only such ones)
    FAILED = "failed"  # fuzz: found a divergence that no --known file lists
    CANNOT = "cannot drive"  # unsupported, install failed, import failed, or no verdict


@dataclass(frozen=True)
class FailureKey:
    """What identifies a failure across releases: where it happened and what differed (not the values)."""

    step: int
    kind: str
    op: str
    field: str

    def __str__(self) -> str:
        where = f"step {self.step}: {self.kind}" + (f" on {self.op}" if self.op else "")
        return where + (f" ({self.field})" if self.field else "")


@dataclass
class ReleaseResult:
    release: str
    verdict: Verdict
    detail: str = ""  # the failure, the finding, or why it cannot be driven
    failure: FailureKey | None = None
    env_seconds: float = 0.0  # building the environment (or finding it warm)
    env_built: bool = False  # False: the cached environment was used (pip not called)
    run_seconds: float = 0.0  # the replay or fuzz run
    raw: dict[str, object] = field(default_factory=dict)  # the run's JSON verdict (replay)
    env_given: bool = False  # True: an environment given for the release (``given_env``), not the cache's


def versions_of(engine: str, module: str | None = None) -> Versions:
    """The versions API of ``engine`` (``refcache.engines.ENGINE.versions``, or ``module``). Raises
    ``UsageError`` when there is none."""
    name = module or f"refcache.engines.{engine}.versions"
    try:
        found = importlib.import_module(name)
    except ImportError as error:
        raise UsageError(f"engine {engine!r} has no versions API ({name}: {error})") from error
    for attribute in ("SUPPORTED", "install_recipe", "check_supported"):
        if not hasattr(found, attribute):
            raise UsageError(f"{name} is not a versions API: it lacks {attribute}")
    versions: Versions = found  # a module: checked above, attribute by attribute
    return versions


def choose_releases(versions: Versions, span: str | None, *, post: bool = False) -> list[str]:
    """The releases to run, oldest first: the supported ones within ``span`` ("A..B", "A", "*" or None: all),
    and the ends it names even when they are not supported (they show as "cannot drive: unsupported").
    ``post``: the post releases the API lists (``POST_RELEASES``, where it has them) within ``span`` too; an
    end that is a post release is run either way."""
    listed = tuple(getattr(versions, "POST_RELEASES", ())) if post else ()
    supported = sorted((*versions.SUPPORTED, *listed), key=_order)
    if span is None or span.strip() == "*":
        return supported
    try:
        chosen = ReleaseRange.parse(span)
    except ValueError as error:
        raise UsageError(f"--releases {span!r}: {error}") from None
    releases = [r for r in supported if r in chosen]
    ends = [e.strip() for e in span.split("..")] if ".." in span else [span.strip()]
    for end in ends:
        if end and end not in releases:
            releases.append(end)
    return sorted(releases, key=_order)


def _order(release: str) -> Release:
    try:
        return Release.parse(release)
    except ValueError:
        return Release((10**9,), (4, 0), -1)  # a checkout ("main") after every release


def source_root() -> Path:
    """The directory that holds this refcache's package (and, in a checkout, ``constraints/``)."""
    import refcache

    return Path(refcache.__file__).resolve().parent.parent


def cache_root() -> Path:
    """Where environments are cached: ``$REFCACHE_CACHE/envs``, else ``~/.cache/refcache/envs``."""
    base = os.environ.get(CACHE_ENV)
    return (Path(base) if base else Path.home() / ".cache" / "refcache") / "envs"


def recipe_key(recipe: Sequence[Sequence[str]], root: Path) -> str:
    """A hash of ``recipe``, of every constraints or requirements file it names (read from ``root``), and of
    this Python's version: an environment is rebuilt when any of them changes."""
    digest = hashlib.sha256(json.dumps([list(step) for step in recipe]).encode())
    digest.update(f"python {sys.version_info[0]}.{sys.version_info[1]}".encode())
    for step in recipe:
        for flag, value in itertools.pairwise(step):
            if flag in ("-c", "--constraint", "-r", "--requirement"):
                path = root / value
                digest.update(path.read_bytes() if path.is_file() else b"missing " + value.encode())
    return digest.hexdigest()[:12]


def _python(env: Path) -> Path:
    return env / "bin" / "python"


def ensure_env(
    engine: str,
    release: str,
    versions: Versions,
    *,
    root: Path | None = None,
    cache: Path | None = None,
    log: Callable[[str], None] = lambda line: None,
    recipe: Sequence[Sequence[str]] | None = None,
) -> tuple[Path, bool]:
    """The environment for ``release`` (module docstring) and whether it was built now (False: cached, pip not
    called); ``recipe``: the pip steps to build it with instead of the API's (a source checkout's, labelled
    ``release`` with its version). Raises ``EnvError`` ("unsupported": ``check_supported`` refused it;
    "install failed": a pip step failed, its last lines in the message)."""
    if recipe is None:
        try:
            versions.check_supported(release)
            recipe = versions.install_recipe(release)
        except Exception as error:  # the API's own refusal (UnsupportedError, UsageError)
            raise EnvError("unsupported", str(error)) from error
    root = root or source_root()
    cache = cache or cache_root()
    env = cache / f"{engine}-{release}-{recipe_key(recipe, root)}"
    if (env / MARKER).is_file() and _python(env).exists():
        return env, False
    cache.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{env.name}.", dir=cache))
    try:
        _run([sys.executable, "-m", "venv", "--without-pip", str(scratch)], root, "venv")
        for index, step in enumerate(recipe, 1):
            log(f"pip install {' '.join(step)} ({index}/{len(recipe)})")
            _run(
                [sys.executable, "-m", "pip", "--python", str(_python(scratch)), "install", "-q", *step],
                root,
                f"step {index} (pip install {' '.join(step)})",
            )
        (scratch / MARKER).write_text(json.dumps({"engine": engine, "release": release, "recipe": recipe}))
        if env.exists():  # an incomplete one (no marker) left by a run that was killed
            shutil.rmtree(env)
        os.replace(scratch, env)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    for stale in cache.glob(
        f"{engine}-{release}-*"
    ):  # the same release under an older recipe: its space back
        if stale != env and _KEYED.fullmatch(stale.name.removeprefix(f"{engine}-{release}-")):
            shutil.rmtree(stale, ignore_errors=True)
    return env, True


_INSTALLED: Final = (
    "import sys\n"
    "from importlib import metadata\n"
    "try:\n"
    "    print(metadata.version(sys.argv[1]))\n"
    "except metadata.PackageNotFoundError:\n"
    "    print('')\n"
)


def given_env(engine: str, release: str, env: Path) -> Path:
    """``env``, an environment given for ``release`` (not built here: a nox session's, or one kept per release),
    used as it is once its Python shows the distribution named ``engine`` at ``release`` (a run there drives
    whatever is installed: a wrong one would put its verdict on another release's row). Raises ``EnvError``
    ("not given": no ``bin/python`` there, or another release, or none, of ``engine`` installed)."""
    python = _python(env)
    if not python.exists():
        raise EnvError("not given", f"{env} is not an environment (no bin/python)")
    done = subprocess.run(
        [str(python), "-c", _INSTALLED, engine], capture_output=True, text=True, timeout=300, check=False
    )
    installed = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else ""
    if installed != release:
        raise EnvError(
            "not given",
            f"{env} has {engine} {installed or 'not installed'}, not {release} (--env {release}=PATH)",
        )
    return env


def _run(command: list[str], cwd: Path, what: str) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
        raise EnvError("install failed", f"{what} failed (exit {done.returncode}): {tail}")


def system_for(engine: str, release: str, versions: Versions | None = None) -> str:
    """The registered system that drives ``release`` of ``engine`` (its entry's ``engine`` names both; a post
    release or a checkout is read as the release whose row drives it, where ``versions`` places it with
    ``release(version).version``), else ``engine`` itself (a plugin's system, registered only inside the
    release's environment)."""
    row = getattr(versions, "release", None)
    if callable(row):
        with contextlib.suppress(Exception):  # the API's own refusal: the run says why it cannot drive it
            release = str(row(release).version)
    for name, entry in SYSTEMS.items():
        if entry.engine is not None and entry.engine[0] == engine and release in entry.engine[1]:
            return name
    return engine


_FOLLOWED: Final = (
    "import sys\n"
    "from refcache.systems import SYSTEMS\n"
    "entry = SYSTEMS.get(sys.argv[1])\n"
    "print((entry.followed() if entry is not None else None) or '')\n"
)


def followed(env: Path, system: str, environment: Mapping[str, str]) -> str | None:
    """The fidelity profile ``system`` follows in ``env`` (``SystemEntry.followed()``, asked there: an engine's
    profile may be its installed release's); None when it reads the configuration, when the profile is not
    one of this refcache's ``PROFILES``, or when asking fails (the run then says why it cannot drive)."""
    done = subprocess.run(
        [str(_python(env)), "-c", _FOLLOWED, system],
        env=dict(environment),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    profile = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else ""
    return profile if profile in PROFILES else None


def profiled(trace: Path, profile: str | None, out: Path, fidelity: Mapping[str, bool] | None = None) -> Path:
    """``trace`` with ``profile``'s fidelity options set in its configuration, then ``fidelity``'s (an
    option a bug hunt turns off: the profiles follow one §9 bug, D-07), written to ``out``; ``trace`` itself
    when it is not a HiCache trace (another family's has no such options). Raises ``ConfigError`` for a name
    that is not a fidelity option."""
    try:
        config, ops = read_trace(trace)
    except TraceFormatError:
        return trace
    if profile is not None:
        config = config.with_fidelity(PROFILES[profile])
    write_trace(out, config.with_fidelity(fidelity or {}), ops)
    return out


def run_release(
    env: Path,
    trace: Path | None,
    system: str,
    *,
    known: Sequence[Path] = (),
    minutes: float = 0.0,
    seed: int = 0,
    as_recorded: bool = False,
    fidelity: Mapping[str, bool] | None = None,
    root: Path | None = None,
    timeout: float = 1800.0,
) -> tuple[Verdict, str, FailureKey | None, dict[str, object]]:
    """Replay ``trace`` (or, without one, fuzz for ``minutes``) against ``model`` and ``system`` in ``env``,
    under the profile ``system`` follows (``as_recorded``: a trace under its own configuration), then with
    ``fidelity``'s options (replay only); the verdict
    before it is compared with the reference (``Verdict.SAME`` is never returned: a failure is
    ``DIFFERENT``), what it said, the failure's key, and the replay's JSON record."""
    root = root or source_root()
    against = f"model,{system}"
    extra = [arg for path in known for arg in ("--known", str(path))]
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), environment.get("PYTHONPATH")]))
    environment.setdefault("PYTHONWARNINGS", "ignore")
    profile = None if as_recorded and trace is not None else followed(env, system, environment)
    with tempfile.TemporaryDirectory(prefix="refcache-bisect-") as scratch:
        if trace is not None:
            if profile is not None or fidelity:
                trace = profiled(trace, profile, Path(scratch) / f"{trace.stem}.{profile}.jsonl", fidelity)
            command = ["replay", str(trace), "--against", against, "--json", *extra]
        else:
            command = ["fuzz", "--against", against, "--minutes", str(minutes), "--seed", str(seed)]
            command += ["--shrink-seconds", "0", *(["--profile", profile] if profile else []), *extra]
        environment["REFCACHE_TRACE_DIR"] = scratch
        try:
            done = subprocess.run(
                [str(_python(env)), "-m", "refcache.cli", *command],
                cwd=scratch,
                env=environment,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return Verdict.CANNOT, f"no verdict within {timeout:.0f} s", None, {}
    if trace is None:
        return _fuzz_verdict(done)
    return _replay_verdict(done)


def _last_line(text: str, what: Callable[[str], bool]) -> str | None:
    return next((line for line in reversed(text.splitlines()) if what(line)), None)


def _replay_verdict(
    done: subprocess.CompletedProcess[str],
) -> tuple[Verdict, str, FailureKey | None, dict[str, object]]:
    line = _last_line(done.stdout, lambda text: text.startswith("{"))
    if line is None:
        error = _last_line(done.stderr, lambda text: bool(text.strip())) or f"exit {done.returncode}"
        return Verdict.CANNOT, f"no verdict: {error.strip()}", None, {}
    record: dict[str, object] = json.loads(line)
    verdict = record.get("verdict")
    if verdict == "clean":
        return Verdict.CLEAN, "", None, record
    if verdict == "cannot drive":
        error = _last_line(done.stderr, lambda text: bool(text.strip())) or str(record.get("reason", ""))
        return Verdict.CANNOT, error.strip().removeprefix("error: "), None, record
    if verdict == "crashed":
        key = FailureKey(0, "crashed when opened", "", "")
        return Verdict.DIFFERENT, str(record.get("reason", "")), key, record
    key = FailureKey(
        int(str(record.get("step", 0))),
        str(record.get("kind", "")),
        str(record.get("op", "")),
        str(record.get("field", "")),
    )
    if verdict == "known":
        return Verdict.KNOWN, f"known finding {record.get('finding')}", key, record
    return Verdict.DIFFERENT, str(record.get("summary", "")), key, record


def _fuzz_verdict(
    done: subprocess.CompletedProcess[str],
) -> tuple[Verdict, str, FailureKey | None, dict[str, object]]:
    if done.returncode == 0:
        known = _last_line(done.stdout, lambda text: text.startswith("known findings:"))
        spent = _last_line(done.stdout, lambda text: _SPENT.match(text) is not None) or ""
        detail = "; ".join(part for part in (spent, known) if part)
        return (Verdict.KNOWN if known else Verdict.CLEAN), detail, None, {}
    failed = _last_line(done.stdout, lambda text: text.startswith("FAILED"))
    if failed is None:
        error = (
            _last_line(done.stderr + done.stdout, lambda text: bool(text.strip()))
            or f"exit {done.returncode}"
        )
        return Verdict.CANNOT, error.strip().removeprefix("error: "), None, {}
    return Verdict.FAILED, failed, None, {}


def classify(results: Sequence[ReleaseResult], reference: FailureKey | None) -> None:
    """A failure equal to ``reference`` becomes ``Verdict.SAME`` (in place)."""
    for result in results:
        if result.verdict is Verdict.DIFFERENT and reference is not None and result.failure == reference:
            result.verdict = Verdict.SAME


def bisect_releases(
    releases: Sequence[str],
    check: Callable[[str], ReleaseResult],
    *,
    first_bad: bool,
    on_result: Callable[[ReleaseResult], None] = lambda result: None,
) -> tuple[list[ReleaseResult], str | None]:
    """Run ``check`` on ``releases`` (given oldest first), newest first, so that the reference failure (the
        newest failing release's) is known before the others are classified against it: on every release, or with
        ``first_bad`` a binary search for the first release that fails as the newest one does (the oldest must not;
        a release that cannot be driven is skipped, its neighbours tried instead; a different failure counts as
        not the one looked for). ``on_result`` sees each result once classified. Returns the results run, oldest
        first, and the first bad release (None without ``first_bad``, when the newest does not fail or the oldest
        already does; "A..B" when the releases before B that are left cannot be driven: the first bad one is
    one of A..B)."""
    done: dict[str, ReleaseResult] = {}
    reference: list[FailureKey] = []

    def result(release: str) -> ReleaseResult:
        if release not in done:
            found = check(release)
            if found.failure is not None and not reference:
                reference.append(found.failure)
            classify([found], reference[0] if reference else None)
            done[release] = found
            on_result(found)
        return done[release]

    def tried() -> list[ReleaseResult]:
        return [done[r] for r in releases if r in done]

    if not first_bad:
        for release in reversed(releases):
            result(release)
        return tried(), None
    last = result(releases[-1])
    if last.failure is None or len(releases) < 2:
        return tried(), None
    wanted = last.failure

    def bad(release: str) -> bool | None:  # None: cannot tell (cannot drive)
        found = result(release)
        if found.verdict is Verdict.CANNOT:
            return None
        return found.failure == wanted

    low, high = 0, len(releases) - 1
    if bad(releases[low]) is not False:
        return tried(), None
    while high - low > 1:
        middle = (low + high) // 2
        # the middle first, then its neighbours outwards (a release that cannot be driven is skipped)
        verdict: bool | None = None
        for index in sorted(range(low + 1, high), key=lambda i: (abs(i - middle), i)):
            verdict = bad(releases[index])
            if verdict is not None:
                middle = index
                break
        if verdict is None:  # nothing between low and high can be driven: the first bad one is among them
            return tried(), f"{releases[low + 1]}..{releases[high]}"
        if verdict:
            high = middle
        else:
            low = middle
    return tried(), releases[high]
