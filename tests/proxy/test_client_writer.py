"""The server's own writer (``scope["extensions"]["blazar.writer"]``), seen from a client's socket.

A real uvicorn server with the gateway's protocol, an ASGI app that writes
through the extension, and a client that reads the raw bytes: the framing,
the held head, keep-alive after a response written this way, and what the
writer refuses.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from proxy.protocol import ClientWriter
from proxy.relay.out import AsgiWriter, writer_for
from tests.helpers import in_process_server

pytestmark = pytest.mark.anyio

Scenario = Callable[[ClientWriter], Awaitable[None]]


@asynccontextmanager
async def serving(scenarios: dict[str, Scenario], seen: list[object]) -> AsyncIterator[int]:
    """A uvicorn server on a free port whose app runs ``scenarios[path]`` with the writer."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()
        if scope["path"].startswith("/wrapped"):
            inner = send

            async def send(message: Any) -> None:
                await inner(message)

        writer = writer_for(scope, send)
        seen.append(writer)
        try:
            await scenarios[scope["path"]](writer)  # type: ignore[arg-type]
        except RuntimeError as exc:
            seen.append(exc)
            raise

    async with in_process_server(app) as port:
        yield port


async def exchange(port: int, *paths: str) -> bytes:
    """Send a GET for each path on one connection; everything the server sends until it is quiet."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for path in paths:
        writer.write(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    await writer.drain()
    data = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), 0.5):
            data += chunk
    except TimeoutError:
        pass
    writer.close()
    return data


def body_of(response: bytes) -> tuple[bytes, bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    return head, body


async def test_a_chunked_stream_is_framed_once_with_the_head_and_ends_with_the_last_chunk() -> None:
    async def stream(out: ClientWriter) -> None:
        out.start(200, [(b"content-type", b"text/event-stream")])
        assert out.write(b"data: 1\n\n", True) is None
        assert out.write(b"data: 22\n\n", False) is None

    seen: list[object] = []
    async with serving({"/s": stream}, seen) as port:
        head, body = body_of(await exchange(port, "/s"))
    assert isinstance(seen[0], ClientWriter)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"\r\ntransfer-encoding: chunked" in head and b"content-type: text/event-stream" in head
    assert body == b"9\r\ndata: 1\n\n\r\na\r\ndata: 22\n\n\r\n0\r\n\r\n"


async def test_a_body_with_a_length_goes_out_as_is_and_the_connection_serves_the_next_request() -> None:
    async def sized(out: ClientWriter) -> None:
        out.start(200, [(b"content-type", b"application/json"), (b"content-length", b"5")])
        out.write(b"hel", True)
        out.write(b"lo", False)

    async with serving({"/j": sized}, []) as port:
        data = await exchange(port, "/j", "/j")
    first, _, rest = data.partition(b"hello")
    assert b"content-length: 5" in first and b"transfer-encoding" not in first
    assert rest.startswith(b"HTTP/1.1 200 OK") and rest.endswith(b"\r\n\r\nhello")


async def test_a_flushed_head_goes_out_alone_and_an_empty_last_write_ends_the_body() -> None:
    async def flushed(out: ClientWriter) -> None:
        out.start(200, [(b"content-type", b"text/event-stream")])
        assert out.flush() is None
        assert out.flush() is None  # nothing held any more
        out.write(b"x", True)
        out.write(b"", False)

    async with serving({"/f": flushed}, []) as port:
        head, body = body_of(await exchange(port, "/f"))
    assert head.startswith(b"HTTP/1.1 200 OK")
    assert body == b"1\r\nx\r\n0\r\n\r\n"


async def test_the_writer_refuses_a_second_head_a_bad_header_and_a_body_longer_than_its_length() -> None:
    async def twice(out: ClientWriter) -> None:
        out.start(200, [])
        out.start(200, [])

    async def bad_header(out: ClientWriter) -> None:
        out.start(200, [(b"x-bad", b"a\nb")])

    async def too_long(out: ClientWriter) -> None:
        out.start(200, [(b"content-length", b"2")])
        out.write(b"abc", False)

    seen: list[object] = []
    async with serving({"/twice": twice, "/bad": bad_header, "/long": too_long}, seen) as port:
        for path in ("/twice", "/bad", "/long"):
            await exchange(port, path)
    errors = [str(e) for e in seen if isinstance(e, RuntimeError)]
    assert errors == [
        "the response has already started",
        "Invalid HTTP header name or value.",
        "Response content longer than Content-Length",
    ]


class _Transport:
    """Enough of a transport for a cycle that is only asked to start a response."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


def _cycle() -> RequestResponseCycle:
    transport = _Transport()
    return RequestResponseCycle(
        scope={"method": "GET", "path": "/", "http_version": "1.1"},  # type: ignore[typeddict-item]
        transport=transport,  # type: ignore[arg-type]
        flow=FlowControl(transport),  # type: ignore[arg-type]
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test"),
        access_log=False,
        default_headers=[],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=True,
        on_response=lambda: None,
    )


async def test_the_writer_refuses_exactly_the_header_bytes_uvicorns_own_send_refuses() -> None:
    """Each of the 256 bytes in a header's name and in its value: refused by the writer iff by uvicorn."""
    for byte in range(256):
        for header in ((b"x-" + bytes((byte,)) + b"y", b"v"), (b"x-h", b"a" + bytes((byte,)) + b"b")):
            try:
                await _cycle().send({"type": "http.response.start", "status": 200, "headers": [header]})
                uvicorn_refuses = False
            except RuntimeError:
                uvicorn_refuses = True
            try:
                ClientWriter(_cycle()).start(200, [(b"x-ok", b"fine"), header])
                writer_refuses = False
            except RuntimeError:
                writer_refuses = True
            assert writer_refuses == uvicorn_refuses, (header, uvicorn_refuses)


async def test_a_wrapped_send_gets_the_asgi_writer_that_makes_the_same_bytes() -> None:
    sent: list[MutableMapping[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope: dict[str, Any] = {"extensions": {}}
    out = writer_for(scope, send)
    assert isinstance(out, AsgiWriter)
    out.start(200, [(b"content-type", b"text/event-stream")])
    waits = [out.write(b"a", True), out.write(b"b", False)]
    for wait in waits:
        assert wait is not None
        await wait
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert [m.get("body") for m in sent[1:]] == [b"a", b"b"]


async def test_a_wrapped_send_gets_asgi_messages_and_the_same_bytes() -> None:
    async def stream(out: ClientWriter) -> None:
        out.start(200, [(b"content-type", b"text/event-stream")])
        for wait in (out.write(b"data: 1\n\n", True), out.write(b"data: 22\n\n", False)):
            if wait is not None:
                await wait

    seen: list[object] = []
    async with serving({"/wrapped": stream}, seen) as port:
        _, body = body_of(await exchange(port, "/wrapped"))
    assert isinstance(seen[0], AsgiWriter)
    assert body == b"9\r\ndata: 1\n\n\r\na\r\ndata: 22\n\n\r\n0\r\n\r\n"


async def test_a_response_written_this_way_leaves_no_reference_cycle() -> None:
    """Each request's cycle, scope and writer are freed when it ends, not left for the collector."""

    async def stream(out: ClientWriter) -> None:
        out.start(200, [(b"content-type", b"text/event-stream")])
        out.write(b"data: 1\n\n", False)

    async with serving({"/s": stream}, []) as port:
        await exchange(port, "/s")  # the server's own start-up garbage, out of the way
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            await exchange(port, *["/s"] * 20)
            gc.collect()
            left = [type(o).__name__ for o in gc.garbage]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert "RequestResponseCycle" not in left and "ClientWriter" not in left
