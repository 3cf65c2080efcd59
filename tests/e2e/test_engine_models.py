"""Many engine models behind one gateway, with the real mlx engine on the CPU.

A config file names several models served by mlx-0.32.0 children (the demo
model, generated locally, under several names). These tests show lazy
starts with single flight, least-recently-used eviction under --max-loaded
that spares models in use, replicas sharing the load, aliases, idle
unloading, the admin endpoints and /v1/models' states, all with real child
processes.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ROOT
from tests.e2e.test_engine_mlx import ENGINE, _env
from tests.e2e.test_engine_mlx import engine_installed as engine_installed
from tests.helpers import engine_home, free_port, pid_alive, terminate, wait_until

_READY_TIMEOUT_S = 180.0
_CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def demo_model(engine_installed: None) -> Path:
    """The tiny demo model, generated with the engine's own Python (once per home)."""
    home = engine_home()
    target = home / "models" / "blazar-demo-qwen2-tiny"
    python = home / "engines" / ENGINE / "venv" / "bin" / "python"
    subprocess.run(
        [str(python), str(ROOT / "engines" / "demo_model.py"), "--out", str(target), "--preset", "tiny"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


class ConfigGateway:
    """A gateway started with --config, its log, and helpers to ask it things."""

    def __init__(self, config: str, tmp_path: Path, *args: str) -> None:
        self.port = free_port()
        self.config_path = tmp_path / "blazar.toml"
        self.config_path.write_text(config)
        self.log_path = tmp_path / f"gateway-{self.port}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "proxy",
                    "--config",
                    str(self.config_path),
                    "--port",
                    str(self.port),
                    *args,
                ],
                cwd=ROOT,
                env=_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.http = httpx.Client(base_url=self.url, trust_env=False, timeout=120)
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while True:
            try:
                if self.http.get("/livez").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"gateway did not start: {self.log()}")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def states(self) -> dict[str, str]:
        return {m["id"]: m["state"] for m in self.http.get("/v1/models").json()["data"]}

    def metric(self, name: str, **labels: str) -> float:
        text = self.http.get("/metrics").text
        wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
        match = re.search(rf"^{re.escape(name)}{{{re.escape(wanted)}}} (\S+)$", text, re.MULTILINE)
        assert match, f"{name}{{{wanted}}} not in /metrics"
        return float(match.group(1))

    def chat(self, model: str, max_tokens: int = 4) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
        return self.http.post(_CHAT, json=body)

    def wait_state(self, model: str, state: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.states()[model] != state:
            if time.monotonic() > deadline:
                raise AssertionError(f"{model} is {self.states()[model]}, not {state}: {self.log()}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.http.close()
        terminate(self.proc, 30)


def _model_table(name: str, model: Path | str, engine: str = ENGINE, **extra: object) -> str:
    lines = [f"[models.{name}]", f'engine = "{engine}"', 'variant = "cpu"', f'model = "{model}"']
    for key, value in extra.items():
        rendered = str(value).lower() if isinstance(value, bool) else repr(value).replace("'", '"')
        lines.append(f"{key.replace('_', '-')} = {rendered}")
    return "\n".join(lines) + "\n"


def _requests_in(log: Path) -> int:
    """POSTs to chat completions that an mlx child logged (readiness probes included)."""
    if not log.exists():
        return 0
    return log.read_text(errors="replace").count('"POST /v1/chat/completions HTTP/1.1" 200')


def _start_stream(gateway: ConfigGateway, model: str, max_tokens: int) -> tuple[threading.Thread, list[str]]:
    """A long stream in a thread, returned once its first events came; the list fills as more come."""
    events: list[str] = []

    def stream() -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
        with (
            httpx.Client(trust_env=False, timeout=120) as client,
            client.stream("POST", f"{gateway.url}{_CHAT}", json={**body, "stream": True}) as response,
        ):
            for line in response.iter_lines():
                if line.startswith("data:"):
                    # One at a time, as they arrive: the caller watches the list.
                    events.append(line)  # noqa: PERF401

    streaming = threading.Thread(target=stream)
    streaming.start()
    deadline = time.monotonic() + 30
    while len(events) < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(events) >= 5, f"the stream on {model} did not start"
    return streaming, events


@pytest.fixture
def gateway_factory(tmp_path: Path) -> Iterator[list[ConfigGateway]]:
    started: list[ConfigGateway] = []
    yield started
    for gateway in started:
        gateway.stop()


async def _concurrent_chats(url: str, model: str, count: int) -> list[int]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    limits = httpx.Limits(max_connections=count)
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=180, limits=limits) as client:
        responses = await asyncio.gather(*(client.post(_CHAT, json=body) for _ in range(count)))
    return [r.status_code for r in responses]


def test_lazy_single_flight_lru_eviction_replicas_and_aliases(
    demo_model: Path, tmp_path: Path, gateway_factory: list[ConfigGateway]
) -> None:
    """Cold models start on first use, once for 50 requests; --max-loaded 1 swaps them, never under one."""
    config = "[gateway]\nmax-loaded = 1\n\n" + _model_table("a", demo_model, replicas=2)
    # b's engine is picked from its model's format: an MLX directory.
    config += _model_table("b", demo_model, engine="auto", aliases=["gpt-4o-mini"])
    gateway = ConfigGateway(config, tmp_path)
    gateway_factory.append(gateway)
    logs = engine_home() / "logs"

    # Nothing runs until asked; the gateway is ready all the same (a request would start a model).
    assert gateway.states() == {"a": "unloaded", "b": "unloaded"}
    assert gateway.http.get("/readyz").status_code == 200
    assert re.search(r"engine auto for 'b': .*: mlx-0\.32\.0", gateway.log()), gateway.log()

    # 50 concurrent first requests for b: one child start, all answered.
    statuses = asyncio.run(_concurrent_chats(gateway.url, "b", 50))
    assert statuses == [200] * 50
    assert gateway.metric("blazar_engine_child_starts_total", model="b", replica="0") == 1.0
    assert gateway.states() == {"a": "unloaded", "b": "loaded"}

    # a needs b's slot: b is idle, so it is unloaded; a's two replicas share the load.
    statuses = asyncio.run(_concurrent_chats(gateway.url, "a", 16))
    assert statuses == [200] * 16
    assert gateway.states() == {"a": "loaded", "b": "unloaded"}
    # The load ends when one replica is ready; once both are, they share the requests.
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while not all(gateway.metric("blazar_engine_child_ready", model="a", replica=str(i)) for i in (0, 1)):
        assert time.monotonic() < deadline, gateway.log()
        time.sleep(0.1)
    before = {i: _requests_in(logs / f"{ENGINE}--a-{i}.log") for i in (0, 1)}
    statuses = asyncio.run(_concurrent_chats(gateway.url, "a", 16))
    assert statuses == [200] * 16
    served = {i: _requests_in(logs / f"{ENGINE}--a-{i}.log") - before[i] for i in (0, 1)}
    assert served[0] >= 4 and served[1] >= 4 and served[0] + served[1] == 16, served

    # An alias loads b (a is idle) and is answered by b's child.
    response = gateway.chat("gpt-4o-mini")
    assert response.status_code == 200, response.text
    assert gateway.states() == {"a": "unloaded", "b": "loaded"}

    # While a long stream on b runs, a cannot take b's slot: 503 with the reason, and the stream finishes.
    streaming, events = _start_stream(gateway, "b", max_tokens=3000)
    refused = gateway.chat("a")
    still_streaming = streaming.is_alive()
    streaming.join(120)
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"]
    assert "--max-loaded" in refused.json()["error"]["message"]
    assert still_streaming, "the stream ended before a was asked for; the test proved nothing"
    assert events[-1] == "data: [DONE]"
    assert gateway.states()["b"] == "loaded"

    # The admin endpoints: unload b, load a (which now fits).
    response = gateway.http.post("/admin/models/b/unload")
    assert response.status_code == 200 and response.json()["state"] == "unloaded"
    response = gateway.http.post("/admin/models/a/load")
    assert response.status_code == 200 and response.json()["state"] == "loaded", response.text
    assert gateway.states() == {"a": "loaded", "b": "unloaded"}
    response = gateway.http.post("/admin/models/nope/load")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_idle_model_is_unloaded_after_its_ttl_and_loads_again(
    demo_model: Path, tmp_path: Path, gateway_factory: list[ConfigGateway]
) -> None:
    """A model with ttl = 2 is unloaded after 2 s without requests; the next request starts it again."""
    gateway = ConfigGateway(_model_table("idle", demo_model, ttl=2), tmp_path)
    gateway_factory.append(gateway)
    assert gateway.chat("idle").status_code == 200
    assert gateway.states()["idle"] == "loaded"
    gateway.wait_state("idle", "unloaded", timeout_s=30)
    assert "idle for 2 s" in gateway.log()
    assert gateway.chat("idle").status_code == 200
    assert gateway.metric("blazar_engine_child_starts_total", model="idle", replica="0") == 2.0


def test_always_loaded_model_starts_with_the_gateway(
    engine_installed: None, tmp_path: Path, gateway_factory: list[ConfigGateway]
) -> None:
    """always-loaded = true starts the child at startup (here model = "builtin:tiny", by name)."""
    gateway = ConfigGateway(_model_table("eager", "builtin:tiny", always_loaded=True), tmp_path)
    gateway_factory.append(gateway)
    assert gateway.states()["eager"] in ("loading", "loaded")
    gateway.wait_state("eager", "loaded", timeout_s=_READY_TIMEOUT_S)
    assert gateway.metric("blazar_engine_child_starts_total", model="eager", replica="0") == 1.0


def _replica_pids(gateway: ConfigGateway, model: str, replicas: int) -> dict[int, int]:
    """Replica index → pid of its running child, from the child logs' ports and the gateway's ready lines."""
    logs = engine_home() / "logs"
    pids: dict[int, int] = {}
    for index in range(replicas):
        name = f"{ENGINE}--{model}" + (f"-{index}" if replicas > 1 else "")
        text = (logs / f"{name}.log").read_text(errors="replace")
        port = re.findall(r"Starting httpd at 127\.0\.0\.1 on port (\d+)", text)[-1]
        found = re.findall(rf"serving '{model}':.*pid (\d+), port {port}, ready", gateway.log())
        pids[index] = int(found[-1])
    return pids


@pytest.mark.fault("engines", "a replica that fails")
def test_failed_replica_leaves_rotation_and_its_request_is_not_retried(
    demo_model: Path, tmp_path: Path, gateway_factory: list[ConfigGateway]
) -> None:
    """Killing the replica under a stream ends it with an error event, unretried; the other one serves."""
    gateway = ConfigGateway(_model_table("pair", demo_model, replicas=2, always_loaded=True), tmp_path)
    gateway_factory.append(gateway)
    gateway.wait_state("pair", "loaded", timeout_s=_READY_TIMEOUT_S)
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while not all(gateway.metric("blazar_engine_child_ready", model="pair", replica=str(i)) for i in (0, 1)):
        assert time.monotonic() < deadline, gateway.log()
        time.sleep(0.1)
    logs = engine_home() / "logs"
    before = {i: _requests_in(logs / f"{ENGINE}--pair-{i}.log") for i in (0, 1)}

    streaming, events = _start_stream(gateway, "pair", max_tokens=5000)
    during = {i: _requests_in(logs / f"{ENGINE}--pair-{i}.log") - before[i] for i in (0, 1)}
    assert sorted(during.values()) == [0, 1], during
    victim = 0 if during[0] else 1
    other = 1 - victim
    os.kill(_replica_pids(gateway, "pair", 2)[victim], signal.SIGKILL)
    streaming.join(60)
    assert not streaming.is_alive()
    assert events[-1] != "data: [DONE]" and '"error"' in events[-1], events[-3:]
    # The stream was not sent again to the other replica.
    assert _requests_in(logs / f"{ENGINE}--pair-{other}.log") == before[other]

    # Out of rotation until ready again: every request meanwhile goes to the other replica.
    deadline = time.monotonic() + 30
    while gateway.metric("blazar_engine_child_ready", model="pair", replica=str(victim)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    statuses = asyncio.run(_concurrent_chats(gateway.url, "pair", 8))
    assert statuses == [200] * 8
    # And back in rotation once its restart is ready.
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while not gateway.metric("blazar_engine_child_ready", model="pair", replica=str(victim)):
        assert time.monotonic() < deadline, gateway.log()
        time.sleep(0.1)
    assert gateway.metric("blazar_engine_child_restarts_total", model="pair", replica=str(victim)) == 1.0
    served_before = _requests_in(logs / f"{ENGINE}--pair-{victim}.log")
    statuses = asyncio.run(_concurrent_chats(gateway.url, "pair", 8))
    assert statuses == [200] * 8
    assert _requests_in(logs / f"{ENGINE}--pair-{victim}.log") > served_before


def test_reload_restarts_only_the_changed_model(
    demo_model: Path, tmp_path: Path, gateway_factory: list[ConfigGateway]
) -> None:
    """SIGHUP after changing y's engine args restarts y alone; a stream in flight on x runs on untouched."""
    config = _model_table("x", demo_model, always_loaded=True) + _model_table(
        "y", demo_model, always_loaded=True
    )
    gateway = ConfigGateway(config, tmp_path)
    gateway_factory.append(gateway)
    gateway.wait_state("x", "loaded", timeout_s=_READY_TIMEOUT_S)
    gateway.wait_state("y", "loaded", timeout_s=_READY_TIMEOUT_S)
    old_y = _replica_pids(gateway, "y", 1)[0]
    streaming, events = _start_stream(gateway, "x", max_tokens=3000)
    gateway.config_path.write_text(
        _model_table("x", demo_model, always_loaded=True)
        + _model_table("y", demo_model, always_loaded=True, engine_args=["--max-tokens", "64"])
    )
    gateway.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while "reload: restarted y" not in gateway.log():
        assert time.monotonic() < deadline, gateway.log()
        time.sleep(0.05)
    assert streaming.is_alive(), "x's stream ended before the reload; the test proved nothing"
    streaming.join(120)
    assert events[-1] == "data: [DONE]"
    gateway.wait_state("y", "loaded", timeout_s=_READY_TIMEOUT_S)
    assert gateway.chat("y").status_code == 200
    assert gateway.metric("blazar_engine_child_starts_total", model="x", replica="0") == 1.0
    new_y = _replica_pids(gateway, "y", 1)[0]
    assert new_y != old_y
    wait_until(lambda: not pid_alive(old_y), "the replaced child stopped", timeout_s=30)
    assert "--max-tokens 64" in Path(f"/proc/{new_y}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_two_models_never_share_a_child_name_or_log(demo_model: Path, tmp_path: Path) -> None:
    """Model m with two replicas and a model named m-0 would share a child name: startup says so and stops."""
    path = tmp_path / "blazar.toml"
    path.write_text(_model_table("m", demo_model, replicas=2) + _model_table('"m-0"', demo_model))
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "--config", str(path), "--port", str(free_port())],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "would share the child name" in result.stderr and "'m-0'" in result.stderr, result.stderr


@pytest.mark.fault("engines", "a child that crashes, hangs or turns unhealthy")
def test_a_child_whose_generation_thread_dies_exits_and_is_started_again(
    demo_model: Path, tmp_path: Path, gateway_factory: list[ConfigGateway]
) -> None:
    """An mlx child whose generation thread dies exits at once, and the gateway starts it again.

    Its default max_tokens of 0 (engine-args) kills the thread on the first request that names
    none, as an exact prompt-cache hit did: mlx_lm.server alone would serve on with /health 503
    and every request a 404 "generation thread died" until three health checks (5 s apart) failed.
    """
    config = _model_table("z", demo_model, always_loaded=True, engine_args=["--max-tokens", "0"])
    gateway = ConfigGateway(config, tmp_path)
    gateway_factory.append(gateway)
    gateway.wait_state("z", "loaded", timeout_s=_READY_TIMEOUT_S)
    old = _replica_pids(gateway, "z", 1)[0]
    killer = gateway.http.post(_CHAT, json={"model": "z", "messages": [{"role": "user", "content": "hi"}]})
    assert killer.status_code >= 500, killer.text
    assert set(killer.json()["error"]) == {"message", "type", "param", "code"}, killer.text
    # Well before the first of the health checks that would have noticed (5 s apart, three in a row).
    wait_until(lambda: not pid_alive(old), "the child with a dead generation thread exits", timeout_s=4)
    # The model stays "loaded" while its child restarts (a request meanwhile gets 503 model_loading
    # with Retry-After): wait for the new child's ready line, then it serves.
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while gateway.log().count("serving 'z'") < 2:
        assert time.monotonic() < deadline, gateway.log()
        time.sleep(0.05)
    assert gateway.chat("z").status_code == 200
    assert _replica_pids(gateway, "z", 1)[0] != old
    assert "status 70" in gateway.log() or "code 70" in gateway.log(), gateway.log()
