"""proxy.translate.anthropic: the Messages API over chat completions, read by the anthropic SDK itself."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import orjson
import pytest

from proxy.errors import HTTPError, anthropic_error_body, anthropic_error_type
from proxy.translate import Translator
from proxy.translate.anthropic import CountTokensTranslator, MessagesTranslator, TranslationFailed

# Request shapes recorded from the real clients (copied from the shared recordings).
AGENT_CLIENTS = Path(__file__).resolve().parents[1] / "data" / "agent-clients"


def recorded(name: str) -> Any:
    """One of the request shapes recorded from the real clients."""
    return json.loads((AGENT_CLIENTS / name).read_text())


# Tools shaped as Claude Code writes them (zod to JSON Schema 2020-12), with the keywords
# its 24 tools carry: $schema, additionalProperties, propertyNames, anyOf, const, pattern.
TASK_UPDATE_TOOL = {
    "name": "TaskUpdate",
    "description": "Update a task.",
    "input_schema": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
            "taskId": {"type": "string", "pattern": "^[0-9]+$"},
            "status": {
                "anyOf": [{"type": "string", "const": "pending"}, {"type": "string", "const": "done"}]
            },
            "metadata": {
                "type": "object",
                "propertyNames": {"type": "string"},
                "additionalProperties": {},
            },
        },
        "required": ["taskId"],
        "additionalProperties": False,
    },
}


def claude_code_request() -> dict[str, Any]:
    """Claude Code's first request as recorded, with its Bash tool and a tool shaped like TaskUpdate."""
    body: dict[str, Any] = copy.deepcopy(recorded("claude-code-first-request.summary.json")["body_summary"])
    body["tools"] = [body.pop("tools[Bash]"), TASK_UPDATE_TOOL]
    return body


def chat_of(body: dict[str, Any]) -> dict[str, Any]:
    return MessagesTranslator(body).chat_request()


def minimal(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], **fields}


def refusal(
    body: Any, translator: type[MessagesTranslator | CountTokensTranslator] = MessagesTranslator
) -> HTTPError:
    """The HTTPError the translation raises for body, checked to be a 400."""
    with pytest.raises(HTTPError) as info:
        translator(body).chat_request()
    assert info.value.status == 400
    return info.value


# --- the request ---------------------------------------------------------------------------------


def test_translators_are_translators() -> None:
    """Both classes satisfy the relay's Translator protocol."""
    translators: list[Translator] = [MessagesTranslator(minimal()), CountTokensTranslator(minimal())]
    assert [t.stream for t in translators] == [False, False]


def test_claude_code_request_becomes_one_chat_stream_with_one_system_message_first() -> None:
    """Claude Code's system blocks and its system message at messages[1] are one system message first."""
    body = claude_code_request()
    chat = chat_of(body)
    assert chat["model"] == "some-local-model"
    assert chat["stream"] is True
    assert chat["stream_options"] == {"include_usage": True}
    assert chat["max_tokens"] == 32000
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user"]
    system = chat["messages"][0]["content"]
    texts = [block["text"] for block in body["system"]] + [body["messages"][1]["content"]]
    positions = [system.index(text) for text in texts]
    assert positions == sorted(positions)
    user = chat["messages"][1]["content"]
    assert isinstance(user, str)
    assert user.endswith("\nsay hi")
    for name in ("thinking", "context_management", "output_config", "metadata", "system"):
        assert name not in chat


def test_claude_code_tools_lose_meta_schema_keywords_and_keep_their_shape() -> None:
    """Tool schemas reach chat as functions without $schema and propertyNames; anyOf, const, pattern stay."""
    chat = chat_of(claude_code_request())
    bash, task = (tool["function"] for tool in chat["tools"])
    assert all(tool["type"] == "function" for tool in chat["tools"])
    assert bash["name"] == "Bash"
    assert bash["description"].startswith("Executes a bash command")
    assert "$schema" not in bash["parameters"]
    assert bash["parameters"]["required"] == ["command"]
    params = task["parameters"]
    assert "$schema" not in params
    assert "propertyNames" not in params["properties"]["metadata"]
    assert params["properties"]["taskId"]["pattern"] == "^[0-9]+$"
    assert params["properties"]["status"]["anyOf"][0]["const"] == "pending"
    assert "propertyNames" in TASK_UPDATE_TOOL["input_schema"]["properties"]["metadata"]  # type: ignore[index]


@pytest.mark.parametrize(
    "name", ["claude-code-tool-roundtrip-bash.json", "claude-code-tool-roundtrip-read.json"]
)
def test_claude_code_tool_round_trip_becomes_tool_calls_and_a_tool_message(name: str) -> None:
    """A tool_use turn is the assistant's tool_calls (ids kept, input JSON); a tool_result a tool message."""
    turns = recorded(name)
    chat = chat_of(minimal(messages=[{"role": "user", "content": "go"}, *turns]))
    use = turns[0]["content"][0]
    result = turns[1]["content"][0]
    assistant, tool = chat["messages"][1:]
    assert assistant["role"] == "assistant"
    assert assistant["content"] == ""
    (call,) = assistant["tool_calls"]
    assert call["id"] == use["id"]
    assert call["type"] == "function"
    assert call["function"]["name"] == use["name"]
    assert json.loads(call["function"]["arguments"]) == use["input"]
    assert tool == {"role": "tool", "tool_call_id": use["id"], "content": result["content"]}


def test_tool_results_come_before_the_text_of_their_user_turn() -> None:
    """Each tool_result is its own tool message, before a user message with the turn's text."""
    turns = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Two tools."},
                {"type": "tool_use", "id": "t1", "name": "a", "input": {}},
                {"type": "tool_use", "id": "t2", "name": "b", "input": {"x": [1, "ü"]}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "here"},
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "one"}]},
                {"type": "tool_result", "tool_use_id": "t2", "content": "boom", "is_error": True},
            ],
        },
    ]
    messages = chat_of(minimal(messages=turns))["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "user"]
    assert messages[1]["content"] == "Two tools."
    assert json.loads(messages[1]["tool_calls"][1]["function"]["arguments"]) == {"x": [1, "ü"]}
    assert messages[2] == {"role": "tool", "tool_call_id": "t1", "content": "one"}
    assert messages[3]["tool_call_id"] == "t2"
    assert messages[3]["content"] == "Error: boom"
    assert messages[4] == {"role": "user", "content": "here"}


def test_an_image_in_a_tool_result_is_named_in_the_text_and_noted() -> None:
    """A tool message is text: an image in a tool result becomes a line saying it was left out, and a note."""
    result = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [
            {"type": "text", "text": "see"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        ],
    }
    translator = MessagesTranslator(minimal(messages=[{"role": "user", "content": [result]}]))
    (tool,) = translator.chat_request()["messages"]
    assert tool["content"].startswith("see\n[image omitted")
    assert translator.notes == ["a image block in a tool result was left out (tool messages are text)"]


def test_images_become_image_url_parts_beside_the_text() -> None:
    """A base64 image is a data URL, a url image its URL, in image_url parts in block order."""
    content = [
        {"type": "text", "text": "what is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}},
    ]
    (user,) = chat_of(minimal(messages=[{"role": "user", "content": content}]))["messages"]
    assert user["content"] == [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}},
    ]


def test_thinking_blocks_and_cache_control_are_dropped() -> None:
    """An assistant's thinking and redacted_thinking blocks are left out; cache_control is ignored."""
    assistant = {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "sig"},
            {"type": "redacted_thinking", "data": "xx"},
            {"type": "text", "text": "Hello.", "cache_control": {"type": "ephemeral"}},
        ],
    }
    messages = chat_of(minimal(messages=[{"role": "user", "content": "hi"}, assistant]))["messages"]
    assert messages[1] == {"role": "assistant", "content": "Hello."}


def test_sampling_fields_and_stop_sequences_map_to_chat() -> None:
    """temperature, top_p and top_k pass; stop_sequences is chat's stop; an empty list sends none."""
    chat = chat_of(minimal(temperature=0.2, top_p=0.9, top_k=40, stop_sequences=["\n\nHuman:"]))
    assert (chat["temperature"], chat["top_p"], chat["top_k"], chat["stop"]) == (0.2, 0.9, 40, ["\n\nHuman:"])
    assert "stop" not in chat_of(minimal(stop_sequences=[]))


def test_server_tools_are_dropped_and_noted() -> None:
    """Tools with a server type (web_search, bash) are left out and said in notes; custom tools stay."""
    tools = [
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
        {"type": "bash_20250124", "name": "bash"},
        {"type": "custom", "name": "f", "input_schema": {"type": "object"}},
        {"name": "g", "input_schema": {"type": "object"}},
    ]
    translator = MessagesTranslator(minimal(tools=tools, tool_choice={"type": "any"}))
    chat = translator.chat_request()
    assert [t["function"]["name"] for t in chat["tools"]] == ["f", "g"]
    assert chat["tool_choice"] == "required"
    assert len(translator.notes) == 2
    assert "'web_search'" in translator.notes[0]
    assert "web_search_20250305" in translator.notes[0]


def test_tool_choice_of_a_server_tool_is_left_out_with_it() -> None:
    """tool_choice naming a server tool that was left out is left out too, and noted."""
    tools = [{"type": "web_search_20250305", "name": "web_search"}, {"name": "f", "input_schema": {}}]
    translator = MessagesTranslator(minimal(tools=tools, tool_choice={"type": "tool", "name": "web_search"}))
    chat = translator.chat_request()
    assert [t["function"]["name"] for t in chat["tools"]] == ["f"]
    assert "tool_choice" not in chat
    assert translator.notes[-1].startswith("tool_choice left out")


def test_only_server_tools_send_no_tools_and_no_tool_choice() -> None:
    """When every tool is a server tool, the chat request has neither tools nor tool_choice."""
    chat = chat_of(
        minimal(tools=[{"type": "web_search_20250305", "name": "w"}], tool_choice={"type": "auto"})
    )
    assert "tools" not in chat
    assert "tool_choice" not in chat


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto"),
    ],
)
def test_tool_choice_maps_to_chat(choice: dict[str, Any], expected: Any) -> None:
    """auto/any/tool/none are chat's auto/required/{function}/none."""
    chat = chat_of(minimal(tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice=choice))
    assert chat["tool_choice"] == expected


def test_tool_choice_of_an_unknown_tool_is_400() -> None:
    """tool_choice naming a tool the request does not have is a 400 naming it."""
    err = refusal(
        minimal(tools=[{"name": "f", "input_schema": {}}], tool_choice={"type": "tool", "name": "g"})
    )
    assert err.param == "tool_choice.name"
    assert "'g'" in err.message


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "max_tokens: Field required"),
        ("64", "max_tokens: Input should be a valid integer"),
        (True, "max_tokens: Input should be a valid integer"),
        (1.5, "max_tokens: Input should be a valid integer"),
        (0, "max_tokens: Input should be greater than or equal to 1"),
        (-3, "max_tokens: Input should be greater than or equal to 1"),
    ],
)
def test_max_tokens_is_required_and_positive(value: Any, message: str) -> None:
    """A missing or non-positive max_tokens is a 400 in Anthropic's words, with param max_tokens."""
    body = minimal()
    if value is None:
        del body["max_tokens"]
    else:
        body["max_tokens"] = value
    err = refusal(body)
    assert err.message == message
    assert err.param == "max_tokens"


def test_count_tokens_needs_no_max_tokens_and_asks_for_one_token() -> None:
    """count_tokens translates the same request with max_tokens 1, with or without max_tokens sent."""
    body = claude_code_request()
    del body["max_tokens"]
    counter = CountTokensTranslator(body)
    chat = counter.chat_request()
    assert counter.stream is False
    assert chat["max_tokens"] == 1
    assert chat["stream"] is True
    assert chat["messages"] == MessagesTranslator(claude_code_request()).chat_request()["messages"]


HOSTILE_BODIES: list[tuple[Any, str]] = [
    ([], ""),
    ({"model": "m", "max_tokens": 5}, "messages"),
    (minimal(messages={"role": "user"}), "messages"),
    (minimal(messages=[]), "messages"),
    (minimal(messages=["hi"]), "messages.0"),
    (minimal(messages=[{"role": "user"}]), "messages.0.content"),
    (minimal(messages=[{"content": "x"}]), "messages.0.role"),
    (minimal(messages=[{"role": "tool", "content": "x"}]), "messages.0.role"),
    (minimal(messages=[{"role": ["user"], "content": "x"}]), "messages.0.role"),
    (minimal(messages=[{"role": "user", "content": 5}]), "messages.0.content"),
    (minimal(messages=[{"role": "user", "content": [5]}]), "messages.0.content.0"),
    (minimal(messages=[{"role": "user", "content": [{"text": "x"}]}]), "messages.0.content.0.type"),
    (minimal(messages=[{"role": "user", "content": [{"type": 3}]}]), "messages.0.content.0.type"),
    (minimal(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages.0.content.0.text"),
    (minimal(messages=[{"role": "user", "content": [{"type": "video"}]}]), "messages.0.content.0.type"),
    (minimal(messages=[{"role": "user", "content": [{"type": "tool_use"}]}]), "messages.0.content.0.type"),
    (minimal(messages=[{"role": "user", "content": [{"type": "image"}]}]), "messages.0.content.0.source"),
    (
        minimal(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]),
        "messages.0.content.0.source.type",
    ),
    (
        minimal(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]),
        "messages.0.content.0.tool_use_id",
    ),
    (
        minimal(
            messages=[
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 3}]}
            ]
        ),
        "messages.0.content.0.content",
    ),
    (minimal(messages=[{"role": "assistant", "content": [{"type": "image"}]}]), "messages.0.content.0.type"),
    (
        minimal(messages=[{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]),
        "messages.0.content.0.id",
    ),
    (
        minimal(
            messages=[
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}]}
            ]
        ),
        "messages.0.content.0.input",
    ),
    (minimal(messages=[{"role": "system", "content": [{"type": "image"}]}]), "messages.0.content.0.type"),
    (minimal(system=5), "system"),
    (minimal(system=[{"type": "text", "text": 5}]), "system.0.text"),
    (minimal(system=["x"]), "system.0"),
    (minimal(model=None), "model"),
    (minimal(model=5), "model"),
    (minimal(stream="yes"), "stream"),
    (minimal(temperature="hot"), "temperature"),
    (minimal(top_p=True), "top_p"),
    (minimal(top_k=1.5), "top_k"),
    (minimal(stop_sequences="\n"), "stop_sequences"),
    (minimal(stop_sequences=[1]), "stop_sequences"),
    (minimal(tools={"name": "f"}), "tools"),
    (minimal(tools=["f"]), "tools.0"),
    (minimal(tools=[{"input_schema": {}}]), "tools.0.name"),
    (minimal(tools=[{"name": "f"}]), "tools.0.input_schema"),
    (minimal(tools=[{"name": "f", "input_schema": {}, "description": 1}]), "tools.0.description"),
    (minimal(tools=[{"name": "f", "input_schema": {}}], tool_choice="auto"), "tool_choice"),
    (minimal(tools=[{"name": "f", "input_schema": {}}], tool_choice={"type": "some"}), "tool_choice.type"),
    (minimal(tool_choice={"type": "tool"}), "tool_choice.name"),
    (minimal(tool_choice={"type": "tool", "name": "f"}), "tool_choice.name"),
]


@pytest.mark.parametrize(("body", "param"), HOSTILE_BODIES)
def test_bad_shapes_are_400_naming_the_field(body: Any, param: str) -> None:
    """A body of the wrong shape is a 400 whose message starts with the field it names, not a crash."""
    err = refusal(body)
    if param:
        assert err.param == param
        assert err.message.startswith(f"{param}: ")
    assert err.code


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path into a JSON value: object keys and list positions, at every depth."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from paths(item, (*prefix, index))


def replaced(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    doc = copy.deepcopy(doc)
    target = doc
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return doc


HOSTILE_VALUES: list[Any] = [None, True, 0, -1, 1.5, "", "x", [], [None], {}, {"type": None}]


def test_a_wrong_type_anywhere_in_claude_codes_shape_is_a_translation_or_a_400() -> None:
    """Any value of Claude Code's requests replaced by a wrong type translates or is a 400: never a crash."""
    round_trip = recorded("claude-code-tool-roundtrip-bash.json")
    body = claude_code_request()
    body["messages"] = [*body["messages"], *round_trip]
    body["tools"] = [*body["tools"], {"type": "web_search_20250305", "name": "web_search"}]
    body["tool_choice"] = {"type": "tool", "name": "Bash"}
    tried = 0
    for path in paths(body):
        for value in HOSTILE_VALUES:
            for translator in (MessagesTranslator, CountTokensTranslator):
                try:
                    chat = translator(replaced(body, path, value)).chat_request()
                except HTTPError as err:
                    assert err.status == 400
                    assert err.message
                else:
                    orjson.dumps(chat)
                tried += 1
    assert tried > 1000


# --- the stream ----------------------------------------------------------------------------------


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    """One chat.completion.chunk as engines send them."""
    choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice], **extra}


def usage(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    """The usage chunk that include_usage asks for (no choices)."""
    body: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    if cached is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"id": "chatcmpl-1", "object": "chat.completion", "choices": [], "usage": body}


def translated_stream(translator: MessagesTranslator, chunks: list[dict[str, Any]]) -> bytes:
    """What the relay writes for a stream that ends with [DONE]."""
    translator.chat_request()
    return translator.start() + b"".join(translator.feed(c) for c in chunks) + translator.finish()


def events(stream: bytes) -> list[tuple[str, dict[str, Any]]]:
    """The (event, data) pairs of an SSE body, checking each event names its data's type."""
    out = []
    for frame in stream.decode().split("\n\n"):
        if not frame:
            continue
        name_line, data_line = frame.split("\n")
        name = name_line.removeprefix("event: ")
        data = json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        out.append((name, data))
    return out


class Engine:
    """A fake /v1/messages for the SDK: its request through the translator, scripted chat chunks back."""

    def __init__(self, chunks: list[dict[str, Any]], *, fail: tuple[int, str] | None = None) -> None:
        self.chunks = chunks
        self.fail = fail
        self.chat: dict[str, Any] | None = None

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        doc = json.loads(request.content)
        translator = (
            CountTokensTranslator if request.url.path.endswith("count_tokens") else MessagesTranslator
        )(doc)
        try:
            self.chat = translator.chat_request()
        except HTTPError as err:
            return httpx2.Response(err.status, content=anthropic_error_body(err.status, err.message))
        body = translator.start() + b"".join(translator.feed(c) for c in self.chunks)
        if self.fail is not None:
            body += translator.failed(self.fail[0], self.fail[1], None)
        else:
            body += translator.finish()
        if translator.stream:
            return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})
        assert body == b""
        return httpx2.Response(200, content=translator.reply(), headers={"content-type": "application/json"})


def client(engine: Engine) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        api_key="sk-local",
        base_url="http://gateway.test",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(engine)),
    )


def streamed(engine: Engine, **request: Any) -> anthropic.types.Message:
    """The SDK's final message from its stream helper over the translated stream."""
    request.setdefault("messages", [{"role": "user", "content": "hi"}])
    with client(engine).messages.stream(model="local", max_tokens=64, **request) as stream:
        return stream.get_final_message()


def test_text_stream_reads_in_the_sdk_as_one_text_block_with_usage() -> None:
    """Text deltas are one text block; stop is end_turn; usage counts the prompt less its cached part."""
    engine = Engine(
        [
            chunk({"role": "assistant", "content": ""}),
            chunk({"content": "Hello"}),
            chunk({"content": ", world"}),
            chunk({}, "stop"),
            usage(20, 3, cached=8),
        ]
    )
    message = streamed(engine)
    assert message.model == "local"
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "Hello, world"  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (12, 3)
    assert message.usage.cache_read_input_tokens == 8
    assert engine.chat is not None
    assert engine.chat["stream"] is True


def test_event_order_is_anthropics() -> None:
    """message_start, then each block's start, deltas and stop, then message_delta and message_stop."""
    stream = translated_stream(
        MessagesTranslator(minimal(stream=True)),
        [
            chunk({"reasoning": "think"}),
            chunk({"content": "A"}),
            chunk({"content": "B"}, "length"),
            usage(5, 3),
        ],
    )
    names = [(name, data.get("index")) for name, data in events(stream)]
    assert names == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("message_delta", None),
        ("message_stop", None),
    ]
    start = events(stream)[0][1]["message"]
    assert start["content"] == []
    assert start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": 0, "output_tokens": 0}
    delta = events(stream)[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": 5, "output_tokens": 3}


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_reasoning_is_a_thinking_block_before_the_text(field: str) -> None:
    """Deltas with reasoning (mlx) or reasoning_content (vLLM, llama.cpp) are a thinking block in the SDK."""
    engine = Engine(
        [chunk({field: "Let me "}), chunk({field: "see."}), chunk({"content": "42"}, "stop"), usage(4, 5)]
    )
    message = streamed(engine)
    thinking, text = message.content
    assert thinking.type == "thinking"
    assert thinking.thinking == "Let me see."
    assert text.type == "text"
    assert text.text == "42"


def test_both_reasoning_fields_in_one_delta_are_read_once() -> None:
    """A delta carrying the same text as reasoning and reasoning_content gives it once."""
    message = streamed(
        Engine([chunk({"reasoning": "r", "reasoning_content": "r"}), chunk({"content": "x"}, "stop")])
    )
    assert message.content[0].thinking == "r"  # type: ignore[union-attr]


def openai_tool_call(index: int, call_id: str, name: str, pieces: list[str]) -> list[dict[str, Any]]:
    """A tool call streamed as OpenAI and vLLM do: id and name first, then argument pieces."""
    first = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
    return [chunk({"tool_calls": [first]})] + [
        chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}) for piece in pieces
    ]


def test_streamed_tool_calls_are_tool_use_blocks_with_their_input() -> None:
    """Two OpenAI-style tool calls after text are two tool_use blocks, ids kept, input parsed: tool_use."""
    engine = Engine(
        [
            chunk({"content": "Running."}),
            *openai_tool_call(0, "call_a", "Bash", ['{"comm', 'and": "ls', ' -la"}']),
            *openai_tool_call(1, "call_b", "Read", ['{"file_path":', ' "/tmp/ä"}']),
            chunk({}, "tool_calls"),
            usage(30, 12),
        ]
    )
    message = streamed(engine, tools=[{"name": "Bash", "input_schema": {"type": "object"}}])
    text, bash, read = message.content
    assert text.type == "text"
    assert bash.type == "tool_use"
    assert (bash.id, bash.name, bash.input) == ("call_a", "Bash", {"command": "ls -la"})
    assert read.type == "tool_use"
    assert (read.id, read.name, read.input) == ("call_b", "Read", {"file_path": "/tmp/ä"})
    assert message.stop_reason == "tool_use"


def test_mlx_tool_calls_whole_in_one_delta_with_text() -> None:
    """mlx_lm.server's last chunk, text and whole tool calls in one delta, is a text and tool_use blocks."""
    mlx_calls = [
        {
            "function": {"name": "Bash", "arguments": '{"command": "echo hi"}'},
            "type": "function",
            "id": "u-1",
            "index": 0,
        },
        {
            "function": {"name": "Read", "arguments": '{"file_path": "a"}'},
            "type": "function",
            "id": "u-2",
            "index": 1,
        },
    ]
    engine = Engine(
        [
            chunk({"role": "assistant", "content": "ok"}),
            chunk({"role": "assistant", "tool_calls": mlx_calls}, "tool_calls"),
        ]
    )
    message = streamed(engine)
    assert [block.type for block in message.content] == ["text", "tool_use", "tool_use"]
    assert message.content[1].input == {"command": "echo hi"}  # type: ignore[union-attr]
    assert message.content[2].id == "u-2"  # type: ignore[union-attr]
    assert message.stop_reason == "tool_use"


def test_a_tool_call_ended_with_stop_is_still_tool_use() -> None:
    """An engine that ends a tool call with finish_reason stop still gives stop_reason tool_use."""
    message = streamed(Engine([*openai_tool_call(0, "c", "f", ["{}"]), chunk({}, "stop")]))
    assert message.stop_reason == "tool_use"


def test_tool_calls_without_index_or_id_continue_the_open_call() -> None:
    """Tool call deltas without an index are known by id; a piece with neither goes to the open call."""
    first = {"id": "c1", "function": {"name": "f", "arguments": '{"a":'}}
    stream = translated_stream(
        MessagesTranslator(minimal(stream=True)),
        [
            chunk({"tool_calls": [first]}),
            chunk({"tool_calls": [{"function": {"arguments": " 1}"}}]}),
            chunk({"tool_calls": [{"id": "c2", "function": {"name": "g"}}]}),
        ],
    )
    starts = [data["content_block"] for name, data in events(stream) if name == "content_block_start"]
    assert [(s["id"], s["name"]) for s in starts] == [("c1", "f"), ("c2", "g")]
    pieces = [data["delta"]["partial_json"] for name, data in events(stream) if name == "content_block_delta"]
    assert pieces == ['{"a":', " 1}"]


def test_a_tool_call_without_id_gets_one() -> None:
    """A tool call the engine sent without an id gets a toolu_ id, as Anthropic's clients expect."""
    stream = translated_stream(
        MessagesTranslator(minimal(stream=True)),
        [chunk({"tool_calls": [{"index": 0, "function": {"name": "f"}}]})],
    )
    start = next(data for name, data in events(stream) if name == "content_block_start")
    assert start["content_block"]["id"].startswith("toolu_")


def test_an_empty_generation_is_a_message_without_content() -> None:
    """A stream with no deltas still opens and ends the message: no blocks, end_turn."""
    message = streamed(Engine([chunk({}, "stop"), usage(3, 0)]))
    assert message.content == []
    assert message.stop_reason == "end_turn"


@pytest.mark.parametrize(
    ("finish", "stop_reason"),
    [
        ("stop", "end_turn"),
        ("length", "max_tokens"),
        ("tool_calls", "tool_use"),
        ("content_filter", "refusal"),
        ("odd", "end_turn"),
    ],
)
def test_finish_reasons_map_to_stop_reasons(finish: str, stop_reason: str) -> None:
    """Chat's finish_reason is Anthropic's stop_reason."""
    message = streamed(Engine([chunk({"content": "x"}, finish)]))
    assert message.stop_reason == stop_reason


def test_an_error_mid_stream_is_raised_by_the_sdk_with_anthropics_type() -> None:
    """failed() after some text is an error event: the SDK raises it, with the type and message."""
    engine = Engine([chunk({"content": "partial"})], fail=(503, "the engine stopped mid-reply"))
    with pytest.raises(anthropic.APIStatusError) as info:
        streamed(engine)
    assert info.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the engine stopped mid-reply"},
    }


def test_an_error_before_any_block_is_raised_too() -> None:
    """failed() right after message_start is raised by the SDK as well."""
    with pytest.raises(anthropic.APIStatusError) as info:
        streamed(Engine([], fail=(504, "no token in 60 s")))
    assert info.value.body["error"]["type"] == "api_error"  # type: ignore[index]


def test_a_bad_request_is_the_sdks_bad_request_error() -> None:
    """A 400 from the translation, in Anthropic's envelope, is the SDK's BadRequestError with the message."""
    with pytest.raises(anthropic.BadRequestError) as info:
        client(Engine([])).messages.create(
            model="m", max_tokens=0, messages=[{"role": "user", "content": "x"}]
        )
    assert "max_tokens: Input should be greater than or equal to 1" in str(info.value)


@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "api_error"),
        (529, "overloaded_error"),
        (507, "api_error"),
    ],
)
def test_error_types_by_status(status: int, error_type: str) -> None:
    """Each status has Anthropic's error type; the body is Anthropic's envelope."""
    assert anthropic_error_type(status) == error_type
    assert orjson.loads(anthropic_error_body(status, "why")) == {
        "type": "error",
        "error": {"type": error_type, "message": "why"},
    }


def test_an_overloaded_body_is_the_sdks_overloaded_error() -> None:
    """A 529 with anthropic_error_body is what the SDK raises as OverloadedError."""

    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(529, content=anthropic_error_body(529, "all slots busy"))

    sdk = anthropic.Anthropic(
        api_key="x",
        base_url="http://gateway.test",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(answer)),
    )
    with pytest.raises(anthropic.OverloadedError, match="all slots busy"):
        sdk.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])


def check_event_order(stream: bytes) -> None:
    """Anthropic's order: message_start; blocks numbered from 0, each started once and stopped once,
    deltas only to a started block; then message_delta and message_stop."""
    names = events(stream)
    assert names[0][0] == "message_start"
    assert [name for name, _ in names[-2:]] == ["message_delta", "message_stop"]
    started: list[int] = []
    stopped: set[int] = set()
    for name, data in names[1:-2]:
        index = data["index"]
        if name == "content_block_start":
            assert index == len(started)
            assert not started or started[-1] in stopped
            started.append(index)
        elif name == "content_block_stop":
            assert index in started
            assert index not in stopped
            stopped.add(index)
        else:
            assert name == "content_block_delta"
            assert index in started
            # A piece for a tool call whose block is closed still goes to that block (documented).
            assert index not in stopped or data["delta"]["type"] == "input_json_delta"
    assert stopped == set(started)


def test_a_wrong_type_anywhere_in_engine_chunks_still_gives_anthropics_event_order() -> None:
    """Any value of vLLM- and mlx-shaped chunks replaced by a wrong type: no exception, events in order."""
    mlx_call = {"function": {"name": "f", "arguments": "{}"}, "type": "function", "id": "u-1", "index": 1}
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "r"}),
        chunk({"content": "t"}),
        *openai_tool_call(0, "c0", "g", ['{"b"', ": 2}"]),
        chunk({"content": "t2", "tool_calls": [mlx_call]}, "tool_calls"),
        usage(9, 4, cached=2),
    ]
    tried = 0
    for position, original in enumerate(chunks):
        for path in paths(original):
            for value in HOSTILE_VALUES:
                mutated = [*chunks[:position], replaced(original, path, value), *chunks[position + 1 :]]
                if not isinstance(mutated[position], dict):
                    continue
                translator = MessagesTranslator(minimal(stream=True))
                check_event_order(translated_stream(translator, mutated))
                plain = MessagesTranslator(minimal())
                translated_stream(plain, mutated)
                assert orjson.loads(plain.reply())["type"] == "message"
                tried += 1
    assert tried > 300


def test_hostile_chunks_give_no_events_and_no_error() -> None:
    """Chunks of the wrong shape are skipped: no exception, and the stream still ends well."""
    translator = MessagesTranslator(minimal(stream=True))
    junk: list[Any] = [
        {},
        {"choices": None},
        {"choices": {}},
        {"choices": [None]},
        {"choices": [{"delta": "x"}]},
        {"choices": [{"delta": {"content": 5, "reasoning": ["x"], "tool_calls": "x"}}]},
        {"choices": [{"delta": {"tool_calls": [None, 5, {"index": True, "function": "x"}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": 5, "arguments": 7}}]}}]},
        {"choices": [{"finish_reason": 5}]},
        {"choices": [], "usage": {"prompt_tokens": "x", "completion_tokens": -4, "prompt_tokens_details": 3}},
        {"usage": {"prompt_tokens": True, "prompt_tokens_details": {"cached_tokens": 99}}},
    ]
    stream = translator.start() + b"".join(translator.feed(c) for c in junk) + translator.finish()
    names = [name for name, _ in events(stream)]
    assert names[0] == "message_start"
    assert names[-2:] == ["message_delta", "message_stop"]
    assert events(stream)[-2][1]["usage"] == {"input_tokens": 0, "output_tokens": 0}


# --- the non-stream reply -------------------------------------------------------------------------


def test_non_stream_reply_is_the_sdks_message() -> None:
    """A non-stream request gets one Message: thinking, text and tool_use blocks in order, usage, stop."""
    engine = Engine(
        [
            chunk({"reasoning": "hm"}),
            chunk({"content": "Sure"}),
            *openai_tool_call(0, "call_1", "Bash", ['{"command"', ': "pwd"}']),
            chunk({}, "tool_calls"),
            usage(40, 9, cached=0),
        ]
    )
    message = client(engine).messages.create(
        model="local", max_tokens=64, messages=[{"role": "user", "content": "x"}]
    )
    assert isinstance(message, anthropic.types.Message)
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[2].input == {"command": "pwd"}  # type: ignore[union-attr]
    assert message.stop_reason == "tool_use"
    assert message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (40, 9)
    assert message.usage.cache_read_input_tokens is None


@pytest.mark.parametrize(
    ("arguments", "expected"), [("", {}), ("{bad", {"_raw": "{bad"}), ("[1]", {"_raw": "[1]"})]
)
def test_non_stream_tool_arguments_that_are_not_an_object(arguments: str, expected: dict[str, Any]) -> None:
    """Empty arguments give {}; not a JSON object, {"_raw": text}, so the tool's check can say why."""
    call = {"index": 0, "id": "c", "function": {"name": "f", "arguments": arguments}}
    translator = MessagesTranslator(minimal())
    translator.chat_request()
    assert (
        translator.start()
        + translator.feed(chunk({"tool_calls": [call]}, "tool_calls"))
        + translator.finish()
        == b""
    )
    reply = orjson.loads(translator.reply())
    assert reply["content"] == [{"type": "tool_use", "id": "c", "name": "f", "input": expected}]


def test_non_stream_failed_writes_nothing() -> None:
    """A non-stream request's failed() returns no bytes: the relay answers its error itself."""
    translator = MessagesTranslator(minimal())
    assert translator.failed(502, "broken", None) == b""


# --- count_tokens ----------------------------------------------------------------------------------


def test_count_tokens_reads_the_prompt_tokens_in_the_sdk() -> None:
    """count_tokens answers the usage's prompt_tokens, which the SDK reads as input_tokens."""
    engine = Engine([chunk({"content": "x"}, "length"), usage(1234, 1, cached=1000)])
    count = client(engine).messages.count_tokens(model="m", messages=[{"role": "user", "content": "hello"}])
    assert count.input_tokens == 1234
    assert engine.chat is not None
    assert engine.chat["max_tokens"] == 1


def test_count_tokens_without_usage_is_translation_failed_502() -> None:
    """A stream without usage cannot be counted: TranslationFailed, an HTTPError of status 502."""
    counter = CountTokensTranslator(minimal())
    counter.chat_request()
    assert counter.start() + counter.feed(chunk({"content": "x"}, "stop")) + counter.finish() == b""
    with pytest.raises(TranslationFailed) as info:
        counter.reply()
    assert isinstance(info.value, HTTPError)
    assert info.value.status == 502
    assert "usage" in info.value.message
