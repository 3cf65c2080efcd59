"""The gateway's work on a json request, fused into the floor's callbacks: a design target, not a product.

The floor (``perf/floor_proxy.py``) does only what no model-aware relay can
skip. This relay does, besides, what the gateway does on its common case (a
non-stream request, whole in its read, to a model of one server) before,
while and after it relays it, in the shape the floor has: two protocols whose
callbacks do the work, no task, no coroutine, no object between them but one
record a request. Each part stands for a part of the gateway:

- the client's head walked once, as it is parsed: the Host (one, and one of
  the gateway's names), Origin and Sec-Fetch-Site (the browser checks),
  Content-Type and Content-Length (415, 413, the body budget), a client's
  ``x-request-id``, the fields that send a request elsewhere (Expect, Upgrade,
  Transfer-Encoding), and the upstream's head built from the headers that
  may cross;
- the body: parsed with orjson, its nesting bounded, the model routed, the
  token limits and the messages checked, the stream flag read;
- admission (the model's and the gateway's requests in flight), the body
  budget charged, a request id, ``x-forwarded-for``, the head's deadline
  (one timer), the connection in the drain's set;
- the upstream's head filtered as it is parsed (hop-by-hop fields, a
  ``connection: close`` that ends its reuse), the client's head written with
  the server's ``date``, ``x-request-id``, the timing header and the body in
  one write;
- what the request held given back, its record kept for the status page's
  activity (the last 300), its metrics (a count by status, three
  histograms) and its access-log line (fields kept, formatted a batch at a
  time to a file);
- a keep-alive connection's idle timer, one a connection;
- a pass of the loop's writes after its first (the upstream's request, the
  client's answer) made at the pass's end, as the gateway's
  ``proxy/outbox.py`` makes them.

A stream is relayed as the floor relays one (its record at its end), and
anything the gateway would refuse or hand to its task path is answered 502
and closed: the json cells measure the common case only. With no error
handling past that, no limits beyond these and no hand-over, it costs less
than a gateway doing this work can: what the gateway spends above it is what
its structure costs (its objects, calls and the code it shares with the
task path), not its features.

    python -m perf.fused_proxy --upstream m1=http://127.0.0.1:PORT [--port 0]

prints ``PORT <n>`` on stdout once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import os
import socket
import sys
import time
from collections import deque
from time import perf_counter
from typing import Any, cast
from urllib.parse import urlsplit

import httptools
import orjson

_REFUSED = (
    b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: application/json\r\ncontent-length: 34\r\n"
    b"connection: close\r\n\r\n"
    b'{"error":{"message":"not served"}}'
)
# Response fields not relayed: hop-by-hop, or set by the relay.
_RESPONSE_DROP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"content-length",
        b"proxy-authenticate",
        b"te",
        b"trailer",
        b"upgrade",
        b"server",
        b"date",
        b"x-request-id",
    }
)
# Request fields that do not cross to the upstream.
_REQUEST_DROP = frozenset(
    {
        b"host",
        b"content-length",
        b"connection",
        b"keep-alive",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"upgrade",
        b"x-forwarded-for",
        b"x-request-id",
        b"forwarded",
        b"authorization",
        b"cookie",
        b"content-type",
    }
)
_ODD = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
_JSON_TYPES = frozenset({b"application/json", b"text/json"})
_PATHS = frozenset({b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings"})
_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
_MAX_DEPTH = 64
_MAX_BODY = 8 << 20
_BUDGET = 256 << 20
_HEAD_TIMEOUT_S = 600.0
_KEEP_ALIVE_S = 5.0


class Histogram:
    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(_BOUNDS) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(_BOUNDS, value)] += 1
        self.sum += value


class Route:
    """A model's one server: its idle connections, its requests in flight, its metrics."""

    def __init__(self, model: str, host: str, port: int) -> None:
        self.model = model
        self.host, self.port = host, port
        self.host_header = f"{host}:{port}".encode()
        self.idle: list[UpstreamConnection] = []
        self.in_flight = 0
        self.limit = 256
        self.counts: dict[int, int] = {}
        self.e2e, self.overhead, self.ttft = Histogram(), Histogram(), Histogram()


class Record:
    """One request, as the status page's activity and the access log keep it."""

    __slots__ = ("bytes_out", "duration_s", "head_s", "model", "own_s", "request_id", "status")

    def __init__(self, request_id: bytes, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.status = 0
        self.bytes_out = 0
        self.duration_s = self.head_s = self.own_s = 0.0


class Gateway:
    """What the connections share: routes, names, counters, the access log's batch, the activity."""

    def __init__(self, loop: asyncio.AbstractEventLoop, routes: dict[str, Route]) -> None:
        self.loop = loop
        self.routes = routes
        self.hosts: frozenset[bytes] = frozenset()
        self.in_flight = 0
        self.limit = 1024
        self.budget = _BUDGET
        self.ids = itertools.count()
        self.id_prefix = os.urandom(4).hex().encode() + b"-"
        self.status_lines = {status: b"HTTP/1.1 %d OK\r\n" % status for status in range(200, 300)}
        self.draining: set[UpstreamConnection] = set()
        self.activity: deque[Record] = deque(maxlen=300)
        self.lines: list[tuple[Any, ...]] = []
        self.log = open(os.devnull, "w")  # noqa: SIM115 (held for the process's life)
        self._date = b""
        self._date_at = 0
        self._forwarded: dict[str, bytes] = {}
        # A pass's writes after its first, made at its end (as the gateway's ``proxy/outbox.py``).
        self.due: list[tuple[asyncio.Transport, bytes] | None] = []

    def write(self, transport: asyncio.Transport, data: bytes) -> None:
        due = self.due
        if due:
            due.append((transport, data))
            return
        due.append(None)  # the pass's first write: at once, the pass's end marked
        self.loop.call_soon(self.flush_due)
        transport.write(data)

    def flush_due(self) -> None:
        due = self.due
        if len(due) > 1:
            for transport, data in due[1:]:  # type: ignore[misc]
                if not transport.is_closing():
                    transport.write(data)
        due.clear()

    def date(self) -> bytes:
        now = int(time.time())
        if now != self._date_at:
            self._date_at = now
            self._date = (
                b"date: " + time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now)).encode() + b"\r\n"
            )
        return self._date

    def forwarded_for(self, peer: str) -> bytes:
        value = self._forwarded.get(peer)
        if value is None:
            value = self._forwarded[peer] = peer.encode()
        return value

    def record(self, record: Record, peer: str, path: bytes) -> None:
        self.activity.append(record)
        self.lines.append(
            (time.time_ns(), peer, path, record.request_id, record.model, record.status, record.bytes_out,
             record.duration_s, record.head_s, record.own_s)
        )  # fmt: skip
        if len(self.lines) == 1:
            self.loop.call_later(0.05, self.flush)

    def flush(self) -> None:
        out = []
        second, stamp = -1, ""
        for now_ns, peer, path, request_id, model, status, size, duration_s, head_s, own_s in self.lines:
            if now_ns // 1_000_000_000 != second:
                second = now_ns // 1_000_000_000
                stamp = time.strftime("%d/%b/%Y:%H:%M:%S", time.gmtime(second))
            out.append(
                f'{peer} - [{stamp}] "POST {path.decode()}" {request_id.decode()} {model} {status} {size} '
                f"{duration_s * 1e3:.1f}ms ttfb={head_s * 1e3:.1f}ms own={own_s * 1e3:.2f}ms"
            )
        self.lines.clear()
        self.log.write("\n".join(out) + "\n")
        self.log.flush()


class UpstreamConnection(asyncio.Protocol):
    """A keep-alive connection to an upstream; one client's response at a time."""

    def __init__(self, route: Route) -> None:
        self.route = route
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: ClientConnection | None = None
        self.pending: bytes | None = None
        self.head: list[bytes] = []
        self.length: bytes | None = None
        self.event_stream = False
        self.reusable = True
        self.body: bytes = b""
        self.out: list[bytes] = []
        self.finished = False
        self.idle_since = 0.0

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
            client.gateway.write(self.transport, data)

    def data_received(self, data: bytes) -> None:
        self.out = []
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._fail()
            return
        client = self.client
        if client is None:
            return
        if self.event_stream:
            if self.out:
                client.transport.write(b"".join(self.out))
            if self.finished:
                self.finished = False
                client.done(self, len(self.body))
        elif self.finished:
            self.finished = False
            client.answer(self)

    def on_message_begin(self) -> None:
        self.head = []
        self.length = None
        self.event_stream = False
        self.body = b""

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length":
            self.length = value
        elif name == b"connection":
            if value.lower() == b"close":
                self.reusable = False
        elif name not in _RESPONSE_DROP:
            if name == b"content-type" and value.startswith(b"text/event-stream"):
                self.event_stream = True
            self.head += (name, b": ", value, b"\r\n")

    def on_headers_complete(self) -> None:
        if self.event_stream and self.client is not None:
            self.out.append(self.client.stream_head(self))

    def on_body(self, body: bytes) -> None:
        if self.event_stream:
            self.out.append(b"%x\r\n%b\r\n" % (len(body), body))
            self.body = body
        else:
            self.body = body if not self.body else self.body + body

    def on_message_complete(self) -> None:
        if self.event_stream:
            self.out.append(b"0\r\n\r\n")
        self.finished = True

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.route.idle:
            self.route.idle.remove(self)
        self._fail()

    def _fail(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.refuse()
        if self.transport is not None:
            self.transport.close()


class ClientConnection(asyncio.Protocol):
    """A client's keep-alive connection: each request checked, routed by model, relayed, recorded."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.loop = gateway.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.peer = ""
        self.url = b""
        self.headers: list[bytes] = []
        self.body = b""
        self.hosts = 0
        self.host = b""
        self.origin: bytes | None = None
        self.site = b""
        self.media = b""
        self.declared = -1
        self.request_id: bytes | None = None
        self.odd = False
        self.keep_alive = True
        self.timer: asyncio.TimerHandle | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.idle_since = 0.0
        # The request being relayed.
        self.route: Route | None = None
        self.upstream: UpstreamConnection | None = None
        self.record: Record | None = None
        self.started = self.sent = 0.0
        self.charged = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.peer = self.transport.get_extra_info("peername")[0]
        self.timer = self.loop.call_later(10.0, self.transport.close)

    def data_received(self, data: bytes) -> None:
        self.idle_since = 0.0
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.refuse()

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.body = b""
        self.hosts = 0
        self.origin = self.request_id = None
        self.site = self.media = b""
        self.declared = -1
        self.odd = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"host":
            self.hosts += 1
            self.host = value
        elif name == b"content-type":
            self.media = value.split(b";", 1)[0].strip().lower()
        elif name == b"content-length":
            self.declared = int(value) if value.isdigit() else -1
        elif name == b"origin":
            self.origin = value
        elif name == b"sec-fetch-site":
            self.site = value
        elif name == b"x-request-id":
            self.request_id = value
        elif name in _ODD:
            self.odd = True
        if name not in _REQUEST_DROP:
            self.headers += (name, b": ", value, b"\r\n")

    def on_headers_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body = body if not self.body else self.body + body

    def on_message_complete(self) -> None:
        started = perf_counter()
        gateway = self.gateway
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        body = self.body
        if (
            self.parser.get_method() != b"POST"
            or self.url not in _PATHS
            or self.hosts != 1
            or self.host not in gateway.hosts
            or self.origin is not None
            or self.site == b"cross-site"
            or self.odd
            or self.media not in _JSON_TYPES
            or self.declared > _MAX_BODY
            or len(body) > gateway.budget
        ):
            self.refuse()
            return
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            self.refuse()
            return
        if body.count(b"[") + body.count(b"{") > _MAX_DEPTH or type(doc) is not dict:
            self.refuse()
            return
        model = doc.get("model")
        route = gateway.routes.get(model) if type(model) is str else None
        messages = doc.get("messages")
        if route is None or type(messages) is not list or not messages:
            self.refuse()
            return
        for field in _TOKEN_FIELDS:
            value = doc.get(field)
            if value is not None and (type(value) is not int or value < 1):
                self.refuse()
                return
        for message in messages:
            if type(message) is not dict or type(message.get("role")) is not str:
                self.refuse()
                return
        if route.in_flight >= route.limit or gateway.in_flight >= gateway.limit:
            self.refuse()
            return
        route.in_flight += 1
        gateway.in_flight += 1
        gateway.budget -= len(body)
        self.charged = len(body)
        request_id = self.request_id or b"%s%08x" % (gateway.id_prefix, next(gateway.ids))
        head = (
            b"POST %b HTTP/1.1\r\nhost: %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"x-request-id: %b\r\nx-forwarded-for: %b\r\n%b\r\n"
        ) % (
            self.url,
            route.host_header,
            len(body),
            request_id,
            gateway.forwarded_for(self.peer),
            b"".join(self.headers),
        )
        upstream = route.idle.pop() if route.idle else None
        if upstream is None:
            upstream = UpstreamConnection(route)
            upstream.send(self, head + body)
            connecting = upstream
            self.loop.create_task(self.loop.create_connection(lambda: connecting, route.host, route.port))
        else:
            upstream.send(self, head + body)
        gateway.draining.add(upstream)
        self.route, self.upstream, self.record = route, upstream, Record(request_id, route.model)
        self.started, self.sent = started, perf_counter()
        self.timer = self.loop.call_at(self.loop.time() + _HEAD_TIMEOUT_S, self.refuse)
        self.transport.pause_reading()

    def stream_head(self, upstream: UpstreamConnection) -> bytes:
        head_at = perf_counter()
        status = upstream.parser.get_status_code()
        record = self.record
        if record is not None:
            record.status, record.head_s = status, head_at - self.started
            record.own_s = self.sent - self.started + perf_counter() - head_at
        return b"%b%btransfer-encoding: chunked\r\n%b\r\n" % (
            self.gateway.status_lines.get(status, b"HTTP/1.1 200 OK\r\n"),
            self.gateway.date(),
            b"".join(upstream.head),
        )

    def answer(self, upstream: UpstreamConnection) -> None:
        head_at = perf_counter()
        status = upstream.parser.get_status_code()
        record = self.record
        if upstream.length is None or status not in self.gateway.status_lines or record is None:
            self.refuse()
            return
        body = upstream.body
        own_s = self.sent - self.started + perf_counter() - head_at
        self.gateway.write(
            self.transport,
            b"%b%bcontent-length: %b\r\nx-request-id: %b\r\nx-blazar-timing: own=%.3f;up=%.3f\r\n%b\r\n%b"
            % (
                self.gateway.status_lines[status],
                self.gateway.date(),
                upstream.length,
                record.request_id,
                own_s * 1000,
                (head_at - self.sent) * 1000,
                b"".join(upstream.head),
                body,
            ),
        )
        record.status, record.own_s, record.head_s = status, own_s, head_at - self.started
        self.done(upstream, len(body))

    def done(self, upstream: UpstreamConnection, size: int) -> None:
        """The response is written: what the request held given back, its record, the next request."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        gateway, route, record = self.gateway, self.route, self.record
        assert route is not None and record is not None
        upstream.client = None
        gateway.draining.discard(upstream)
        if upstream.reusable:
            upstream.idle_since = self.loop.time()
            route.idle.append(upstream)
        elif upstream.transport is not None:
            upstream.transport.close()
        route.in_flight -= 1
        gateway.in_flight -= 1
        gateway.budget += self.charged
        self.charged = 0
        self.route = self.upstream = self.record = None
        record.bytes_out = size
        record.duration_s = duration_s = perf_counter() - self.started
        route.counts[record.status] = route.counts.get(record.status, 0) + 1
        route.e2e.observe(duration_s)
        route.overhead.observe(record.own_s)
        route.ttft.observe(record.head_s)
        gateway.record(record, self.peer, self.url)
        if not self.keep_alive:
            gateway.flush_due()  # the answer, before the close
            self.transport.close()
            return
        self.transport.resume_reading()
        self.idle_since = self.loop.time()
        if self.idle_timer is None:
            self.idle_timer = self.loop.call_later(_KEEP_ALIVE_S, self._idle)

    def _idle(self) -> None:
        self.idle_timer = None
        if not self.idle_since:
            return
        left = self.idle_since + _KEEP_ALIVE_S - self.loop.time()
        if left > 0:
            self.idle_timer = self.loop.call_later(left, self._idle)
        else:
            self.transport.close()

    def refuse(self) -> None:
        self.gateway.flush_due()  # an answer held for the pass's end goes first
        self.transport.write(_REFUSED)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self.timer, self.idle_timer):
            if timer is not None:
                timer.cancel()


async def _serve(host: str, port: int, routes: dict[str, Route]) -> None:
    loop = asyncio.get_running_loop()
    gateway = Gateway(loop, routes)
    server = await loop.create_server(lambda: ClientConnection(gateway), host, port, backlog=1024)
    sock: socket.socket = server.sockets[0]
    bound = sock.getsockname()[1]
    gateway.hosts = frozenset(b"%s:%d" % (name, bound) for name in (b"127.0.0.1", b"localhost")) | {
        b"127.0.0.1",
        b"localhost",
    }
    print(f"PORT {bound}", flush=True)
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
        routes[model] = Route(model, parts.hostname or "127.0.0.1", parts.port or 80)
    if not routes:
        sys.exit("give at least one --upstream MODEL=URL")
    import uvloop

    uvloop.run(_serve(args.host, args.port, routes))


if __name__ == "__main__":
    main()
