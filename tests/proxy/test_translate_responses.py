"""proxy.translate.responses: the OpenAI Responses API over chat completions.

Requests are Codex CLI's recorded shapes (tests/data/agent-clients/); streams
and replies are read back by the openai SDK's own Responses stream helper
and types, which are stricter than Codex about event order.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from openai.types.responses import Response

from proxy.errors import HTTPError
from proxy.translate import Translator
from proxy.translate.responses import ResponsesTranslator, custom_input, flat_name

# openai 2026 releases speak through httpx2, earlier ones through httpx: the mock transport is the SDK's own.
SDK_HTTP = importlib.import_module("httpx2" if importlib.util.find_spec("httpx2") else "httpx")
CLIENTS = Path(__file__).resolve().parents[1] / "data" / "agent-clients"


def recorded(name: str) -> Any:
    return json.loads((CLIENTS / name).read_text())


# The body Codex 0.171 sent first, with the recording's cut tool lists filled in with the real shapes.
FIRST = recorded("codex-first-request.summary.json")["body_summary"]
EXEC_COMMAND = recorded("codex-first-request.summary.json")["body_summary"]["tools[exec_command]"]
APPLY_PATCH = recorded("codex-first-request-known-slug-gpt-5.5.summary.json")["tools[apply_patch]"]
# A namespace as codex-rs serialises one (tools/src/responses_api.rs: ResponsesApiNamespace).
MULTI_AGENT = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools to start and talk to sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "spawn_agent",
            "description": "Start a sub-agent with a task.",
            "strict": False,
            "parameters": {
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "type": "object",
                "properties": {"task": {"type": "string"}},
                "required": ["task"],
                "additionalProperties": False,
            },
        },
        {
            "type": "function",
            "name": "send_input",
            "description": "Send text to a running sub-agent.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"id": {"type": "string"}, "text": {"type": "string"}},
            },
        },
    ],
}
HOSTED = [
    {"type": "web_search", "external_web_access": False, "search_content_types": ["text", "image"]},
    {"type": "tool_search", "execution": "client", "description": "Find tools.", "parameters": {}},
]


def codex_doc(**changes: Any) -> dict[str, Any]:
    """Codex's first request with its real tools (functions, a namespace, custom apply_patch, hosted ones)."""
    doc: dict[str, Any] = copy.deepcopy(FIRST)
    doc["tools"] = [
        copy.deepcopy(EXEC_COMMAND),
        copy.deepcopy(MULTI_AGENT),
        copy.deepcopy(APPLY_PATCH),
        *HOSTED,
    ]
    doc.update(changes)
    return doc


def chat_of(doc: dict[str, Any]) -> dict[str, Any]:
    chat: dict[str, Any] = ResponsesTranslator(doc).chat_request()
    return chat


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}],
    }


# mlx_lm.server's usage chunk: object "chat.completion", no choices.
USAGE = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "choices": [],
    "usage": {
        "prompt_tokens": 40,
        "completion_tokens": 7,
        "total_tokens": 47,
        "prompt_tokens_details": {"cached_tokens": 32},
    },
}


def text_chunks(*pieces: str, finish: str = "stop") -> list[dict[str, Any]]:
    return [
        chunk({"role": "assistant", "content": ""}),
        *(chunk({"content": p}) for p in pieces),
        chunk({}, finish),
    ]


def run(doc: dict[str, Any], chunks: list[dict[str, Any]]) -> tuple[ResponsesTranslator, bytes]:
    """The bytes a client gets for ``chunks``: start, every feed, finish."""
    translator = ResponsesTranslator(doc)
    translator.chat_request()
    out = translator.start()
    for item in chunks:
        out += translator.feed(item)
    return translator, out + translator.finish()


def events(body: bytes) -> list[dict[str, Any]]:
    """The SSE events, each checked: ``event:`` equals the data's type."""
    out = []
    for block in body.split(b"\n\n"):
        if not block:
            continue
        name, data = block.split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: ")
        doc = orjson.loads(data[6:])
        assert doc["type"] == name[7:].decode()
        out.append(doc)
    return out


def sdk(body: bytes, *, content_type: str = "text/event-stream") -> openai.OpenAI:
    """An openai client whose every request is answered with ``body``."""

    def answer(request: Any) -> Any:
        return SDK_HTTP.Response(200, headers={"content-type": content_type}, content=body)

    http = openai.DefaultHttpxClient(transport=SDK_HTTP.MockTransport(answer))
    return openai.OpenAI(
        api_key="sk-test", base_url="http://gateway.test/v1", http_client=http, max_retries=0
    )


def sdk_stream(body: bytes) -> tuple[list[Any], Response]:
    """The SDK's stream helper over ``body``: its events and its final response."""
    with sdk(body).responses.stream(model="m", input="hi") as stream:
        seen = list(stream)
        final = stream.get_final_response()
    return seen, final


SIMPLE = {"model": "m", "input": "hi", "stream": True}


# ---------------------------------------------------------------- request


def test_codex_first_request_becomes_one_chat_completion() -> None:
    """Codex's developer messages are one system message on top, then its user turns; a stream with usage."""
    chat = chat_of(codex_doc())
    messages = chat["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "user"]
    assert messages[0]["content"].startswith("You are a coding agent running in the Codex CLI")
    assert "<skills_instructions>" in messages[0]["content"]
    assert "<permissions instructions>" in messages[0]["content"]
    assert messages[2]["content"] == "say hi..."
    assert chat["model"] == "some-local-model"
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    for ignored in (
        "reasoning",
        "include",
        "prompt_cache_key",
        "client_metadata",
        "store",
        "parallel_tool_calls",
    ):
        assert ignored not in chat
    assert chat["tool_choice"] == "auto"


def test_instructions_and_developer_messages_merge_in_order() -> None:
    """``instructions`` first, then every developer/system item in order, wherever it sits, in one message."""
    doc = {
        "model": "m",
        "instructions": "A",
        "input": [
            {"role": "developer", "content": "B"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "C"}]},
        ],
    }
    messages = chat_of(doc)["messages"]
    assert messages == [{"role": "system", "content": "A\n\nB\n\nC"}, {"role": "user", "content": "q"}]


def test_tools_are_flattened_cleaned_and_hosted_ones_dropped() -> None:
    """Functions keep a cleaned schema; a namespace is ns__name functions; apply_patch takes one string."""
    translator = ResponsesTranslator(codex_doc())
    chat = translator.chat_request()
    functions = {t["function"]["name"]: t["function"] for t in chat["tools"]}
    assert list(functions) == [
        "exec_command",
        "multi_agent_v1__spawn_agent",
        "multi_agent_v1__send_input",
        "apply_patch",
    ]
    assert all(t["type"] == "function" for t in chat["tools"])
    assert functions["exec_command"]["parameters"]["required"] == ["cmd"]
    spawn = functions["multi_agent_v1__spawn_agent"]
    assert "$schema" not in spawn["parameters"]
    assert "Start a sub-agent" in spawn["description"]
    patch = functions["apply_patch"]
    assert patch["parameters"]["properties"] == {
        "input": {"type": "string", "description": patch["parameters"]["properties"]["input"]["description"]}
    }
    assert patch["parameters"]["required"] == ["input"]
    assert "FREEFORM" in patch["description"] and "one string argument, `input`" in patch["description"]
    assert "begin_patch hunk+ end_patch" in patch["description"]  # the lark grammar, short enough to help
    assert any("web_search" in note and "tool_search" in note for note in translator.notes)


def test_codex_exec_command_round_trip() -> None:
    """Codex's function_call + function_call_output become an assistant tool call and its tool message."""
    doc = codex_doc(input=[*FIRST["input"], *recorded("codex-tool-roundtrip-exec_command.json")])
    messages = chat_of(doc)["messages"]
    call, result = messages[-2], messages[-1]
    assert call == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_348d09ddeb9b4b3f8fdde2d8",
                "type": "function",
                "function": {
                    "name": "exec_command",
                    "arguments": '{"cmd": "echo hi", "workdir": "/home/user/project"}',
                },
            }
        ],
    }
    assert result["role"] == "tool" and result["tool_call_id"] == "call_348d09ddeb9b4b3f8fdde2d8"
    assert result["content"].endswith("Output:\nhi\n")


def test_codex_apply_patch_round_trip() -> None:
    """Codex's custom_tool_call + its output: a call whose one string argument ``input`` is the patch."""
    doc = codex_doc(input=[*FIRST["input"], *recorded("codex-tool-roundtrip-apply_patch-custom.json")])
    messages = chat_of(doc)["messages"]
    call = messages[-2]["tool_calls"][0]
    assert call["id"] == "call_0616e1bdbe974fdb823dd0e8"
    assert call["function"]["name"] == "apply_patch"
    patch = "*** Begin Patch\n*** Add File: patched.txt\n+hi from apply_patch\n*** End Patch\n"
    assert json.loads(call["function"]["arguments"]) == {"input": patch}
    assert messages[-1]["tool_call_id"] == "call_0616e1bdbe974fdb823dd0e8"
    assert "A patched.txt" in messages[-1]["content"]


def test_consecutive_calls_share_the_assistant_turn_and_reasoning_is_dropped() -> None:
    """Text then two calls (one namespaced) is one assistant message; reasoning items and ids are left out."""
    doc = {
        "model": "m",
        "input": [
            {"role": "user", "content": "go"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "xyz"},
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "ok"}],
            },
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "a", "arguments": "{}"},
            {
                "type": "function_call",
                "call_id": "c2",
                "name": "spawn_agent",
                "namespace": "multi_agent_v1",
                "arguments": "{}",
            },
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "2"}],
            },
        ],
    }
    messages = chat_of(doc)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == "ok"
    assert [c["function"]["name"] for c in messages[1]["tool_calls"]] == ["a", "multi_agent_v1__spawn_agent"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c2", "content": "2"}


@pytest.mark.parametrize("arguments", ["", "  ", '{"cmd": "ls"', "[1, 2]", '"ls"'])
def test_past_call_arguments_that_are_not_a_json_object_are_wrapped(arguments: str) -> None:
    """A past call's broken arguments (small models write them) reach the engine as a JSON object."""
    doc = {
        "model": "m",
        "input": [
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": arguments},
            {"type": "function_call_output", "call_id": "c", "output": "failed to parse function arguments"},
        ],
    }
    sent = chat_of(doc)["messages"][0]["tool_calls"][0]["function"]["arguments"]
    parsed = json.loads(sent)
    assert isinstance(parsed, dict)
    assert parsed in ({}, {"input": arguments})


def test_images_become_image_url_parts() -> None:
    """An input_image is a chat image_url part; a tool's image follows its tool message as the user's."""
    url = "data:image/png;base64,iVBORw0KGgo="
    doc = {
        "model": "m",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "look"},
                    {"type": "input_image", "image_url": url, "detail": "low"},
                ],
            },
            {"type": "function_call", "call_id": "c", "name": "view_image", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c",
                "output": [{"type": "input_image", "image_url": url}],
            },
        ],
    }
    messages = chat_of(doc)["messages"]
    assert messages[0]["content"] == [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
    ]
    assert messages[2] == {"role": "tool", "tool_call_id": "c", "content": ""}
    assert messages[3]["role"] == "user" and messages[3]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": url},
    }


def test_sampling_fields_and_json_schema_format_map_to_chat() -> None:
    """max_output_tokens is max_tokens; temperature, top_p pass; text.format is response_format."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    doc = {
        **SIMPLE,
        "max_output_tokens": 64,
        "temperature": 0.2,
        "top_p": 0.9,
        "text": {
            "format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True},
            "verbosity": "low",
        },
        "tool_choice": {"type": "function", "name": "f"},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    }
    chat = chat_of(doc)
    assert chat["max_tokens"] == 64 and chat["temperature"] == 0.2 and chat["top_p"] == 0.9
    # llama-cpp-python's form (a grammar from the schema); its server refuses type json_schema.
    assert chat["response_format"] == {"type": "json_object", "schema": schema}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert "max_output_tokens" not in chat and "text" not in chat


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"conversation": {"id": "conv_1"}}, "conversation"),
        ({"background": True}, "background"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ],
)
def test_state_the_gateway_does_not_keep_is_a_clear_400(change: dict[str, Any], param: str) -> None:
    """Stored responses, conversations and references are refused: send the whole history with store false."""
    with pytest.raises(HTTPError) as caught:
        chat_of({**SIMPLE, **change})
    assert caught.value.status == 400
    assert caught.value.param == param
    assert "stateless" in caught.value.message
    assert "store: false" in caught.value.message or param == "background"


def test_store_false_and_null_state_fields_are_accepted() -> None:
    """What Codex sends (store false, no previous response) and explicit nulls pass."""
    chat_of({**SIMPLE, "store": False, "previous_response_id": None, "conversation": None})


@pytest.mark.parametrize(
    ("doc", "param"),
    [
        ([], "body"),
        ({"input": "hi"}, "model"),
        ({"model": 5, "input": "hi"}, "model"),
        ({"model": "m"}, "input"),
        ({"model": "m", "input": 3}, "input"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": "hi", "stream": "yes"}, "stream"),
        ({"model": "m", "input": "hi", "instructions": ["x"]}, "instructions"),
        ({"model": "m", "input": ["hi"]}, "input[0]"),
        ({"model": "m", "input": [{"type": "message", "role": "tool", "content": "x"}]}, "input[0].role"),
        ({"model": "m", "input": [{"role": "user", "content": 5}]}, "input[0].content"),
        ({"model": "m", "input": [{"role": "user", "content": [5]}]}, "input[0].content[0]"),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content[0]",
        ),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "input[0].content[0]",
        ),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0]",
        ),
        (
            {
                "model": "m",
                "input": [{"role": "system", "content": [{"type": "input_image", "image_url": "u"}]}],
            },
            "input[0].content[0]",
        ),
        (
            {"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        (
            {
                "model": "m",
                "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}],
            },
            "input[0].arguments",
        ),
        (
            {
                "model": "m",
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "", "namespace": 1}
                ],
            },
            "input[0].namespace",
        ),
        (
            {"model": "m", "input": [{"type": "custom_tool_call", "call_id": "c", "name": "f"}]},
            "input[0].input",
        ),
        (
            {"model": "m", "input": [{"type": "function_call_output", "call_id": "c", "output": 5}]},
            "input[0].output",
        ),
        (
            {
                "model": "m",
                "input": [
                    {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}
                ],
            },
            "input[0].output[0]",
        ),
        ({"model": "m", "input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0]"),
        ({"model": "m", "input": [{"type": None}]}, "input[0]"),
        ({"model": "m", "input": "hi", "tools": {}}, "tools"),
        ({"model": "m", "input": "hi", "tools": [5]}, "tools[0]"),
        ({"model": "m", "input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
        (
            {"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "..."}]},
            "tools[0].parameters",
        ),
        (
            {"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f", "description": 1}]},
            "tools[0].description",
        ),
        (
            {"model": "m", "input": "hi", "tools": [{"type": "namespace", "name": "n", "tools": "..."}]},
            "tools[0].tools",
        ),
        (
            {
                "model": "m",
                "input": "hi",
                "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "custom", "name": "c"}]}],
            },
            "tools[0].tools[0]",
        ),
        (
            {"model": "m", "input": "hi", "tools": [{"type": "custom", "name": "c", "format": "..."}]},
            "tools[0].format",
        ),
        (
            {
                "model": "m",
                "input": "hi",
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": "always",
            },
            "tool_choice",
        ),
        (
            {
                "model": "m",
                "input": "hi",
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "g"},
            },
            "tool_choice.name",
        ),
        ({"model": "m", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "m", "input": "hi", "max_output_tokens": True}, "max_output_tokens"),
        ({"model": "m", "input": "hi", "max_output_tokens": "9"}, "max_output_tokens"),
        ({"model": "m", "input": "hi", "temperature": "hot"}, "temperature"),
        ({"model": "m", "input": "hi", "text": "plain"}, "text"),
        ({"model": "m", "input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"model": "m", "input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ],
)
def test_bad_shapes_are_400_naming_the_field(doc: Any, param: str) -> None:
    """Every malformed field is a 400 whose param names it, never a KeyError or TypeError."""
    with pytest.raises(HTTPError) as caught:
        ResponsesTranslator(doc).chat_request()
    assert caught.value.status == 400
    assert caught.value.param == param
    assert caught.value.message


def test_error_messages_repeat_client_strings_cut_short() -> None:
    """A huge type or role string is quoted cut to a prefix in the 400, not whole."""
    for doc in (
        {"model": "m", "input": [{"type": "x" * 100_000}]},
        {"model": "m", "input": [{"role": "x" * 100_000, "content": ""}]},
        {"model": "m", "input": [{"role": "user", "content": [{"type": "x" * 100_000}]}]},
    ):
        with pytest.raises(HTTPError) as caught:
            chat_of(doc)
        assert len(caught.value.message) < 400 and "100000 characters" in caught.value.message


HOSTILE = [None, 0, -1, True, 1.5, "", "x", [], [None], {}, {"type": None}, {"type": "message"}]


def paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from paths(sub, (*path, key))
    elif isinstance(value, list):
        for index, sub in enumerate(value):
            yield from paths(sub, (*path, index))


def replaced(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    out = copy.deepcopy(doc)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


def full_doc() -> dict[str, Any]:
    """A request using every mapped feature at once, short enough to mutate at every path."""
    return {
        "model": "m",
        "instructions": "be brief",
        "stream": True,
        "max_output_tokens": 10,
        "temperature": 0.5,
        "text": {"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}}},
        "tool_choice": {"type": "function", "name": "f"},
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "u"},
                    {"type": "input_image", "image_url": "data:,"},
                ],
            },
            {"type": "function_call", "call_id": "c1", "name": "f", "namespace": "n", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_text", "text": "r"}],
            },
            {"type": "custom_tool_call", "call_id": "c2", "name": "p", "input": "x"},
            {"type": "custom_tool_call_output", "call_id": "c2", "output": "ok"},
        ],
        "tools": [
            {
                "type": "function",
                "name": "f",
                "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
            },
            {
                "type": "namespace",
                "name": "n",
                "tools": [{"type": "function", "name": "f", "description": "d"}],
            },
            {
                "type": "custom",
                "name": "p",
                "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
            },
            {"type": "web_search"},
        ],
    }


def test_hostile_values_at_every_path_are_400_or_accepted() -> None:
    """Any value at any depth of a full request gives a chat request or a 400, never another exception."""
    doc = full_doc()
    tried = 0
    for path in paths(doc):
        for value in HOSTILE:
            tried += 1
            try:
                chat = ResponsesTranslator(replaced(doc, path, value)).chat_request()
            except HTTPError as err:
                assert err.status == 400 and err.param, (path, value)
            else:
                orjson.dumps(chat)
    assert tried > 600


# ----------------------------------------------------------------- stream


def test_text_stream_reads_back_through_the_sdk_stream_helper() -> None:
    """Chat text deltas are a message item the SDK's stream helper assembles, with usage; status completed."""
    _, body = run(SIMPLE, [*text_chunks("Hel", "lo", "!"), USAGE])
    seen, final = sdk_stream(body)
    assert [e.type for e in seen] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final.status == "completed"
    assert final.output_text == "Hello!"
    assert final.id.startswith("resp_")
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (40, 7, 47)
    assert final.usage.input_tokens_details.cached_tokens == 32
    assert final.usage.output_tokens_details.reasoning_tokens == 0


def test_sequence_numbers_increase_and_response_object_has_the_required_fields() -> None:
    """Each event has the next sequence_number; created/completed carry what the SDK's Response needs."""
    _, body = run(
        {**SIMPLE, "tools": [{"type": "function", "name": "f"}], "tool_choice": "auto"}, text_chunks("a")
    )
    evs = events(body)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    for event in (evs[0], evs[-1]):
        response = event["response"]
        Response.model_validate(response)  # strict pydantic validation, not the SDK's lenient construct
        assert response["tools"] == [{"type": "function", "name": "f"}]
        assert response["parallel_tool_calls"] is True and response["tool_choice"] == "auto"
    assert evs[0]["response"]["status"] == "in_progress" and evs[0]["response"]["output"] == []


def test_mlx_reasoning_then_text_is_a_reasoning_item_then_a_message() -> None:
    """mlx's ``reasoning`` (and ``reasoning_content``) deltas are one reasoning item of reasoning_text."""
    chunks = [
        chunk({"role": "assistant", "reasoning": "think "}),
        chunk({"reasoning_content": "more"}),
        chunk({"content": "answer"}),
        chunk({}, "stop"),
        USAGE,
    ]
    _, body = run(SIMPLE, chunks)
    seen, final = sdk_stream(body)
    types = [e.type for e in seen]
    assert types.count("response.reasoning_text.delta") == 2
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert reasoning.content is not None and reasoning.content[0].text == "think more"
    assert reasoning.summary == []
    assert final.output_text == "answer"


def test_openai_style_tool_call_pieces_become_a_function_call_item() -> None:
    """A call streamed as id+name, then argument pieces, is a function_call whose call_id is the chat id."""
    chunks = [
        chunk({"role": "assistant", "content": None}),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_9",
                        "type": "function",
                        "function": {"name": "exec_command", "arguments": ""},
                    }
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"cmd":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "ls"}'}}]}),
        chunk({}, "tool_calls"),
        USAGE,
    ]
    _, body = run(codex_doc(stream=True), chunks)
    seen, final = sdk_stream(body)
    deltas = [e.delta for e in seen if e.type == "response.function_call_arguments.delta"]
    assert deltas == ['{"cmd":', ' "ls"}']
    (call,) = final.output
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.arguments, call.status) == (
        "call_9",
        "exec_command",
        '{"cmd": "ls"}',
        "completed",
    )
    assert call.id is not None and call.id.startswith("fc_")
    assert final.status == "completed"


def test_mlx_style_whole_calls_in_the_last_chunk_are_several_items() -> None:
    """mlx sends each call whole with its index, beside text and finish reason: one item each, in order."""
    calls = [
        {
            "function": {"name": "exec_command", "arguments": '{"cmd": "ls"}'},
            "type": "function",
            "id": "u-1",
            "index": 0,
        },
        {
            "function": {"name": "exec_command", "arguments": '{"cmd": "pwd"}'},
            "type": "function",
            "id": "u-2",
            "index": 1,
        },
    ]
    chunks = [
        chunk({"role": "assistant", "content": "Let me"}),
        # mlx_lm.server's last packet: the text since the last write, every call, the finish reason.
        chunk({"role": "assistant", "content": " look.", "tool_calls": calls}, "tool_calls"),
        USAGE,
    ]
    _, body = run(codex_doc(stream=True), chunks)
    _, final = sdk_stream(body)
    message, first, second = final.output
    assert message.type == "message" and final.output_text == "Let me look."
    assert first.type == "function_call" and second.type == "function_call"
    assert (first.call_id, first.arguments) == ("u-1", '{"cmd": "ls"}')
    assert (second.call_id, second.arguments) == ("u-2", '{"cmd": "pwd"}')


def test_custom_tool_call_comes_back_with_its_freeform_input() -> None:
    """A chat call of apply_patch is a custom_tool_call whose input is the decoded ``input`` string."""
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
    arguments = orjson.dumps({"input": patch}).decode()
    chunks = [
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_p",
                        "type": "function",
                        "function": {"name": "apply_patch", "arguments": arguments[:20]},
                    }
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": arguments[20:]}}]}),
        chunk({}, "tool_calls"),
    ]
    translator, body = run(codex_doc(stream=True), chunks)
    seen, final = sdk_stream(body)
    (call,) = final.output
    assert call.type == "custom_tool_call"
    assert (call.call_id, call.name, call.input) == ("call_p", "apply_patch", patch)
    done = [e for e in seen if e.type == "response.custom_tool_call_input.done"]
    assert done[0].input == patch
    assert not [e for e in seen if e.type == "response.function_call_arguments.delta"]
    # As Codex reads it: the done item has call_id, name and input (codex-rs ResponseItem::CustomToolCall).
    item = next(e for e in events(body) if e["type"] == "response.output_item.done")["item"]
    assert {
        "type": "custom_tool_call",
        "call_id": "call_p",
        "name": "apply_patch",
        "input": patch,
    }.items() <= item.items()
    assert translator.reply()  # the reply object is built for a non-stream client too


def test_namespace_call_comes_back_with_name_and_namespace() -> None:
    """A call of multi_agent_v1__spawn_agent is a function_call spawn_agent in namespace multi_agent_v1."""
    chunks = [
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c",
                        "type": "function",
                        "function": {"name": "multi_agent_v1__spawn_agent", "arguments": '{"task":"x"}'},
                    }
                ]
            }
        ),
        chunk({}, "tool_calls"),
    ]
    _, body = run(codex_doc(stream=True), chunks)
    _, final = sdk_stream(body)
    (call,) = final.output
    assert call.type == "function_call"
    assert (call.name, call.namespace, call.arguments) == ("spawn_agent", "multi_agent_v1", '{"task":"x"}')
    added = next(e for e in events(body) if e["type"] == "response.output_item.added")["item"]
    assert added["namespace"] == "multi_agent_v1" and added["name"] == "spawn_agent"


def test_a_name_repeated_in_every_delta_is_kept_once() -> None:
    """Servers that repeat the function name in each delta, or send it late, still give the name once."""
    name = "multi_agent_v1__spawn_agent"
    chunks = [
        chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": name, "arguments": "{"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"name": name, "arguments": "}"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "d", "function": {"arguments": "{"}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"name": "exec_command", "arguments": "}"}}]}),
        chunk({}, "tool_calls"),
    ]
    _, body = run(codex_doc(stream=True), chunks)
    _, final = sdk_stream(body)
    first, second = final.output
    assert first.type == "function_call" and second.type == "function_call"
    assert (first.name, first.namespace, first.arguments) == ("spawn_agent", "multi_agent_v1", "{}")
    assert (second.name, second.arguments) == ("exec_command", "{}")


def test_unknown_tool_name_passes_as_a_plain_function_call() -> None:
    """A call of a name not in ``tools`` comes back as the model wrote it, for the client to refuse."""
    chunks = [
        chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "nope", "arguments": "{}"}}]}),
        chunk({}, "tool_calls"),
    ]
    _, body = run(codex_doc(stream=True), chunks)
    _, final = sdk_stream(body)
    assert final.output[0].type == "function_call" and final.output[0].name == "nope"


def test_length_finish_ends_with_response_incomplete() -> None:
    """finish_reason length ends with response.incomplete (max_output_tokens), items marked incomplete."""
    _, body = run(SIMPLE, [*text_chunks("cut", finish="length"), USAGE])
    evs = events(body)
    assert evs[-1]["type"] == "response.incomplete"
    response = evs[-1]["response"]
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"
    assert response["usage"]["output_tokens"] == 7
    with sdk(body).responses.stream(model="m", input="hi") as stream:
        seen = list(stream)
        with pytest.raises(RuntimeError, match=r"response\.completed"):
            stream.get_final_response()
    assert seen[-1].type == "response.incomplete"
    assert seen[-1].response.incomplete_details is not None
    assert seen[-1].response.incomplete_details.reason == "max_output_tokens"


def test_failure_mid_stream_ends_with_response_failed() -> None:
    """An engine breaking mid-stream ends the stream with response.failed: the error and what was said."""
    translator = ResponsesTranslator(SIMPLE)
    translator.chat_request()
    body = translator.start() + translator.feed(chunk({"content": "partial"}))
    body += translator.failed(502, "upstream closed the stream before it ended", None)
    evs = events(body)
    assert evs[-1]["type"] == "response.failed"
    response = evs[-1]["response"]
    assert response["status"] == "failed"
    assert response["error"] == {
        "code": "server_error",
        "message": "upstream closed the stream before it ended",
    }
    assert response["output"][0]["content"][0]["text"] == "partial"
    assert response["output"][0]["status"] == "incomplete"
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    with sdk(body).responses.stream(model="m", input="hi") as stream:
        seen = list(stream)
        with pytest.raises(RuntimeError):
            stream.get_final_response()
    assert seen[-1].type == "response.failed"
    assert seen[-1].response.error is not None and seen[-1].response.error.message.startswith(
        "upstream closed"
    )


def test_rate_limited_failure_keeps_codes_codex_acts_on() -> None:
    """A 429 without a code is rate_limit_exceeded (Codex retries it); a given code passes as it is."""
    for status, code, expected in (
        (429, None, "rate_limit_exceeded"),
        (400, "context_length_exceeded", "context_length_exceeded"),
    ):
        translator = ResponsesTranslator(SIMPLE)
        translator.chat_request()
        evs = events(translator.start() + translator.failed(status, "m", code))
        assert evs[-1]["response"]["error"]["code"] == expected


def test_empty_stream_completes_with_no_output() -> None:
    """An engine that sends only [DONE] still ends the stream with response.completed."""
    _, body = run(SIMPLE, [])
    _, final = sdk_stream(body)
    assert final.status == "completed" and final.output == [] and final.usage is None


def test_codex_reads_the_completed_usage_and_items() -> None:
    """response.completed has the id and the five usage numbers codex-rs parses (sse/responses.rs)."""
    _, body = run(SIMPLE, [*text_chunks("hi"), USAGE])
    evs = events(body)
    completed = evs[-1]["response"]
    assert isinstance(completed["id"], str)
    usage = completed["usage"]
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        assert isinstance(usage[key], int)
    assert isinstance(usage["input_tokens_details"]["cached_tokens"], int)
    assert isinstance(usage["output_tokens_details"]["reasoning_tokens"], int)
    done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    assert done == [completed["output"][0]]
    assert done[0]["role"] == "assistant" and done[0]["content"][0] == {
        "type": "output_text",
        "text": "hi",
        "annotations": [],
        "logprobs": [],
    }


# ------------------------------------------------------------- non-stream


def test_non_stream_reply_is_the_sdk_response() -> None:
    """Without ``stream`` the events are empty and reply() is the Response the SDK's create() returns."""
    doc = codex_doc(stream=False)
    translator = ResponsesTranslator(doc)
    assert translator.stream is False
    translator.chat_request()
    chunks = [
        chunk({"reasoning": "hmm"}),
        chunk({"content": "Done: "}),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c",
                        "function": {"name": "multi_agent_v1__send_input", "arguments": "{}"},
                    }
                ]
            }
        ),
        chunk({}, "tool_calls"),
        USAGE,
    ]
    streamed = translator.start() + b"".join(translator.feed(c) for c in chunks) + translator.finish()
    assert streamed == b""
    reply = translator.reply()
    response = sdk(reply, content_type="application/json").responses.create(model="m", input="hi")
    assert isinstance(response, Response)
    Response.model_validate(orjson.loads(reply))
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    assert response.output_text == "Done: "
    call = response.output[2]
    assert call.type == "function_call" and call.namespace == "multi_agent_v1" and call.name == "send_input"
    assert response.usage is not None and response.usage.total_tokens == 47


def test_reply_equals_the_completed_event_response() -> None:
    """The non-stream reply and response.completed carry the same response object."""
    doc = {"model": "m", "input": "hi"}
    streamed_doc = {**doc, "stream": True}
    _, body = run(streamed_doc, text_chunks("x"))
    completed = events(body)[-1]["response"]
    translator, _ = run(doc, text_chunks("x"))
    reply = orjson.loads(translator.reply())
    for key in ("id", "created_at", "completed_at", "output"):
        completed.pop(key, None)
        reply.pop(key, None)
    assert reply == completed


# ---------------------------------------------------------- hostile chunks


def test_hostile_chunks_never_raise() -> None:
    """Odd engine chunks (wrong types at any depth) are skipped, and the stream still ends well formed."""
    base = {
        "choices": [
            {
                "delta": {
                    "content": "a",
                    "reasoning": "r",
                    "tool_calls": [
                        {"index": 0, "id": "c", "function": {"name": "apply_patch", "arguments": "{}"}}
                    ],
                },
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 1}},
    }
    for path in paths(base):
        for value in HOSTILE:
            translator = ResponsesTranslator(codex_doc(stream=True))
            translator.chat_request()
            mutated = replaced(base, path, value)
            if not isinstance(mutated, dict):
                continue
            body = (
                translator.start() + translator.feed(mutated) + translator.feed(mutated) + translator.finish()
            )
            last = events(body)[-1]
            assert last["type"] in ("response.completed", "response.incomplete"), (path, value)
            Response.model_validate(last["response"])


def test_custom_input_takes_what_the_model_wrote() -> None:
    """The freeform input is the ``input`` string, a lone string value, or the raw text when not JSON."""
    assert custom_input('{"input": "a\\nb"}') == "a\nb"
    assert custom_input('{"patch": "p"}') == "p"
    assert custom_input("*** Begin Patch") == "*** Begin Patch"
    assert custom_input('"bare"') == "bare"
    assert custom_input('{"a": "1", "b": "2"}') == '{"a": "1", "b": "2"}'


def test_flat_name_is_codex_canonical_flat_name() -> None:
    """Namespaced names join with __ and lose stray underscores around it, as codex-rs ToolName does."""
    assert flat_name("multi_agent_v1", "spawn_agent") == "multi_agent_v1__spawn_agent"
    assert flat_name("mcp__github__", "_search") == "mcp__github__search"


def test_translator_protocol() -> None:
    """ResponsesTranslator is a Translator."""
    translator: Translator = ResponsesTranslator(SIMPLE)
    assert translator.stream is True and translator.notes == []
