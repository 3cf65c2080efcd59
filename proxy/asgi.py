"""ASGI type aliases and the one response helper the gateway needs everywhere."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from proxy.errors import Envelope, HTTPError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_json(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Send a whole JSON response."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
                *(headers or ()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_error(
    send: Send, envelope: Envelope, error: HTTPError, headers: list[tuple[bytes, bytes]]
) -> int:
    """The one place an error is answered before a response has started: in the envelope of the API
    the request came in on, with the error's own headers; return the body's size (the access log's)."""
    body = envelope.body(error)
    await send_json(send, error.status, body, [*headers, *error.headers])
    return len(body)
