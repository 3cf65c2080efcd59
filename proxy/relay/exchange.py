"""The exchange with the upstream: send the request, await the head, relay the response.

No retry once the request is written (the upstream may have acted on it),
but for a pooled connection that the upstream closed without a byte of
answer (``_exchange``); the connection goes back to its pool, or is closed, in one ``finally``.
Errors before the response starts are OpenAI JSON; after a stream has
started, one SSE ``data: {"error": ...}`` event ends it; after a non-stream
body has started, the client's connection is cut before its declared end.
"""

from __future__ import annotations

import asyncio
from time import perf_counter
from typing import Final

from proxy.asgi import Receive, Scope, Send, send_error, send_json
from proxy.auth import CREDENTIAL_HEADERS
from proxy.errors import HTTPError, echo
from proxy.forwarded import ProxyTrust
from proxy.headers import (
    POST_HEAD,
    add_sse_headers,
    filter_response_headers,
    forward_request_headers,
    is_event_stream_type,
    request_drop,
    request_head,
)
from proxy.relay.body import relay_body
from proxy.relay.built import respond_built
from proxy.relay.drain import Drain
from proxy.relay.failures import KEPT_ON_ERRORS, read_error_body, send_upstream_error
from proxy.relay.heartbeat import await_head_with_heartbeats, continue_stream, started_stream_error
from proxy.relay.out import writer_for
from proxy.relay.outcome import Outcome
from proxy.relay.request import RequestBody
from proxy.relay.routes import Peer
from proxy.relay.settings import RelaySettings
from proxy.relay.sse import relay_events
from proxy.relay.timing import server_timing, timing_header
from proxy.relay.translated import respond_translated
from proxy.relay.watch import ClientWatch, arm_guards
from proxy.upstream import Connection
from proxy.upstream_errors import (
    Cancelled,
    ClientGone,
    ConnectFailed,
    Draining,
    EmptyReply,
    EngineExited,
    UpstreamError,
)


def _chat_stream(conn: Connection) -> bool:
    """Whether the upstream's head starts the chat stream a translated request asked for."""
    return conn.status == 200 and is_event_stream_type(conn.content_type) and conn.content_encoding is None


class Exchange:
    """How the relay talks to upstreams: its timeouts and header rules, resolved once."""

    def __init__(self, settings: RelaySettings, drain: Drain) -> None:
        self._drain = drain
        self._head_timeout_s = settings.first_byte_timeout_s
        self._read_timeout_s = settings.read_timeout_s
        self._heartbeat_s = settings.heartbeat_s
        self._total_timeout_s = settings.total_timeout_s
        self._send_stall_s = settings.send_stall_s
        self._trust = ProxyTrust(settings.forwarded_allow_ips)
        self._request_drop = self.request_drop = request_drop(
            CREDENTIAL_HEADERS if settings.strip_credentials else frozenset()
        )

    async def run(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        peer: Peer,
        body: RequestBody,
        outcome: Outcome,
        *,
        may_move: bool = False,
        failed: UpstreamError | None = None,
    ) -> ConnectFailed | None:
        """Send ``body`` to ``peer`` and relay its answer; ``outcome`` says how it went.

        Once the upstream has answered (it has read the request), the body is
        dropped: a long generation does not hold it, nor its budget.

        With ``may_move`` (a peer of several), a connection that could not be
        opened is returned unanswered: nothing was sent, so the caller may
        send the request to another peer. Otherwise None: the client is answered.
        ``failed``: the connect failure of an attempt made already (the fast path's), as
        if this one had failed so.
        """
        head = self.request_head(scope, peer, len(body.data), outcome.request_id)
        conn = await self._open(send, peer, outcome, may_move, failed=failed)
        if not isinstance(conn, Connection):
            return conn
        if "blazar.gone" in (scope.get("extensions") or ()):
            # The client left while the connection opened: nothing is sent (an engine that cannot
            # see a client leave would answer it for nobody); recorded as 499.
            peer.pool.unused(conn)
            outcome.client_gone = True
            return None
        await self.resume(conn, head, scope, receive, send, peer, body, outcome, sent=False)
        return None

    async def resume(
        self,
        conn: Connection,
        head: bytes,
        scope: Scope,
        receive: Receive,
        send: Send,
        peer: Peer,
        body: RequestBody,
        outcome: Outcome,
        *,
        sent: bool,
    ) -> None:
        """The exchange on ``conn``, from its send (``sent``: from just after it, for an exchange
        begun from callbacks, ``proxy/relay/fast.py``), to the client's answer."""
        resend = await self._exchange(
            conn, head, scope, receive, send, peer, body, outcome, may_resend=True, sent=sent
        )
        if resend:
            fresh = await self._open(send, peer, outcome, False, fresh=True)
            if isinstance(fresh, Connection):
                await self._exchange(fresh, head, scope, receive, send, peer, body, outcome, may_resend=False)

    async def _exchange(
        self,
        conn: Connection,
        head: bytes,
        scope: Scope,
        receive: Receive,
        send: Send,
        peer: Peer,
        body: RequestBody,
        outcome: Outcome,
        *,
        may_resend: bool,
        sent: bool = False,
    ) -> bool:
        """One request on ``conn``; True when it must be sent again on a new connection.

        No retry once the request is written (the upstream may have acted on
        it), but for one case: a pooled connection that the upstream closed
        without a byte of answer. An upstream may close a connection it had
        kept alive just as it is taken from the pool (llama-server does after
        every stream, though its head said keep-alive): a request that waited
        in the queue takes it in the same instant, before the close is seen.
        Such a close comes back at once (``_STALE_CLOSE_S``): nothing was
        read, so nothing was acted on, and browsers send such a request again
        too. An upstream that closed later may have taken the request and
        worked on it, and a new connection has no excuse: their empty reply
        is the upstream's answer (502), never sent twice.
        """
        drain, pool, health = self._drain, peer.pool, peer.health
        resend = False
        outcome.peer, outcome.conn = peer, conn
        if not sent:
            conn.send(head, body.data)
            outcome.sent_at = perf_counter()
        guards, arm_stall_watch = arm_guards(conn, outcome, scope, self._total_timeout_s, self._send_stall_s)
        watch = ClientWatch(receive, conn, arm_stall_watch)
        drain.active.add(conn)
        try:
            try:
                if self._heartbeat_s and outcome.stream:
                    await await_head_with_heartbeats(
                        conn, send, outcome, self._heartbeat_s, self._head_timeout_s
                    )
                else:
                    await conn.read_head(self._head_timeout_s)
            except UpstreamError as exc:
                if may_resend and _closed_when_reused(conn, exc, outcome.sent_at) and not outcome.sse_started:
                    conn.close()
                    resend = True
                else:
                    body.drop()
                    exc = _exited(peer, exc)
                    if health is not None and exc.status >= 500 and not isinstance(exc, Cancelled):
                        # Suspect only: the request's own content may be the cause (its probe decides).
                        health.answered(exc.status, peer.targets[scope["path"]])
                    await self._head_failed(conn, send, outcome, exc)
            else:
                body.drop()
                if health is not None and conn.status >= 500:
                    health.answered(conn.status, peer.targets[scope["path"]])
                await self._respond(conn, scope, send, outcome)
        except ClientGone as exc:
            outcome.client_gone = True
            if exc.nothing_sent:
                # Its connection closed (a half-close closes it) before any byte went out.
                outcome.status = 499
        except asyncio.CancelledError:
            if not outcome.stalled:
                raise
            # Our own watchdog cancelled a send the client never took (and
            # aborted that client's connection).
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            outcome.status, outcome.error = 499, "client_stalled"
        finally:
            for guard in guards:
                guard.cancel()
            drain.active.discard(conn)
            outcome.conn = None
            gone = watch.stop()
            if gone:
                conn.close()
            else:
                pool.release(conn)
        return resend and not gone

    async def _open(
        self,
        send: Send,
        peer: Peer,
        outcome: Outcome,
        may_move: bool,
        *,
        fresh: bool = False,
        failed: UpstreamError | None = None,
    ) -> Connection | ConnectFailed | None:
        """A connection to ``peer``; else the client is answered (None), or, with ``may_move``,
        the connect failure is returned for the caller to try another peer."""
        drain = self._drain
        if drain.closing:
            # The drain is over: nothing new starts.
            await self._refuse(send, outcome, Draining("the gateway is shutting down"))
            return None
        try:
            if failed is not None:
                raise failed
            conn = await (peer.pool.connect() if fresh else peer.pool.acquire())
        except UpstreamError as exc:
            if peer.health is not None and isinstance(exc, ConnectFailed):
                peer.health.connect_failed(str(exc))
                if may_move:
                    return exc
            await self._refuse(send, outcome, exc)
            return None
        if drain.closing:
            # The drain ended while this connection was being opened: send nothing.
            peer.pool.release(conn)
            await self._refuse(send, outcome, Draining("the gateway is shutting down"))
            return None
        return conn

    def request_head(
        self, scope: Scope, peer: Peer, length: int, request_id: bytes, forward: list[bytes] | None = None
    ) -> bytes:
        """The head sent upstream: the client's headers that may cross, and the gateway's own;
        ``forward``: those fields' lines, from ``HeadFields``' walk (None: read from the scope)."""
        if forward is not None:
            return POST_HEAD % (
                peer.targets[scope["path"]],
                peer.host_header,
                length,
                b"".join(forward),
                request_id,
                self._trust.x_forwarded_for(scope),
            )
        headers = forward_request_headers(scope["headers"], self._request_drop)
        headers.append((b"x-request-id", request_id))
        headers.append((b"x-forwarded-for", self._trust.x_forwarded_for(scope)))
        # The target is the endpoint's, without the client's query: the OpenAI endpoints
        # take none, and mlx_lm.server answers 404 to a path with one (openai.AzureOpenAI
        # adds ?api-version= to every request). Unlike nginx's proxy_pass, which is
        # transparent to paths, the gateway serves fixed endpoints and writes the target.
        return request_head(b"POST", peer.targets[scope["path"]], peer.host_header, headers, length)

    async def refuse(self, send: Send, outcome: Outcome, exc: UpstreamError) -> None:
        """Answer for an exchange that could not begin on any peer."""
        await self._refuse(send, outcome, exc)

    async def _refuse(self, send: Send, outcome: Outcome, exc: UpstreamError) -> None:
        """Answer for an exchange that could not begin (no connection, or the drain is over)."""
        outcome.failed(exc)
        outcome.bytes_out = await send_upstream_error(
            send, outcome.endpoint.envelope, exc, outcome.request_id, server_timing(outcome.started)
        )

    async def _head_failed(self, conn: Connection, send: Send, outcome: Outcome, exc: UpstreamError) -> None:
        """No usable head came (a timeout, a close, garbage): tell the client, as an event once streaming."""
        conn.close()
        outcome.failed(exc)
        if outcome.sse_started:
            event = started_stream_error(outcome, exc.status, exc.message, exc.code)
            outcome.bytes_out += len(event)  # after the heartbeats'
            await send({"type": "http.response.body", "body": event})
        else:
            timing = server_timing(outcome.started, outcome.sent_at, perf_counter())
            outcome.bytes_out = await send_upstream_error(
                send, outcome.endpoint.envelope, exc, outcome.request_id, timing
            )

    async def _respond(self, conn: Connection, scope: Scope, send: Send, outcome: Outcome) -> None:
        """The upstream's head is in: answer with it, or with what is wrong with it."""
        head_at = perf_counter()
        started, sent_at = outcome.started, outcome.sent_at
        status = conn.status
        outcome.head_s = head_at - started
        if outcome.sse_started:
            # The client's first byte was the gateway's own heartbeat; the
            # gateway's own time is still everything but the upstream's wait.
            outcome.own_s = sent_at - started + perf_counter() - head_at
            if outcome.translator is not None and _chat_stream(conn):
                await respond_translated(
                    conn, scope, send, outcome, head_at, self._read_timeout_s, self._heartbeat_s
                )
            else:
                await continue_stream(conn, send, status, outcome, self._read_timeout_s)
            return
        outcome.status = status
        if not 200 <= status <= 599:
            conn.close()
            await self._bad_response(send, outcome, head_at, f"upstream answered with status {status}")
            return
        headers = filter_response_headers(conn.headers)
        sse = is_event_stream_type(conn.content_type)
        if outcome.translator is not None and status < 400:
            if _chat_stream(conn):
                outcome.own_s = sent_at - started + perf_counter() - head_at
                await respond_translated(
                    conn, scope, send, outcome, head_at, self._read_timeout_s, self._heartbeat_s
                )
            else:
                conn.close()
                kind = echo((conn.content_type or b"no content type").decode("latin-1"))
                message = f"upstream answered the chat completion it was sent with {status} {kind}"
                await self._bad_response(send, outcome, head_at, message)
            return
        if outcome.built is not None and status == 200 and sse:
            if conn.content_encoding is not None:
                conn.close()
                message = (
                    "upstream sent its event stream with Content-Encoding "
                    f"{echo(conn.content_encoding.decode('latin-1'))}, which the gateway "
                    "does not decode to build the reply"
                )
                await self._bad_response(send, outcome, head_at, message)
                return
            await respond_built(conn, send, outcome, head_at, self._read_timeout_s)
            return
        if outcome.stream and 200 <= status < 300 and not sse:
            # The client waits for events and would see a clean end of none.
            conn.close()
            media = next((v for n, v in headers if n == b"content-type"), b"no content type")
            given = echo(media.decode("latin-1"))
            message = f"upstream answered a stream request with {given}, not an event stream"
            await self._bad_response(send, outcome, head_at, message)
            return
        if status >= 400 and (not sse or outcome.translator is not None):
            # (A translated request's error is never relayed as the engine's events: its client
            # speaks another API.)
            envelope = outcome.endpoint.envelope
            # The upstream's head came: the same ttfb and overhead a relayed success has.
            outcome.own_s = sent_at - started + perf_counter() - head_at
            try:
                body = await read_error_body(conn, envelope, self._read_timeout_s)
            except UpstreamError as exc:
                # The error body broke or timed out: say that, with its own status.
                conn.close()
                outcome.failed(exc)
                outcome.own_s = None  # the gateway's own answer, as for a head that failed
                status, body = exc.status, envelope.body(exc)
            kept = [(n, v) for n, v in headers if n in KEPT_ON_ERRORS]
            timing = server_timing(started, sent_at, perf_counter())
            outcome.bytes_out = len(body)
            await send_json(send, status, body, [(b"x-request-id", outcome.request_id), timing, *kept])
            return
        if sse:
            headers = add_sse_headers(headers)
        headers.append((b"x-request-id", outcome.request_id))
        # The gateway's own time, computed once: for the header and the metrics.
        outcome.own_s = sent_at - started + perf_counter() - head_at
        headers.append(timing_header(outcome.own_s, head_at - sent_at))
        # An event stream goes out chunked whatever its framing upstream, so that one cut
        # short can still end with an error event (a sized body could only be cut).
        length = None if sse or conn.close_delimited or status in (204, 304) else conn.content_length
        if length is not None:
            headers.append((b"content-length", length))
        out = writer_for(scope, send)
        out.start(status, headers)
        if sse and conn.content_encoding is None:
            outcome.error = await relay_events(conn, out, outcome, self._read_timeout_s)
        else:
            # A coded event stream (gzip...) is relayed as it came, its Content-Encoding
            # with it: its events cannot be read, so no [DONE] is vouched for and no
            # error event added; it goes out chunked, cut short if its upstream breaks.
            outcome.error = await relay_body(conn, out, outcome, self._read_timeout_s)

    async def _bad_response(self, send: Send, outcome: Outcome, head_at: float, message: str) -> None:
        """502 upstream_bad_response: a head the client cannot be given."""
        outcome.status, outcome.error = 502, "upstream_bad_response"
        error = HTTPError(502, message, code="upstream_bad_response")
        timing = server_timing(outcome.started, outcome.sent_at, head_at)
        outcome.bytes_out = await send_error(
            send, outcome.endpoint.envelope, error, [(b"x-request-id", outcome.request_id), timing]
        )


# How soon after the request an empty close means the upstream had closed the
# connection already: a loopback or LAN round trip, far less than any work.
_STALE_CLOSE_S: Final = 0.05


def _closed_when_reused(conn: Connection, exc: UpstreamError, sent_at: float) -> bool:
    """Whether ``exc`` is a pooled connection's close, at once, with no byte of answer (``_exchange``):
    timed when the connection saw it, not when the relay reads it (after a hand-over from the
    callbacks, a busy loop may take longer than ``_STALE_CLOSE_S`` to get there)."""
    return isinstance(exc, EmptyReply) and conn.requests_sent > 1 and exc.at - sent_at < _STALE_CLOSE_S


def _exited(peer: Peer, exc: UpstreamError) -> UpstreamError:
    """``exc``, or, for an empty reply from an engine child that has exited, 503 ``engine_exited``
    with Retry-After: the child is gone, as it is for a connect refused a moment later. Killed or
    stopped as the request came (its kernel resets the connections it had queued, unread), or
    crashed on this request: nothing here tells which, and the code lets the metrics count it.
    A child still running answered it (502)."""
    gate = peer.gate
    if gate is None or not isinstance(exc, EmptyReply) or not gate.exited():
        return exc
    return EngineExited(
        f"the engine's child {gate.name} exited as the request reached it (its connection closed "
        "unanswered): it was stopped or killed as the request came, or crashed on it"
    )
