"""The hot path: one request in, the original bytes out, the response relayed.

Per request and nothing more: read the body once (bounded), find ``model``
with one ``orjson.loads``, pick the route, send the client's bytes with one
Content-Length, relay the response bytes as they arrive, release the upstream
connection in one place. No per-chunk parsing or logging: the only look at
the relayed bytes is a ``[DONE]`` check on the last few bytes of a stream.

Errors before the response starts are OpenAI JSON; after a stream has
started, one SSE ``data: {"error": ...}`` event ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from time import perf_counter
from typing import Any, NamedTuple

import orjson

from proxy.accesslog import AccessLog
from proxy.admission import Admission
from proxy.asgi import Message, Receive, Scope, Send, send_json
from proxy.assembly import AssemblyError, ReplyAssembler
from proxy.auth import CREDENTIAL_HEADERS
from proxy.errors import HTTPError, echo, normalize_error, sse_error_event
from proxy.forwarded import ProxyTrust
from proxy.headers import (
    SSE_HEADERS,
    add_sse_headers,
    filter_response_headers,
    forward_request_headers,
    is_event_stream,
    request_drop,
    request_head,
    valid_request_id,
)
from proxy.metrics import Metrics, ModelMetrics
from proxy.payload import RequestGuards, ask_for_stream, check_request, parse_request
from proxy.routing import Gate, ReplicaGate, Route, RoutingTable, UpstreamAddress
from proxy.upstream import (
    BodyBroken,
    ClientGone,
    Connection,
    Draining,
    HeadTimeout,
    Pool,
    TotalTimeout,
    UpstreamError,
)

log = logging.getLogger("blazar.relay")

# Client path → the endpoint below the upstream's /v1. Paths without /v1 are
# served too: clients often get the base URL wrong.
ENDPOINTS: Mapping[str, bytes] = {
    "/v1/chat/completions": b"/chat/completions",
    "/chat/completions": b"/chat/completions",
    "/v1/completions": b"/completions",
    "/completions": b"/completions",
    "/v1/embeddings": b"/embeddings",
    "/embeddings": b"/embeddings",
}

_ROUTE_LABELS: Mapping[str, str] = {
    path: endpoint.decode().lstrip("/") for path, endpoint in ENDPOINTS.items()
}

# Upstream error bodies are read whole to be normalised, up to this size.
_ERROR_BODY_LIMIT_BYTES = 1024 * 1024
# Enough of a stream's end to hold "data: [DONE]" and its newlines.
_TAIL_BYTES = 32
# Larger reads are handed to the client in slices of this size.
_SLICE_BYTES = 64 * 1024
_HEARTBEAT = b": keepalive\n\n"
# The most of a half-written SSE event held back to wait for its end.
_PARTIAL_EVENT_LIMIT_BYTES = 64 * 1024
# Upstream error headers that clients act on (openai-python reads them all).
_KEPT_ON_ERRORS = frozenset({b"retry-after", b"retry-after-ms", b"x-should-retry", b"www-authenticate"})
_RETRY_AFTER_S = b"2"
# A built reply waits this long after [DONE] for its stream's end (it follows at once).
_AFTER_DONE_S = 1.0
# How long an exchange runs before the client is watched for a disconnect
# (well inside the 1 s in which an abandoned upstream must be closed).
_WATCH_AFTER_S = 0.05

_ACCEPTED_CONTENT_TYPES = frozenset(
    {
        b"application/json",
        # curl -d sends this unless told otherwise; the body is JSON all the same.
        b"application/x-www-form-urlencoded",
    }
)


@dataclass(frozen=True, slots=True)
class RelaySettings:
    max_body_bytes: int = 32 * 1024 * 1024
    head_timeout_s: float = 600.0
    read_timeout_s: float = 300.0
    max_queued: int = 256
    queue_timeout_s: float = 60.0
    # The gateway checks API keys: the client's credentials are for it alone.
    strip_credentials: bool = False
    # A request for a model whose child is starting waits this long for it
    # (0: answer 503 model_loading at once).
    load_wait_s: float = 0.0
    # A stream whose head takes longer than this gets SSE keepalive comments.
    heartbeat_s: float = 15.0
    # A whole exchange may take this long (0: no limit).
    total_timeout_s: float = 0.0
    # A client that takes no bytes for this long while some wait is cut (0: never).
    send_stall_s: float = 120.0
    # Proxies whose X-Forwarded-For is believed (and passed on, with the peer appended).
    forwarded_allow_ips: tuple[str, ...] = ()


class Relay:
    """The relay endpoint, as a pure ASGI application."""

    def __init__(
        self,
        table: RoutingTable,
        settings: RelaySettings,
        metrics: Metrics | None = None,
        access_log: AccessLog | None = None,
        *,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self._settings = settings
        self._connect_timeout_s = connect_timeout_s
        self.pools: dict[UpstreamAddress, Pool] = {}
        self.table = table
        self._built: dict[Route, _RouteEntry] = {}
        self._routes: dict[str, _RouteEntry] = {}
        self._metrics = metrics
        self._access = access_log
        self.update(table)
        if metrics is not None:
            metrics.watch_admission(self._admission_sample)
        self.request_id_of = RequestIds()
        # Upstream connections with a request on them, for a drain to end.
        self.active: set[Connection] = set()
        # Set when a drain's time is over: nothing new may start, and what waits
        # (for a model to load) is answered with ``_ending``.
        self.closing = False
        self._ended = asyncio.Event()
        self._ending: HTTPError | None = None
        self._max_body_bytes = settings.max_body_bytes
        self._head_timeout_s = settings.head_timeout_s
        self._read_timeout_s = settings.read_timeout_s
        self._load_wait_s = settings.load_wait_s
        self._heartbeat_s = settings.heartbeat_s
        self._total_timeout_s = settings.total_timeout_s
        self._send_stall_s = settings.send_stall_s
        self._trust = ProxyTrust(settings.forwarded_allow_ips)
        self._request_drop = request_drop(CREDENTIAL_HEADERS if settings.strip_credentials else frozenset())

    def update(self, table: RoutingTable) -> None:
        """Serve ``table`` from now on (a configuration reload).

        A route that is unchanged keeps its entry: its admission queue, its
        requests in flight and its pooled connections carry on untouched.
        Requests already past the lookup finish on the entry they found.
        """
        built: dict[Route, _RouteEntry] = {}
        routes: dict[str, _RouteEntry] = {}
        for route in table:
            entry = self._built.get(route) or self._entry(route)
            built[route] = entry
            routes[route.model] = entry
            for alias in route.aliases:
                routes[alias] = entry._replace(rename=route.model)
        wanted = set(table.upstreams())
        for address in list(self.pools):
            if address not in wanted:
                # Requests still on it finish; their connections are closed on release.
                self.pools.pop(address).close()
        self.table, self._built, self._routes = table, built, routes

    def _entry(self, route: Route) -> _RouteEntry:
        replicas = []
        for backend in route.backends:
            pool = self.pools.get(backend.upstream)
            if pool is None:
                pool = self.pools[backend.upstream] = Pool(
                    backend.upstream, connect_timeout_s=self._connect_timeout_s
                )
            targets = {path: backend.upstream.target(endpoint) for path, endpoint in ENDPOINTS.items()}
            replicas.append(_Replica(pool, backend.upstream.host_header, targets, backend.gate))
        return _RouteEntry(
            tuple(replicas),
            route.gate,
            route.guards,
            Admission(
                route.max_in_flight,
                max_queued=self._settings.max_queued,
                queue_timeout_s=self._settings.queue_timeout_s,
            ),
            self._metrics.for_model(route.model) if self._metrics is not None else None,
            None,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = perf_counter()
        request_id = b""
        stats: ModelMetrics | None = None
        model = ""
        entry = None
        entered: Gate | None = None
        try:
            request_id = self.request_id_of(scope)
            if scope["method"] != "POST":
                raise HTTPError(
                    405,
                    f"method {echo(scope['method'])} is not allowed on {echo(scope['path'])}; use POST",
                    code="method_not_allowed",
                    headers=((b"allow", b"POST"),),
                )
            body = await self._read_body(scope, receive)
            # The client's upload time is not the gateway's.
            started = arrived = perf_counter()
            model, doc = parse_request(body)
            entry = self._routes.get(model)
            if entry is None:
                raise HTTPError(
                    404,
                    f"The model `{echo(model)}` does not exist or is not served here; "
                    "GET /v1/models lists the models this gateway serves",
                    param="model",
                    code="model_not_found",
                )
            replicas, gate, guards, admission, stats, rename = entry
            endpoint = ENDPOINTS[scope["path"]]
            rewrite = check_request(doc, endpoint, guards)
            streamed = doc.get("stream") is True
            # An engine that cannot tell that a non-stream client left is asked for a stream.
            built = guards.via_stream and not streamed and ask_for_stream(doc, endpoint, guards)
            rewrite = rewrite or built
            if gate is not None:
                if not gate.ready:
                    admission.wait_for_load(model)
                    try:
                        ready = await self._wait_for_model(gate, receive)
                    finally:
                        admission.loading -= 1
                    if not ready:
                        raise _loading(gate.not_ready_reason())
                    # Starting the model, or waiting for it, is not the gateway's own time.
                    started = perf_counter()
                # In use from here, queued or not: never unloaded under this request.
                gate.enter()
                entered = gate
            if not admission.try_enter():
                if self._ending is not None:
                    raise self._ending  # the drain is over: no new place in the queue
                queued_at = perf_counter()
                await _wait_for_slot(admission, model, receive)
                if stats is not None:
                    stats.queue_time.observe(perf_counter() - queued_at)
                # Waiting for a slot is not the gateway's own time either.
                started = perf_counter()
                if gate is not None and not gate.ready:
                    # Its children went away while this request was queued.
                    admission.leave()
                    raise _loading(gate.not_ready_reason())
            replica = replicas[0] if len(replicas) == 1 else _least_busy(replicas)
            if replica is None:
                # No replica is ready (only a model with several can get here).
                admission.leave()
                assert gate is not None
                raise _loading(gate.not_ready_reason())
            if rename is not None:
                # An alias: the upstream knows the model by its own name only.
                doc["model"] = rename
                rewrite = True
            if rewrite:
                # The one case besides aliases where the body is not the client's bytes.
                body = orjson.dumps(doc)
        except HTTPError as exc:
            if entered is not None:
                entered.leave()
            headers = [(b"x-request-id", request_id), server_timing(started), *exc.headers]
            await send_json(send, exc.status, exc.body(), headers)
            if stats is not None:
                stats.count(_ROUTE_LABELS[scope["path"]], exc.status)
            if self._access is not None:
                self._access.write(
                    scope,
                    request_id=request_id,
                    model=model if entry is not None else "",
                    status=exc.status,
                    bytes_out=0,
                    duration_s=perf_counter() - started,
                    ttfb_s=None,
                    overhead_s=None,
                )
            return
        except ClientGone:
            if entered is not None:
                entered.leave()
            if self._metrics is not None:
                self._metrics.client_disconnects += 1
            return
        except BaseException:
            if entered is not None:
                entered.leave()
            raise
        # From here on this request holds a slot (and its model); both are given back below, on every path.
        replica.in_flight += 1
        replica.served += 1
        try:
            headers = forward_request_headers(scope["headers"], self._request_drop)
            headers.append((b"x-request-id", request_id))
            headers.append((b"x-forwarded-for", self._trust.x_forwarded_for(scope)))
            target = replica.targets[scope["path"]]
            if scope["query_string"]:
                target += b"?" + scope["query_string"]
            head = request_head(b"POST", target, replica.host_header, headers, len(body))
            outcome = _Outcome()
            outcome.stream = streamed
            outcome.heartbeat = bool(self._heartbeat_s) and streamed
            if built:
                outcome.built = ReplyAssembler(chat=endpoint == b"/chat/completions")
            try:
                await self._exchange(
                    replica.pool, head, body, receive, send, request_id, started, outcome, scope
                )
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
            admission.leave()
            replica.in_flight -= 1
            if gate is not None:
                gate.leave()
        if not outcome.status:
            outcome.status = 499  # the client left before the response began
        if stats is not None:
            self._record(stats, _ROUTE_LABELS[scope["path"]], outcome, arrived)
        if self._access is not None:
            self._access.write(
                scope,
                request_id=request_id,
                model=model,
                status=outcome.status,
                bytes_out=outcome.bytes_out,
                duration_s=perf_counter() - arrived,
                ttfb_s=outcome.head_s if outcome.own_s is not None else None,
                overhead_s=outcome.own_s,
            )

    def _record(self, stats: ModelMetrics, route: str, outcome: _Outcome, started: float) -> None:
        """Per request, once, after the response: a few pre-bound metric updates."""
        stats.count(route, outcome.status)
        stats.e2e.observe(perf_counter() - started)
        if outcome.own_s is not None:
            stats.overhead.observe(outcome.own_s)
            stats.ttft.observe(outcome.head_s)
        if outcome.error is not None:
            if outcome.error == "overloaded" and self._metrics is not None:
                self._metrics.overloaded += 1  # the gateway's own, not the upstream's
            else:
                stats.upstream_error(outcome.error)
        if outcome.client_gone and self._metrics is not None:
            self._metrics.client_disconnects += 1

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self._max_body_bytes
        media = b""
        from_browser = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                if value.isdigit() and int(value) > limit:
                    raise _too_large(limit)
            elif name == b"content-type":
                media = value.split(b";", 1)[0].strip().lower()
                if media not in _ACCEPTED_CONTENT_TYPES and not media.endswith(b"+json"):
                    given = echo(media.decode("latin-1"))
                    raise HTTPError(
                        415,
                        f"Content-Type {given!r} is not supported; send application/json",
                        code="unsupported_media_type",
                    )
            elif name == b"origin":
                from_browser = True
        if from_browser and media == b"application/x-www-form-urlencoded":
            # A form type needs no CORS preflight: any web page could make a
            # visitor's browser run generations here. Browsers must send JSON.
            raise HTTPError(
                415,
                "a browser request must send Content-Type: application/json",
                code="unsupported_media_type",
            )
        message = await receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            # The common case: the whole body came with the head.
            body: bytes = message.get("body", b"")
            if len(body) > limit:
                raise _too_large(limit)
            return body
        # Its deadline (--body-timeout, from the end of the head) is the protocol's (proxy/protocol.py).
        return await self._read_rest(message, receive, limit)

    async def _read_rest(self, message: Message, receive: Receive, limit: int) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
            message = await receive()

    async def _exchange(
        self,
        pool: Pool,
        head: bytes,
        body: bytes,
        receive: Receive,
        send: Send,
        request_id: bytes,
        started: float,
        outcome: _Outcome,
        scope: Scope,
    ) -> None:
        if self.closing:
            # The drain is over: nothing new starts.
            draining = Draining("the gateway is shutting down")
            outcome.failed(draining)
            await _send_upstream_error(send, draining, request_id, server_timing(started))
            return
        try:
            conn = await pool.acquire()
        except UpstreamError as exc:
            outcome.failed(exc)
            await _send_upstream_error(send, exc, request_id, server_timing(started))
            return
        if self.closing:
            # The drain ended while this connection was being opened: send nothing.
            pool.release(conn)
            draining = Draining("the gateway is shutting down")
            outcome.failed(draining)
            await _send_upstream_error(send, draining, request_id, server_timing(started))
            return
        # No retry once the request is written: the upstream may have acted
        # on it. Dead idle connections are weeded out by acquire() instead.
        conn.send(head, body)
        sent_at = perf_counter()
        watch = ClientWatch(receive, conn)
        self.active.add(conn)
        guards = self._guard(conn, outcome, scope)
        try:
            try:
                if outcome.heartbeat:
                    await self._await_head_with_heartbeats(conn, send, request_id, started, sent_at, outcome)
                else:
                    await conn.read_head(self._head_timeout_s)
            except UpstreamError as exc:
                conn.close()
                outcome.failed(exc)
                if outcome.sse_started:
                    event = sse_error_event(exc.status, str(exc), code=exc.code)
                    await send({"type": "http.response.body", "body": event})
                else:
                    await _send_upstream_error(
                        send, exc, request_id, server_timing(started, sent_at, perf_counter())
                    )
                return
            await self._respond(conn, send, request_id, started, sent_at, outcome)
        except ClientGone:
            outcome.client_gone = True
        finally:
            for guard in guards:
                guard.cancel()
            self.active.discard(conn)
            if watch.stop():
                conn.close()
            else:
                pool.release(conn)

    def _guard(self, conn: Connection, outcome: _Outcome, scope: Scope) -> list[asyncio.TimerHandle]:
        """Arm the optional whole-exchange deadline and the send-stall watchdog."""
        loop = asyncio.get_running_loop()
        guards = []
        if self._total_timeout_s:
            error = TotalTimeout(
                f"the request took longer than the gateway's limit of {self._total_timeout_s:g} s"
            )
            guards.append(loop.call_later(self._total_timeout_s, conn.abort, error))
        if self._send_stall_s:
            task = asyncio.current_task()
            assert task is not None
            abort_client = (scope.get("extensions") or {}).get("blazar.abort")
            watch = _StallWatch(self._send_stall_s, conn, outcome, task, guards, abort_client)
            guards.append(loop.call_later(self._send_stall_s, watch.check, -1))
        return guards

    async def _await_head_with_heartbeats(
        self,
        conn: Connection,
        send: Send,
        request_id: bytes,
        started: float,
        sent_at: float,
        outcome: _Outcome,
    ) -> None:
        """Wait for a stream's head; during a long prefill, keep the client's proxies from timing out.

        After each ``heartbeat_s`` without a head, the gateway starts the SSE
        response itself (200, text/event-stream) and sends `: keepalive`
        comments, so that an nginx `proxy_read_timeout` in front of it does
        not cut the stream. The upstream's own head then only continues it.
        """
        deadline = sent_at + self._head_timeout_s
        while not await conn.wait_head(max(0.0, min(self._heartbeat_s, deadline - perf_counter()))):
            if perf_counter() >= deadline:
                conn.close()
                raise HeadTimeout(f"upstream sent no response within {self._head_timeout_s:g} s")
            if not outcome.sse_started:
                headers = [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    *SSE_HEADERS,
                    (b"x-request-id", request_id),
                    server_timing(started),
                ]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                outcome.sse_started = True
                outcome.status = 200
            await send({"type": "http.response.body", "body": _HEARTBEAT, "more_body": True})
            outcome.bytes_out += len(_HEARTBEAT)

    async def _respond(
        self,
        conn: Connection,
        send: Send,
        request_id: bytes,
        started: float,
        sent_at: float,
        outcome: _Outcome,
    ) -> None:
        head_at = perf_counter()
        status = conn.status
        outcome.head_s = head_at - started
        if outcome.sse_started:
            # The client's first byte was the gateway's own heartbeat; the
            # gateway's own time is still everything but the upstream's wait.
            outcome.own_s = sent_at - started + perf_counter() - head_at
            await self._continue_stream(conn, send, status, outcome)
            return
        outcome.status = status
        if not 200 <= status <= 599:
            outcome.status, outcome.error = 502, "upstream_bad_response"
            conn.close()
            message = f"upstream answered with status {status}"
            timing = server_timing(started, sent_at, head_at)
            body = _upstream_error_body(502, message, "upstream_bad_response")
            await send_json(send, 502, body, [(b"x-request-id", request_id), timing])
            return
        headers = filter_response_headers(conn.headers)
        sse = is_event_stream(headers)
        if outcome.built is not None and status == 200 and sse:
            await self._respond_built(conn, send, request_id, started, sent_at, head_at, outcome)
            return
        if outcome.stream and 200 <= status < 300 and not sse:
            # The client waits for events and would see a clean end of none.
            conn.close()
            outcome.status, outcome.error = 502, "upstream_bad_response"
            media = next((v for n, v in headers if n == b"content-type"), b"no content type")
            given = echo(media.decode("latin-1"))
            message = f"upstream answered a stream request with {given}, not an event stream"
            body = _upstream_error_body(502, message, "upstream_bad_response")
            timing = server_timing(started, sent_at, head_at)
            await send_json(send, 502, body, [(b"x-request-id", request_id), timing])
            return
        if status >= 400 and not sse:
            try:
                body = await self._read_error_body(conn)
            except UpstreamError as exc:
                # The error body broke or timed out: say that, with its own status.
                conn.close()
                outcome.failed(exc)
                status, body = exc.status, _upstream_error_body(exc.status, str(exc), exc.code)
            kept = [(n, v) for n, v in headers if n in _KEPT_ON_ERRORS]
            timing = server_timing(started, sent_at, perf_counter())
            await send_json(send, status, body, [(b"x-request-id", request_id), timing, *kept])
            return
        if sse:
            headers = add_sse_headers(headers)
        headers.append((b"x-request-id", request_id))
        # The gateway's own time, computed once: for the header and the metrics.
        outcome.own_s = sent_at - started + perf_counter() - head_at
        headers.append(_timing(outcome.own_s, head_at - sent_at))
        if not conn.close_delimited and status not in (204, 304):
            for name, value in conn.headers:
                if name == b"content-length":
                    headers.append((name, value))
                    break
        await send({"type": "http.response.start", "status": status, "headers": headers})
        if sse:
            outcome.error = await self._relay_events(conn, send, outcome)
        else:
            outcome.error = await self._relay_body(conn, send, outcome)

    async def _respond_built(
        self,
        conn: Connection,
        send: Send,
        request_id: bytes,
        started: float,
        sent_at: float,
        head_at: float,
        outcome: _Outcome,
    ) -> None:
        """Read the stream the engine was asked for, and answer with the non-stream reply it makes.

        Nothing reaches the client before the reply is whole: a stream that
        breaks or ends without ``[DONE]`` (the engine died) is a 502 in the
        OpenAI envelope, never a short reply. The time to the first event with
        data is the request's time to first token.
        """
        assembler = outcome.built
        assert assembler is not None
        own_s = sent_at - started + perf_counter() - head_at
        try:
            while chunk := await conn.read(self._read_timeout_s):
                at = perf_counter()
                had_data = assembler.first_data
                assembler.feed(chunk)
                if not had_data and assembler.first_data:
                    outcome.head_s = at - started
                own_s += perf_counter() - at
                if assembler.done:
                    break
            at = perf_counter()
            body = assembler.reply()
        except (UpstreamError, AssemblyError) as exc:
            conn.close()
            outcome.status, outcome.error = exc.status, exc.code
            timing = server_timing(started, sent_at, perf_counter())
            await _send_upstream_error(send, exc, request_id, timing)
            return
        outcome.status = 200
        outcome.bytes_out = len(body)
        own_s += perf_counter() - at
        outcome.own_s = own_s
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"x-request-id", request_id),
            _timing(own_s, head_at - sent_at),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        if not conn.complete:
            # The stream's end follows [DONE] at once (mlx closes; a chunked
            # body sends its last chunk): once the client has its reply, wait
            # for it briefly, so that the connection ends cleanly and the pool
            # opens the next one ahead.
            with contextlib.suppress(UpstreamError, ClientGone, TimeoutError):
                async with asyncio.timeout(_AFTER_DONE_S):
                    while await conn.read(self._read_timeout_s):
                        pass
            if not conn.complete:
                conn.close()

    async def _continue_stream(self, conn: Connection, send: Send, status: int, outcome: _Outcome) -> None:
        """The upstream's head after the gateway's heartbeats: relay its events, or its error as one."""
        if 200 <= status < 300 and is_event_stream(conn.headers):
            outcome.error = await self._relay_events(conn, send, outcome)
            return
        try:
            body = await self._read_error_body(conn) if status >= 400 else b""
        except UpstreamError as exc:
            conn.close()
            outcome.failed(exc)
            body = _upstream_error_body(502, str(exc), exc.code)
        if not body:
            conn.close()
            body = _upstream_error_body(
                502, f"upstream answered {status} without an event stream", "upstream_bad_response"
            )
        outcome.error = outcome.error or "upstream_status"
        await send({"type": "http.response.body", "body": b"data: " + body + b"\n\n"})

    async def _relay_body(self, conn: Connection, send: Send, outcome: _Outcome) -> str | None:
        """Relay a body as it arrives; the upstream error's code if it broke."""
        read_timeout_s = self._read_timeout_s
        try:
            while chunk := await conn.read(read_timeout_s):
                outcome.bytes_out += len(chunk)
                if len(chunk) > _SLICE_BYTES:
                    chunk = await _send_all_but_last_slice(send, chunk, outcome)
                if conn.complete:
                    await send({"type": "http.response.body", "body": chunk})
                    return None
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                outcome.sends += 1
        except UpstreamError as exc:
            # Headers are out: the only honest signal left is to cut the
            # client's connection before the declared end of the body.
            conn.close()
            log.warning("upstream body broken, cutting the client's response: %s", exc)
            return exc.code
        await send({"type": "http.response.body", "body": b""})
        return None

    async def _relay_events(self, conn: Connection, send: Send, outcome: _Outcome) -> str | None:
        """Relay an SSE stream event by event as bytes arrive, and vouch for its end.

        Bytes after the last complete event of a read wait for the rest of
        their event (they are rare: servers write whole events), so that an
        error event never lands inside a half-written one. On the OpenAI
        streaming endpoints ``data: [DONE]`` is the end, whatever the framing:
        a stream that ends without it (and without an error event of its own,
        a chained gateway's) ends with an error event.
        """
        read_timeout_s = self._read_timeout_s
        pending = b""
        tail = b""
        last = b""
        try:
            while chunk := await conn.read(read_timeout_s):
                if pending:
                    chunk = pending + chunk
                    pending = b""
                if not chunk.endswith(b"\n\n"):
                    cut = _event_end(chunk)
                    if cut < len(chunk) and len(chunk) - cut <= _PARTIAL_EVENT_LIMIT_BYTES:
                        chunk, pending = chunk[:cut], chunk[cut:]
                        if not chunk:
                            continue
                tail = chunk[-_TAIL_BYTES:] if len(chunk) >= _TAIL_BYTES else (tail + chunk)[-_TAIL_BYTES:]
                outcome.bytes_out += len(chunk)
                if len(chunk) > _SLICE_BYTES:
                    chunk = await _send_all_but_last_slice(send, chunk, outcome)
                last = chunk
                if conn.complete and not conn.close_delimited and not pending and _ends_stream(tail, last):
                    await send({"type": "http.response.body", "body": chunk})
                    return None
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                outcome.sends += 1
        except UpstreamError as exc:
            conn.close()
            event = sse_error_event(exc.status, str(exc), code=exc.code)
            await send({"type": "http.response.body", "body": event})
            return exc.code
        if not _ends_stream(tail, last):
            # An HTTP/1.0 stream ends with the close either way, and a chunked
            # one may end cleanly too: without [DONE], the engine crashed or
            # cut it, or sent something else, and the client must know.
            message = "upstream stream ended without [DONE]: the response is truncated"
            event = sse_error_event(502, message, code="upstream_truncated")
            await send({"type": "http.response.body", "body": event})
            return "upstream_truncated"
        await send({"type": "http.response.body", "body": pending})
        return None

    async def _read_error_body(self, conn: Connection) -> bytes:
        """An upstream error body, read whole (bounded) and put in OpenAI's envelope."""
        chunks: list[bytes] = []
        size = 0
        while size <= _ERROR_BODY_LIMIT_BYTES:
            try:
                chunk = await conn.read(self._read_timeout_s)
            except BodyBroken:
                break
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if not conn.complete:
            conn.close()
        return normalize_error(conn.status, b"".join(chunks))

    def _admission_sample(self) -> list[tuple[str, int, int]]:
        return [
            (r.model, e.admission.in_flight, e.admission.queued + e.admission.loading)
            for r, e in self._built.items()
        ]

    async def _wait_for_model(self, gate: Gate, receive: Receive) -> bool:
        """Wait for a model to load (or restart), watching the client and the drain."""
        ready = asyncio.ensure_future(gate.wait_ready(self._load_wait_s))
        gone = asyncio.ensure_future(receive())
        ended = asyncio.ensure_future(self._ended.wait())
        try:
            await asyncio.wait({ready, gone, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in (ready, gone, ended):
                # Only this wait ends: a load is shared, and goes on.
                if not waiting.done():
                    waiting.cancel()
        if ready.done() and not ready.cancelled():
            return ready.result()
        if ended.done() and self._ending is not None:
            raise self._ending
        raise ClientGone()

    def abort_all(self, reason: str) -> int:
        """End everything still running or waiting (a drain that ran out of time); return how many."""
        self.closing = True
        self._ending = HTTPError(503, reason, code="draining", headers=((b"retry-after", _RETRY_AFTER_S),))
        self._ended.set()
        ended = len(self.active)
        for conn in list(self.active):
            conn.abort(Draining(reason))
        refusal = HTTPError(503, reason, code="draining", headers=((b"retry-after", _RETRY_AFTER_S),))
        for entry in self._routes.values():
            ended += entry.admission.fail_waiters(refusal)
        return ended


def server_timing(started: float, sent_at: float = 0.0, answered_at: float = 0.0) -> tuple[bytes, bytes]:
    """The Server-Timing header: the gateway's own time, and the upstream's until its answer.

    The gateway's time is everything from the request's arrival to now except
    the wait between sending upstream and the upstream's answer.
    """
    now = perf_counter()
    if not sent_at:
        return (b"server-timing", b"gateway;dur=%.3f" % ((now - started) * 1000))
    return _timing(sent_at - started + now - answered_at, answered_at - sent_at)


def _timing(own_s: float, upstream_s: float) -> tuple[bytes, bytes]:
    return (b"server-timing", b"gateway;dur=%.3f, upstream;dur=%.3f" % (own_s * 1000, upstream_s * 1000))


class _RouteEntry(NamedTuple):
    """Everything the hot path needs about a model, resolved once (unpacked per request)."""

    replicas: tuple[_Replica, ...]
    gate: Gate | None
    guards: RequestGuards
    admission: Admission
    stats: ModelMetrics | None
    # For an alias: the model's own name, put in the body sent upstream.
    rename: str | None


class _Replica:
    """One upstream of a model, with its pool and the requests it has in flight."""

    __slots__ = ("gate", "host_header", "in_flight", "pool", "served", "targets")

    def __init__(
        self, pool: Pool, host_header: bytes, targets: dict[str, bytes], gate: ReplicaGate | None
    ) -> None:
        self.pool = pool
        self.host_header = host_header
        self.targets = targets
        self.gate = gate
        self.in_flight = 0
        self.served = 0


def _least_busy(replicas: tuple[_Replica, ...]) -> _Replica | None:
    """The ready replica with the fewest requests in flight; ties go to the one that served fewest."""
    best: _Replica | None = None
    for replica in replicas:
        if replica.gate is not None and not replica.gate.ready:
            continue  # out of rotation until it is ready again
        if best is None or (replica.in_flight, replica.served) < (best.in_flight, best.served):
            best = replica
    return best


def _loading(reason: str) -> HTTPError:
    return HTTPError(503, reason, code="model_loading", headers=((b"retry-after", _RETRY_AFTER_S),))


class _Outcome:
    """How one relayed request ended, for the metrics."""

    __slots__ = (
        "built",
        "bytes_out",
        "client_gone",
        "error",
        "head_s",
        "heartbeat",
        "own_s",
        "sends",
        "sse_started",
        "stalled",
        "status",
        "stream",
    )

    def __init__(self) -> None:
        self.stalled = False
        self.sends = 0
        self.status = 0
        self.bytes_out = 0
        self.heartbeat = False
        # The client asked for a stream.
        self.stream = False
        self.sse_started = False
        self.own_s: float | None = None
        self.head_s = 0.0
        self.error: str | None = None
        self.client_gone = False
        # A non-stream reply being built from the stream the engine was asked for.
        self.built: ReplyAssembler | None = None

    def failed(self, exc: UpstreamError) -> None:
        if not self.sse_started:
            # Once the gateway has started the stream, the client has its 200.
            self.status = exc.status
        self.error = exc.code


class _StallWatch:
    """Cuts a client that took nothing for a whole interval while the relay was handing it bytes.

    Progress is a completed ``send``; a relay waiting on the upstream is not
    stalled by its client. A stalled client's socket is aborted (a plain close
    would wait for it to take the bytes it is not taking), its upstream closed,
    and the relay task cancelled out of the blocked ``send``.
    """

    __slots__ = ("abort_client", "conn", "guards", "interval_s", "outcome", "task")

    def __init__(
        self,
        interval_s: float,
        conn: Connection,
        outcome: _Outcome,
        task: asyncio.Task[Any],
        guards: list[asyncio.TimerHandle],
        abort_client: Any,
    ) -> None:
        self.interval_s = interval_s
        self.conn = conn
        self.outcome = outcome
        self.task = task
        self.guards = guards
        self.abort_client = abort_client

    def check(self, last_sends: int) -> None:
        if self.outcome.sends == last_sends and not self.conn.awaited:
            self.outcome.stalled = True
            log.warning(
                "client took nothing for %g s: closing its response and the upstream", self.interval_s
            )
            self.conn.close()
            if self.abort_client is not None:
                self.abort_client()
            self.task.cancel()
            return
        loop = asyncio.get_running_loop()
        self.guards.append(loop.call_later(self.interval_s, self.check, self.outcome.sends))


class ClientWatch:
    """Watches the client for a disconnect, and closes the upstream when it comes.

    Once the request body is read, the only event left on ``receive`` is the
    disconnect; a task waiting on it lets the relay close the upstream at
    once, even in a prefill that sends nothing for minutes. The task starts
    after ``_WATCH_AFTER_S``: an exchange that ends sooner has nothing worth
    cancelling, and skipping the task saves ~15 µs of CPU a request.
    """

    __slots__ = ("_conn", "_receive", "_task", "_timer")

    def __init__(self, receive: Receive, conn: Connection) -> None:
        self._receive = receive
        self._conn = conn
        self._task: asyncio.Future[Message] | None = None
        self._timer = asyncio.get_running_loop().call_later(_WATCH_AFTER_S, self._start)

    def _start(self) -> None:
        self._task = asyncio.ensure_future(self._receive())
        self._task.add_done_callback(self._conn.client_event)

    def stop(self) -> bool:
        """Stop watching; True if the client has gone (its upstream is closed)."""
        self._timer.cancel()
        task = self._task
        if task is None:
            return False
        if task.done():
            return True
        task.cancel()
        return False


class RequestIds:
    """Request ids: the client's x-request-id if usable, else a new one.

    New ids are a random per-process prefix and a counter (32 hex digits):
    unique enough for tracing, at a tenth of uuid4's cost.
    """

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex().encode()
        self._counter = itertools.count(1)

    def __call__(self, scope: Scope) -> bytes:
        for name, value in scope["headers"]:
            if name == b"x-request-id" and valid_request_id(value):
                return bytes(value)
        return b"%s%016x" % (self._prefix, next(self._counter))


async def _wait_for_slot(admission: Admission, model: str, receive: Receive) -> None:
    """Queue for a slot, watching the client: one that leaves while queued gives its place up."""
    enter = asyncio.ensure_future(admission.enter(model))
    gone = asyncio.ensure_future(receive())
    try:
        await asyncio.wait({enter, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        # Cancelled while queued: give the place (or a slot just granted) back.
        enter.cancel()
        try:
            await enter
        except (asyncio.CancelledError, HTTPError):
            pass
        else:
            admission.leave()  # the slot had been granted: pass it on
        raise
    finally:
        if not gone.done():
            gone.cancel()
    if not gone.done() or gone.cancelled():
        enter.result()  # the slot, or the 429/503 HTTPError
        return
    # The client left while queued.
    if enter.done():
        if enter.exception() is None:
            admission.leave()
    else:
        enter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await enter
    raise ClientGone()


async def _send_all_but_last_slice(send: Send, chunk: bytes, outcome: _Outcome) -> bytes:
    """Send a large chunk in slices, so that a slow but steady client shows progress; return the last."""
    view = memoryview(chunk)
    last = (len(chunk) - 1) // _SLICE_BYTES * _SLICE_BYTES
    for offset in range(0, last, _SLICE_BYTES):
        await send(
            {
                "type": "http.response.body",
                "body": bytes(view[offset : offset + _SLICE_BYTES]),
                "more_body": True,
            }
        )
        outcome.sends += 1
    return bytes(view[last:])


def _ends_stream(tail: bytes, last: bytes) -> bool:
    """Whether a stream's last bytes end it: ``[DONE]``, or an error event (a chained gateway's)."""
    return b"[DONE]" in tail or b'{"error"' in last


def _event_end(data: bytes) -> int:
    """Where the last complete SSE event in ``data`` ends (0 if none does)."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _too_large(limit: int) -> HTTPError:
    return HTTPError(
        413,
        f"request body is larger than the limit of {limit} bytes",
        code="request_too_large",
        headers=((b"connection", b"close"),),
    )


def _upstream_error_body(status: int, message: str, code: str) -> bytes:
    return HTTPError(status, message, code=code).body()


async def _send_upstream_error(
    send: Send, exc: UpstreamError | AssemblyError, request_id: bytes, timing: tuple[bytes, bytes]
) -> None:
    headers = [(b"x-request-id", request_id), timing]
    if exc.status == 503:
        headers.append((b"retry-after", _RETRY_AFTER_S))
    await send_json(send, exc.status, _upstream_error_body(exc.status, str(exc), exc.code), headers)
