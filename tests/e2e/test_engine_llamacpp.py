"""The real llama.cpp engine: llamacpp-0.3.36 (llama_cpp.server) on the CPU, behind the gateway.

The engine is compiled from source at install (4-7 min on two cores), so these
tests do not install it: scripts/test does, into BLAZAR_TEST_HOME (default
~/.cache/blazar-test), and sets BLAZAR_TEST_LLAMACPP=required so that a
missing engine fails the run instead of skipping. Run alone, without the
engine installed, they skip and say how to install it. The model is the GGUF
demo (engines/gguf_model.py), generated locally with the engine's Python.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from engines.home import Home
from engines.install import read_manifest
from tests.e2e.conftest import ROOT, free_port, openai_client
from tests.e2e.test_nonstream_via_stream import cpu_s, wait_idle

pytestmark = pytest.mark.llamacpp

ENGINE = "llamacpp-0.3.36"
SERVED = "tiny-chat"  # the stem of the GGUF file the main gateway serves
_READY_TIMEOUT_S = 120.0


def engine_home() -> Path:
    return Path(os.environ.get("BLAZAR_TEST_HOME") or Path.home() / ".cache" / "blazar-test")


def _env() -> dict[str, str]:
    # llama_cpp.server reads these: HOST and PORT override --host/--port, API_KEY makes
    # every request a 401. Set here, they prove the spec's env_drop keeps them out.
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "BLAZAR_HOME": str(engine_home()),
        "PYTHONUNBUFFERED": "1",
        "HOST": "0.0.0.0",
        "PORT": "1",
        "API_KEY": "leaked-into-the-child",
    }


@dataclass
class EngineGateway:
    """A gateway process running one llama.cpp child."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    child_pid: int
    child_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def child_url(self) -> str:
        return f"http://127.0.0.1:{self.child_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def start_gateway(log_dir: Path, *args: str) -> EngineGateway:
    """Start `blazar-proxy ARGS` with one engine child and wait until the child is ready."""
    port = free_port()
    log_path = log_dir / f"llamacpp-gateway-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "--engine-variant", "cpu", "--port", str(port), *args],
            cwd=ROOT,
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + _READY_TIMEOUT_S
    pattern = re.compile(r"pid (\d+), port (\d+), ready in")
    while True:
        match = pattern.search(log_path.read_text(errors="replace"))
        if match:
            return EngineGateway(proc, port, log_path, int(match.group(1)), int(match.group(2)))
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"gateway did not get ready: {log_path.read_text(errors='replace')}")
        time.sleep(0.1)


def stop(gateway: EngineGateway) -> None:
    if gateway.proc.poll() is None:
        gateway.proc.send_signal(signal.SIGTERM)
        try:
            gateway.proc.wait(20)
        except subprocess.TimeoutExpired:
            gateway.proc.kill()
            gateway.proc.wait()


@pytest.fixture(scope="session")
def engine_python() -> Path:
    """The installed llamacpp-0.3.36 venv's python; skip (or fail, when required) without it."""
    installation = read_manifest(Home(engine_home()), ENGINE)
    if installation is None:
        message = (
            f"{ENGINE} is not installed in {engine_home()}; it compiles llama.cpp (~7 min on two cores): "
            f"run scripts/test, or BLAZAR_HOME={engine_home()} blazar-proxy engines install {ENGINE} "
            "--variant cpu"
        )
        if os.environ.get("BLAZAR_TEST_LLAMACPP") == "required":
            pytest.fail(message)
        pytest.skip(message)
    return installation.python


@pytest.fixture(scope="session")
def gguf_file(engine_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GGUF model named tiny-chat.gguf, generated with the engine's python."""
    out = tmp_path_factory.mktemp("gguf") / f"{SERVED}.gguf"
    subprocess.run(
        [str(engine_python), str(ROOT / "engines" / "gguf_model.py"), "--out", str(out), "--preset", "tiny"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return out


@pytest.fixture(scope="session")
def gateway(gguf_file: Path, logs_dir: Path) -> Iterator[EngineGateway]:
    """`blazar-proxy --engine llamacpp-0.3.36 --model tiny-chat.gguf`, for the session."""
    gw = start_gateway(logs_dir, "--engine", ENGINE, "--model", str(gguf_file))
    yield gw
    stop(gw)


def client(url: str) -> openai.OpenAI:
    return openai_client(url, timeout_s=60)


def chat(prompt: str, max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    return {
        "model": SERVED,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def test_startup_line_and_child_command_line(gateway: EngineGateway, gguf_file: Path) -> None:
    """The child is llama_cpp.server (through engines/llamacpp_server.py) from the engine venv, given the
    file and its alias."""
    line = next(line for line in gateway.log().splitlines() if "ready in" in line)
    assert f"engine {ENGINE} (cpu) serving '{SERVED}'" in line
    cmdline = Path(f"/proc/{gateway.child_pid}/cmdline").read_bytes().decode().split("\0")
    assert cmdline[0] == str(engine_home() / "engines" / ENGINE / "venv" / "bin" / "python")
    assert cmdline[1] == str(ROOT / "engines" / "llamacpp_server.py")
    assert cmdline[cmdline.index("--model") + 1] == str(gguf_file)
    assert cmdline[cmdline.index("--model_alias") + 1] == SERVED
    with httpx.Client(trust_env=False, timeout=10) as http:
        models = http.get(f"{gateway.child_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [SERVED]


def test_openai_client_chat_through_gateway(gateway: EngineGateway) -> None:
    """A real llama.cpp generation comes back through the gateway with the client's model name."""
    with client(gateway.url) as c:
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
        reply = c.chat.completions.create(model=SERVED, messages=messages, max_tokens=8)
    assert reply.model == SERVED
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content


def test_openai_client_stream_through_gateway(gateway: EngineGateway) -> None:
    """A real llama.cpp stream arrives token by token (one chunk each) and ends with finish_reason length."""
    with client(gateway.url) as c:
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
        stream = c.chat.completions.create(model=SERVED, messages=messages, max_tokens=12, stream=True)
        chunks = list(stream)
    contents = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    # The demo model emits only single-byte ASCII tokens: one content chunk per token.
    assert len(contents) == 12
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.model == SERVED for ch in chunks)


def test_parity_direct_and_through_gateway(gateway: EngineGateway) -> None:
    """At temperature 0 the whole reply but id and created is identical direct and through the gateway."""
    prompts = ["Say hello.", "Count to five.", "What is the capital of France?"]
    with httpx.Client(trust_env=False, timeout=60) as http:
        for prompt in prompts:
            replies = []
            for url in (gateway.child_url, gateway.url):
                response = http.post(f"{url}/v1/chat/completions", json=chat(prompt, 24))
                assert response.status_code == 200, response.text
                body = response.json()
                assert body.pop("id").startswith("chatcmpl-") and isinstance(body.pop("created"), int)
                replies.append(body)
            assert replies[0] == replies[1], prompt
            assert replies[0]["usage"]["completion_tokens"] == 24


def test_stream_parity_direct_and_through_gateway(gateway: EngineGateway) -> None:
    """At temperature 0 a stream carries the same text direct and through the gateway, then [DONE]."""
    texts = []
    with httpx.Client(trust_env=False, timeout=60) as http:
        for url in (gateway.child_url, gateway.url):
            raw = http.post(f"{url}/v1/chat/completions", json=chat("Stream, please.", 20, stream=True)).text
            assert raw.rstrip().endswith("data: [DONE]")
            events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
            texts.append("".join(e["choices"][0]["delta"].get("content") or "" for e in events))
    assert texts[0] == texts[1] and len(texts[0]) == 20


@pytest.mark.fault("engines", "requests that would break the engine")
def test_guards_answer_400_before_the_engine(gateway: EngineGateway) -> None:
    """max_tokens 0 (unbounded in llama-cpp-python) and a chat without messages get a 400 from the gateway."""
    with httpx.Client(trust_env=False, timeout=30) as http:
        started = time.monotonic()
        zero = http.post(f"{gateway.url}/v1/chat/completions", json=chat("x", 0))
        assert zero.status_code == 400, zero.text
        assert zero.json()["error"]["param"] == "max_tokens"
        empty = http.post(f"{gateway.url}/v1/chat/completions", json={"model": SERVED, "messages": []})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"
        # Had max_tokens 0 reached the engine it would generate ~2000 tokens (seconds) first.
        after = http.post(f"{gateway.url}/v1/chat/completions", json=chat("x", 1))
        assert after.status_code == 200
        assert time.monotonic() - started < 2.0


@pytest.mark.fault("engines", "requests that would break the engine")
def test_bad_field_type_gets_a_400_at_the_gateway(gateway: EngineGateway) -> None:
    """A sampling field of the wrong type gets a 400 naming it, before the engine (which would say 500)."""
    with httpx.Client(trust_env=False, timeout=30) as http:
        response = http.post(f"{gateway.url}/v1/chat/completions", json=chat("x", 2, temperature="hot"))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "temperature" and error["code"] == "invalid_type"
    with client(gateway.url) as c, pytest.raises(openai.BadRequestError, match="temperature"):
        c.chat.completions.create(
            model=SERVED,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            extra_body={"temperature": "hot"},
        )


@pytest.mark.fault("engines", "requests that would break the engine")
def test_the_fields_its_request_types_declare_are_checked_and_its_nulls_left_out(
    gateway: EngineGateway,
) -> None:
    """mirostat_tau "hot" (the engine's 500) is a 400 naming it; temperature: null (its 500 too) works."""
    with httpx.Client(trust_env=False, timeout=60) as http:
        typed = http.post(f"{gateway.url}/v1/chat/completions", json=chat("x", 2, mirostat_tau="hot"))
        assert typed.status_code == 400, typed.text
        assert typed.json()["error"]["param"] == "mirostat_tau"
        nulls = http.post(
            f"{gateway.url}/v1/chat/completions",
            json={**chat("x", 2), "temperature": None, "stream": None, "top_k": None, "seed": None},
        )
        assert nulls.status_code == 200, nulls.text


def test_engine_validation_error_is_relayed_in_openai_shape(gateway: EngineGateway) -> None:
    """A field the gateway does not check but the engine refuses comes back OpenAI-shaped, naming it."""
    with httpx.Client(trust_env=False, timeout=30) as http:
        response = http.post(f"{gateway.url}/v1/chat/completions", json=chat("x", 2, tool_choice=5))
    # llama_cpp.server answers its validation errors with 500; the gateway keeps the status.
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert "tool_choice" in error["message"]


@pytest.mark.fault("clients", "a client that leaves mid-request")
def test_a_client_that_leaves_a_non_stream_request_frees_the_engine(gateway: EngineGateway) -> None:
    """While its client waits the child generates; once the client has left, it stops within about a second.

    llama_cpp.server alone generates on to max_tokens for nobody (2.97 s of
    CPU in the 3 s after the client left, measured here); the child runs it
    through engines/llamacpp_server.py, which ends the token loop once the
    request's connection is gone. Then the child serves the next request.
    """
    # 1900 tokens (the context is 2048) take 10-20 s here: it would generate all through the test.
    long_story = chat("Tell me a very long story about a dragon.", 1900)
    wait_idle(gateway.child_pid)
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        data = orjson.dumps(long_story)
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(data) + data
        )
        time.sleep(1.5)
        # The client still waits: the child is generating, and the CPU figure sees it.
        waiting = cpu_s(gateway.child_pid)
        time.sleep(1.5)
        generating = cpu_s(gateway.child_pid) - waiting
    left = cpu_s(gateway.child_pid)
    time.sleep(3.0)
    used = cpu_s(gateway.child_pid) - left
    # Under other load a child gets less than its core; generating on, it would use about twice
    # in 3 s what it used in 1.5 s, and it uses next to nothing once stopped.
    assert generating > 0.2, f"the child used only {generating:.2f} s of CPU in 1.5 s of generating"
    assert used < min(1.0, generating / 2), (
        f"the child used {used:.2f} s of CPU in the 3 s after its client left "
        f"({generating:.2f} s in 1.5 s while it generated)"
    )
    reply = httpx.post(gateway.url + "/v1/chat/completions", json=chat("Say hello.", 4), timeout=60)
    assert reply.status_code == 200, reply.text


def test_a_waiting_request_does_not_cut_a_stream_short(gateway: EngineGateway) -> None:
    """With --interrupt_requests false, a request queued behind a stream (a probe) leaves it whole."""
    received: list[str] = []

    def stream() -> None:
        with httpx.Client(trust_env=False, timeout=60) as http:
            received.append(
                http.post(f"{gateway.child_url}/v1/chat/completions", json=chat("hi", 800, stream=True)).text
            )

    worker = threading.Thread(target=stream)
    worker.start()
    time.sleep(0.3)
    with httpx.Client(trust_env=False, timeout=60) as http:
        assert http.post(f"{gateway.child_url}/v1/chat/completions", json=chat("x", 1)).status_code == 200
    worker.join(60)
    assert received
    finishes = re.findall(r'"finish_reason": "(\w+)"', received[0])
    assert finishes == ["length"]
    assert received[0].count('"content"') == 800


@pytest.mark.fault("engines", "a child stopped: its group killed and reaped")
def test_builtin_tiny_then_sigterm_reaps_the_child(engine_python: Path, logs_dir: Path) -> None:
    """`--model builtin:tiny` serves the GGUF demo model; SIGTERM exits 0 and the child is gone."""
    gateway = start_gateway(logs_dir, "--engine", ENGINE, "--model", "builtin:tiny")
    try:
        assert "serving 'blazar-demo-llama-tiny'" in gateway.log()
        assert (engine_home() / "models" / "blazar-demo-llama-tiny.gguf").is_file()
        with client(gateway.url) as c:
            reply = c.chat.completions.create(
                model="blazar-demo-llama-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert reply.usage is not None and reply.usage.completion_tokens == 4
        gateway.proc.send_signal(signal.SIGTERM)
        assert gateway.proc.wait(30) == 0
        assert not _pid_alive(gateway.child_pid)
    finally:
        stop(gateway)


def test_engine_auto_picks_llamacpp_for_a_gguf_file(gguf_file: Path, logs_dir: Path) -> None:
    """`--engine auto --model FILE.gguf` detects GGUF, says so, and starts the llama.cpp engine."""
    gateway = start_gateway(logs_dir, "--engine", "auto", "--model", str(gguf_file))
    try:
        assert re.search(
            rf"engine auto for .*: {SERVED}\.gguf: GGUF file.*: {ENGINE}$", gateway.log(), re.MULTILINE
        )
        assert f"engine {ENGINE} (cpu) serving '{SERVED}'" in gateway.log()
    finally:
        stop(gateway)
