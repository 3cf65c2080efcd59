"""Client-side limits: slowloris heads and bodies, oversized headers, ambiguous framing."""

from __future__ import annotations

import http.client
import socket
import time

import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartGateway

BODY = orjson.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


@pytest.fixture
def strict(start_gateway: StartGateway, fake: FakeEngine) -> Running:
    """A gateway with a 0.5 s head deadline, a 0.5 s body deadline and 4 KiB of headers."""
    return start_gateway(
        {"fake": fake.url}, "--header-timeout", "0.5", "--body-timeout", "0.5", "--max-header-bytes", "4096"
    )


def exchange(gateway: Running, *parts: bytes, pause_s: float = 0.0) -> bytes:
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
        for part in parts:
            try:
                sock.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break  # the gateway has answered and closed: read what it said
            time.sleep(pause_s)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
            if received.endswith(b"}}") or received.endswith(b"}}\n"):
                break
        return received


def behind_a_stream(gateway: Running, stall_s: float, second: bytes, status: bytes) -> bytes:
    """A stream request and ``second`` in one write, all read until the close: the stream must come
    first and whole, then the response to ``second`` with ``status``, whose bytes are returned."""
    stream = orjson.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    first = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"x-fake: stall=%g\r\nContent-Length: %d\r\n\r\n" % (stall_s, len(stream)) + stream
    )
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        sock.sendall(first + second)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 200 OK"), received[:200]
    stream_part, _, rest = received.partition(b"HTTP/1.1 " + status)
    assert b"data: [DONE]" in stream_part and stream_part.endswith(b"0\r\n\r\n"), received[-300:]
    return rest


@pytest.mark.fault("clients", "slowloris: heads and bodies that trickle or never come")
def test_slowloris_head_gets_408_and_close(strict: Running, fake: FakeEngine) -> None:
    """A head sent a few bytes at a time past the head deadline gets 408 in OpenAI's envelope."""
    started = time.monotonic()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
    response = exchange(strict, *(head[i : i + 5] for i in range(0, len(head), 5)), pause_s=0.1)
    assert response.startswith(b"HTTP/1.1 408")
    assert b'"code":"request_timeout"' in response and b"connection: close" in response
    assert time.monotonic() - started < 3
    assert fake.records() == []


@pytest.mark.fault("clients", "slowloris: heads and bodies that trickle or never come")
def test_silent_connection_is_closed(strict: Running) -> None:
    """A connection that sends nothing is answered 408 and closed at the head deadline."""
    with socket.create_connection(("127.0.0.1", strict.port), timeout=5) as sock:
        started = time.monotonic()
        data = sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 408")
        assert sock.recv(65536) == b""
        assert time.monotonic() - started < 3


@pytest.mark.fault("clients", "slowloris: heads and bodies that trickle or never come")
def test_slow_body_gets_408(strict: Running, fake: FakeEngine) -> None:
    """A body that does not arrive within the body deadline gets 408 and the engine never sees it."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n"
    )
    response = exchange(strict, head % len(BODY) + BODY[:10], BODY[10:20], BODY[20:30], pause_s=0.4)
    assert response.startswith(b"HTTP/1.1 408")
    assert b'"code":"request_timeout"' in response
    assert fake.records() == []


@pytest.mark.fault("clients", "slowloris: heads and bodies that trickle or never come")
def test_a_pipelined_body_that_waits_its_turn_does_not_cut_the_running_response(
    strict: Running, fake: FakeEngine
) -> None:
    """A second request queued behind a running stream, its body not all sent: the stream ends
    whole, and only then does the second get its 408 (its body deadline runs from its turn)."""
    second = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY[:10]
    )
    rest = behind_a_stream(strict, 1.5, second, b"408")
    assert b'"code":"request_timeout"' in rest


@pytest.mark.fault("clients", "slowloris: heads and bodies that trickle or never come")
def test_a_head_that_declares_a_body_then_sends_nothing_gets_408(strict: Running, fake: FakeEngine) -> None:
    """The body deadline runs from the end of the head: a declared body of which no byte comes is cut."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", strict.port), timeout=5) as sock:
        started = time.monotonic()
        sock.sendall(head)
        data = sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in data
        assert sock.recv(65536) == b""
        assert time.monotonic() - started < 3
    assert fake.records() == []


@pytest.mark.fault("clients", "smuggling, upgrades and hop-by-hop headers")
def test_an_upgrade_request_is_refused_and_closed(strict: Running, fake: FakeEngine) -> None:
    """POST with Connection: upgrade and a body: 400 upgrade_not_supported and close, not a lost body."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Connection: Upgrade\r\nUpgrade: websocket\r\nContent-Length: %d\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", strict.port), timeout=5) as sock:
        started = time.monotonic()
        sock.sendall(head % len(BODY) + BODY)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        assert data.startswith(b"HTTP/1.1 400") and b'"code":"upgrade_not_supported"' in data
        assert time.monotonic() - started < 3
    assert fake.records() == []


@pytest.mark.fault("clients", "oversized heads and bodies")
@pytest.mark.parametrize("whole", [True, False], ids=["whole-head", "half-a-head"])
def test_an_oversized_head_pipelined_in_the_same_read_gets_431_after_the_running_response(
    strict: Running, fake: FakeEngine, whole: bool
) -> None:
    """A second head past --max-header-bytes, sent in one write with the request before it, whole or
    not yet ended: counted (its bytes are not the first request's), refused with 431 once the first
    response has ended whole."""
    second = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 8000 + b"\r\nX-More: "
    )
    if whole:
        second += b"1\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY
    rest = behind_a_stream(strict, 0.5, second, b"431")
    assert b'"code":"headers_too_large"' in rest
    assert len(fake.records()) == 1


@pytest.mark.fault("clients", "oversized heads and bodies")
def test_an_oversized_pipelined_head_split_across_reads_gets_431(strict: Running, fake: FakeEngine) -> None:
    """A second head that begins in the read that ends the first request, its big header still
    arriving (httptools holds it unseen), and ends in a later read: checked whole at its end, 431."""
    first = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"x-fake: prefill=0.3\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY
    )
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as sock:
        sock.sendall(
            first + b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 20000
        )
        time.sleep(0.1)
        sock.sendall(b"\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 200 OK"), received[:200]
    assert b"HTTP/1.1 431" in received and b'"code":"headers_too_large"' in received, received[-300:]
    assert len(fake.records()) == 1


@pytest.mark.fault("clients", "slowloris: heads and bodies that trickle or never come")
def test_a_pipelined_head_of_two_bytes_behind_a_request_is_still_timed(
    strict: Running, fake: FakeEngine
) -> None:
    """'GE' after a request in the same read, then nothing: the head deadline still applies (408)."""
    first = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"x-fake: prefill=0.8\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY
    )
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as sock:
        sock.sendall(first + b"GE")
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 200 OK"), received[:200]
    assert b"HTTP/1.1 408" in received and b'"code":"request_timeout"' in received, received[-300:]


@pytest.mark.fault("clients", "smuggling, upgrades and hop-by-hop headers")
def test_a_malformed_request_pipelined_behind_a_stream_gets_its_400_after_the_stream(
    strict: Running, fake: FakeEngine
) -> None:
    """Bytes the parser refuses, sent right after a stream request: the stream ends whole first
    (pipelined responses keep their order), then 400 and close."""
    rest = behind_a_stream(strict, 0.3, b"NOT HTTP AT ALL\r\n\r\n", b"400")
    assert b'"code":"invalid_request"' in rest


@pytest.mark.fault("clients", "smuggling, upgrades and hop-by-hop headers")
def test_a_broken_body_of_a_request_queued_behind_a_stream_gets_its_400_after_the_stream(
    strict: Running, fake: FakeEngine
) -> None:
    """A pipelined request whose chunked body the parser refuses: it never starts; the stream before
    it ends whole, then that request's 400 and close."""
    second = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"a":\r\nzz\r\n'
    )
    rest = behind_a_stream(strict, 0.3, second, b"400")
    assert b'"code":"invalid_request"' in rest
    assert len(fake.records()) == 1


@pytest.mark.fault("clients", "oversized heads and bodies")
def test_oversized_headers_get_431(strict: Running, fake: FakeEngine) -> None:
    """Headers past --max-header-bytes get 431 and close, before any body is read."""
    response = exchange(
        strict,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nX-Big: "
        + b"a" * 8000
        + b"\r\nContent-Length: 2\r\n\r\n{}",
    )
    assert response.startswith(b"HTTP/1.1 431")
    assert b'"code":"headers_too_large"' in response
    assert fake.records() == []


@pytest.mark.fault("clients", "smuggling, upgrades and hop-by-hop headers")
def test_content_length_with_transfer_encoding_is_400_and_close(gateway: Running, fake: FakeEngine) -> None:
    """Content-Length with Transfer-Encoding (request smuggling) gets 400 and close, as OpenAI JSON."""
    response = exchange(
        gateway,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" % len(BODY) + BODY,
    )
    assert response.startswith(b"HTTP/1.1 400")
    assert b"connection: close" in response and b'"error":' in response
    assert fake.records() == []


@pytest.mark.fault("clients", "idle keep-alive connections")
def test_normal_requests_are_unaffected(strict: Running, fake: FakeEngine) -> None:
    """Keep-alive requests well within the limits pass, one after another on one connection."""
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY
    )
    with socket.create_connection(("127.0.0.1", strict.port), timeout=5) as sock:
        for _ in range(3):
            sock.sendall(request)
            received = b""
            while b'"usage"' not in received:
                received += sock.recv(65536)
            assert received.startswith(b"HTTP/1.1 200")
            time.sleep(0.3)


@pytest.mark.fault("clients", "idle keep-alive connections")
def test_idle_client_connections_are_kept_for_the_keep_alive_timeout(
    start_gateway: StartGateway, fake: FakeEngine
) -> None:
    """An idle connection outlives uvicorn's 5 s by default (75 s); --keep-alive-timeout 1 ends it at 1 s."""

    def idle_for(gateway: Running, wait_s: float) -> bool:
        """Whether the same connection serves a second request after ``wait_s`` idle."""
        conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=5)
        try:
            headers = {"content-type": "application/json"}
            conn.request("POST", "/v1/chat/completions", BODY, headers)
            first = conn.getresponse()
            assert first.status == 200
            first.read()
            sock = conn.sock
            time.sleep(wait_s)
            try:
                conn.request("POST", "/v1/chat/completions", BODY, headers)
                second = conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                return False
            return second.status == 200 and conn.sock is sock
        finally:
            conn.close()

    assert idle_for(start_gateway({"fake": fake.url}), 6.0)
    assert not idle_for(start_gateway({"fake": fake.url}, "--keep-alive-timeout", "1"), 2.0)
