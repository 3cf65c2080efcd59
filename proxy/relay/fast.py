"""The relay's common case run from the protocols' callbacks: no task, no ASGI message, no coroutine.

A request that came whole in its read, to a model of one server, asking for
no translation and nothing the gateway changes in its body (and for no
stream, but from the lean protocol, whose client takes streams), with a
slot free, is sent upstream from the client protocol's own callback
(``proxy/protocol.py``, ``proxy/lean.py``) on an idle pooled connection; where
none is pooled (a burst's first requests), on one it opens (a future for the
connect alone: its callback sends the request). A connect that fails is
answered by the task path as that failure, without a second attempt. When the upstream's
response has come whole with its head (a 2xx with a Content-Length, not an
event stream, at most ``MAX_BODY_BYTES``), the upstream connection's
callback writes its head and body to the client in one write and records
the request. A stream's 2xx event stream (no content coding) is relayed
from the same callback as its reads come (``_start_stream``, ``_relay``),
by ``relay_events``' rules (``proxy/relay/sse.py``'s ``EventStream``), its
client's backpressure holding the upstream, and is recorded at its end.

Anything else hands the exchange to the code that serves every other
request, from where it stands (``Relay.resume``, a task like any other
request's): an upstream error, a close or an abort (a drain, a cancel from
the status page, the head's deadline, the client's connection lost, which
closes the upstream at once), a non-stream head whose body is still
coming, a response of another kind, or a stream's head not come by the
first heartbeat's time. Once a stream's head is out, nothing is handed
over: the callbacks end it, whatever ends it. A client that leaves while the connection is
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
from typing import TYPE_CHECKING, Final, cast

from mypy_extensions import mypyc_attr

from proxy.asgi import Receive, Scope, Send
from proxy.headers import add_sse_headers, filter_response_headers, is_event_stream_type, response_lines
from proxy.protocol import FastClient, StreamClient
from proxy.relay.body import usage_tail
from proxy.relay.outcome import Outcome
from proxy.relay.request import RequestBody
from proxy.relay.routes import Peer
from proxy.relay.sse import EventStream
from proxy.relay.ticket import Ticket
from proxy.relay.timing import TIMING, timing_header
from proxy.upstream import Connection
from proxy.upstream_errors import ClientGone, UpstreamError

if TYPE_CHECKING:
    from proxy.relay.handler import Relay

log: Final = logging.getLogger("blazar.relay")

# When the task path starts watching the client (``proxy/relay/watch.py``'s ``_WATCH_AFTER_S``).
WATCH_AFTER_S: Final = 0.05
# The largest body written from a callback in one write; a larger one goes through the task.
MAX_BODY_BYTES: Final = 64 * 1024


# Made for each request: a freed one is kept for the next (compiled).
@mypyc_attr(free_list_len=1)
class FastExchange:
    """One request's exchange with its upstream, driven by the upstream connection's callback."""

    # What changes as the exchange goes, at its start: on the class, so that a new exchange sets
    # only what it is given.
    # ``conn`` is set when the request is sent on it (``start``).
    conn: Connection
    sent = False
    head = b""
    _connecting: asyncio.Future[Connection] | None = None
    # Why the connection this exchange opened could not be (the task path answers so).
    connect_failure: UpstreamError | None = None
    # The head's deadline, as ``Connection.read_head`` keeps it on the other path, and the watch's start.
    _timer: int | None = None
    _watch_timer: int | None = None
    # A stream's head not come by the first heartbeat's time: the task path sends them.
    _beat_timer: int | None = None
    # A stream relayed from the callbacks (``_start_stream``): its events' state, and the
    # deadline of a client that takes no bytes.
    _events: EventStream | None = None
    _stall_timer: asyncio.TimerHandle | None = None
    # No longer the callbacks': answered, or handed to a task.
    _over = False
    # What the request held is given back.
    _released = False

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
        # Told once the request has ended (the gateway's count of requests in flight).
        self.leave = leave
        self._head_timeout_s = head_timeout_s

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
        and the head's deadline, for the time left. A stream's head not come by the first
        heartbeat's time is handed over then: the task path sends the heartbeats."""
        self._watch_timer = None
        self.client.watch()
        if self._over:
            return
        heartbeat_s = self.relay.heartbeat_s
        if self.outcome.stream and heartbeat_s:
            if heartbeat_s <= WATCH_AFTER_S:
                self.hand_over()
                return
            self._beat_timer = self.conn.timers.later(heartbeat_s - WATCH_AFTER_S, self.hand_over)
        self._timer = self.conn.head_deadline(self._head_timeout_s, WATCH_AFTER_S)

    def client_lost(self) -> None:
        """The client's connection is gone: the upstream is closed now, the rest handed over
        (a stream under way ends here: its client had its 200)."""
        if self._events is not None:
            if not self._over:
                self.outcome.client_gone = True
                self.conn.listener = None
                self.conn.client_gone()
                self._stream_over(None)
            return
        self.conn.client_gone()  # its callback hands the exchange over
        self.hand_over()

    def on_upstream(self) -> None:
        """The upstream's head, its end or an error came (or the connection closed)."""
        try:
            if self._events is not None:
                self._relay()
                return
            conn = self.conn
            if self.outcome.stream:
                if conn.error is None and conn.status:
                    if self.client.streams and _relayed_here(conn):
                        self._start_stream(conn)
                    else:
                        self.hand_over()  # an error's answer, or a head the task path refuses
                elif conn.error is not None:
                    self.hand_over()
                return
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
        except Exception:
            self._failed()

    def _failed(self) -> None:
        """A callback raised: logged; the task path then answers (or, past the answer's start,
        both connections are closed), and what the request held is given back."""
        log.exception("the relay's fast path failed on %s", self.outcome.request_id.decode())
        if not self._over and self._events is None:
            self.hand_over()
        elif not self._released:
            # Past the answer's start: the request recorded as it stands, whatever the closes do.
            try:
                self.client.close()
                self.conn.close()
            finally:
                self._stream_over(self.outcome.error)

    def _answer(self, conn: Connection, status: int) -> None:
        """Write the whole response to the client, as ``Exchange._respond`` and ``relay_body`` would."""
        outcome = self.outcome
        head_at = perf_counter()
        started, sent_at = outcome.started, outcome.sent_at
        self.body.drop()
        outcome.head_s = head_at - started
        outcome.status = status
        lines = response_lines(conn.headers)
        outcome.own_s = own_s = sent_at - started + perf_counter() - head_at
        # The layout ``respond`` takes: name, ": ", value, CRLF a field.
        # A 2xx answered here has a Content-Length (``on_upstream``).
        lines += (  # type: ignore[arg-type]
            b"x-request-id",
            b": ",
            outcome.request_id,
            b"\r\n",
            b"server-timing",
            b": ",
            TIMING % (own_s * 1000, (head_at - sent_at) * 1000),
            b"\r\n",
            b"content-length",
            b": ",
            conn.content_length,
            b"\r\n",
        )
        data = conn.take_body()
        try:
            outcome.tail = usage_tail(b"", data)
            self.client.writer().respond(status, lines, data)
            outcome.bytes_out += len(data)
        except ClientGone as exc:
            outcome.client_gone = True
            if exc.nothing_sent:
                outcome.status = 499
        self._release()
        self.relay.record(self.scope, outcome)

    def _start_stream(self, conn: Connection) -> None:
        """The upstream's event stream has begun: its head goes out, its events follow as they
        come, from this connection's callback, as ``Exchange._respond`` and ``relay_events``
        would relay them."""
        self._cancel_head_timers()
        client = cast(StreamClient, self.client)
        outcome = self.outcome
        head_at = perf_counter()
        started, sent_at = outcome.started, outcome.sent_at
        self.body.drop()
        outcome.head_s = head_at - started
        outcome.status = status = conn.status
        headers = add_sse_headers(filter_response_headers(conn.headers))
        headers.append((b"x-request-id", outcome.request_id))
        outcome.own_s = sent_at - started + perf_counter() - head_at
        headers.append(timing_header(outcome.own_s, head_at - sent_at))
        self._events = EventStream(outcome)
        client.writable = self._writable
        try:
            client.writer().start(status, headers, chunked=True)
        except Exception:
            self._events = None  # nothing written: the task path answers (a head uvicorn refuses)
            raise
        conn.listen_body(self.relay.read_timeout_s)
        # Read the client again (a pipelined head may have paused it): its close is seen.
        client.watch()
        self._relay()

    def _relay(self) -> None:
        """What came of the stream since the last call: its events relayed, its end vouched for
        (``relay_events``' rules), an upstream error told as its API's error event."""
        conn, outcome = self.conn, self.outcome
        events = self._events
        assert events is not None
        out = cast(StreamClient, self.client).writer()
        try:
            data = conn.take_body()
            if data:
                chunk = events.cut(data)
                if chunk:
                    events.wrote(chunk)
                    # Counted once handed on: a write to a client that has gone raises ClientGone.
                    if conn.whole and not conn.close_delimited and not events.pending and events.ended():
                        outcome.tail = usage_tail(events.prev, chunk)
                        out.write(chunk, False)
                        outcome.bytes_out += len(chunk)
                        self._stream_over(None)
                        return
                    out.write(chunk, True)
                    outcome.bytes_out += len(chunk)
                    outcome.sends += 1
            error = conn.error
            if isinstance(error, UpstreamError):
                conn.close()
                event = outcome.endpoint.envelope.event(error.status, error.message, error.code)
                out.write(event, False)
                outcome.bytes_out += len(event)
                self._stream_over(error.code)
                return
            if error is not None:
                raise ClientGone()
            if conn.whole:
                if not events.ended():
                    # Without its end, the engine crashed or cut the stream: the client must know.
                    event = events.truncated()
                    out.write(event, False)
                    outcome.bytes_out += len(event)
                    self._stream_over("upstream_truncated")
                    return
                outcome.tail = usage_tail(events.prev, events.last)
                # Half an event after the end: the client gets it as sent, and it counts.
                out.write(events.pending, False)
                outcome.bytes_out += len(events.pending)
                self._stream_over(None)
                return
            # The head alone, while nothing of the body is here (a prefill, half an event).
            out.flush()
            if out.write_paused:
                self._hold()
        except ClientGone as exc:
            outcome.client_gone = True
            if exc.nothing_sent:
                outcome.status = 499
            conn.listener = None
            conn.close()  # an engine that keeps generating for nobody must stop
            self._stream_over(outcome.error)

    def _hold(self) -> None:
        """The client takes no more bytes for now: the upstream is not read until it does, and
        one that takes none for ``send_stall_s`` is cut (``StallWatch``'s rule)."""
        self.conn.hold(True)
        stall_s = self.relay.send_stall_s
        if stall_s and self._stall_timer is None:
            self._stall_timer = self.conn.loop.call_later(stall_s, self._stalled)

    def _writable(self) -> None:
        """The client takes bytes again: read the upstream again."""
        if self._over:
            return
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        try:
            self.conn.hold(False)
        except Exception:
            self._failed()

    def _stalled(self) -> None:
        self._stall_timer = None
        if self._over:
            return
        outcome = self.outcome
        outcome.stalled = True
        outcome.status = 499
        outcome.error = "client_stalled"
        log.warning(
            "client took nothing for %g s: closing its response and the upstream", self.relay.send_stall_s
        )
        try:
            self.conn.listener = None
            self.conn.close()
            cast(StreamClient, self.client).abort()  # a close would wait for the bytes it does not take
        except Exception:
            self._failed()
            return
        self._stream_over("client_stalled")

    def _stream_over(self, error: str | None) -> None:
        """The stream has ended (or its client has, or the answer failed past its start): what it
        held given back, and its record."""
        outcome = self.outcome
        outcome.error = error
        self._over = True
        self.conn.listener = None
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        self.client.ended()
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
        """Go on in a task, from where the exchange stands (``Relay.resume``): before anything
        was written to the client."""
        if self._over or self._events is not None:
            return  # answered, handed over, or a stream under way already
        self._end_callbacks()
        self.client.run(self._resume)

    async def _resume(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.relay.resume(self, scope, receive, send)

    def _end_callbacks(self) -> None:
        self._over = True
        self.conn.listener = None
        self._cancel_head_timers()
        self.client.ended()

    def _cancel_head_timers(self) -> None:
        timers = self.conn.timers
        if self._timer is not None:
            delay_s = self._head_timeout_s
            timers.cancel(delay_s - WATCH_AFTER_S if delay_s > WATCH_AFTER_S else delay_s, self._timer)
            self._timer = None
        if self._watch_timer is not None:
            timers.cancel(WATCH_AFTER_S, self._watch_timer)
            self._watch_timer = None
        if self._beat_timer is not None:
            timers.cancel(self.relay.heartbeat_s - WATCH_AFTER_S, self._beat_timer)
            self._beat_timer = None


def _relayed_here(conn: Connection) -> bool:
    """Whether a stream's answer is relayed from the callbacks: a 2xx event stream in no coding
    (anything else is the task path's to answer, as it answers it)."""
    status = conn.status
    return (
        200 <= status < 300
        and status != 204
        and is_event_stream_type(conn.content_type)
        and conn.content_encoding is None
    )
