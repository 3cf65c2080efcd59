"""Requests written by hand on a socket, for what httpx would not do: a small receive buffer, a hang-up."""

from __future__ import annotations

import socket

import orjson

from tests.e2e.conftest import Running


def payload(**fields: object) -> bytes:
    return orjson.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], **fields})


def raw_request(
    gateway: Running, fake_header: str, body: bytes, rcvbuf: int | None = None, timeout_s: float | None = None
) -> socket.socket:
    """POST ``body`` to chat completions on a raw socket, with ``x-fake: fake_header``, and leave it open.

    ``rcvbuf`` shrinks the socket's receive buffer; ``timeout_s`` bounds each of its operations.
    """
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    if timeout_s is not None:
        sock.settimeout(timeout_s)
    sock.connect(("127.0.0.1", gateway.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
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
