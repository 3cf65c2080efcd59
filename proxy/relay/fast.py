"""The relay's common case run from the protocols' callbacks: no task, no ASGI message, no coroutine.

A request that came whole in its read, to a model of one server, asking for
no stream, no translation and nothing the gateway changes in its body, with
a slot free and an idle connection pooled, is sent upstream from the client
protocol's own callback (``proxy/protocol.py``). When the upstream's
response has come whole with its head (a 2xx with a Content-Length, not an
event stream, at most ``MAX_BODY_BYTES``), the upstream connection's
callback writes its head and body to the client in one write and records
the request.

Anything else hands the exchange to the code that serves every other
request, from where it stands (``Relay.resume``, a task like any other
request's): an upstream error, a close or an abort (a drain, a cancel from
the status page, the head's deadline, the client's connection lost, which
closes the upstream at once), a head whose body is still coming, or a
response of another kind. Nothing is
written to the client before that hand-over, so the code that takes over
answers as it would have from the start. What the fast path checks before
sending is the same code the other path runs (``check_head``,
``Relay._parse``, ``Ticket.take``, ``Exchange.request_head``); any refusal
there leaves the request to the other path, which refuses it in its own
words.
"""

from __future__ import annotations

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
from proxy.upstream import ClientGone, Connection

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
        "_head_timeout_s",
        "_over",
        "_released",
        "_timer",
        "_watch_timer",
        "body",
        "client",
        "conn",
        "head",
        "leave",
        "outcome",
        "peer",
        "relay",
        "scope",
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
        conn: Connection,
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
        self.conn = conn
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

    def start(self, head: bytes) -> None:
        """Send the request; the upstream's callback does the rest."""
        conn, outcome = self.conn, self.outcome
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
