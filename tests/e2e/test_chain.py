"""Chained gateways: A serves model "fake" from gateway B (`--upstream fake=http://B/v1`), B from the engine.

This is how one gateway fronts engines on other hosts. Chaining must keep
what a single gateway promises: streams arrive event by event and end with
[DONE]; responses and errors arrive as B gives them; a failure mid-stream is
one SSE error event; B's 503s keep their Retry-After; a client that leaves
frees the engine; the client's request id reaches the engine.
"""

from __future__ import annotations

import re
import signal
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.e2e.balancers import CHAT, in_flight
from tests.e2e.conftest import FakeEngine, Running, StartGateway, openai_client
from tests.helpers import free_port, wait_until

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def chain(start_gateway: StartGateway, fake: FakeEngine) -> tuple[Running, Running]:
    """(A, B): B in front of the fake engine, A in front of B."""
    b = start_gateway({"fake": fake.url})
    a = start_gateway({"fake": f"{b.url}/v1"})
    return a, b


def text_of(count: int) -> str:
    """What the fake engine generates for ``count`` tokens."""
    return "".join(f"tok{i} " for i in range(count))


def events_of(raw: bytes) -> list[bytes]:
    return [event for event in raw.split(b"\n\n") if event.strip()]


def post(
    http: httpx.Client, url: str, fake_header: str = "", request_id: str = "", **fields: Any
) -> httpx.Response:
    body = {"model": "fake", "messages": MESSAGES, **fields}
    headers = {"x-fake": fake_header} if fake_header else {}
    if request_id:
        headers["x-request-id"] = request_id
    return http.post(url + CHAT, json=body, headers=headers)


def without_engine_randomness(body: bytes) -> bytes:
    """The body with the two fields the engine draws anew per request (id, created) blanked, each once."""
    body, ids = re.subn(rb'"id":"chatcmpl-[0-9a-f-]{36}"', b'"id":"-"', body)
    body, times = re.subn(rb'"created":\d+', b'"created":0', body)
    assert ids == times == 1, body
    return body


def by_request_id(request_id: str) -> Any:
    return lambda record: record["headers"].get("x-request-id") == request_id


@pytest.fixture
def holding() -> Iterator[list[httpx.Response]]:
    """Streams opened with ``hold``; closed after the test."""
    held: list[httpx.Response] = []
    yield held
    for response in held:
        response.close()


def hold(http: httpx.Client, gateway: Running, held: list[httpx.Response]) -> None:
    """Open a long stream straight to ``gateway`` and keep it open: a draining gateway stays up for it."""
    body = {"model": "fake", "messages": MESSAGES, "stream": True}
    request = http.build_request(
        "POST", gateway.url + CHAT, json=body, headers={"x-fake": "chunks=600; chunk-delay=0.1"}
    )
    response = http.send(request, stream=True)
    held.append(response)
    assert response.status_code == 200
    wait_until(lambda: in_flight(gateway, http) == 1, "the gateway serves the holding stream", timeout_s=10)


def test_stream_through_two_gateways_arrives_event_by_event(
    chain: tuple[Running, Running], fake: FakeEngine, http: httpx.Client
) -> None:
    """A stream through A and B reaches the client event by event, whole, and ends with [DONE]."""
    a, _ = chain
    body = {"model": "fake", "messages": MESSAGES, "stream": True}
    headers = {"x-fake": "chunks=10; chunk-delay=0.2", "x-request-id": "chain-stream"}
    with http.stream("POST", a.url + CHAT, json=body, headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        # Neither gateway held it back: the engine is still writing the stream.
        record = fake.wait_for_record(by_request_id("chain-stream"))
        assert record["finished_at"] is None and record["events_sent"] < 11, record
        data = [first, *(line for line in lines if line.startswith("data: "))]
    assert data[-1] == "data: [DONE]"
    chunks = [orjson.loads(line.removeprefix("data: ")) for line in data[:-1]]
    assert len(chunks) == 11  # ten tokens and the finish event
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text_of(10)


def test_openai_client_through_two_gateways(chain: tuple[Running, Running]) -> None:
    """openai-python (sync) streams and completes through A and B as it does against one server."""
    a, _ = chain
    with openai_client(a.url) as client:
        stream = client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
        )
        pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
        completion = client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert "".join(pieces) == text_of(5)
    assert completion.choices[0].message.content == text_of(4)
    assert completion.usage is not None and completion.usage.completion_tokens == 4


def test_non_stream_response_through_a_is_bs_byte_for_byte(
    chain: tuple[Running, Running], http: httpx.Client
) -> None:
    """A non-streamed response through A is B's, byte for byte (but the engine's per-request id and time)."""
    a, b = chain
    direct = post(http, b.url, max_tokens=7)
    chained = post(http, a.url, max_tokens=7)
    assert direct.status_code == chained.status_code == 200
    assert without_engine_randomness(chained.content) == without_engine_randomness(direct.content)
    assert chained.headers["content-type"] == direct.headers["content-type"] == "application/json"
    assert chained.headers["content-length"] == str(len(chained.content))


@pytest.mark.fault("balancers", "a gateway in front (chained gateways)")
@pytest.mark.parametrize(
    ("status", "error_class"),
    [
        (400, openai.BadRequestError),
        (404, openai.NotFoundError),
        (500, openai.InternalServerError),
        (503, openai.InternalServerError),
    ],
)
def test_upstream_error_status_through_a_is_bs_error(
    chain: tuple[Running, Running], http: httpx.Client, status: int, error_class: type[openai.APIStatusError]
) -> None:
    """An engine's error status reaches A's client as B's OpenAI error: same status, body, Retry-After."""
    a, b = chain
    fault = f"status={status}"
    direct = post(http, b.url, fault, max_tokens=3)
    chained = post(http, a.url, fault, max_tokens=3)
    assert direct.status_code == chained.status_code == status
    assert chained.content == direct.content
    assert set(chained.json()["error"]) == {"message", "type", "param", "code"}
    assert chained.headers.get("retry-after") == direct.headers.get("retry-after")
    if status == 503:
        assert chained.headers["retry-after"] == "7"  # the engine's own
    streamed = post(http, a.url, fault, max_tokens=3, stream=True)
    assert streamed.status_code == status and streamed.content == direct.content
    with openai_client(a.url) as client, pytest.raises(error_class) as raised:
        client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], extra_headers={"x-fake": fault}
        )
    assert raised.value.status_code == status
    assert isinstance(raised.value.body, dict) and raised.value.body["message"] == "fake error"


@pytest.mark.fault("balancers", "a gateway in front (chained gateways)")
@pytest.mark.parametrize("fault", ["die-after=3", "die-after=3; mid-event"])
def test_stream_that_breaks_behind_b_is_one_error_event_at_a(
    chain: tuple[Running, Running], http: httpx.Client, fault: str
) -> None:
    """An engine stream cut short reaches A's client as its whole events and then one error event, B's."""
    a, b = chain
    direct = post(http, b.url, fault, max_tokens=8, stream=True)
    chained = post(http, a.url, fault, max_tokens=8, stream=True)
    assert direct.status_code == chained.status_code == 200
    events = events_of(chained.content)
    parsed = [orjson.loads(event.removeprefix(b"data: ")) for event in events]
    assert [("error" in p) for p in parsed] == [False, False, False, True]
    assert parsed[-1]["error"]["code"] == "upstream_truncated"
    assert events[-1] == events_of(direct.content)[-1]
    assert b"data: [DONE]" not in events

    received: list[str | None] = []
    with openai_client(a.url) as client, pytest.raises(openai.APIError, match="truncated"):
        stream = client.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            stream=True,
            extra_headers={"x-fake": fault},
        )
        for chunk in stream:
            received.append(chunk.choices[0].delta.content)  # noqa: PERF401 (the error ends the loop)
    assert received == ["tok0 ", "tok1 ", "tok2 "]


@pytest.mark.fault("balancers", "a gateway in front (chained gateways)")
def test_error_after_bs_heartbeats_is_one_error_event_at_a(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """B began the stream with heartbeats, then the engine failed: A's client gets them, one error event."""
    b = start_gateway({"fake": fake.url}, "--sse-heartbeat", "0.2")
    a = start_gateway({"fake": f"{b.url}/v1"})
    response = post(http, a.url, "prefill=1; status=500", max_tokens=3, stream=True)
    assert response.status_code == 200
    events = events_of(response.content)
    assert events[0] == b": keepalive"
    assert set(events[:-1]) == {b": keepalive"}
    error = orjson.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error["message"] == "fake error" and error["type"] == "server_error"


@pytest.mark.fault("balancers", "a gateway in front (chained gateways)")
def test_bs_refused_upstream_reaches_the_client_as_bs_503_with_retry_after(
    start_gateway: StartGateway, http: httpx.Client
) -> None:
    """B cannot reach its engine (connection refused): A's client gets B's 503, with Retry-After."""
    b = start_gateway({"fake": f"http://127.0.0.1:{free_port()}/v1"})
    a = start_gateway({"fake": f"{b.url}/v1"})
    direct = post(http, b.url, max_tokens=3)
    chained = post(http, a.url, max_tokens=3, stream=True)
    assert direct.status_code == chained.status_code == 503
    assert chained.content == direct.content
    assert chained.json()["error"]["code"] == "upstream_unavailable"
    assert chained.headers["retry-after"] == direct.headers["retry-after"]


@pytest.mark.fault("balancers", "a gateway in front (chained gateways)")
def test_draining_b_reaches_the_client_as_503_draining_with_retry_after(
    chain: tuple[Running, Running], http: httpx.Client, holding: list[httpx.Response]
) -> None:
    """While B drains, A's /readyz is 503 and A's client gets B's 503 `draining`; after B, A's own 503."""
    a, b = chain
    hold(http, b, holding)
    b.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: http.get(b.url + "/readyz").status_code == 503, "B drains", timeout_s=10)
    # A's own readiness follows B's (at A's next timed check), so a balancer in front of A stops
    # sending it requests.
    wait_until(lambda: http.get(a.url + "/readyz").status_code == 503, "A sees B drain", timeout_s=10)
    ready = http.get(a.url + "/readyz")
    assert ready.status_code == 503, ready.text
    assert "/readyz answers 503" in ready.json()["reason"]
    for stream in (False, True):
        response = post(http, a.url, max_tokens=3, stream=stream)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "draining"
        assert response.headers["retry-after"] == "1"
    with openai_client(a.url) as client, pytest.raises(openai.InternalServerError) as raised:
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}])
    assert raised.value.status_code == 503

    holding.pop().close()
    assert b.proc.wait(15) == 0
    gone = post(http, a.url, max_tokens=3)
    assert gone.status_code == 503 and gone.json()["error"]["code"] == "upstream_unavailable"
    assert gone.headers["retry-after"]


@pytest.mark.fault("balancers", "a gateway in front (chained gateways)")
def test_client_leaving_a_mid_stream_closes_b_and_the_engine(
    chain: tuple[Running, Running], fake: FakeEngine, http: httpx.Client
) -> None:
    """A client that leaves A mid-stream makes A close B and B close the engine, long before the end."""
    a, _ = chain
    body = {"model": "fake", "messages": MESSAGES, "stream": True}
    headers = {"x-fake": "chunks=400; chunk-delay=0.05", "x-request-id": "leaves-mid-stream"}
    with http.stream("POST", a.url + CHAT, json=body, headers=headers) as response:
        lines = response.iter_lines()
        assert [next(line for line in lines if line.startswith("data: ")) for _ in range(2)]
    record = fake.wait_for_record(
        lambda r: by_request_id("leaves-mid-stream")(r) and r["outcome"] == "peer_closed", timeout_s=10
    )
    assert record["events_sent"] < 400 and record["closed_at"] is not None


@pytest.mark.fault("balancers", "a gateway in front (chained gateways)")
def test_client_leaving_a_during_prefill_closes_b_and_the_engine(
    chain: tuple[Running, Running], fake: FakeEngine
) -> None:
    """A client that leaves A while the engine is in prefill makes the engine see its connection close."""
    a, _ = chain
    body = orjson.dumps({"model": "fake", "messages": MESSAGES, "stream": True})
    head = (
        f"POST {CHAT} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nx-fake: prefill=30\r\nx-request-id: leaves-in-prefill\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", a.port), timeout=10) as sock:
        sock.sendall(head.encode() + body)
        fake.wait_for_record(by_request_id("leaves-in-prefill"), timeout_s=10)
    record = fake.wait_for_record(
        lambda r: by_request_id("leaves-in-prefill")(r) and r["outcome"] == "peer_closed", timeout_s=10
    )
    assert record["status"] is None  # the engine never answered


def test_client_request_id_reaches_the_engine_and_comes_back(
    chain: tuple[Running, Running], fake: FakeEngine, http: httpx.Client
) -> None:
    """The client's x-request-id crosses both hops to the engine and back, and names it in both logs."""
    a, b = chain
    response = post(http, a.url, request_id="client-id-42", max_tokens=2)
    assert response.status_code == 200 and response.headers["x-request-id"] == "client-id-42"
    assert fake.wait_for_record(by_request_id("client-id-42"))["path"] == "/v1/chat/completions"
    wait_until(
        lambda: all("id=client-id-42" in g.log() for g in (a, b)), "both access log lines", timeout_s=10
    )

    # Without one, or with one A does not take (over 200 characters, or not
    # visible ASCII), A's own id is the one B and the engine see and the client gets.
    for given in ("", "x" * 201, "has space"):
        response = post(http, a.url, request_id=given, max_tokens=2)
        generated = response.headers["x-request-id"]
        assert generated and generated != given
        assert fake.wait_for_record(by_request_id(generated))
