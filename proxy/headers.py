"""Which headers cross the proxy, in each direction. Pure functions, no I/O.

RFC 9110 7.6.1: ``Connection``, the fields it names, and the hop-by-hop
fields below describe one connection, not the message, so they never cross.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE

Header = tuple[bytes, bytes]

HOP_BY_HOP: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)

# Towards the upstream the gateway writes Host and Content-Length itself.
# Accept-Encoding is dropped so that streams arrive uncompressed: a compressed
# SSE stream could not be checked for its final "[DONE]", and an upstream's
# compressor may hold events back.
_DROP_REQUEST: Final = HOP_BY_HOP | {
    b"host",
    b"content-length",
    # Always sent as application/json: the gateway has parsed the body as
    # JSON, and FastAPI servers refuse curl's default form type with a 422.
    b"content-type",
    b"expect",
    b"accept-encoding",
    b"x-request-id",
    # Cookies are credentials, as keys are: for the gateway's client, not the engine.
    b"cookie",
    # Rebuilt by the gateway from the trusted chain (proxy/forwarded.py).
    b"x-forwarded-for",
    b"forwarded",
    # llama-server keeps generating a stream sent with it after its client
    # has gone, for anyone to replay with GET /v1/stream?conv_id=: a client
    # must not detach a generation from its connection, nor read another's.
    b"x-conversation-id",
}

# Towards the client, uvicorn writes Date and the framing; the request id and
# Server-Timing are the gateway's own; mlx_lm.server's blanket
# "Access-Control-Allow-Origin: *" must not turn CORS on behind our back.
_DROP_RESPONSE: Final = HOP_BY_HOP | {
    b"content-length",
    b"date",
    b"server",
    b"x-request-id",
    b"server-timing",
    b"access-control-allow-origin",
    b"access-control-allow-credentials",
    b"access-control-allow-headers",
    b"access-control-allow-methods",
    b"access-control-expose-headers",
    b"access-control-max-age",
}

# What a Connection header most often says: it names no field but hop-by-hop ones, dropped already.
_PLAIN_CONNECTION: Final = frozenset({b"keep-alive", b"close"})

SSE_HEADERS: Final[tuple[Header, ...]] = (
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)

_REQUEST_ID_MAX_CHARS: Final = 200


def connection_tokens(headers: Iterable[Header]) -> frozenset[bytes]:
    """The field names that a ``Connection`` header marks as hop-by-hop."""
    names: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            names.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return frozenset(names)


def request_drop(also: frozenset[bytes] = frozenset()) -> frozenset[bytes]:
    """The request fields that never go upstream, plus ``also`` (the gateway's own
    credentials, when it checks keys). Resolve once, at startup."""
    return _DROP_REQUEST | also


def forward_request_headers(
    headers: Iterable[Header], drop: frozenset[bytes] = _DROP_REQUEST
) -> list[Header]:
    """The client's headers that go on to the upstream.

    Names must be lower-case already, as ASGI servers give them.
    """
    return _without(headers, drop)


def filter_response_headers(headers: Iterable[Header]) -> list[Header]:
    """The upstream's headers that go on to the client (names must be lower-case)."""
    return _without(headers, _DROP_RESPONSE)


def _without(headers: Iterable[Header], drop: frozenset[bytes]) -> list[Header]:
    kept = []
    connection: list[Header] = []
    for header in headers:
        if header[0] not in drop:
            kept.append(header)
        elif header[0] == b"connection":
            connection.append(header)
    if not connection or (len(connection) == 1 and connection[0][1].lower() in _PLAIN_CONNECTION):
        return kept
    # The Connection header may name more fields to keep on this hop.
    extra = connection_tokens(connection) - drop
    if not extra:
        return kept
    return [h for h in kept if h[0] not in extra]


def response_lines(headers: list[Header]) -> list[bytes]:
    """``filter_response_headers`` as a head's lines: name, ``": "``, value, CRLF a field."""
    lines: list[bytes] = []
    connection = False
    for name, value in headers:
        if name not in _DROP_RESPONSE:
            lines += (name, b": ", value, b"\r\n")
        elif name == b"connection":
            if not connection and value.lower() in _PLAIN_CONNECTION:
                connection = True
                continue
            # It names fields to drop besides, or is not the only one (rare): the general rule.
            lines = []
            for name, value in filter_response_headers(headers):
                lines += (name, b": ", value, b"\r\n")
            return lines
    return lines


def add_sse_headers(headers: list[Header]) -> list[Header]:
    """Mark an SSE response as not to be cached or buffered, replacing upstream's say."""
    kept = [(n, v) for n, v in headers if n not in (b"cache-control", b"x-accel-buffering")]
    kept += SSE_HEADERS
    return kept


def is_event_stream(headers: Iterable[Header]) -> bool:
    """Whether the response is Server-Sent Events (by its Content-Type)."""
    for name, value in headers:
        if name == b"content-type":
            return is_event_stream_type(value)
    return False


def is_event_stream_type(content_type: bytes | None) -> bool:
    """Whether a Content-Type value is Server-Sent Events'."""
    return content_type is not None and content_type.split(b";", 1)[0].strip().lower() == b"text/event-stream"


def valid_request_id(value: bytes) -> bool:
    """A client's X-Request-Id is echoed only if it is short, visible ASCII."""
    return 0 < len(value) <= _REQUEST_ID_MAX_CHARS and all(0x21 <= b <= 0x7E for b in value)


# ``request_head`` for a POST whose forwarded lines are joined already (``HeadFields``): the
# target, host, length, those lines, then the gateway's x-request-id and x-forwarded-for.
POST_HEAD: Final = (
    b"POST %b HTTP/1.1\r\nhost: %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
    b"%bx-request-id: %b\r\nx-forwarded-for: %b\r\n\r\n"
)


def request_head(
    method: bytes, target: bytes, host: bytes, headers: Iterable[Header], content_length: int
) -> bytes:
    """Serialise an HTTP/1.1 request head for the upstream."""
    parts = [
        method,
        b" ",
        target,
        b" HTTP/1.1\r\nhost: ",
        host,
        b"\r\ncontent-type: application/json\r\ncontent-length: ",
        str(content_length).encode(),
        b"\r\n",
    ]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


# uvicorn's patterns of the bytes refused in a header's name and in its value (one byte each),
# as tables: a byte it refuses maps to 0, any other to 1. A head's names (values), mapped, hold a
# 0 only if a byte is refused. ``translate`` with a table costs a few instructions a byte, where
# the pattern's search costs ~35; ``translate`` deleting the allowed bytes instead costs as much
# again each call, building its table of 200-odd bytes to delete.
_NAME_MAP: Final = bytes(0 if HEADER_RE.match(bytes((b,))) else 1 for b in range(256))
_VALUE_MAP: Final = bytes(0 if HEADER_VALUE_RE.match(bytes((b,))) else 1 for b in range(256))
_REFUSED: Final = b"\x00"


def check_header_bytes(content: list[bytes]) -> None:
    """uvicorn's checks of a response head's names and values, made once over the whole head
    (``content``: the status line, then name, ``": "``, value, ``"\\r\\n"`` a header) rather than
    twice a header, and as a table (``_NAME_MAP``, ``_VALUE_MAP``)."""
    if _REFUSED in b"".join(content[1::4]).translate(_NAME_MAP) or _REFUSED in b"".join(
        content[3::4]
    ).translate(_VALUE_MAP):
        raise RuntimeError("Invalid HTTP header name or value.")
