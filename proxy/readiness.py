"""Readiness of the static upstreams, checked at most once per interval, for ``GET /readyz``.

``/readyz`` is unauthenticated and polled by balancers and orchestrators: a
probe of every upstream per call let any client multiply its calls into the
upstreams (20 upstreams, 1,000 calls: 20,000 upstream requests). So the
upstreams are checked in rounds, each upstream once per round, at most one
round per interval whatever asks, and ``/readyz`` answers from the last one.
A round runs when a call finds the last one older than the interval (or
missing an upstream: at start, after a reload), and every call made while it
runs awaits that same round. Nobody polling, nothing is sent: an upstream
is not asked for a readiness nobody wants.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping

from proxy.routing import RoutingTable, UpstreamAddress

# A check waits this long for a connection, and then this long for the
# answer to GET /readyz, so that a round ends inside a 1 s probe timeout
# (Kubernetes'), which the call that starts it awaits.
_CONNECT_TIMEOUT_S = 1.0
_READ_TIMEOUT_S = 0.3
# Said of an upstream that no round has covered yet (a reload added it mid-round).
NOT_CHECKED = "not checked yet"


def static_upstreams(table: RoutingTable) -> list[UpstreamAddress]:
    """Each static upstream of the table once (engine children have their own readiness)."""
    return list(dict.fromkeys(b.upstream for r in table if r.gate is None for b in r.all_replicas))


class Readiness:
    """Whether each static upstream can take requests, as of the last round (at most one per interval)."""

    def __init__(self, table: Callable[[], RoutingTable], interval_s: float) -> None:
        self._table = table
        self.interval_s = interval_s
        # Upstream → None (ready) or why not, from the last round that covered it.
        self._problems: dict[UpstreamAddress, str | None] = {}
        # When the last round began (the loop's clock), and the one running now.
        self._checked_at = float("-inf")
        self._round: asyncio.Future[None] | None = None

    async def stop(self) -> None:
        """Cancel a round in progress (the gateway is shutting down)."""
        pending, self._round = self._round, None
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending

    async def _check_round(self) -> None:
        """One round, shared: a caller that comes while one runs awaits that one."""
        if self._round is None or self._round.done():
            self._checked_at = asyncio.get_running_loop().time()
            self._round = asyncio.ensure_future(self._check_all())
        await asyncio.shield(self._round)

    async def _check_all(self) -> None:
        static = static_upstreams(self._table())
        results = await asyncio.gather(*(reachable(a) for a in static))
        self._problems = dict(zip(static, results, strict=True))

    async def problems(self) -> Mapping[UpstreamAddress, str | None]:
        """Each static upstream of the table now: None if it can take requests, else why not.

        From the last round, unless it is older than the interval or missed
        an upstream: then from a new one (shared by the calls meanwhile); an
        upstream even that missed (a reload mid-round) is "not checked yet".
        """
        static = static_upstreams(self._table())
        stale = asyncio.get_running_loop().time() - self._checked_at >= self.interval_s
        if stale or any(a not in self._problems for a in static):
            await self._check_round()
        known = self._problems
        return {a: known.get(a, f"{a.host_header.decode()}: {NOT_CHECKED}") for a in static}


async def reachable(address: UpstreamAddress) -> str | None:
    """None if the upstream can take requests, else why not.

    It must accept a TCP connection (the one check every OpenAI server
    passes). If it then answers ``GET /readyz`` with 503, it says itself that
    it cannot: another gateway that is draining, behind this one. Any other
    answer, or none within ``_READ_TIMEOUT_S``, counts as ready, since most
    servers have no /readyz (only a prompt 503 counts).
    """
    host = address.host_header.decode()
    try:
        async with asyncio.timeout(_CONNECT_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(address.host, address.port)
    except TimeoutError:
        return f"{host}: no answer within {_CONNECT_TIMEOUT_S:g} s"
    except OSError as exc:
        return f"{host}: {exc.strerror or exc}"
    try:
        writer.write(
            b"GET %s/readyz HTTP/1.1\r\nhost: %s\r\nconnection: close\r\n\r\n"
            % (address.prefix.encode(), address.host_header)
        )
        async with asyncio.timeout(_READ_TIMEOUT_S):
            status_line = await reader.readline()
    except (TimeoutError, OSError):
        return None
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    parts = status_line.split()
    if len(parts) >= 2 and parts[1] == b"503":
        return f"{host}: its /readyz answers 503 (it is draining or has nothing ready)"
    return None
