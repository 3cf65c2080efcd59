"""The gateway's protocol against RFC 9112, in process: versions, Host, transfer codings, HTTP/1.0 framing.

A real uvicorn server with the gateway's protocol (``serving`` from the
writer's tests) and requests written by hand.
"""

from __future__ import annotations

import asyncio

import pytest

from proxy.protocol import ClientWriter
from proxy.relay.out import AsgiWriter
from proxy.upstream_errors import ClientGone
from tests.proxy.test_client_writer import Scenario, body_of, serving

pytestmark = pytest.mark.anyio


async def until_close(port: int, raw: bytes) -> bytes:
    """Send ``raw``; everything the server sends until it closes (or is quiet for 2 s)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    data = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), 2):
            data += chunk
    except TimeoutError:
        data += b"<not closed>"
    writer.close()
    return data


async def stream(out: ClientWriter) -> None:
    out.start(200, [(b"content-type", b"text/event-stream")])
    for piece in (b"data: 1\n\n", b"data: 22\n\n"):
        if (wait := out.write(piece, True)) is not None:
            await wait
    if (wait := out.write(b"data: [DONE]\n\n", False)) is not None:
        await wait


async def sized(out: ClientWriter) -> None:
    out.start(200, [(b"content-length", b"5")])
    if (wait := out.write(b"hello", False)) is not None:
        await wait


SCENARIOS: dict[str, Scenario] = {"/s": stream, "/j": sized}


async def test_an_http10_response_of_unknown_length_is_close_delimited_through_send() -> None:
    """HTTP/1.0: no writer of the server's own, and the ASGI path sends the body unchunked, then closes."""
    seen: list[object] = []
    async with serving(SCENARIOS, seen) as port:
        head, body = body_of(await until_close(port, b"GET /s HTTP/1.0\r\n\r\n"))
    assert isinstance(seen[0], AsgiWriter)
    assert b"transfer-encoding" not in head and b"connection: close" in head, head
    assert body == b"data: 1\n\ndata: 22\n\ndata: [DONE]\n\n"


async def test_an_http10_response_with_a_length_keeps_it_and_http11_stays_chunked() -> None:
    """A sized body to HTTP/1.0 goes out as uvicorn sends it; an HTTP/1.1 stream gets the writer, chunked."""
    seen: list[object] = []
    async with serving(SCENARIOS, seen) as port:
        head, body = body_of(await until_close(port, b"GET /j HTTP/1.0\r\n\r\n"))
        assert b"content-length: 5" in head and body == b"hello"
        raw = b"GET /s HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        head, body = body_of(await until_close(port, raw))
    assert isinstance(seen[1], ClientWriter)
    assert b"transfer-encoding: chunked" in head and body.endswith(b"0\r\n\r\n")


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"GET /s HTTP/2.0\r\nhost: x\r\n\r\n", b"505", b"http_version_not_supported"),
        (b"GET /s HTTP/0.9\r\nhost: x\r\n\r\n", b"505", b"http_version_not_supported"),
        (b"GET /s HTTP/1.7\r\nhost: x\r\n\r\n", b"505", b"http_version_not_supported"),
        (b"GET /s HTTP/1.1\r\n\r\n", b"400", b"invalid_host_header"),
        (b"GET /s HTTP/1.1\r\nhost: x\r\nHost: x\r\n\r\n", b"400", b"invalid_host_header"),
        (b"GET /s HTTP/1.0\r\nhost: x\r\nhost: y\r\n\r\n", b"400", b"invalid_host_header"),
        (
            b"POST /s HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip, chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
            b"501",
            b"unsupported_transfer_encoding",
        ),
        (
            b"POST /s HTTP/1.1\r\nhost: x\r\ntransfer-encoding: identity\r\n\r\n",
            b"501",
            b"unsupported_transfer_encoding",
        ),
        (
            b"POST /s HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
            b"400",
            b"invalid_transfer_encoding",
        ),
    ],
    ids=[
        "http2",
        "http09",
        "http17",
        "no-host",
        "two-hosts",
        "two-hosts-http10",
        "gzip-chunked",
        "identity",
        "chunked-http10",
    ],
)
async def test_requests_the_protocol_refuses(raw: bytes, status: bytes, code: bytes) -> None:
    """Each is refused with its status in OpenAI's envelope, the connection closed, the app never called."""
    seen: list[object] = []
    async with serving(SCENARIOS, seen) as port:
        response = await until_close(port, raw)
    assert response.startswith(b"HTTP/1.1 " + status), response[:200]
    assert b'"code":"' + code + b'"' in response and not response.endswith(b"<not closed>")
    assert seen == []


async def test_an_http10_request_without_host_and_a_chunked_one_in_capitals_are_served() -> None:
    """HTTP/1.0 may omit Host; ``Transfer-Encoding: CHUNKED`` is chunked."""
    seen: list[object] = []
    async with serving(SCENARIOS, seen) as port:
        _, body = body_of(await until_close(port, b"GET /j HTTP/1.0\r\n\r\n"))
        assert body == b"hello"
        raw = b"POST /j HTTP/1.1\r\nhost: x\r\nconnection: close\r\ntransfer-encoding: CHUNKED\r\n\r\n"
        _, body = body_of(await until_close(port, raw + b"1\r\nx\r\n0\r\n\r\n"))
        assert body == b"hello"


async def test_a_write_after_the_client_has_gone_raises_client_gone_and_says_whether_anything_went() -> None:
    """The writer raises ClientGone once the client's connection is closed (uvicorn's send would drop
    the bytes silently): nothing_sent while the head is still held, not once it went out."""

    async def late(out: ClientWriter) -> None:
        out.start(200, [(b"content-type", b"text/event-stream")])
        await asyncio.sleep(0.3)  # the client half-closes meanwhile: uvicorn closes the connection
        try:
            out.write(b"data: 1\n\n", True)
        except ClientGone as exc:
            seen.append(exc.nothing_sent)

    async def flushed(out: ClientWriter) -> None:
        out.start(200, [(b"content-type", b"text/event-stream")])
        out.flush()
        await asyncio.sleep(0.3)
        try:
            out.write(b"data: 1\n\n", True)
        except ClientGone as exc:
            seen.append(exc.nothing_sent)

    seen: list[object] = []
    async with serving({"/late": late, "/flushed": flushed}, seen) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /late HTTP/1.1\r\nhost: x\r\n\r\n")
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed at the half-close
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /flushed HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200"), head
        writer.write_eof()  # after the head went out
        await asyncio.wait_for(reader.read(), 5)
        writer.close()
        await asyncio.sleep(0.5)
    assert [s for s in seen if isinstance(s, bool)] == [True, False], seen
