"""proxy.status: the activity rows, the tokens read from an answer's end, the series, the watchers' queues."""

from __future__ import annotations

import asyncio
from time import perf_counter
from typing import Any

import orjson
import pytest

from proxy.endpoints import CHAT, MESSAGES
from proxy.errors import HTTPError
from proxy.metrics import Metrics
from proxy.relay.outcome import Outcome
from proxy.status import LOG_LINES, QUEUE_LIMIT, Status, _Watcher, activity_row, event, tokens_of


def test_tokens_come_from_each_api_s_usage() -> None:
    chat = b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":17,"total_tokens":26}}\n\n'
    assert tokens_of(chat + b"data: [DONE]\n\n") == 17
    anthropic = b'event: message_delta\ndata: {"usage":{"output_tokens":5}}\n\nevent: message_stop\n'
    assert tokens_of(anthropic) == 5
    responses = b'"usage":{"input_tokens":3,"output_tokens":12,"total_tokens":15}}}\n\n'
    assert tokens_of(responses) == 12
    # The last count wins (a usage that grows, Anthropic's message_start then message_delta).
    assert tokens_of(b'"output_tokens":1} ... "output_tokens":40}') == 40
    assert tokens_of(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n') is None
    assert tokens_of(b"") is None


def finished(stream: bool, tail: bytes, duration_s: float, head_s: float) -> Outcome:
    outcome = Outcome(b"req-1", CHAT)
    outcome.model, outcome.stream, outcome.status = "m", stream, 200
    outcome.head_s, outcome.own_s = head_s, 0.0001
    outcome.tail, outcome.duration_s = tail, duration_s
    return outcome


def test_tokens_per_second_count_over_the_request_s_whole_time() -> None:
    tail = b'"completion_tokens":40}}\n\ndata: [DONE]\n\n'
    row = activity_row(finished(True, tail, duration_s=2.0, head_s=0.5), 0.0)
    assert row["tokens"] == 40
    assert row["tps"] == 20.0
    # A head that came with the last tokens does not make the generation seem instant.
    late = activity_row(finished(True, tail, duration_s=2.0, head_s=1.999), 0.0)
    assert late["tps"] == 20.0
    assert (late["ttft_ms"], late["duration_ms"]) == (1999.0, 2000.0)


def test_a_row_in_flight_has_no_status_and_no_tokens_yet() -> None:
    outcome = Outcome(b"req-2", MESSAGES)
    outcome.model = "m"
    row = activity_row(outcome, 1000.0)
    assert row["in_flight"] is True
    assert (row["status"], row["tokens"], row["tps"], row["duration_ms"], row["ttft_ms"]) == (
        None,
        None,
        None,
        None,
        None,
    )
    assert row["api"] == "messages"
    assert row["cancellable"] is False  # not with an engine yet
    assert row["time"] == pytest.approx(1000.0 + outcome.arrived, abs=0.001)


def test_a_refusal_shows_its_code() -> None:
    outcome = Outcome(b"req-3", CHAT)
    outcome.refuse(HTTPError(429, "busy", code="model_overloaded"))
    outcome.duration_s = 0.001
    row = activity_row(outcome, 0.0)
    assert (row["status"], row["error"]) == (429, "model_overloaded")


def test_the_series_counts_requests_and_the_mean_time_to_first_token() -> None:
    metrics = Metrics()
    status = Status(metrics)
    status.series_point(0.0)  # the start: nothing before it
    stats = metrics.for_model("m")
    for _ in range(20):
        stats.count("chat/completions", 200)
    stats.ttft.observe(0.1)
    stats.ttft.observe(0.3)
    point = status.series_point(10.0)
    assert point["rps"] == 2.0  # 20 requests in a 10 s step
    assert point["ttft_ms"] == pytest.approx(200.0)
    quiet = status.series_point(20.0)
    assert (quiet["rps"], quiet["ttft_ms"], quiet["tps"]) == (0.0, None, None)


def test_the_series_tokens_per_second_come_from_the_requests_that_ended_in_the_step() -> None:
    status = Status(Metrics())
    done = finished(True, b'"completion_tokens":30}', duration_s=1.0, head_s=0.25)
    done.arrived = perf_counter() - 1.0
    status.activity.append(done)
    assert status.series_point(0.0)["tps"] == 30.0


def test_a_watcher_that_does_not_read_is_dropped_not_kept_forever() -> None:
    aborted = []
    watcher = _Watcher(lambda: aborted.append(True))
    for _ in range(QUEUE_LIMIT):
        watcher.put(b"x")
    assert not watcher.overflowed and not aborted
    watcher.put(b"x")
    assert watcher.overflowed and aborted == [True]
    assert not watcher.events  # its backlog is let go


def test_an_event_is_one_name_and_one_line_of_json() -> None:
    text = event("model", {"id": 'a"b\nc'})
    name, data, end = text.split(b"\n", 2)
    assert name == b"event: model"
    assert orjson.loads(data.removeprefix(b"data: ")) == {"id": 'a"b\nc'}
    assert end == b"\n"


def test_a_model_s_since_moves_only_with_its_state(monkeypatch: pytest.MonkeyPatch) -> None:
    views: list[dict[str, Any]] = [{"id": "m", "state": "unloaded"}]
    clock = [1000.0]
    monkeypatch.setattr("proxy.status.time.time", lambda: clock[0])
    status = Status()
    status.bind(lambda: [dict(v) for v in views])
    clock[0] = 1010.0
    assert status.models()[0]["since"] == 1000.0  # the first look: since the gateway started
    clock[0] = 1020.0
    assert status.models()[0]["since"] == 1000.0
    views[0]["state"] = "loading"
    assert status.models()[0]["since"] == 1020.0
    # A model a reload added later: since it was first seen, not since the start.
    views.append({"id": "added", "state": "loaded"})
    clock[0] = 1030.0
    assert [v["since"] for v in status.models()] == [1020.0, 1030.0]
    assert status.model("m") is not None and status.model("other") is None


@pytest.mark.anyio
async def test_changes_coalesce_into_one_update() -> None:
    calls = 0

    def views() -> list[dict[str, Any]]:
        nonlocal calls
        calls += 1
        return [{"id": "m", "state": "loaded"}]

    status = Status()
    status.bind(views)
    for _ in range(5):
        status.changed()
    await asyncio.sleep(0)
    assert calls == 1


def test_a_recorded_request_keeps_no_reply_body_or_frames() -> None:
    """The activity keeps 300 records: each without what it no longer needs (a reply being built,
    a translation, the frames of a refusal's traceback with the request's body in them)."""
    outcome = Outcome(b"req-4", CHAT)

    def refuse(body: bytes) -> None:
        try:
            raise HTTPError(404, "no such model", code="model_not_found")
        except HTTPError as exc:
            outcome.refuse(exc)

    refuse(b"x" * 1000)
    assert outcome.refusal is not None and outcome.refusal.__traceback__ is not None
    outcome.model = "m" * 100_000
    outcome.translator = object()  # type: ignore[assignment]
    outcome.built = object()  # type: ignore[assignment]
    outcome.record({"path": "/v1/chat/completions", "extensions": {}}, None, None)
    assert outcome.refusal.__traceback__ is None
    assert outcome.translator is None and outcome.built is None
    assert len(outcome.model) < 1000
    assert activity_row(outcome, 0.0)["error"] == "model_not_found"


def test_a_long_request_that_ended_in_the_step_counts_behind_newer_ones() -> None:
    status = Status(Metrics())
    now = perf_counter()
    long = finished(True, b'"completion_tokens":100}', duration_s=19.5, head_s=1.0)
    long.arrived = now - 20.0  # ended half a second ago
    short = finished(True, b'"completion_tokens":5}', duration_s=0.1, head_s=0.05)
    short.arrived = now - 15.0  # newer, but ended before the step
    status.activity.extend([long, short])
    assert status.series_point(0.0)["tps"] == round(100 / 19.5, 1)


def test_without_metrics_the_series_counts_the_requests_that_ended_in_each_step() -> None:
    status = Status(None)
    status.series_point(0.0)
    for _ in range(400):
        done = finished(False, b"", duration_s=0.01, head_s=0.005)
        status.activity.append(done)
    first = status.series_point(10.0)
    assert first["rps"] == 30.0  # the 300 the activity holds, in a 10 s step
    assert first["ttft_ms"] == 5.0


async def _stream_events(
    status: Status, scope: dict[str, Any], sent: list[bytes], gone: asyncio.Event
) -> None:
    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            sent.append(message["body"])

    await status.stream(scope, receive, send)  # type: ignore[arg-type]


def _names_and_rows(sent: list[bytes]) -> list[tuple[str, Any]]:
    events = []
    for chunk in sent:
        for text in chunk.split(b"\n\n"):
            if text.startswith(b"event: "):
                name, data = text.split(b"\n", 1)
                events.append((name[7:].decode(), orjson.loads(data.removeprefix(b"data: "))))
    return events


@pytest.mark.anyio
async def test_a_second_watcher_does_not_take_the_first_one_s_changes() -> None:
    """A request that arrived and one that ended between two ticks reach the first watcher, though a
    second one connected in between (its snapshot has them)."""
    status = Status()
    status.bind(list)
    old = Outcome(b"old", CHAT)
    status.activity.append(old)
    scope = {"type": "http", "method": "GET", "extensions": {}}
    first: list[bytes] = []
    second: list[bytes] = []
    gone = asyncio.Event()
    a = asyncio.ensure_future(_stream_events(status, scope, first, gone))
    await asyncio.sleep(0.05)
    new = Outcome(b"new", CHAT)
    status.activity.append(new)
    old.duration_s = 0.1
    b = asyncio.ensure_future(_stream_events(status, scope, second, gone))
    await asyncio.sleep(0.05)
    rows = {
        (row["id"], row["in_flight"])
        for name, data in _names_and_rows(first)
        if name == "activity"
        for row in data["rows"]
    }
    assert ("new", True) in rows and ("old", False) in rows
    snapshot = _names_and_rows(second)[0][1]
    assert [(r["id"], r["in_flight"]) for r in snapshot["activity"]] == [("new", True), ("old", False)]
    gone.set()
    await asyncio.gather(a, b)


@pytest.mark.anyio
async def test_a_watcher_that_takes_nothing_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its write blocked (the client reads nothing): after SEND_TIMEOUT_S its connection is aborted
    and its stream ends; past QUEUE_BYTES waiting, at once."""
    monkeypatch.setattr("proxy.status.SEND_TIMEOUT_S", 0.2)
    status = Status()
    status.bind(list)
    aborted = asyncio.Event()
    scope = {"type": "http", "method": "GET", "extensions": {"blazar.abort": aborted.set}}
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            await never.wait()  # the client's window is full, for good

    await asyncio.wait_for(status.stream(scope, receive, send), 2)  # type: ignore[arg-type]
    assert aborted.is_set()
    assert not status._watchers

    # A backlog past its bytes ends it at once, its write still blocked.
    monkeypatch.setattr("proxy.status.SEND_TIMEOUT_S", 60.0)
    aborted.clear()
    task = asyncio.ensure_future(status.stream(scope, receive, send))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    (watcher,) = status._watchers
    for _ in range(5):
        status._send(event("log", {"child": "c", "lines": ["x" * 1_000_000]}))
    assert aborted.is_set() and watcher.overflowed and watcher.size == 0
    task.cancel()


@pytest.mark.anyio
async def test_head_answers_the_stream_s_headers_only() -> None:
    status = Status()
    status.bind(list)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        raise AssertionError("a HEAD request's answer waits for nothing")

    scope = {"type": "http", "method": "HEAD", "extensions": {}}
    await asyncio.wait_for(status.stream(scope, receive, send), 1)  # type: ignore[arg-type]
    assert sent[0]["status"] == 200 and sent[-1] == {"type": "http.response.body", "body": b""}
    assert not status._watchers


def test_a_flood_of_log_lines_is_said_not_sent() -> None:
    status = Status()
    status._watchers.add(_Watcher())
    for n in range(LOG_LINES + 50):
        status.log_line("c", f"line {n}")
    status._send_logs()
    (watcher,) = status._watchers
    ((name, data),) = _names_and_rows(list(watcher.events))
    assert name == "log" and len(data["lines"]) == LOG_LINES + 1
    assert data["lines"][-1] == "[blazar-proxy: 50 more lines in the log file, not shown here]"
