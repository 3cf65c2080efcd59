"""``Outcome.record`` against a plain statement of its rules, for many outcomes drawn at random.

``reference_record`` below is the record written branch by branch, each rule once, with no
care for its cost. The relay's own is written for its fast path; the two must leave the same
outcome, the same metrics (the whole exposition, byte for byte) and the same access-log line.
"""

from __future__ import annotations

import io
import random
from typing import Any

import pytest

from proxy.accesslog import AccessLog, Clock, cut_model
from proxy.asgi import Scope
from proxy.endpoints import CHAT, ENDPOINTS
from proxy.errors import HTTPError
from proxy.metrics import Metrics
from proxy.relay import outcome as outcome_module
from proxy.relay.outcome import Outcome
from proxy.relay.routes import ROUTE_LABELS

NOW = 1000.0


def reference_record(
    outcome: Outcome, scope: Scope, metrics: Metrics | None, access: AccessLog | None
) -> None:
    """What recording a request does, rule by rule."""
    now = NOW
    if outcome.gone_early:
        outcome.status, outcome.duration_s = 499, now - outcome.started
        outcome.translator = outcome.built = None
        if outcome.refusal is not None:
            outcome.refusal.__traceback__ = None
        if metrics is not None:
            metrics.client_disconnects += 1
        return
    gone = "blazar.gone" in (scope.get("extensions") or ())
    if gone and not outcome.client_gone and not outcome.sse_started:
        outcome.status, outcome.bytes_out, outcome.client_gone = 499, 0, True
    route = ROUTE_LABELS[scope["path"]]
    if outcome.refusal is not None:
        duration_s = now - outcome.started
        if outcome.stats is not None:
            outcome.stats.count(route, outcome.status)
        elif metrics is not None:
            metrics.unrouted.count(route, outcome.status)
        if outcome.refusal.code == "model_not_found":
            asked = outcome.model
            outcome.model = access.asked_model(asked) if access is not None else cut_model(asked)
    else:
        if outcome.status == 0:
            outcome.status = 499
        duration_s = now - outcome.arrived
        stats = outcome.stats
        if stats is not None:
            stats.count(route, outcome.status)
            stats.e2e.observe(duration_s)
            if outcome.own_s is not None and outcome.status < 400:
                stats.overhead.observe(outcome.own_s)
                stats.ttft.observe(outcome.first_s or outcome.head_s)
            if outcome.error == "overloaded" and metrics is not None:
                metrics.overloaded += 1
            elif outcome.error is not None:
                stats.upstream_error(outcome.error)
            if outcome.client_gone and metrics is not None:
                metrics.client_disconnects += 1
    outcome.duration_s = duration_s
    outcome.translator = outcome.built = None
    if outcome.refusal is not None:
        outcome.refusal.__traceback__ = None
    if access is not None:
        access.write(
            scope,
            request_id=outcome.request_id,
            model=outcome.model,
            status=outcome.status,
            bytes_out=outcome.bytes_out,
            duration_s=duration_s,
            ttfb_s=outcome.head_s if outcome.own_s is not None else None,
            overhead_s=outcome.own_s,
            upstreams=outcome.upstreams,
        )


def draw(rng: random.Random) -> dict[str, Any]:
    """One request's record as the relay could leave it, before ``record``."""
    fields: dict[str, Any] = {
        "path": rng.choice(sorted(ENDPOINTS)),
        "request_id": rng.choice([b"req-1", b"\xe9id"]),
        "model": rng.choice(["m", "", "x" * 80, 'bad "name"']),
        "with_stats": rng.random() < 0.8,
        "status": rng.choice([0, 200, 200, 201, 400, 404, 429, 499, 502, 503]),
        "bytes_out": rng.choice([0, 12, 4096]),
        "own_s": rng.choice([None, 0.0, 3e-5, 0.002, 0.3]),
        "head_s": rng.choice([0.0, 0.001, 0.5, 40.0]),
        "first_s": rng.choice([0.0, 0.0, 0.75, 700.0]),
        "error": rng.choice([None, None, None, "overloaded", "upstream_closed", "client_stalled"]),
        "client_gone": rng.random() < 0.2,
        "sse_started": rng.random() < 0.2,
        "stream": rng.random() < 0.3,
        "gone_early": rng.random() < 0.1,
        "refusal": rng.choice([None, None, None, (404, "model_not_found"), (429, "busy"), (400, None)]),
        "extensions": rng.choice([None, {}, {"blazar.gone": True}, {"blazar.writer": None}]),
        "upstreams": rng.choice([None, None, ["a:1", "b:2"]]),
        "started_ago": rng.choice([0.0, 1e-4, 0.02, 3.0, 900.0]),
        "arrived_ago": rng.choice([0.0, 2e-4, 0.03, 4.0, 1000.0]),
        "with_metrics": rng.random() < 0.9,
        "with_access": rng.random() < 0.9,
        "fmt": rng.choice(["text", "json"]),
    }
    return fields


def build(fields: dict[str, Any], metrics: Metrics | None) -> tuple[Outcome, Scope]:
    path = fields["path"]
    outcome = Outcome(fields["request_id"], ENDPOINTS.get(path, CHAT))
    outcome.model = fields["model"]
    if fields["with_stats"] and metrics is not None:
        outcome.stats = metrics.for_model("m")
    for name in ("status", "bytes_out", "own_s", "head_s", "first_s", "error", "client_gone"):
        setattr(outcome, name, fields[name])
    for name in ("sse_started", "stream", "gone_early", "upstreams"):
        setattr(outcome, name, fields[name])
    outcome.started = NOW - fields["started_ago"]
    outcome.arrived = NOW - fields["arrived_ago"]
    if fields["refusal"] is not None:
        status, code = fields["refusal"]
        try:
            raise HTTPError(status, "refused", code=code)
        except HTTPError as exc:
            outcome.refuse(exc)
    scope: Scope = {"method": "POST", "path": path, "client": ("10.0.0.7", 1), "headers": []}
    if fields["extensions"] is not None:
        scope["extensions"] = dict(fields["extensions"])
    return outcome, scope


def state(outcome: Outcome) -> tuple[Any, ...]:
    refusal = outcome.refusal
    return (
        outcome.status,
        outcome.bytes_out,
        outcome.client_gone,
        outcome.duration_s,
        outcome.model,
        outcome.translator,
        outcome.built,
        None if refusal is None else refusal.__traceback__,
    )


def test_record_follows_the_rules_for_every_kind_of_outcome(
    lines: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outcome_module, "perf_counter", lambda: NOW)
    rng = random.Random(20260)
    seen: set[tuple[Any, ...]] = set()
    for _ in range(1000):
        fields = draw(rng)
        results = []
        for record in (reference_record, Outcome.record):
            metrics = Metrics() if fields["with_metrics"] else None
            clock = Clock(lambda: 1_800_000_000_000_000_000)
            access = AccessLog(fields["fmt"], clock=clock) if fields["with_access"] else None
            outcome, scope = build(fields, metrics)
            record(outcome, scope, metrics, access)
            if access is not None:
                access.flush()
            line = lines.getvalue()
            lines.seek(0)
            lines.truncate()
            figures = None
            if metrics is not None:
                figures = (metrics.render(), metrics.client_disconnects, metrics.overloaded)
            results.append((state(outcome), figures, line))
        assert results[0] == results[1], fields
        seen.add((outcome.status, outcome.refusal is None, outcome.client_gone))
    # The draw reaches every kind: relayed and refused, answered and left, and the 499s.
    assert len(seen) >= 20
