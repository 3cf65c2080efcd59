"""Admission over real sockets: the limit, the queue, and slots released on every path."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartGateway
from tests.e2e.raw_http import raw_request

CHAT = "/v1/chat/completions"


def chat(**fields: object) -> dict[str, object]:
    return {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def open_request(gateway: Running, fake_header: str, **fields: object) -> socket.socket:
    """Send a request on a raw socket and leave it open (to hold a slot or hang up later)."""
    return raw_request(gateway, fake_header, orjson.dumps(chat(**fields)), timeout_s=10)


LIMITS = ("--max-in-flight", "2", "--max-queued", "2", "--queue-timeout", "1")


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    """Raw client sockets, all closed after the test whatever happens."""
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


@pytest.fixture
def limited(start_gateway: StartGateway, fake: FakeEngine) -> Running:
    """A gateway allowing 2 requests in flight and 2 queued, for 1 s at most."""
    return start_gateway({"fake": fake.url}, *LIMITS)


def in_flight_at_engine(fake: FakeEngine) -> int:
    return sum(1 for r in fake.records() if r["outcome"] is None)


@pytest.mark.fault("overload", "the limit and the queue: 429 and 503 with Retry-After")
def test_limit_queue_full_and_queue_timeout(
    limited: Running, fake: FakeEngine, http: httpx.Client, sockets: list[socket.socket]
) -> None:
    """Two run, two queue, a fifth gets 429, the queued get 503 at the timeout; all with Retry-After."""
    holders = [open_request(limited, "prefill=3") for _ in range(2)]
    sockets += holders
    fake.wait_for_record(lambda r: len(fake.records()) == 2)
    queued = [open_request(limited, "prefill=3") for _ in range(2)]
    sockets += queued
    time.sleep(0.2)
    assert len(fake.records()) == 2  # the queued ones have not reached the engine
    refused = http.post(limited.url + CHAT, json=chat())
    assert refused.status_code == 429 and refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "queue_full"
    for sock in queued:
        response = sock.recv(65536)
        while not response.endswith(b"}}"):
            response += sock.recv(65536)
        assert response.startswith(b"HTTP/1.1 503") and b"queue_timeout" in response
        assert b"retry-after" in response.lower()


@pytest.mark.fault("overload", "slots released on every path, cancelled waiters too")
def test_slots_are_released_on_every_path(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client, sockets: list[socket.socket]
) -> None:
    """After success, errors, 504, 502 and disconnects mid-stream or queued, the full limit is usable."""
    limited = start_gateway({"fake": fake.url}, *LIMITS, "--first-byte-timeout", "0.5")
    assert http.post(limited.url + CHAT, json=chat()).status_code == 200
    assert http.post(limited.url + CHAT, json=chat(), headers={"x-fake": "status=500"}).status_code == 500
    assert http.post(limited.url + CHAT, json=chat(), headers={"x-fake": "prefill=2"}).status_code == 504
    assert http.post(limited.url + CHAT, json=chat(), headers={"x-fake": "empty"}).status_code == 502
    # Disconnect mid-stream.
    sock = open_request(limited, "chunk-delay=0.05; chunks=100", stream=True)
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    sock.close()
    # Disconnect while queued.
    holders = [open_request(limited, "prefill=0.4") for _ in range(2)]
    sockets += holders
    fake.wait_for_record(lambda r: in_flight_at_engine(fake) >= 2)
    waiting = open_request(limited, "prefill=0.4")
    time.sleep(0.1)
    waiting.close()
    for holder in holders:
        assert holder.recv(65536).startswith(b"HTTP/1.1 200")
    time.sleep(0.3)
    # The full limit is usable again: two requests run at once, neither queues.
    fake.reset()
    both = [open_request(limited, "prefill=0.3") for _ in range(2)]
    sockets += both
    fake.wait_for_record(lambda r: len(fake.records()) == 2, timeout_s=2)
    received_at = [r["received_at"] for r in fake.records()]
    assert max(received_at) - min(received_at) < 0.25
    for sock in both:
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")


@pytest.mark.fault("overload", "the limit and the queue: 429 and 503 with Retry-After")
def test_retry_after_follows_the_queues_drain_rate(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client, sockets: list[socket.socket]
) -> None:
    """Requests that hold their slot 1 s, one slot, four queued: the 429 says to come back in 4 s or
    more (the queue's drain time), not 1 s; the queue's 503s as well."""
    gateway = start_gateway(
        {"fake": fake.url}, "--max-in-flight", "1", "--max-queued", "4", "--queue-timeout", "1.5"
    )
    # One request alone: the gateway learns how long a slot is held here.
    assert http.post(gateway.url + CHAT, json=chat(), headers={"x-fake": "prefill=1"}).status_code == 200
    sockets.append(open_request(gateway, "prefill=5"))
    fake.wait_for_record(lambda r: len(fake.records()) == 2)
    queued = [open_request(gateway, "prefill=1") for _ in range(4)]
    sockets += queued
    deadline = time.monotonic() + 10
    while 'blazar_queue_depth{model="fake"} 4.0' not in http.get(gateway.url + "/metrics").text:
        assert time.monotonic() < deadline, "the four never queued"
        time.sleep(0.05)
    refused = http.post(gateway.url + CHAT, json=chat())
    assert refused.status_code == 429, refused.text
    assert 4 <= int(refused.headers["retry-after"]) <= 60, refused.headers
    # The queued ones time out behind the 5 s holder: each 503 says how long what is left needs.
    retry_afters = []
    for sock in queued:
        response = sock.recv(65536)
        while not response.endswith(b"}}"):
            response += sock.recv(65536)
        assert response.startswith(b"HTTP/1.1 503") and b"queue_timeout" in response
        head = response.split(b"\r\n\r\n", 1)[0].lower()
        retry_afters.append(int(head.split(b"retry-after: ", 1)[1].split(b"\r\n", 1)[0]))
    assert all(1 <= seconds <= 60 for seconds in retry_afters), retry_afters
    assert max(retry_afters) >= 3, retry_afters  # the first to time out still had three behind it
