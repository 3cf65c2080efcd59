"""What the gateway is doing, for people and tools: one snapshot, then each change.

``Status`` is the one place the gateway's state is read from: the models
(``models()``: each model's state, engine, replicas, requests in flight and
queued, TTL) that ``/v1/models``, ``/metrics`` and the status page show; the
activity (the last ``ACTIVITY_LIMIT`` requests); a 15-minute series of
requests per second, time to first token and tokens per second; and each
engine child's log. ``GET /events`` streams it as server-sent events: a
``snapshot`` first, then each change (``model``, ``model_removed``,
``activity``, ``series``, ``log``, ``gateway``); README's "Status page" has
the format.

What it costs the request path: the relay appends each request's ``Outcome``
to a bounded deque when it arrives, and that is all. The rows are read from
those records off the request path: when someone watches, a tick every
``TICK_S`` sends what is new or ended; tokens are read from the last bytes of
each response (its usage) only then. Model transitions come from the engine
manager (``changed``), and a child's log lines as it writes them
(``log_line``); nothing polls the children. Nothing runs per watcher but its
queue: an event is encoded once for all of them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterable
from time import perf_counter
from typing import Any, Protocol

import orjson

from proxy import __version__
from proxy.asgi import Receive, Scope, Send
from proxy.endpoints import Endpoint
from proxy.errors import HTTPError, echo
from proxy.metrics import Metrics
from proxy.routing import RoutingTable
from proxy.upstream import Connection
from proxy.upstream_errors import Cancelled

log = logging.getLogger("blazar.status")

# Requests kept for the activity list, newest last.
ACTIVITY_LIMIT = 300
# The series: one point a step, 15 minutes of them.
SERIES_STEP_S = 10.0
SERIES_POINTS = 90
# While someone watches: how often what is new in the activity and the logs goes out.
TICK_S = 0.5
# A comment this often keeps proxies and browsers from closing an idle stream.
KEEPALIVE_S = 15.0
# Events, and bytes, waiting for one watcher that does not read: past either, its stream ends (it
# comes back to a fresh snapshot) rather than the gateway keeping its backlog.
QUEUE_LIMIT = 2000
QUEUE_BYTES = 4 * 1024 * 1024
# A write to a watcher that takes nothing for this long ends its stream.
SEND_TIMEOUT_S = 15.0
# A child's lines in the snapshot (the engine manager keeps this many).
LOG_LINES = 200
# The end of a response kept for its usage: the usage chunk and [DONE] fit in it.
USAGE_BYTES = 2048

# The completion's token count in an answer's usage: OpenAI's, Anthropic's and the Responses API's.
_TOKENS = re.compile(rb'"(?:completion_tokens|output_tokens)"\s*:\s*(\d+)')


class Record(Protocol):
    """What the activity reads of a request: the relay's ``Outcome``."""

    request_id: bytes
    endpoint: Endpoint
    model: str
    status: int
    stream: bool
    arrived: float
    head_s: float
    first_s: float
    own_s: float | None
    bytes_out: int
    error: str | None
    refusal: HTTPError | None
    duration_s: float | None
    tail: bytes
    conn: Connection | None

    @property
    def replica(self) -> str | None: ...


def tokens_of(tail: bytes) -> int | None:
    """The completion tokens an answer's usage reports, from its last bytes; None without usage."""
    found = _TOKENS.findall(tail)
    return int(found[-1]) if found else None


def activity_row(record: Record, wall_offset: float) -> dict[str, Any]:
    """One request as the activity list shows it; ``wall_offset``: the wall clock minus perf_counter."""
    done = record.duration_s is not None
    # A stream's first event with data; a reply's head (a reply built from a stream: its first data).
    ttft_s = record.first_s or (record.head_s if record.own_s is not None else None)
    tokens = tokens_of(record.tail) if done else None
    tps = None
    if tokens and record.duration_s:
        # Over the request's whole time: from its first byte on, a stream whose head came late
        # (an engine that answers its head with the first tokens, or a busy machine) would seem
        # to generate in no time at all.
        tps = round(tokens / record.duration_s, 1)
    return {
        "id": record.request_id.decode("latin-1"),
        # Unique among the rows (clients may give two requests one x-request-id).
        "key": id(record),
        "time": round(wall_offset + record.arrived, 3),
        "model": record.model,
        "api": record.endpoint.name,
        "stream": record.stream,
        "in_flight": not done,
        "status": record.status if done else None,
        "ttft_ms": round(ttft_s * 1000, 1) if ttft_s is not None else None,
        "duration_ms": round(record.duration_s * 1000, 1) if record.duration_s is not None else None,
        "bytes": record.bytes_out,
        "tokens": tokens,
        "tps": tps,
        "replica": record.replica,
        "error": record.error or (record.refusal.code if record.refusal is not None else None),
        "cancellable": not done and record.conn is not None,
    }


# A model as the gateway shows it (README, "Status page"): plain JSON data.
ModelView = dict[str, Any]
# Each model's view, from the routing table: the engine manager's part is added by the composition root.
Views = Callable[[], list[ModelView]]
# Each child's log lines so far: (child, model, replica index, lines).
Logs = Callable[[], Iterable[tuple[str, str, int, list[str]]]]


class _Watcher:
    """One ``GET /events`` stream: the events waiting for it, bounded in number and bytes."""

    __slots__ = ("abort", "events", "overflowed", "size", "wake")

    def __init__(self, abort: Callable[[], None] | None = None) -> None:
        self.events: collections.deque[bytes] = collections.deque()
        self.size = 0
        self.wake = asyncio.Event()
        self.overflowed = False
        # Closes the client's connection at once (the server's ``blazar.abort``), if there is one.
        self.abort = abort

    def put(self, event: bytes) -> None:
        if self.overflowed:
            return
        if len(self.events) >= QUEUE_LIMIT or self.size + len(event) > QUEUE_BYTES:
            # It does not read (a write to it may be blocked): its stream ends now.
            self.overflowed = True
            self.events.clear()
            self.size = 0
            if self.abort is not None:
                self.abort()
        else:
            self.events.append(event)
            self.size += len(event)
        self.wake.set()

    def take(self) -> bytes:
        body = b"".join(self.events)
        self.events.clear()
        self.size = 0
        return body


def event(name: str, data: object) -> bytes:
    """One server-sent event: its name and its JSON data."""
    return b"event: %s\ndata: %s\n\n" % (name.encode(), orjson.dumps(data))


class Status:
    """The gateway's state, read in one place and streamed to whoever watches."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics
        # The relay appends each request here as it arrives (its whole cost on the request path).
        self.activity: collections.deque[Record] = collections.deque(maxlen=ACTIVITY_LIMIT)
        self.started = time.time()
        self.draining = False
        self._views: Views = list
        self._logs: Logs = tuple
        self._table: Callable[[], RoutingTable] | None = None
        self._watchers: set[_Watcher] = set()
        # Each model's state as last seen, and since when (the wall clock).
        self._since: dict[str, tuple[str, float]] = {}
        self._looked = False
        # Each model's view as last sent to the watchers.
        self._sent: dict[str, ModelView] = {}
        # The newest record the watchers were told of, and those told of while in flight (by
        # object: clients may give two requests the same x-request-id).
        self._newest: Record | None = None
        self._open: dict[int, Record] = {}
        # Log lines waiting for the next tick, by child, and those past the tick's limit.
        self._lines: dict[str, list[str]] = {}
        self._dropped: dict[str, int] = {}
        self._series: collections.deque[dict[str, Any]] = collections.deque(maxlen=SERIES_POINTS)
        self._totals: tuple[int, float, int] | None = None
        self._models_soon: asyncio.Handle | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._closed = False

    def bind(self, views: Views) -> None:
        """Where the models' views come from (``proxy.app.model_views``)."""
        self._views = views

    def bind_logs(self, logs: Logs) -> None:
        """Where the children's logs come from (the composition root's)."""
        self._logs = logs

    # -- the one snapshot ----------------------------------------------------

    def models(self) -> list[ModelView]:
        """Every model's view now: what /v1/models, /metrics and the page show."""
        now = time.time()
        views = self._views()
        # The first look: each model has been in its state since the gateway started.
        first = not self._looked
        self._looked = True
        for view in views:
            state = view["state"]
            seen = self._since.get(view["id"])
            if seen is None or seen[0] != state:
                seen = self._since[view["id"]] = (state, self.started if first else now)
            view["since"] = seen[1]
        if len(self._since) > len(views):
            names = {view["id"] for view in views}
            for name in [n for n in self._since if n not in names]:
                del self._since[name]
        return views

    def model(self, name: str) -> ModelView | None:
        """One model's view now (None: no such model)."""
        return next((view for view in self.models() if view["id"] == name), None)

    def snapshot(self) -> dict[str, Any]:
        """Everything the page shows, at one instant."""
        offset = time.time() - perf_counter()
        return {
            "gateway": self._gateway(),
            "models": self.models(),
            "activity": [activity_row(r, offset) for r in reversed(self.activity)],
            "series": list(self._series),
            "logs": [
                {"child": child, "model": model, "replica": index, "lines": lines[-LOG_LINES:]}
                for child, model, index, lines in self._logs()
            ],
        }

    def _gateway(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "now": time.time(),
            "started": self.started,
            "draining": self.draining,
            "activity_limit": ACTIVITY_LIMIT,
            "series_step_s": SERIES_STEP_S,
        }

    # -- told by the engine manager ------------------------------------------

    def changed(self) -> None:
        """A model or a child changed state: its view goes out (once, however many changes came at once)."""
        if self._models_soon is None and not self._closed:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop: a test's direct call; the next look sees it
                return
            self._models_soon = loop.call_soon(self._send_models)

    def log_line(self, child: str, line: str) -> None:
        """A line a child wrote: it goes out with the next tick, if anyone watches (at most
        ``LOG_LINES`` a tick: a flood is said, not sent; the log file has it all)."""
        if self._watchers:
            lines = self._lines.setdefault(child, [])
            if len(lines) < LOG_LINES:
                lines.append(line)
            else:
                self._dropped[child] = self._dropped.get(child, 0) + 1

    def set_draining(self) -> None:
        """The gateway began to shut down: the page says so."""
        self.draining = True
        self._send(event("gateway", {"draining": True, "now": time.time()}))

    # -- cancelling ------------------------------------------------------------

    def cancel(self, request_id: str) -> tuple[int, str]:
        """End a request under way; (200, "") or the status and reason it could not be."""
        wanted = request_id.encode("latin-1", "replace")
        request_id = echo(request_id)
        # Clients may give several requests one x-request-id: each of them under way is ended.
        found = {id(r): r for r in (*self.activity, *self._open.values()) if r.request_id == wanted}
        if not found:
            return 404, f"no request {request_id} is among the last {ACTIVITY_LIMIT}"
        running = [r for r in found.values() if r.duration_s is None]
        under_way = [r.conn for r in running if r.conn is not None]
        if not under_way:
            if running:
                return 409, (
                    f"request {request_id} is not with an engine yet (it is being read, or waits for "
                    "its model or a slot); only a request under way can be cancelled"
                )
            return 409, f"request {request_id} has already ended"
        log.info("request %s cancelled by an operator", request_id)
        for conn in under_way:
            conn.abort(Cancelled("the request was cancelled by the gateway's operator"))
        return 200, ""

    # -- the stream ------------------------------------------------------------

    async def stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /events``: a snapshot, then each change, until the client or the gateway leaves."""
        extensions = scope.get("extensions") or {}
        watcher = _Watcher(extensions.get("blazar.abort"))
        if self._watchers:
            # What the others have not been sent yet goes to them first: from the snapshot on,
            # every watcher is told the same changes.
            self._update()
        watcher.put(event("snapshot", self.snapshot()))
        self._note_sent()
        self._watchers.add(watcher)
        self._start_ticker()
        if scope["method"] == "HEAD":
            self._watchers.discard(watcher)
            await send({"type": "http.response.start", "status": 200, "headers": list(_STREAM_HEADERS)})
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.start", "status": 200, "headers": list(_STREAM_HEADERS)})
        gone = asyncio.ensure_future(_disconnect(receive))
        try:
            while not gone.done() and not watcher.overflowed and not self._closed:
                if watcher.events:
                    body = {"type": "http.response.body", "body": watcher.take(), "more_body": True}
                    try:
                        async with asyncio.timeout(SEND_TIMEOUT_S):
                            await send(body)
                    except TimeoutError:
                        # It takes nothing: its connection is closed, its backlog dropped.
                        if watcher.abort is not None:
                            watcher.abort()
                        return
                    continue
                watcher.wake.clear()
                woken = asyncio.ensure_future(watcher.wake.wait())
                done, _ = await asyncio.wait(
                    {woken, gone}, timeout=KEEPALIVE_S, return_when=asyncio.FIRST_COMPLETED
                )
                woken.cancel()
                if not done:
                    await send({"type": "http.response.body", "body": b": keepalive\n\n", "more_body": True})
            if not gone.done() and not watcher.overflowed:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.cancel()
            self._watchers.discard(watcher)

    def _send(self, data: bytes) -> None:
        for watcher in self._watchers:
            watcher.put(data)

    def _note_sent(self) -> None:
        """What a new snapshot showed: from here on only what changes goes out."""
        self._sent = {view["id"]: view for view in self.models()}
        self._lines.clear()
        if self.activity:
            self._newest = self.activity[-1]
            self._open = {id(r): r for r in self.activity if r.duration_s is None}

    def _update(self) -> None:
        """Send the watchers what changed since the last time."""
        self._send_activity()
        self._send_logs()
        self._send_models()

    def _send_models(self) -> None:
        self._models_soon = None
        views = {view["id"]: view for view in self.models()}
        if not self._watchers:
            self._sent = views
            return
        for name, view in views.items():
            if self._sent.get(name) != _without_clock(view, self._sent.get(name)):
                self._send(event("model", view))
        for name in self._sent.keys() - views.keys():
            self._send(event("model_removed", {"id": name}))
        self._sent = views

    def _send_activity(self) -> None:
        fresh = []
        newest = self._newest
        for record in reversed(self.activity):
            if record is newest:
                break
            fresh.append(record)
        if self.activity:
            self._newest = self.activity[-1]
        if not fresh and not self._open:
            return
        offset = time.time() - perf_counter()
        rows = []
        for key, record in list(self._open.items()):
            if record.duration_s is not None:
                rows.append(activity_row(record, offset))
                del self._open[key]
        for record in reversed(fresh):
            rows.append(activity_row(record, offset))
            if record.duration_s is None:
                self._open[id(record)] = record
        if rows:
            self._send(event("activity", {"rows": rows}))

    def _send_logs(self) -> None:
        lines, self._lines = self._lines, {}
        dropped, self._dropped = self._dropped, {}
        for child, new in lines.items():
            if child in dropped:
                new.append(f"[blazar-proxy: {dropped[child]} more lines in the log file, not shown here]")
            self._send(event("log", {"child": child, "lines": new}))

    def _start_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.ensure_future(self._tick())

    async def _tick(self) -> None:
        """While anyone watches: what is new in the activity, the logs and the counts."""
        while self._watchers and not self._closed:
            await asyncio.sleep(TICK_S)
            try:
                self._update()
            except Exception:
                log.exception("the status stream's update failed; trying again")
        self._lines.clear()

    # -- the series ------------------------------------------------------------

    def start(self) -> None:
        """Begin the series (in the server's loop): a point every ``SERIES_STEP_S``."""
        if self._sampler is None:
            self._totals = self._read_totals()
            self._sampler = asyncio.ensure_future(self._sample())

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(SERIES_STEP_S)
            try:
                point = self.series_point(time.time())
            except Exception:
                log.exception("the status series' sample failed; trying again")
                continue
            self._series.append(point)
            self._send(event("series", point))

    def series_point(self, now: float) -> dict[str, Any]:
        """The step that ended now: requests per second, mean time to first token and tokens per second."""
        totals = self._read_totals()
        before = self._totals or totals
        self._totals = totals
        requests = totals[0] - before[0]
        ttft_count = totals[2] - before[2]
        ttft_ms = (totals[1] - before[1]) / ttft_count * 1000 if ttft_count > 0 else None
        since = perf_counter() - SERIES_STEP_S
        speeds = []
        # Every one: a long request that ended in the step may sit behind newer, shorter ones.
        for record in self.activity:
            if record.duration_s is None or record.arrived + record.duration_s < since:
                continue
            row = activity_row(record, 0.0)
            if row["tps"] is not None:
                speeds.append(row["tps"])
        return {
            "t": round(now, 3),
            "rps": round(requests / SERIES_STEP_S, 3),
            "ttft_ms": round(ttft_ms, 1) if ttft_ms is not None else None,
            "tps": round(sum(speeds) / len(speeds), 1) if speeds else None,
        }

    def _read_totals(self) -> tuple[int, float, int]:
        """(requests answered, the time-to-first-token sum and count) as the metrics have them;
        without metrics, those of the activity's requests that ended in the last step."""
        metrics = self.metrics
        if metrics is None:
            since = perf_counter() - SERIES_STEP_S
            ttfts = [
                r.first_s or r.head_s
                for r in self.activity
                if r.duration_s is not None and r.arrived + r.duration_s >= since
            ]
            # As running totals: each step's are its own.
            before = self._totals or (0, 0.0, 0)
            return before[0] + len(ttfts), before[1] + sum(ttfts), before[2] + len(ttfts)
        requests = sum(sum(m.requests.values()) for m in (*metrics.models.values(), metrics.unrouted))
        ttft_sum = sum(m.ttft.sum for m in metrics.models.values())
        ttft_count = sum(sum(m.ttft.counts) for m in metrics.models.values())
        return requests, ttft_sum, ttft_count

    async def close(self) -> None:
        """End every stream and stop the series (the gateway shuts down)."""
        self._closed = True
        for watcher in self._watchers:
            watcher.wake.set()
        for task in (self._ticker, self._sampler):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


_STREAM_HEADERS = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache, no-store"),
    (b"x-accel-buffering", b"no"),
)


def _without_clock(view: ModelView, sent: ModelView | None) -> ModelView:
    """``view`` as compared with what was sent: the idle time alone does not make a change."""
    if sent is None or view.get("idle_s") == sent.get("idle_s"):
        return view
    return {**view, "idle_s": sent.get("idle_s")}


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
