"""The non-stream reply built from a stream's events (proxy/assembly.py), without sockets."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from engines.spec import Guards
from proxy.assembly import AssemblyError, ReplyAssembler
from proxy.payload import ask_for_stream

TOP = {"id": "chatcmpl-1", "system_fingerprint": "fp", "model": "m", "created": 7}


def sse(*events: dict[str, Any] | str, sep: bytes = b"\n\n") -> bytes:
    out = b""
    for event in events:
        data = event.encode() if isinstance(event, str) else orjson.dumps(event)
        out += b"data: " + data + sep
    return out


def chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0) -> dict[str, Any]:
    return {
        **TOP,
        "object": "chat.completion.chunk",
        "choices": [{"index": index, "finish_reason": finish, "delta": delta}],
    }


USAGE = {
    **TOP,
    "object": "chat.completion",
    "choices": [],
    "usage": {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 3},
    },
}


def build(data: bytes, *, chat: bool = True, split: int = 0) -> dict[str, Any]:
    assembler = ReplyAssembler(chat=chat)
    pieces = [data[i : i + split] for i in range(0, len(data), split)] if split else [data]
    for piece in pieces:
        assembler.feed(piece)
    assert assembler.done
    reply: dict[str, Any] = orjson.loads(assembler.reply())
    return reply


def test_chat_chunks_make_the_engines_non_stream_reply() -> None:
    """Role, content, finish_reason, usage (cached tokens too) and the engine's id, model and times."""
    stream = sse(
        chunk({"role": "assistant", "content": "Hel"}),
        chunk({"role": "assistant", "content": "lo"}),
        chunk({"role": "assistant"}, "stop"),
        USAGE,
        "[DONE]",
    )
    reply = build(b": keepalive 1/5\n\n" + stream)
    assert reply == {
        **TOP,
        "object": "chat.completion",
        "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hello"}}
        ],
        "usage": USAGE["usage"],
    }
    assert list(reply)[:5] == ["id", "system_fingerprint", "object", "model", "created"]


def test_any_split_of_the_bytes_gives_the_same_reply() -> None:
    """Events cut across reads (one byte at a time, CRLF separators too) are joined before parsing."""
    parts = (chunk({"role": "assistant", "content": "a\\nb"}), chunk({}, "length"), USAGE, "[DONE]")
    whole = build(sse(*parts))
    assert build(sse(*parts), split=1) == whole
    assert build(sse(*parts, sep=b"\r\n\r\n"), split=3) == whole


def test_empty_content_is_null_as_in_the_engines_own_reply() -> None:
    """A reply with no text has content null (mlx_lm.server's non-stream reply does)."""
    reply = build(sse(chunk({"role": "assistant"}, "stop"), USAGE, "[DONE]"))
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": None}


def test_reasoning_is_kept_under_the_engines_own_key() -> None:
    """Reasoning deltas are joined and named as the engine named them."""
    reply = build(
        sse(
            chunk({"role": "assistant", "reasoning": "think "}),
            chunk({"reasoning": "more"}),
            chunk({"content": "answer"}, "stop"),
            "[DONE]",
        )
    )
    assert reply["choices"][0]["message"] == {
        "role": "assistant",
        "content": "answer",
        "reasoning": "think more",
    }


def test_tool_calls_are_assembled_from_their_deltas() -> None:
    """OpenAI-style fragments (id and name first, arguments in pieces) per index, in index order."""
    first = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get", "arguments": ""}}
    second = {"index": 1, "id": "call_b", "type": "function", "function": {"name": "put", "arguments": "{}"}}
    reply = build(
        sse(
            chunk({"role": "assistant", "tool_calls": [first]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
            chunk({"tool_calls": [second]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
            chunk({}, "tool_calls"),
            "[DONE]",
        )
    )
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {"id": "call_a", "type": "function", "function": {"name": "get", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "put", "arguments": "{}"}},
    ]


def test_legacy_completions_make_a_text_completion() -> None:
    """text_completion events are joined into one text per choice."""
    event = {
        **TOP,
        "object": "text_completion",
        "choices": [{"index": 0, "finish_reason": None, "text": "4"}],
    }
    end = {
        **TOP,
        "object": "text_completion",
        "choices": [{"index": 0, "finish_reason": "length", "text": "2"}],
    }
    reply = build(sse(event, end, USAGE, "[DONE]"), chat=False)
    assert reply["object"] == "text_completion"
    assert reply["choices"] == [{"index": 0, "finish_reason": "length", "text": "42"}]
    assert reply["usage"]["completion_tokens"] == 2


def test_first_data_ignores_comments() -> None:
    """A keepalive comment is not the first token."""
    assembler = ReplyAssembler(chat=True)
    assembler.feed(b": keepalive 1/9\n\n")
    assert not assembler.first_data
    assembler.feed(sse(chunk({"content": "x"})))
    assert assembler.first_data and not assembler.done


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        (
            b'data: {"error": {"message": "boom", "code": "upstream_truncated"}}\n\n',
            502,
            "upstream_truncated",
        ),
        (b"data: {not json\n\n", 502, "upstream_bad_response"),
        (b"data: [1, 2]\n\n", 502, "upstream_bad_response"),
    ],
)
def test_what_makes_no_reply_is_an_assembly_error(data: bytes, status: int, code: str) -> None:
    """An error event, a non-JSON event or a non-object event is an error with an OpenAI status and code."""
    assembler = ReplyAssembler(chat=True)
    assembler.feed(data)
    with pytest.raises(AssemblyError) as caught:
        assembler.reply()
    assert (caught.value.status, caught.value.code) == (status, code)


def test_a_stream_without_done_makes_no_reply() -> None:
    """A stream that ends without [DONE] (the engine died) is upstream_truncated, not a short reply."""
    assembler = ReplyAssembler(chat=True)
    assembler.feed(sse(chunk({"role": "assistant", "content": "Hel"})))
    assert not assembler.done
    with pytest.raises(AssemblyError) as caught:
        assembler.reply()
    assert caught.value.code == "upstream_truncated"


def test_done_is_seen_when_split_across_reads() -> None:
    """`data: [DONE]` cut between two reads still ends the stream."""
    assembler = ReplyAssembler(chat=True)
    data = sse(chunk({"role": "assistant", "content": "x"}), "[DONE]")
    cut = data.index(b"[DO")
    assembler.feed(data[:cut])
    assert not assembler.done
    assembler.feed(data[cut:])
    assert assembler.done
    assert orjson.loads(assembler.reply())["choices"][0]["message"]["content"] == "x"


def test_ask_for_stream_turns_a_generation_into_a_stream_with_usage() -> None:
    """Chat and completions become streams with include_usage; embeddings and logprobs requests do not."""
    guards = Guards(via_stream=True, stream_cannot_carry=("logprobs", "top_logprobs"))
    doc: dict[str, Any] = {"model": "m", "messages": [], "stream": False, "stream_options": {"x": 1}}
    assert ask_for_stream(doc, b"/chat/completions", guards)
    assert doc["stream"] is True and doc["stream_options"] == {"include_usage": True}
    assert ask_for_stream({"model": "m", "prompt": "p"}, b"/completions", guards)
    assert not ask_for_stream({"model": "m", "input": "p"}, b"/embeddings", guards)
    kept = {"model": "m", "messages": [], "logprobs": True}
    assert not ask_for_stream(kept, b"/chat/completions", guards) and "stream" not in kept
    assert ask_for_stream({"model": "m", "messages": [], "logprobs": False}, b"/chat/completions", guards)
