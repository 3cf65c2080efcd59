"""`python -m perf translation` measures what it says: whole streams in each API, and a report with its rows.

No figure is asserted: timings belong in perf/, not in tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from perf.assembly import mlx_stream
from perf.translation import APIS, TOKENS, KeptWriter, relay_once, translate_once

ROOT = Path(__file__).resolve().parents[2]


def _last_event(body: bytes) -> bytes:
    return body.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]


def test_the_relay_benchmark_relays_the_whole_stream_to_its_end() -> None:
    """The chat relay measured hands on every byte of the stream, [DONE] last, and counts them."""
    reads = mlx_stream(16)
    writer = KeptWriter()
    outcome = relay_once(reads, writer)
    assert bytes(writer.body) == b"".join(reads)
    assert outcome.bytes_out == len(writer.body)
    assert outcome.error is None


@pytest.mark.parametrize("whole", [False, True], ids=["a-read-per-event", "one-read"])
def test_the_translation_benchmark_streams_every_token_in_its_api(whole: bool) -> None:
    """Each translated stream measured ends as its API ends, with every token's text and the usage."""
    reads = mlx_stream(16)
    if whole:
        reads = [b"".join(reads)]
    for api, last in (("messages", b"event: message_stop"), ("responses", b"event: response.incomplete")):
        writer = KeptWriter()
        outcome = translate_once(api, reads, writer)
        assert outcome.status == 200 and outcome.error is None, api
        assert _last_event(bytes(writer.body)).startswith(last), api
        assert bytes(writer.body).count(b'" word"') >= 16, api
        assert b'"output_tokens":16' in writer.body, api


def test_the_reply_benchmark_builds_each_apis_reply() -> None:
    """A non-stream translation measured builds the whole reply: all the text and the usage."""
    reads = mlx_stream(16)
    for api in APIS:
        outcome = translate_once(api, reads, KeptWriter(), stream=False)
        assert outcome.status == 200 and outcome.bytes_out > 0, api
        assert outcome.translator is not None
        reply = orjson.loads(outcome.translator.reply())
        assert " word" * 16 in orjson.dumps(reply).decode(), api
        assert reply["usage"]["output_tokens"] == 16, api


def test_smoke_report_has_its_rows(tmp_path: Path) -> None:
    """`perf translation --smoke` writes its report: a row per stream length, per API and C, no errors."""
    if shutil.which("taskset") is None:
        pytest.skip("taskset (util-linux) is not installed")
    result = subprocess.run(
        [sys.executable, "-m", "perf", "translation", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = (tmp_path / "translation.md").read_text()
    data = orjson.loads((tmp_path / "translation.json").read_bytes())
    assert [row["tokens"] for row in data["in_process"]] == list(TOKENS)
    for row in data["in_process"]:
        for key in ("relay_us", "parse_us", "messages_us", "responses_us", "messages_reply_us"):
            assert row[key] > 0, (key, row)
    cells = {(row["concurrency"], row["api"]) for row in data["end_to_end"]}
    assert cells == {(c, api) for c in (1, 16) for api in ("chat", "messages", "responses")}
    for row in data["end_to_end"]:
        assert row["requests"] > 0 and row["errors"] == 0, row
        # Every stream read to its end: at least the engine's chunks as events, each one.
        assert row["events_per_request"] >= 128, row
    tables = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(tables) == 3 * len(TOKENS) + 6
