"""Non-stream requests to mlx_lm.server go as streams, so a client that leaves frees the real engine.

mlx_lm.server writes a non-stream reply only at the end, so it keeps
generating for a client that has gone; a stream stops at its next failed
write. The gateway asks the engine for a stream and builds the non-stream
reply from its events. These tests run the real engine (the tiny demo model,
~700 tok/s here) and check the effect: the child's CPU time after the
client left, and the reply the engine itself would have sent.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.conftest import ROOT, FakeEngine, Running, StartGateway
from tests.e2e.test_engine_mlx import DEMO, start_engine_gateway
from tests.e2e.test_engine_mlx import engine_installed as engine_installed
from tests.helpers import EngineGateway, free_port, wait_until

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
# Long enough to run for seconds on the tiny model (~700 tok/s), well inside its context.
_LONG = 4000


@pytest.fixture(scope="module")
def gateway(engine_installed: None, logs_dir: Path) -> Iterator[EngineGateway]:
    gw = start_engine_gateway(logs_dir)
    yield gw
    gw.stop()


def cpu_s(pid: int) -> float:
    """User and system CPU seconds of a process, all its threads."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def chat(prompt: str, max_tokens: int = 24, **extra: Any) -> dict[str, Any]:
    return {
        "model": DEMO,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=120) as http:
        return http.post(url + path, json=body)


def leave_after(port: int, body: dict[str, Any], wait_s: float, path: str = "/v1/chat/completions") -> None:
    """Send a request on a raw socket and close it after ``wait_s`` without reading an answer."""
    data = orjson.dumps(body)
    head = (
        b"POST %b HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (path.encode(), len(data))
    )
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head + data)
        time.sleep(wait_s)


def wait_idle(pid: int, quiet_s: float = 0.5, limit_s: float = 30.0) -> None:
    """Wait until the child has used (almost) no CPU for ``quiet_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = cpu_s(pid)
        time.sleep(quiet_s)
        if cpu_s(pid) - before < 0.05:
            return
    raise AssertionError("the child never went idle")


def essentials(reply: dict[str, Any]) -> dict[str, Any]:
    choice = reply["choices"][0]
    message = choice.get("message") or {}
    return {
        "object": reply["object"],
        "role": message.get("role"),
        "content": message.get("content", choice.get("text")),
        "finish_reason": choice["finish_reason"],
        "prompt_tokens": reply["usage"]["prompt_tokens"],
        "completion_tokens": reply["usage"]["completion_tokens"],
    }


PARITY = [
    ("/v1/chat/completions", chat("Explain in two sentences why the sky is blue.")),
    ("/v1/chat/completions", chat("What is the capital of France?")),
    ("/v1/chat/completions", chat("Count from 1 to 5.")),
    ("/v1/completions", {"model": DEMO, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}),
    (
        "/v1/chat/completions",
        chat(
            "What is the weather in Paris?",
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "The weather in a city",
                        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                    },
                }
            ],
        ),
    ),
]


@pytest.mark.parametrize(("path", "body"), PARITY, ids=["sky", "capital", "count", "legacy", "tools"])
def test_built_reply_equals_the_engines_own_non_stream_reply(
    gateway: EngineGateway, path: str, body: dict[str, Any]
) -> None:
    """At temperature 0 the reply built from the stream matches the child's own in every field that counts."""
    direct = post(f"http://127.0.0.1:{gateway.child_port}", path, body)
    built = post(gateway.url, path, body)
    assert direct.status_code == built.status_code == 200, built.text
    assert built.headers["content-type"] == "application/json"
    assert int(built.headers["content-length"]) == len(built.content)
    mine, theirs = built.json(), direct.json()
    assert essentials(mine) == essentials(theirs)
    assert mine["model"] == theirs["model"] == DEMO
    assert set(mine) == set(theirs), (mine, theirs)
    assert set(mine["usage"]) == set(theirs["usage"])


@pytest.mark.fault("clients", "a client that leaves mid-request")
def test_a_client_that_leaves_a_non_stream_request_frees_the_engine(gateway: EngineGateway) -> None:
    """The child stops generating within about a second of the client leaving (its CPU says so)."""
    wait_idle(gateway.child_pid)
    leave_after(gateway.port, chat("Tell me a very long story.", _LONG), 1.5)
    left = cpu_s(gateway.child_pid)
    time.sleep(3.0)
    used = cpu_s(gateway.child_pid) - left
    assert used < 1.0, f"the child used {used:.2f} s of CPU in the 3 s after its client left"


@pytest.mark.fault("clients", "a client that leaves mid-request")
def test_a_client_that_leaves_a_stream_frees_the_engine(gateway: EngineGateway) -> None:
    """A chat stream, which the gateway relays from the upstream connection's callbacks (its head
    comes long before the first heartbeat's time): the child stops generating within about a
    second of the client leaving (its CPU says so)."""
    wait_idle(gateway.child_pid)
    leave_after(gateway.port, chat("Tell me a very long story.", _LONG, stream=True), 1.5)
    left = cpu_s(gateway.child_pid)
    time.sleep(3.0)
    used = cpu_s(gateway.child_pid) - left
    assert used < 1.0, f"the child used {used:.2f} s of CPU in the 3 s after its client left"


_STORY = "Tell me a very long story."
# Another API's request, as Claude Code and Codex send it: translated, sent to mlx as a stream.
_OTHER_APIS = [
    ("/v1/messages", {"model": DEMO, "max_tokens": _LONG, "messages": [{"role": "user", "content": _STORY}]}),
    ("/v1/responses", {"model": DEMO, "max_output_tokens": _LONG, "input": _STORY}),
]


@pytest.mark.fault("clients", "a client that leaves mid-request")
@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
@pytest.mark.parametrize(("path", "body"), _OTHER_APIS, ids=["messages", "responses"])
def test_a_client_that_leaves_a_translated_request_frees_the_engine(
    gateway: EngineGateway, path: str, body: dict[str, Any], stream: bool
) -> None:
    """A Messages or Responses request translated for mlx: the child stops generating within about a
    second of the client leaving, streamed or not (its CPU says so)."""
    wait_idle(gateway.child_pid)
    leave_after(gateway.port, {**body, "stream": stream}, 1.5, path)
    left = cpu_s(gateway.child_pid)
    time.sleep(3.0)
    used = cpu_s(gateway.child_pid) - left
    assert used < 1.0, f"the child used {used:.2f} s of CPU in the 3 s after its client left"


def test_a_request_only_a_non_stream_reply_can_carry_goes_as_it_is(gateway: EngineGateway) -> None:
    """logprobs go to mlx as a non-stream request, so the engine generates on after the client left.

    This is the measurement above without the gateway's help: it shows that
    the CPU figure does see an engine generating for nobody.
    """
    wait_idle(gateway.child_pid)
    leave_after(gateway.port, chat("Tell me a very long story.", _LONG, logprobs=True), 1.5)
    left = cpu_s(gateway.child_pid)
    time.sleep(3.0)
    used = cpu_s(gateway.child_pid) - left
    assert used > 1.5, f"the child used only {used:.2f} s of CPU: it stopped although it cannot notice"
    wait_idle(gateway.child_pid, limit_s=60)
    reply = post(gateway.url, "/v1/chat/completions", chat("Say hello.", 4, logprobs=True))
    assert reply.status_code == 200 and reply.json()["choices"][0]["logprobs"] is not None


def test_time_to_first_token_is_real_for_non_stream_requests(gateway: EngineGateway) -> None:
    """The access log's time to first byte of a built reply is the first token's, well before the end."""
    reply = post(gateway.url, "/v1/chat/completions", chat("Count to a hundred.", 400))
    assert reply.status_code == 200
    request_id = reply.headers["x-request-id"]

    def logged() -> str | None:
        # The line is written once the response has ended, after the client may have it.
        return next((line for line in gateway.log().splitlines() if request_id in line), None)

    line = wait_until(logged, f"the access log line of {request_id}", timeout_s=10)
    match = re.search(r" ([\d.]+)ms ttfb=([\d.]+)ms ", line)
    assert match is not None, line
    total_ms, ttfb_ms = float(match.group(1)), float(match.group(2))
    assert ttfb_ms < total_ms / 2, line


@pytest.mark.fault("clients", "a client that leaves mid-request")
def test_a_remote_mlx_named_beside_its_upstream_is_freed_when_the_client_leaves(
    gateway: EngineGateway, start_gateway: StartGateway, tmp_path: Path
) -> None:
    """A front gateway serving the real mlx child as an upstream, engine = "mlx-0.32.0": the engine stops
    generating within about a second of the client leaving a non-stream request, as for a child."""
    config = tmp_path / "blazar.toml"
    config.write_text(
        f'[models."{DEMO}"]\nupstream = "http://127.0.0.1:{gateway.child_port}"\nengine = "mlx-0.32.0"\n'
    )
    front = start_gateway({}, "--config", str(config))
    wait_idle(gateway.child_pid)
    leave_after(front.port, chat("Tell me a very long story.", _LONG), 1.5)
    left = cpu_s(gateway.child_pid)
    time.sleep(3.0)
    used = cpu_s(gateway.child_pid) - left
    assert used < 1.0, f"the engine used {used:.2f} s of CPU in the 3 s after its client left"
    reply = post(front.url, "/v1/chat/completions", chat("Say hello.", 4))
    assert reply.status_code == 200 and reply.json()["object"] == "chat.completion", reply.text


@pytest.mark.fault("engines", "a child that crashes, hangs or turns unhealthy")
def test_a_child_that_dies_under_a_built_reply_is_a_502_not_a_short_reply(gateway: EngineGateway) -> None:
    """SIGKILL of the child mid-generation: the client gets 502 in OpenAI's envelope, not part of a reply."""
    wait_idle(gateway.child_pid)
    with httpx.Client(trust_env=False, timeout=60) as http:
        pid = gateway.child_pid

        def kill_soon() -> None:
            time.sleep(1.0)
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_soon)
        killer.start()
        reply = http.post(gateway.url + "/v1/chat/completions", json=chat("Tell me a long story.", _LONG))
        killer.join()
    assert reply.status_code == 502, reply.text
    error = reply.json()["error"]
    assert error["code"] in ("upstream_truncated", "upstream_empty_reply") and error["message"]


# -- an mlx engine on another host: the fake one, declared in the config file -------------

WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


@pytest.fixture
def remote_mlx(tmp_path: Path, start_gateway: StartGateway, fake: FakeEngine) -> Running:
    """A gateway whose model "remote" is the fake engine, declared to run mlx-0.32.0."""
    config = tmp_path / "blazar.toml"
    config.write_text(f'[models.remote]\nupstream = "{fake.url}"\nengine = "mlx-0.32.0"\n')
    return start_gateway({}, "--config", str(config))


def test_an_upstream_that_runs_mlx_gets_non_stream_requests_as_streams(
    remote_mlx: Running, fake: FakeEngine
) -> None:
    """engine = "mlx-0.32.0" beside upstream: a non-stream request reaches it as a stream, with usage."""
    body = {"model": "remote", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    response = post(remote_mlx.url, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
    sent = orjson.loads(fake.records()[-1]["body"])
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}


def test_tool_call_deltas_and_reasoning_are_assembled_as_the_engines_own_reply(
    remote_mlx: Running, fake: FakeEngine
) -> None:
    """Tool calls streamed in pieces (id and name first, then the arguments) and reasoning, built into
    the reply the engine sends for a non-stream request."""
    body = {
        "model": "remote",
        "messages": [{"role": "user", "content": "Weather and time in Paris?"}],
        "max_tokens": 2,
        "tools": WEATHER_TOOLS,
    }
    headers = {"x-fake": "tool-calls=3; reasoning=2"}
    with httpx.Client(trust_env=False, timeout=30) as http:
        built = http.post(remote_mlx.url + "/v1/chat/completions", json=body, headers=headers)
        own = http.post(fake.url + "/v1/chat/completions", json=body, headers=headers)
    assert built.status_code == own.status_code == 200, built.text
    assert int(built.headers["content-length"]) == len(built.content)
    sent = orjson.loads(fake.records()[-2]["body"])
    assert sent["stream"] is True, "the gateway did not ask for a stream"
    built_reply, own_reply = built.json(), own.json()
    for reply in (built_reply, own_reply):
        del reply["id"], reply["created"]  # the engine's own, different for each request
    assert built_reply == own_reply
    message = built_reply["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == [
        "get_weather",
        "get_time",
        "get_weather",
    ]
    assert orjson.loads(message["tool_calls"][1]["function"]["arguments"])["call"] == 1
    assert message["reasoning"] == "think0 think1 "
    assert built_reply["choices"][0]["finish_reason"] == "tool_calls"


def test_an_upstream_engine_that_is_not_known_stops_the_start(tmp_path: Path, fake: FakeEngine) -> None:
    """engine = "mlx-9" beside upstream: the start fails at once, naming the file, the table and the key."""
    config = tmp_path / "blazar.toml"
    config.write_text(f'[models.remote]\nupstream = "{fake.url}"\nengine = "mlx-9"\n')
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "--config", str(config), "--port", str(free_port())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert f"{config}: [models.remote] engine" in result.stderr and "mlx-9" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
