"""The keep-alive race behind a balancer, through the shipped nginx and HAProxy configs.

A balancer keeps idle connections to the gateway for reuse. If the gateway
closes one first (uvicorn's idle keep-alive was a fixed 5 s), the balancer can
write the next request into a connection that is closing, and its client gets
a 502. The rule (README, deploy/): the gateway's --keep-alive-timeout must be
longer than the balancer's idle limit, so that the balancer is the one that
closes. nginx has such a limit (keepalive_timeout). HAProxy has none: it keeps
an idle connection while recent traffic says it may need it, so behind it the
gateway does close first, and the shipped config's `retry-on empty-response`
sends a request that met a closing connection again.

The tests scale the limits down to seconds (the shipped ones are 60 s for
nginx and 75 s for the gateway) and space requests just before and just after
each limit. Each request must succeed. Who closed each connection that
carried a request is read from the kernel: the side that closes first keeps
the socket in TIME_WAIT. Behind nginx the gateway never closes first, and a
test that breaks the rule on purpose sees it close first, so that the check
is shown to see it; behind HAProxy it closes first, as it must for the race
to be tried.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from perf.surfaces import nginx_binary
from tests.e2e.balancers import CHAT, replace_once, wait_listening
from tests.e2e.conftest import FakeEngine, StartGateway
from tests.e2e.test_haproxy import HAProxy, haproxy_binary, render_haproxy
from tests.e2e.test_load_balancer import render_nginx
from tests.helpers import free_port

pytestmark = pytest.mark.fault("balancers", "idle connections at the keep-alive limits")

# States in /proc/net/tcp.
_ESTABLISHED, _TIME_WAIT = "01", "06"


def _sockets(port: int) -> list[tuple[int, str]]:
    """(peer port, state) of each IPv4 socket whose local port is ``port``."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, peer, state = fields[1], fields[2], fields[3]
        if int(local.rsplit(":", 1)[1], 16) == port and state in (_ESTABLISHED, _TIME_WAIT):
            found.append((int(peer.rsplit(":", 1)[1], 16), state))
    return found


@dataclass
class Connections:
    """The balancer's connections to one gateway, as the gateway's kernel sees them."""

    gateway_port: int
    used: set[int] = field(default_factory=set)

    def note_used(self) -> None:
        """Remember the kept-alive connections (called right after a request was answered).

        Open now and still open a moment later: HAProxy's health checks come
        on connections of their own that last a few milliseconds (and that the
        gateway closes, as HTTP/1.0 asks), and are not counted.
        """

        def open_now() -> set[int]:
            return {peer for peer, state in _sockets(self.gateway_port) if state == _ESTABLISHED}

        first = open_now()
        time.sleep(0.05)  # a moment for a check's connection to end
        self.used |= first & open_now()

    def closed_by_gateway(self) -> set[int]:
        """Connections that carried requests and that the gateway closed first."""
        return {peer for peer, state in _sockets(self.gateway_port) if state == _TIME_WAIT} & self.used


def spaced_requests(url: str, connections: Connections, spacings_s: list[float]) -> list[str]:
    """One request, then one more after each pause; returns what went wrong (nothing, when all is well)."""
    problems = []
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(trust_env=False, timeout=10) as client:
        for pause_s in [0.0, *spacings_s]:
            # The spacing is the point of the test: the pause is the idle time itself.
            time.sleep(pause_s)
            try:
                response = client.post(url + CHAT, json=body)
            except httpx.HTTPError as exc:
                problems.append(f"after {pause_s} s idle: {exc!r}")
                continue
            if response.status_code != 200:
                problems.append(f"after {pause_s} s idle: {response.status_code} {response.text[:200]}")
            connections.note_used()
    return problems


def around(*limits_s: float) -> list[float]:
    """Pauses just before and just after each limit."""
    return [pause for limit in limits_s for pause in (limit - 0.1, limit + 0.1)]


@pytest.fixture
def one_gateway_nginx(tmp_path: Path) -> Iterator[Callable[[int, str], str]]:
    """Start the shipped nginx config in front of one gateway port, with its idle limit scaled."""
    binary = nginx_binary()
    if binary is None:
        pytest.skip("nginx is not installed; scripts/test installs it")
    procs: list[subprocess.Popen[bytes]] = []

    def start(gateway_port: int, keepalive_timeout: str) -> str:
        listen, unused = free_port(), free_port()
        conf = render_nginx(tmp_path, listen, [gateway_port, unused])
        text = conf.read_text()
        text = replace_once(text, "keepalive_timeout 60s;", f"keepalive_timeout {keepalive_timeout};")
        # One gateway: each request reuses the same idle connection.
        text = replace_once(text, f"server 127.0.0.1:{unused} max_fails=1 fail_timeout=2s;", "")
        conf.write_text(text)
        procs.append(
            subprocess.Popen([binary, "-p", str(tmp_path), "-c", str(conf)], stderr=subprocess.DEVNULL)
        )
        wait_listening(listen)
        return f"http://127.0.0.1:{listen}"

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(5)


@pytest.fixture
def one_gateway_haproxy(tmp_path: Path) -> Iterator[Callable[[int], str]]:
    """Start the shipped HAProxy config in front of one gateway port."""
    binary = haproxy_binary()
    if binary is None:
        pytest.skip("haproxy is not installed; scripts/test installs it")
    procs: list[HAProxy] = []

    def start(gateway_port: int) -> str:
        listen, unused, admin_port = free_port(), free_port(), free_port()
        conf = render_haproxy(tmp_path, listen, [gateway_port, unused], admin_port)
        text = conf.read_text()
        text = replace_once(text, f"\n    server gw2 127.0.0.1:{unused}", "")
        conf.write_text(text)
        log_path = tmp_path / "haproxy.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen([binary, "-db", "-f", str(conf)], stdout=log, stderr=subprocess.STDOUT)
        haproxy = HAProxy(proc, listen, admin_port, log_path)
        procs.append(haproxy)
        wait_listening(listen)
        wait_listening(admin_port)
        haproxy.wait_status("gw1", "UP", 10)
        return haproxy.url

    yield start
    for haproxy in procs:
        haproxy.proc.terminate()
        haproxy.proc.wait(5)


def test_nginx_idle_limit_below_the_gateways_loses_no_request(
    start_gateway: StartGateway, fake: FakeEngine, one_gateway_nginx: Callable[[int, str], str]
) -> None:
    """nginx at 2 s idle, the gateway at 3 s: requests spaced at both limits succeed; nginx closes first."""
    port = free_port()
    start_gateway({"fake": fake.url}, "--port", str(port), "--keep-alive-timeout", "3")
    url = one_gateway_nginx(port, "2s")
    connections = Connections(port)
    assert spaced_requests(url, connections, around(2, 3)) == []
    assert connections.used, "no connection from nginx was seen"
    assert connections.closed_by_gateway() == set()


def test_haproxy_reusing_a_connection_the_gateway_is_closing_loses_no_request(
    start_gateway: StartGateway, fake: FakeEngine, one_gateway_haproxy: Callable[[int], str]
) -> None:
    """Requests spaced at the gateway's 2 s limit, to the millisecond, behind HAProxy: none fails."""
    port = free_port()
    start_gateway({"fake": fake.url}, "--port", str(port), "--keep-alive-timeout", "2")
    url = one_gateway_haproxy(port)
    connections = Connections(port)
    # The gateway's timer starts as its response ends, a fraction of a
    # millisecond before the client has it: sweep the pause across that.
    sweep = [2 + offset_ms / 1000 for offset_ms in range(-4, 5)]
    assert spaced_requests(url, connections, [*around(2), *sweep]) == []
    assert connections.used, "no connection from HAProxy was seen"
    assert connections.closed_by_gateway(), "the gateway closed no connection first: the race was not tried"


def test_a_gateway_idle_limit_below_nginxs_closes_first(
    start_gateway: StartGateway, fake: FakeEngine, one_gateway_nginx: Callable[[int, str], str]
) -> None:
    """The rule broken (gateway 1 s, nginx 5 s): the gateway closes a connection nginx still holds."""
    port = free_port()
    start_gateway({"fake": fake.url}, "--port", str(port), "--keep-alive-timeout", "1")
    url = one_gateway_nginx(port, "5s")
    connections = Connections(port)
    spaced_requests(url, connections, [1.5])
    assert connections.closed_by_gateway(), (
        "the gateway closed no connection first: the check cannot see the race"
    )
