"""A client that stops reading, and the optional limit on a whole request."""

from __future__ import annotations

import contextlib
import os
import socket
import time

import httpx
import orjson
import pytest

from tests.e2e.conftest import FakeEngine, StartFakeEngine, StartGateway
from tests.helpers import rss_mib, wait_until

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


@pytest.mark.fault("clients", "a client that stops reading, or reads slowly")
def test_a_client_that_sends_requests_and_reads_no_answers_holds_little_and_is_cut(
    start_gateway: StartGateway, fake: FakeEngine
) -> None:
    """Pipelined requests, none of the answers read: the gateway reads and answers only until the
    client's buffer is full (its memory does not grow with what the client sends), and a client
    that then takes nothing for --send-stall is cut, its connection closed."""
    gateway = start_gateway({"fake": fake.url}, "--send-stall", "1")
    payload = orjson.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}]})
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"x-fake: chunks=60; chunk-bytes=500\r\nContent-Length: %d\r\n\r\n%b" % (len(payload), payload)
    )  # an answer of ~30 KB: the fast path's, written whole
    fds = len(os.listdir(f"/proc/{gateway.proc.pid}/fd"))
    rss_before = rss_mib(gateway.proc.pid)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", gateway.port))
    sock.settimeout(3)
    sent = 0
    try:
        with contextlib.suppress(TimeoutError, ConnectionError):
            while sent < 20_000:
                sock.sendall(request * 50)
                sent += 50
        # The gateway stopped reading long before 20,000 (~600 MB of answers).
        assert sent < 20_000
        wait_until(lambda: " took none of the " in gateway.log(), "the stalled client cut", timeout_s=15)
        wait_until(
            lambda: len(os.listdir(f"/proc/{gateway.proc.pid}/fd")) <= fds,
            "its connection closed",
            timeout_s=5,
        )
        assert rss_mib(gateway.proc.pid) - rss_before < 50
    finally:
        sock.close()
    # The gateway serves on.
    with httpx.Client(trust_env=False) as client:
        response = client.post(
            gateway.url + CHAT, json={"model": "fake", "messages": [{"role": "user", "content": "x"}]}
        )
    assert response.status_code == 200
