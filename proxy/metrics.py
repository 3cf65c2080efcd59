"""Prometheus metrics, served at GET /metrics (a plain route: a mounted app answers 307).

Cost is per request, never per chunk, and small: the relay updates plain
counters and bucket arrays bound once per model (a dict increment and a
`bisect` per observation). prometheus-client's own Counter and Histogram take
a lock on every update and cost ~14 µs a request here in all; they are used
only to write the text format, at scrape time, from these figures. In-flight
counts, queue depths and engine states are read at scrape time from the live
objects. Updates run in the event loop's thread, so nothing needs a lock.

A scrape copies the figures on the loop (``Metrics.snapshot``: plain lists
and numbers, one consistent instant) and writes the text in a thread
(``proxy.exposition.render_snapshot``): writing 20k series took a quarter of a second, and
on the loop every stream stalled that long.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from proxy.exposition import render_snapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The gateway's own time per request: the headline, so buckets start at 25 µs.
OVERHEAD_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 0.01, 0.05, 0.25)
LATENCY_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(frozen=True, slots=True)
class EngineSample:
    model: str
    replica: str
    up: bool
    ready: bool
    restarts: int
    starts: int = 0


@dataclass(frozen=True, slots=True)
class ReplicaSample:
    """One replica of a model with several, read at scrape time."""

    model: str
    replica: str
    in_flight: int
    affinity_hits: int
    affinity_misses: int
    affinity_spills: int
    ejections: int
    moved_away: int


def bucket_of(bounds: tuple[float, ...], value: float) -> int:
    """The index of the first bound ``value`` is at or below (``len(bounds)``: +Inf), as
    ``bisect_left`` gives it: from the smallest up, since a request's times fall in the first
    buckets (compiled, a loop of C comparisons beats a call that compares Python floats)."""
    index = 0
    for bound in bounds:
        if value <= bound:
            return index
        index += 1
    return index


class Buckets:
    """A histogram's figures: counts per bucket (`le` bounds), sum and count."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bucket_of(self.bounds, value)] += 1
        self.sum += value

    def copy(self) -> Buckets:
        twin = Buckets(self.bounds)
        twin.counts = self.counts.copy()
        twin.sum = self.sum
        return twin

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += count
            out.append((bound, float(running)))
        return out


class ModelMetrics:
    """One model's figures, updated by the relay once per request."""

    __slots__ = ("e2e", "model", "overhead", "queue_time", "requests", "ttft", "upstream_errors")

    def __init__(self, model: str) -> None:
        self.model = model
        self.requests: dict[tuple[str, int], int] = {}
        self.upstream_errors: dict[str, int] = {}
        self.e2e = Buckets(LATENCY_BUCKETS)
        self.ttft = Buckets(LATENCY_BUCKETS)
        self.overhead = Buckets(OVERHEAD_BUCKETS)
        self.queue_time = Buckets(QUEUE_BUCKETS)

    def count(self, route: str, status: int) -> None:
        key = (route, status)
        self.requests[key] = self.requests.get(key, 0) + 1

    def relayed(
        self, route: str, status: int, e2e_s: float, own_s: float | None = None, ttft_s: float = 0.0
    ) -> None:
        """A relayed request: ``count``, and its end-to-end time observed; with ``own_s``, the
        gateway's own time and the time to the first token (``ttft_s``) too.

        Each observation is ``Buckets.observe`` written out: one call for a request's figures.
        """
        key = (route, status)
        requests = self.requests
        requests[key] = requests.get(key, 0) + 1
        buckets = self.e2e
        buckets.counts[bucket_of(buckets.bounds, e2e_s)] += 1
        buckets.sum += e2e_s
        if own_s is not None:
            buckets = self.overhead
            buckets.counts[bucket_of(buckets.bounds, own_s)] += 1
            buckets.sum += own_s
            buckets = self.ttft
            buckets.counts[bucket_of(buckets.bounds, ttft_s)] += 1
            buckets.sum += ttft_s

    def upstream_error(self, kind: str) -> None:
        self.upstream_errors[kind] = self.upstream_errors.get(kind, 0) + 1

    def copy(self) -> ModelMetrics:
        """The figures as they are now, for a scrape to write while these go on."""
        twin = ModelMetrics(self.model)
        twin.requests = self.requests.copy()
        twin.upstream_errors = self.upstream_errors.copy()
        twin.e2e, twin.ttft = self.e2e.copy(), self.ttft.copy()
        twin.overhead, twin.queue_time = self.overhead.copy(), self.queue_time.copy()
        return twin


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every figure of one scrape, copied at one instant on the loop: plain data, safe in another thread."""

    models: list[ModelMetrics]
    unrouted: ModelMetrics
    client_disconnects: int
    overloaded: int
    admission: list[tuple[str, int, int]]
    replicas: list[ReplicaSample]
    engines: list[EngineSample]


class Metrics:
    """Every metric of one gateway; written at scrape time from a snapshot (``render``)."""

    def __init__(self) -> None:
        self.models: dict[str, ModelMetrics] = {}
        # Relay requests answered before a model was known (an unreadable body,
        # an unknown model), by route and status: model="" on the counter, so
        # that a client's text never becomes a label.
        self.unrouted = ModelMetrics("")
        self.client_disconnects = 0
        # Requests refused because the gateway itself ran out of file descriptors.
        self.overloaded = 0
        self._admission: list[Callable[[], Iterable[tuple[str, int, int]]]] = []
        self._replicas: list[Callable[[], Iterable[ReplicaSample]]] = []
        self._engines: list[Callable[[], Iterable[EngineSample]]] = []
        # One scrape written at a time: a burst of scrapes queues rather than fills threads.
        self._rendering = asyncio.Lock()

    def for_model(self, model: str) -> ModelMetrics:
        return self.models.setdefault(model, ModelMetrics(model))

    def watch_admission(self, sample: Callable[[], Iterable[tuple[str, int, int]]]) -> None:
        """Report in-flight and queued counts, read at scrape time from (model, in flight, queued)."""
        self._admission.append(sample)

    def watch_replicas(self, sample: Callable[[], Iterable[ReplicaSample]]) -> None:
        """Report each replica of a model with several, read at scrape time."""
        self._replicas.append(sample)

    def watch_engines(self, sample: Callable[[], Iterable[EngineSample]]) -> None:
        """Report engine children's state, read at scrape time."""
        self._engines.append(sample)

    def snapshot(self) -> Snapshot:
        """Every figure as it is now (on the loop: it reads the live objects)."""
        return Snapshot(
            models=[m.copy() for m in self.models.values()],
            unrouted=self.unrouted.copy(),
            client_disconnects=self.client_disconnects,
            overloaded=self.overloaded,
            admission=[row for sample in self._admission for row in sample()],
            replicas=[row for sample in self._replicas for row in sample()],
            engines=[row for sample in self._engines for row in sample()],
        )

    def render(self) -> bytes:
        """The text format, written here and now (tests, and callers off the loop)."""
        return render_snapshot(self.snapshot())

    async def render_off_loop(self) -> bytes:
        """The text format of this instant's figures, written in a thread while the loop goes on."""
        async with self._rendering:
            return await asyncio.to_thread(render_snapshot, self.snapshot())
