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
(``render_snapshot``): writing 20k series took a quarter of a second, and
on the loop every stream stalled that long.
"""

from __future__ import annotations

import asyncio
import re
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy import __version__

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


class Buckets:
    """A histogram's figures: counts per bucket (`le` bounds), sum and count."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
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
        buckets.counts[bisect_left(buckets.bounds, e2e_s)] += 1
        buckets.sum += e2e_s
        if own_s is not None:
            buckets = self.overhead
            buckets.counts[bisect_left(buckets.bounds, own_s)] += 1
            buckets.sum += own_s
            buckets = self.ttft
            buckets.counts[bisect_left(buckets.bounds, ttft_s)] += 1
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


def render_snapshot(snapshot: Snapshot) -> bytes:
    """The text format of ``snapshot`` (in any thread: it reads nothing live)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_RequestCollector(snapshot))
    registry.register(_AdmissionCollector(snapshot.admission))
    registry.register(_ReplicaCollector(snapshot.replicas))
    registry.register(_EngineCollector(snapshot.engines))
    return generate_latest(registry)


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


class _RequestCollector(Collector):
    def __init__(self, snapshot: Snapshot) -> None:
        self._metrics = snapshot

    def collect(self) -> Iterator[Metric]:
        models = self._metrics.models
        requests = CounterMetricFamily(
            "blazar_requests",
            "Requests answered, by model, route and status (model empty: answered before a model was known).",
            labels=["model", "route", "code"],
        )
        errors = CounterMetricFamily(
            "blazar_upstream_errors", "Upstream failures, by model and kind.", labels=["model", "kind"]
        )
        for m in (*models, self._metrics.unrouted):
            for (route, status), value in sorted(m.requests.items()):
                requests.add_metric([m.model, route, str(status)], value)
            for kind, value in sorted(m.upstream_errors.items()):
                errors.add_metric([m.model, kind], value)
        yield requests
        yield errors
        for name, doc, pick in (
            ("blazar_queue_time_seconds", "Time queued for a slot (requests that queued).", "queue_time"),
            (
                "blazar_time_to_first_token_seconds",
                "From the request's arrival to its first token: a stream's first event with data (comments "
                "do not count), a reply's response head.",
                "ttft",
            ),
            (
                "blazar_e2e_request_latency_seconds",
                "From the request's arrival to the end of its response.",
                "e2e",
            ),
            (
                "blazar_proxy_overhead_seconds",
                "The gateway's own time per request (Server-Timing gateway;dur).",
                "overhead",
            ),
        ):
            family = HistogramMetricFamily(name, doc, labels=["model"])
            for m in models:
                buckets: Buckets = getattr(m, pick)
                family.add_metric([m.model], buckets.cumulative(), buckets.sum)
            yield family
        disconnects = CounterMetricFamily(
            "blazar_client_disconnects", "Clients that left before their response ended."
        )
        disconnects.add_metric([], self._metrics.client_disconnects)
        yield disconnects
        overloaded = CounterMetricFamily(
            "blazar_overloaded", "Requests refused (503) because the gateway ran out of file descriptors."
        )
        overloaded.add_metric([], self._metrics.overloaded)
        yield overloaded
        build = GaugeMetricFamily("blazar_build_info", "The gateway's version.", labels=["version"])
        build.add_metric([__version__], 1)
        yield build


class _AdmissionCollector(Collector):
    def __init__(self, rows: list[tuple[str, int, int]]) -> None:
        self._rows = rows

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "blazar_requests_in_flight", "Requests holding a slot.", labels=["model"]
        )
        queued = GaugeMetricFamily("blazar_queue_depth", "Requests waiting for a slot.", labels=["model"])
        for model, running, waiting in self._rows:
            in_flight.add_metric([model], running)
            queued.add_metric([model], waiting)
        yield in_flight
        yield queued


class _ReplicaCollector(Collector):
    def __init__(self, rows: list[ReplicaSample]) -> None:
        self._rows = rows

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "replica"]
        in_flight = GaugeMetricFamily(
            "blazar_replica_in_flight", "Requests in flight on one replica of a model.", labels=labels
        )
        hits = CounterMetricFamily(
            "blazar_replica_affinity_hits",
            "Requests sent to a replica because it had served a prefix of their conversation.",
            labels=labels,
        )
        misses = CounterMetricFamily(
            "blazar_replica_affinity_misses",
            "Requests sent to a replica by load (no known prefix, too little, or a spill).",
            labels=labels,
        )
        spills = CounterMetricFamily(
            "blazar_replica_affinity_spills",
            "Requests a replica knew but lost to a less busy one (busier by more than the slack).",
            labels=labels,
        )
        ejections = CounterMetricFamily(
            "blazar_replica_ejections", "Times a replica was taken out of rotation.", labels=labels
        )
        moved_away = CounterMetricFamily(
            "blazar_replica_moved_away",
            "Requests that could not connect to a replica and went to another one (they had reached "
            "no engine).",
            labels=labels,
        )
        for row in self._rows:
            key = [row.model, row.replica]
            in_flight.add_metric(key, row.in_flight)
            hits.add_metric(key, row.affinity_hits)
            misses.add_metric(key, row.affinity_misses)
            spills.add_metric(key, row.affinity_spills)
            ejections.add_metric(key, row.ejections)
            moved_away.add_metric(key, row.moved_away)
        yield from (in_flight, hits, misses, spills, ejections, moved_away)


class _EngineCollector(Collector):
    def __init__(self, rows: list[EngineSample]) -> None:
        self._rows = rows

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "replica"]
        up = GaugeMetricFamily("blazar_engine_child_up", "1 while the child process runs.", labels=labels)
        ready = GaugeMetricFamily("blazar_engine_child_ready", "1 while the child serves.", labels=labels)
        restarts = CounterMetricFamily(
            "blazar_engine_child_restarts",
            "Times the child was started again after a failure.",
            labels=labels,
        )
        starts = CounterMetricFamily(
            "blazar_engine_child_starts",
            "Times the child process was spawned (loads and restarts).",
            labels=labels,
        )
        for engine in self._rows:
            up.add_metric([engine.model, engine.replica], 1 if engine.up else 0)
            ready.add_metric([engine.model, engine.replica], 1 if engine.ready else 0)
            restarts.add_metric([engine.model, engine.replica], engine.restarts)
            starts.add_metric([engine.model, engine.replica], engine.starts)
        yield up
        yield ready
        yield restarts
        yield starts


def merge_expositions(texts: Iterable[tuple[dict[str, str], str]]) -> str:
    """Other servers' Prometheus texts as one, each sample given its server's labels.

    Each family's ``# HELP`` and ``# TYPE`` lines come once, with every
    server's samples of it together under them (the text format wants a
    family's samples in one group).
    """
    families: dict[str, list[str]] = {}
    for labels, text in texts:
        added = ",".join(f'{name}="{_escape_label(value)}"' for name, value in labels.items())
        family = ""
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    lines = families.setdefault(family, [])
                    if line not in lines:
                        lines.append(line)
                continue
            match = _METRIC_NAME.match(line)
            if match is None:
                continue  # blank, or nothing Prometheus would read either
            name, rest = match.group(0), line[match.end() :]
            if not family or not name.startswith(family):
                family = name
            if rest.startswith("{"):
                inner = rest[1:].lstrip()
                sample = f"{name}{{{added}{'' if inner.startswith('}') else ','}{inner}"
            else:
                sample = f"{name}{{{added}}}{rest}"
            families.setdefault(family, []).append(sample)
    return "".join(line + "\n" for lines in families.values() for line in lines)


_METRIC_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
