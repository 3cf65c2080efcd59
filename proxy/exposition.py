"""The text format of the gateway's metrics (``proxy/metrics.py`` keeps the figures), and other
servers' texts merged into it.

Written at scrape time, in a thread, by prometheus-client; apart from the
figures' module because that one is compiled (``proxy/compiled.py``) and these
classes derive from prometheus-client's, which a compiled module cannot.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy import __version__

if TYPE_CHECKING:
    from proxy.metrics import Buckets, EngineSample, ReplicaSample, Snapshot


def render_snapshot(snapshot: Snapshot) -> bytes:
    """The text format of ``snapshot`` (in any thread: it reads nothing live)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_RequestCollector(snapshot))
    registry.register(_AdmissionCollector(snapshot.admission))
    registry.register(_ReplicaCollector(snapshot.replicas))
    registry.register(_EngineCollector(snapshot.engines))
    return generate_latest(registry)


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
