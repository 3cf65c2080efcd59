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
from proxy.status import QUEUE_LIMIT, Status, _Watcher, activity_row, event, tokens_of


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
    watcher = _Watcher()
    for _ in range(QUEUE_LIMIT):
        watcher.put(b"x")
    assert not watcher.overflowed
    watcher.put(b"x")
    assert watcher.overflowed
    assert len(watcher.events) == QUEUE_LIMIT


def test_an_event_is_one_name_and_one_line_of_json() -> None:
    text = event("model", {"id": 'a"b\nc'})
    name, data, end = text.split(b"\n", 2)
    assert name == b"event: model"
    assert orjson.loads(data.removeprefix(b"data: ")) == {"id": 'a"b\nc'}
    assert end == b"\n"


def test_a_model_s_since_moves_only_with_its_state() -> None:
    views: list[dict[str, Any]] = [{"id": "m", "state": "unloaded"}]
    status = Status()
    status.bind(lambda: [dict(v) for v in views])
    first = status.models()[0]["since"]
    assert first == status.started
    assert status.models()[0]["since"] == first
    views[0]["state"] = "loading"
    moved = status.models()[0]["since"]
    assert moved >= first
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
