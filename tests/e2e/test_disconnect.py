"""A client that goes away takes its upstream connection with it, at once.

An engine keeps generating for a client that has gone until its socket is
closed (mlx_lm.server generates a non-streamed reply to the end), so the
gateway must close the upstream connection as soon as the client's closes:
mid-stream, during a non-streamed generation, and in a prefill that has sent
nothing yet. The fake engine records when it saw its peer close.
"""

from __future__ import annotations

import socket
import time

import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartGateway
from tests.e2e.raw_http import payload, raw_request

pytestmark = pytest.mark.fault("clients", "a client that leaves mid-request")

_NOTICE_WITHIN_S = 1.0


def hang_up(sock: socket.socket) -> float:
    closed_at = time.time()
    sock.close()
    return closed_at


@pytest.mark.parametrize(
    ("stream", "fake_header", "read_first"),
    [
        pytest.param(True, "chunk-delay=0.05; chunks=400", True, id="mid-stream"),
        pytest.param(False, "prefill=30", False, id="non-stream-generating"),
        pytest.param(True, "prefill=30", False, id="stream-in-prefill"),
    ],
)
def test_client_disconnect_closes_upstream(
    gateway: Running, fake: FakeEngine, stream: bool, fake_header: str, read_first: bool
) -> None:
    """The engine sees its connection closed within 1 s of the client hanging up."""
    sock = raw_request(gateway, fake_header, payload(stream=stream), timeout_s=10)
    fake.wait_for_record(lambda r: r["path"] == "/v1/chat/completions")
    if read_first:
        received = b""
        while b"data: {" not in received:
            received += sock.recv(65536)
    else:
        time.sleep(0.3)
    assert fake.records()[0]["closed_at"] is None
    client_closed_at = hang_up(sock)
    record = fake.wait_for_record(lambda r: r["closed_at"] is not None, timeout_s=5)
    assert record["outcome"] == "peer_closed"
    assert record["closed_at"] - client_closed_at < _NOTICE_WITHIN_S
    if read_first:
        assert record["events_sent"] < 400


def test_a_pipelined_client_that_hangs_up_frees_the_running_request(
    start_gateway: StartGateway, fake: FakeEngine
) -> None:
    """A client that sent a second request behind a running stream, then hung up: the running one's
    upstream is closed too (uvicorn tells only the newest request of the disconnect)."""
    body = orjson.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n" % len(body)
    )
    gateway = start_gateway({"fake": fake.url})
    sock = socket.create_connection(("127.0.0.1", gateway.port))
    sock.sendall(head + b"x-fake: stall=30\r\n\r\n" + body + head + b"\r\n" + body)
    received = b""
    while b"data: {" not in received:
        received += sock.recv(65536)
    client_closed_at = hang_up(sock)
    record = fake.wait_for_record(lambda r: r["closed_at"] is not None, timeout_s=5)
    assert record["outcome"] == "peer_closed"
    assert record["closed_at"] - client_closed_at < _NOTICE_WITHIN_S
    assert "Traceback" not in gateway.log()


def test_gateway_keeps_serving_after_disconnects(gateway: Running, fake: FakeEngine) -> None:
    """After clients hang up mid-request, the gateway still answers new requests normally."""
    for header in ("prefill=30", "chunk-delay=0.05; chunks=400"):
        sock = raw_request(gateway, header, payload(stream=True), timeout_s=10)
        time.sleep(0.2)
        hang_up(sock)
    sock = raw_request(gateway, "chunks=2", payload(max_tokens=2), timeout_s=10)
    response = b""
    while chunk := sock.recv(65536):
        response += chunk
        if b"\r\n\r\n" in response and b'"usage"' in response:
            break
    sock.close()
    assert response.startswith(b"HTTP/1.1 200")
