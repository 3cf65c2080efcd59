"""Real processes on real sockets: the fake engine and the gateway (uvicorn).

Both run as subprocesses, started the way a user starts them, so that the
tests see what a client sees: framing, headers, disconnects and timing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import free_port, terminate

ROOT = Path(__file__).resolve().parents[2]
_START_TIMEOUT_S = 15.0


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT)
    return env


@dataclass
class Running:
    """A started subprocess and where it listens."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        terminate(self.proc, 5)


@dataclass
class FakeEngine(Running):
    """The fake engine, with access to what it recorded."""

    client: httpx.Client = field(default_factory=lambda: httpx.Client(trust_env=False, timeout=5))

    def records(self) -> list[dict[str, Any]]:
        response = self.client.get(f"{self.url}/_fake/requests")
        response.raise_for_status()
        records: list[dict[str, Any]] = response.json()
        return records

    def stop(self) -> None:
        self.client.close()
        super().stop()

    def reset(self) -> None:
        self.client.post(f"{self.url}/_fake/reset", content=b"").raise_for_status()

    def wait_for_record(
        self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 5.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            for record in self.records():
                if predicate(record):
                    return record
            if time.monotonic() > deadline:
                raise AssertionError(f"no matching record within {timeout_s} s: {self.records()}")
            time.sleep(0.02)


def _start_fake_engine(log_dir: Path, *args: str) -> FakeEngine:
    log_path = log_dir / f"fake-engine-{time.monotonic_ns()}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fake_engine", "--port", "0", *args],
            cwd=ROOT,
            env=_child_env(),
            stdout=subprocess.PIPE,
            stderr=log,
        )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"fake engine did not start: {line!r} {log_path.read_text()}")
    return FakeEngine(proc=proc, port=int(line.split()[1]), log_path=log_path)


def _start_gateway(log_dir: Path, upstreams: dict[str, str], *args: str) -> Running:
    port = int(args[args.index("--port") + 1]) if "--port" in args else free_port()
    log_path = log_dir / f"gateway-{port}.log"
    argv = [sys.executable, "-m", "proxy", "--log-level", "warning"]
    if "--port" not in args:
        argv += ["--port", str(port)]
    for name, url in upstreams.items():
        argv += ["--upstream", f"{name}={url}"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*argv, *args], cwd=ROOT, env=_child_env(), stdout=log, stderr=subprocess.STDOUT
        )
    gateway = Running(proc=proc, port=port, log_path=log_path)
    deadline = time.monotonic() + _START_TIMEOUT_S
    with httpx.Client(trust_env=False, timeout=1) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {proc.returncode}: {gateway.log()}")
            try:
                # Its own answer, not another listener's on a port taken between ``free_port`` and
                # the gateway's bind (the gateway then fails to bind, and says so, below).
                live = client.get(f"{gateway.url}/livez")
                if live.status_code == 200 and live.content == b'{"status":"ok"}':
                    return gateway
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                gateway.stop()
                raise RuntimeError(f"gateway did not start within {_START_TIMEOUT_S} s: {gateway.log()}")
            time.sleep(0.05)


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def engine(logs_dir: Path) -> Iterator[FakeEngine]:
    """One fake engine for the session, speaking HTTP/1.0 like mlx_lm.server."""
    fake = _start_fake_engine(logs_dir)
    yield fake
    fake.stop()


@pytest.fixture(scope="session")
def gateway(engine: FakeEngine, logs_dir: Path) -> Iterator[Running]:
    """One gateway for the session, serving models "fake" and "org/fake-2" from the engine."""
    gw = _start_gateway(logs_dir, {"fake": f"{engine.url}/v1", "org/fake-2": engine.url})
    yield gw
    gw.stop()


@pytest.fixture
def fake(engine: FakeEngine) -> FakeEngine:
    """The session's fake engine, with its records cleared."""
    engine.reset()
    return engine


StartFakeEngine = Callable[..., FakeEngine]
StartGateway = Callable[..., Running]


@pytest.fixture
def start_fake_engine(logs_dir: Path) -> Iterator[StartFakeEngine]:
    """Start extra fake engines with their own flags; each is stopped after the test."""
    started: list[Running] = []

    def start(*args: str) -> FakeEngine:
        fake = _start_fake_engine(logs_dir, *args)
        started.append(fake)
        return fake

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def start_gateway(logs_dir: Path) -> Iterator[StartGateway]:
    """Start extra gateways with their own flags; each is stopped after the test."""
    started: list[Running] = []

    def start(upstreams: dict[str, str], *args: str) -> Running:
        gw = _start_gateway(logs_dir, upstreams, *args)
        started.append(gw)
        return gw

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    """A plain httpx client that ignores proxy variables."""
    with httpx.Client(trust_env=False, timeout=10) as client:
        yield client


def openai_client(base_url: str, timeout_s: float = 10.0) -> openai.OpenAI:
    """The official client as a user would make it, minus retries and proxy variables."""
    return openai.OpenAI(
        base_url=f"{base_url}/v1",
        api_key="unused",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(trust_env=False, timeout=timeout_s),
    )
