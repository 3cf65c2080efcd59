"""The real engine: mlx-0.32.0 on the CPU, installed in its own venv, behind the gateway.

`blazar-proxy --engine mlx-0.32.0 --model builtin:tiny` serves the tiny
built-in model (a random-weight Qwen2 generated locally, ~700 tok/s), so these
tests need no model hub and stay fast; test_engine_smollm2.py runs the real
default model. The engine venv lives in BLAZAR_TEST_HOME (default ~/.cache/blazar-test),
so a second run on the same machine installs nothing; a fresh machine
installs it from PyPI.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.e2e.conftest import ROOT, openai_client
from tests.helpers import EngineGateway, engine_home, free_port, pid_alive, spawn_engine_gateway, wait_until

ENGINE = "mlx-0.32.0"
DEMO = "blazar-demo-qwen2-tiny"
_READY_TIMEOUT_S = 180.0


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "BLAZAR_HOME": str(engine_home()), "PYTHONUNBUFFERED": "1"}


def start_engine_gateway(log_dir: Path, *args: str, model: str | None = "builtin:tiny") -> EngineGateway:
    """Start `blazar-proxy --engine mlx-0.32.0 --model MODEL` and wait until its child is ready.

    ``model`` None starts it without --model: the default built-in model.
    """
    port = free_port()
    return spawn_engine_gateway(
        [
            "--engine",
            ENGINE,
            "--engine-variant",
            "cpu",
            "--port",
            str(port),
            *(("--model", model) if model is not None else ()),
            *args,
        ],
        port=port,
        log_path=log_dir / f"engine-gateway-{port}.log",
        env=_env(),
        timeout_s=_READY_TIMEOUT_S,
        what="engine gateway",
    )


@pytest.fixture(scope="session")
def engine_installed() -> None:
    """Install mlx-0.32.0 (cpu) once; a no-op when it already is."""
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "engines", "install", ENGINE, "--variant", "cpu"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="session")
def mlx_gateway(engine_installed: None, logs_dir: Path) -> Iterator[EngineGateway]:
    gateway = start_engine_gateway(logs_dir)
    yield gateway
    gateway.stop()


def client(url: str) -> openai.OpenAI:
    return openai_client(url, timeout_s=60)


PROMPTS = ["Say hello.", "Count to five.", "What is the capital of France?"]


def ask(c: openai.OpenAI, prompt: str, max_tokens: int = 16) -> str:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
    reply = c.chat.completions.create(model=DEMO, messages=messages, max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content or ""


def test_startup_line_names_engine_variant_venv_and_port(mlx_gateway: EngineGateway) -> None:
    """Startup prints one line per child with engine, variant, venv, CUDA_HOME, pid, port and ready time."""
    line = next(line for line in mlx_gateway.log().splitlines() if "ready in" in line)
    assert f"engine {ENGINE} (cpu) serving '{DEMO}'" in line
    assert f"venv {engine_home() / 'engines' / ENGINE / 'venv'}" in line
    assert "CUDA_HOME -" in line
    child_cmdline = Path(f"/proc/{mlx_gateway.child_pid}/cmdline").read_bytes().split(b"\0")
    assert child_cmdline[0] == str(engine_home() / "engines" / ENGINE / "venv" / "bin" / "python").encode()
    # mlx_lm.server through engines/mlx_lm_server.py (an exact prompt-cache hit leaves a token to prefill).
    assert (
        child_cmdline[1] == str(Path(__file__).resolve().parents[2] / "engines" / "mlx_lm_server.py").encode()
    )


def test_openai_client_chat_through_gateway(mlx_gateway: EngineGateway) -> None:
    """A real mlx generation comes back through the gateway with the client's model name and token count."""
    with client(mlx_gateway.url) as c:
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
        reply = c.chat.completions.create(model=DEMO, messages=messages, max_tokens=8)
    assert reply.model == DEMO
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    assert reply.choices[0].finish_reason == "length"


def test_openai_client_stream_through_gateway(mlx_gateway: EngineGateway) -> None:
    """A real mlx stream arrives chunk by chunk, ends cleanly and reports usage."""
    with client(mlx_gateway.url) as c:
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
        stream = c.chat.completions.create(
            model=DEMO,
            messages=messages,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) >= 2
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_parity_direct_and_through_gateway(mlx_gateway: EngineGateway) -> None:
    """At temperature 0 the content is byte-identical direct and through the gateway, for 3 prompts."""
    with client(f"http://127.0.0.1:{mlx_gateway.child_port}") as direct, client(mlx_gateway.url) as proxied:
        for prompt in PROMPTS:
            assert ask(direct, prompt) == ask(proxied, prompt), prompt


def test_the_azure_openai_client_gets_answers_from_mlx_through_the_gateway(
    mlx_gateway: EngineGateway,
) -> None:
    """openai.AzureOpenAI adds ?api-version= (mlx_lm.server answers 404 to it): through the gateway,
    the child generates a reply and a stream."""
    azure = openai.AzureOpenAI(
        azure_endpoint=mlx_gateway.url,
        api_version="2024-10-21",
        api_key="unused",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(trust_env=False, timeout=60),
    )
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    with azure:
        reply = azure.chat.completions.create(model=DEMO, messages=messages, max_tokens=6)
        assert reply.usage is not None and reply.usage.completion_tokens == 6
        chunks = list(azure.chat.completions.create(model=DEMO, messages=messages, max_tokens=6, stream=True))
        assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) >= 2
    # The query alone, on the gateway's own path (a client's default_query).
    with openai.OpenAI(
        base_url=f"{mlx_gateway.url}/v1",
        api_key="unused",
        default_query={"api-version": "2024-10-21"},
        max_retries=0,
        http_client=openai.DefaultHttpxClient(trust_env=False, timeout=60),
    ) as plain:
        reply = plain.chat.completions.create(model=DEMO, messages=messages, max_tokens=3)
        assert reply.usage is not None and reply.usage.completion_tokens == 3
    with httpx.Client(trust_env=False, timeout=30) as http:
        direct = http.post(
            f"http://127.0.0.1:{mlx_gateway.child_port}/v1/chat/completions?api-version=2024-10-21",
            json={"model": DEMO, "messages": messages, "max_tokens": 2},
        )
    assert direct.status_code == 404  # why the query must stay at the gateway


@pytest.mark.fault("engines", "requests that would break the engine")
def test_engine_guards_answer_400_before_the_engine(mlx_gateway: EngineGateway) -> None:
    """max_tokens 0 and a chat without messages get 400 at the gateway; the child stays healthy."""
    with httpx.Client(trust_env=False, timeout=30) as http:
        zero = http.post(
            f"{mlx_gateway.url}/v1/chat/completions",
            json={"model": DEMO, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        )
        assert zero.status_code == 400 and zero.json()["error"]["param"] == "max_tokens"
        empty = http.post(f"{mlx_gateway.url}/v1/chat/completions", json={"model": DEMO})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"
        assert http.get(f"http://127.0.0.1:{mlx_gateway.child_port}/health").status_code == 200


@pytest.mark.fault("engines", "requests that would break the engine")
def test_bad_field_type_gets_400_not_a_hang(mlx_gateway: EngineGateway) -> None:
    """A field type mlx cannot handle (it would close with 0 bytes) gets a 400 naming it; it serves on."""
    with httpx.Client(trust_env=False, timeout=30) as http:
        response = http.post(
            f"{mlx_gateway.url}/v1/chat/completions",
            json={"model": DEMO, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "temperature"
        for field, value in (("seed", -5), ("top_logprobs", 15)):
            limited = http.post(
                f"{mlx_gateway.url}/v1/chat/completions",
                json={"model": DEMO, "messages": [{"role": "user", "content": "x"}], field: value},
            )
            assert limited.status_code == 400 and limited.json()["error"]["param"] == field
        # Nulls mean "the default" to OpenAI; mlx would refuse them, so the gateway drops them.
        after = http.post(
            f"{mlx_gateway.url}/v1/chat/completions",
            json={
                "model": DEMO,
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 2,
                "temperature": None,
                "stop": None,
            },
        )
        assert after.status_code == 200, after.text


@pytest.mark.fault("engines", "a child that crashes, hangs or turns unhealthy")
def test_crashed_child_comes_back_and_requests_meanwhile_get_503(
    engine_installed: None, logs_dir: Path
) -> None:
    """SIGKILL the child: requests meanwhile get 503 with Retry-After, then it serves again."""
    gateway = start_engine_gateway(logs_dir)
    try:
        os.kill(gateway.child_pid, signal.SIGKILL)
        seen_503 = False
        deadline = time.monotonic() + 120
        with httpx.Client(trust_env=False, timeout=30) as http:
            body = {"model": DEMO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            while time.monotonic() < deadline:
                response = http.post(f"{gateway.url}/v1/chat/completions", json=body)
                if response.status_code == 200:
                    break
                assert response.status_code == 503, response.text
                assert response.headers["retry-after"]
                assert response.json()["error"]["code"] in (
                    "model_loading",
                    "upstream_unavailable",
                    "engine_exited",
                )
                seen_503 = True
                time.sleep(0.05)
            assert response.status_code == 200
        assert seen_503
        assert "restarting" in gateway.log() or "starting again" in gateway.log()
        with httpx.Client(trust_env=False, timeout=10) as http:
            metrics = http.get(f"{gateway.url}/metrics").text
        assert f'blazar_engine_child_ready{{model="{DEMO}",replica="0"}} 1.0' in metrics
        assert f'blazar_engine_child_restarts_total{{model="{DEMO}",replica="0"}} 1.0' in metrics
    finally:
        gateway.stop()


@pytest.mark.fault("engines", "a child stopped: its group killed and reaped")
def test_sigterm_stops_gateway_and_reaps_child(engine_installed: None, logs_dir: Path) -> None:
    """SIGTERM: the gateway exits 0 and its child is gone."""
    gateway = start_engine_gateway(logs_dir)
    gateway.proc.send_signal(signal.SIGTERM)
    assert gateway.proc.wait(30) == 0
    assert not pid_alive(gateway.child_pid)


@pytest.mark.fault("engines", "a child stopped: its group killed and reaped")
def test_sigkill_of_gateway_leaves_no_orphan(engine_installed: None, logs_dir: Path) -> None:
    """SIGKILL the gateway: its child dies within 2 s (parent-death signal)."""
    gateway = start_engine_gateway(logs_dir)
    gateway.proc.kill()
    gateway.proc.wait()
    wait_until(lambda: not pid_alive(gateway.child_pid), f"the child {gateway.child_pid} gone", timeout_s=2.0)


def _wait_for_log(gateway: EngineGateway, text: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in gateway.log_path.read_text(errors="replace"):
        assert gateway.proc.poll() is None, gateway.log_path.read_text(errors="replace")
        assert time.monotonic() < deadline, f"no {text!r} in the gateway's log"
        time.sleep(0.005)


def _three_signals(gateway: EngineGateway) -> None:
    """SIGTERM, SIGINT, SIGINT, each once the gateway has told of the one before, with a stream in flight.

    Two SIGINTs that arrive before Python runs its handler are one signal to it
    (a busy machine made a 20 ms spacing flaky). The stream holds the drain
    open after the first.
    """
    body = {"model": DEMO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000}
    body["stream"] = True
    streamed = threading.Event()

    def stream() -> None:
        with (
            contextlib.suppress(httpx.HTTPError),
            httpx.Client(trust_env=False, timeout=60) as http,
            http.stream("POST", f"{gateway.url}/v1/chat/completions", json=body) as response,
        ):
            for _ in response.iter_raw():
                streamed.set()

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    assert streamed.wait(60)
    for sig, told in ((signal.SIGTERM, "draining: 1 requests"), (signal.SIGINT, "second signal")):
        gateway.proc.send_signal(sig)
        _wait_for_log(gateway, told)
    gateway.proc.send_signal(signal.SIGINT)
    assert gateway.proc.wait(10) == 130
    client.join(10)


@pytest.mark.fault("drain", "a second and a third signal")
def test_third_signal_kills_the_child_and_exits_130(engine_installed: None, logs_dir: Path) -> None:
    """Three signals in a row: the gateway exits 130 at once and SIGKILLs its child itself."""
    gateway = start_engine_gateway(logs_dir)
    _three_signals(gateway)
    wait_until(lambda: not pid_alive(gateway.child_pid), f"the child {gateway.child_pid} gone", timeout_s=2.0)


@pytest.mark.fault("engines", "a child stopped while the gateway stops")
def test_a_child_the_gateway_kills_as_it_stops_is_not_said_to_start_again(
    engine_installed: None, logs_dir: Path
) -> None:
    """A child killed by the gateway's own last-resort stop is not logged as a crash that restarts."""
    gateway = start_engine_gateway(logs_dir)
    _three_signals(gateway)
    log = gateway.log()
    assert "second signal" in log  # the stop went the way the test means
    assert "starting again" not in log, log
    assert "exited with code -9" not in log, log


@pytest.mark.fault("engines", "a child that crashes, hangs or turns unhealthy")
def test_load_wait_holds_requests_until_the_child_is_back(engine_installed: None, logs_dir: Path) -> None:
    """With --load-wait, a request made while the child restarts waits for it and succeeds."""
    gateway = start_engine_gateway(logs_dir, "--load-wait", "60")
    try:
        os.kill(gateway.child_pid, signal.SIGKILL)
        time.sleep(0.2)  # the owner has seen the exit: the child is not ready
        with httpx.Client(trust_env=False, timeout=90) as http:
            body = {"model": DEMO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            response = http.post(f"{gateway.url}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
    finally:
        gateway.stop()


@pytest.mark.fault("drain", "SIGTERM with requests in flight")
def test_sigterm_lets_a_real_stream_finish_then_reaps_the_child(
    engine_installed: None, logs_dir: Path
) -> None:
    """A real mlx stream in flight at SIGTERM completes with [DONE]; the child is reaped; exit 0."""
    gateway = start_engine_gateway(logs_dir)
    received: list[bytes] = []

    def stream() -> None:
        body = {
            "model": DEMO,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 400,
            "stream": True,
        }
        with httpx.Client(trust_env=False, timeout=60) as http:
            received.append(http.post(f"{gateway.url}/v1/chat/completions", json=body).content)

    worker = threading.Thread(target=stream)
    worker.start()
    time.sleep(0.3)
    gateway.proc.send_signal(signal.SIGTERM)
    worker.join(60)
    assert received and received[0].rstrip().endswith(b"data: [DONE]")
    assert b'"error"' not in received[0]
    assert gateway.proc.wait(30) == 0
    assert not pid_alive(gateway.child_pid)
