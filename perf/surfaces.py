"""The processes a benchmark runs side by side, and their CPU time from /proc.

Every process is started pinned to one core (``taskset``) when a core is
given: on this VM a wakeup across cores costs milliseconds, which would
swamp the tenth of a millisecond being measured.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

_NGINX_CONF = """
worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    upstream engines {{
{servers}
        keepalive 256;
        keepalive_requests 10000000;
    }}
    keepalive_requests 10000000;
    keepalive_timeout 600s;
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engines;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def pinned(argv: list[str], cpu: int | None) -> list[str]:
    return ["taskset", "-c", str(cpu), *argv] if cpu is not None else argv


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


@dataclass
class Process:
    """A started surface: where it listens and which pids do its work."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pids(self) -> list[int]:
        """The process and its children (nginx's workers)."""
        pids = [self.proc.pid]
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{self.proc.pid}/task"):
                children = Path(f"/proc/{self.proc.pid}/task/{task}/children").read_text().split()
                pids += [int(c) for c in children]
        return pids

    def cpu_s(self) -> float:
        """CPU time used so far by the process, its threads and children, in seconds."""
        total_ns = 0
        for pid in self.pids():
            with contextlib.suppress(OSError):
                for task in os.listdir(f"/proc/{pid}/task"):
                    # schedstat's first field: ns spent on a CPU (finer than /proc/pid/stat's ticks).
                    total_ns += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
        return total_ns / 1e9

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port} after {timeout_s} s")


def start_fake_engine(cpu: int | None, log_dir: Path, *args: str) -> Process:
    """The fast fake engine (HTTP/1.1 keep-alive, chunked streams)."""
    log = (log_dir / f"fake-engine-{time.monotonic_ns()}.log").open("wb")
    proc = subprocess.Popen(
        pinned([sys.executable, "-m", "tests.fake_engine", "--http11", "--port", "0", *args], cpu),
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=log,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    proc.stdout.close()
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"fake engine did not start: {line!r}")
    return Process("engine", proc, int(line.split()[1]))


def start_blazar(upstreams: dict[str, str], cpu: int | None, log_dir: Path, *args: str) -> Process:
    port = free_port()
    # Like nginx here (access_log off): the cost of a log line is not the relay's.
    argv = [
        sys.executable,
        "-m",
        "proxy",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--no-access-log",
        *args,
    ]
    for name, url in upstreams.items():
        argv += ["--upstream", f"{name}={url}"]
    log = (log_dir / f"blazar-{port}.log").open("wb")
    proc = subprocess.Popen(
        pinned(argv, cpu), cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT
    )
    wait_until_ready(f"http://127.0.0.1:{port}/livez", proc)
    return Process("blazar", proc, port)


def start_httpx_gateway(upstreams: dict[str, str], cpu: int | None, log_dir: Path) -> Process:
    port = free_port()
    argv = [sys.executable, "-m", "perf.httpx_gateway", "--port", str(port)]
    for name, url in upstreams.items():
        argv += ["--upstream", f"{name}={url}"]
    log = (log_dir / f"httpx-{port}.log").open("wb")
    proc = subprocess.Popen(
        pinned(argv, cpu), cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT
    )
    wait_listening(port, proc)
    return Process("blazar-httpx", proc, port)


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)


def start_nginx(upstream_ports: list[int], cpu: int | None, work_dir: Path) -> Process:
    """nginx from Debian, with a config written here: upstream keepalive, no buffering."""
    binary = nginx_binary()
    if binary is None:
        raise RuntimeError("nginx is not installed (apt-get install nginx-light)")
    port = free_port()
    prefix = work_dir / f"nginx-{port}"
    prefix.mkdir(parents=True)
    servers = "\n".join(f"        server 127.0.0.1:{p};" for p in upstream_ports)
    conf = prefix / "nginx.conf"
    conf.write_text(_NGINX_CONF.format(prefix=prefix, servers=servers, port=port))
    log = (prefix / "stdout.log").open("wb")
    proc = subprocess.Popen(
        pinned([binary, "-p", str(prefix), "-c", str(conf)], cpu), stdout=log, stderr=subprocess.STDOUT
    )
    wait_listening(port, proc)
    return Process("nginx", proc, port)


def wait_until_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=1) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"process exited with {proc.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if client.get(url).status_code == 200:
                    return
            time.sleep(0.05)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


@contextlib.contextmanager
def running(*processes: Process) -> Iterator[None]:
    try:
        yield
    finally:
        for process in processes:
            process.stop()
