"""What the gateway records of an odd request (Server-Timing, metrics, the access log).

A slow upload is the client's time, not the gateway's; a stream that
heartbeats began still has a time to first token; a client gone before the
head is a 499; a request refused for a full queue is logged with its model.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartGateway
from tests.e2e.raw_http import payload, raw_request

CHAT = "/v1/chat/completions"


@pytest.mark.fault("clients", "slowloris: heads and bodies that trickle or never come")
def test_server_timing_excludes_the_clients_upload(gateway: Running, fake: FakeEngine) -> None:
    """A client that sends its body slowly does not inflate the gateway's Server-Timing figure."""
    body = payload(max_tokens=4)
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        sock.sendall(body[:5])
        time.sleep(0.5)
        sock.sendall(body[5:])
        raw = b""
        while b"\r\n\r\n" not in raw:
            raw += sock.recv(65536)
    timing = next(line for line in raw.split(b"\r\n") if line.lower().startswith(b"server-timing:"))
    gateway_ms = float(timing.split(b"gateway;dur=")[1].split(b",")[0])
    assert gateway_ms < 500


@pytest.mark.fault("clients", "a client that leaves mid-request")
def test_heartbeat_streams_are_counted_in_ttft_and_client_gone_is_499(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """Streams started by heartbeats still feed the TTFT histogram; a client gone before the head is 499."""
    gateway = start_gateway({"fake": fake.url}, "--sse-heartbeat", "0.2")
    http.post(gateway.url + CHAT, content=payload(stream=True), headers={"x-fake": "prefill=0.5"})
    sock = raw_request(gateway, "prefill=2", payload())
    time.sleep(0.3)
    sock.close()
    time.sleep(0.3)
    text = http.get(gateway.url + "/metrics").text
    assert 'blazar_time_to_first_token_seconds_count{model="fake"} 1.0' in text
    assert 'code="499"' in text and 'code="0"' not in text


@pytest.mark.fault("overload", "the limit and the queue: 429 and 503 with Retry-After")
def test_access_log_names_the_model_of_a_429_without_metrics(
    start_gateway: StartGateway, fake: FakeEngine
) -> None:
    """With --no-metrics, a refused request's log line still names its model."""
    gateway = start_gateway({"fake": fake.url}, "--no-metrics", "--max-in-flight", "1", "--max-queued", "0")
    holder = raw_request(gateway, "prefill=1", payload())
    try:
        fake.wait_for_record(lambda r: True)
        with httpx.Client(trust_env=False) as http:
            assert (
                http.post(gateway.url + CHAT, content=payload(), headers={"x-request-id": "r429"}).status_code
                == 429
            )
        time.sleep(0.2)
        (line,) = [line for line in gateway.log().splitlines() if "id=r429" in line]
        assert "model=fake" in line
    finally:
        holder.close()
