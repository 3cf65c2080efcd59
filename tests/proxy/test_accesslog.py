"""The access log's lines (proxy/accesslog.py): their bytes, and when and how they are written."""

from __future__ import annotations

import asyncio
import gc
import io
import logging
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from proxy import accesslog
from proxy.accesslog import FLUSH_AFTER_S, MAX_LINES, AccessLog, Clock
from proxy.asgi import Scope

ROOT = Path(__file__).resolve().parents[2]

SCOPE: Scope = {
    "method": "POST",
    "path": "/v1/chat/completions",
    "client": ("10.0.0.7", 40000),
    "headers": [],
}
ODD: Scope = {"method": "POST", "path": '/v1/café "x"', "client": None, "headers": []}

# 2026-12-01T20:00:03.123456Z, as time.time_ns() gives it.
AT_NS = 1_796_155_203_123_456_000

# What the gateway printed before lines were buffered (main at 993e768), byte
# for byte, with the time each line now carries after its client.
TEXT = (
    '10.0.0.7 [2026-12-01T20:00:03.123Z] "POST /v1/chat/completions" 200 1234 12.346ms ttfb=0.456ms '
    "overhead=0.100ms model=m1 id=req-1\n"
    '- [2026-12-01T20:00:03.123Z] "POST /v1/café "x"" 400 0 0.500ms ttfb=-ms overhead=-ms model=- id=éid\n'
)
JSON = (
    '{"time":"2026-12-01T20:00:03.123Z","client":"10.0.0.7","method":"POST","path":"/v1/chat/completions",'
    '"request_id":"req-1","model":"m1","status":200,"bytes":1234,"duration_ms":12.346,"ttfb_ms":0.456,'
    '"overhead_ms":0.1}\n'
    '{"time":"2026-12-01T20:00:03.123Z","client":"-","method":"POST","path":"/v1/café \\"x\\"",'
    '"request_id":"éid","model":"","status":400,"bytes":0,"duration_ms":0.5,"ttfb_ms":null,"overhead_ms":null}\n'
)


class Stream(io.StringIO):
    """A real text stream that also counts the writes it is given."""

    writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


@pytest.fixture
def stream() -> Iterator[Stream]:
    """ "blazar.access" set up as the CLI sets it up, on a stream of our own; restored afterwards."""
    logger = accesslog.log
    saved = (logger.handlers[:], logger.level, logger.propagate)
    out = Stream()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield out
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def write_both(access: AccessLog) -> None:
    access.write(
        SCOPE,
        request_id=b"req-1",
        model="m1",
        status=200,
        bytes_out=1234,
        duration_s=0.0123456,
        ttfb_s=0.0004565,
        overhead_s=0.0000995,
    )
    access.write(
        ODD,
        request_id=b"\xe9id",
        model="",
        status=400,
        bytes_out=0,
        duration_s=0.0005,
        ttfb_s=None,
        overhead_s=None,
    )


def write_one(access: AccessLog, request_id: bytes = b"r") -> None:
    access.write(
        SCOPE,
        request_id=request_id,
        model="m1",
        status=200,
        bytes_out=1,
        duration_s=0.001,
        ttfb_s=None,
        overhead_s=None,
    )


@pytest.mark.parametrize(("fmt", "expected"), [("text", TEXT), ("json", JSON)])
def test_lines_are_the_same_bytes_as_before(stream: Stream, fmt: str, expected: str) -> None:
    """Text and JSON lines are byte for byte what the per-line logger wrote ('-' or null when unknown),
    with the time."""
    access = AccessLog(fmt, clock=Clock(lambda: AT_NS))
    write_both(access)  # no running loop: written at once
    assert stream.getvalue() == expected


def test_the_time_is_utc_to_the_millisecond_and_follows_the_clock_across_seconds() -> None:
    """The cached second is formatted again when the second changes; the milliseconds are cut, not rounded."""
    now = [AT_NS]
    clock = Clock(lambda: now[0])
    assert clock() == "2026-12-01T20:00:03.123Z"
    now[0] = AT_NS + 876_543_999  # 03.999999...
    assert clock() == "2026-12-01T20:00:03.999Z"
    now[0] = AT_NS + 877_000_000
    assert clock() == "2026-12-01T20:00:04.000Z"
    now[0] = AT_NS + 86_400 * 10**9 * 31  # a month on: the date too
    assert clock() == "2027-01-01T20:00:03.123Z"


def test_a_line_has_the_time_it_was_written(stream: Stream) -> None:
    """With the real clock: each line's time is between the times before and after it was written."""
    before = Clock()()
    write_both(AccessLog("text"))
    after = Clock()()
    stamps = [line.split(" ")[1].strip("[]") for line in stream.getvalue().splitlines()]
    assert len(stamps) == 2 and all(before <= stamp <= after for stamp in stamps), (before, stamps, after)


@pytest.mark.parametrize(
    ("fmt", "tail"),
    [
        ("text", " id=req-1 upstream=10.0.0.1:80,10.0.0.2:80\n"),
        ("json", ',"overhead_ms":0.1,"upstream":["10.0.0.1:80","10.0.0.2:80"]}\n'),
    ],
)
def test_a_moved_request_lists_every_server_tried(stream: Stream, fmt: str, tail: str) -> None:
    """A request that moved ends its line with the servers it tried, in order (nginx's $upstream_addr);
    the rest of the line is the same bytes as without."""
    access = AccessLog(fmt, clock=Clock(lambda: AT_NS))
    access.write(
        SCOPE,
        request_id=b"req-1",
        model="m1",
        status=200,
        bytes_out=1234,
        duration_s=0.0123456,
        ttfb_s=0.0004565,
        overhead_s=0.0000995,
        upstreams=["10.0.0.1:80", "10.0.0.2:80"],
    )
    plain = (TEXT if fmt == "text" else JSON).splitlines()[0]
    line = stream.getvalue()
    assert line.endswith(tail), line
    if fmt == "text":
        assert line == plain + tail[len(" id=req-1") :]
    else:
        assert line == plain[:-1] + tail[len(',"overhead_ms":0.1') :]


@pytest.mark.anyio
async def test_lines_wait_for_one_write_per_batch(stream: Stream) -> None:
    """On the loop, lines wait in a buffer; the timer writes them all in one write, without a flush call."""
    access = AccessLog()
    for index in range(5):
        write_one(access, b"%d" % index)
    assert stream.getvalue() == "" and access.pending() == 5
    await asyncio.sleep(FLUSH_AFTER_S * 4)
    assert access.pending() == 0
    assert [line.rsplit("id=", 1)[1] for line in stream.getvalue().splitlines()] == ["0", "1", "2", "3", "4"]
    assert stream.writes == 1


@pytest.mark.anyio
async def test_a_full_buffer_is_written_at_once(stream: Stream) -> None:
    """The buffer is bounded: the MAX_LINES-th line writes the batch without waiting for the timer."""
    access = AccessLog()
    for _ in range(MAX_LINES - 1):
        write_one(access)
    assert stream.writes == 0
    write_one(access)
    assert access.pending() == 0 and stream.writes == 1
    assert len(stream.getvalue().splitlines()) == MAX_LINES


class _Scope(dict[str, object]):
    """A scope that a weak reference can watch."""


@pytest.mark.anyio
async def test_a_waiting_line_holds_nothing_of_its_request(stream: Stream) -> None:
    """A line waits as text and numbers: the request's scope (its headers, its extensions) is freed
    when the request ends, not when the batch is written, and the line still says who asked."""
    scope = _Scope(method="POST", path="/v1/chat/completions", client=("10.0.0.7", 1), headers=[])
    watched = weakref.ref(scope)
    access = AccessLog()
    access.write(
        scope,
        request_id=b"r",
        model="m1",
        status=200,
        bytes_out=1,
        duration_s=0.001,
        ttfb_s=None,
        overhead_s=None,
    )
    del scope
    assert access.pending() == 1 and watched() is None
    access.flush()
    assert (
        stream.getvalue().startswith("10.0.0.7 [") and '"POST /v1/chat/completions" 200' in stream.getvalue()
    )


def test_lines_left_by_a_closed_loop_go_with_the_next_loops_line(stream: Stream) -> None:
    """Lines of a loop that closed before its timer ran are written by the next line, on a new loop."""
    access = AccessLog()

    async def one(request_id: bytes) -> None:
        write_one(access, request_id)

    asyncio.run(one(b"first"))
    assert access.pending() == 1
    asyncio.run(one(b"second"))
    assert "id=first" in stream.getvalue()


@pytest.mark.anyio
async def test_other_handlers_get_one_record_per_line(stream: Stream) -> None:
    """A handler with a formatter of its own, or a level above INFO, is served as logging would serve it."""
    framed_out = io.StringIO()
    framed = logging.StreamHandler(framed_out)
    framed.setFormatter(logging.Formatter("access: %(message)s"))
    quiet_out = io.StringIO()
    quiet = logging.StreamHandler(quiet_out)
    quiet.setLevel(logging.WARNING)
    accesslog.log.addHandler(framed)
    accesslog.log.addHandler(quiet)
    access = AccessLog()
    write_one(access, b"a")
    write_one(access, b"b")
    access.flush()
    assert framed_out.getvalue().splitlines() == [
        f"access: {line}" for line in stream.getvalue().splitlines()
    ]
    assert len(framed_out.getvalue().splitlines()) == 2
    assert quiet_out.getvalue() == ""


def test_a_logger_above_info_costs_no_line(stream: Stream) -> None:
    """With "blazar.access" above INFO nothing is formatted, buffered or written."""
    accesslog.log.setLevel(logging.WARNING)
    access = AccessLog()
    write_one(access)
    assert access.pending() == 0 and stream.getvalue() == ""


def test_lines_still_waiting_at_exit_are_written() -> None:
    """A process whose loop ends before the timer runs still writes its lines, on its way out."""
    script = """
import asyncio, logging, sys
from proxy.accesslog import AccessLog, log
handler = logging.StreamHandler(sys.stderr)
handler.setFormatter(logging.Formatter("%(message)s"))
log.addHandler(handler)
log.setLevel(logging.INFO)
access = AccessLog()

async def main():
    for n in range(3):
        access.write({"method": "POST", "path": "/v1/completions", "client": ("127.0.0.1", 1), "headers": []},
            request_id=b"exit-%d" % n, model="m", status=200, bytes_out=1, duration_s=0.001,
            ttfb_s=None, overhead_s=None)
    assert access.pending() == 3

asyncio.run(main())
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert [line.rsplit("id=", 1)[1] for line in done.stderr.splitlines()] == ["exit-0", "exit-1", "exit-2"]


def test_a_stream_that_cannot_be_written_fails_no_request(
    stream: Stream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A closed stream is logging's error to report, not an exception for the request filling the batch."""
    monkeypatch.setattr(logging, "raiseExceptions", False)
    stream.close()
    access = AccessLog()
    for _ in range(MAX_LINES):
        write_one(access)
    assert access.pending() == 0


ODD_PREFIX = 'a "b" c\\d\n\x00\u2028é'
ODD_MODEL = ODD_PREFIX + "z" * 80


def _write_not_found(access: AccessLog, model: str) -> None:
    """The line of a 404 for ``model``, as the relay writes it."""
    access.write(
        SCOPE,
        request_id=b"r",
        model=model,
        status=404,
        bytes_out=180,
        duration_s=0.001,
        ttfb_s=None,
        overhead_s=None,
    )


def test_an_unknown_model_in_a_text_line_is_cut_and_escaped(stream: Stream) -> None:
    """A model name no route serves is cut to 64 characters and escaped nginx-style: the line keeps
    its fields (split on spaces) and its one line."""
    access = AccessLog("text")
    shown = access.asked_model(ODD_MODEL)
    assert shown == r"a\x20\x22b\x22\x20c\x5Cd\x0A\x00\u2028é" + "z" * (64 - len(ODD_PREFIX)) + "…"
    assert access.asked_model("gpt-4o") == "gpt-4o"
    _write_not_found(access, shown)
    (line,) = stream.getvalue().split("\n")[:-1]
    assert line.split(" ")[-2] == "model=" + shown
    assert len(line.split(" ")) == len(TEXT.splitlines()[0].split(" "))


def test_an_unknown_model_in_a_json_line_is_as_given_but_cut(stream: Stream) -> None:
    """JSON carries the client's name as given, cut to 64 characters."""
    access = AccessLog("json")
    shown = access.asked_model(ODD_MODEL)
    assert shown == ODD_MODEL[:64] + "…"
    assert access.asked_model("x" * 64) == "x" * 64
    _write_not_found(access, shown)
    (line,) = stream.getvalue().split("\n")[:-1]
    assert orjson.loads(line)["model"] == shown


def test_a_log_no_longer_used_is_not_kept_for_the_flush_at_exit() -> None:
    """The flush at exit holds a log by a weak reference (to the holder it makes): a log no longer
    used goes, with the collector's next pass, and the exit's flush then has nothing to do."""
    access = AccessLog()
    held = weakref.ref(access._at_exit)
    del access
    gc.collect()
    assert held() is None
