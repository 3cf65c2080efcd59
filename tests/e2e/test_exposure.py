"""A gateway that listens beyond this machine without an API key says so when it starts."""

from __future__ import annotations

import time

from tests.e2e.conftest import FakeEngine, Running, StartGateway
from tests.helpers import free_port

WARNING = "without an API key: anyone who can reach this address can run generations"


def log_once_ready(gateway: Running, timeout_s: float = 10.0) -> str:
    """The gateway's output once its ready line is there (the warning comes before it)."""
    deadline = time.monotonic() + timeout_s
    while "ready:" not in gateway.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    return gateway.log()


def test_a_gateway_open_to_the_network_without_a_key_warns(
    start_gateway: StartGateway, fake: FakeEngine
) -> None:
    """--host 0.0.0.0 without a key prints what is open and what to do; with a key it prints nothing."""
    port = free_port()
    gateway = start_gateway({"fake": fake.url}, "--host", "0.0.0.0", "--port", str(port))
    log = log_once_ready(gateway)
    warnings = [line for line in log.splitlines() if WARNING in line]
    assert len(warnings) == 1, log
    (warning,) = warnings
    assert warning.startswith(f"blazar-proxy: warning: listening on 0.0.0.0:{port} without an API key")
    assert "--api-key KEY (or BLAZAR_API_KEY" in warning
    assert "--host 127.0.0.1" in warning
    gateway.stop()
    keyed = start_gateway({"fake": fake.url}, "--host", "0.0.0.0", "--api-key", "k")
    assert "ready:" in log_once_ready(keyed)
    assert WARNING not in keyed.log()


def test_a_loopback_gateway_without_a_key_does_not_warn(
    start_gateway: StartGateway, fake: FakeEngine
) -> None:
    """The default --host (127.0.0.1) and localhost (127.0.0.1 and ::1) are this machine only: no warning."""
    for host in ("127.0.0.1", "localhost"):
        gateway = start_gateway({"fake": fake.url}, "--host", host)
        assert "ready:" in log_once_ready(gateway)
        assert WARNING not in gateway.log()
