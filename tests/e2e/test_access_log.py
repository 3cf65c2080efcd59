"""The access log: one line per relayed request, text or JSON, without probes or keys.

Lines are buffered and written in batches (proxy/accesslog.py): they appear
while the gateway runs, within a fraction of a second, and none is lost when
it stops.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
import orjson

from tests.e2e.conftest import FakeEngine, Running, StartGateway

CHAT = "/v1/chat/completions"
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def lines(log: str, marker: str) -> list[str]:
    return [line for line in log.splitlines() if marker in line]


def wait_for_lines(gateway: Running, marker: str, count: int, timeout_s: float = 10.0) -> list[str]:
    """The lines holding ``marker`` once there are ``count`` of them, written while the gateway runs."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = lines(gateway.log(), marker)
        if len(found) >= count:
            assert gateway.proc.poll() is None, "the lines came only as the gateway exited"
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(found)} of {count} lines with {marker!r} after {timeout_s} s")
        time.sleep(0.02)


def stop(gateway: Running) -> str:
    """SIGTERM, wait for a clean exit, and return the whole log."""
    gateway.proc.send_signal(signal.SIGTERM)
    assert gateway.proc.wait(15) == 0
    return gateway.log()


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
    wait_for_lines(gateway, '"request_id"', 2)
    records = [orjson.loads(line) for line in lines(stop(gateway), '"request_id"')]
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
    (trusted_line,) = wait_for_lines(trusting, "id=a", 1)
    assert trusted_line.startswith('203.0.113.9 "POST /v1/chat/completions" 200 ')
    (plain_line,) = wait_for_lines(distrusting, "id=b", 1)
    assert plain_line.startswith('127.0.0.1 "POST /v1/chat/completions" 200 ')


def test_no_access_log(start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client) -> None:
    """--no-access-log writes no request lines, not even at exit."""
    gateway = start_gateway({"fake": fake.url}, "--no-access-log")
    assert http.post(gateway.url + CHAT, json=BODY, headers={"x-request-id": "quiet"}).status_code == 200
    assert "quiet" not in stop(gateway)


def test_no_line_is_lost_at_sigterm(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """A burst of requests, then SIGTERM at once: after the exit every request has its line, once."""
    gateway = start_gateway({"fake": fake.url})
    for index in range(100):
        response = http.post(gateway.url + CHAT, json=BODY, headers={"x-request-id": f"burst-{index}"})
        assert response.status_code == 200
    log = stop(gateway)
    ids = [line.rsplit("id=", 1)[1] for line in lines(log, "id=burst-")]
    assert ids == [f"burst-{index}" for index in range(100)]


def test_streams_ended_by_the_drain_are_logged(start_gateway: StartGateway, fake: FakeEngine) -> None:
    """Streams that the drain timeout ends, just before the gateway exits, still get their lines."""
    gateway = start_gateway({"fake": fake.url}, "--drain-timeout", "0.5")

    def stream(index: int) -> bytes:
        with (
            httpx.Client(trust_env=False, timeout=30) as client,
            client.stream(
                "POST",
                gateway.url + CHAT,
                json={**BODY, "stream": True},
                headers={"x-fake": "chunks=100; chunk-delay=0.1", "x-request-id": f"drained-{index}"},
            ) as response,
        ):
            return response.read()

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(stream, index) for index in range(3)]
        fake.wait_for_record(lambda r: len(fake.records()) >= 3, timeout_s=10)
        log = stop(gateway)
        assert all(b'"draining"' in future.result(timeout=20) for future in streams)
    drained = sorted(line.rsplit("id=", 1)[1] for line in lines(log, "id=drained-"))
    assert drained == ["drained-0", "drained-1", "drained-2"]
