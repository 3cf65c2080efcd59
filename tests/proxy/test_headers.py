"""proxy.headers: which headers cross the proxy, and the upstream request head."""

from __future__ import annotations

import random

import httptools
import pytest
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE

from proxy.headers import (
    HOP_BY_HOP,
    SSE_HEADERS,
    Header,
    check_header_bytes,
    connection_tokens,
    filter_response_headers,
    forward_request_headers,
    is_event_stream,
    request_drop,
    request_head,
    response_lines,
    valid_request_id,
)

# RFC 9110 7.6.1 names these, plus the obsolete Proxy-Connection; Proxy-Authenticate and
# Proxy-Authorization are for the next hop only (RFC 9110 11.7).
RFC_HOP_BY_HOP = [
    b"connection",
    b"keep-alive",
    b"proxy-connection",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"te",
    b"transfer-encoding",
    b"upgrade",
]


def names(headers: list[Header]) -> list[bytes]:
    return [name for name, _ in headers]


def test_hop_by_hop_set_covers_rfc_9110() -> None:
    """Every hop-by-hop field of RFC 9110 7.6.1 is in HOP_BY_HOP."""
    assert set(RFC_HOP_BY_HOP) <= HOP_BY_HOP


@pytest.mark.parametrize("name", RFC_HOP_BY_HOP)
def test_hop_by_hop_never_forwarded_to_upstream(name: bytes) -> None:
    """A hop-by-hop request header never reaches the upstream."""
    out = forward_request_headers([(name, b"v"), (b"accept", b"application/json")])
    assert out == [(b"accept", b"application/json")]


@pytest.mark.parametrize("name", RFC_HOP_BY_HOP)
def test_hop_by_hop_never_forwarded_to_client(name: bytes) -> None:
    """A hop-by-hop response header never reaches the client."""
    out = filter_response_headers([(name, b"v"), (b"content-type", b"application/json")])
    assert out == [(b"content-type", b"application/json")]


def test_connection_tokens_are_case_insensitive_and_trimmed() -> None:
    """Connection values are split on commas, trimmed and lower-cased; empty items are skipped."""
    tokens = connection_tokens([(b"Connection", b" Keep-Alive ,X-Foo,, \tX-Bar "), (b"other", b"x-baz")])
    assert tokens == {b"keep-alive", b"x-foo", b"x-bar"}


def test_connection_tokens_merge_repeated_connection_headers() -> None:
    """Several Connection headers all contribute their names."""
    tokens = connection_tokens([(b"connection", b"x-one"), (b"connection", b"X-Two")])
    assert tokens == {b"x-one", b"x-two"}


def test_request_drops_fields_named_by_connection() -> None:
    """Request headers named in a Connection header (any case, comma list with spaces) are dropped."""
    out = forward_request_headers(
        [
            (b"connection", b"X-Hop ,  x-other,Keep-Alive"),
            (b"x-hop", b"1"),
            (b"x-other", b"2"),
            (b"x-kept", b"3"),
        ]
    )
    assert out == [(b"x-kept", b"3")]


def test_response_drops_fields_named_by_connection() -> None:
    """Response headers named in a Connection header are dropped, whatever the case of its tokens."""
    out = filter_response_headers(
        [
            (b"connection", b"X-Hop, x-OTHER"),
            (b"x-hop", b"1"),
            (b"x-other", b"2"),
            (b"x-kept", b"3"),
        ]
    )
    assert out == [(b"x-kept", b"3")]


@pytest.mark.parametrize(
    "name", [b"host", b"content-length", b"content-type", b"expect", b"accept-encoding", b"x-request-id"]
)
def test_request_drops_fields_the_gateway_writes_itself(name: bytes) -> None:
    """Host, Content-Length, Content-Type, Expect, Accept-Encoding, X-Request-Id: the gateway writes them."""
    assert forward_request_headers([(name, b"v")]) == []


def test_a_conversation_id_never_reaches_an_engine() -> None:
    """X-Conversation-Id would let llama-server go on generating without its client, for anyone to replay."""
    headers = [(b"x-conversation-id", b"conv-1"), (b"accept", b"text/event-stream")]
    assert forward_request_headers(headers) == [(b"accept", b"text/event-stream")]
    drop = request_drop(frozenset({b"authorization"}))
    assert forward_request_headers(headers, drop) == [(b"accept", b"text/event-stream")]


def test_request_keeps_end_to_end_fields_in_order() -> None:
    """Authorization, User-Agent and OpenAI-* headers go upstream unchanged, in order."""
    headers = [
        (b"authorization", b"Bearer sk-test"),
        (b"user-agent", b"OpenAI/Python 1.40.0"),
        (b"openai-organization", b"org-1"),
        (b"openai-beta", b"assistants=v2"),
        (b"x-stainless-lang", b"python"),
    ]
    assert forward_request_headers(headers) == headers


def test_request_keeps_repeated_fields() -> None:
    """A field sent twice is forwarded twice."""
    headers = [(b"x-tag", b"a"), (b"x-tag", b"b")]
    assert forward_request_headers(headers) == headers


def test_request_accepts_a_one_shot_iterable() -> None:
    """A generator of headers is read once and still filtered against its Connection header."""
    headers = [(b"connection", b"x-hop"), (b"x-hop", b"1"), (b"accept", b"*/*")]
    assert forward_request_headers(iter(headers)) == [(b"accept", b"*/*")]


def test_response_keeps_values_untouched() -> None:
    """Response header values pass as they came (names arrive lower-cased from the transport)."""
    out = filter_response_headers([(b"content-type", b"Application/JSON"), (b"x-custom", b"MiXeD")])
    assert out == [(b"content-type", b"Application/JSON"), (b"x-custom", b"MiXeD")]


@pytest.mark.parametrize(
    "name",
    [
        b"Date",
        b"Server",
        b"Content-Length",
        b"X-Request-Id",
        b"Server-Timing",
        b"Access-Control-Allow-Origin",
        b"Access-Control-Allow-Credentials",
        b"Access-Control-Allow-Headers",
        b"Access-Control-Allow-Methods",
        b"Access-Control-Expose-Headers",
        b"Access-Control-Max-Age",
    ],
)
def test_response_drops_fields_the_gateway_owns(name: bytes) -> None:
    """Date, Server, framing, the gateway's own ids and upstream CORS headers do not reach the client."""
    assert filter_response_headers([(name.lower(), b"v")]) == []


def test_response_from_mlx_server_keeps_only_end_to_end_fields() -> None:
    """mlx_lm.server's usual response headers reduce to Content-Type, Retry-After and custom ones."""
    upstream = [
        (b"Server", b"BaseHTTP/0.6 Python/3.11.7"),
        (b"Date", b"Sat, 29 Nov 2025 22:00:00 GMT"),
        (b"Content-Type", b"text/event-stream"),
        (b"Access-Control-Allow-Origin", b"*"),
        (b"Cache-Control", b"no-cache"),
        (b"Retry-After", b"5"),
        (b"X-Custom", b"1"),
        (b"Connection", b"close"),
        (b"Content-Length", b"12"),
    ]
    # Lower-cased as the transport delivers them.
    assert filter_response_headers([(n.lower(), v) for n, v in upstream]) == [
        (b"content-type", b"text/event-stream"),
        (b"cache-control", b"no-cache"),
        (b"retry-after", b"5"),
        (b"x-custom", b"1"),
    ]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"text/event-stream", True),
        (b"text/event-stream; charset=utf-8", True),
        (b"text/event-stream;charset=utf-8", True),
        (b"TEXT/EVENT-STREAM", True),
        (b"  Text/Event-Stream ; charset=UTF-8", True),
        (b"application/json", False),
        (b"text/event-stream-ish", False),
        (b"", False),
    ],
)
def test_is_event_stream_by_content_type(value: bytes, expected: bool) -> None:
    """Only a text/event-stream media type, any case, any parameters, counts as SSE."""
    assert is_event_stream([(b"x-other", b"text/event-stream"), (b"content-type", value)]) is expected


def test_is_event_stream_without_content_type() -> None:
    """A response with no Content-Type is not SSE."""
    assert is_event_stream([]) is False
    assert is_event_stream([(b"x-content-type", b"text/event-stream")]) is False


def test_is_event_stream_on_filtered_upstream_headers() -> None:
    """An upstream's Content-Type is still recognised after the response filter."""
    filtered = filter_response_headers([(b"content-type", b"text/event-stream; charset=utf-8")])
    assert is_event_stream(filtered) is True


def test_sse_headers_disable_caching_and_proxy_buffering() -> None:
    """SSE responses carry Cache-Control: no-cache and X-Accel-Buffering: no."""
    assert dict(SSE_HEADERS) == {b"cache-control": b"no-cache", b"x-accel-buffering": b"no"}


@pytest.mark.parametrize(
    "value",
    [b"a", b"req-0123456789abcdef", b"550e8400-e29b-41d4-a716-446655440000", b"!~" * 100],
)
def test_valid_request_id_accepts_short_visible_ascii(value: bytes) -> None:
    """A request id of 1 to 200 visible ASCII characters is echoed."""
    assert valid_request_id(value) is True


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"a" * 201,
        b"has space",
        b"tab\there",
        b"nul\x00",
        b"crlf\r\nx-injected: 1",
        b"del\x7f",
        "caf\u00e9".encode(),
    ],
)
def test_valid_request_id_rejects_empty_long_spaces_controls_and_non_ascii(value: bytes) -> None:
    """An empty, over-long, spaced, control-character or non-ASCII request id is not echoed."""
    assert valid_request_id(value) is False


class _HeadRecorder:
    """httptools request-parser callbacks that record what was parsed."""

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[Header] = []
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_message_complete(self) -> None:
        self.complete = True


def test_request_head_parses_as_http11_with_one_host_and_content_length() -> None:
    """request_head writes a valid HTTP/1.1 head with exactly one Host and one Content-Length."""
    client = [
        (b"host", b"gateway:8000"),
        (b"content-length", b"999"),
        (b"content-type", b"application/json"),
        (b"authorization", b"Bearer sk-test"),
        (b"connection", b"keep-alive"),
    ]
    body = b'{"model":"m"}'
    head = request_head(
        b"POST", b"/api/v1/chat/completions", b"[::1]:8080", forward_request_headers(client), len(body)
    )
    assert head.endswith(b"\r\n\r\n")
    assert head.count(b"\r\n\r\n") == 1

    recorder = _HeadRecorder()
    parser = httptools.HttpRequestParser(recorder)
    parser.feed_data(head + body)

    assert recorder.complete
    assert parser.get_method() == b"POST"
    assert parser.get_http_version() == "1.1"
    assert recorder.url == b"/api/v1/chat/completions"
    assert [name for name, _ in recorder.headers].count(b"host") == 1
    assert [name for name, _ in recorder.headers].count(b"content-length") == 1
    assert recorder.headers == [
        (b"host", b"[::1]:8080"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"authorization", b"Bearer sk-test"),
    ]


def test_request_head_bytes_exactly() -> None:
    """request_head's layout: request line, host, content-type, content-length, headers, blank line."""
    head = request_head(b"POST", b"/v1/completions", b"h:1", [(b"x-a", b"1")], 0)
    assert head == (
        b"POST /v1/completions HTTP/1.1\r\nhost: h:1\r\ncontent-type: application/json\r\n"
        b"content-length: 0\r\nx-a: 1\r\n\r\n"
    )


def test_sse_headers_replace_upstream_cache_control() -> None:
    """An SSE response gets exactly one Cache-Control (no-cache) and X-Accel-Buffering: no."""
    from proxy.headers import add_sse_headers

    out = add_sse_headers([(b"content-type", b"text/event-stream"), (b"cache-control", b"max-age=60")])
    assert out == [
        (b"content-type", b"text/event-stream"),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
    ]


def test_response_lines_are_the_filtered_fields_as_a_heads_lines() -> None:
    names = [
        b"content-type",
        b"content-length",
        b"connection",
        b"keep-alive",
        b"date",
        b"server",
        b"x-request-id",
        b"x-kept",
        b"x-named",
        b"set-cookie",
        b"access-control-allow-origin",
        b"close",
    ]
    values = [b"keep-alive", b"close", b"Keep-Alive", b"x-named", b"close, x-kept", b"v", b""]
    rng = random.Random(3)
    named = 0
    for _ in range(3000):
        headers = [(rng.choice(names), rng.choice(values)) for _ in range(rng.randint(0, 7))]
        expected = [
            piece
            for name, value in filter_response_headers(headers)
            for piece in (name, b": ", value, b"\r\n")
        ]
        assert response_lines(headers) == expected, headers
        named += any(n == b"connection" and v.lower() not in (b"keep-alive", b"close") for n, v in headers)
    assert named > 300  # the Connection field that names others, met often


@pytest.mark.parametrize("where", ["name", "value"])
def test_a_response_head_is_refused_for_exactly_the_bytes_uvicorn_refuses(where: str) -> None:
    """Every byte, alone in a header's name or value among good headers: refused where uvicorn's own
    patterns refuse it, let through where they do not."""
    pattern = HEADER_RE if where == "name" else HEADER_VALUE_RE
    for byte in range(256):
        odd = bytes((byte,))
        name, value = (b"x-" + odd, b"v") if where == "name" else (b"x-a", b"v" + odd + b"w")
        content = [b"HTTP/1.1 200 OK\r\n", b"content-type", b": ", b"application/json", b"\r\n"]
        content += [name, b": ", value, b"\r\n", b"x-b", b": ", b"ok", b"\r\n"]
        if pattern.search(name if where == "name" else value):
            with pytest.raises(RuntimeError, match="Invalid HTTP header name or value"):
                check_header_bytes(content)
        else:
            check_header_bytes(content)
