"""Clients too slow for the gateway, at either end of a request.

One that stops reading is cut, and its socket with it, so that a drain is
not held up by it; one that reads slowly but steadily is not cut. A head that
trickles in behind a running request, or one huge header value, is refused
without being buffered.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import time

import pytest

from tests.e2e.conftest import FakeEngine, StartFakeEngine, StartGateway
from tests.e2e.raw_http import payload, raw_request


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
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"x-fake: prefill=1.5\r\nContent-Length: %d\r\n\r\n"
            % len(body)
            + body
            + b"GET /livez HTTP/1.1\r\nx-a: "
        )
        started = time.monotonic()
        received = b""
        seen: list[str] = []  # what happened when, for a failure's message
        while b"HTTP/1.1 408" not in received and time.monotonic() - started < 8:
            try:
                sock.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError) as exc:
                seen.append(f"{time.monotonic() - started:.2f} s: send: {exc!r}")
                break
            sock.settimeout(0.5)
            with contextlib.suppress(TimeoutError):
                chunk = sock.recv(65536)
                seen.append(f"{time.monotonic() - started:.2f} s: {len(chunk)} bytes {chunk[:12]!r}")
                received += chunk
        # The gateway may have answered and closed just as a byte was sent: read what it said.
        sock.settimeout(1.0)
        try:
            while b"HTTP/1.1 408" not in received and (chunk := sock.recv(65536)):
                received += chunk
        except (TimeoutError, ConnectionResetError) as exc:
            seen.append(f"{time.monotonic() - started:.2f} s: last read: {exc!r}")
        assert b"HTTP/1.1 408" in received, (seen, received[-300:])
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
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        sent = 0
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            while sent < 50 * 1024 * 1024:
                sock.sendall(b"a" * 65536)
                sent += 65536
        assert sent < 4 * 1024 * 1024
    finally:
        sock.close()
