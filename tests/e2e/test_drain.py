"""SIGTERM drains: streams in flight finish, new requests are turned away, and the gateway exits 0."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartGateway

CHAT = "/v1/chat/completions"


def stream_body(url: str, fake_header: str) -> bytes:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with (
        httpx.Client(trust_env=False, timeout=30) as client,
        client.stream("POST", url + CHAT, json=body, headers={"x-fake": fake_header}) as response,
    ):
        assert response.status_code == 200
        return response.read()


def start_streams(
    gateway: Running, fake: FakeEngine, count: int, fake_header: str
) -> list[concurrent.futures.Future[bytes]]:
    pool = concurrent.futures.ThreadPoolExecutor(count)
    futures = [pool.submit(stream_body, gateway.url, fake_header) for _ in range(count)]
    pool.shutdown(wait=False)
    fake.wait_for_record(lambda r: len(fake.records()) >= count, timeout_s=10)
    return futures


def last_event(raw: bytes) -> bytes:
    return [e for e in raw.split(b"\n\n") if e.strip()][-1]


@pytest.mark.fault("drain", "SIGTERM with requests in flight")
def test_sigterm_with_20_streams_in_flight_loses_none(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """20 streams in flight at SIGTERM all complete; meanwhile /readyz and new requests get 503; exit 0."""
    gateway = start_gateway({"fake": fake.url}, "--drain-timeout", "20")
    streams = start_streams(gateway, fake, 20, "chunks=30; chunk-delay=0.05")
    gateway.proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    ready = http.get(gateway.url + "/readyz")
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    refused = http.post(
        gateway.url + CHAT, json={"model": "fake", "messages": [{"role": "user", "content": "x"}]}
    )
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert refused.headers["connection"] == "close" and refused.headers["retry-after"]
    for future in streams:
        raw = future.result(timeout=30)
        assert last_event(raw) == b"data: [DONE]"
        assert b'"error"' not in raw
    assert gateway.proc.wait(15) == 0


@pytest.mark.fault("drain", "the drain deadline")
def test_drain_timeout_ends_the_rest_with_an_error_event(
    start_gateway: StartGateway, fake: FakeEngine
) -> None:
    """Streams still running when the drain time is over end with an SSE error event, not silently."""
    gateway = start_gateway({"fake": fake.url}, "--drain-timeout", "0.5")
    streams = start_streams(gateway, fake, 3, "chunks=100; chunk-delay=0.1")
    started = time.monotonic()
    gateway.proc.send_signal(signal.SIGTERM)
    for future in streams:
        error = orjson.loads(last_event(future.result(timeout=20)).removeprefix(b"data: "))["error"]
        assert error["code"] == "draining"
    assert gateway.proc.wait(15) == 0
    assert time.monotonic() - started < 8
    fake.wait_for_record(lambda r: all(x["closed_at"] is not None for x in fake.records()), timeout_s=5)


@pytest.mark.fault("drain", "a second and a third signal")
def test_second_signal_exits_at_once(start_gateway: StartGateway, fake: FakeEngine) -> None:
    """A second signal during a long drain ends the streams with an error event and exits 0 at once."""
    gateway = start_gateway({"fake": fake.url}, "--drain-timeout", "60")
    streams = start_streams(gateway, fake, 2, "chunks=600; chunk-delay=0.1")
    gateway.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    started = time.monotonic()
    gateway.proc.send_signal(signal.SIGINT)
    assert gateway.proc.wait(10) == 0
    assert time.monotonic() - started < 5
    for future in streams:
        event = last_event(future.result(timeout=10))
        assert event.startswith(b'data: {"error"') and b"second signal" in event, event
    assert "Traceback" not in gateway.log(), gateway.log()


@pytest.mark.fault("drain", "a second and a third signal")
def test_third_signal_exits_without_waiting(start_gateway: StartGateway, fake: FakeEngine) -> None:
    """A third signal leaves even if the second one's shutdown is still under way."""
    gateway = start_gateway({"fake": fake.url}, "--drain-timeout", "60")
    start_streams(gateway, fake, 1, "chunks=600; chunk-delay=0.1")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGINT):
        gateway.proc.send_signal(sig)
        time.sleep(0.05)
    assert gateway.proc.wait(10) == 130
