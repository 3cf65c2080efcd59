"""Idle upstream connections are closed on the pool's timer, not only when a next request comes.

A burst opens as many connections to an upstream as it had requests at once;
once it is over they sit idle in the pool. Retired only when a next request
came for that upstream, they held their descriptors for as long as none came
(a later burst to another model then ran out of descriptors). The fake engine
in ``--http11`` mode never closes an idle connection itself, so only the
gateway's timer can.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import StartFakeEngine, StartGateway

pytestmark = pytest.mark.fault("overload", "idle upstream connections, closed on a timer")

# The pool's idle limit (proxy/pool.py), and a generous margin on a busy machine.
_IDLE_LIMIT_S = 4.0
_MARGIN_S = 8.0
_BURST = 24


def upstream_sockets(pid: int, upstream_port: int) -> int:
    """How many of process ``pid``'s open descriptors are TCP sockets connected to ``upstream_port``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == upstream_port and fields[9] in inodes:
                count += 1
    return count


def test_idle_upstream_connections_close_on_a_timer_without_a_next_request(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway
) -> None:
    """After a burst, the gateway's idle connections to the upstream close within the idle limit, unasked."""
    engine = start_fake_engine("--http11", "--prefill", "0.3")
    gateway = start_gateway({"fake": engine.url})
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    def one(_: int) -> int:
        with httpx.Client(trust_env=False, timeout=30) as client:
            return client.post(f"{gateway.url}/v1/chat/completions", json=body).status_code

    with ThreadPoolExecutor(_BURST) as pool:
        statuses = list(pool.map(one, range(_BURST)))
    burst_over = time.monotonic()
    assert statuses == [200] * _BURST
    opened = upstream_sockets(gateway.proc.pid, engine.port)
    assert opened > 1, "the burst ran its requests one at a time: nothing to see"
    deadline = burst_over + _IDLE_LIMIT_S + _MARGIN_S
    left = opened
    while time.monotonic() < deadline:
        left = upstream_sockets(gateway.proc.pid, engine.port)
        if left == 0:
            break
        time.sleep(0.2)
    waited_s = time.monotonic() - burst_over
    assert left == 0, f"{left} of {opened} idle upstream connections open {waited_s:.1f} s after the burst"
    # And the pool still serves: the next request opens a fresh connection.
    assert one(0) == 200
