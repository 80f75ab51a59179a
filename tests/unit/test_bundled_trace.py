"""The Mooncake trace shipped in the package (``refcache.sim.mooncake.bundled_trace``) and the reader's
``.gz`` support. Pure Python: runs in the portable sessions too."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

from refcache.errors import TraceFormatError
from refcache.sim.mooncake import BUNDLED_TRACE_NAME, bundled_trace, read_mooncake_trace

DATA = Path(__file__).parent.parent / "data"
EXCERPT = DATA / "mooncake_conversation_head300.jsonl"
# The uncompressed trace as released (refcache/data/README.md states the same figures)
TRACE_REQUESTS = 12_031
TRACE_SHA256 = "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"


def test_a_gz_trace_reads_as_its_plain_text(tmp_path: Path) -> None:
    packed = tmp_path / "head.jsonl.gz"
    packed.write_bytes(gzip.compress(EXCERPT.read_bytes()))
    assert read_mooncake_trace(packed) == read_mooncake_trace(EXCERPT)
    assert read_mooncake_trace(packed, limit=7) == read_mooncake_trace(EXCERPT, limit=7)
    assert len(read_mooncake_trace(str(packed))) == 300  # a str path as well as a Path


def test_a_bad_line_in_a_gz_trace_names_the_file_and_line(tmp_path: Path) -> None:
    packed = tmp_path / "bad.jsonl.gz"
    packed.write_bytes(
        gzip.compress(b'{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}\n')
    )
    with pytest.raises(TraceFormatError, match=rf"^{packed}:1: input_length must be"):
        read_mooncake_trace(packed)


@pytest.mark.parametrize(
    "content",
    [
        b'{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n',  # not compressed
        gzip.compress(EXCERPT.read_bytes())[:2000],  # cut short
        gzip.compress(EXCERPT.read_bytes())[:20] + b"\x00" * 200,  # corrupt after the header
        gzip.compress(b"\xff\xfe not utf-8\n"),
    ],
    ids=["plain-text", "truncated", "corrupt", "not-utf8"],
)
def test_an_unreadable_gz_trace_is_a_format_error_naming_the_file(tmp_path: Path, content: bytes) -> None:
    packed = tmp_path / "broken.jsonl.gz"
    packed.write_bytes(content)
    with pytest.raises(TraceFormatError, match=rf"^{packed}: not (a readable gzip file|UTF-8 text)"):
        read_mooncake_trace(packed)


def test_the_bundled_trace_is_the_released_conversation_trace() -> None:
    path = bundled_trace()
    assert path.name == BUNDLED_TRACE_NAME and path.parent.name == "data" and path.is_file()
    with gzip.open(path, "rb") as file:
        raw = file.read()
    assert hashlib.sha256(raw).hexdigest() == TRACE_SHA256  # unchanged apart from compression
    requests = read_mooncake_trace(path)
    assert len(requests) == TRACE_REQUESTS
    assert requests[:300] == read_mooncake_trace(EXCERPT)  # the tests' excerpt is its head
    # its attribution and licence sit beside it
    readme = (path.parent / "README.md").read_text(encoding="utf-8")
    assert "kvcache-ai/Mooncake" in readme and "Apache License 2.0" in readme and TRACE_SHA256 in readme
    assert "Apache License" in (path.parent / "LICENSE-Apache-2.0.txt").read_text(encoding="utf-8")


def test_a_package_without_the_trace_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import refcache.sim.mooncake as mooncake

    monkeypatch.setattr(mooncake, "BUNDLED_TRACE_NAME", "no_such_trace.jsonl.gz")
    with pytest.raises(FileNotFoundError, match=r"no_such_trace\.jsonl\.gz is missing"):
        mooncake.bundled_trace()


def test_simulate_and_record_default_to_the_bundled_trace() -> None:
    """``refcache simulate`` alone (a fresh install, no trace at hand) runs the bundled trace; ``record``'s
    help says it does too."""
    from typer.testing import CliRunner

    from refcache.cli import app

    result = CliRunner().invoke(app, ["simulate", "--limit", "40", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["trace"] == "mooncake_conversation_trace.jsonl.gz" and report["requests"] == 40
    help_text = " ".join(CliRunner().invoke(app, ["record", "--help"], env={"COLUMNS": "300"}).output.split())
    assert "Default: the Mooncake conversation trace shipped with refcache" in help_text
