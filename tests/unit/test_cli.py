"""The command line as a user meets it (issue #15): every command runs the implementation without
``TRITON_INTERPRET`` set, budgets hold, progress counts equal the report's, bad input is one line naming
the option or the file and line (exit 2), and the help fits 80 columns.

The tests that start the implementation skip without torch; the rest run in ``nox -s portable``.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
from rich.console import Console
from typer.testing import CliRunner

import refcache.cli as cli
from refcache.check.coverage import Coverage
from refcache.check.parallel import merged
from refcache.cli import LedgerColumn, app
from refcache.config import HiCacheConfig, WritePolicy
from refcache.hicache.ops import (
    Done,
    FaultKind,
    FinishRequest,
    Observation,
    Op,
    StartRequest,
    StorageFault,
)
from refcache.hicache.recording import Observed, Recording, read_recording, write_recording
from refcache.hicache.snapshot import Snapshot
from refcache.hicache.trace import read_trace, write_trace
from refcache.model import HiCacheModel
from refcache.systems import SYSTEMS, SystemEntry
from refcache.vllm.family import FAMILY as VLLM
from refcache.vllm.family import TRACES as VLLM_TRACES
from refcache.vllm.model import VllmModel
from refcache.vllm.ops import Admit, AdmitResult, VllmObservation, VllmOp

ROOT = Path(__file__).parent.parent.parent
REGRESSIONS = sorted((ROOT / "tests" / "regressions").glob("*.jsonl"))
EXCERPT = ROOT / "tests" / "data" / "mooncake_conversation_head300.jsonl"
CONFIG = HiCacheConfig(device_size=32, hicache_write_policy=WritePolicy.WRITE_THROUGH).resolve()


class Liar(HiCacheModel):
    """The model, except that every finish it reports is ``Done()``: diverges from the model at once."""

    def apply(self, op: Op) -> Observation:
        obs = super().apply(op)
        return Done() if isinstance(op, FinishRequest) else obs


@pytest.fixture
def liar(monkeypatch: pytest.MonkeyPatch) -> str:
    """A registered system ``liar`` (``Liar``), for commands that compare two systems without torch."""
    monkeypatch.setitem(SYSTEMS, "liar", SystemEntry("a model that lies", f"{__name__}:Liar"))
    return "liar"


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``refcache ARGS`` in a fresh interpreter whose environment does not say how Triton runs."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "refcache.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


# --- 1. every entry point chooses the Triton interpreter by itself ----------------------------------------


@pytest.mark.parametrize("trace", REGRESSIONS, ids=[t.stem for t in REGRESSIONS])
def test_replay_against_both_runs_without_the_variable(trace: Path) -> None:
    pytest.importorskip("torch")
    result = run("replay", str(trace), "--against", "both", "-q")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no divergence" in result.stdout


def test_shrink_against_both_runs_without_the_variable() -> None:
    """A passing trace replays on both systems and is found not to fail: status 2, "nothing to shrink"
    (the implementation really ran: without the interpreter choice it would have diverged)."""
    pytest.importorskip("torch")
    result = run("shrink", str(REGRESSIONS[0]), "--against", "both", "--seconds", "5")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "nothing to shrink" in result.stderr


def test_fuzz_against_both_runs_without_the_variable(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    result = run("fuzz", "--against", "both", "--examples", "2", "--hicache-io-backend", "kernel")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 examples" in result.stdout


def test_simulate_against_impl_runs_without_the_variable_and_says_which_backend() -> None:
    torch = pytest.importorskip("torch")
    result = run("simulate", str(EXCERPT), "--limit", "5", "--against", "impl")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "input tokens served" in result.stdout
    if not torch.cuda.is_available():  # item 10: what works by itself, said in one line
        assert "no CUDA device" in result.stderr and "--hicache-io-backend direct" in result.stderr


# --- 2, 3. replay commands and paths ----------------------------------------------------------------------


def test_fuzz_prints_the_replay_command_with_its_systems(
    liar: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REFCACHE_TRACE_DIR", str(tmp_path))
    result = CliRunner().invoke(
        app, ["fuzz", "--against", f"model,{liar}", "--examples", "20", "--shrink-seconds", "0"]
    )
    assert result.exit_code == 1, result.output
    match = re.search(r"replay with: refcache replay (\S+) --against model,liar", result.output)
    assert match is not None, result.output
    assert Path(match.group(1)).exists()


def test_replay_of_a_divergence_prints_no_path_that_is_gone(liar: str, tmp_path: Path) -> None:
    trace = tmp_path / "lie.jsonl"
    write_trace(trace, CONFIG, [StartRequest(1, (1, 2, 3)), FinishRequest(1)])
    result = CliRunner().invoke(app, ["replay", str(trace), "--against", f"model,{liar}"])
    assert result.exit_code == 1 and "DIVERGENCE" in result.output
    for path in re.findall(r"(/\S+\.jsonl)", result.output):
        assert Path(path).exists(), f"{path} printed but does not exist"
    assert "trace written" not in result.output and "replay with" not in result.output


# --- 4, 5. budgets and progress ---------------------------------------------------------------------------


def test_fuzz_holds_its_time_budget() -> None:
    started = time.monotonic()
    result = CliRunner().invoke(app, ["fuzz", "--against", "model", "--minutes", "0.05"])
    elapsed = time.monotonic() - started
    assert result.exit_code == 0, result.output
    assert 3 <= elapsed < 3 + 10, elapsed


def test_fuzz_examples_and_progress_counts_equal_the_report() -> None:
    result = CliRunner().invoke(app, ["fuzz", "--against", "model", "--examples", "7", "--batch", "2"])
    assert result.exit_code == 0, result.output
    counts = re.findall(r"([\d,]+) examples, ([\d,]+) steps", result.output)
    assert len(counts) == 2, result.output  # the progress bar's last state, and the report
    assert counts[0] == counts[1] and counts[0][0] == "7"


def test_the_progress_column_reads_the_ledger_as_it_fills() -> None:
    ledger = Coverage()
    column = LedgerColumn(ledger)
    ledger.runs, ledger.steps = 3, 1234
    assert column.render(None).plain == "3 examples, 1,234 steps"  # type: ignore[arg-type]
    ledger.runs += 1
    assert column.render(None).plain.startswith("4 examples")  # type: ignore[arg-type]


def test_coverage_shows_progress_and_its_report_stays_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    screen = io.StringIO()
    monkeypatch.setattr(cli.options, "errors", Console(file=screen, force_terminal=True, width=100))
    seen: list[str] = []
    render = LedgerColumn.render

    def spy(self: LedgerColumn, task: object) -> object:
        text = render(self, task)  # type: ignore[arg-type]
        seen.append(text.plain)
        return text

    monkeypatch.setattr(LedgerColumn, "render", spy)
    first = CliRunner().invoke(app, ["coverage", "--examples", "3", "--steps", "20"])
    assert any(not line.startswith("0 examples") for line in seen), seen  # the bar moved during the run
    second = CliRunner().invoke(app, ["coverage", "--examples", "3", "--steps", "20"])
    assert first.stdout == second.stdout and re.match(r"\d+ examples, [\d,]+ steps", first.stdout)
    assert "examples" not in first.stdout.splitlines()[1]  # the progress went to stderr, not the report


# --- 7, 8. errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["coverage", "--examples", "0"], "--examples"),
        (["coverage", "--examples", "-1"], "--examples"),
        (["fuzz", "--steps", "0"], "--steps"),
        (["fuzz", "--minutes", "-1"], "--minutes"),
        (["fuzz", "--examples", "-5"], "--examples"),
        (["fuzz", "--batch", "0"], "--batch"),
        (["fuzz", "--shrink-seconds", "-1"], "--shrink-seconds"),
        (["fuzz", "--page-size", "0"], "--page-size"),
        (["fuzz", "--tp-size", "0"], "--tp-size"),
        (["fuzz", "--minutes", "0"], "--minutes"),
        (["shrink", str(REGRESSIONS[0]), "--seconds", "-1"], "--seconds"),
        (["simulate", str(EXCERPT), "--l1-tokens", "-5"], "--l1-tokens"),
        (["simulate", str(EXCERPT), "--limit", "-1"], "--limit"),
        (["simulate", str(EXCERPT), "--block-tokens", "0"], "--block-tokens"),
        (["simulate", str(EXCERPT), "--page-size", "0"], "--page-size"),
        (["simulate", str(EXCERPT), "--tp-size", "0"], "--tp-size"),
        (["simulate", str(EXCERPT), "--hicache-ratio", "-1"], "--hicache-ratio"),
        (["simulate", str(EXCERPT), "--hicache-ratio", "0.5"], "--hicache-ratio"),
        (["simulate", str(EXCERPT), "--storage-batch-size", "0"], "--storage-batch-size"),
        (["simulate", str(EXCERPT), "--drain-every", "0"], "--drain-every"),
        (["simulate", str(EXCERPT), "--audit-every", "-1"], "--audit-every"),
        (["simulate", str(EXCERPT), "--l3-batch-us", "0"], "--l3-batch-us"),
    ],
)
def test_a_bad_count_or_duration_names_its_option_up_front(args: list[str], option: str) -> None:
    started = time.monotonic()
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert option in result.output and "Traceback" not in result.output
    assert "device_size" not in result.output and "hicache_ratio" not in result.output
    assert "no requests" not in result.output
    assert time.monotonic() - started < 5  # refused before anything ran


def test_an_empty_trace_is_named_once(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for command in ("replay", "shrink"):
        result = CliRunner().invoke(app, [command, str(empty)])
        assert result.exit_code == 2 and result.output.count("empty.jsonl") == 1, result.output
    result = CliRunner().invoke(app, ["simulate", str(empty)])
    assert result.exit_code == 2 and result.output.count("empty.jsonl") == 1, result.output


def test_each_command_says_which_trace_format_it_got_and_which_it_expects() -> None:
    result = CliRunner().invoke(app, ["simulate", str(REGRESSIONS[0])])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{REGRESSIONS[0].name}:1:" in result.output
    assert "refcache operation trace" in result.output and "Mooncake request trace" in result.output
    assert "refcache replay" in result.output
    for command in ("replay", "shrink"):
        result = CliRunner().invoke(app, [command, str(EXCERPT)])
        assert result.exit_code == 2 and f"{EXCERPT.name}:1:" in result.output
        assert "Mooncake request trace" in result.output and "refcache simulate" in result.output


def test_config_errors_name_the_options() -> None:
    message = cli._option_message("device_size=-5 must be a positive integer", ["device_size"])
    assert message == "--l1-tokens -5 must be a positive integer"
    message = cli._option_message(
        "raise hicache_ratio above 1 or hicache_size", ["hicache_ratio", "hicache_size"]
    )
    assert message == "raise --hicache-ratio above 1 or --hicache-size"


# --- 9. injected faults -----------------------------------------------------------------------------------


def test_the_implementation_warnings_stay_out_of_the_console_unless_asked() -> None:
    logger = logging.getLogger("refcache.gpu.storage")
    try:
        cli._log_level(verbose=False)
        assert not logger.isEnabledFor(logging.WARNING)
        cli._log_level(verbose=True)
        assert logger.isEnabledFor(logging.WARNING)
    finally:
        logging.getLogger("refcache.gpu").setLevel(logging.NOTSET)


# --- help text --------------------------------------------------------------------------------------------


def test_the_command_list_is_not_cut() -> None:
    result = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["--help"])
    commands = result.output.split("Commands:")[1]
    assert result.exit_code == 0 and "..." not in commands and "…" not in commands
    assert all(len(line) <= 80 for line in result.output.splitlines())


@pytest.mark.parametrize("command", ["fuzz", "coverage", "replay", "shrink", "simulate"])
def test_help_fits_80_columns(command: str) -> None:
    result = CliRunner(env={"COLUMNS": "80"}).invoke(app, [command, "--help"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert "…" not in result.output and "{" not in lines[0]
    if command in ("replay", "shrink"):
        assert lines[0].endswith(" TRACE"), lines[0]
    if command == "simulate":  # optional: the bundled trace by default
        assert lines[0].endswith(" [TRACE]"), lines[0]
    # Docstring paragraphs are reflowed: no line of the description ends far before the margin unless it
    # ends a paragraph.
    paragraphs = result.output.split("\n\n")[1:]
    for paragraph in paragraphs:
        if paragraph.startswith(("Arguments:", "Options:")):
            break
        body = paragraph.splitlines()
        assert all(len(line) > 60 for line in body[:-1]), body


# --- vLLM's family on the command line (refcache.check.families) ------------------------------------------


class VllmLiar(VllmModel):
    """vLLM's model, except that every admission reports one more hit token: diverges at the first admit."""

    def apply(self, op: VllmOp) -> VllmObservation:
        obs = super().apply(op)
        if isinstance(obs, AdmitResult) and obs.admitted:
            return dataclasses.replace(obs, hit_tokens=obs.hit_tokens + 1)
        return obs


@pytest.fixture
def vllm_liar(monkeypatch: pytest.MonkeyPatch) -> str:
    entry = SystemEntry("vLLM's model that lies", f"{__name__}:VllmLiar", family="vllm")
    monkeypatch.setitem(SYSTEMS, "vllm-liar", entry)
    return "vllm-liar"


def test_fuzz_runs_the_vllm_machines() -> None:
    result = CliRunner().invoke(app, ["fuzz", "--against", "vllm-model", "--examples", "4"])
    assert result.exit_code == 0, result.output
    assert "Admit:" in result.output and "node states" not in result.output
    bad = CliRunner().invoke(app, ["fuzz", "--against", "vllm-model", "--examples", "4", "--tp", "2"])
    assert bad.exit_code == 2 and "--tp-size" in bad.output, bad.output


def test_a_vllm_failure_is_found_shrunk_and_replayed(
    vllm_liar: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REFCACHE_TRACE_DIR", str(tmp_path))
    against = f"vllm-model,{vllm_liar}"
    result = CliRunner().invoke(app, ["fuzz", "--against", against, "--examples", "20"])
    assert result.exit_code == 1, result.output
    match = re.search(rf"replay with: refcache replay (\S+) --against {against}", result.output)
    assert match is not None, result.output
    shrunk = Path(match.group(1))
    assert VLLM.is_trace(shrunk.read_text())
    replayed = CliRunner().invoke(app, ["replay", str(shrunk), "--against", against])
    assert replayed.exit_code == 1 and "DIVERGENCE" in replayed.output, replayed.output
    agreed = CliRunner().invoke(app, ["replay", str(shrunk), "--against", "vllm-model"])
    # the status line ("blocks used ...") is cut to the terminal's width after a long operation: its start is
    # what is certain
    assert agreed.exit_code == 0 and "| blocks" in agreed.output, agreed.output
    assert "no divergence, every invariant held" in agreed.output, agreed.output


def test_a_trace_of_one_family_with_systems_of_the_other_is_refused(tmp_path: Path) -> None:
    vllm = tmp_path / "vllm.jsonl"
    VLLM_TRACES.write(vllm, CONFIG, [Admit(0, (1, 2, 3))])
    for command in ("replay", "shrink"):
        result = CliRunner().invoke(app, [command, str(vllm), "--against", "model"])
        assert result.exit_code == 2 and "vLLM" in result.output and "vllm-model" in result.output, (
            result.output
        )
        result = CliRunner().invoke(app, [command, str(REGRESSIONS[0]), "--against", "vllm-model"])
        assert result.exit_code == 2 and "HiCache" in result.output, result.output


def test_a_trace_ending_in_gz_is_written_and_read_compressed(tmp_path: Path) -> None:
    """``.gz`` traces (``refcache.hicache.trace.open_trace``): a recording with its observations and snapshots,
    a plain HiCache trace and a vLLM trace written to ``X.jsonl.gz`` are gzip files, read back equal, and
    ``refcache replay`` replays them (the family told from the decompressed header)."""
    ops: list[Op] = [StartRequest(1, (1, 2, 3, 4)), FinishRequest(1)]
    with HiCacheModel(CONFIG) as model:
        observed: list[Observed | None] = []
        snaps: list[Snapshot | None] = []
        for op in ops:
            observed.append(model.apply(op))
            snaps.append(model.snapshot())
    recorded, plain, vllm = tmp_path / "run.jsonl.gz", tmp_path / "plain.jsonl.gz", tmp_path / "vllm.jsonl.gz"
    write_recording(
        recorded, Recording(CONFIG, ops, observed, snaps, {"engine": "sglang", "version": "0.5.20"})
    )
    write_trace(plain, CONFIG, ops)
    VLLM_TRACES.write(vllm, CONFIG, [Admit(0, (1, 2, 3))])
    for path in (recorded, plain, vllm):
        assert path.read_bytes()[:2] == b"\x1f\x8b", f"{path.name} is gzip"
    back = read_recording(recorded)
    assert (back.ops, back.observed, back.snapshots) == (ops, observed, snaps)
    assert read_trace(plain) == (CONFIG, ops) and VLLM_TRACES.read(vllm)[1] == [Admit(0, (1, 2, 3))]
    for path, against in ((recorded, "model"), (plain, "model"), (vllm, "vllm-model")):
        result = CliRunner().invoke(app, ["replay", str(path), "--against", against])
        assert result.exit_code == 0 and "no divergence" in result.output, result.output


# --- fuzz --jobs (refcache.check.parallel) ----------------------------------------------------------------


def test_fuzz_jobs_share_one_example_budget_and_the_report_sums_the_workers(tmp_path: Path) -> None:
    result = run("fuzz", "--against", "model", "--examples", "9", "--batch", "2", "--jobs", "2",
                 "--database", str(tmp_path / "db"))  # fmt: skip
    assert result.returncode == 0, result.stderr
    bar = re.findall(r"([\d,]+) examples, ([\d,]+) steps", result.stderr)
    report = re.findall(r"([\d,]+) examples, ([\d,]+) steps", result.stdout)
    assert report[0][0] == "9" and bar[-1] == report[0], (result.stdout, result.stderr)


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_passing_fuzz_run_writes_nothing(
    jobs: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No trace, no example database (only a failing example is saved) and no Hypothesis storage in the
    working directory (Hypothesis' constants cache goes to a temporary directory: refcache.check.run)."""
    for name in ("REFCACHE_TRACE_DIR", "HYPOTHESIS_STORAGE_DIRECTORY"):
        monkeypatch.delenv(name, raising=False)
    result = run("fuzz", "--against", "model", "--examples", "6", "--jobs", jobs, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_merged_ledgers_are_the_sum() -> None:
    a, b = Coverage(runs=2, steps=10), Coverage(runs=3, steps=5, first_failure=2)
    a.states["host"], b.states["host"], b.outcomes["x"] = 1, 2, 4
    total = merged([a, b])
    assert (total.runs, total.steps, total.first_failure) == (5, 15, 2)
    assert total.states["host"] == 3 and total.outcomes["x"] == 4


# --- --oracle: per-system options (refcache.systems.system_options) -----------------------------------------


class OracleProbe(HiCacheModel):
    """The model, taking the implementation's ``oracle`` option and remembering the modes it was given."""

    modes: ClassVar[list[str]] = []

    def __init__(self, config: HiCacheConfig, *, oracle: str = "full") -> None:
        super().__init__(config)
        OracleProbe.modes.append(oracle)


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> str:
    entry = SystemEntry("a model taking --oracle", f"{__name__}:OracleProbe", options=("oracle",))
    monkeypatch.setitem(SYSTEMS, "probe", entry)
    OracleProbe.modes.clear()
    return "probe"


def test_the_oracle_option_reaches_the_systems_that_take_it(probe: str, tmp_path: Path) -> None:
    against = f"model,{probe}"
    result = CliRunner().invoke(
        app, ["replay", str(REGRESSIONS[0]), "-q", "--against", against, "--oracle", "off"]
    )
    assert result.exit_code == 0 and OracleProbe.modes == ["off"], result.output
    result = CliRunner().invoke(app, ["fuzz", "--against", against, "--examples", "2", "--oracle", "sampled"])
    assert result.exit_code == 0 and set(OracleProbe.modes) == {"off", "sampled"}, result.output
    OracleProbe.modes.clear()
    result = CliRunner().invoke(app, ["replay", str(REGRESSIONS[0]), "-q", "--against", against])
    assert result.exit_code == 0 and OracleProbe.modes == ["full"], result.output
    for args in (["--against", "model", "--oracle", "off"], ["--against", against, "--oracle", "most"]):
        result = CliRunner().invoke(app, ["replay", str(REGRESSIONS[0]), *args])
        assert result.exit_code == 2 and "--oracle" in result.output, result.output


def test_the_implementation_takes_the_oracle_option() -> None:
    pytest.importorskip("torch")
    result = run("replay", str(REGRESSIONS[0]), "-q", "--against", "both", "--oracle", "sampled")
    assert result.returncode == 0, result.stderr
    result = run("simulate", str(EXCERPT), "--against", "impl", "--limit", "5", "--oracle", "off")
    assert result.returncode == 0, result.stderr


# --- torch threads --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [({}, "1"), ({"REFCACHE_TORCH_THREADS": "3"}, "3"), ({"OMP_NUM_THREADS": "2"}, None)],
)
def test_the_command_gives_torch_one_thread_unless_the_user_chose(
    given: dict[str, str], expected: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("REFCACHE_TORCH_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, ["replay", str(REGRESSIONS[0]), "--against", "model", "-q"])
    assert result.exit_code == 0, result.output
    assert os.environ.get("REFCACHE_TORCH_THREADS") == expected


def test_the_implementation_runs_with_one_torch_thread_from_the_command() -> None:
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k not in ("REFCACHE_TORCH_THREADS", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = str(ROOT)
    code = (
        "import sys; from refcache.cli import app\n"
        "try:\n    app(['replay', sys.argv[1], '-q', '--against', 'both'])\nexcept SystemExit:\n    pass\n"
        "import torch; print('threads', torch.get_num_threads())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(REGRESSIONS[0])],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert "threads 1" in result.stdout, (result.stdout, result.stderr)


def test_a_fuzz_worker_reports_its_failure_and_stops_the_others(
    liar: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker loop in this process (a spawned worker would not see the ``liar`` registered here)."""
    import multiprocessing
    import queue

    from refcache.check.parallel import _worker
    from refcache.check.plan import FuzzPlan

    monkeypatch.setenv("REFCACHE_TRACE_DIR", str(tmp_path))
    context = multiprocessing.get_context("spawn")
    results: queue.Queue[tuple[object, ...]] = queue.Queue()
    shared: dict[str, Any] = {"claimed": context.Value("q", 0), "runs": context.Value("q", 0), "steps": context.Value("q", 0),
              "stop": context.Event(), "results": results}  # fmt: skip
    shared["deadline"] = None
    plan = FuzzPlan("hicache", ("model", liar), {}, steps=20, examples=50, seconds=None, seed=5,
                    database=tmp_path / "db", chunk=5)  # fmt: skip
    _worker(3, plan, shared)
    index, ledger, failure, path, _, _known = results.get_nowait()
    assert index == 3 and failure is not None and path is not None and shared["stop"].is_set()
    assert Path(str(path)).name.endswith("-3.jsonl") and Path(str(path)).exists()
    assert isinstance(ledger, Coverage) and shared["runs"].value == ledger.runs >= 1
    assert any((tmp_path / "db").iterdir())  # the failing example, for every later run sharing the database


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("fuzz", "--steps", "0"), "--steps"),
        (("coverage", "--examples", "-1"), "--examples"),
        (("fuzz", "--minutes", "-1"), "--minutes"),
        (("replay",), "TRACE"),
    ],
)
def test_the_command_reports_a_usage_error_in_one_line(args: tuple[str, ...], option: str) -> None:
    """The console command (``refcache.cli:main``): one line on stderr naming the option, exit 2, no
    usage block or traceback."""
    result = run(*args)
    assert result.returncode == 2, result
    assert result.stderr.strip().count("\n") == 0 and option in result.stderr, result.stderr
    assert result.stdout == ""


# --- --hicache-storage-backend: L3 on an engine whose entry allows it ---------------------------------------


class L3Probe(HiCacheModel):
    """The model, remembering the configurations it ran and the storage faults it was given."""

    configs: ClassVar[list[HiCacheConfig]] = []
    faults: ClassVar[set[FaultKind]] = set()

    def __init__(self, config: HiCacheConfig) -> None:
        super().__init__(config)
        L3Probe.configs.append(config)

    def apply(self, op: Op) -> Observation:
        if isinstance(op, StorageFault):
            L3Probe.faults.add(op.kind)
        return super().apply(op)


@pytest.fixture
def l3probe(monkeypatch: pytest.MonkeyPatch) -> str:
    """A system registered as an engine with L3 is (``SYSTEMS["sglang"]``): no L3 unless chosen, and then
    only with write_through and two fault kinds."""
    entry = SystemEntry(
        "an engine whose L3 runs write_through only",
        f"{__name__}:L3Probe",
        constraints={"tp_size": 1, "hicache_storage_backend": None},
        allows={"hicache_storage_backend": ("file",)},
        fault_kinds=frozenset({FaultKind.DELETE, FaultKind.FAIL_NEXT_READ}),
        with_storage={"hicache_write_policy": (WritePolicy.WRITE_THROUGH, "upstream bug #6")},
    )
    monkeypatch.setitem(SYSTEMS, "l3probe", entry)
    L3Probe.configs.clear()
    L3Probe.faults.clear()
    return "l3probe"


def test_fuzz_draws_l3_on_an_engine_only_when_asked_and_then_what_its_l3_runs_with(l3probe: str) -> None:
    args = ["fuzz", "--against", f"model,{l3probe}", "--examples", "16", "--batch", "4", "--steps", "30"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert L3Probe.configs and all(c.hicache_storage_backend is None for c in L3Probe.configs)
    L3Probe.configs.clear()
    result = CliRunner().invoke(app, [*args, "--hicache-storage-backend", "file"])
    assert result.exit_code == 0, result.output
    assert {(c.hicache_storage_backend, c.hicache_write_policy) for c in L3Probe.configs} == {
        ("file", WritePolicy.WRITE_THROUGH)
    }
    assert L3Probe.faults and L3Probe.faults <= {FaultKind.DELETE, FaultKind.FAIL_NEXT_READ}, L3Probe.faults
    assert "PrefetchFromStorage" in result.output  # the report counts the storage operations reached


@pytest.mark.parametrize(
    ("against", "extra", "wanted"),
    [
        ("model,sglang", ["--hicache-write-policy", "write_back"], ["--hicache-write-policy", "§9 #6"]),
        ("model,sglang-0.5.23", [], ["runs only without --hicache-storage-backend"]),
        ("vllm-model,vllm", [], ["--hicache-storage-backend do not apply"]),
        ("model,sglang", ["--hicache-storage-backend", "memory"], ["'memory'"]),
    ],
)
def test_fuzz_refuses_l3_where_the_systems_do_not_run_it(
    against: str, extra: list[str], wanted: list[str]
) -> None:
    args = ["fuzz", "--against", against, "--hicache-storage-backend", "file", "--examples", "1", *extra]
    started = time.monotonic()
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert all(w in result.output for w in ["--hicache-storage-backend", *wanted]), result.output
    assert "Traceback" not in result.output and "--l3" not in result.output
    assert time.monotonic() - started < 5  # refused before any system was opened


def test_storage_faults_are_drawn_from_the_kinds_every_system_injects() -> None:
    from refcache.check.machines import machine
    from refcache.systems import fault_kinds

    assert fault_kinds(["model", "impl"]) == tuple(FaultKind)  # unchanged where every system injects all
    assert machine(("model", "impl"), faults=True).fault_kinds == tuple(FaultKind)
    assert FaultKind.CORRUPT not in fault_kinds(["model", "sglang"])
    assert FaultKind.DELETE in machine(("model", "sglang"), faults=True).fault_kinds


def test_record_reports_a_two_rank_hang_with_the_recording_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``refcache record`` on two ranks whose collectives went out of step: the recorder writes what it
    salvaged (ending with ``NeverReturned``) and raises ``RankError``; the command says so in one error
    line (the operation, the file, the replay command to run) and exits 1, with no traceback. A
    ``RankError`` without a written recording and a ``RecordingError`` are reported alike; a stale file
    from an earlier run is not taken for this run's recording. (A stub for ``record_run``: a real hang
    takes seconds of SGLang start-up; tests/engines/sglang/test_two_ranks.py records one.)"""
    import refcache.sim.record
    from refcache.errors import RankError, RecordingError
    from refcache.hicache.recording import NeverReturned, Recording, write_recording

    config = HiCacheConfig(tp_size=2, page_size=1, device_size=8).resolve()
    ops: list[Op] = [StartRequest(1, (1, 2, 3, 4)), FinishRequest(1)]
    hang = NeverReturned(0, 3, "hiradix_cache.py:226 _all_reduce_attn_groups", 1, 2)
    trace, out = tmp_path / "trace.jsonl", tmp_path / "hung.jsonl"
    trace.write_text("")
    raised: list[Exception] = []

    def hung(trace: Path, out: Path, *args: Any, **kwargs: Any) -> Any:
        if isinstance(raised[0], RankError) and raised[0].hang is not None:
            write_recording(
                out,
                Recording(config, ops, [None, hang], [None, None], {"engine": "sglang", "version": "0.5.20"}),
            )
        raise raised[0]

    monkeypatch.setattr(refcache.sim.record, "record_run", hung)
    # stubbed: SGLang is not installed here, so the profile it follows cannot be asked of it either
    stub = dataclasses.replace(SYSTEMS["sglang"], requires=(), follows="sglang-0.5.20")
    monkeypatch.setitem(SYSTEMS, "sglang", stub)
    raised.append(RankError("rank 0 waits in all-reduce #3, which rank 1 never entered", 0, hang=hang))
    result = CliRunner().invoke(app, ["record", str(trace), "--out", str(out), "--tp-size", "2"])
    assert result.exit_code == 1 and not isinstance(result.exception, RankError), result.output
    text = " ".join(result.output.split())
    assert "Traceback" not in text, text
    assert "out of step at operation 2: rank 0 waits in all-reduce #3" in text, text
    assert f"written to {out} and ends with the operation that never returned" in text, text
    assert f"refcache replay {out} --against model" in text, text

    raised[0] = RankError("rank 1 died during 'apply' (exit code -9)", 1)  # out is now stale
    result = CliRunner().invoke(app, ["record", str(trace), "--out", str(out), "--tp-size", "2"])
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "Traceback" not in text, text
    assert f"a rank failed: rank 1 died during 'apply' (exit code -9); {out} was not written" in text, text

    raised[0] = RecordingError("the ranks recorded one lock-step operation differently: [(1, 2)]")
    result = CliRunner().invoke(app, ["record", str(trace), "--out", str(out), "--tp-size", "2"])
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "cannot express what the engine did" in text, text
    assert "differently: [(1, 2)]" in text, text

    raised[0] = KeyError("an unrelated bug")  # not the engine's: a traceback, as before
    result = CliRunner().invoke(app, ["record", str(trace), "--out", str(out), "--tp-size", "2"])
    assert isinstance(result.exception, KeyError)
