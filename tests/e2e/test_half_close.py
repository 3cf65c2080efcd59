"""A client that half-closes (``shutdown(SHUT_WR)``) after its request: what the access log says it got.

uvicorn's protocol closes the connection at the client's end of input (its
``eof_received`` keeps nothing open), as nginx ends a request whose client
closed (its 499): the response is never written, and the line must say so.
"""

from __future__ import annotations

import socket
import time

import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartGateway

CHAT = b"/v1/chat/completions"


def half_close(
    gateway: Running, request_id: str, version: bytes = b"1.1", fault: bytes = b"", **fields: object
) -> bytes:
    """Send a chat request, shut down the sending side, and read what comes until the close."""
    body = orjson.dumps(
        {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **fields}
    )
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        sock.sendall(
            b"POST %s HTTP/%s\r\nHost: localhost\r\nContent-Type: application/json\r\nx-request-id: %s\r\n"
            # The engine answers after 30 ms: after the gateway has seen the half-close, before
            # the disconnect watch (50 ms) would.
            b"x-fake: prefill=0.03%s\r\nContent-Length: %d\r\n\r\n"
            % (CHAT, version, request_id.encode(), fault, len(body))
            + body
        )
        sock.shutdown(socket.SHUT_WR)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
    return received


def logged(gateway: Running, request_id: str, timeout_s: float = 10.0) -> dict[str, object]:
    """The JSON access-log line of ``request_id``, once written."""
    deadline = time.monotonic() + timeout_s
    while True:
        for line in gateway.log().splitlines():
            if f'"request_id":"{request_id}"' in line:
                record: dict[str, object] = orjson.loads(line)
                return record
        if time.monotonic() > deadline:
            raise AssertionError(f"no access-log line for {request_id}: {gateway.log()[-2000:]}")
        time.sleep(0.02)


@pytest.fixture
def json_log(start_gateway: StartGateway, fake: FakeEngine) -> Running:
    return start_gateway({"fake": fake.url}, "--log-format", "json")


@pytest.mark.fault("clients", "a client that leaves mid-request")
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_client_that_half_closes_is_logged_with_what_it_received(
    json_log: Running, fake: FakeEngine, stream: bool
) -> None:
    """Half-closed after its request, the client gets nothing, and its line says 499 and 0 bytes, not 200."""
    request_id = f"half-close-{stream}"
    received = half_close(json_log, request_id, stream=stream)
    record = logged(json_log, request_id)
    assert received == b""
    assert (record["status"], record["bytes"]) == (499, 0), record


@pytest.mark.fault("clients", "a client that leaves mid-request")
def test_an_http10_client_that_half_closes_is_logged_with_what_it_received(
    json_log: Running, fake: FakeEngine
) -> None:
    """The same through ASGI send (an HTTP/1.0 client's close-delimited stream): 499 and 0 bytes."""
    received = half_close(json_log, "half-close-http10", version=b"1.0", stream=True)
    record = logged(json_log, "half-close-http10")
    assert received == b""
    assert (record["status"], record["bytes"]) == (499, 0), record


@pytest.mark.fault("clients", "a client that leaves mid-request")
def test_a_client_that_half_closes_before_an_upstream_error_is_logged_with_what_it_received(
    json_log: Running, fake: FakeEngine
) -> None:
    """An upstream's error answered through ASGI send after the half-close: 499 and 0 bytes, not 503."""
    received = half_close(json_log, "half-close-error", fault=b"; status=503")
    record = logged(json_log, "half-close-error")
    assert received == b""
    assert (record["status"], record["bytes"]) == (499, 0), record
