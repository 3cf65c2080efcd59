"""One request's record: its clocks, what it sent, how it ended; written out once.

The relay fills an ``Outcome`` as the request goes (no figure is written per
chunk) and ``record`` writes the metrics and the access-log line once, after
the response has ended.
"""

from __future__ import annotations

from time import perf_counter

from mypy_extensions import mypyc_attr

from proxy.accesslog import AccessLog, cut_model
from proxy.asgi import Scope
from proxy.assembly import ReplyAssembler
from proxy.endpoints import Endpoint
from proxy.errors import HTTPError
from proxy.metrics import Metrics, ModelMetrics
from proxy.relay.routes import ROUTE_LABELS, Peer
from proxy.translate import Translator
from proxy.upstream import Connection
from proxy.upstream_errors import UpstreamError


# Made for each request: a freed one is kept for the next (compiled).
@mypyc_attr(free_list_len=1)
class Outcome:
    """How one request went, from its arrival to its end."""

    # What a request has not set reads as these: only the few set for every request are set
    # by ``__init__`` (the rest are set on the record as the request goes).

    # Another API's request sent as a chat completion: its translation (else None).
    translator: Translator | None = None
    # When the request was written upstream.
    sent_at = 0.0
    # Set once the model is known to be served here.
    model = ""
    stats: ModelMetrics | None = None
    # The client asked for a stream.
    stream = False
    # A non-stream reply being built from the stream the engine was asked for.
    built: ReplyAssembler | None = None
    # The gateway's own answer before any exchange (400, 404, 429, 503...).
    refusal: HTTPError | None = None
    # The client left before the exchange began (in its upload or a queue).
    gone_early = False
    status = 0
    bytes_out = 0
    sends = 0
    sse_started = False
    own_s: float | None = None
    head_s = 0.0
    # A stream's time to its first event with data (its first token), once it came; else 0.
    first_s = 0.0
    error: str | None = None
    client_gone = False
    stalled = False
    # A request that moved between servers of a set: each one tried, in order (else None).
    upstreams: list[str] | None = None
    # The replica it was sent to, and its connection while the exchange runs (to cancel it).
    peer: Peer | None = None
    conn: Connection | None = None
    # The last bytes of the response (its usage, read for the status page); set at its end.
    tail = b""
    # Set once recorded: the request is over.
    duration_s: float | None = None

    def __init__(self, request_id: bytes, endpoint: Endpoint) -> None:
        self.request_id = request_id
        # The API endpoint it came in on: its error envelope, how its stream ends.
        self.endpoint = endpoint
        # ``started``, the gateway's clock: restarted when the body is in (the client's upload
        # is not the gateway's time) and after a wait for the model or a slot. ``arrived``: when
        # the body was in, the start of the request's end-to-end time.
        self.started = self.arrived = perf_counter()

    @property
    def replica(self) -> str | None:
        """The replica that served it, as the status page names it."""
        peer = self.peer
        return None if peer is None else peer.label

    def refuse(self, exc: HTTPError) -> None:
        self.refusal = exc
        self.status = exc.status

    def failed(self, exc: UpstreamError) -> None:
        if not self.sse_started:
            # Once the gateway has started the stream, the client has its 200.
            self.status = exc.status
        self.error = exc.code

    def record(self, scope: Scope, metrics: Metrics | None, access: AccessLog | None) -> None:
        """Write the request's metrics and its access-log line: once, after its response."""
        if self.gone_early:
            self.status, self.duration_s = 499, perf_counter() - self.started
            self._let_go()
            if metrics is not None:
                metrics.client_disconnects += 1
            return
        if "blazar.gone" in (scope.get("extensions") or ()) and not self.client_gone and not self.sse_started:
            # Answered through ASGI send (a refusal, an error, a built reply: one write
            # each) after the server lost the client's connection, which drops it silently.
            # (The scope first: a fast-path scope has no extensions, and the test ends there.)
            self.status, self.bytes_out, self.client_gone = 499, 0, True
        status = self.status
        own_s = self.own_s
        stats = self.stats
        if self.refusal is None:
            if not status:
                self.status = status = 499  # the client left before the response began
            duration_s = perf_counter() - self.arrived
            if stats is not None:
                if own_s is not None and status < 400:
                    stats.relayed(
                        ROUTE_LABELS[scope["path"]], status, duration_s, own_s, self.first_s or self.head_s
                    )
                else:
                    # A relayed upstream error has its figures in the access log, not in the
                    # histograms of the gateway's own time and the time to the first token.
                    stats.relayed(ROUTE_LABELS[scope["path"]], status, duration_s)
                error = self.error
                if error is not None:
                    if error == "overloaded" and metrics is not None:
                        metrics.overloaded += 1  # the gateway's own, not the upstream's
                    else:
                        stats.upstream_error(error)
                if self.client_gone and metrics is not None:
                    metrics.client_disconnects += 1
        else:
            duration_s = perf_counter() - self.started
            if stats is not None:
                stats.count(ROUTE_LABELS[scope["path"]], status)
            elif metrics is not None:
                metrics.unrouted.count(ROUTE_LABELS[scope["path"]], status)
            if self.refusal.code == "model_not_found":
                # A name no route serves: the client's own text, made safe for the line, and cut
                # (the status page's activity keeps it).
                self.model = access.asked_model(self.model) if access is not None else cut_model(self.model)
        self.duration_s = duration_s
        self._let_go()
        if access is not None:
            access.add(
                scope,
                self.request_id,
                self.model,
                status,
                self.bytes_out,
                duration_s,
                self.head_s if own_s is not None else None,
                own_s,
                self.upstreams,
            )

    def _let_go(self) -> None:
        """Keep only the record: it stays in the status page's activity for 300 more requests,
        without the reply being built or translated, nor the frames (the request's body and
        document) that a refusal's traceback holds."""
        self.translator = None
        self.built = None
        if self.refusal is not None:
            self.refusal.__traceback__ = None
