"""The relay's upstream transport: HTTP/1.1 over asyncio, parsed by httptools (pooled by proxy/pool.py).

Why not httpx here: measured on this machine with one fast loopback upstream,
Starlette + httpx added 0.82 ms a request and httpcore scans its whole pool on
every request (+3 ms with 64 idle connections); a minimal asyncio client with
llhttp (httptools, already installed by uvicorn[standard]) added 0.09 ms.
httpx stays the client for everything off the hot path.

What it must get right (shared/design.md):
- keep-alive reuse, and HTTP/1.0 upstreams (mlx_lm.server) that close after
  every response, including close-delimited streams, where the close *is* the
  end of the body; a close before the declared end is a broken body;
- chunked bodies; a connection that died while idle in the pool;
- backpressure: reading from the upstream pauses while the client is slow;
- no environment proxies (``HTTP_PROXY`` and friends are never read).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from typing import Any, Final, cast

import httptools

from proxy import outbox
from proxy.timers import for_loop
from proxy.upstream_errors import (
    BadResponse,
    BodyBroken,
    ClientGone,
    EmptyReply,
    HeadTimeout,
    ReadTimeout,
    UpstreamError,
)

# Reading from the upstream pauses above this many unrelayed bytes.
_HIGH_WATER_BYTES: Final = 256 * 1024
# An upstream's response head larger than this is refused (as request heads are).
MAX_HEAD_BYTES: Final = 64 * 1024


class ConnState(enum.Enum):
    NEW = "new"
    ACTIVE = "active"
    IDLE = "idle"
    CLOSED = "closed"


def _keep_alive_limit(value: bytes) -> float | None:
    """How long a connection may idle, from ``Keep-Alive: timeout=N[, max=M]``: N less a second."""
    for param in value.split(b","):
        key, _, number = param.strip().partition(b"=")
        if key.strip().lower() == b"timeout":
            try:
                return max(0.0, float(number.strip()) - 1.0)
            except ValueError:
                return None
    return None


# The header fields the connection notes while it reads a head.
_NOTED: Final = frozenset(
    {b"content-type", b"content-length", b"transfer-encoding", b"keep-alive", b"content-encoding"}
)
# A head with a name twice, or with one of these, is read field by field (``_read_fields``); but
# for a head of a stream (``Transfer-Encoding: chunked``), one of the second set.
_LONG: Final = frozenset({b"transfer-encoding", b"keep-alive", b"content-encoding"})
_LONG_CHUNKED: Final = frozenset({b"content-length", b"keep-alive", b"content-encoding"})


def _ambiguous(codings: list[bytes], lengths: set[bytes]) -> bool:
    """Whether a response's framing could be read two ways (RFC 9112 6.1, 6.3).

    Transfer-Encoding with Content-Length, chunked named more than once, or
    Content-Length values that differ.
    """
    if codings:
        return bool(lengths) or codings.count(b"chunked") > 1
    return len(lengths) > 1


class Connection(asyncio.Protocol):
    """One upstream connection, carrying one request at a time."""

    def __init__(self) -> None:
        self._loop = self.loop = asyncio.get_running_loop()
        # The loop's coarse timers (proxy/timers.py), for the deadlines that may be a tick late.
        self.timers = for_loop(self._loop)
        # A request is written at the end of the loop's pass (proxy/outbox.py): held here till then.
        box = outbox.for_loop(self._loop)
        self._due, self._flush_due = box.due, box.flush
        self._out: bytes | None = None
        self._transport: asyncio.Transport | None = None
        # The parser's body callback is the list's own append: httptools calls
        # it once per HTTP chunk (an engine writes one per SSE event), and a
        # C method there costs no Python frame. What a Python callback did
        # (count, pause, wake, drop stray bytes) is done once per read.
        self._chunks: list[bytes] = []
        self.on_body: Callable[[bytes], None] = self._chunks.append
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        # Called instead of waking a waiter, for an exchange run from callbacks
        # (proxy/relay/fast.py): after the read that brought the head, body bytes, the end
        # or an error; at once for what comes outside a read (a close, a timeout, an abort).
        self.listener: Callable[[], None] | None = None
        # A listener that takes the body as it comes (``listen_body``): its read deadline runs
        # while this is set (cleared while its client is not taking bytes, ``hold``).
        self._listening = False
        self._woken = False
        self._wait_over = False
        self._read_timer: asyncio.TimerHandle | None = None
        self.state = ConnState.NEW
        self.requests_sent = 0
        self.idle_since = 0.0
        # Reused only while idle less than this; None: the pool's own limit.
        # From the upstream's ``Keep-Alive: timeout=N``, less a second.
        self.idle_limit_s: float | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        # The first Content-Type and Content-Length of the head, as sent.
        self.content_type: bytes | None = None
        self.content_length: bytes | None = None
        # The content coding of the body (gzip, br...), None for none: the relay passes it on intact.
        self.content_encoding: bytes | None = None
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.close_delimited = False
        self._head_done = False
        # Bytes received before the head was whole.
        self._head_bytes = 0
        # Whether the whole response has arrived (its body may not have been read).
        self.whole = False
        self._received_any = False
        self._paused = False
        self._listening = False
        if self.state is ConnState.IDLE:
            # A connection pooled idle ended its last response (if it had one) cleanly: the rest
            # is as set below already.
            return
        self._stray = False
        self._informational = False
        # What ended the exchange, if anything did (a timeout, a close, a malformed response).
        self.error: BaseException | None = None
        self._chunks.clear()
        # The bytes received and not yet read (the body's framing included): the pause's measure.
        self.buffered = 0
        # With a stray message under way: how many chunks are this response's.
        self._kept = 0
        self._last_data_at = 0.0
        self._wait_since = 0.0
        self._read_timeout_s = 0.0

    def __repr__(self) -> str:
        return f"<Connection {self.state.name} requests={self.requests_sent}>"

    # -- asyncio.Protocol ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.state is not ConnState.ACTIVE:
            # Bytes nobody asked for: the connection can no longer be trusted.
            self.close()
            return
        self._received_any = True
        self._last_data_at = self._loop.time()
        if not self._head_done:
            self._head_bytes += len(data)
        chunks = self._chunks
        if self._stray:
            self._kept = len(chunks)
        # The parser's callbacks tell a listener by setting ``_woken``: it is told once the read is
        # parsed, below.
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._woken = False
            self._fail(BadResponse(f"upstream sent a malformed HTTP response ({exc!r})"))
            self.close()
            return
        if self._stray:
            self._raw_headers.clear()  # a stray message's fields: none kept past the read
        if chunks:
            if self._stray:
                # Bytes of a message after the end of this response are not its body.
                del chunks[self._kept :]
            self.buffered += len(data)
            if self.buffered > _HIGH_WATER_BYTES and not self._paused and self._transport:
                self._paused = True
                self._transport.pause_reading()
            if self._waiter is not None:
                self._wake()
            elif self._listening:
                self._woken = True  # told once the read is parsed, below
        if not self._head_done and self._head_bytes > MAX_HEAD_BYTES:
            # Endless header lines, or one huge one: memory stays bounded.
            self._woken = False
            self._fail(BadResponse(f"upstream's response head is larger than {MAX_HEAD_BYTES} bytes"))
            self.close()
        elif self._woken:
            self._woken = False
            if self.listener is not None:
                self.listener()

    def eof_received(self) -> bool:
        self._on_close(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_close(exc)
        self.state = ConnState.CLOSED

    # -- httptools callbacks ------------------------------------------------

    def on_message_begin(self) -> None:
        if self.whole:
            # Bytes after the end of the response: the next message began.
            # The connection is out of step with its requests; never reuse it.
            self._stray = True
            self._kept = len(self._chunks)
            self._raw_headers = []  # not this response's: emptied after each read (``data_received``)

    def on_header(self, name: bytes, value: bytes) -> None:
        # Kept as they come, the name lower-cased; read once the head is whole.
        self._raw_headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self._stray:
            return
        raw = self._raw_headers
        self._raw_headers = []
        status = self._parser.get_status_code()
        if status < 200:
            # 1xx: an interim response; the real one follows.
            self._informational = True
            return
        # Counted only when the bytes read so far (the head, maybe some body) pass the limit.
        if self._head_bytes > MAX_HEAD_BYTES and sum(len(n) + len(v) + 4 for n, v in raw) > MAX_HEAD_BYTES:
            self._refuse(BadResponse(f"upstream's response head is larger than {MAX_HEAD_BYTES} bytes"))
            return
        self.headers = raw
        fields = dict(raw)
        if len(fields) == len(raw) and _LONG.isdisjoint(fields):
            # The common head: no name twice, and none of the fields read the long way.
            self.content_type = fields.get(b"content-type")
            length = self.content_length = fields.get(b"content-length")
            framed = length is not None
        elif (
            len(fields) == len(raw)
            and fields.get(b"transfer-encoding") == b"chunked"
            and _LONG_CHUNKED.isdisjoint(fields)
        ):
            # The common head of a stream: chunked, and no other field read the long way.
            self.content_type = fields.get(b"content-type")
            framed = True
        else:
            read = self._read_fields(raw)
            if read is None:
                return
            framed = read
        self.status = status
        self.close_delimited = not framed and status not in (204, 304)
        self._head_done = True
        if self.listener is not None:
            self._woken = True  # told once the read is parsed (data_received)
        else:
            self._wake()

    def _read_fields(self, headers: list[tuple[bytes, bytes]]) -> bool | None:
        """Note the fields of a head that has a name twice or one of the rarer fields: whether its
        body is framed (by Content-Length or Transfer-Encoding), or None when it is refused."""
        framed = False
        # Transfer-Encoding and Content-Length as the upstream sent them, to check its framing.
        codings: list[bytes] = []
        lengths: set[bytes] = set()
        for name, value in headers:
            if name in _NOTED:
                if name == b"content-type":
                    if self.content_type is None:
                        self.content_type = value
                elif name == b"content-length":
                    framed = True
                    lengths.add(value.strip())
                    if self.content_length is None:
                        self.content_length = value
                elif name == b"transfer-encoding":
                    framed = True
                    codings.extend(c.strip().lower() for c in value.split(b","))
                elif name == b"content-encoding":
                    if value.strip().lower() not in (b"", b"identity"):
                        self.content_encoding = value
                else:
                    self.idle_limit_s = _keep_alive_limit(value)
        if framed and _ambiguous(codings, lengths):
            # As nginx and HAProxy: a body whose end two readers could see in two places.
            self._refuse(
                BadResponse(
                    "upstream sent ambiguous framing (Transfer-Encoding "
                    f"{b', '.join(codings).decode('latin-1')!r}, "
                    f"Content-Length {sorted(v.decode('latin-1') for v in lengths)})"
                )
            )
            return None
        if codings and codings != [b"chunked"]:
            # As nginx: llhttp would read "gzip, chunked" as chunked and hand on the coded bytes.
            self._refuse(
                BadResponse(
                    "upstream sent Transfer-Encoding "
                    f"{b', '.join(codings).decode('latin-1')!r}, which the gateway does not decode "
                    "(only chunked)"
                )
            )
            return None
        return framed

    def on_message_complete(self) -> None:
        if self._stray:
            return
        if self._informational:
            self._informational = False
            return
        self.whole = True
        self.keep_alive = self._parser.should_keep_alive()
        if self._read_timer is not None:
            self._cancel_read_timer()
        if self.listener is not None:
            self._woken = True  # told once the read is parsed (data_received)
        else:
            self._wake()

    # -- used by the relay --------------------------------------------------

    def send(self, head: bytes, body: bytes | bytearray) -> None:
        """Write one request; the connection must be NEW or IDLE."""
        assert self._transport is not None
        if self._read_timer is not None:
            # The last response's deadline, left armed: it would read this one's with its timeout.
            self._cancel_read_timer()
        self._reset()
        self.state = ConnState.ACTIVE
        self.requests_sent += 1
        if len(body) < 65536:
            due = self._due
            if not due:
                # The pass's first write: made now, the pass's end marked for any after it.
                due.append(outbox.WRITTEN)
                self._loop.call_soon(self._flush_due)
                self._transport.write(head + body)
            else:
                self._out = head + body
                due.append(self)
        else:
            self._transport.writelines((head, body))

    def send_out(self) -> None:
        """Write the request ``send`` left in the outbox, unless the connection closed since."""
        data, self._out = self._out, None
        transport = self._transport
        if data is not None and transport is not None and not transport.is_closing():
            transport.write(data)

    async def read_head(self, timeout_s: float) -> None:
        """Wait for the response head (status and headers), or raise."""
        if self._head_awaited():
            timer = self.timers.later(timeout_s, self._head_timed_out, timeout_s)
            try:
                while self._head_awaited():
                    await self._wait()
            finally:
                self.timers.cancel(timeout_s, timer)
        if not self._head_done:
            assert self.error is not None
            raise self.error

    async def wait_head(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the response head: True when it came, False if not yet.

        Unlike read_head, running out of time leaves the exchange alone.
        """
        if self._head_awaited():
            # A coarse timer that wakes the wait (asyncio.timeout costs a
            # dozen calls, and this wait is made for every stream).
            self._wait_over = False
            timer = self.timers.later(timeout_s, self._end_head_wait)
            try:
                while self._head_awaited():
                    if self._wait_over:
                        return False
                    await self._wait()
            finally:
                self.timers.cancel(timeout_s, timer)
        if self._head_done:
            return True
        assert self.error is not None
        raise self.error

    def _head_awaited(self) -> bool:
        """Whether the head is still to come: neither here nor failed. Asked by a call, not
        written out in a wait's loop: there a checker takes the state tested before the wait for
        the state after it, and a compiled build (mypyc) trusts the checker."""
        return not self._head_done and self.error is None

    async def read(self, timeout_s: float) -> bytes:
        """The body bytes that have arrived; ``b""`` once the body is complete.

        Raises ReadTimeout when nothing arrives for ``timeout_s``.
        """
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self.buffered = 0
                if self._paused and self._transport is not None:
                    self._paused = False
                    self._transport.resume_reading()
                return data
            if self.whole:
                return b""
            if self.error is not None:
                raise self.error
            # One timer per response, re-armed only when it fires: arming and
            # cancelling one per wait would cost every relayed event.
            self._wait_since = self._loop.time()
            if self._read_timer is None:
                self._read_timeout_s = timeout_s
                self._read_timer = self._loop.call_at(self._wait_since + timeout_s, self._check_read_deadline)
            await self._wait()

    async def wait_body(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for body bytes, the body's end or an error: whether ``read``
        would now return without waiting. Running out of time leaves the exchange alone (and
        arms no read deadline: the caller keeps its own)."""
        if not self.ready:
            self._wait_over = False
            timer = self.timers.later(timeout_s, self._end_head_wait)
            try:
                while not self.ready:
                    if self._wait_over:
                        return False
                    await self._wait()
            finally:
                self.timers.cancel(timeout_s, timer)
        return True

    @property
    def awaited(self) -> bool:
        """Whether the relay is waiting on this connection for the upstream's bytes."""
        return self._waiter is not None and not self._waiter.done()

    @property
    def ready(self) -> bool:
        """Whether ``read`` would return (or raise) without waiting."""
        return bool(self._chunks) or self.whole or self.error is not None

    @property
    def complete(self) -> bool:
        """Whether the whole body has arrived and been read."""
        return self.whole and not self._chunks

    def take_body(self) -> bytes:
        """The body bytes that have arrived, at once (``read`` without a wait)."""
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return data

    @property
    def reusable(self) -> bool:
        return (
            self.whole
            and self.keep_alive
            and not self._stray
            and not self._chunks
            and self.state is ConnState.ACTIVE
            and self._transport is not None
            and not self._transport.is_closing()
        )

    def client_event(self, task: asyncio.Future[Any]) -> None:
        """Done-callback of the task watching the client's ``receive()``.

        The only event left for a request whose body was read is the
        disconnect, so its completion means the client has gone.
        """
        if not task.cancelled():
            self.client_gone()

    def client_gone(self) -> None:
        """The client's connection is gone: end the exchange with ``ClientGone`` and close."""
        if self.state is not ConnState.ACTIVE:
            return
        self._fail(ClientGone())
        self.close()

    def abort(self, error: UpstreamError) -> None:
        """End the exchange with ``error`` (the relay tells its client) and close."""
        self._fail(error)
        self.close()

    def close(self) -> None:
        """Close at once, discarding anything unsent or unread."""
        self._cancel_read_timer()
        self.state = ConnState.CLOSED
        self._out = None
        if self._transport is not None:
            self._transport.abort()

    def listen_body(self, timeout_s: float) -> None:
        """Tell the listener of body bytes as they come (it takes them with ``take_body``), with
        ``read``'s deadline: ``ReadTimeout`` when nothing comes for ``timeout_s`` while it listens."""
        self._listening = True
        self._read_timeout_s = timeout_s
        self._wait_since = self._loop.time()
        if self._read_timer is None and not self.whole and self.error is None:
            # (A response whole already arms nothing: its end cancelled the deadline before this.)
            self._read_timer = self._loop.call_at(self._wait_since + timeout_s, self._check_read_deadline)

    def hold(self, held: bool) -> None:
        """A listener's client is not taking bytes (``held``): stop reading, and the upstream's
        silence is not counted; or it takes them again."""
        transport = self._transport
        if held:
            self._listening = False
            if transport is not None and not self._paused:
                self._paused = True
                transport.pause_reading()
            return
        self._listening = True
        self._wait_since = self._loop.time()
        if self._paused and transport is not None:
            self._paused = False
            transport.resume_reading()

    # -- internals ----------------------------------------------------------

    def head_deadline(self, timeout_s: float, since_s: float = 0.0) -> int:
        """Abort with ``HeadTimeout`` unless the head comes within ``timeout_s`` of the send, armed
        ``since_s`` after it (``read_head``'s deadline, for an exchange run from callbacks); the
        key to ``timers.cancel`` it with, for the delay ``timeout_s - since_s``."""
        return self.timers.later(timeout_s - since_s, self._head_timed_out, timeout_s)

    def _end_head_wait(self) -> None:
        self._wait_over = True
        self._wake()

    def _head_timed_out(self, timeout_s: float) -> None:
        if not self._head_done and self.error is None:
            self._fail(HeadTimeout(f"upstream sent no response within {timeout_s:g} s"))
            self.close()

    def _check_read_deadline(self) -> None:
        self._read_timer = None
        if self.error is not None or self.whole or self.state is not ConnState.ACTIVE:
            return
        now = self._loop.time()
        timeout_s = self._read_timeout_s
        if self._waiter is None and not self._listening:
            # The relay is busy with the client (backpressure): not our silence.
            deadline = now + timeout_s
        else:
            deadline = max(self._wait_since, self._last_data_at) + timeout_s
            if now >= deadline:
                self._fail(
                    ReadTimeout(f"upstream sent nothing for {timeout_s:g} s in the middle of its response")
                )
                self.close()
                return
        self._read_timer = self._loop.call_at(deadline, self._check_read_deadline)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _on_close(self, exc: Exception | None) -> None:
        if self.state is not ConnState.ACTIVE or self.whole or self.error is not None:
            self.state = ConnState.CLOSED
            return
        if self._head_done:
            if self.close_delimited and exc is None:
                # HTTP/1.0 and friends: the close is the end of the body.
                self.whole = True
                self.keep_alive = False
            else:
                self._fail(BodyBroken("upstream closed the connection before the response was complete"))
        elif not self._received_any:
            self._fail(
                EmptyReply(
                    "upstream closed the connection without sending a response"
                    + (f" ({exc})" if exc else "")
                    + "; engines such as mlx_lm.server do this on a request field"
                    " they cannot handle (a wrong type or out-of-range value)"
                )
            )
        else:
            self._fail(BadResponse("upstream closed the connection in the middle of the response head"))
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _refuse(self, error: UpstreamError) -> None:
        """``abort``, from a parser callback: the listener is told once the read is parsed."""
        if self.error is None:
            self.error = error
        if self.listener is not None:
            self._woken = True
        else:
            self._wake()
        self.close()

    def _wake(self) -> None:
        if self.listener is not None:
            self.listener()
            return
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        await self._waiter
