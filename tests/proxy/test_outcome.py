"""proxy.relay.outcome: what ``Outcome.record`` counts in the metrics and writes in the access log."""

from __future__ import annotations

import io

from proxy.accesslog import AccessLog, Clock
from proxy.asgi import Scope
from proxy.endpoints import CHAT
from proxy.errors import HTTPError
from proxy.metrics import LATENCY_BUCKETS, OVERHEAD_BUCKETS, Buckets, Metrics, ModelMetrics
from proxy.relay.outcome import Outcome

SCOPE: Scope = {"method": "POST", "path": "/v1/chat/completions", "client": ("10.0.0.7", 1), "headers": []}
ROUTE = "chat/completions"


def relayed(metrics: Metrics, status: int, own_s: float | None = 0.002) -> Outcome:
    outcome = Outcome(b"req-1", CHAT)
    outcome.model, outcome.stats, outcome.status = "m", metrics.for_model("m"), status
    outcome.head_s, outcome.own_s, outcome.bytes_out = 0.5, own_s, 12
    return outcome


def counts(buckets: Buckets) -> int:
    return sum(buckets.counts)


def test_a_relayed_answer_is_counted_with_its_times(lines: io.StringIO) -> None:
    metrics = Metrics()
    access = AccessLog(clock=Clock(lambda: 1_800_000_000_000_000_000))
    outcome = relayed(metrics, 200)
    outcome.first_s = 0.75
    outcome.record(SCOPE, metrics, access)
    access.flush()
    stats = metrics.models["m"]
    assert stats.requests == {(ROUTE, 200): 1}
    assert outcome.duration_s is not None and stats.e2e.sum == outcome.duration_s
    assert (counts(stats.e2e), stats.overhead.sum, stats.ttft.sum) == (1, 0.002, 0.75)
    assert stats.overhead.counts[OVERHEAD_BUCKETS.index(2e-3)] == 1
    assert stats.ttft.counts[LATENCY_BUCKETS.index(1)] == 1
    line = lines.getvalue()
    assert line.startswith('10.0.0.7 [2027-01-15T08:00:00.000Z] "POST /v1/chat/completions" 200 12 ')
    assert line.endswith(" ttfb=500.000ms overhead=2.000ms model=m id=req-1\n")


def test_a_relayed_error_is_counted_without_the_gateway_s_times() -> None:
    """Its e2e time and its kind; not the gateway's own time nor the time to a first token."""
    metrics = Metrics()
    outcome = relayed(metrics, 502)
    outcome.error = "upstream_closed"
    outcome.record(SCOPE, metrics, None)
    stats = metrics.models["m"]
    assert stats.requests == {(ROUTE, 502): 1} and stats.upstream_errors == {"upstream_closed": 1}
    assert (counts(stats.e2e), counts(stats.overhead), counts(stats.ttft)) == (1, 0, 0)


def test_the_gateway_s_own_overload_and_a_client_that_left_are_its_own_counters() -> None:
    metrics = Metrics()
    outcome = relayed(metrics, 503, own_s=None)
    outcome.error, outcome.client_gone = "overloaded", True
    outcome.record(SCOPE, metrics, None)
    assert (metrics.overloaded, metrics.client_disconnects) == (1, 1)
    assert metrics.models["m"].upstream_errors == {}


def test_a_response_never_begun_is_a_499(lines: io.StringIO) -> None:
    metrics = Metrics()
    access = AccessLog("json", clock=Clock(lambda: 1_800_000_000_000_000_000))
    outcome = relayed(metrics, 0, own_s=None)
    outcome.record(SCOPE, metrics, access)
    access.flush()
    assert outcome.status == 499 and metrics.models["m"].requests == {(ROUTE, 499): 1}
    assert '"status":499,"bytes":12,' in lines.getvalue()
    assert '"ttfb_ms":null,"overhead_ms":null}' in lines.getvalue()


def test_a_refusal_is_counted_under_no_model_and_lets_its_traceback_go() -> None:
    metrics = Metrics()
    outcome = Outcome(b"req-2", CHAT)
    try:
        raise HTTPError(404, "no such model", code="model_not_found")
    except HTTPError as exc:
        outcome.refuse(exc)
    outcome.model = "x" * 100
    outcome.record(SCOPE, metrics, None)
    assert metrics.unrouted.requests == {(ROUTE, 404): 1}
    assert outcome.refusal is not None and outcome.refusal.__traceback__ is None
    assert outcome.model == "x" * 64 + "…" and outcome.translator is None and outcome.built is None


def test_relayed_is_count_and_observe_in_one() -> None:
    one, other = ModelMetrics("m"), ModelMetrics("m")
    one.relayed("chat", 200, 1.5, 0.0004, 0.3)
    one.relayed("chat", 500, 70.0)
    other.count("chat", 200)
    other.e2e.observe(1.5)
    other.overhead.observe(0.0004)
    other.ttft.observe(0.3)
    other.count("chat", 500)
    other.e2e.observe(70.0)
    for pick in ("e2e", "overhead", "ttft"):
        mine, theirs = getattr(one, pick), getattr(other, pick)
        assert (mine.counts, mine.sum) == (theirs.counts, theirs.sum)
    assert one.requests == other.requests
