"""GET /metrics: Prometheus text from a plain route, with the figures an operator needs."""

from __future__ import annotations

import re
import socket
import time

import httpx
import orjson

from tests.e2e.conftest import FakeEngine, Running, StartGateway

CHAT = "/v1/chat/completions"


def chat(**fields: object) -> dict[str, object]:
    return {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus text, or None."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_metrics_is_a_plain_route_with_request_counts(
    gateway: Running, fake: FakeEngine, http: httpx.Client
) -> None:
    """/metrics answers 200 (not a 307 redirect) and counts requests by model, route and status."""
    before = http.get(gateway.url + "/metrics", follow_redirects=False)
    assert before.status_code == 200
    assert before.headers["content-type"].startswith("text/plain")
    base = (
        sample(before.text, "blazar_requests_total", model="fake", route="chat/completions", code="200") or 0
    )
    for _ in range(3):
        assert http.post(gateway.url + CHAT, json=chat()).status_code == 200
    assert http.post(gateway.url + CHAT, json=chat(), headers={"x-fake": "empty"}).status_code == 502
    text = http.get(gateway.url + "/metrics").text
    assert (
        sample(text, "blazar_requests_total", model="fake", route="chat/completions", code="200") == base + 3
    )
    assert (
        sample(text, "blazar_requests_total", model="fake", route="chat/completions", code="502") or 0
    ) >= 1
    assert (sample(text, "blazar_upstream_errors_total", model="fake", kind="upstream_empty_reply") or 0) >= 1
    assert (sample(text, "blazar_proxy_overhead_seconds_count", model="fake") or 0) >= 3
    assert sample(text, "blazar_proxy_overhead_seconds_bucket", model="fake", le="2.5e-05") is not None
    assert (sample(text, "blazar_e2e_request_latency_seconds_count", model="fake") or 0) >= 4
    assert sample(text, "blazar_build_info") == 1
    # Unroutable requests never become a label: no cardinality from clients.
    http.post(gateway.url + CHAT, json=chat(model="made-up-name"))
    assert "made-up-name" not in http.get(gateway.url + "/metrics").text


def test_requests_refused_before_a_model_is_known_are_counted_without_one(
    gateway: Running, http: httpx.Client
) -> None:
    """A body that is not JSON (400) and an unknown model (404): counted under model="", by route and code."""

    def unrouted(text: str, route: str, code: str) -> float:
        labels = ('model=""', f'route="{route}"', f'code="{code}"')
        for line in text.splitlines():
            if line.startswith("blazar_requests_total{") and all(label in line for label in labels):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = http.get(gateway.url + "/metrics").text
    for _ in range(2):
        reply = http.post(gateway.url + CHAT, content=b"{not json")
        assert reply.status_code == 400
    reply = http.post(gateway.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert reply.status_code == 404
    after = http.get(gateway.url + "/metrics").text
    assert unrouted(after, "chat/completions", "400") == unrouted(before, "chat/completions", "400") + 2
    assert unrouted(after, "completions", "404") == unrouted(before, "completions", "404") + 1
    assert "nope" not in after


def test_in_flight_queue_depth_and_disconnects(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """In-flight and queued requests show while they last; a client that leaves is counted."""
    gateway = start_gateway({"fake": fake.url}, "--max-in-flight", "1")
    payload = orjson.dumps(chat())
    socks = []
    for _ in range(2):
        sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=5)
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"x-fake: prefill=2\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
        )
        socks.append(sock)
    time.sleep(0.3)
    text = http.get(gateway.url + "/metrics").text
    assert sample(text, "blazar_requests_in_flight", model="fake") == 1
    assert sample(text, "blazar_queue_depth", model="fake") == 1
    for sock in socks:
        sock.close()
    time.sleep(0.3)
    text = http.get(gateway.url + "/metrics").text
    assert sample(text, "blazar_requests_in_flight", model="fake") == 0
    assert sample(text, "blazar_queue_depth", model="fake") == 0
    assert (sample(text, "blazar_client_disconnects_total") or 0) >= 2


def test_metrics_can_be_turned_off(start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client) -> None:
    """--no-metrics removes the route (404 in OpenAI's envelope)."""
    gateway = start_gateway({"fake": fake.url}, "--no-metrics")
    response = http.get(gateway.url + "/metrics")
    assert response.status_code == 404 and re.search(r'"code":\s*"unknown_url"', response.text)
