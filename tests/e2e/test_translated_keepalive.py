"""A translated stream during a long prefill: its head and opening events at once, then keepalives.

mlx_lm.server sends its 200 head before a prefill and then only SSE comments
until the first token (the fake's ``prefill=S; keepalive=S``); a prompt of
Claude Code's or Codex's size takes minutes to prefill on a CPU, and Codex
gives up on a stream idle for 300 s. The gateway writes the API's opening
events as soon as the engine's head is in, and then the API's own keepalive
(Anthropic's ``ping``; the Responses API's ``response.in_progress`` before any
output, a comment after) whenever the client has had nothing for
``--sse-heartbeat``; the SDKs still read the whole answer.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest

from tests.e2e.conftest import (
    FakeEngine,
    Running,
    StartFakeEngine,
    StartGateway,
    _start_fake_engine,
    _start_gateway,
    openai_client,
)
from tests.e2e.test_api_sdks import ASK, MESSAGES, RESPONSES, claude, post_stream
from tests.helpers import named_events

# mlx's way: the head, then a comment every 0.2 s for 2 s, then the tokens.
PREFILL = {"x-fake": "prefill=2; keepalive=0.2; chunks=3"}
# A silent engine: the first event, then nothing for 2 s.
STALL = {"x-fake": "stall=2; chunks=3"}


@pytest.fixture(scope="module")
def engine(start_fake_engine_module: StartFakeEngine) -> FakeEngine:
    return start_fake_engine_module()


@pytest.fixture(scope="module")
def gateway(engine: FakeEngine, start_gateway_module: StartGateway) -> Running:
    return start_gateway_module({"fake": engine.url}, "--sse-heartbeat", "0.4")


@pytest.fixture(scope="module")
def start_fake_engine_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartFakeEngine]:
    started: list[FakeEngine] = []

    def start(*args: str) -> FakeEngine:
        engine = _start_fake_engine(tmp_path_factory.mktemp("fake"), *args)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


@pytest.fixture(scope="module")
def start_gateway_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartGateway]:
    started: list[Running] = []

    def start(upstreams: dict[str, str], *args: str) -> Running:
        gateway = _start_gateway(tmp_path_factory.mktemp("gw"), upstreams, *args)
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        gateway.stop()


def _names(payload: bytes) -> list[str]:
    return [name for name, _ in named_events(payload)]


@pytest.mark.parametrize("fault", [PREFILL, STALL], ids=["prefill-comments", "silent-stall"])
def test_a_messages_stream_pings_while_the_engine_prefills(gateway: Running, fault: dict[str, str]) -> None:
    """message_start comes first, then pings while the engine sends no token, then the text."""
    body = {"model": "fake", "max_tokens": 3, "stream": True, "messages": ASK}
    status, payload = post_stream(gateway.url + MESSAGES, body, fault)
    names = _names(payload)
    assert status == 200 and names[0] == "message_start", names
    assert names[-1] == "message_stop", names
    assert names.count("ping") >= 2, names
    if fault is PREFILL:
        first_delta = names.index("content_block_delta")
        assert names[1:first_delta].count("ping") >= 2, names


def test_the_anthropic_sdk_reads_a_stream_with_pings(gateway: Running) -> None:
    """The SDK's stream helper takes the pings and rebuilds the message."""
    with (
        claude(gateway.url) as client,
        client.messages.stream(model="fake", max_tokens=3, messages=ASK, extra_headers=PREFILL) as stream,
    ):
        message = stream.get_final_message()
    assert isinstance(message, anthropic.types.Message)
    assert message.content[0].type == "text" and message.content[0].text.startswith("tok0")


@pytest.mark.parametrize("fault", [PREFILL, STALL], ids=["prefill-comments", "silent-stall"])
def test_a_responses_stream_keeps_alive_while_the_engine_prefills(
    gateway: Running, fault: dict[str, str]
) -> None:
    """response.created first, response.in_progress again while no token came, then the output."""
    body = {"model": "fake", "input": "hi", "max_output_tokens": 3, "stream": True}
    status, payload = post_stream(gateway.url + RESPONSES, body, fault)
    names = _names(payload)
    assert status == 200 and names[0] == "response.created", names
    assert names[-1] in ("response.completed", "response.incomplete"), names
    if fault is PREFILL:
        first_item = names.index("response.output_item.added")
        assert names[:first_item].count("response.in_progress") >= 3, names
    else:
        # Output had begun: the keepalive is a comment, which no event parser yields.
        assert payload.count(b": keepalive\n\n") >= 2, payload[:2000]


def test_the_openai_sdk_reads_a_responses_stream_with_keepalives(gateway: Running) -> None:
    """The SDK's stream helper takes the repeated in_progress events and rebuilds the response."""
    with (
        openai_client(gateway.url) as client,
        client.responses.stream(
            model="fake",
            input="hi",
            max_output_tokens=3,
            extra_headers={"x-fake": PREFILL["x-fake"] + "; stop"},
        ) as stream,
    ):
        response = stream.get_final_response()
    assert response.status == "completed" and response.output_text.startswith("tok0")
