"""The end of a drain, as the request path sees it.

The server's drain (proxy/startup/server.py) waits for the relayed requests in
flight; when its time is over it calls ``Relay.abort_all``, and from then on
nothing new starts: upstream connections still in use are aborted (their
clients get an SSE error event or a 503), and requests still waiting for a
slot or for a model to load are answered 503 ``draining``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from proxy.errors import HTTPError
from proxy.relay.failures import draining
from proxy.relay.routes import RouteEntry
from proxy.upstream import Connection
from proxy.upstream_errors import Draining


class Drain:
    """What a drain that ran out of time ends, and what requests check to see that it did."""

    __slots__ = ("active", "closing", "ended", "refusal")

    def __init__(self) -> None:
        # Upstream connections with a request on them, for the drain to end.
        self.active: set[Connection] = set()
        # Set when the drain's time is over: nothing new may start.
        self.closing = False
        # Set with ``closing``; what waits for a model to load waits on it too.
        self.ended = asyncio.Event()
        # The answer for requests that still wait, once the drain is over.
        self.refusal: HTTPError | None = None

    def end(self, reason: str, entries: Iterable[RouteEntry]) -> int:
        """End everything still running or waiting; return how many."""
        self.closing = True
        self.refusal = draining(reason)
        self.ended.set()
        ended = len(self.active)
        for conn in list(self.active):
            conn.abort(Draining(reason))
        refusal = draining(reason)
        for entry in entries:
            ended += entry.admission.fail_waiters(refusal)
        return ended
