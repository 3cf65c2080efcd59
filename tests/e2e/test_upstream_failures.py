"""An upstream that fails once it has the request, over real sockets.

A pooled connection closed without a reply (never sent twice), a stream cut
or malformed mid-way (an error event that parses), silence mid-response (the
read timeout counts silence, not the whole response), an error status (its
Retry-After kept).
"""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.e2e.conftest import FakeEngine, Running, StartFakeEngine, StartGateway, openai_client

CHAT = "/v1/chat/completions"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def chat(**fields: object) -> dict[str, object]:
    return {"model": "fake", "messages": MESSAGES, "max_tokens": 4, **fields}


@pytest.fixture
def http11(start_fake_engine: StartFakeEngine, start_gateway: StartGateway) -> tuple[FakeEngine, Running]:
    """A keep-alive (HTTP/1.1, chunked) fake engine behind its own gateway."""
    fake = start_fake_engine("--http11")
    return fake, start_gateway({"fake": fake.url}, "--read-timeout", "1")


@pytest.mark.fault("upstreams", "a pooled connection closed as it is reused")
def test_empty_reply_on_pooled_connection_is_not_sent_twice(
    http11: tuple[FakeEngine, Running], http: httpx.Client
) -> None:
    """An upstream that took the request and then closed with 0 bytes is not sent it again."""
    fake, gateway = http11
    assert http.post(gateway.url + CHAT, json=chat()).status_code == 200  # pools a connection
    response = http.post(
        gateway.url + CHAT, json=chat(), headers={"x-fake": "prefill=0.2; empty", "x-request-id": "once"}
    )
    assert response.status_code == 502
    assert [r["headers"]["x-request-id"] for r in fake.records()].count("once") == 1


@pytest.mark.fault("upstreams", "a body cut short or malformed mid-way")
def test_malformed_chunk_mid_stream_becomes_an_sse_error_event(
    http11: tuple[FakeEngine, Running],
) -> None:
    """A parse error after the stream started ends it with an error event (openai raises APIError)."""
    _, gateway = http11
    with openai_client(gateway.url) as c:
        stream = c.chat.completions.create(
            model="fake", messages=MESSAGES, max_tokens=5, stream=True, extra_headers={"x-fake": "bad-chunk"}
        )
        with pytest.raises(openai.APIError, match="malformed"):
            list(stream)


@pytest.mark.fault("upstreams", "a body cut short or malformed mid-way")
def test_cut_in_the_middle_of_an_event_still_gives_a_parseable_error(
    gateway: Running, fake: FakeEngine
) -> None:
    """Half an event before the close is held back, so the error event parses as APIError."""
    with openai_client(gateway.url) as c:
        stream = c.chat.completions.create(
            model="fake",
            messages=MESSAGES,
            max_tokens=8,
            stream=True,
            extra_headers={"x-fake": "die-after=2; mid-event"},
        )
        received: list[object] = []
        with pytest.raises(openai.APIError, match="truncated"):
            received.extend(stream)
    assert len(received) == 2


@pytest.mark.fault("upstreams", "silence mid-response, and the total timeout")
def test_upstream_silent_mid_response_times_out(
    http11: tuple[FakeEngine, Running], http: httpx.Client
) -> None:
    """An upstream that stalls after its head no longer hangs the client: stream gets an error event."""
    fake, gateway = http11
    response = http.post(gateway.url + CHAT, json=chat(stream=True), headers={"x-fake": "stall=30"})
    events = [e for e in response.content.split(b"\n\n") if e.strip()]
    error = orjson.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_timeout"
    record = fake.wait_for_record(lambda r: r["closed_at"] is not None)
    assert record["outcome"] == "peer_closed"


@pytest.mark.fault("upstreams", "silence mid-response, and the total timeout")
def test_upstream_silent_mid_json_body_cuts_the_response(
    http11: tuple[FakeEngine, Running], http: httpx.Client
) -> None:
    """A non-stream body that stops arriving is cut, never left hanging or passed as complete."""
    _, gateway = http11
    with pytest.raises(httpx.RemoteProtocolError):
        http.post(gateway.url + CHAT, json=chat(), headers={"x-fake": "stall=30"})


@pytest.mark.fault("upstreams", "error statuses")
def test_upstream_error_keeps_retry_headers(gateway: Running, fake: FakeEngine, http: httpx.Client) -> None:
    """An upstream 503 keeps Retry-After when normalised (openai-python reads it)."""
    response = http.post(gateway.url + CHAT, json=chat(), headers={"x-fake": "status=503"})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "7"


@pytest.mark.fault("upstreams", "silence mid-response, and the total timeout")
def test_read_timeout_is_per_silence_not_per_response(
    http11: tuple[FakeEngine, Running], http: httpx.Client
) -> None:
    """A stream that keeps sending for longer than --read-timeout (1 s here) is not cut."""
    _, gateway = http11
    response = http.post(
        gateway.url + CHAT,
        json=chat(stream=True),
        headers={"x-fake": "chunks=40; chunk-delay=0.05"},
    )
    assert response.content.endswith(b"data: [DONE]\n\n")
    assert b'"error"' not in response.content
