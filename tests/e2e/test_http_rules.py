"""HTTP/1.x as RFC 9112 and nginx have it, on raw sockets: versions, Host, codings, HTTP/1.0 framing."""

from __future__ import annotations

import socket

import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartGateway

CHAT = b"/v1/chat/completions"
STREAM = orjson.dumps(
    {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 3}
)
PLAIN = orjson.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})


def until_close(gateway: Running, raw: bytes, timeout_s: float = 10) -> bytes:
    """Send ``raw`` on a new connection; everything the gateway sends until it closes."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=timeout_s) as sock:
        sock.sendall(raw)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def post(version: bytes, fields: bytes, body: bytes = STREAM, extra: bytes = b"") -> bytes:
    """A POST to chat completions with these header lines (each ending in CRLF) and a Content-Length."""
    return (
        b"POST %s HTTP/%s\r\n%sContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n"
        % (CHAT, version, fields, extra, len(body))
        + body
    )


def chunked_post(fields: bytes, body: bytes = STREAM) -> bytes:
    """An HTTP/1.1 POST whose body goes in one chunk, with these header lines."""
    head = b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n%s\r\n" % (CHAT, fields)
    return head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


def error_code(response: bytes) -> str:
    code: str = orjson.loads(response.partition(b"\r\n\r\n")[2])["error"]["code"]
    return code


# -- an HTTP/1.0 client gets no chunked framing ------------------------------------------------


@pytest.mark.fault("clients", "HTTP versions, Host and framing a client may not use")
def test_an_http10_client_gets_a_close_delimited_stream_not_a_chunked_one(
    gateway: Running, fake: FakeEngine
) -> None:
    """An HTTP/1.0 stream request: no Transfer-Encoding, the events as sent, [DONE], then the close."""
    response = until_close(gateway, post(b"1.0", b""))
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower(), head
    assert body.startswith(b"data: {"), body[:100]
    assert body.endswith(b"data: [DONE]\n\n"), body[-100:]
    assert b"\r\n0\r\n" not in body


@pytest.mark.fault("clients", "HTTP versions, Host and framing a client may not use")
def test_an_http10_client_gets_a_close_delimited_stream_after_heartbeats(
    start_gateway: StartGateway, fake: FakeEngine
) -> None:
    """The gateway's own heartbeat head (sent through ASGI send) is close-delimited too for HTTP/1.0."""
    beating = start_gateway({"fake": fake.url}, "--sse-heartbeat", "0.2")
    response = until_close(beating, post(b"1.0", b"Host: localhost\r\n", extra=b"x-fake: prefill=0.7\r\n"))
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower(), head
    assert body.startswith(b": keepalive\n\n"), body[:100]
    assert body.endswith(b"data: [DONE]\n\n") and b"\r\n0\r\n" not in body, body[-100:]


@pytest.mark.fault("clients", "HTTP versions, Host and framing a client may not use")
def test_an_http10_client_keeps_a_sized_body_and_an_http11_client_keeps_chunking(
    gateway: Running, fake: FakeEngine
) -> None:
    """A JSON answer with a length keeps it for HTTP/1.0; an HTTP/1.1 stream stays chunked."""
    sized = until_close(gateway, post(b"1.0", b"", body=PLAIN))
    head, _, body = sized.partition(b"\r\n\r\n")
    assert b"content-length: %d" % len(body) in head.lower() and orjson.loads(body)["choices"], sized[:300]
    chunked = until_close(gateway, post(b"1.1", b"Host: localhost\r\nConnection: close\r\n"))
    assert b"transfer-encoding: chunked" in chunked.partition(b"\r\n\r\n")[0]
    assert chunked.endswith(b"\r\n0\r\n\r\n")


# -- Host ----------------------------------------------------------------------------------------


@pytest.mark.fault("clients", "HTTP versions, Host and framing a client may not use")
@pytest.mark.parametrize(
    ("version", "fields"),
    [
        (b"1.1", b""),
        (b"1.1", b"Host: localhost\r\nHost: localhost\r\n"),
        (b"1.0", b"Host: localhost\r\nHost: y\r\n"),
    ],
    ids=["1.1-no-host", "1.1-two-hosts", "1.0-two-hosts"],
)
def test_a_request_without_host_or_with_two_gets_400(
    gateway: Running, fake: FakeEngine, version: bytes, fields: bytes
) -> None:
    """An HTTP/1.1 request without Host, or any request with two, is refused 400 and never relayed."""
    response = until_close(gateway, post(version, fields))
    assert response.startswith(b"HTTP/1.1 400"), response[:200]
    assert error_code(response) == "invalid_host_header"
    assert fake.records() == []


@pytest.mark.fault("clients", "HTTP versions, Host and framing a client may not use")
def test_an_http10_request_without_host_is_served(gateway: Running, fake: FakeEngine) -> None:
    """HTTP/1.0 may omit Host (nginx serves it too)."""
    response = until_close(gateway, post(b"1.0", b"", body=PLAIN))
    assert response.startswith(b"HTTP/1.1 200"), response[:200]


# -- versions ------------------------------------------------------------------------------------


@pytest.mark.fault("clients", "HTTP versions, Host and framing a client may not use")
@pytest.mark.parametrize("line", [b"HTTP/2.0", b"HTTP/0.9", b"HTTP/3.0"])
def test_a_request_line_of_another_http_version_gets_505(
    gateway: Running, fake: FakeEngine, line: bytes
) -> None:
    """Versions other than HTTP/1.0 and HTTP/1.1 are refused 505, not served as HTTP/1.1."""
    response = until_close(gateway, post(line.removeprefix(b"HTTP/"), b"Host: localhost\r\n"))
    assert response.startswith(b"HTTP/1.1 505"), response[:200]
    assert error_code(response) == "http_version_not_supported"
    assert fake.records() == []


# -- transfer codings ----------------------------------------------------------------------------


@pytest.mark.fault("clients", "smuggling, upgrades and hop-by-hop headers")
@pytest.mark.parametrize(
    "fields",
    [
        b"Transfer-Encoding: gzip, chunked\r\n",
        b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: identity\r\n",
    ],
    ids=["gzip-chunked", "two-fields", "identity"],
)
def test_a_request_with_an_unknown_transfer_coding_gets_501(
    gateway: Running, fake: FakeEngine, fields: bytes
) -> None:
    """A request transfer coding other than chunked alone is refused 501 (nginx's), never relayed."""
    response = until_close(gateway, chunked_post(fields))
    assert response.startswith(b"HTTP/1.1 501"), response[:200]
    assert error_code(response) == "unsupported_transfer_encoding"
    assert fake.records() == []


@pytest.mark.fault("clients", "smuggling, upgrades and hop-by-hop headers")
@pytest.mark.parametrize(
    "raw",
    [
        chunked_post(b"Transfer-Encoding: chunked, chunked\r\n"),
        chunked_post(b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n"),
        b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(STREAM), STREAM),
    ],
    ids=["chunked-twice", "te-and-length", "http10-chunked"],
)
def test_ambiguous_request_framing_gets_400(gateway: Running, fake: FakeEngine, raw: bytes) -> None:
    """chunked twice, Transfer-Encoding with Content-Length, or chunked on HTTP/1.0: 400, never relayed."""
    response = until_close(gateway, raw)
    assert response.startswith(b"HTTP/1.1 400"), response[:200]
    assert fake.records() == []


@pytest.mark.fault("clients", "smuggling, upgrades and hop-by-hop headers")
def test_a_chunked_request_in_any_case_is_served(gateway: Running, fake: FakeEngine) -> None:
    """``Transfer-Encoding: Chunked`` (codings are case-insensitive) is read as chunked and relayed."""
    response = until_close(gateway, chunked_post(b"Transfer-Encoding: Chunked\r\nConnection: close\r\n"))
    assert response.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in response, response[:200]
