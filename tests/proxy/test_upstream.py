"""The relay's upstream transport against scripted servers on real sockets.

Each server here writes exact bytes, so that every framing case the pool must
survive (keep-alive, HTTP/1.0 close-delimited, chunked, a close at the wrong
moment) is produced on purpose rather than hoped for.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE

from proxy.pool import Pool
from proxy.routing import UpstreamAddress
from proxy.upstream import Connection, ConnState
from proxy.upstream_errors import BadResponse, BodyBroken, ConnectFailed, EmptyReply, HeadTimeout

pytestmark = pytest.mark.anyio

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n"


class Scripted:
    """A loopback server whose handler writes what the test says."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    @property
    def address(self) -> UpstreamAddress:
        assert self.server is not None
        return UpstreamAddress("127.0.0.1", self.server.sockets[0].getsockname()[1])


@asynccontextmanager
async def scripted(handler: Handler) -> AsyncIterator[Scripted]:
    server = Scripted(handler)
    server.server = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    try:
        yield server
    finally:
        server.server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


async def roundtrip(pool: Pool, timeout_s: float = 5.0) -> tuple[Connection, bytes]:
    conn = await pool.acquire()
    conn.send(REQUEST, b"{}")
    await conn.read_head(timeout_s)
    chunks = []
    while chunk := await conn.read(5):
        chunks.append(chunk)
    return conn, b"".join(chunks)


async def test_a_connection_nothing_was_sent_on_is_pooled_for_the_next_request() -> None:
    """Opened for a request that went nowhere, or taken idle and not used: the next request gets it
    (an idle one with its idle time as it was), and no second connection is opened."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        opened = await pool.connect()
        assert opened.state is ConnState.NEW
        pool.unused(opened)
        taken = pool.take_idle()
        assert taken is opened and taken.state is ConnState.IDLE
        idle_since = taken.idle_since
        pool.unused(taken)
        assert pool.take_idle() is opened and opened.idle_since == idle_since
        pool.unused(opened)
        conn, body = await roundtrip(pool)
        assert conn is opened and body == b"ok" and server.connections == 1
        pool.release(conn)
        pool.close()
        # A pool that is closed takes nothing back.
        late = Pool(server.address, connect_timeout_s=1)
        fresh = await late.connect()
        late.close()
        late.unused(fresh)
        assert fresh.state is ConnState.CLOSED


async def test_a_connection_reused_starts_its_next_response_from_nothing() -> None:
    """What a response set (its status, its headers, its framing, its end) is gone for the next."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 201 Created\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nhi")
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n")
        await writer.drain()

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        first, body = await roundtrip(pool)
        assert (first.status, first.content_type, first.content_length, body) == (
            201,
            b"text/plain",
            b"2",
            b"hi",
        )
        pool.release(first)
        second, body = await roundtrip(pool)
        assert second is first and body == b"ok"
        assert (second.status, second.content_type, second.content_length) == (200, None, None)
        assert second.headers == [(b"transfer-encoding", b"chunked")]
        pool.release(second)
        pool.close()


async def test_keep_alive_connection_is_reused() -> None:
    """Two requests to an HTTP/1.1 keep-alive upstream share one connection."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")
            await writer.drain()

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        first, body = await roundtrip(pool)
        assert body == b"hello"
        pool.release(first)
        assert first.state is ConnState.IDLE
        second, body = await roundtrip(pool)
        assert second is first and body == b"hello"
        assert server.connections == 1
        pool.release(second)
        pool.close()
        assert second.state is ConnState.CLOSED


async def test_header_names_arrive_lower_cased() -> None:
    """The transport lower-cases header names once, so the header filters need not."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Mixed-Case: A\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.2)

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        conn, _ = await roundtrip(pool)
        assert conn.headers == [(b"content-length", b"2"), (b"x-mixed-case", b"A")]


async def test_a_head_that_comes_a_byte_at_a_time_after_an_interim_one_is_read_whole() -> None:
    """A head read across many reads, after a 1xx head: its fields as sent, names lower-cased."""
    head = (
        b"HTTP/1.1 102 Processing\r\nX-Interim: 1\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Blank:   padded value \t\r\nX-Colon: a:b\r\n"
        b"X-Empty:\r\nx-twice: 1\r\nX-Twice: 2\r\n\r\nok"
    )

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        for i in range(len(head)):
            writer.write(head[i : i + 1])
            await writer.drain()
            await asyncio.sleep(0)
        await asyncio.sleep(0.2)

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        conn, body = await roundtrip(pool)
        assert conn.status == 200 and body == b"ok"
        assert conn.headers == [
            (b"content-length", b"2"),
            (b"x-blank", b"padded value \t"),
            (b"x-colon", b"a:b"),
            (b"x-empty", b""),
            (b"x-twice", b"1"),
            (b"x-twice", b"2"),
        ]


async def test_http10_close_delimited_body_ends_at_close() -> None:
    """An HTTP/1.0 body without Content-Length is complete when the upstream closes."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: a\n\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"data: [DONE]\n\n")

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        conn, body = await roundtrip(pool)
        assert body == b"data: a\n\ndata: [DONE]\n\n"
        assert conn.close_delimited and conn.complete and not conn.reusable
        pool.release(conn)
        assert conn.state is ConnState.CLOSED


async def test_chunked_body_is_decoded() -> None:
    """A chunked body arrives as its payload bytes, and the connection stays reusable."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(b"2\r\nde\r\n0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.5)

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        conn, body = await roundtrip(pool)
        assert body == b"abcde"
        assert not conn.close_delimited and conn.reusable


async def test_close_before_content_length_is_broken_body() -> None:
    """A close before the declared Content-Length is reached raises BodyBroken."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf")

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        with pytest.raises(BodyBroken):
            await roundtrip(pool)


async def test_close_mid_chunked_body_is_broken_body() -> None:
    """A close before the last chunk raises BodyBroken, never a clean end."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        with pytest.raises(BodyBroken):
            await roundtrip(pool)


async def test_close_without_response_is_empty_reply() -> None:
    """An upstream that closes with 0 bytes (mlx_lm.server on bad fields) raises EmptyReply."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        with pytest.raises(EmptyReply, match="without sending a response"):
            await roundtrip(pool)


async def test_garbage_is_bad_response() -> None:
    """Bytes that are not HTTP raise BadResponse."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"\x00\x01garbage that is not http\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.5)

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        with pytest.raises(BadResponse):
            await roundtrip(pool)


async def test_close_in_the_middle_of_the_head_is_bad_response() -> None:
    """A close after part of the status line raises BadResponse, not EmptyReply."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-")

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        with pytest.raises(BadResponse):
            await roundtrip(pool)


async def test_interim_100_continue_is_skipped() -> None:
    """A 1xx interim response is skipped and the final response is read."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.2)

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        conn, body = await roundtrip(pool)
        assert conn.status == 201 and body == b"ok"


async def test_head_timeout() -> None:
    """No response head within the budget raises HeadTimeout and closes the connection."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        conn = await pool.acquire()
        conn.send(REQUEST, b"{}")
        with pytest.raises(HeadTimeout, match=r"0\.2 s"):
            await conn.read_head(0.2)
        assert conn.state is ConnState.CLOSED


async def test_connection_refused_is_connect_failed() -> None:
    """A port with no listener raises ConnectFailed (a 503 for the client)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async with scripted(handler) as server:
        address = server.address
    pool = Pool(address, connect_timeout_s=1)
    with pytest.raises(ConnectFailed, match="cannot connect") as info:
        await pool.acquire()
    assert info.value.status == 503
    assert pool.last_connect_error is not None


async def test_idle_connection_closed_by_upstream_is_not_reused() -> None:
    """A pooled connection that the upstream closed while idle is dropped, and a new one is opened."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        # ...and then the upstream's keep-alive timer closes it.

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        first, _ = await roundtrip(pool)
        pool.release(first)
        await asyncio.sleep(0.1)
        assert first.state is ConnState.CLOSED
        second, body = await roundtrip(pool)
        assert second is not first and body == b"ok"
        assert server.connections == 2


async def test_idle_connection_past_idle_timeout_is_retired() -> None:
    """A pooled connection idle longer than idle_timeout_s is closed instead of reused."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1, idle_timeout_s=0.05)
        first, _ = await roundtrip(pool)
        pool.release(first)
        await asyncio.sleep(0.1)
        second, _ = await roundtrip(pool)
        assert second is not first and first.state is ConnState.CLOSED


async def test_upstream_keep_alive_timeout_is_honoured() -> None:
    """`Keep-Alive: timeout=2` retires a connection after 1 s idle, before the upstream closes it."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nkeep-alive: timeout=2, max=100\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        first, _ = await roundtrip(pool)
        assert first.idle_limit_s == 1.0
        pool.release(first)
        await asyncio.sleep(0.3)
        second, _ = await roundtrip(pool)
        assert second is first  # inside the upstream's limit: reused
        pool.release(second)
        await asyncio.sleep(1.2)
        third, _ = await roundtrip(pool)
        assert third is not first and server.connections == 2
        pool.release(third)
        pool.close()


async def test_large_body_passes_through_backpressure() -> None:
    """A body far above the read-pause mark arrives whole when read slowly."""
    payload = bytes(range(256)) * 8192  # 2 MiB

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(payload))
        writer.write(payload)
        await writer.drain()
        await asyncio.sleep(1)

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        conn = await pool.acquire()
        conn.send(REQUEST, b"{}")
        await conn.read_head(5)
        received = bytearray()
        while chunk := await conn.read(5):
            received += chunk
            await asyncio.sleep(0.001)
        assert bytes(received) == payload


async def test_http10_upstream_gets_a_spare_connection_for_the_next_request() -> None:
    """After a close-delimited response the pool opens the next connection at once, and it gets used."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{}")

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        conn, body = await roundtrip(pool)
        assert body == b"{}"
        pool.release(conn)
        for _ in range(100):
            if server.connections == 2:
                break
            await asyncio.sleep(0.01)
        assert server.connections == 2  # the spare, opened before any second request
        spare = await pool.acquire()
        assert spare is not conn and spare.requests_sent == 0
        spare.send(REQUEST, b"{}")
        await spare.read_head(5)
        assert await spare.read(5) == b"{}"
        pool.release(spare)
        pool.close()


async def test_keep_alive_upstream_gets_no_spare() -> None:
    """A keep-alive upstream needs no spare: its released connection is the next one."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(1)

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        conn, _ = await roundtrip(pool)
        pool.release(conn)
        await asyncio.sleep(0.05)
        assert server.connections == 1
        pool.close()


@pytest.mark.parametrize(
    "codings",
    [b"gzip, chunked", b"gzip", b"identity", b"chunked\r\ntransfer-encoding: gzip"],
    ids=["gzip-chunked", "gzip", "identity", "two-fields"],
)
async def test_a_transfer_coding_other_than_chunked_is_bad_response(codings: bytes) -> None:
    """Only ``chunked`` is a transfer coding the connection reads; any other is BadResponse (nginx: 502)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: %b\r\n\r\n3\r\nabc\r\n0\r\n\r\n" % codings)
        await writer.drain()
        await asyncio.sleep(0.5)

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        with pytest.raises(BadResponse, match="does not decode"):
            await roundtrip(pool)


async def test_a_content_coding_is_noted_and_the_body_left_as_sent() -> None:
    """``Content-Encoding: gzip`` is noted for the relay and the coded bytes come through untouched."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: 4\r\n\r\n")
        writer.write(b"\x1f\x8b\x08\x00")
        await writer.drain()
        await asyncio.sleep(0.5)

    async with scripted(handler) as server:
        pool = Pool(server.address, connect_timeout_s=1)
        conn, body = await roundtrip(pool)
        assert conn.content_encoding == b"gzip" and body == b"\x1f\x8b\x08\x00"


class _KeptTransport:
    """A transport that keeps what is written (the connection's own side only)."""

    def __init__(self) -> None:
        self.written = b""
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True


async def test_requests_after_the_pass_s_first_write_are_written_at_its_end_unless_closed_before() -> None:
    """The first ``send`` of a pass of the loop writes at once; those after it leave the request
    for the end of the pass (``proxy/outbox.py``), and a connection closed before then writes
    nothing (its request reached no server)."""
    first, sent, dropped = Connection(), Connection(), Connection()
    for conn in (first, sent, dropped):
        conn.connection_made(_KeptTransport())  # type: ignore[arg-type]
        conn.send(REQUEST, b"{}")
    dropped.close()
    assert first._transport.written == REQUEST + b"{}"  # type: ignore[union-attr]
    assert sent._transport.written == b""  # type: ignore[union-attr]
    await asyncio.sleep(0)
    assert sent._transport.written == REQUEST + b"{}"  # type: ignore[union-attr]
    assert dropped._transport.written == b""  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("head", "noted"),
    [
        (
            b"Content-Type: a/b\r\nContent-Length: 2\r\nX-One: 1",
            (b"a/b", b"2", None, False, None),
        ),
        (b"X-One: 1", (None, None, None, True, None)),
        (
            b"content-type: a/b\r\nset-cookie: a=1\r\nContent-Type: c/d\r\nSet-Cookie: b=2\r\n"
            b"content-length: 2",
            (b"a/b", b"2", None, False, None),
        ),
        (
            b"Content-Encoding: gzip\r\nContent-Encoding: identity\r\nTransfer-Encoding: chunked",
            (None, None, b"gzip", False, None),
        ),
        (b"content-encoding:  Identity \r\ncontent-length: 2", (None, b"2", None, False, None)),
        (
            b"Content-Type: text/event-stream\r\nTransfer-Encoding: chunked",
            (b"text/event-stream", None, None, False, None),
        ),
        (b"transfer-encoding: Chunked \r\nX-One: 1", (None, None, None, False, None)),
        (
            b"Keep-Alive: timeout=5, max=10\r\nKeep-Alive: timeout=9\r\ncontent-length: 2",
            (None, b"2", None, False, 8.0),
        ),
    ],
    ids=[
        "common",
        "unframed",
        "names-twice",
        "codings",
        "identity",
        "stream",
        "chunked-as-sent",
        "keep-alive-twice",
    ],
)
async def test_the_fields_a_head_notes(head: bytes, noted: tuple[object, ...]) -> None:
    """The first Content-Type and Content-Length as sent, the last content coding other than
    identity, whether the close ends the body, and the last Keep-Alive's timeout less a second;
    every header kept, in order, its name lower-cased."""
    conn = Connection()
    conn.connection_made(_KeptTransport())  # type: ignore[arg-type]
    conn.send(REQUEST, b"{}")
    chunked = b"chunked" in head.lower()
    body = b"2\r\nok\r\n0\r\n\r\n" if chunked else b"ok"
    conn.data_received(b"HTTP/1.1 200 OK\r\n" + head + b"\r\n\r\n" + body)
    assert conn.error is None and conn.status == 200
    lines = (line.partition(b":") for line in head.split(b"\r\n"))
    assert conn.headers == [(name.lower(), value.lstrip()) for name, _, value in lines]
    fields = (conn.content_type, conn.content_length, conn.content_encoding)
    assert (*fields, conn.close_delimited, conn.idle_limit_s) == noted
    assert conn.take_body() == b"ok"


async def test_a_connection_sent_on_again_without_being_pooled_starts_from_nothing() -> None:
    """A request sent on a connection that was not pooled idle (its last response may have ended
    any way: here with a stray message after it) reads its response from nothing."""
    conn = Connection()
    conn.connection_made(_KeptTransport())  # type: ignore[arg-type]
    conn.send(REQUEST, b"{}")
    stray = b"HTTP/1.1 204 No Content\r\nx-stray: 1\r\n\r\n"
    conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok" + stray)
    assert conn.take_body() == b"ok" and not conn.reusable
    # The stray message's head is neither this response's nor kept.
    assert conn.headers == [(b"content-length", b"2")] and not conn._raw_headers
    conn.send(REQUEST, b"{}")
    assert conn.status == 0 and conn.headers == [] and not conn.whole
    conn.data_received(b"HTTP/1.1 201 Created\r\ncontent-length: 3\r\n\r\nyes")
    assert conn.status == 201 and conn.whole and conn.take_body() == b"yes" and conn.reusable


@pytest.mark.parametrize("where", ["name", "value"])
async def test_a_head_with_a_byte_the_client_head_check_refuses_is_refused_as_read(where: str) -> None:
    """Every byte uvicorn's head check (``check_header_bytes``) refuses in a field's name or value
    is refused by the connection's parser as the upstream's head is read (502, malformed), so the
    lean protocol's ``respond`` need not check the fields it relays."""
    pattern = HEADER_RE if where == "name" else HEADER_VALUE_RE
    read: set[int] = set()
    for byte in range(256):
        odd = bytes((byte,))
        name, value = (b"x-a" + odd + b"b", b"v") if where == "name" else (b"x-a", b"v" + odd + b"w")
        if where == "name" and odd == b":":
            name, value = b"x-a", b"b: v"  # the name ends at the colon: "b: v" is its value, as sent
        conn = Connection()
        conn.connection_made(_KeptTransport())  # type: ignore[arg-type]
        conn.send(REQUEST, b"{}")
        conn.data_received(b"HTTP/1.1 200 OK\r\n%b: %b\r\ncontent-length: 2\r\n\r\nok" % (name, value))
        if pattern.search(name if where == "name" else value):
            assert isinstance(conn.error, BadResponse), (where, byte)
        elif conn.error is None:  # llhttp refuses more in a name than the check (any non-token byte)
            assert conn.headers[0] == (name.lower(), value), (where, byte)
            read.add(byte)
    assert read.issuperset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
