"""The processes a benchmark runs side by side, and their CPU time from /proc.

Every process is started pinned to one core (``taskset``) when a core is
given: on this VM a wakeup across cores costs milliseconds, which would
swamp the tenth of a millisecond being measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[1]

_NGINX_CONF = """
worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    # As shipped: every request logged, in nginx's default (combined) format, to a file.
    {access_log}
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
            proxy_buffering off;{request_buffering}
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def pinned(argv: list[str], cpu: int | None) -> list[str]:
    return ["taskset", "-c", str(cpu), *argv] if cpu is not None else argv


def child_env(root: Path = ROOT) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1"}


@dataclass
class Process:
    """A started surface: where it listens and which pids do its work."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    # Headers every request to this surface carries (Portkey's routing headers), beside the workload's.
    headers: dict[str, str] = field(default_factory=dict)

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
    argv = [sys.executable, "-m", "tests.fake_engine", "--http11", "--port", "0", *args]
    return _start_announcing(
        "engine", "fake engine", argv, cpu, log_dir / f"fake-engine-{time.monotonic_ns()}.log"
    )


def start_fast_upstream(cpu: int | None, log_dir: Path) -> Process:
    """The fast upstream (``perf/fast_upstream.py``): a fixed ~1 KB completion for every POST, at once."""
    argv = [sys.executable, "-m", "perf.fast_upstream", "--port", "0"]
    return _start_announcing(
        "upstream", "fast upstream", argv, cpu, log_dir / f"fast-upstream-{time.monotonic_ns()}.log"
    )


def _start_announcing(name: str, what: str, argv: list[str], cpu: int | None, log_path: Path) -> Process:
    """A server that prints ``PORT <n>`` on stdout once it listens."""
    log = log_path.open("wb")
    proc = subprocess.Popen(pinned(argv, cpu), cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=log)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    proc.stdout.close()
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"{what} did not start: {line!r}")
    return Process(name, proc, int(line.split()[1]))


def start_blazar(
    upstreams: dict[str, str],
    cpu: int | None,
    log_dir: Path,
    *args: str,
    name: str = "blazar",
    root: Path = ROOT,
) -> Process:
    """blazar-proxy as a user runs it: its defaults, access log (stderr, here a file) and metrics on.

    ``root`` is the checkout whose code runs (another worktree, for a before-and-after in one run).
    """
    port = free_port()
    argv = [sys.executable, "-m", "proxy", "--port", str(port), "--log-level", "warning", *args]
    for model, url in upstreams.items():
        argv += ["--upstream", f"{model}={url}"]
    log = (log_dir / f"{name}-{port}.log").open("wb")
    proc = subprocess.Popen(
        pinned(argv, cpu), cwd=root, env=child_env(root), stdout=log, stderr=subprocess.STDOUT
    )
    wait_until_ready(f"http://127.0.0.1:{port}/livez", proc)
    return Process(name, proc, port)


def start_httpx_gateway(upstreams: dict[str, str], cpu: int | None, log_dir: Path) -> Process:
    return _start_relay("perf.httpx_gateway", "blazar-httpx", "httpx", upstreams, cpu, log_dir)


def start_floor(upstreams: dict[str, str], cpu: int | None, log_dir: Path) -> Process:
    """The floor (``perf/floor_proxy.py``): what a Python relay on uvloop and httptools costs at least."""
    return _start_relay("perf.floor_proxy", "floor", "floor", upstreams, cpu, log_dir)


def start_fused(upstreams: dict[str, str], cpu: int | None, log_dir: Path) -> Process:
    """The fused relay (``perf/fused_proxy.py``): the gateway's json work in the floor's shape."""
    return _start_relay("perf.fused_proxy", "fused", "fused", upstreams, cpu, log_dir)


def _start_relay(
    module: str, name: str, log_name: str, upstreams: dict[str, str], cpu: int | None, log_dir: Path
) -> Process:
    """One of perf's own relays (``--port``, ``--upstream MODEL=URL`` each), started and listening."""
    port = free_port()
    argv = [sys.executable, "-m", module, "--port", str(port)]
    for model, url in upstreams.items():
        argv += ["--upstream", f"{model}={url}"]
    log = (log_dir / f"{log_name}-{port}.log").open("wb")
    proc = subprocess.Popen(
        pinned(argv, cpu), cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT
    )
    wait_listening(port, proc)
    return Process(name, proc, port)


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)


def nginx_config(
    upstream_ports: list[int],
    port: int,
    prefix: Path,
    *,
    request_buffering: bool = True,
    access_log: bool = True,
) -> str:
    """nginx.conf: one worker, a keepalive upstream of ``upstream_ports``, no response buffering.

    ``request_buffering`` False adds ``proxy_request_buffering off`` (the request body streamed to
    the upstream as it comes instead of read whole first); ``access_log`` False turns the log off.
    """
    servers = "\n".join(f"        server 127.0.0.1:{p};" for p in upstream_ports)
    return _NGINX_CONF.format(
        prefix=prefix,
        servers=servers,
        port=port,
        access_log=f"access_log {prefix}/access.log combined;" if access_log else "access_log off;",
        request_buffering="" if request_buffering else "\n            proxy_request_buffering off;",
    )


def start_nginx(
    upstream_ports: list[int],
    cpu: int | None,
    work_dir: Path,
    *,
    request_buffering: bool = True,
    access_log: bool = True,
    name: str = "nginx",
) -> Process:
    """nginx from Debian, with a config written here (``nginx_config``): upstream keepalive, access log on."""
    binary = nginx_binary()
    if binary is None:
        raise RuntimeError("nginx is not installed (apt-get install nginx-light)")
    port = free_port()
    prefix = work_dir / f"{name}-{port}"
    prefix.mkdir(parents=True)
    conf = prefix / "nginx.conf"
    conf.write_text(
        nginx_config(upstream_ports, port, prefix, request_buffering=request_buffering, access_log=access_log)
    )
    log = (prefix / "stdout.log").open("wb")
    proc = subprocess.Popen(
        pinned([binary, "-p", str(prefix), "-c", str(conf)], cpu), stdout=log, stderr=subprocess.STDOUT
    )
    wait_listening(port, proc)
    return Process(name, proc, port)


@dataclass(frozen=True)
class LiteLLM:
    """A Python that has LiteLLM's proxy (``litellm[proxy]``), found by ``find_litellm``."""

    python: str
    version: str
    found_by: str


LITELLM_ENV = "BLAZAR_PERF_LITELLM_PYTHON"

# One model per fake engine, as an OpenAI-compatible upstream; nothing optional on:
# no database, no callbacks, no message logging, no background health checks.
# x- headers are forwarded so that the fake engine gets its x-fake workload
# header, as it does through the other surfaces. No master key: loopback only.
_LITELLM_CONF = """model_list:
{models}
litellm_settings:
  telemetry: false
  turn_off_message_logging: true
  callbacks: []
general_settings:
  forward_client_headers_to_llm_api: true
  disable_spend_logs: true
  disable_error_logs: true
  background_health_checks: false
  dangerously_permit_weak_or_unset_master_key: true
"""

_LITELLM_MODEL = """  - model_name: {name}
    litellm_params:
      model: openai/{name}
      api_base: {url}/v1
      api_key: none
"""


def find_litellm() -> LiteLLM | None:
    """LiteLLM's proxy, if installed: the Python in $BLAZAR_PERF_LITELLM_PYTHON, the `litellm` CLI's, ours."""
    candidates: list[tuple[str, str]] = []
    if os.environ.get(LITELLM_ENV):
        candidates.append((os.environ[LITELLM_ENV], f"${LITELLM_ENV}"))
    cli = shutil.which("litellm")
    if cli:
        with contextlib.suppress(OSError), open(cli, "rb") as script:
            first = script.readline()
            if first.startswith(b"#!"):
                candidates.append((first[2:].decode(errors="replace").strip(), f"the litellm CLI at {cli}"))
    candidates.append((sys.executable, "this Python"))
    # The version without importing litellm (seconds); fastapi stands for the [proxy] extra.
    probe = (
        "import importlib.metadata as m, importlib.util as u; "
        "u.find_spec('fastapi') and print(m.version('litellm'))"
    )
    for python, found_by in candidates:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            result = subprocess.run(
                [python, "-c", probe], capture_output=True, text=True, timeout=30, check=False
            )
            if result.returncode == 0 and result.stdout.strip():
                return LiteLLM(python, result.stdout.strip(), found_by)
    return None


def litellm_config(upstreams: dict[str, str]) -> str:
    """LiteLLM's config.yaml: each upstream as ``openai/<name>`` at ``<url>/v1``, optional features off."""
    models = "".join(_LITELLM_MODEL.format(name=name, url=url) for name, url in upstreams.items())
    return _LITELLM_CONF.format(models=models.rstrip("\n"))


def start_litellm(
    litellm: LiteLLM, upstreams: dict[str, str], cpu: int | None, work_dir: Path, timeout_s: float = 180.0
) -> Process:
    """LiteLLM's proxy in front of the fake engines, one uvicorn worker, its own logs at ERROR."""
    port = free_port()
    prefix = work_dir / f"litellm-{port}"
    prefix.mkdir(parents=True)
    conf = prefix / "config.yaml"
    conf.write_text(litellm_config(upstreams))
    argv = [
        litellm.python, "-m", "litellm.proxy.proxy_cli", "--config", str(conf),
        "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        PYTHONUNBUFFERED="1",
        # ERROR also sets its uvicorn's log level: no access log (blazar and nginx log here).
        LITELLM_LOG="ERROR",
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        LITELLM_TELEMETRY="False",
        LITELLM_MODE="PRODUCTION",
    )
    log = (prefix / "litellm.log").open("wb")
    proc = subprocess.Popen(pinned(argv, cpu), cwd=prefix, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}/health/liveliness", proc, timeout_s)
    except RuntimeError as exc:
        Process("litellm", proc, port).stop()
        raise RuntimeError(f"{exc}; log: {prefix / 'litellm.log'}") from exc
    return Process("litellm", proc, port)


@dataclass(frozen=True)
class Portkey:
    """Portkey's open-source gateway (npm ``@portkey-ai/gateway``), found by ``find_portkey``."""

    node: str
    entry: str  # the package's build/start-server.js
    version: str
    found_by: str


PORTKEY_ENV = "BLAZAR_PERF_PORTKEY_DIR"
PORTKEY_PACKAGE = Path("node_modules", "@portkey-ai", "gateway")


def _portkey_package(path: Path) -> Path | None:
    """The package directory for ``path``: the package itself, or an npm prefix that has it installed."""
    for candidate in (path, path / PORTKEY_PACKAGE):
        if (candidate / "build" / "start-server.js").is_file() and (candidate / "package.json").is_file():
            return candidate
    return None


def find_portkey() -> Portkey | None:
    """Portkey's gateway, if installed: under $BLAZAR_PERF_PORTKEY_DIR (an npm prefix or the package), or
    the ``gateway`` command on PATH where it is Portkey's; run by the ``node`` on PATH."""
    node = shutil.which("node")
    if node is None:
        return None
    candidates: list[tuple[Path, str]] = []
    if os.environ.get(PORTKEY_ENV):
        candidates.append((Path(os.environ[PORTKEY_ENV]), f"${PORTKEY_ENV}"))
    cli = shutil.which("gateway")
    if cli:
        # npm links the package's bin, build/start-server.js, as `gateway`.
        candidates.append((Path(cli).resolve().parent.parent, f"the gateway command at {cli}"))
    for path, found_by in candidates:
        package = _portkey_package(path)
        if package is None:
            continue
        with contextlib.suppress(OSError, ValueError):
            meta = json.loads((package / "package.json").read_text())
            if meta.get("name") == "@portkey-ai/gateway":
                entry = str(package / "build" / "start-server.js")
                return Portkey(node, entry, str(meta.get("version", "?")), found_by)
    return None


def portkey_headers(upstreams: dict[str, str]) -> dict[str, str]:
    """The headers that route a request through Portkey to ``upstreams`` (model name → base URL).

    One upstream: its documented per-request headers, provider ``openai`` at a custom host. Several: a
    config (``x-portkey-config``) that picks the target by the request's model (conditional routing).
    Either way ``x-fake`` is forwarded (the fake engine's workload header, as the other surfaces pass it).
    """
    forward = {"x-portkey-forward-headers": "x-fake"}
    if len(upstreams) == 1:
        (url,) = upstreams.values()
        return {"x-portkey-provider": "openai", "x-portkey-custom-host": f"{url}/v1", **forward}
    config = {
        "strategy": {
            "mode": "conditional",
            "conditions": [{"query": {"params.model": {"$eq": name}}, "then": name} for name in upstreams],
            "default": next(iter(upstreams)),
        },
        "targets": [
            {"name": name, "provider": "openai", "api_key": "none", "custom_host": f"{url}/v1"}
            for name, url in upstreams.items()
        ],
    }
    return {"x-portkey-config": json.dumps(config, separators=(",", ":")), **forward}


def portkey_command(portkey: Portkey, port: int) -> list[str]:
    """Portkey's server on ``port``, ``--headless``: no console UI, so no log stream to feed."""
    return [portkey.node, portkey.entry, f"--port={port}", "--headless"]


def portkey_env() -> dict[str, str]:
    # NODE_ENV=production: the other switch its start-up reads to leave the console (and its logs) out.
    return {**os.environ, "NODE_ENV": "production"}


def start_portkey(
    portkey: Portkey, upstreams: dict[str, str], cpu: int | None, work_dir: Path, timeout_s: float = 60.0
) -> Process:
    """Portkey's gateway (one Node process) in front of ``upstreams``, routed by request headers."""
    port = free_port()
    prefix = work_dir / f"portkey-{port}"
    prefix.mkdir(parents=True)
    log = (prefix / "portkey.log").open("wb")
    proc = subprocess.Popen(
        pinned(portkey_command(portkey, port), cpu),
        cwd=prefix,
        env=portkey_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    process = Process("portkey", proc, port, portkey_headers(upstreams))
    try:
        wait_until_ready(f"http://127.0.0.1:{port}/", proc, timeout_s)
    except RuntimeError as exc:
        process.stop()
        raise RuntimeError(f"{exc}; log: {prefix / 'portkey.log'}") from exc
    return process


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
