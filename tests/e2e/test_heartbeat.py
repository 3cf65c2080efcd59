"""SSE heartbeats: a stream whose upstream is slow to answer (a long prefill) is kept alive."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartGateway
from tests.helpers import sse_events

CHAT = "/v1/chat/completions"


def chat(**fields: object) -> dict[str, object]:
    return {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **fields}


@pytest.fixture
def beating(start_gateway: StartGateway, fake: FakeEngine) -> Running:
    return start_gateway({"fake": fake.url}, "--sse-heartbeat", "0.2", "--first-byte-timeout", "1.5")


@pytest.mark.fault("upstreams", "a long prefill, bridged by heartbeats")
def test_long_prefill_stream_gets_keepalives_then_the_stream(beating: Running, http: httpx.Client) -> None:
    """The gateway starts the SSE response with comments during prefill, then relays the events."""
    started = time.monotonic()
    with http.stream(
        "POST", beating.url + CHAT, json=chat(stream=True), headers={"x-fake": "prefill=1"}
    ) as response:
        first_byte_s = None
        raw = b""
        for chunk in response.iter_raw():
            first_byte_s = first_byte_s or time.monotonic() - started
            raw += chunk
    assert response.headers["content-type"].startswith("text/event-stream")
    assert first_byte_s is not None and first_byte_s < 0.8
    stream = sse_events(raw)
    assert stream[0] == b": keepalive" and len([e for e in stream if e == b": keepalive"]) >= 3
    assert stream[-1] == b"data: [DONE]"
    assert any(e.startswith(b"data: {") for e in stream)


@pytest.mark.fault("upstreams", "error statuses")
def test_upstream_error_after_heartbeats_is_an_error_event(beating: Running, http: httpx.Client) -> None:
    """An upstream error status after the gateway started the stream arrives as one SSE error event."""
    raw = http.post(
        beating.url + CHAT, json=chat(stream=True), headers={"x-fake": "prefill=0.6; status=500"}
    ).content
    error = orjson.loads(sse_events(raw)[-1].removeprefix(b"data: "))["error"]
    assert error["message"] == "fake error"
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.fault("upstreams", "no head before the first-byte timeout")
def test_first_byte_timeout_after_heartbeats_is_an_error_event(beating: Running, http: httpx.Client) -> None:
    """A head that never comes ends the heartbeats with an upstream_timeout error event."""
    raw = http.post(beating.url + CHAT, json=chat(stream=True), headers={"x-fake": "prefill=5"}).content
    error = orjson.loads(sse_events(raw)[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_timeout"


@pytest.mark.fault("upstreams", "a long prefill, bridged by heartbeats")
def test_non_stream_requests_get_no_heartbeats(beating: Running, http: httpx.Client) -> None:
    """A non-stream request during a long prefill gets its JSON answer, no SSE comments."""
    response = http.post(beating.url + CHAT, json=chat(), headers={"x-fake": "prefill=0.6"})
    assert response.status_code == 200 and response.json()["object"] == "chat.completion"
