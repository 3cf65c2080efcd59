"""CORS, off unless origins are configured (--cors-origin).

The engines' own `Access-Control-Allow-Origin: *` never passes the relay (see
headers.py); with origins configured, the gateway answers preflights itself
(before any API key check: browsers send no credentials on them) and marks
responses to allowed origins.
"""

from __future__ import annotations

from collections.abc import Iterable

from proxy.asgi import Message, Scope, Send

_ALLOW_METHODS = b"GET, POST, OPTIONS"
_DEFAULT_ALLOW_HEADERS = b"authorization, content-type, x-api-key, x-request-id"
_EXPOSE_HEADERS = b"x-request-id, server-timing, retry-after"


class Cors:
    def __init__(self, origins: Iterable[str]) -> None:
        configured = [o.strip().rstrip("/") for o in origins if o.strip()]
        self.any_origin = "*" in configured
        self.origins = frozenset(o.encode() for o in configured if o != "*")

    def __bool__(self) -> bool:
        return self.any_origin or bool(self.origins)

    def allows(self, origin: bytes) -> bool:
        """Whether a page of this origin may use the gateway (``*``: any, ``null`` included)."""
        return self.any_origin or origin in self.origins

    def origin_of(self, scope: Scope) -> bytes | None:
        """The request's Origin, if it is allowed."""
        for name, value in scope["headers"]:
            if name == b"origin":
                return bytes(value) if self.any_origin or value in self.origins else None
        return None

    def is_preflight(self, scope: Scope) -> bool:
        return scope["method"] == "OPTIONS" and any(
            name == b"access-control-request-method" for name, _ in scope["headers"]
        )

    def preflight_headers(self, scope: Scope, origin: bytes) -> list[tuple[bytes, bytes]]:
        requested = next((v for n, v in scope["headers"] if n == b"access-control-request-headers"), None)
        return [
            (b"access-control-allow-origin", b"*" if self.any_origin else origin),
            (b"access-control-allow-methods", _ALLOW_METHODS),
            (b"access-control-allow-headers", bytes(requested) if requested else _DEFAULT_ALLOW_HEADERS),
            (b"access-control-max-age", b"600"),
            (b"vary", b"Origin"),
        ]

    def marking(self, send: Send, origin: bytes | None) -> Send:
        """Wrap ``send`` so the response start carries the CORS headers for ``origin``.

        Every response varies by Origin once CORS is configured, allowed or
        not, so that a cache never serves one origin's answer to another.
        """
        added = [(b"vary", b"Origin")]
        if origin is not None:
            added += [
                (b"access-control-allow-origin", b"*" if self.any_origin else origin),
                (b"access-control-expose-headers", _EXPOSE_HEADERS),
            ]

        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *added]
            await send(message)

        return marked
