"""Request ids: the client's ``x-request-id`` if usable, else a new one."""

from __future__ import annotations

import os
from binascii import hexlify

from proxy.asgi import Scope
from proxy.headers import valid_request_id


class RequestIds:
    """Request ids: the client's x-request-id if usable, else a new one.

    New ids are a random per-process prefix and a counter (32 hex digits):
    unique enough for tracing, at a tenth of uuid4's cost.
    """

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex().encode()
        self._count = 0

    def _next(self) -> bytes:
        """A new id: the prefix and the next count, 16 hex digits (one ``hexlify`` of 8 bytes,
        where ``%016x`` parses a format)."""
        self._count = count = self._count + 1
        return self._prefix + hexlify(count.to_bytes(8, "big"))

    def __call__(self, scope: Scope) -> bytes:
        for name, value in scope["headers"]:
            if name == b"x-request-id" and valid_request_id(value):
                return bytes(value)
        return self._next()

    def of(self, given: bytes | None) -> bytes:
        """The id of a request whose first usable x-request-id is ``given`` (None: it has none)."""
        return given if given is not None else self._next()
