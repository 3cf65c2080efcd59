"""Claude Code's requests, translated to chat, on the real mlx_lm.server 0.32.0 behind the gateway.

The translation (``proxy.translate.anthropic``) is driven here by the test,
as the relay drives it: Claude Code's recorded first request and its tool
round trip become chat completions (one system message, tools with their
JSON Schema 2020-12 keywords, ``tool`` messages), go through the gateway's
chat endpoint to the real engine, and the engine's stream comes back through
the translator to the anthropic SDK's own stream reader. What is pinned: the
engine takes every shape the translation makes (its template and its
``process_message_content`` refuse some), and its real chunks (usage with
``cached_tokens``, the usage chunk without choices) read as Anthropic's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import orjson
import pytest

from proxy.translate.anthropic import CountTokensTranslator, MessagesTranslator
from tests.e2e.test_engine_mlx import engine_installed as engine_installed
from tests.e2e.test_engine_mlx import start_engine_gateway
from tests.helpers import EngineGateway

# The model name Claude Code was run with when its requests were recorded.
SERVED = "some-local-model"
AGENT_CLIENTS = Path(__file__).resolve().parents[1] / "data" / "agent-clients"
# What the per-model cap would leave of Claude Code's max_tokens 32000 for a tiny model.
CAPPED_MAX_TOKENS = 8


@pytest.fixture(scope="module")
def gateway(engine_installed: None, logs_dir: Path) -> Iterator[EngineGateway]:
    running = start_engine_gateway(logs_dir, "--served-name", SERVED)
    yield running
    running.stop()


def claude_code_request(*, round_trip: bool) -> dict[str, Any]:
    """Claude Code's recorded first request (its Bash tool), with its Bash round trip appended if asked."""
    body: dict[str, Any] = json.loads((AGENT_CLIENTS / "claude-code-first-request.summary.json").read_text())[
        "body_summary"
    ]
    body["tools"] = [body.pop("tools[Bash]"), {"type": "web_search_20250305", "name": "web_search"}]
    if round_trip:
        body["messages"] += json.loads((AGENT_CLIENTS / "claude-code-tool-roundtrip-bash.json").read_text())
    return body


def relay(gateway: EngineGateway, translator: MessagesTranslator | CountTokensTranslator) -> bytes:
    """As the relay does: the translator's chat request to the engine, the engine's chunks through it."""
    chat = translator.chat_request()
    chat["max_tokens"] = min(chat["max_tokens"], CAPPED_MAX_TOKENS)
    out = translator.start()
    ended = False
    with (
        httpx.Client(trust_env=False, timeout=120) as http,
        http.stream("POST", f"{gateway.url}/v1/chat/completions", json=chat) as response,
    ):
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line == "data: [DONE]":
                ended = True
            elif line.startswith("data: "):
                out += translator.feed(orjson.loads(line[6:]))
    assert ended
    return out + translator.finish()


def sdk(gateway: EngineGateway) -> anthropic.Anthropic:
    """The anthropic SDK, its requests answered by the translation over the real engine."""

    def answer(request: httpx2.Request) -> httpx2.Response:
        doc = json.loads(request.content)
        if request.url.path.endswith("/count_tokens"):
            counter = CountTokensTranslator(doc)
            relay(gateway, counter)
            return httpx2.Response(200, content=counter.reply())
        translator = MessagesTranslator(doc)
        body = relay(gateway, translator)
        if translator.stream:
            return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})
        return httpx2.Response(200, content=translator.reply())

    return anthropic.Anthropic(
        api_key="sk-local",
        base_url="http://gateway.test",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(answer)),
    )


def create_kwargs(body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """The SDK's arguments for Claude Code's body, its fields with no chat equivalent sent as extra body."""
    extra = {name: body[name] for name in ("thinking", "context_management", "output_config", "metadata")}
    return {
        "model": body["model"],
        "max_tokens": max_tokens,
        "system": body["system"],
        "messages": body["messages"],
        "tools": body["tools"],
        "extra_body": extra,
    }


@pytest.mark.parametrize("round_trip", [False, True], ids=["first-request", "tool-round-trip"])
def test_claude_code_stream_on_mlx_reads_in_the_sdk(gateway: EngineGateway, round_trip: bool) -> None:
    """Claude Code's request, streamed: mlx answers its translation; the SDK reads a message with usage."""
    body = claude_code_request(round_trip=round_trip)
    with sdk(gateway).messages.stream(**create_kwargs(body, 32000)) as stream:
        message = stream.get_final_message()
    assert message.model == SERVED
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 0 < message.usage.output_tokens <= CAPPED_MAX_TOKENS
    prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert prompt > 100
    assert all(block.type == "text" for block in message.content)


def test_claude_code_tool_round_trip_reuses_the_engines_prompt_cache(gateway: EngineGateway) -> None:
    """The round trip after the first request reads their shared prefix from mlx's cache: cache_read."""
    client = sdk(gateway)
    client.messages.create(**create_kwargs(claude_code_request(round_trip=False), 1000))
    message = client.messages.create(**create_kwargs(claude_code_request(round_trip=True), 1000))
    assert isinstance(message, anthropic.types.Message)
    assert (message.usage.cache_read_input_tokens or 0) > 100
    assert message.usage.input_tokens > 0


def test_claude_code_count_tokens_on_mlx(gateway: EngineGateway) -> None:
    """count_tokens of Claude Code's request is the engine's prompt_tokens, more for the longer round trip."""
    client = sdk(gateway)
    counts = []
    for round_trip in (False, True):
        body = claude_code_request(round_trip=round_trip)
        kwargs = create_kwargs(body, 1)
        del kwargs["max_tokens"]
        counts.append(client.messages.count_tokens(**kwargs).input_tokens)
    assert 100 < counts[0] < counts[1]
