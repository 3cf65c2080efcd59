"""Helpers for the tests that put gateways behind a real load balancer (nginx, HAProxy).

Waits are conditions with deadlines, never fixed sleeps: the suite runs on
small, busy machines.
"""

from __future__ import annotations

import socket

import httpx

from tests.e2e.conftest import FakeEngine, Running, StartGateway
from tests.helpers import wait_until

CHAT = "/v1/chat/completions"


def wait_listening(port: int, timeout_s: float = 10.0) -> None:
    """Return once something accepts connections on 127.0.0.1:port."""

    def accepts() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return False
        return True

    wait_until(accepts, f"a listener on port {port}", timeout_s=timeout_s)


def replace_once(text: str, old: str, new: str) -> str:
    """``text`` with ``old`` replaced; fails when ``old`` is not there exactly once.

    The tests render the shipped configs: an edit that moves what they
    substitute must fail loudly, not run an unrendered config.
    """
    count = text.count(old)
    if count != 1:
        raise AssertionError(f"expected {old!r} once in the config, found it {count} times")
    return text.replace(old, new)


def start_pair(
    start_gateway: StartGateway, fake: FakeEngine, ports: list[int], drain_timeout_s: float = 10
) -> list[Running]:
    """Two gateways on the given ports, both serving model "fake" from the fake engine."""
    drain = f"{drain_timeout_s:g}"
    return [
        start_gateway({"fake": fake.url}, "--drain-timeout", drain, "--port", str(port)) for port in ports
    ]


def _metric_sum(gateway: Running, http: httpx.Client, prefix: str) -> float:
    text = http.get(gateway.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def counted(gateway: Running, http: httpx.Client) -> float:
    """Relayed requests this gateway has finished (its /metrics)."""
    return _metric_sum(gateway, http, "blazar_requests_total{")


def in_flight(gateway: Running, http: httpx.Client) -> float:
    """Relayed requests this gateway is serving now (its /metrics)."""
    return _metric_sum(gateway, http, "blazar_requests_in_flight{")


def chat(http: httpx.Client, url: str, **fields: object) -> httpx.Response:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    return http.post(url + CHAT, json=body, headers={"x-fake": "chunks=20; chunk-delay=0.05"})


def served_ids(gateway: Running) -> set[str]:
    """Request ids this gateway answered 200 to, from its access log (text format)."""
    ids = set()
    for line in gateway.log().splitlines():
        if '" 200 ' in line and " id=" in line:
            ids.add(line.rsplit(" id=", 1)[1].strip())
    return ids
