"""Two gateways behind a real nginx, configured by the shipped deploy/nginx.conf.

Load spreads over both; a gateway that drains under load loses nothing (its
streams finish, its 503 `draining` is retried on the other); it restarts and
rejoins. HAProxy's config, deploy/haproxy.cfg, is run by test_haproxy.py.
"""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from perf.surfaces import nginx_binary
from tests.e2e.balancers import chat, counted, start_pair, wait_listening
from tests.e2e.conftest import ROOT, FakeEngine, StartGateway
from tests.helpers import free_port

pytestmark = pytest.mark.fault("balancers", "nginx in front")


def render_nginx(work: Path, listen: int, backends: list[int]) -> Path:
    """deploy/nginx.conf with this test's ports, and a prefix nginx can write to."""
    text = (ROOT / "deploy" / "nginx.conf").read_text()
    text = text.replace("listen 127.0.0.1:8000;", f"listen 127.0.0.1:{listen};")
    text = text.replace("server 127.0.0.1:8001 ", f"server 127.0.0.1:{backends[0]} ")
    text = text.replace("server 127.0.0.1:8002 ", f"server 127.0.0.1:{backends[1]} ")
    text = text.replace(
        "worker_processes auto;",
        f"worker_processes 1;\ndaemon off;\npid {work}/nginx.pid;\nerror_log {work}/error.log;",
    )
    text = text.replace(
        "http {",
        f"http {{\n    access_log off;\n    client_body_temp_path {work}/body;\n"
        f"    proxy_temp_path {work}/proxy;",
    )
    conf = work / "nginx.conf"
    conf.write_text(text)
    return conf


@pytest.fixture
def nginx_front(tmp_path: Path) -> Iterator[tuple[int, list[int], Path]]:
    binary = nginx_binary()
    if binary is None:
        pytest.skip("nginx is not installed; scripts/test installs it")
    listen, backends = free_port(), [free_port(), free_port()]
    conf = render_nginx(tmp_path, listen, backends)
    proc = subprocess.Popen([binary, "-p", str(tmp_path), "-c", str(conf)], stderr=subprocess.DEVNULL)
    wait_listening(listen)
    yield listen, backends, tmp_path
    proc.terminate()
    proc.wait(5)


def test_load_spreads_and_a_drained_gateway_loses_nothing(
    nginx_front: tuple[int, list[int], Path],
    start_gateway: StartGateway,
    fake: FakeEngine,
    http: httpx.Client,
) -> None:
    """Through nginx: both gateways serve; SIGTERM one under load: every request succeeds; it rejoins."""
    listen, ports, _ = nginx_front
    front = f"http://127.0.0.1:{listen}"
    first, second = start_pair(start_gateway, fake, ports)
    for _ in range(10):
        assert chat(http, front).status_code == 200
    assert counted(first, http) > 0 and counted(second, http) > 0

    def one(i: int) -> bytes:
        with httpx.Client(trust_env=False, timeout=30) as client:
            response = chat(client, front, stream=bool(i % 2))
            assert response.status_code == 200, response.text
            return response.content

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        time.sleep(0.3)
        first.proc.send_signal(signal.SIGTERM)
        futures += [pool.submit(one, i) for i in range(8, 24)]
        results = [f.result(timeout=60) for f in futures]
    for i, content in enumerate(results):
        if i % 2:
            assert content.rstrip().endswith(b"data: [DONE]"), content[-200:]
            assert b'"error"' not in content
        else:
            assert b'"choices"' in content
    assert first.proc.wait(15) == 0

    # The drained gateway comes back on its port and serves again.
    again = start_gateway({"fake": fake.url}, "--port", str(ports[0]))
    deadline = time.monotonic() + 10
    while counted(again, http) == 0 and time.monotonic() < deadline:
        chat(http, front)
    assert counted(again, http) > 0
