"""The access log: one line per relayed request, text or JSON, without probes or keys.

Lines are buffered and written in batches (proxy/accesslog.py): they appear
while the gateway runs, within a fraction of a second, and none is lost when
it stops.
"""

from __future__ import annotations

import concurrent.futures
import re
import signal
import time

import httpx
import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartGateway
from tests.helpers import free_port

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
    assert trusted_line.startswith("203.0.113.9 [") and '] "POST /v1/chat/completions" 200 ' in trusted_line
    (plain_line,) = wait_for_lines(distrusting, "id=b", 1)
    assert plain_line.startswith("127.0.0.1 [") and '] "POST /v1/chat/completions" 200 ' in plain_line


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
        return streamed(gateway, f"drained-{index}", "chunks=100; chunk-delay=0.1", timeout_s=30)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(stream, index) for index in range(3)]
        fake.wait_for_record(lambda r: len(fake.records()) >= 3, timeout_s=10)
        log = stop(gateway)
        assert all(b'"draining"' in future.result(timeout=20) for future in streams)
    drained = sorted(line.rsplit("id=", 1)[1] for line in lines(log, "id=drained-"))
    assert drained == ["drained-0", "drained-1", "drained-2"]


def streamed(gateway: Running, request_id: str, misbehave: str, timeout_s: float = 10) -> bytes:
    """One stream request with this id and ``x-fake``; the whole body the client got."""
    with (
        httpx.Client(trust_env=False, timeout=timeout_s) as client,
        client.stream(
            "POST",
            gateway.url + CHAT,
            json={**BODY, "stream": True},
            headers={"x-request-id": request_id, "x-fake": misbehave},
        ) as response,
    ):
        return response.read()


# A text line: client [time] "METHOD PATH" status bytes duration ttfb= overhead= model= id= [upstream=].
TEXT_LINE = re.compile(
    r'^\S+ \[\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z\] "POST \S+" '
    r"(?P<status>\d+) (?P<bytes>\d+) [\d.]+ms ttfb=(?P<ttfb>[\d.]+|-)ms "
    r"overhead=(?P<overhead>[\d.]+|-)ms model=(?P<model>\S+) id=(?P<id>\S+)$"
)


def fields(gateway: Running, fmt: str, request_id: str) -> dict[str, object]:
    """The figures of one request's line, the same keys for either format."""
    if fmt == "json":
        (line,) = wait_for_lines(gateway, f'"request_id":"{request_id}"', 1)
        record = orjson.loads(line)
        return {k: record[k] for k in ("status", "bytes", "ttfb_ms", "overhead_ms", "model")}
    (line,) = wait_for_lines(gateway, f" id={request_id}", 1)
    match = TEXT_LINE.match(line)
    assert match is not None, line
    ttfb, overhead = match["ttfb"], match["overhead"]
    return {
        "status": int(match["status"]),
        "bytes": int(match["bytes"]),
        "ttfb_ms": None if ttfb == "-" else float(ttfb),
        "overhead_ms": None if overhead == "-" else float(overhead),
        "model": match["model"],
    }


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_error_bodies_count_their_bytes_and_a_relayed_error_has_its_ttfb(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client, fmt: str
) -> None:
    """Every error body the client gets is counted in bytes (nginx's $body_bytes_sent): the gateway's
    refusals, its answers for a failed upstream and a relayed upstream error; only the relayed one,
    whose head came from the upstream, has a ttfb and an overhead."""
    gateway = start_gateway(
        {"fake": fake.url, "down": f"http://127.0.0.1:{free_port()}"}, "--log-format", fmt
    )
    cases = {
        # id: (model, extra body, x-fake, status wanted, relayed)
        "refused-400": ("fake", {"max_tokens": 0}, "", 400, False),
        "refused-404": ("nowhere", {}, "", 404, False),
        "relayed-500": ("fake", {}, "status=500", 500, True),
        "relayed-429": ("fake", {}, "status=429", 429, True),
        "garbage-502": ("fake", {}, "garbage", 502, False),
        "empty-502": ("fake", {}, "empty", 502, False),
        "unreachable": ("down", {}, "", 0, False),
    }
    sizes = {}
    for request_id, (model, extra, misbehave, status, _) in cases.items():
        headers = {"x-request-id": request_id, **({"x-fake": misbehave} if misbehave else {})}
        response = http.post(gateway.url + CHAT, json={**BODY, "model": model, **extra}, headers=headers)
        assert response.status_code == status or (not status and response.status_code >= 500), request_id
        assert response.content and response.json()["error"]["message"], request_id
        sizes[request_id] = (response.status_code, len(response.content))
    for request_id, (_, _, _, _, relayed) in cases.items():
        line = fields(gateway, fmt, request_id)
        assert (line["status"], line["bytes"]) == sizes[request_id], (request_id, line)
        if relayed:
            assert line["ttfb_ms"] is not None and line["overhead_ms"] is not None, (request_id, line)
        else:
            assert line["ttfb_ms"] is None and line["overhead_ms"] is None, (request_id, line)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_the_gateways_error_events_after_a_stream_began_count_their_bytes(
    start_gateway: StartGateway, fake: FakeEngine, fmt: str
) -> None:
    """A stream that the gateway ends with an error event of its own logs every byte the client got:
    a truncated stream's relayed events and the event, heartbeats and an upstream's error after them."""
    gateway = start_gateway({"fake": fake.url}, "--log-format", fmt, "--sse-heartbeat", "0.05")
    cases = {"truncated": "no-done", "after-heartbeats": "prefill=0.3; status=500"}
    sizes = {}
    for request_id, misbehave in cases.items():
        body = streamed(gateway, request_id, misbehave)
        assert b'"error"' in body, (request_id, body)
        sizes[request_id] = len(body)
    for request_id in cases:
        line = fields(gateway, fmt, request_id)
        assert (line["status"], line["bytes"]) == (200, sizes[request_id]), (request_id, line)


def test_half_an_event_after_done_is_relayed_and_counted(
    start_gateway: StartGateway, fake: FakeEngine
) -> None:
    """Bytes after [DONE] that end no event go to the client at the stream's end, and count in its line."""
    gateway = start_gateway({"fake": fake.url}, "--log-format", "json")
    body = streamed(gateway, "after-done", "after-done")
    assert body.endswith(b"data: [DONE]\n\n: after"), body[-40:]
    line = fields(gateway, "json", "after-done")
    assert (line["status"], line["bytes"]) == (200, len(body)), line


def test_an_unknown_model_is_logged_as_asked_and_safe_for_the_line(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """A 404 model_not_found logs the name the client gave: in a text line cut and escaped so that the
    line still splits on spaces, in JSON as given (cut); no metric gets a label for it."""
    prefix = 'my "odd" model\\\n\t\x1b'
    odd = prefix + "x" * 100
    text = start_gateway({"fake": fake.url}, "--api-key", "k")
    json_log = start_gateway({"fake": fake.url}, "--log-format", "json")
    auth = {"authorization": "Bearer k"}
    for gateway, headers in ((text, auth), (json_log, {})):
        for request_id, model in (("plain", "gpt-4o"), ("odd", odd)):
            response = http.post(
                gateway.url + CHAT,
                json={**BODY, "model": model},
                headers={**headers, "x-request-id": request_id},
            )
            assert response.status_code == 404
    assert fields(text, "text", "plain")["model"] == "gpt-4o"
    shown = fields(text, "text", "odd")["model"]
    assert shown == r"my\x20\x22odd\x22\x20model\x5C\x0A\x09\x1B" + "x" * (64 - len(prefix)) + "…", shown
    assert fields(json_log, "json", "plain")["model"] == "gpt-4o"
    assert fields(json_log, "json", "odd")["model"] == odd[:64] + "…"
    metrics = http.get(text.url + "/metrics", headers=auth).text
    assert "gpt-4o" not in metrics and "odd" not in metrics
