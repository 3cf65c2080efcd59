"""The access log: one line per relayed request, text or JSON, without probes or keys."""

from __future__ import annotations

import time

import httpx
import orjson

from tests.e2e.conftest import FakeEngine, StartGateway

CHAT = "/v1/chat/completions"
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def lines(log: str, marker: str) -> list[str]:
    return [line for line in log.splitlines() if marker in line]


def test_json_access_log_has_one_line_per_request(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """Each relayed request (and each gateway error) gets one JSON line; probes and /metrics get none."""
    gateway = start_gateway({"fake": fake.url}, "--log-format", "json", "--api-key", "secret-key")
    auth = {"authorization": "Bearer secret-key"}
    http.post(gateway.url + CHAT, json=BODY, headers={**auth, "x-request-id": "req-1"})
    http.post(gateway.url + CHAT, json={**BODY, "max_tokens": 0}, headers={**auth, "x-request-id": "req-2"})
    http.get(gateway.url + "/livez")
    http.get(gateway.url + "/readyz")
    http.get(gateway.url + "/metrics", headers=auth)
    time.sleep(0.2)
    records = [orjson.loads(line) for line in lines(gateway.log(), '"request_id"')]
    assert [r["request_id"] for r in records] == ["req-1", "req-2"]
    ok, bad = records
    assert (ok["status"], ok["model"], ok["path"]) == (200, "fake", CHAT)
    assert ok["bytes"] > 0 and ok["duration_ms"] > 0 and ok["overhead_ms"] is not None
    assert bad["status"] == 400
    assert "secret-key" not in gateway.log()


def test_text_log_and_forwarded_for_from_trusted_proxies(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """X-Forwarded-For names the client only when the peer is a configured proxy."""
    trusting = start_gateway({"fake": fake.url}, "--forwarded-allow-ips", "127.0.0.1")
    http.post(
        trusting.url + CHAT,
        json=BODY,
        headers={"x-forwarded-for": "203.0.113.9, 127.0.0.1", "x-request-id": "a"},
    )
    distrusting = start_gateway({"fake": fake.url})
    http.post(
        distrusting.url + CHAT, json=BODY, headers={"x-forwarded-for": "203.0.113.9", "x-request-id": "b"}
    )
    time.sleep(0.2)
    (trusted_line,) = lines(trusting.log(), "id=a")
    assert trusted_line.startswith('203.0.113.9 "POST /v1/chat/completions" 200 ')
    (plain_line,) = lines(distrusting.log(), "id=b")
    assert plain_line.startswith('127.0.0.1 "POST /v1/chat/completions" 200 ')


def test_no_access_log(start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client) -> None:
    """--no-access-log writes no request lines."""
    gateway = start_gateway({"fake": fake.url}, "--no-access-log")
    http.post(gateway.url + CHAT, json=BODY, headers={"x-request-id": "quiet"})
    time.sleep(0.2)
    assert "quiet" not in gateway.log()
