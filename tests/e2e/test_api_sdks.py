"""The Anthropic Messages and OpenAI Responses APIs through the gateway, with the real Python SDKs.

Their stream helpers (``messages.stream``, ``responses.stream``) are stricter than
the CLIs: they rebuild the message from the events and refuse a stream that does
not end with the API's own last event. Three upstreams:

- translation: the fake engine as a plain chat-only static upstream (the session's
  ``gateway``, model "fake"); the gateway turns each request into a chat completion
  and the chat stream into the API's events;
- passthrough: the fake with its native routes (``--native-apis``), configured as
  serving them; the bytes go through untouched, and only a stream that ends without
  the API's last event gets the gateway's error end;
- the real mlx engine (``--engine mlx-0.32.0 --model builtin:tiny``).
"""

from __future__ import annotations

import base64
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from tests.e2e.conftest import FakeEngine, Running, StartFakeEngine, StartGateway, openai_client
from tests.e2e.test_engine_mlx import DEMO, start_engine_gateway
from tests.e2e.test_engine_mlx import engine_installed as engine_installed
from tests.helpers import EngineGateway, named_events

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
CHAT = "/v1/chat/completions"
ASK: Any = [{"role": "user", "content": "hi"}]
WEATHER: Any = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
SHELL: Any = [
    {
        "type": "function",
        "name": "shell",
        "description": "Run a command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]
# What the fake's tool-calls=1 sends as the first call's arguments.
CALL_0 = {"call": 0, "city": "Paris", "unit": "celsius"}
# The fake's answer ends its turn (finish_reason stop) instead of running into max_tokens.
STOP = {"x-fake": "stop"}
# The per-model config key that says which APIs a static upstream serves itself.
NATIVE_KEY = "native-apis"
_NOTICE_WITHIN_S = 1.0


def claude(
    gateway_url: str, *, api_key: str | None = "unused", auth_token: str | None = None
) -> anthropic.Anthropic:
    """The Anthropic SDK as a user makes it (base URL without /v1), minus retries and proxy variables."""
    return anthropic.Anthropic(
        base_url=gateway_url,
        api_key=api_key,
        auth_token=auth_token,
        max_retries=0,
        http_client=anthropic.DefaultHttpxClient(trust_env=False, timeout=20.0),
    )


def fake_header(value: str) -> dict[str, str]:
    return {"x-fake": value}


def post_stream(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """POST and read the whole body, whatever its end; (status, body)."""
    with (
        httpx.Client(trust_env=False, timeout=20) as client,
        client.stream("POST", url, json=body, headers=headers or {}) as response,
    ):
        data = b""
        try:
            for chunk in response.iter_raw():
                data += chunk
        except httpx.HTTPError:
            pass
        return response.status_code, data


def planned(record: dict[str, Any]) -> bytes:
    """What the fake built for a native request, before any fault cut it."""
    assert record["planned_b64"] is not None, record
    return base64.b64decode(record["planned_b64"])


def last_native(fake: FakeEngine, path: str) -> dict[str, Any]:
    return fake.wait_for_record(lambda r: r["path"].startswith(path) and r["outcome"] is not None)


# -- translation: Anthropic Messages over the fake's chat completions ---------------------


def test_anthropic_create_non_stream(gateway: Running, fake: FakeEngine) -> None:
    """messages.create answers a Message with the fake's text, max_tokens stop, usage and the model name."""
    with claude(gateway.url) as client:
        message = client.messages.create(model="fake", max_tokens=3, messages=ASK, system="Be brief.")
    assert message.type == "message" and message.role == "assistant" and message.model == "fake"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].type == "text" and message.content[0].text == "tok0 tok1 tok2 "
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 3 and message.usage.input_tokens > 0
    record = fake.wait_for_record(lambda r: r["path"] == CHAT)
    sent = orjson.loads(record["body"])
    assert sent["messages"][0] == {"role": "system", "content": "Be brief."}
    assert sent["messages"][-1]["role"] == "user" and sent["max_tokens"] == 3


def test_anthropic_stream_text_and_final_message(gateway: Running, fake: FakeEngine) -> None:
    """messages.stream yields the text as it comes and get_final_message() rebuilds the same Message."""
    with (
        claude(gateway.url) as client,
        client.messages.stream(model="fake", max_tokens=4, messages=ASK) as stream,
    ):
        pieces = list(stream.text_stream)
        message = stream.get_final_message()
    assert pieces == ["tok0 ", "tok1 ", "tok2 ", "tok3 "]
    assert message.content[0].type == "text" and message.content[0].text == "tok0 tok1 tok2 tok3 "
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_anthropic_tool_call(gateway: Running, fake: FakeEngine, stream: bool) -> None:
    """A chat tool call comes back as a tool_use block with the parsed input, stop_reason tool_use."""
    message: anthropic.types.Message
    with claude(gateway.url) as client:
        headers = fake_header("tool-calls=1")
        if stream:
            with client.messages.stream(
                model="fake", max_tokens=2, messages=ASK, tools=WEATHER, extra_headers=headers
            ) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(
                model="fake", max_tokens=2, messages=ASK, tools=WEATHER, extra_headers=headers
            )
    assert message.stop_reason == "tool_use"
    tool = message.content[-1]
    assert tool.type == "tool_use" and tool.name == "get_weather" and tool.input == CALL_0 and tool.id
    sent = orjson.loads(fake.wait_for_record(lambda r: r["path"] == CHAT)["body"])
    assert sent["tools"][0]["type"] == "function" and sent["tools"][0]["function"]["name"] == "get_weather"


def test_anthropic_tool_result_round_trip(gateway: Running, fake: FakeEngine) -> None:
    """A tool_result sent back reaches the engine as a tool message after the assistant's tool_calls."""
    history: Any = [
        *ASK,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": CALL_0}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    with claude(gateway.url) as client:
        message = client.messages.create(model="fake", max_tokens=2, messages=history, tools=WEATHER)
    assert message.content[0].type == "text" and message.content[0].text == "tok0 tok1 "
    sent = orjson.loads(fake.wait_for_record(lambda r: r["path"] == CHAT)["body"])
    assistant, tool = sent["messages"][-2:]
    assert assistant["tool_calls"][0]["id"] == "toolu_1"
    assert orjson.loads(assistant["tool_calls"][0]["function"]["arguments"]) == CALL_0
    assert tool["role"] == "tool" and tool["tool_call_id"] == "toolu_1" and "sunny" in str(tool["content"])


def test_anthropic_count_tokens_grows_with_the_prompt(gateway: Running, fake: FakeEngine) -> None:
    """messages.count_tokens gives a positive count that grows with the prompt."""
    with claude(gateway.url) as client:
        short = client.messages.count_tokens(model="fake", messages=ASK)
        long = client.messages.count_tokens(
            model="fake", messages=[{"role": "user", "content": "hello " * 300}]
        )
    assert 0 < short.input_tokens < long.input_tokens


def test_anthropic_unknown_model_is_not_found_in_anthropics_envelope(
    gateway: Running, fake: FakeEngine
) -> None:
    """An unknown model raises NotFoundError, the body {"type": "error", "error": {type, message}}."""
    with claude(gateway.url) as client, pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", max_tokens=2, messages=ASK)
    body: Any = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert "no-such-model" in body["error"]["message"]
    assert fake.records() == []


def test_anthropic_bad_body_is_bad_request(gateway: Running, fake: FakeEngine, http: httpx.Client) -> None:
    """A body the API refuses raises anthropic.BadRequestError; JSON that does not parse is 400 likewise."""
    with claude(gateway.url) as client, pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model="fake", max_tokens=2, messages=ASK, extra_body={"messages": "not a list"}
        )
    body: Any = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    response = http.post(
        gateway.url + MESSAGES, content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    assert fake.records() == []


@pytest.fixture
def guarded(start_gateway: StartGateway, fake: FakeEngine) -> Running:
    """A gateway that wants the key "right-key"."""
    return start_gateway({"fake": fake.url}, "--api-key", "right-key")


def test_anthropic_wrong_key_is_authentication_error(guarded: Running, fake: FakeEngine) -> None:
    """A wrong key as x-api-key or as Bearer raises AuthenticationError; the right one gets in both ways."""
    for client in (
        claude(guarded.url, api_key="wrong"),
        claude(guarded.url, api_key=None, auth_token="wrong"),
    ):
        with client, pytest.raises(anthropic.AuthenticationError) as caught:
            client.messages.create(model="fake", max_tokens=2, messages=ASK)
        body: Any = caught.value.body
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        assert "wrong" not in body["error"]["message"]
    assert fake.records() == []
    for client in (
        claude(guarded.url, api_key="right-key"),
        claude(guarded.url, api_key=None, auth_token="right-key"),
    ):
        with client:
            assert client.messages.create(model="fake", max_tokens=1, messages=ASK).content
    assert len(fake.records()) == 2


@pytest.mark.fault("upstreams", "a body cut short or malformed mid-way")
def test_anthropic_stream_cut_by_the_engine_ends_with_an_error_event(
    gateway: Running, fake: FakeEngine
) -> None:
    """A chat stream the engine cuts ends the Messages stream with an `error` event; the SDK raises."""
    with (
        claude(gateway.url) as client,
        pytest.raises(anthropic.APIError),
        client.messages.stream(
            model="fake", max_tokens=10, messages=ASK, extra_headers=fake_header("die-after=3")
        ) as stream,
    ):
        list(stream.text_stream)
    status, payload = post_stream(
        gateway.url + MESSAGES,
        {"model": "fake", "max_tokens": 10, "messages": ASK, "stream": True},
        fake_header("die-after=3"),
    )
    events = named_events(payload)
    assert status == 200
    assert events[-1][0] == "error" and events[-1][1]["type"] == "error" and events[-1][1]["error"]["message"]
    assert "message_stop" not in [name for name, _ in events]


# -- translation: OpenAI Responses over the fake's chat completions ------------------------


def test_openai_responses_create_non_stream(gateway: Running, fake: FakeEngine) -> None:
    """responses.create answers a completed Response with the fake's text and usage."""
    with openai_client(gateway.url) as client:
        response = client.responses.create(
            model="fake", input="hi", instructions="Be brief.", max_output_tokens=3, extra_headers=STOP
        )
    assert response.status == "completed" and response.model == "fake"
    assert response.output_text == "tok0 tok1 tok2 "
    assert response.usage is not None and response.usage.output_tokens == 3
    sent = orjson.loads(fake.wait_for_record(lambda r: r["path"] == CHAT)["body"])
    assert sent["messages"][0] == {"role": "system", "content": "Be brief."}
    assert sent["messages"][-1]["role"] == "user"


def test_openai_responses_create_stream(gateway: Running, fake: FakeEngine) -> None:
    """responses.create(stream=True) runs response.created .. response.completed with the text deltas."""
    with openai_client(gateway.url) as client:
        events = list(
            client.responses.create(
                model="fake", input="hi", max_output_tokens=3, stream=True, extra_headers=STOP
            )
        )
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "tok0 tok1 tok2 " and len(deltas) == 3
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)


def test_openai_responses_stream_helper_final_response(gateway: Running, fake: FakeEngine) -> None:
    """responses.stream() rebuilds the Response, and get_final_response() returns the completed one."""
    with (
        openai_client(gateway.url) as client,
        client.responses.stream(model="fake", input=ASK, max_output_tokens=4, extra_headers=STOP) as stream,
    ):
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == "tok0 tok1 tok2 tok3 " == final.output_text
    assert final.status == "completed"


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_openai_answer_cut_at_max_output_tokens_is_incomplete(
    gateway: Running, fake: FakeEngine, stream: bool
) -> None:
    """An answer the engine ends at max tokens is an incomplete Response (max_output_tokens), as OpenAI's."""
    with openai_client(gateway.url) as client:
        if stream:
            events = list(client.responses.create(model="fake", input="hi", max_output_tokens=3, stream=True))
            last = events[-1]
            assert last.type == "response.incomplete", last
            response = last.response
        else:
            response = client.responses.create(model="fake", input="hi", max_output_tokens=3)
    assert response.status == "incomplete" and response.output_text == "tok0 tok1 tok2 "
    assert (
        response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    )


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_openai_responses_function_call(gateway: Running, fake: FakeEngine, stream: bool) -> None:
    """A chat tool call comes back as a function_call output item with its name and arguments."""
    headers = fake_header("tool-calls=1")
    response: openai.types.responses.Response
    with openai_client(gateway.url) as client:
        if stream:
            with client.responses.stream(
                model="fake", input="hi", max_output_tokens=2, tools=SHELL, extra_headers=headers
            ) as events:
                response = events.get_final_response()
        else:
            response = client.responses.create(
                model="fake", input="hi", max_output_tokens=2, tools=SHELL, extra_headers=headers
            )
    calls = [o for o in response.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "shell" and calls[0].call_id
    assert orjson.loads(calls[0].arguments) == CALL_0
    sent = orjson.loads(fake.wait_for_record(lambda r: r["path"] == CHAT)["body"])
    assert sent["tools"][0]["function"]["name"] == "shell"


def test_openai_function_call_output_round_trip(gateway: Running, fake: FakeEngine) -> None:
    """function_call and function_call_output items reach the engine as tool_calls and a tool message."""
    items: Any = [
        {"role": "user", "content": "list files"},
        {"type": "function_call", "call_id": "call_9", "name": "shell", "arguments": '{"command": "ls"}'},
        {"type": "function_call_output", "call_id": "call_9", "output": "a.txt"},
    ]
    with openai_client(gateway.url) as client:
        response = client.responses.create(model="fake", input=items, tools=SHELL, max_output_tokens=2)
    assert response.output_text == "tok0 tok1 "
    sent = orjson.loads(fake.wait_for_record(lambda r: r["path"] == CHAT)["body"])
    assistant, tool = sent["messages"][-2:]
    assert (
        assistant["tool_calls"][0]["id"] == "call_9"
        and assistant["tool_calls"][0]["function"]["name"] == "shell"
    )
    assert tool == {"role": "tool", "tool_call_id": "call_9", "content": "a.txt"}


@pytest.mark.parametrize(
    "fields", [{"previous_response_id": "resp_123"}, {"store": True}], ids=["previous_response_id", "store"]
)
def test_openai_stateful_requests_are_bad_requests(
    gateway: Running, fake: FakeEngine, fields: dict[str, Any]
) -> None:
    """previous_response_id and store: true raise BadRequestError in OpenAI's envelope, naming the field."""
    with openai_client(gateway.url) as client, pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="fake", input="hi", **fields)
    body: Any = caught.value.body
    assert set(body) >= {"message", "type", "param", "code"}
    assert next(iter(fields)) in body["message"]
    assert fake.records() == []


def test_openai_responses_errors_in_openais_envelope(guarded: Running, fake: FakeEngine) -> None:
    """Unknown model: NotFoundError; wrong key: AuthenticationError; both in OpenAI's error envelope."""
    client = openai.OpenAI(
        base_url=guarded.url + "/v1",
        api_key="right-key",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(trust_env=False, timeout=10),
    )
    with client, pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="no-such-model", input="hi")
    wrong = openai.OpenAI(
        base_url=guarded.url + "/v1",
        api_key="wrong",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(trust_env=False, timeout=10),
    )
    with wrong, pytest.raises(openai.AuthenticationError) as denied:
        wrong.responses.create(model="fake", input="hi")
    for error in (missing.value, denied.value):
        body: Any = error.body
        assert set(body) >= {"message", "type", "param", "code"}, body
    assert fake.records() == []


@pytest.mark.fault("upstreams", "a body cut short or malformed mid-way")
def test_openai_stream_cut_by_the_engine_ends_with_response_failed(
    gateway: Running, fake: FakeEngine
) -> None:
    """A chat stream the engine cuts ends the Responses stream with response.failed, never completed."""
    with openai_client(gateway.url) as client:
        events = list(
            client.responses.create(
                model="fake",
                input="hi",
                max_output_tokens=10,
                stream=True,
                extra_headers=fake_header("die-after=3"),
            )
        )
        types = [e.type for e in events]
        assert types[0] == "response.created" and types[-1] == "response.failed"
        assert "response.completed" not in types
        last = events[-1]
        assert last.type == "response.failed" and last.response.status == "failed" and last.response.error
        with (
            pytest.raises(RuntimeError),
            client.responses.stream(
                model="fake", input="hi", max_output_tokens=10, extra_headers=fake_header("die-after=3")
            ) as stream,
        ):
            list(stream)
            stream.get_final_response()


# -- passthrough: the fake's own /v1/messages and /v1/responses -----------------------------


@pytest.fixture
def native_fake(start_fake_engine: StartFakeEngine) -> FakeEngine:
    """A fake engine that serves the Messages and Responses APIs itself, as llama-server does."""
    return start_fake_engine("--native-apis", "messages,responses")


@pytest.fixture
def passthrough(start_gateway: StartGateway, native_fake: FakeEngine, tmp_path: Path) -> Running:
    """A gateway whose model "native" is the native fake, configured as serving both APIs."""
    config = tmp_path / "blazar.toml"
    config.write_text(
        f'[models.native]\nupstream = "{native_fake.url}/v1"\n{NATIVE_KEY} = ["messages", "responses"]\n'
    )
    return start_gateway({}, "--config", str(config))


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param(MESSAGES, {"max_tokens": 3, "messages": ASK, "stream": True}, id="messages-stream"),
        pytest.param(MESSAGES, {"max_tokens": 3, "messages": ASK}, id="messages"),
        pytest.param(COUNT_TOKENS, {"messages": ASK}, id="count_tokens"),
        pytest.param(
            RESPONSES, {"max_output_tokens": 3, "input": "hi", "stream": True}, id="responses-stream"
        ),
        pytest.param(RESPONSES, {"max_output_tokens": 3, "input": "hi"}, id="responses"),
    ],
)
def test_passthrough_bytes_come_through_untouched(
    passthrough: Running, native_fake: FakeEngine, path: str, body: dict[str, Any]
) -> None:
    """To an engine that serves the API itself the request goes to that API; its reply comes back as sent."""
    status, payload = post_stream(
        passthrough.url + path, {"model": "native", **body}, fake_header("tool-calls=1")
    )
    record = last_native(native_fake, path)
    assert status == 200
    assert record["path"].partition("?")[0] == path and record["outcome"] == "completed"
    assert payload == planned(record)
    assert [r["path"] for r in native_fake.records() if r["path"] == CHAT] == []


def test_passthrough_sdk_helpers_and_query_string(passthrough: Running, native_fake: FakeEngine) -> None:
    """Both SDKs' stream helpers complete through passthrough; Claude Code's ?beta=true is no obstacle."""
    with claude(passthrough.url) as client:
        with client.messages.stream(
            model="native",
            max_tokens=3,
            messages=ASK,
            tools=WEATHER,
            extra_headers=fake_header("tool-calls=1"),
        ) as stream:
            message = stream.get_final_message()
        assert message.stop_reason == "tool_use" and message.content[-1].type == "tool_use"
        assert client.messages.count_tokens(model="native", messages=ASK).input_tokens > 0
        beta = client.beta.messages.create(model="native", max_tokens=2, messages=ASK)
        assert beta.content[0].type == "text" and beta.content[0].text == "tok0 tok1 "
    with (
        openai_client(passthrough.url) as oai,
        oai.responses.stream(model="native", input="hi", max_output_tokens=2) as rstream,
    ):
        assert rstream.get_final_response().output_text == "tok0 tok1 "
    paths = [r["path"].partition("?")[0] for r in native_fake.records()]
    assert CHAT not in paths and paths.count(MESSAGES) == 2 and paths.count(RESPONSES) == 1


@pytest.mark.fault("upstreams", "a stream without [DONE], or not an event stream")
@pytest.mark.parametrize(
    ("path", "body", "last", "error_end"),
    [
        pytest.param(
            MESSAGES,
            {"max_tokens": 3, "messages": ASK, "stream": True},
            "message_stop",
            ("error",),
            id="messages",
        ),
        pytest.param(
            RESPONSES,
            {"max_output_tokens": 3, "input": "hi", "stream": True},
            "response.completed",
            ("response.failed",),
            id="responses",
        ),
    ],
)
@pytest.mark.parametrize("fault", ["no-done", "die-after=4"])
def test_passthrough_stream_without_its_last_event_gets_an_error_end(
    passthrough: Running,
    native_fake: FakeEngine,
    path: str,
    body: dict[str, Any],
    last: str,
    error_end: tuple[str, ...],
    fault: str,
) -> None:
    """A native stream without its last event is passed on, then ended with the API's own error."""
    status, payload = post_stream(passthrough.url + path, {"model": "native", **body}, fake_header(fault))
    record = last_native(native_fake, path)
    whole = planned(record)
    assert status == 200
    sent = whole[: whole.rindex(b"event: " + last.encode())] if fault == "no-done" else None
    if sent is not None:
        assert payload.startswith(sent)
    events = named_events(payload)
    assert last not in [name for name, _ in events]
    name, data = events[-1]
    assert name in error_end, events[-1]
    if name == "response.failed":
        assert data["response"]["status"] == "failed" and data["response"]["error"]["message"]
    else:
        assert data["type"] == "error" and data["error"]["message"]


@pytest.mark.fault("upstreams", "a stream without [DONE], or not an event stream")
def test_passthrough_sdk_sees_a_cut_stream_fail(passthrough: Running, native_fake: FakeEngine) -> None:
    """Through passthrough, anthropic raises on a stream cut before message_stop; openai sees failed."""
    with (
        claude(passthrough.url) as client,
        pytest.raises(anthropic.APIError),
        client.messages.stream(
            model="native", max_tokens=5, messages=ASK, extra_headers=fake_header("no-done")
        ) as stream,
    ):
        stream.get_final_message()
    with openai_client(passthrough.url) as oai:
        events = list(
            oai.responses.create(
                model="native",
                input="hi",
                max_output_tokens=5,
                stream=True,
                extra_headers=fake_header("no-done"),
            )
        )
    assert events[-1].type == "response.failed"
    assert "response.completed" not in [e.type for e in events]


# -- the real mlx engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlx(engine_installed: None, logs_dir: Path) -> Iterator[EngineGateway]:
    """The gateway with its mlx child serving the tiny built-in model."""
    gateway = start_engine_gateway(logs_dir)
    yield gateway
    gateway.stop()


def test_mlx_anthropic_stream_answers(mlx: EngineGateway) -> None:
    """An anthropic stream through the gateway on mlx answers with text and a clean end."""
    with (
        claude(mlx.url) as client,
        client.messages.stream(model=DEMO, max_tokens=12, messages=ASK) as stream,
    ):
        pieces = list(stream.text_stream)
        message = stream.get_final_message()
    assert len(pieces) >= 2 and "".join(pieces).strip()
    assert message.content[0].type == "text" and message.content[0].text == "".join(pieces)
    assert message.stop_reason in ("max_tokens", "end_turn")
    assert message.usage.output_tokens > 0 and message.usage.input_tokens > 0


def test_mlx_openai_responses_stream_answers(mlx: EngineGateway) -> None:
    """An openai responses stream through the gateway on mlx answers with text and a proper end."""
    with openai_client(mlx.url, timeout_s=60) as client:
        events = list(
            client.responses.create(model=DEMO, input="Say hello.", max_output_tokens=12, stream=True)
        )
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    last = events[-1]
    # The tiny random-weight model seldom ends its turn: at 12 tokens the Response is incomplete.
    assert last.type in ("response.completed", "response.incomplete"), last
    final = last.response
    assert len(deltas) >= 2 and final.output_text == "".join(deltas) and final.output_text.strip()
    assert final.usage is not None and final.usage.output_tokens > 0


def test_mlx_count_tokens_grows_with_the_prompt(mlx: EngineGateway) -> None:
    """count_tokens on mlx is positive and grows with the prompt."""
    with claude(mlx.url) as client:
        short = client.messages.count_tokens(model=DEMO, messages=ASK)
        long = client.messages.count_tokens(
            model=DEMO, messages=[{"role": "user", "content": "hello there " * 50}]
        )
    assert 0 < short.input_tokens < long.input_tokens


def test_mlx_refuses_a_translated_field_by_the_clients_name(mlx: EngineGateway) -> None:
    """Five stop_sequences (mlx takes four stop strings) are a 400 naming stop_sequences, not chat's stop."""
    body = {"model": DEMO, "max_tokens": 4, "messages": ASK, "stop_sequences": ["a", "b", "c", "d", "e"]}
    with httpx.Client(trust_env=False, timeout=20) as client:
        reply = client.post(mlx.url + MESSAGES, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("stop_sequences"), error


# -- the relay's duties on the new routes ---------------------------------------------------


def open_raw(gateway: Running, path: str, body: dict[str, Any], header: str) -> socket.socket:
    """Send a request on a raw socket and leave it open."""
    payload = orjson.dumps(body)
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
    sock.sendall(
        b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"x-fake: %s\r\nContent-Length: %d\r\n\r\n" % (path.encode(), header.encode(), len(payload)) + payload
    )
    return sock


@pytest.mark.fault("clients", "a client that leaves mid-request")
@pytest.mark.parametrize(
    ("path", "body", "marker"),
    [
        pytest.param(
            MESSAGES, {"max_tokens": 400, "messages": ASK, "stream": True}, b"text_delta", id="messages"
        ),
        pytest.param(
            RESPONSES,
            {"max_output_tokens": 400, "input": "hi", "stream": True},
            b"output_text.delta",
            id="responses",
        ),
    ],
)
def test_a_client_that_leaves_a_translated_stream_closes_the_upstream(
    gateway: Running, fake: FakeEngine, path: str, body: dict[str, Any], marker: bytes
) -> None:
    """The engine sees its connection closed within 1 s of the client leaving a translated stream mid-way."""
    sock = open_raw(gateway, path, {"model": "fake", **body}, "chunk-delay=0.05; chunks=400")
    try:
        received = b""
        while marker not in received:
            data = sock.recv(65536)
            assert data, received
            received += data
        assert fake.records()[0]["closed_at"] is None
    finally:
        closed_at = time.time()
        sock.close()
    record = fake.wait_for_record(lambda r: r["closed_at"] is not None, timeout_s=5)
    assert record["path"] == CHAT and record["outcome"] == "peer_closed"
    assert record["closed_at"] - closed_at < _NOTICE_WITHIN_S
    assert record["events_sent"] < 400


def _sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def _routes(text: str, name: str) -> set[str]:
    return {
        line.split('route="', 1)[1].split('"', 1)[0]
        for line in text.splitlines()
        if line.startswith(name + "{") and 'route="' in line
    }


def test_access_log_and_metrics_carry_the_new_routes(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client
) -> None:
    """Each new route gets its access-log line (path, model, status) and its own route label in /metrics."""
    gateway = start_gateway({"fake": fake.url}, "--log-format", "json")
    calls = [
        (MESSAGES + "?beta=true", {"model": "fake", "max_tokens": 2, "messages": ASK}, "msg"),
        (COUNT_TOKENS, {"model": "fake", "messages": ASK}, "count"),
        (RESPONSES, {"model": "fake", "input": "hi", "max_output_tokens": 2}, "resp"),
    ]
    for path, body, request_id in calls:
        assert (
            http.post(gateway.url + path, json=body, headers={"x-request-id": request_id}).status_code == 200
        )
    deadline = time.monotonic() + 10
    while True:
        records = [orjson.loads(line) for line in gateway.log().splitlines() if '"request_id"' in line]
        if len(records) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    by_id = {r["request_id"]: r for r in records}
    for path, _, request_id in calls:
        line = by_id[request_id]
        assert line["status"] == 200 and line["model"] == "fake", line
        assert line["path"].partition("?")[0] == path.partition("?")[0], line
    text = http.get(gateway.url + "/metrics").text
    routes = _routes(text, "blazar_requests_total")
    new = routes - {"chat/completions", "completions", "embeddings"}
    assert len(new) >= 3, routes
    assert any("count" in r for r in new) and any("responses" in r for r in new), routes
    for route in new:
        assert _sample(text, "blazar_requests_total", model="fake", route=route, code="200") == 1, (
            route,
            text,
        )


@pytest.mark.fault("overload", "the limit and the queue: 429 and 503 with Retry-After")
@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param(MESSAGES, {"max_tokens": 2, "messages": ASK}, id="messages"),
        pytest.param(RESPONSES, {"max_output_tokens": 2, "input": "hi"}, id="responses"),
    ],
)
def test_admission_limits_apply_to_the_new_routes(
    start_gateway: StartGateway, fake: FakeEngine, http: httpx.Client, path: str, body: dict[str, Any]
) -> None:
    """With one in flight and one queued, a third request is refused 429 and the queued one times out 503,
    each in the API's own envelope and with Retry-After."""
    gateway = start_gateway(
        {"fake": fake.url}, "--max-in-flight", "1", "--max-queued", "1", "--queue-timeout", "1"
    )
    request = {"model": "fake", **body}
    holder = open_raw(gateway, path, request, "prefill=4")
    queued: socket.socket | None = None
    try:
        fake.wait_for_record(lambda r: r["path"] == CHAT)
        queued = open_raw(gateway, path, request, "")
        time.sleep(0.3)
        assert len(fake.records()) == 1
        refused = http.post(gateway.url + path, json=request)
        assert refused.status_code == 429 and refused.headers["retry-after"]
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = queued.recv(65536)
            if not data:
                break
            answer += data
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert b"retry-after" in answer.lower()
        queued_body = orjson.loads(answer.partition(b"\r\n\r\n")[2])
        for doc in (refused.json(), queued_body):
            if path == MESSAGES:
                assert doc["type"] == "error" and doc["error"]["type"] and doc["error"]["message"], doc
            else:
                assert set(doc["error"]) >= {"message", "type", "param", "code"}, doc
    finally:
        holder.close()
        if queued is not None:
            queued.close()


# -- the engine's errors, in each API's envelope --------------------------------------------


@pytest.fixture
def mixed(start_gateway: StartGateway, fake: FakeEngine, native_fake: FakeEngine, tmp_path: Path) -> Running:
    """A gateway with "fake" (chat only: translated) and "native" (passed through) side by side."""
    config = tmp_path / "mixed.toml"
    config.write_text(
        f'[models.fake]\nupstream = "{fake.url}/v1"\n\n'
        f'[models.native]\nupstream = "{native_fake.url}/v1"\n{NATIVE_KEY} = ["messages", "responses"]\n'
    )
    return start_gateway({}, "--config", str(config))


@pytest.mark.fault("upstreams", "error statuses")
@pytest.mark.parametrize("model", ["fake", "native"], ids=["translated", "passthrough"])
def test_engine_errors_reach_the_sdks_in_the_apis_envelope(mixed: Running, model: str) -> None:
    """An engine's 429 and a malformed or empty reply reach each SDK as its own error class and envelope."""
    for fault, anthropic_error, openai_error, kind in [
        ("status=429", anthropic.RateLimitError, openai.RateLimitError, "rate_limit_error"),
        ("garbage", anthropic.InternalServerError, openai.InternalServerError, "api_error"),
        ("empty", anthropic.InternalServerError, openai.InternalServerError, "api_error"),
    ]:
        with claude(mixed.url) as client, pytest.raises(anthropic_error) as caught:
            client.messages.create(model=model, max_tokens=2, messages=ASK, extra_headers=fake_header(fault))
        body: Any = caught.value.body
        assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body
        with openai_client(mixed.url) as oai, pytest.raises(openai_error) as failed:
            oai.responses.create(model=model, input="hi", extra_headers=fake_header(fault))
        envelope: Any = failed.value.body
        assert set(envelope) >= {"message", "type", "param", "code"}, envelope


@pytest.mark.fault("upstreams", "a body cut short or malformed mid-way")
def test_a_non_stream_answer_cut_by_the_engine_is_a_502_in_the_apis_envelope(
    gateway: Running, fake: FakeEngine
) -> None:
    """A translated non-stream request whose chat stream the engine cuts gets a 502, not a partial answer."""
    with claude(gateway.url) as client, pytest.raises(anthropic.InternalServerError) as caught:
        client.messages.create(
            model="fake", max_tokens=8, messages=ASK, extra_headers=fake_header("die-after=3")
        )
    body: Any = caught.value.body
    assert (
        caught.value.status_code == 502 and body["type"] == "error" and body["error"]["type"] == "api_error"
    )
    with openai_client(gateway.url) as oai, pytest.raises(openai.InternalServerError) as failed:
        oai.responses.create(
            model="fake", input="hi", max_output_tokens=8, extra_headers=fake_header("die-after=3")
        )
    assert failed.value.status_code == 502


def test_passthrough_to_an_http11_engine_keeps_the_bytes(
    start_fake_engine: StartFakeEngine, start_gateway: StartGateway, tmp_path: Path
) -> None:
    """Passthrough to a keep-alive, chunked engine (as llama-server is) still hands on its bytes as sent."""
    native = start_fake_engine("--native-apis", "messages,responses", "--http11")
    config = tmp_path / "http11.toml"
    config.write_text(
        f'[models.native]\nupstream = "{native.url}/v1"\n{NATIVE_KEY} = ["messages", "responses"]\n'
    )
    gateway = start_gateway({}, "--config", str(config))
    cases = [
        (MESSAGES, {"max_tokens": 3, "messages": ASK, "stream": True}),
        (RESPONSES, {"max_output_tokens": 3, "input": "hi", "stream": True}),
        (MESSAGES, {"max_tokens": 3, "messages": ASK}),
        (COUNT_TOKENS, {"messages": ASK}),
    ]
    for index, (path, body) in enumerate(cases, start=1):
        status, payload = post_stream(
            gateway.url + path, {"model": "native", **body}, fake_header("reasoning=2")
        )

        def answered(record: dict[str, Any], number: int = index) -> bool:
            return bool(record["id"] == number and record["outcome"] is not None)

        record = native.wait_for_record(answered)
        assert status == 200 and record["outcome"] == "completed"
        assert payload == planned(record), path
    assert len({r["conn_id"] for r in native.records()}) < len(cases)
