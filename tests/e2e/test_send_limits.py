"""A client that stops reading, and the optional limit on a whole request."""

from __future__ import annotations

import socket
import time

import httpx
import orjson
import pytest

from tests.e2e.conftest import FakeEngine, StartFakeEngine, StartGateway

CHAT = "/v1/chat/completions"


@pytest.mark.fault("clients", "a client that stops reading, or reads slowly")
def test_client_that_stops_reading_is_cut_and_its_upstream_closed(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine, http: httpx.Client
) -> None:
    """Backpressure first reaches the upstream; after --send-stall the gateway gives up on the client."""
    fake = start_fake_engine("--http11")
    gateway = start_gateway({"fake": fake.url}, "--send-stall", "0.5", "--max-in-flight", "1")
    payload = orjson.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", gateway.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"x-fake: chunks=5000; chunk-bytes=2000; chunk-delay=0.002\r\nContent-Length: %d\r\n\r\n"
        % len(payload)
        + payload
    )
    try:
        # The client reads nothing. The upstream is closed within a few intervals.
        record = fake.wait_for_record(lambda r: r["closed_at"] is not None, timeout_s=10)
        assert record["outcome"] == "peer_closed"
        assert record["events_sent"] < 5000  # backpressure stopped it long before the end
        # The slot is free again: another request goes straight through.
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert http.post(gateway.url + CHAT, json=body).status_code == 200
    finally:
        sock.close()


@pytest.mark.fault("upstreams", "silence mid-response, and the total timeout")
def test_total_timeout_ends_a_long_stream_with_an_error_event(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """With --total-timeout, a stream running past it ends with a total_timeout error event."""
    gateway = start_gateway({"fake": fake.url}, "--total-timeout", "0.5")
    started = time.monotonic()
    raw = http.post(
        gateway.url + CHAT,
        json={"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        headers={"x-fake": "chunks=100; chunk-delay=0.05"},
    ).content
    assert time.monotonic() - started < 3
    last = [e for e in raw.split(b"\n\n") if e.strip()][-1]
    assert orjson.loads(last.removeprefix(b"data: "))["error"]["code"] == "total_timeout"
