"""The relay's fast path end to end in process: the gateway's app on uvicorn, an upstream on asyncio.

Which requests it serves from callbacks (counted at ``Relay.try_fast``), that
the rest of an exchange it hands over is answered as the task path answers,
and that a request served from callbacks leaves nothing for the collector.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any, cast

import orjson
import pytest

from engines.spec import Guards
from proxy import entry
from proxy.app import Gateway, build_app
from proxy.payload import parse_request
from proxy.relay import HeadFields, exchange, handler
from proxy.relay.outcome import Outcome
from proxy.routing import Route, RoutingTable, UpstreamAddress
from proxy.startup.settings import Settings
from proxy.upstream import Connection
from proxy.upstream_errors import EmptyReply
from tests.helpers import in_process_server, replaces_calls_into, wait_until_async

pytestmark = pytest.mark.anyio

REPLY = orjson.dumps(
    {"id": "c1", "object": "chat.completion", "choices": [], "usage": {"completion_tokens": 3}}
)


# A chat stream's events, as an engine writes them: one HTTP chunk each.
EVENTS = [b'data: {"choices":[{"delta":{"content":"%d"}}]}\n\n' % n for n in range(3)]
DONE = b"data: [DONE]\n\n"
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


STREAM_MODES = frozenset(
    {"events", "events-later", "cut", "break", "silent", "slow-head", "endless", "endless-large"}
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class Upstream(asyncio.Protocol):
    """Answers each request by its body's ``mode``: whole at once, whole after 0.2 s (``slow``),
    head then body later (0.05 s, or 0.4 s: ``later-slow``), or a 500;
    or an event stream: whole (``events``), its end later (``events-later``), without its end
    (``cut``), broken by a close (``break``), silent after its first event (``silent``), endless
    (``endless``, ``endless-large``), or after a slow head (``slow-head``)."""

    # How many connections the gateway has opened to it, how many requests it was sent, and
    # how many of its connections were closed under it.
    connections = 0
    requests = 0
    lost = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        Upstream.connections += 1
        self.transport: Any = transport
        self.buffer = b""
        self.timer: asyncio.TimerHandle | None = None

    def connection_lost(self, exc: Exception | None) -> None:
        Upstream.lost += 1
        if self.timer is not None:
            self.timer.cancel()

    def endless(self, event: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(chunk(event))
            self.timer = asyncio.get_running_loop().call_later(0.002, self.endless, event)

    def stream(self, mode: str) -> None:
        loop = asyncio.get_running_loop()
        write = self.transport.write
        events = b"".join(map(chunk, EVENTS))
        if mode == "events":
            write(SSE_HEAD + events + chunk(DONE) + b"0\r\n\r\n")
        elif mode == "events-later":
            write(SSE_HEAD + chunk(EVENTS[0]))
            loop.call_later(0.05, write, b"".join(map(chunk, EVENTS[1:])))
            loop.call_later(0.1, write, chunk(DONE) + b"0\r\n\r\n")
        elif mode == "cut":
            write(SSE_HEAD + events + b"0\r\n\r\n")
        elif mode == "break":
            write(SSE_HEAD + chunk(EVENTS[0]))
            loop.call_later(0.05, self.transport.close)
        elif mode == "silent":
            write(SSE_HEAD + chunk(EVENTS[0]))
        elif mode == "slow-head":
            loop.call_later(0.3, write, SSE_HEAD + events + chunk(DONE) + b"0\r\n\r\n")
        else:
            write(SSE_HEAD)
            self.endless(EVENTS[0] if mode == "endless" else b"data: " + b"x" * 65536 + b"\n\n")

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head, sep, rest = self.buffer.partition(b"\r\n\r\n")
        if not sep:
            return
        length = int(
            next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))[15:]
        )
        if len(rest) < length:
            return
        body, self.buffer = rest[:length], rest[length:]
        Upstream.requests += 1
        mode = orjson.loads(body).get("mode")
        if mode in STREAM_MODES:
            self.stream(mode)
            return
        if mode == "error":
            error = b'{"error":{"message":"boom"}}'
            self.transport.write(
                b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: %d\r\n\r\n%b" % (len(error), error)
            )
            return
        response_head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(REPLY)
        )
        if mode == "slow":
            asyncio.get_running_loop().call_later(0.2, self.transport.write, response_head + REPLY)
        elif mode in ("later", "later-slow"):
            self.transport.write(response_head)
            asyncio.get_running_loop().call_later(
                0.05 if mode == "later" else 0.5, self.transport.write, REPLY
            )
        else:
            self.transport.write(response_head + REPLY)


@asynccontextmanager
async def gateway(
    listening: bool = True, settings: Settings | None = None
) -> AsyncIterator[tuple[int, Gateway, list[bool]]]:
    """A gateway over one upstream (``listening``: else a port nothing listens on); each answer of
    the app's ``fast`` and ``fast_after_head`` (what the lean protocol offers a request to) is
    appended to the list."""
    loop = asyncio.get_running_loop()
    Upstream.connections = Upstream.requests = Upstream.lost = 0
    upstream = await loop.create_server(Upstream, "127.0.0.1", 0)
    upstream_port = upstream.sockets[0].getsockname()[1]
    if not listening:
        upstream.close()
        await upstream.wait_closed()
    route = Route(model="m1", upstream=UpstreamAddress("127.0.0.1", upstream_port), guards=Guards())
    app = build_app(RoutingTable([route]), settings or Settings())
    taken: list[bool] = []

    def counting(offer: Callable[..., bool]) -> Callable[..., bool]:
        def counted(*args: Any) -> bool:
            taken.append(offer(*args))
            return taken[-1]

        return counted

    # Read by each connection's protocol as it is made (compiled, the entry's methods are fixed).
    app.fast = counting(app.fast)
    app.fast_after_head = counting(app.fast_after_head)
    try:
        async with in_process_server(app) as port:
            yield port, app, taken
    finally:
        upstream.close()


@contextlib.contextmanager
def connecting_through(
    pool: Any, wrap: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]
) -> Iterator[None]:
    """Each connection ``pool`` opens goes through ``wrap(open)``, ``open`` making it: at the running
    loop's ``create_connection`` (the pool's own code, compiled or not, runs as it is)."""
    loop = asyncio.get_running_loop()
    create = loop.create_connection
    ip, port = pool.address.host, pool.address.port

    def create_connection(factory: Any, host: Any = None, to: Any = None, *args: Any, **kwargs: Any) -> Any:
        if (host, to) != (ip, port):
            return create(factory, host, to, *args, **kwargs)
        return wrap(lambda: create(factory, host, to, *args, **kwargs))

    loop.create_connection = create_connection  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del loop.create_connection


async def posts(port: int, *bodies: bytes, full: bool = False) -> list[tuple[bytes, bytes]]:
    """Each body POSTed in turn on one connection; each response's head and body. ``full``: on the
    full protocol (``on_full_protocol``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if full:
        await on_full_protocol(reader, writer)
    answers = []
    for body in bodies:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(v for n, _, v in (h.partition(b": ") for h in head.split(b"\r\n")) if n == b"content-length")
        )
        answers.append((head, await reader.readexactly(length)))
    writer.close()
    return answers


async def on_full_protocol(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Give the connection to the full protocol, for good: a GET (the lean protocol serves POSTs
    only), answered."""
    writer.write(b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(
        next(v for n, _, v in (h.partition(b": ") for h in head.split(b"\r\n")) if n == b"content-length")
    )
    await reader.readexactly(length)


async def head_alone(port: int, body: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection on which the head of a POST of ``body`` is written, and read by the gateway;
    its body is the caller's to write (as the SDKs write a request: head, then body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    await writer.drain()
    await asyncio.sleep(0.05)
    return reader, writer


async def test_a_plain_request_is_served_from_callbacks_and_answered_whole() -> None:
    """The first request opens the pool's connection itself (none is pooled); the next reuses it."""
    async with gateway() as (port, _, taken):
        [first, (head, body)] = await posts(port, b'{"model":"m1"}', b'{"model":"m1","messages":[]}')
    assert taken == [True, True] and Upstream.connections == 1
    assert first[1] == REPLY
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"x-request-id: " in head and b"server-timing: " in head
    assert body == REPLY


async def test_a_body_served_from_callbacks_holds_the_budget_until_its_answer() -> None:
    """The body's bytes are charged to the budget while the upstream has not answered, and given
    back once it has (as the task path holds a body)."""
    body = b'{"model":"m1","mode":"slow"}'
    async with gateway() as (port, app, taken):
        budget = app.relay.body_budget
        answered = asyncio.ensure_future(posts(port, body))
        await wait_until_async(lambda: Upstream.requests == 1 or None, "the request sent upstream")
        assert budget.held_bytes == len(body)
        [(head, reply)] = await answered
    assert taken == [True] and head.startswith(b"HTTP/1.1 200 ") and reply == REPLY
    assert budget.held_bytes == 0


async def test_a_stream_and_an_unknown_model_go_the_task_s_way() -> None:
    async with gateway() as (port, _, taken):
        [(head, body)] = await posts(port, b'{"model":"nope","messages":[]}')
    assert taken == [False]
    assert head.startswith(b"HTTP/1.1 404 ") and orjson.loads(body)["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "body",
    [b'{"model":"m1","stream":true}', b'{"model":"m1","messages":[], "stream" :\n true}'],
)
@pytest.mark.parametrize("full", [False, True], ids=["lean protocol", "full protocol"])
@replaces_calls_into("proxy/payload.py")
async def test_a_stream_is_parsed_once(body: bytes, full: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the lean protocol the fast path takes it, and hands it over at the upstream's head (JSON
    here: the task path's 502 that says so); on the full protocol, whose client takes no stream
    from the fast path, it is declined before any parse. Either way, parsed once."""
    parsed: list[bytes] = []

    def counted(data: Any) -> Any:
        parsed.append(bytes(data))
        return parse_request(data)

    monkeypatch.setattr(handler, "parse_request", counted)
    async with gateway() as (port, _, taken):
        [(head, answer)] = await posts(port, body, full=full)
    assert taken == [not full] and parsed == [body]
    assert head.startswith(b"HTTP/1.1 502 ") and b"not an event stream" in answer


async def test_a_head_whose_body_comes_later_and_an_upstream_error_are_handed_over() -> None:
    async with gateway() as (port, _, taken):
        answers = await posts(
            port,
            b'{"model":"m1"}',
            b'{"model":"m1","mode":"later"}',
            b'{"model":"m1","mode":"error"}',
            b'{"model":"m1"}',
        )
    assert taken == [True, True, True, True]
    _, (later_head, later_body), (error_head, error_body), (_, plain_body) = answers
    assert later_head.startswith(b"HTTP/1.1 200 OK\r\n") and later_body == REPLY
    # The upstream's error as the task path relays it: its status, in OpenAI's envelope.
    assert error_head.startswith(b"HTTP/1.1 500 ") and orjson.loads(error_body)["error"]["message"] == "boom"
    assert plain_body == REPLY


@replaces_calls_into("proxy/relay/request.py", "proxy/browser.py", "proxy/entry.py")
async def test_a_body_written_after_its_head_is_served_from_callbacks_its_head_checked_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the SDKs write a request (head, then body): the head's fields are walked once, and the
    browser checks and the relay's check of the head run once, as the head comes, not again with
    the body."""
    checks: list[str] = []
    refuses_head = handler.refuses_head  # type: ignore[attr-defined]

    def counted_refuses_head(*args: Any) -> bool:
        checks.append("head")
        return refuses_head(*args)

    def counted_fields(*args: Any) -> HeadFields:
        checks.append("walk")
        return HeadFields(*args)

    monkeypatch.setattr(handler, "refuses_head", counted_refuses_head)
    monkeypatch.setattr(entry, "HeadFields", counted_fields)
    async with gateway() as (port, app, taken):
        refusal_of = app.browser.refusal_of

        def counted_refusal(*args: Any) -> Any:
            checks.append("browser")
            return refusal_of(*args)

        app.browser.refusal_of = counted_refusal  # type: ignore[method-assign,assignment]
        body = b'{"model":"m1","messages":[]}'
        reader, writer = await head_alone(port, body)
        assert checks == ["walk", "browser", "head"]
        writer.write(body)
        head = await reader.readuntil(b"\r\n\r\n")
        answer = await reader.readexactly(len(REPLY))
        writer.close()
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and answer == REPLY
    assert taken == [True] and checks == ["walk", "browser", "head"]


async def test_a_body_that_comes_after_a_drain_began_is_answered_503() -> None:
    """Its head was checked before the drain began; the drain is seen when its body comes, as the
    full protocol's request would have seen it at its head: 503, not an exchange the drain does
    not wait for."""
    async with gateway() as (port, app, taken):
        body = b'{"model":"m1","messages":[]}'
        reader, writer = await head_alone(port, body)
        app.state.draining = True
        writer.write(body)
        head = await reader.readuntil(b"\r\n\r\n")
        writer.close()
        app.state.draining = False
    assert head.startswith(b"HTTP/1.1 503 ") and taken == [False] and Upstream.requests == 0


async def test_a_request_served_from_callbacks_leaves_nothing_for_the_collector() -> None:
    async with gateway() as (port, _, taken):
        await posts(port, b'{"model":"m1"}')  # start-up's garbage, and the pool's first connection
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            await posts(port, *[b'{"model":"m1"}'] * 20)
            gc.collect()
            left = {type(o).__name__ for o in gc.garbage}
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert all(taken)
    assert not left & {"FastExchange", "Client", "Outcome", "ClientWriter", "RequestResponseCycle"}, left


async def test_a_connection_the_fast_path_cannot_open_is_answered_as_that_failure_once() -> None:
    """The task path answers it (503, in OpenAI's envelope) without a second attempt."""
    async with gateway(listening=False) as (port, app, taken):
        pool = app.relay.pools[next(iter(app.relay.pools))]
        attempts: list[int] = []

        async def counted(open_: Callable[[], Awaitable[Any]]) -> Any:
            attempts.append(1)
            return await open_()

        with connecting_through(pool, counted):
            [(head, body)] = await posts(port, b'{"model":"m1"}')
    assert taken == [True] and len(attempts) == 1
    assert head.startswith(b"HTTP/1.1 503 ")
    error = orjson.loads(body)["error"]
    assert error["code"] == "upstream_unavailable" and "cannot connect to upstream" in error["message"]


@pytest.mark.parametrize(
    ("body", "fast"),
    [(b'{"model":"m1"}', True), (b'{"model":"m1","stream":true}', False)],
    ids=["fast path", "task path"],
)
async def test_a_client_that_leaves_while_the_connection_opens_holds_nothing(body: bytes, fast: bool) -> None:
    """Its request is sent nowhere, recorded as 499, and holds nothing: on the fast path, and on
    the task path (a stream on the full protocol)."""
    async with gateway() as (port, app, taken):
        pool = app.relay.pools[next(iter(app.relay.pools))]

        async def slow(open_: Callable[[], Awaitable[Any]]) -> Any:
            await asyncio.sleep(0.2)
            return await open_()

        with connecting_through(pool, slow):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if not fast:
                await on_full_protocol(reader, writer)
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
            )
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.close()
            for _ in range(100):
                await asyncio.sleep(0.02)
                if not app.state.in_flight:
                    break
            assert taken == [fast]
            assert app.state.in_flight == 0 and app.relay.body_budget.held_bytes == 0
            # Nothing reached the upstream once the connection had opened, and the request is recorded
            # as one whose client left before its response began (499).
            await asyncio.sleep(0.3)
            assert Upstream.requests == 0
            assert [record.status for record in app.status.activity] == [499]
        # The gateway still serves (its slot and the pool's connections are whole).
        [(head, answer)] = await posts(port, b'{"model":"m1"}')
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and answer == REPLY


async def test_a_drain_that_ends_while_the_connection_opens_sends_nothing() -> None:
    """As on the task path: the drain's end is checked once the connection is open (503)."""
    async with gateway() as (port, app, taken):
        pool = app.relay.pools[next(iter(app.relay.pools))]
        opening, go_on = asyncio.Event(), asyncio.Event()

        async def held(open_: Callable[[], Awaitable[Any]]) -> Any:
            opening.set()
            await go_on.wait()
            return await open_()

        with connecting_through(pool, held):
            answers = asyncio.ensure_future(posts(port, b'{"model":"m1"}'))
            await asyncio.wait_for(opening.wait(), 5)
            app.relay.abort_all("the drain's time is over")
            go_on.set()
            [(head, body)] = await asyncio.wait_for(answers, 5)
    assert taken == [True] and Upstream.requests == 0
    assert head.startswith(b"HTTP/1.1 503 ") and b"shutting down" in body


# -- streams relayed from the callbacks --------------------------------------------------------


def stream_request(mode: str | None = None) -> bytes:
    body = orjson.dumps({"model": "m1", "stream": True, **({"mode": mode} if mode else {})})
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )


def outcomes(app: Gateway) -> list[Outcome]:
    """The records of the requests served, as the relay made them."""
    records = list(app.status.activity)
    assert all(isinstance(record, Outcome) for record in records)
    return cast(list[Outcome], records)


async def read_stream(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """A chunked response's head, and its body decoded (to its last chunk)."""
    head = await reader.readuntil(b"\r\n\r\n")
    assert b"transfer-encoding: chunked\r\n" in head, head
    body = b""
    while size := int(await reader.readuntil(b"\r\n"), 16):
        body += await reader.readexactly(size)
        assert await reader.readexactly(2) == b"\r\n"
    assert await reader.readexactly(2) == b"\r\n"
    return head, body


@asynccontextmanager
async def switches_counted(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[list[int]]:
    """Each time a lean protocol gives its connection to the full protocol."""
    from proxy.lean import LeanProtocol

    switched: list[int] = []
    switch = LeanProtocol._switch

    def counted(self: Any, *args: Any) -> Any:
        switched.append(1)
        return switch(self, *args)

    monkeypatch.setattr(LeanProtocol, "_switch", counted)
    yield switched


async def test_a_stream_is_relayed_from_callbacks_on_the_lean_protocol(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its events as the engine wrote them, chunked, with the SSE headers, recorded; and the
    connection, still the lean protocol's, serves the next request from callbacks."""
    async with switches_counted(monkeypatch) as switched, gateway() as (port, app, taken):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(stream_request("events"))
        head, body = await read_stream(reader)
        writer.write(stream_request("events-later"))
        _, later = await read_stream(reader)
        writer.close()
        [(_, plain)] = await posts(port, b'{"model":"m1"}')
        records = outcomes(app)
    assert taken == [True, True, True] and switched == []
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    for header in (b"content-type: text/event-stream", b"cache-control: no-cache", b"x-accel-buffering: no"):
        assert header + b"\r\n" in head
    assert b"x-request-id: " in head and b"server-timing: " in head
    assert body == later == b"".join(EVENTS) + DONE and plain == REPLY
    assert [(r.status, r.error, r.bytes_out) for r in records[:2]] == [(200, None, len(body))] * 2
    assert records[0].first_s > 0 and records[1].sends >= 2
    assert Upstream.connections == 1  # the stream's connection was pooled again, and reused


@pytest.mark.parametrize(
    ("mode", "code"),
    [("cut", "upstream_truncated"), ("break", "upstream_truncated"), ("silent", "upstream_timeout")],
)
async def test_a_stream_that_breaks_ends_with_an_error_event(
    mode: str, code: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without its [DONE], cut by a close, or silent past the read timeout: its events, then an
    error event in OpenAI's shape, as the task path ends such a stream."""
    async with (
        switches_counted(monkeypatch) as switched,
        gateway(settings=Settings(read_timeout_s=0.3)) as (
            port,
            app,
            taken,
        ),
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(stream_request(mode))
        _, body = await asyncio.wait_for(read_stream(reader), 5)
        writer.close()
        [record] = app.status.activity
    assert taken == [True] and switched == []
    events = body.split(b"\n\n")
    assert body.startswith(EVENTS[0]) and events[-1] == b""
    assert orjson.loads(events[-2].removeprefix(b"data: "))["error"]["code"] == code
    assert record.status == 200 and record.error == code


async def test_a_client_that_leaves_a_stream_closes_its_upstream_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with switches_counted(monkeypatch) as switched, gateway() as (port, app, taken):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(stream_request("endless"))
        await reader.readuntil(EVENTS[0])
        writer.close()
        await wait_until_async(lambda: Upstream.lost, "the upstream's connection closed")
        assert Upstream.lost == 1 and app.state.in_flight == 0
        [record] = outcomes(app)
        assert record.client_gone and record.status == 200
        [(_, plain)] = await posts(port, b'{"model":"m1"}')
    assert taken == [True, True] and plain == REPLY and switched == []


async def reads_nothing(port: int) -> asyncio.StreamWriter:
    """A client that asks for an endless stream of large events and reads none of it (a small
    receive buffer, so that the gateway's buffer fills at once)."""
    import socket

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    _, writer = await asyncio.open_connection(sock=sock)
    writer.write(stream_request("endless-large"))
    return writer


async def test_a_client_that_takes_nothing_is_cut_after_the_send_stall(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The upstream is not read while the client's buffer is full; a client that takes nothing for
    ``send_stall_s`` is cut, and its upstream closed (499 client_stalled), as ``StallWatch`` cuts."""
    async with (
        switches_counted(monkeypatch) as switched,
        gateway(settings=Settings(send_stall_s=0.3)) as (
            port,
            app,
            taken,
        ),
    ):
        writer = await reads_nothing(port)
        await wait_until_async(lambda: Upstream.lost, "the upstream's connection closed")
        assert Upstream.lost == 1 and app.state.in_flight == 0
        [record] = outcomes(app)
        writer.close()
    assert taken == [True] and switched == []
    assert (record.status, record.error, record.stalled) == (499, "client_stalled", True)


async def test_a_stall_cut_that_fails_in_the_gateway_still_records_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exception in the stall timer's callback (here the abort) still gives back what the
    stream held and records it, as the client stalled: it does not stay "running"."""
    from proxy.lean import LeanProtocol

    def failing(self: LeanProtocol) -> None:
        raise RuntimeError("a bug in the abort")

    monkeypatch.setattr(LeanProtocol, "abort", failing)
    async with gateway(settings=Settings(send_stall_s=0.3)) as (port, app, taken):
        writer = await reads_nothing(port)
        try:
            await wait_until_async(lambda: app.state.in_flight == 0, "the stream ended", timeout_s=5)
            await wait_until_async(lambda: Upstream.lost, "the upstream's connection closed", timeout_s=5)
        finally:
            writer.close()
        [record] = outcomes(app)
    assert taken == [True]
    assert (record.status, record.error, record.stalled) == (499, "client_stalled", True)
    assert app.relay.body_budget.held_bytes == 0


async def test_a_stream_whose_head_is_slow_is_handed_over_for_the_heartbeats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """By the first heartbeat's time, the task path has the exchange (on the full protocol): its
    heartbeats, then the upstream's events."""
    async with (
        switches_counted(monkeypatch) as switched,
        gateway(settings=Settings(heartbeat_s=0.1)) as (
            port,
            _,
            taken,
        ),
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(stream_request("slow-head"))
        _, body = await asyncio.wait_for(read_stream(reader), 5)
        writer.close()
    assert taken == [True] and switched == [1]
    assert body.startswith(b": keepalive\n\n") and body.endswith(b"".join(EVENTS) + DONE)


async def test_a_shutdown_during_a_request_the_fast_path_then_hands_over_closes_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server tells each connection of its shutdown once: one told while the fast path served
    its request tells the full protocol it hands that request to, whose response then says
    ``connection: close`` and whose connection closes after it (as one on the full protocol from
    the start)."""
    from proxy.lean import LeanProtocol

    made: list[LeanProtocol] = []
    connection_made = LeanProtocol.connection_made

    def kept(self: LeanProtocol, transport: Any) -> None:
        made.append(self)
        connection_made(self, transport)

    monkeypatch.setattr(LeanProtocol, "connection_made", kept)
    async with (
        switches_counted(monkeypatch) as switched,
        gateway(settings=Settings(heartbeat_s=0.15)) as (port, _, taken),
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(stream_request("slow-head"))
        await asyncio.sleep(0.05)
        [protocol] = made
        protocol.shutdown()  # what uvicorn's ``Server.shutdown`` does to each connection
        head, body = await asyncio.wait_for(read_stream(reader), 5)
        closed = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    assert taken == [True] and switched == [1]
    assert b"connection: close\r\n" in head.lower(), head
    assert body.endswith(DONE) and closed == b""


async def test_a_stream_whole_in_one_read_leaves_no_deadline_on_its_pooled_connection() -> None:
    """Its end came in the read that brought its head: the connection goes back to the pool with no
    read deadline armed, which would cut the next response on it once due (a 504 for a body that
    was on its way)."""
    async with gateway(settings=Settings(read_timeout_s=0.6)) as (port, _, taken):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(stream_request("events"))
        await read_stream(reader)
        # Such a deadline would be due at 0.6 s, while the next body is on its way (0.4 to 0.8 s),
        # well before that body's own (1.0 s).
        await asyncio.sleep(0.4)
        body = b'{"model":"m1","mode":"later-slow"}'
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        answer = await asyncio.wait_for(reader.readexactly(len(REPLY)), 5)
        writer.close()
    assert taken == [True, True] and Upstream.connections == 1
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and answer == REPLY


@replaces_calls_into("proxy/relay/sse.py")
async def test_a_stream_that_fails_in_the_gateway_after_its_head_is_closed_and_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No hand-over once the head is out: both connections are closed, what the request held is
    given back, and it is recorded (it does not stay "running" on the status page)."""
    from proxy.relay.sse import EventStream

    cut = EventStream.cut
    calls: list[int] = []

    def failing(self: EventStream, chunk: bytes) -> bytes:
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("a bug in the relay")
        return cut(self, chunk)

    monkeypatch.setattr(EventStream, "cut", failing)
    async with gateway() as (port, app, taken):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(stream_request("events-later"))
        await asyncio.wait_for(reader.readuntil(EVENTS[0]), 5)
        # The first event's chunk ends, then the connection closes: no last chunk, a cut response.
        assert await asyncio.wait_for(reader.read(), 5) == b"\r\n"
        await wait_until_async(lambda: Upstream.lost, "the upstream's connection closed")
        [record] = outcomes(app)
        writer.close()
    assert taken == [True] and Upstream.lost == 1 and app.state.in_flight == 0
    assert record.duration_s is not None and app.relay.body_budget.held_bytes == 0


async def test_a_pooled_connections_close_at_once_is_timed_when_seen_not_when_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request sent on a pooled connection that the upstream had closed (an engine killed, a
    keep-alive ended) is sent again on a new one, when the close came at once: timed when the
    connection saw it. A fast path's hand-over reaches the task path's check later, by as much as
    a loop busy starting a new engine takes; the close is no less immediate for that."""
    conn = Connection()
    conn.requests_sent = 2
    closed = EmptyReply("upstream closed the connection without sending a response")
    sent_at = closed.at - 0.001
    monkeypatch.setattr(exchange, "perf_counter", lambda: closed.at + 1.0)  # read a second later
    assert exchange._closed_when_reused(conn, closed, sent_at)
    late = EmptyReply("closed after working on it")
    assert not exchange._closed_when_reused(conn, late, late.at - 1.0)
    fresh = Connection()
    fresh.requests_sent = 1
    assert not exchange._closed_when_reused(fresh, closed, sent_at)
