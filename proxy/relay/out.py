"""Where a relayed response is written: straight to the client's transport, or through ASGI ``send``.

The server (``proxy/protocol.py``) offers ``scope["extensions"]["blazar.writer"]``,
which makes a writer for the ``send`` it is given when that is the server's
own (a wrapper such as the CORS one adds headers that only ``send`` would see).
Either way the relay calls the same three methods, and awaits what
``write`` and ``flush`` return only when it is not None. Both raise
``ClientGone`` once the client's connection is gone, so that the bytes the
relay counts after a write are bytes handed to the client's connection.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

from proxy.asgi import Scope, Send
from proxy.upstream_errors import ClientGone


class Writer(Protocol):
    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    def flush(self) -> Awaitable[None] | None: ...

    def write(self, body: bytes, more: bool) -> Awaitable[None] | None: ...


class AsgiWriter:
    """The same calls made as ASGI messages; the head waits for the first body bytes, as the server's does.

    ``extensions`` are the request's (the gateway's server sets ``blazar.gone``
    once the client's connection is lost, whose ``send`` then drops messages
    silently): past that, ``write`` and ``flush`` raise ``ClientGone``, as the
    server's own writer does.
    """

    __slots__ = ("_extensions", "_send", "_start")

    def __init__(self, send: Send, extensions: dict[str, object] | None = None) -> None:
        self._send = send
        self._start: dict[str, object] | None = None
        self._extensions = extensions if extensions is not None else {}

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._start = {"type": "http.response.start", "status": status, "headers": headers}

    def flush(self) -> Awaitable[None] | None:
        start = self._start
        if start is None:
            return None
        self._start = None
        if "blazar.gone" in self._extensions:
            raise ClientGone("the client's connection closed before the response began", nothing_sent=True)
        return self._send(start)

    def write(self, body: bytes, more: bool) -> Awaitable[None] | None:
        if "blazar.gone" in self._extensions:
            raise ClientGone("the client's connection closed", nothing_sent=self._start is not None)
        message = {"type": "http.response.body", "body": body, "more_body": more}
        start = self._start
        if start is None:
            return self._send(message)
        # Taken now, not when awaited: a second write before that await must not send it again.
        self._start = None
        return self._both(start, message)

    async def _both(self, start: dict[str, object], message: dict[str, object]) -> None:
        await self._send(start)
        await self._send(message)


def writer_for(scope: Scope, send: Send) -> Writer:
    """The server's own writer when ``send`` is the server's, else one that sends ASGI messages."""
    extensions = scope.get("extensions")
    make = extensions.get("blazar.writer") if extensions is not None else None
    if make is not None and (writer := make(send)) is not None:
        return writer  # type: ignore[no-any-return]
    return AsgiWriter(send, extensions)
