"""The budget of request-body bytes the gateway holds at once: past it, 503 with Retry-After.

Every body in flight was held whole (and more: as pieces, joined, and parsed),
with no bound across requests: a handful of concurrent large bodies took the
gateway's memory where they liked. Now a body is charged to one budget as
its bytes arrive, and given back once its upstream has answered or its
request ends (a client that leaves mid-body included). A head whose declared
length has no room left is refused at once, but reserves nothing.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartGateway
from tests.helpers import rss_mib

pytestmark = pytest.mark.fault("overload", "request bodies past the gateway's budget")

MIB = 1024 * 1024
_BUDGET = 8 * MIB


def body_of(size: int) -> bytes:
    """A chat request for the fake engine, about ``size`` bytes long."""
    return orjson.dumps(
        {"model": "fake", "messages": [{"role": "user", "content": "x" * (size - 80)}], "max_tokens": 1}
    )


@pytest.fixture
def budget_gateway(fake: FakeEngine, start_gateway: StartGateway) -> Iterator[Running]:
    yield start_gateway(
        {"fake": fake.url}, "--body-budget-bytes", str(_BUDGET), "--max-body-bytes", str(7 * MIB)
    )


def post(gateway: Running, body: bytes, fake: str = "") -> httpx.Response:
    headers = {"content-type": "application/json", **({"x-fake": fake} if fake else {})}
    with httpx.Client(trust_env=False, timeout=30) as client:
        return client.post(f"{gateway.url}/v1/chat/completions", content=body, headers=headers)


def assert_over_budget(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"].isdigit()
    error = response.json()["error"]
    assert error["code"] == "body_budget_exhausted"
    assert "--body-budget-bytes" in error["message"]
    assert set(error) >= {"message", "type", "param", "code"}


def test_concurrent_bodies_past_the_budget_get_503_and_the_others_go_through(
    budget_gateway: Running, fake: FakeEngine
) -> None:
    """Two 3 MiB bodies held by a slow upstream leave no room for a third (503), but a small one passes."""
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(post, budget_gateway, body_of(3 * MIB), "prefill=3") for _ in range(2)]
        deadline = time.monotonic() + 15
        while sum(1 for r in fake.records() if r.get("path") == "/v1/chat/completions") < 2:
            assert time.monotonic() < deadline, "the two held requests did not reach the engine"
            time.sleep(0.05)
        assert_over_budget(post(budget_gateway, body_of(3 * MIB)))
        assert post(budget_gateway, body_of(1000)).status_code == 200
        assert [f.result().status_code for f in held] == [200, 200]
    # Given back after each request: the whole budget's worth of bodies fits again, one after another.
    for _ in range(4):
        assert post(budget_gateway, body_of(6 * MIB)).status_code == 200


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_client_that_leaves_mid_body_gives_its_budget_back(budget_gateway: Running, framing: str) -> None:
    """A body half sent holds its charge (others get 503) until its client hangs up; then it is given back."""
    sock = socket.create_connection(("127.0.0.1", budget_gateway.port))
    try:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        if framing == "content-length":
            # Charged as it arrives: 5.5 MiB of the 6 MiB declared.
            sock.sendall(head + b"Content-Length: %d\r\n\r\n" % (6 * MIB) + b"{" + b" " * (11 * MIB // 2))
        else:
            # Charged as it arrives: 6 MiB of chunks, and no last chunk.
            sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
            piece = b" " * (256 * 1024)
            for _ in range(24):
                sock.sendall(b"%x\r\n%b\r\n" % (len(piece), piece))
        deadline = time.monotonic() + 15
        while (response := post(budget_gateway, body_of(3 * MIB))).status_code == 200:
            assert time.monotonic() < deadline, "the half-sent body holds nothing of the budget"
            time.sleep(0.05)
        assert_over_budget(response)
    finally:
        sock.close()
    # 7 MiB fits only if the 6 MiB the client held are given back.
    deadline = time.monotonic() + 15
    while (response := post(budget_gateway, body_of(7 * MIB - 100))).status_code != 200:
        assert_over_budget(response)
        assert time.monotonic() < deadline, "the budget was not given back after the client left"
        time.sleep(0.05)


def test_a_head_declaring_the_budget_does_not_hold_it(fake: FakeEngine, start_gateway: StartGateway) -> None:
    """A head alone declaring nearly the whole budget reserves none of it: others' small requests go through.

    Its declared length was charged as the head arrived and held until the
    body timeout: a few such heads, sent by anyone, refused every request.
    """
    gateway = start_gateway({"fake": fake.url}, "--body-budget-bytes", "3000")
    small = body_of(200)
    sock = socket.create_connection(("127.0.0.1", gateway.port))
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nContent-Length: 2990\r\n\r\n"
        )
        # For a second after the head, no request is refused for what it declared.
        watch_until = time.monotonic() + 1
        while time.monotonic() < watch_until:
            response = post(gateway, small)
            assert response.status_code == 200, response.text
        # Its bytes are charged as they come: with 2000 of them held, a body declaring 1500 has no room.
        sock.sendall(b"{" + b" " * 1999)
        deadline = time.monotonic() + 15
        while (response := post(gateway, body_of(1500))).status_code == 200:
            assert time.monotonic() < deadline, "the bytes the head's body sent hold nothing of the budget"
            time.sleep(0.05)
        assert_over_budget(response)
        assert post(gateway, small).status_code == 200
    finally:
        sock.close()


def test_a_body_in_flight_costs_about_its_own_size(fake: FakeEngine, start_gateway: StartGateway) -> None:
    """Six concurrent 10 MiB bodies raise the gateway's peak memory by well under twice their size.

    They were held as pieces and joined (twice the body), then beside their
    parsed document (once more) while the upstream worked: about 2.7 times.
    """
    gateway = start_gateway({"fake": fake.url}, "--max-body-bytes", str(16 * MIB))
    count, size = 6, 10 * MIB
    base = rss_mib(gateway.proc.pid)
    peak = base
    with ThreadPoolExecutor(count) as pool:
        sent = [pool.submit(post, gateway, body_of(size), "prefill=1") for _ in range(count)]
        while not all(f.done() for f in sent):
            peak = max(peak, rss_mib(gateway.proc.pid))
            time.sleep(0.01)
        assert [f.result().status_code for f in sent] == [200] * count
    grown = peak - base
    assert grown < 2 * count * size / MIB, f"{grown:.0f} MiB for {count} bodies of {size // MIB} MiB"


def test_a_body_larger_than_the_whole_budget_gets_413_not_a_503_to_retry(
    fake: FakeEngine, start_gateway: StartGateway
) -> None:
    """With a budget below --max-body-bytes, a body that could never fit is too large (413), not retried."""
    gateway = start_gateway({"fake": fake.url}, "--body-budget-bytes", str(MIB))
    response = post(gateway, body_of(2 * MIB))
    assert response.status_code == 413, response.text
    assert "--body-budget-bytes" in response.json()["error"]["message"]
    assert post(gateway, body_of(MIB // 2)).status_code == 200
