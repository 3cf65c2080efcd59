"""Failures as the client is told of them before a response has started.

The gateway's own refusals go out with the status of the README's table, in
the envelope of the API the request came in on (``proxy.asgi.send_error``:
the one place an error body is written); an upstream's error body is read whole (bounded) and
put in that envelope, keeping the headers clients act on. After a stream has
started, a failure is one SSE error event instead (``Envelope.event``).
"""

from __future__ import annotations

import math

from proxy.asgi import Send, send_error
from proxy.errors import Envelope, HTTPError
from proxy.relay.timing import server_timing
from proxy.upstream import Connection
from proxy.upstream_errors import BodyBroken

# Upstream error bodies are read whole to be normalised, up to this size.
_ERROR_BODY_LIMIT_BYTES = 1024 * 1024
# Upstream error headers that clients act on (openai-python reads them all).
KEPT_ON_ERRORS = frozenset({b"retry-after", b"retry-after-ms", b"x-should-retry", b"www-authenticate"})
_RETRY_AFTER_S = b"2"


def loading(reason: str) -> HTTPError:
    """503 model_loading: the model cannot take requests yet (or again)."""
    return HTTPError(503, reason, code="model_loading", headers=((b"retry-after", _RETRY_AFTER_S),))


def no_replica(reason: str, back_in_s: float | None = None) -> HTTPError:
    """503 no_healthy_replica: every replica of the model is out of rotation; ``back_in_s``, when
    known, is when the first of them is tried again (Retry-After, 1 to 60 s)."""
    retry_after = _RETRY_AFTER_S if back_in_s is None else b"%d" % max(1, min(60, math.ceil(back_in_s)))
    return HTTPError(503, reason, code="no_healthy_replica", headers=((b"retry-after", retry_after),))


def draining(reason: str) -> HTTPError:
    """503 draining: the drain is over and nothing new starts."""
    return HTTPError(503, reason, code="draining", headers=((b"retry-after", _RETRY_AFTER_S),))


async def refuse(send: Send, envelope: Envelope, exc: HTTPError, request_id: bytes, started: float) -> int:
    """Answer with the gateway's own refusal; return the body's size (the access log's bytes)."""
    return await send_error(send, envelope, exc, [(b"x-request-id", request_id), server_timing(started)])


async def send_upstream_error(
    send: Send, envelope: Envelope, exc: HTTPError, request_id: bytes, timing: tuple[bytes, bytes]
) -> int:
    """Answer for an upstream that failed before the response started (503s with Retry-After);
    return the body's size (the access log's bytes)."""
    headers = [(b"x-request-id", request_id), timing]
    if exc.status == 503 and not exc.headers:
        headers.append((b"retry-after", _RETRY_AFTER_S))
    return await send_error(send, envelope, exc, headers)


async def read_error_body(conn: Connection, envelope: Envelope, read_timeout_s: float) -> bytes:
    """An upstream error body, read whole (bounded) and put in the envelope of the request's API."""
    chunks: list[bytes] = []
    size = 0
    while size <= _ERROR_BODY_LIMIT_BYTES:
        try:
            chunk = await conn.read(read_timeout_s)
        except BodyBroken:
            break
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if not conn.complete:
        conn.close()
    return envelope.upstream(conn.status, b"".join(chunks))
