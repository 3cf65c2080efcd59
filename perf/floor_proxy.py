"""The floor: the least a reverse proxy written in Python on uvloop and httptools can cost.

Not the gateway: a measuring stick for it. It does only what no model-aware
relay can skip, and nothing a user would need besides:

- the client's request parsed with httptools (a Python callback per piece);
- its JSON body parsed with orjson, for the model that picks the upstream;
- an idle keep-alive connection to that upstream taken from a list (or one
  opened), the request head and body sent in one write;
- the upstream's response parsed with httptools, and its head and body
  written to the client as they come, the head with the first body bytes.

No task and no coroutine per request: the client's protocol calls the
upstream's, which writes to the client's transport. No access log, no
metrics, no limits, no timeouts, no error handling past a 502 and a close.
What the gateway spends above this floor is what its features and its
structure cost; what the floor spends above nginx is what Python costs.

    python -m perf.floor_proxy --upstream m1=http://127.0.0.1:PORT [--port 0]

prints ``PORT <n>`` on stdout once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from typing import cast
from urllib.parse import urlsplit

import httptools
import orjson

_BAD_GATEWAY = (
    b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: application/json\r\ncontent-length: 31\r\n"
    b"connection: close\r\n\r\n"
    b'{"error":{"message":"upstream"}}'
)
# The response fields the floor sets itself (hop-by-hop, or its own framing).
_OWN = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length"})


class Upstream:
    """One upstream server: its idle keep-alive connections."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[UpstreamConnection] = []
        self.host_header = f"{host}:{port}".encode()


class UpstreamConnection(asyncio.Protocol):
    """A keep-alive connection to an upstream; relays one response at a time to a client."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: ClientConnection | None = None
        self.head: list[bytes] = []
        self.pending: bytes | None = None
        self.length: bytes | None = None
        self.chunked = False
        self.out: list[bytes] = []
        self.finished = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        if self.pending is not None:
            self.transport.write(self.pending)
            self.pending = None

    def send(self, client: ClientConnection, data: bytes) -> None:
        self.client = client
        if self.transport is None:
            self.pending = data
        else:
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        # What one read brings (several events of a stream) goes out in one write.
        self.out = []
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._fail()
            return
        client = self.client
        if client is None:
            return
        if self.out:
            client.transport.write(b"".join(self.out))
        if self.finished:
            self.finished = False
            self.client = None
            self.upstream.idle.append(self)
            client.done()

    def on_message_begin(self) -> None:
        self.head = []
        self.length = None

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-length":
            self.length = value
        elif lowered not in _OWN:
            self.head += (name, b": ", value, b"\r\n")

    def on_headers_complete(self) -> None:
        head = self.head
        head.insert(0, b"HTTP/1.1 %d OK\r\n" % self.parser.get_status_code())
        self.chunked = self.length is None
        if self.chunked:
            head.append(b"transfer-encoding: chunked\r\n\r\n")
        else:
            head += (b"content-length: ", self.length, b"\r\n\r\n")  # type: ignore[arg-type]
        self.out.append(b"".join(head))

    def on_body(self, body: bytes) -> None:
        if self.chunked:
            self.out.append(b"%x\r\n%b\r\n" % (len(body), body))
        else:
            self.out.append(body)

    def on_message_complete(self) -> None:
        if self.chunked:
            self.out.append(b"0\r\n\r\n")
        self.finished = True

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.upstream.idle:
            self.upstream.idle.remove(self)
        self._fail()

    def _fail(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.transport.write(_BAD_GATEWAY)
            client.transport.close()
        if self.transport is not None:
            self.transport.close()


class ClientConnection(asyncio.Protocol):
    """A client's keep-alive connection: each request parsed, routed by model and relayed."""

    def __init__(self, routes: dict[str, Upstream], loop: asyncio.AbstractEventLoop) -> None:
        self.routes = routes
        self.loop = loop
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers: list[bytes] = []
        self.body = b""
        self.transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(_BAD_GATEWAY)
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.body = b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered != b"host" and lowered != b"content-length" and lowered != b"connection":
            self.headers += (name, b": ", value, b"\r\n")

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        body = self.body
        try:
            model = orjson.loads(body)["model"]
            upstream = self.routes[model]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            self.transport.write(_BAD_GATEWAY)
            self.transport.close()
            return
        head = b"POST %b HTTP/1.1\r\nhost: %b\r\ncontent-length: %d\r\n%b\r\n" % (
            self.url,
            upstream.host_header,
            len(body),
            b"".join(self.headers),
        )
        if upstream.idle:
            upstream.idle.pop().send(self, head + body)
        else:
            conn = UpstreamConnection(upstream)
            conn.send(self, head + body)
            self.loop.create_task(self.loop.create_connection(lambda: conn, upstream.host, upstream.port))
        self.transport.pause_reading()

    def done(self) -> None:
        self.transport.resume_reading()


async def _serve(host: str, port: int, routes: dict[str, Upstream]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: ClientConnection(routes, loop), host, port, backlog=1024)
    sock: socket.socket = server.sockets[0]
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--upstream", action="append", default=[], metavar="MODEL=URL")
    args = parser.parse_args(argv)
    routes = {}
    for item in args.upstream:
        model, _, url = item.partition("=")
        parts = urlsplit(url)
        routes[model] = Upstream(parts.hostname or "127.0.0.1", parts.port or 80)
    if not routes:
        sys.exit("give at least one --upstream MODEL=URL")
    import uvloop

    uvloop.run(_serve(args.host, args.port, routes))


if __name__ == "__main__":
    main()
