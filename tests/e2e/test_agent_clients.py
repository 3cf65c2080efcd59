"""The real agent clients through the gateway, offline: Claude Code (`claude -p`) and Codex (`codex exec`).

Claude Code speaks only the Anthropic Messages API, Codex only the OpenAI
Responses API; the gateway translates both to chat completions for engines
that have neither. Each client here runs one prompt the way a user points it
at a local model (tests/e2e/agent_clients.py: a fresh home, nothing of the
caller's environment, a deadline), in a network namespace with only loopback
where the test process may make one, with its proxy variables on a sink that
records anything it tries to reach beyond the gateway, and through a relay
that keeps a copy of every byte between it and the gateway.

The gateways require the clients' key (Claude Code sends it as x-api-key,
Codex as a Bearer token).

- On the real engine (mlx-0.32.0, the built-in SmolLM2-135M-Instruct, 8192
  tokens of context): each prints an answer, and what it prints is the text
  the gateway streamed to it. Both need their prompt cut to fit: Claude Code
  with --bare, Codex with a short instructions file and its extra tools off
  (``SMALL_MODEL_CODEX``); the gateway's per-model max-tokens cap keeps the
  reply short (Claude Code asks for 32000 tokens, Codex for none).
- In front of the fake engine scripted with one tool call (``--tool-call``):
  each runs the tool, sends its output back, and prints the fake's final
  answer, which echoes that output; the fake's records show the tool result
  in the second request.

scripts/test installs the clients and sets BLAZAR_TEST_AGENT_CLIENTS=required,
so that a missing client fails the run; elsewhere these tests skip without them.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import agent_clients as ac
from tests.e2e import test_engine_mlx as mlx
from tests.e2e.conftest import FakeEngine, StartFakeEngine, StartGateway
from tests.e2e.test_engine_mlx import engine_installed as engine_installed
from tests.fake_engine import TOOL_RESULT_PREFIX
from tests.helpers import EngineGateway, free_port, spawn_engine_gateway

SMOLLM2 = "SmolLM2-135M-Instruct"
# The reply's cap on the real engine: a few seconds of decoding on two cores.
SMOLLM2_MAX_TOKENS = 48
PROMPT = "Say hello in one short sentence."
# A run in front of the fake engine takes a second or two.
FAKE_TIMEOUT_S = 120.0
# What the tools print: the command computes it, so it is in no request before the tool ran.
MARKER = "blazar-42"
MARKER_COMMAND = "echo blazar-$((6*7))"
# Codex's prompt for a small model: its own 17 KB of instructions and its
# subagent and goal tools (13 KB) replaced or off; 8 KB remain.
SMALL_MODEL_INSTRUCTIONS = "You are a coding assistant in a terminal. Answer briefly."

pytestmark = [pytest.mark.agent_clients, pytest.mark.timeout(600)]


@pytest.fixture(scope="session")
def clients() -> ac.AgentClients:
    """The installed clients; skip (or fail, when required) without them.

    Session-scoped so that it comes before engine_installed (pytest sets up
    wider scopes first): without the clients nothing is installed.
    """
    found = ac.find_clients()
    if isinstance(found, str):
        if os.environ.get(ac.REQUIRED_VAR) == "required":
            pytest.fail(found)
        pytest.skip(found)
    return found


@pytest.fixture(scope="module", autouse=True)
def offline(clients: ac.AgentClients, engine_installed: None) -> Iterator[str | None]:
    """Everything this module starts runs in a network namespace with only loopback, where it can.

    Yields None inside one, or why there is none (then the clients' own
    settings and the outbound sink are what keeps and shows them offline).
    """
    with ac.loopback_namespace() as why_not:
        if why_not is None:
            assert ac.interfaces() == ["lo"], ac.interfaces()
        else:
            print(f"agent clients run without a network namespace: {why_not}", file=sys.stderr)
        yield why_not


@pytest.fixture
def sink() -> Iterator[ac.OutboundSink]:
    """The clients' HTTP(S) proxy: it records what they try to reach beyond the gateway."""
    outbound = ac.OutboundSink()
    yield outbound
    outbound.close()


def _relay(port: int) -> ac.RecordingRelay:
    return ac.RecordingRelay(port)


def _assert_ran(run: ac.ClientRun, sink: ac.OutboundSink) -> None:
    assert not run.timed_out and run.returncode == 0, run.describe()
    assert sink.attempts == [], f"the client tried to reach {sink.attempts}\n{run.describe()}"


# -- the real engine ----------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_gateway(
    offline: str | None, logs_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineGateway]:
    """The gateway serving the built-in SmolLM2 on mlx-0.32.0 (cpu), replies capped per model."""
    config = tmp_path_factory.mktemp("agent-config") / "blazar.toml"
    config.write_text(
        f"[models.{json.dumps(SMOLLM2)}]\n"
        'engine = "mlx-0.32.0"\n'
        'variant = "cpu"\n'
        'model = "builtin:smollm2"\n'
        "always-loaded = true\n"
        f"max-tokens = {SMOLLM2_MAX_TOKENS}\n"
    )
    gateway = _start_config_gateway(logs_dir, config)
    yield gateway
    gateway.stop()


def _start_config_gateway(log_dir: Path, config: Path) -> EngineGateway:
    """`blazar-proxy --config FILE`, once its always-loaded child is ready."""
    port = free_port()
    return spawn_engine_gateway(
        ["--config", str(config), "--port", str(port), "--api-key", ac.API_KEY],
        port=port,
        log_path=log_dir / f"agent-gateway-{port}.log",
        env=mlx._env(),
        timeout_s=300,
        interval_s=0.2,
    )


def _events(exchange: ac.Exchange, kind: str) -> list[dict[str, Any]]:
    """The events of one type in a reply's event stream."""
    return [e for e in exchange.sse_data() if isinstance(e, dict) and e.get("type") == kind]


def _anthropic_text(exchange: ac.Exchange) -> tuple[str, dict[str, Any]]:
    """The text an Anthropic event stream carried, and its final usage."""
    text: list[str] = []
    usage: dict[str, Any] = {}
    for event in exchange.sse_data():
        assert isinstance(event, dict)
        if event.get("type") == "content_block_delta" and event["delta"].get("type") == "text_delta":
            text.append(event["delta"]["text"])
        elif event.get("type") == "message_start":
            usage.update(event["message"].get("usage") or {})
        elif event.get("type") == "message_delta":
            usage.update(event.get("usage") or {})
    return "".join(text), usage


def _responses_text(exchange: ac.Exchange) -> tuple[str, dict[str, Any]]:
    """The output text a Responses event stream carried, and the usage of response.completed."""
    text: list[str] = []
    usage: dict[str, Any] = {}
    for event in exchange.sse_data():
        assert isinstance(event, dict)
        if event.get("type") == "response.output_text.delta":
            text.append(event["delta"])
        elif event.get("type") == "response.completed":
            usage = event["response"].get("usage") or {}
    return "".join(text), usage


def _posts(relay: ac.RecordingRelay, path: str) -> list[ac.Exchange]:
    return [e for e in relay.exchanges() if e.method == "POST" and e.target.split("?")[0] == path]


def test_claude_code_answers_from_smollm2_on_mlx(
    clients: ac.AgentClients, smollm2_gateway: EngineGateway, sink: ac.OutboundSink, tmp_path: Path
) -> None:
    """`claude -p --bare` through the gateway on the real engine prints the text the gateway streamed."""
    relay = _relay(smollm2_gateway.port)
    try:
        run = ac.run_claude(clients, tmp_path, relay.url, SMOLLM2, PROMPT)
        [exchange] = _posts(relay, "/v1/messages")
    finally:
        relay.close()
    _assert_ran(run, sink)
    assert exchange.status == 200, exchange.response_body[:2000]
    text, usage = _anthropic_text(exchange)
    print(f"claude code on SmolLM2: {len(exchange.request_body)} request bytes, usage {usage}, text {text!r}")
    assert text.strip(), exchange.response_body[:2000]
    assert run.stdout.strip() == text.strip(), run.describe()
    assert 0 < usage["output_tokens"] <= SMOLLM2_MAX_TOKENS, usage


def test_codex_answers_from_smollm2_on_mlx(
    clients: ac.AgentClients, smollm2_gateway: EngineGateway, sink: ac.OutboundSink, tmp_path: Path
) -> None:
    """`codex exec` through the gateway on the real engine prints the text the gateway streamed."""
    relay = _relay(smollm2_gateway.port)
    try:
        config = ac.small_model_codex_config(tmp_path, relay.url, SMOLLM2, SMALL_MODEL_INSTRUCTIONS)
        run = ac.run_codex(
            clients, tmp_path, relay.url, SMOLLM2, "Say hello in one short sentence.", config=config
        )
        [exchange] = _posts(relay, "/v1/responses")
    finally:
        relay.close()
    _assert_ran(run, sink)
    assert exchange.status == 200, exchange.response_body[:2000]
    text, usage = _responses_text(exchange)
    print(f"codex on SmolLM2: {len(exchange.request_body)} request bytes, usage {usage}, text {text!r}")
    assert text.strip(), exchange.response_body[:2000]
    assert run.stdout.strip() == text.strip(), run.describe()
    assert 0 < usage["output_tokens"] <= SMOLLM2_MAX_TOKENS, usage


# -- a tool round trip, in front of the fake engine ---------------------------


def _chat_posts(fake: FakeEngine) -> list[dict[str, Any]]:
    records = [r for r in fake.records() if r["method"] == "POST" and r["path"].endswith("/chat/completions")]
    return [json.loads(r["body"]) for r in records]


def _offered(body: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in body.get("tools") or []]


# The fake as mlx_lm.server answers (HTTP/1.0, close-delimited) and as vLLM does (HTTP/1.1, chunked).
FRAMINGS = pytest.mark.parametrize("framing", [(), ("--http11",)], ids=["http10", "http11"])


@FRAMINGS
def test_claude_code_runs_a_tool_and_sends_its_result_through_the_gateway(
    clients: ac.AgentClients,
    start_fake_engine: StartFakeEngine,
    start_gateway: StartGateway,
    sink: ac.OutboundSink,
    tmp_path: Path,
    framing: tuple[str, ...],
) -> None:
    """Claude Code (all its tools) runs the fake's Bash call and prints the fake's final answer."""
    call = {"command": MARKER_COMMAND, "description": "Print a marker"}
    fake = start_fake_engine(*framing, "--tool-call", f"Bash={json.dumps(call)}")
    gateway = start_gateway({"agent-model": fake.url}, "--api-key", ac.API_KEY)
    relay = _relay(gateway.port)
    try:
        run = ac.run_claude(
            clients,
            tmp_path,
            relay.url,
            "agent-model",
            "Print the marker.",
            bare=False,
            timeout_s=FAKE_TIMEOUT_S,
        )
        exchanges = _posts(relay, "/v1/messages")
    finally:
        relay.close()
    _assert_ran(run, sink)
    assert TOOL_RESULT_PREFIX + MARKER in run.stdout, run.describe()
    first, second = _chat_posts(fake)
    assert "Bash" in _offered(first), _offered(first)
    assert first["messages"][-1]["role"] != "tool"
    [assistant] = [m for m in second["messages"] if m.get("tool_calls")]
    [tool_call] = assistant["tool_calls"]
    assert tool_call["function"]["name"] == "Bash"
    assert json.loads(tool_call["function"]["arguments"])["command"] == MARKER_COMMAND
    result = second["messages"][-1]
    assert result["role"] == "tool" and result["tool_call_id"] == tool_call["id"], result
    assert MARKER in json.dumps(result["content"]), result
    # Through the gateway: the tool call as Anthropic events, the tool result as a tool_result block.
    assert [e.status for e in exchanges] == [200, 200], [e.response_body[:500] for e in exchanges]
    starts = [
        e for e in exchanges[0].sse_data() if isinstance(e, dict) and e["type"] == "content_block_start"
    ]
    assert [b["content_block"]["type"] for b in starts] == ["tool_use"], starts
    sent = exchanges[1].request_json()
    assert isinstance(sent, dict)
    [block] = [b for b in sent["messages"][-1]["content"] if b.get("type") == "tool_result"]
    assert block["tool_use_id"] == starts[0]["content_block"]["id"]


@FRAMINGS
def test_codex_runs_a_tool_and_sends_its_result_through_the_gateway(
    clients: ac.AgentClients,
    start_fake_engine: StartFakeEngine,
    start_gateway: StartGateway,
    sink: ac.OutboundSink,
    tmp_path: Path,
    framing: tuple[str, ...],
) -> None:
    """Codex runs the exec_command call the fake asked for and prints the fake's final answer."""
    fake = start_fake_engine(*framing, "--tool-call", f"exec_command={json.dumps({'cmd': MARKER_COMMAND})}")
    gateway = start_gateway({"agent-model": f"{fake.url}/v1"}, "--api-key", ac.API_KEY)
    relay = _relay(gateway.port)
    try:
        run = ac.run_codex(
            clients, tmp_path, relay.url, "agent-model", "Print the marker.", timeout_s=FAKE_TIMEOUT_S
        )
        exchanges = _posts(relay, "/v1/responses")
    finally:
        relay.close()
    _assert_ran(run, sink)
    assert TOOL_RESULT_PREFIX in run.stdout and MARKER in run.stdout, run.describe()
    first, second = _chat_posts(fake)
    assert "exec_command" in _offered(first), _offered(first)
    [assistant] = [m for m in second["messages"] if m.get("tool_calls")]
    [tool_call] = assistant["tool_calls"]
    assert tool_call["function"]["name"] == "exec_command"
    result = second["messages"][-1]
    assert result["role"] == "tool" and result["tool_call_id"] == tool_call["id"], result
    assert MARKER in json.dumps(result["content"]), result
    assert [e.status for e in exchanges] == [200, 200], [e.response_body[:500] for e in exchanges]
    done = [
        e for e in exchanges[0].sse_data() if isinstance(e, dict) and e["type"] == "response.output_item.done"
    ]
    assert [d["item"]["type"] for d in done] == ["function_call"], done
    sent = exchanges[1].request_json()
    assert isinstance(sent, dict)
    [output] = [i for i in sent["input"] if i.get("type") == "function_call_output"]
    assert output["call_id"] == done[0]["item"]["call_id"] and MARKER in output["output"]
