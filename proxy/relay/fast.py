"""The relay's common case run from the protocols' callbacks: no task, no ASGI message, no coroutine.

A request that came whole in its read, to a model of one server, asking for
no stream, no translation and nothing the gateway changes in its body, with
a slot free, is sent upstream from the client protocol's own callback
(``proxy/protocol.py``, ``proxy/lean.py``) on an idle pooled connection; where
none is pooled (a burst's first requests), on one it opens (a future for the
connect alone: its callback sends the request). A connect that fails is
answered by the task path as that failure, without a second attempt. When the upstream's
response has come whole with its head (a 2xx with a Content-Length, not an
event stream, at most ``MAX_BODY_BYTES``), the upstream connection's
callback writes its head and body to the client in one write and records
the request.

Anything else hands the exchange to the code that serves every other
request, from where it stands (``Relay.resume``, a task like any other
request's): an upstream error, a close or an abort (a drain, a cancel from
the status page, the head's deadline, the client's connection lost, which
closes the upstream at once), a head whose body is still coming, or a
response of another kind. A client that leaves while the connection is
being opened ends its request there (499): nothing is sent. Nothing is
written to the client before that hand-over, so the code that takes over
answers as it would have from the start. What the fast path checks before
sending is the same code the other path runs (``check_head``,
``Relay._parse``, ``Ticket.take``, ``Exchange.request_head``); any refusal
there leaves the request to the other path, which refuses it in its own
words.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING

from proxy.asgi import Receive, Scope, Send
from proxy.headers import filter_response_headers, is_event_stream_type
from proxy.protocol import FastClient
from proxy.relay.body import usage_tail
from proxy.relay.outcome import Outcome
from proxy.relay.request import RequestBody
from proxy.relay.routes import Peer
from proxy.relay.ticket import Ticket
from proxy.relay.timing import timing_header
from proxy.upstream import ClientGone, Connection, UpstreamError

if TYPE_CHECKING:
    from proxy.relay.handler import Relay

log = logging.getLogger("blazar.relay")

# When the task path starts watching the client (``proxy/relay/watch.py``'s ``_WATCH_AFTER_S``).
WATCH_AFTER_S = 0.05
# The largest body written from a callback in one write; a larger one goes through the task.
MAX_BODY_BYTES = 64 * 1024


class FastExchange:
    """One request's exchange with its upstream, driven by the upstream connection's callback."""

    __slots__ = (
        "_connecting",
        "_head_timeout_s",
        "_over",
        "_released",
        "_timer",
        "_watch_timer",
        "body",
        "client",
        "conn",
        "connect_failure",
        "head",
        "leave",
        "outcome",
        "peer",
        "relay",
        "scope",
        "sent",
        "ticket",
    )

    def __init__(
        self,
        relay: Relay,
        scope: Scope,
        client: FastClient,
        outcome: Outcome,
        ticket: Ticket,
        body: RequestBody,
        peer: Peer,
        leave: Callable[[], None],
        head_timeout_s: float,
    ) -> None:
        self.relay = relay
        self.scope = scope
        self.client = client
        self.outcome = outcome
        self.ticket = ticket
        self.body = body
        self.peer = peer
        # ``conn`` is set when the request is sent on it (``start``).
        self.sent = False
        self._connecting: asyncio.Future[Connection] | None = None
        # Why the connection this exchange opened could not be (the task path answers so).
        self.connect_failure: UpstreamError | None = None
        # Told once the request has ended (the gateway's count of requests in flight).
        self.leave = leave
        self.head = b""
        # The head's deadline, as ``Connection.read_head`` keeps it on the other path.
        self._head_timeout_s = head_timeout_s
        self._timer: int | None = None
        self._watch_timer: int | None = None
        # No longer the callbacks': answered, or handed to a task.
        self._over = False
        # What the request held is given back.
        self._released = False

    def connect(self, head: bytes) -> None:
        """Open a connection (none idle was pooled), then send the request on it (``start``)."""
        self.head = head
        self.client.lost = self._lost_connecting
        connecting = self._connecting = asyncio.ensure_future(self.peer.pool.connect())
        connecting.add_done_callback(self._connected)

    def _connected(self, connecting: asyncio.Future[Connection]) -> None:
        self._connecting = None
        failure = None if connecting.cancelled() else connecting.exception()
        if self._over:
            # The client left while it opened: the connection, unused, is pooled for the next.
            if not connecting.cancelled() and failure is None:
                self.peer.pool.unused(connecting.result())
            return
        if connecting.cancelled() or failure is not None:
            if isinstance(failure, UpstreamError):
                self.connect_failure = failure
            else:
                request_id = self.outcome.request_id.decode()
                log.error("opening a connection for %s failed", request_id, exc_info=failure)
            self._hand_over_unsent()
            return
        if self.relay.drain.closing:
            # The drain ended while it opened (as ``Exchange._open`` checks): sent nowhere; the task
            # path answers that the gateway is shutting down.
            self.peer.pool.release(connecting.result())
            self._hand_over_unsent()
            return
        try:
            self.start(connecting.result(), self.head)
        except Exception:
            log.exception("the relay's fast path failed on %s", self.outcome.request_id.decode())
            if not self._over:
                self.hand_over()

    def _lost_connecting(self) -> None:
        """The client's connection is gone while the upstream's is opened: nothing is sent (an
        engine that cannot see a client leave would answer it for nobody), and the request is
        recorded as one whose client left before its response began (499), as the task path
        records one."""
        if self._connecting is not None:
            self._connecting.cancel()
        self._over = self._released = True
        self.client.ended()
        outcome = self.outcome
        outcome.client_gone = True
        try:
            self.body.drop()
            self.ticket.release(outcome.started)
        finally:
            self.leave()
        self.relay.record(self.scope, outcome)

    def _hand_over_unsent(self) -> None:
        self._over = True
        self.client.ended()
        self.client.run(self._resume)

    def start(self, conn: Connection, head: bytes) -> None:
        """Send the request on ``conn``; the upstream's callback does the rest."""
        outcome = self.outcome
        self.conn = conn
        self.sent = True
        self.head = head
        outcome.peer, outcome.conn = self.peer, conn
        conn.listener = self.on_upstream
        self.client.lost = self.client_lost
        conn.send(head, self.body.data)
        outcome.sent_at = perf_counter()
        self.relay.drain.active.add(conn)
        if self._head_timeout_s > WATCH_AFTER_S:
            # One timer while the answer is quicker than the watch's start (nearly always):
            # the watch's, which arms the head's deadline for the time left.
            self._watch_timer = conn.timers.later(WATCH_AFTER_S, self._watch)
        else:
            self._timer = conn.head_deadline(self._head_timeout_s)
            self._watch_timer = conn.timers.later(WATCH_AFTER_S, self.client.watch)

    def _watch(self) -> None:
        """When the task path starts watching the client: its reading resumed, its close seen;
        and the head's deadline, for the time left."""
        self._watch_timer = None
        self.client.watch()
        if not self._over:
            self._timer = self.conn.head_deadline(self._head_timeout_s, WATCH_AFTER_S)

    def client_lost(self) -> None:
        """The client's connection is gone: the upstream is closed now, the rest handed over."""
        self.conn.client_gone()  # its callback hands the exchange over
        self.hand_over()

    def on_upstream(self) -> None:
        """The upstream's head, its end or an error came (or the connection closed)."""
        try:
            self._on_upstream()
        except Exception:
            # Logged; the task path then answers (or, past the answer's start, the client's
            # connection is closed), and what the request held is given back.
            log.exception("the relay's fast path failed on %s", self.outcome.request_id.decode())
            if not self._over:
                self.hand_over()
            elif not self._released:
                self.client.close()
                self.conn.close()
                self._release()

    def _on_upstream(self) -> None:
        conn = self.conn
        if conn.error is None and not conn.whole:
            if conn.status:
                self.hand_over()  # a head whose body is still coming: relayed as it comes
            return
        status = conn.status
        if (
            conn.error is not None
            or not 200 <= status < 300
            or status == 204
            or conn.content_length is None
            or is_event_stream_type(conn.content_type)
            or conn.buffered > MAX_BODY_BYTES
        ):
            self.hand_over()
            return
        self._end_callbacks()
        self._answer(conn, status)

    def _answer(self, conn: Connection, status: int) -> None:
        """Write the whole response to the client, as ``Exchange._respond`` and ``relay_body`` would."""
        outcome = self.outcome
        head_at = perf_counter()
        started, sent_at = outcome.started, outcome.sent_at
        self.body.drop()
        outcome.head_s = head_at - started
        outcome.status = status
        headers = filter_response_headers(conn.headers)
        headers.append((b"x-request-id", outcome.request_id))
        outcome.own_s = sent_at - started + perf_counter() - head_at
        headers.append(timing_header(outcome.own_s, head_at - sent_at))
        headers.append((b"content-length", conn.content_length))  # type: ignore[arg-type]
        data = conn.take_body()
        out = self.client.writer()
        try:
            out.start(status, headers)
            outcome.tail = usage_tail(b"", data)
            out.write(data, False)
            outcome.bytes_out += len(data)
        except ClientGone as exc:
            outcome.client_gone = True
            if exc.nothing_sent:
                outcome.status = 499
        self._release()
        self.relay.record(self.scope, outcome)

    def _release(self) -> None:
        """What the request held, given back: what ``Exchange._exchange``'s and ``Relay.__call__``'s
        ends do."""
        conn, outcome = self.conn, self.outcome
        self._released = True
        try:
            self.relay.drain.active.discard(conn)
            outcome.conn = None
            self.peer.pool.release(conn)
            self.body.drop()
            self.ticket.release(outcome.started)
        finally:
            self.leave()

    def hand_over(self) -> None:
        """Go on in a task, from where the exchange stands (``Relay.resume``)."""
        if self._over:
            return  # answered or handed over already
        self._end_callbacks()
        self.client.run(self._resume)

    async def _resume(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.relay.resume(self, scope, receive, send)

    def _end_callbacks(self) -> None:
        self._over = True
        self.conn.listener = None
        timers = self.conn.timers
        if self._timer is not None:
            delay_s = self._head_timeout_s
            timers.cancel(delay_s - WATCH_AFTER_S if delay_s > WATCH_AFTER_S else delay_s, self._timer)
            self._timer = None
        if self._watch_timer is not None:
            timers.cancel(WATCH_AFTER_S, self._watch_timer)
            self._watch_timer = None
        self.client.ended()
