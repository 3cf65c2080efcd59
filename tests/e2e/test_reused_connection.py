"""A pooled upstream connection that the upstream closed as it was taken: the request goes again.

llama-server closes its connection after every stream although its head
said keep-alive; a request that waited in the gateway's queue took that
connection in the same instant and got a 502 ``upstream_empty_reply``. The
upstream here makes the race certain: on each connection it answers the
first request, keeps the connection, and closes it on the next request
without a byte of answer. Only a reused connection's empty close is sent
again, once, on a new connection; a new connection's empty close is the
upstream's answer (502).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import StartGateway
from tests.helpers import free_port

_REPLY = (
    b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":'
    b'[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}'
)


class OneAnswerPerConnection:
    """An HTTP/1.1 upstream that answers a connection's first request and closes on its second.

    With ``answer_first=False`` it closes every connection on its first request.
    """

    def __init__(self, *, answer_first: bool = True) -> None:
        self.answer_first = answer_first
        self.port = free_port()
        self.arrivals: list[tuple[int, int]] = []  # (connection number, request number on it)
        self._sock = socket.create_server(("127.0.0.1", self.port))
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        number = 0
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            number += 1
            threading.Thread(target=self._connection, args=(conn, number), daemon=True).start()

    def _connection(self, conn: socket.socket, number: int) -> None:
        with conn:
            data = b""
            for index in range(1, 3):
                while b"\r\n\r\n" not in data:
                    more = conn.recv(65536)
                    if not more:
                        return
                    data += more
                head, _, rest = data.partition(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                while len(rest) < length:
                    rest += conn.recv(65536)
                data = rest[length:]
                self.arrivals.append((number, index))
                if index == 2 or not self.answer_first:
                    return  # closed without a byte of answer
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: keep-alive\r\n"
                    b"content-length: %d\r\n\r\n" % len(_REPLY) + _REPLY
                )

    def close(self) -> None:
        self._sock.close()


@pytest.fixture
def closing_upstream() -> Iterator[OneAnswerPerConnection]:
    upstream = OneAnswerPerConnection()
    yield upstream
    upstream.close()


def _chat() -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.fault("upstreams", "a pooled connection closed as it is reused")
def test_a_reused_connection_closed_without_an_answer_is_sent_again_on_a_new_one(
    start_gateway: StartGateway, closing_upstream: OneAnswerPerConnection
) -> None:
    """Every request is answered 200: each second request on a connection goes again on a new one."""
    gateway = start_gateway({"m": f"http://127.0.0.1:{closing_upstream.port}/v1"})
    with httpx.Client(trust_env=False, timeout=10) as http:
        statuses = [
            http.post(f"{gateway.url}/v1/chat/completions", json=_chat()).status_code for _ in range(4)
        ]
    assert statuses == [200, 200, 200, 200]
    # (The gateway's readiness check opens connections that carry no request.)
    closed_on_reuse = [arrival for arrival in closing_upstream.arrivals if arrival[1] == 2]
    assert closed_on_reuse, closing_upstream.arrivals
    # Each such request went once more, on a new connection, as its first request.
    assert len(closing_upstream.arrivals) == 4 + len(closed_on_reuse)


@pytest.mark.fault("upstreams", "a pooled connection closed as it is reused")
def test_a_new_connection_closed_without_an_answer_is_a_502_not_sent_again(
    start_gateway: StartGateway,
) -> None:
    """An upstream that closes a new connection on its first request: 502, and the request went once."""
    upstream = OneAnswerPerConnection(answer_first=False)
    try:
        gateway = start_gateway({"m": f"http://127.0.0.1:{upstream.port}/v1"})
        with httpx.Client(trust_env=False, timeout=10) as http:
            response = http.post(f"{gateway.url}/v1/chat/completions", json=_chat())
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "upstream_empty_reply"
        assert [index for _, index in upstream.arrivals] == [1]
    finally:
        upstream.close()
