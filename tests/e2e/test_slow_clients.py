"""Regression tests named after bugs found in review of the production features (issue 5)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time

import httpx
import orjson
import pytest

from proxy.admission import Admission
from proxy.relay import _wait_for_slot
from tests.e2e.conftest import FakeEngine, Running, StartFakeEngine, StartGateway

CHAT = "/v1/chat/completions"


def payload(**fields: object) -> bytes:
    return orjson.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], **fields})


def raw_request(gateway: Running, fake_header: str, body: bytes, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", gateway.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"x-fake: %s\r\nContent-Length: %d\r\n\r\n" % (fake_header.encode(), len(body)) + body
    )
    return sock


def read_all(sock: socket.socket, timeout_s: float = 20) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
            if data.endswith(b"0\r\n\r\n"):
                break
    except (ConnectionResetError, TimeoutError):
        pass
    return data


@pytest.mark.fault("clients", "a client that stops reading, or reads slowly")
def test_stalled_client_socket_is_aborted_and_drain_is_not_held(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine
) -> None:
    """A client cut for not reading loses its socket at once, so a later SIGTERM is not held up by it."""
    fake = start_fake_engine("--http11")
    gateway = start_gateway({"fake": fake.url}, "--send-stall", "0.5", "--drain-timeout", "1")
    sock = raw_request(
        gateway, "chunks=5000; chunk-bytes=2000; chunk-delay=0.002", payload(stream=True), 4096
    )
    try:
        fake.wait_for_record(lambda r: r["closed_at"] is not None, timeout_s=10)
        time.sleep(0.3)
        started = time.monotonic()
        gateway.proc.send_signal(signal.SIGTERM)
        assert gateway.proc.wait(10) == 0
        assert time.monotonic() - started < 5
    finally:
        sock.close()


@pytest.mark.fault("drain", "the drain deadline")
def test_drain_timeout_also_ends_queued_requests(start_gateway: StartGateway, fake: FakeEngine) -> None:
    """Requests still queued at the drain deadline get 503 draining; nothing starts after it."""
    gateway = start_gateway({"fake": fake.url}, "--max-in-flight", "1", "--drain-timeout", "1")
    running = raw_request(gateway, "chunks=200; chunk-delay=0.05", payload(stream=True))
    fake.wait_for_record(lambda r: True)
    queued = raw_request(gateway, "chunks=200; chunk-delay=0.05", payload(stream=True))
    try:
        time.sleep(0.2)
        started = time.monotonic()
        gateway.proc.send_signal(signal.SIGTERM)
        assert b'"code":"draining"' in read_all(running)
        queued_answer = read_all(queued)
        assert queued_answer.startswith(b"HTTP/1.1 503") and b"draining" in queued_answer
        assert gateway.proc.wait(15) == 0
        assert time.monotonic() - started < 8
        assert len(fake.records()) == 1  # the queued request never reached the engine
    finally:
        running.close()
        queued.close()


@pytest.mark.fault("clients", "a client that stops reading, or reads slowly")
def test_slow_but_steady_reader_is_not_cut(
    start_gateway: StartGateway, start_fake_engine: StartFakeEngine
) -> None:
    """Large chunks go out in slices, so a client that keeps reading, however slowly, is not a stall."""
    fake = start_fake_engine("--http11")
    gateway = start_gateway({"fake": fake.url}, "--send-stall", "1")
    sock = raw_request(gateway, "chunks=12; chunk-bytes=262144", payload(stream=True), 16384)
    try:
        sock.settimeout(20)
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(32768)
            if not chunk:
                break
            data += chunk
            time.sleep(0.02)
        assert b"data: [DONE]" in data
    finally:
        sock.close()


@pytest.mark.fault("clients", "slowloris: heads and bodies that trickle or never come")
def test_pipelined_slowloris_head_still_gets_408(start_gateway: StartGateway, fake: FakeEngine) -> None:
    """A head trickling in behind a running request on the same connection is still held to its deadline."""
    gateway = start_gateway({"fake": fake.url}, "--header-timeout", "1")
    body = payload(max_tokens=2)
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"x-fake: prefill=1.5\r\nContent-Length: %d\r\n\r\n"
            % len(body)
            + body
            + b"GET /livez HTTP/1.1\r\nx-a: "
        )
        started = time.monotonic()
        received = b""
        while b"408" not in received and time.monotonic() - started < 8:
            try:
                sock.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                break
            sock.settimeout(0.5)
            with contextlib.suppress(TimeoutError):
                received += sock.recv(65536)
        # The gateway may have answered and closed just as a byte was sent: read what it said.
        sock.settimeout(1.0)
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while b"408" not in received and (chunk := sock.recv(65536)):
                received += chunk
        assert b"HTTP/1.1 408" in received
    finally:
        sock.close()


@pytest.mark.fault("clients", "oversized heads and bodies")
def test_huge_header_value_is_refused_before_it_is_buffered(
    start_gateway: StartGateway, fake: FakeEngine
) -> None:
    """One oversized header value is refused while it streams in, not after it is built in memory."""
    gateway = start_gateway({"fake": fake.url}, "--max-header-bytes", "4096")
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent = 0
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            while sent < 50 * 1024 * 1024:
                sock.sendall(b"a" * 65536)
                sent += 65536
        assert sent < 4 * 1024 * 1024
    finally:
        sock.close()


@pytest.mark.fault("clients", "a client that leaves mid-request")
def test_heartbeat_streams_are_counted_in_ttft_and_client_gone_is_499(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """Streams started by heartbeats still feed the TTFT histogram; a client gone before the head is 499."""
    gateway = start_gateway({"fake": fake.url}, "--sse-heartbeat", "0.2")
    http.post(gateway.url + CHAT, content=payload(stream=True), headers={"x-fake": "prefill=0.5"})
    sock = raw_request(gateway, "prefill=2", payload())
    time.sleep(0.3)
    sock.close()
    time.sleep(0.3)
    text = http.get(gateway.url + "/metrics").text
    assert 'blazar_time_to_first_token_seconds_count{model="fake"} 1.0' in text
    assert 'code="499"' in text and 'code="0"' not in text


@pytest.mark.fault("overload", "the limit and the queue: 429 and 503 with Retry-After")
def test_access_log_names_the_model_of_a_429_without_metrics(
    start_gateway: StartGateway, fake: FakeEngine
) -> None:
    """With --no-metrics, a refused request's log line still names its model."""
    gateway = start_gateway({"fake": fake.url}, "--no-metrics", "--max-in-flight", "1", "--max-queued", "0")
    holder = raw_request(gateway, "prefill=1", payload())
    try:
        fake.wait_for_record(lambda r: True)
        with httpx.Client(trust_env=False) as http:
            assert (
                http.post(gateway.url + CHAT, content=payload(), headers={"x-request-id": "r429"}).status_code
                == 429
            )
        time.sleep(0.2)
        (line,) = [line for line in gateway.log().splitlines() if "id=r429" in line]
        assert "model=fake" in line
    finally:
        holder.close()


@pytest.mark.fault("clients", "bodies that are not JSON, or are sent as forms")
def test_browser_form_post_is_refused_and_responses_vary_by_origin(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """A cross-site form POST (no preflight) never runs a generation; CORS responses vary by Origin."""
    gateway = start_gateway({"fake": fake.url}, "--cors-origin", "https://app.example.com")
    response = http.post(
        gateway.url + CHAT,
        content=payload(),
        headers={"origin": "https://evil.example", "content-type": "application/x-www-form-urlencoded"},
    )
    assert response.status_code == 415
    assert response.headers["vary"] == "Origin"
    assert fake.records() == []


@pytest.mark.fault("overload", "slots released on every path, cancelled waiters too")
@pytest.mark.anyio
async def test_request_cancelled_while_queued_leaks_no_slot() -> None:
    """A relay task cancelled while it waits for a slot gives its place back."""
    admission = Admission(1, max_queued=4, queue_timeout_s=10)
    assert admission.try_enter()
    never = asyncio.Event()

    async def receive() -> dict[str, object]:
        await never.wait()
        return {"type": "http.disconnect"}

    waiter = asyncio.ensure_future(_wait_for_slot(admission, "m", receive))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    admission.leave()
    assert admission.in_flight == 0 and admission.queued == 0
