"""Pooled connections to one upstream: idle ones reused newest first, new ones opened on demand.

A connection that was idle too long (the pool's limit, or the upstream's own
``Keep-Alive: timeout``, less a second) is closed rather than reused, and
closed on a timer when no request comes for it: one loop timer per pool,
armed only while connections are idle (a burst's connections would
otherwise hold their descriptors until the next request to this upstream).
For an upstream that closes after every response (HTTP/1.0, like
mlx_lm.server) the next request's connection is opened as soon as one ends,
off its path.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket

from proxy.routing import UpstreamAddress
from proxy.upstream import Connection, ConnState
from proxy.upstream_errors import ConnectFailed, Overloaded


class Pool:
    """Connections to one upstream; idle ones are reused newest first."""

    def __init__(
        self,
        address: UpstreamAddress,
        *,
        connect_timeout_s: float,
        idle_timeout_s: float = 4.0,
        max_idle: int = 512,
    ) -> None:
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        # Shorter than common keep-alive timeouts (uvicorn's default is 5 s),
        # so that the gateway, not the upstream, retires idle connections.
        self.idle_timeout_s = idle_timeout_s
        self.max_idle = max_idle
        self._idle: list[Connection] = []
        self._spare: asyncio.Future[None] | None = None
        self._closed = False
        self._resolved: list[str] = []
        self.last_connect_error: str | None = None
        # The sweep of idle connections past their limit: armed while any is idle.
        self._sweep: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        return f"<Pool {self.address.host_header.decode()} idle={len(self._idle)}>"

    async def acquire(self) -> Connection:
        """An idle connection if a live one is pooled, else a new one."""
        conn = self.take_idle()
        if conn is not None:
            return conn
        return await self.connect()

    def take_idle(self) -> Connection | None:
        """A live idle connection, if one is pooled (those past their limit are closed)."""
        idle = self._idle
        if idle:
            now = idle[-1].loop.time()
            pool_limit_s = self.idle_timeout_s
            while idle:
                conn = idle.pop()
                # _limit_s and _open, written out: this runs for every request.
                limit_s = conn.idle_limit_s
                if limit_s is None or limit_s > pool_limit_s:
                    limit_s = pool_limit_s
                transport = conn._transport
                if (
                    now - conn.idle_since < limit_s
                    and conn.state is ConnState.IDLE
                    and transport is not None
                    and not transport.is_closing()
                ):
                    return conn
                conn.close()
        return None

    def put_back(self, conn: Connection) -> None:
        """An idle connection ``take_idle`` gave and nothing used: pooled again, as it was."""
        self._idle.append(conn)

    async def connect(self) -> Connection:
        """A new connection, or ``ConnectFailed``."""
        loop = asyncio.get_running_loop()
        host, port = self.address.host, self.address.port
        failure: OSError | None = None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                for ip in await self._addresses(loop):
                    try:
                        _, conn = await loop.create_connection(Connection, ip, port)
                    except OSError as exc:
                        failure = exc
                        continue
                    self.last_connect_error = None
                    return conn
        except TimeoutError:
            message = f"connecting to upstream {host}:{port} timed out after {self.connect_timeout_s:g} s"
        except OSError as exc:  # name resolution
            message = f"cannot resolve upstream host {host!r}: {exc}"
        else:
            reason = (failure.strerror or str(failure)) if failure else "no address"
            if failure is not None and failure.errno in (errno.EMFILE, errno.ENFILE):
                raise Overloaded(
                    f"the gateway is overloaded: it has no file descriptor left for a connection "
                    f"to the upstream ({reason}); retry shortly"
                )
            message = f"cannot connect to upstream {host}:{port}: {reason}"
        self._resolved = []
        self.last_connect_error = message
        raise ConnectFailed(message)

    def unused(self, conn: Connection) -> None:
        """Take back a connection nothing was sent on (taken idle, or opened for a request that then
        went nowhere): pooled, with its idle time as it was if it was idle, where there is room;
        else closed."""
        if (
            self._closed
            or len(self._idle) >= self.max_idle
            or conn.state not in (ConnState.NEW, ConnState.IDLE)
            or conn._transport is None
            or conn._transport.is_closing()
        ):
            conn.close()
            return
        if conn.state is ConnState.IDLE:
            self._idle.append(conn)
            if self._sweep is None:
                self._sweep = conn.loop.call_at(
                    conn.idle_since + _limit_s(conn, self.idle_timeout_s), self._close_expired
                )
            return
        self._park(conn)

    def release(self, conn: Connection) -> None:
        """Take back a connection whose request has ended."""
        idle = self._idle
        if conn.reusable and len(idle) < self.max_idle and not self._closed:
            # _park, written out: this runs for every request.
            conn.state = ConnState.IDLE
            conn.idle_since = conn.loop.time()
            idle.append(conn)
            if self._sweep is None:
                self._sweep = conn.loop.call_at(
                    conn.idle_since + _limit_s(conn, self.idle_timeout_s), self._close_expired
                )
            return
        ended_cleanly = conn.complete and not conn.keep_alive
        conn.close()
        if ended_cleanly and not idle and self._spare is None and not self._closed:
            # An upstream that closes after every response (HTTP/1.0, like
            # mlx_lm.server): open the next request's connection now, off
            # its critical path, instead of when it arrives.
            self._spare = asyncio.ensure_future(self._open_spare())

    def close(self) -> None:
        """Close every idle connection; open no more spares."""
        self._closed = True
        if self._spare is not None:
            self._spare.cancel()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    def _park(self, conn: Connection) -> None:
        conn.state = ConnState.IDLE
        conn.idle_since = conn.loop.time()
        self._idle.append(conn)
        if self._sweep is None:
            self._sweep = conn.loop.call_at(
                conn.idle_since + _limit_s(conn, self.idle_timeout_s), self._close_expired
            )

    def _close_expired(self) -> None:
        """Close the idle connections past their limit; armed again for the next one due."""
        self._sweep = None
        if not self._idle:
            return
        loop = self._idle[0].loop
        now = loop.time()
        kept: list[Connection] = []
        next_due: float | None = None
        for conn in self._idle:
            due = conn.idle_since + _limit_s(conn, self.idle_timeout_s)
            if due <= now or not _open(conn):
                conn.close()
                continue
            kept.append(conn)
            if next_due is None or due < next_due:
                next_due = due
        # In the order they were parked: the newest is still reused first.
        self._idle[:] = kept
        if next_due is not None and not self._closed:
            self._sweep = loop.call_at(next_due, self._close_expired)

    async def _open_spare(self) -> None:
        try:
            conn = await self.connect()
        except ConnectFailed:
            return
        finally:
            self._spare = None
        if self._closed:
            conn.close()
        else:
            self._park(conn)

    async def _addresses(self, loop: asyncio.AbstractEventLoop) -> list[str]:
        # Resolve once and connect by IP after: asyncio resolves names in a
        # thread on every connect, and an HTTP/1.0 upstream means a connect
        # per request.
        if not self._resolved:
            host = self.address.host
            try:
                ipaddress.ip_address(host)
                self._resolved = [host]
            except ValueError:
                infos = await loop.getaddrinfo(host, self.address.port, type=socket.SOCK_STREAM)
                self._resolved = list(dict.fromkeys(str(info[4][0]) for info in infos))
        return self._resolved


def _limit_s(conn: Connection, pool_limit_s: float) -> float:
    """How long ``conn`` may stay idle: the pool's limit, or the upstream's own if shorter."""
    limit = conn.idle_limit_s
    return pool_limit_s if limit is None or limit > pool_limit_s else limit


def _open(conn: Connection) -> bool:
    """Whether an idle connection can still be used: not closed by either side."""
    transport = conn._transport
    return conn.state is ConnState.IDLE and transport is not None and not transport.is_closing()
