"""The endpoint objects: paths, envelopes, targets, and how each API's stream ends."""

from __future__ import annotations

import pytest

from proxy.endpoints import (
    ALL,
    CHAT,
    COUNT_TOKENS,
    ENDPOINTS,
    MESSAGES,
    NATIVE_APIS,
    RESPONSES_API,
    envelope_of,
)
from proxy.errors import ANTHROPIC, OPENAI, RESPONSES
from proxy.relay.routes import ROUTE_LABELS, targets_of
from proxy.relay.sse import last_event_head, tail_of
from proxy.routing import UpstreamAddress


def test_every_endpoint_is_served_with_and_without_v1() -> None:
    """Each endpoint answers on /v1/NAME and /NAME, and no path is claimed twice."""
    paths = [p for e in ALL for p in e.paths]
    assert len(paths) == len(set(paths))
    for endpoint in ALL:
        assert ENDPOINTS[f"/v1/{endpoint.name}"] is endpoint
        assert ENDPOINTS[f"/{endpoint.name}"] is endpoint
    assert ENDPOINTS["/v1/messages"] is MESSAGES
    assert ENDPOINTS["/v1/messages/count_tokens"] is COUNT_TOKENS
    assert ENDPOINTS["/v1/responses"] is RESPONSES_API


def test_metric_labels_are_the_endpoint_names() -> None:
    """The route label of a request's metrics is its endpoint's name, the same with or without /v1."""
    assert ROUTE_LABELS["/v1/messages"] == ROUTE_LABELS["/messages"] == "messages"
    assert ROUTE_LABELS["/v1/messages/count_tokens"] == "messages/count_tokens"
    assert ROUTE_LABELS["/responses"] == "responses"
    assert ROUTE_LABELS["/v1/chat/completions"] == "chat/completions"


def test_each_api_answers_errors_in_its_own_envelope() -> None:
    """Anthropic's paths get Anthropic's envelope; the Responses API and the rest OpenAI's."""
    assert envelope_of("/v1/messages") is ANTHROPIC
    assert envelope_of("/messages/count_tokens") is ANTHROPIC
    assert envelope_of("/v1/responses") is RESPONSES
    assert envelope_of("/v1/chat/completions") is OPENAI
    assert envelope_of("/no/such/path") is OPENAI


def test_targets_translate_what_the_server_does_not_serve() -> None:
    """A server without native APIs gets the Messages and Responses paths as chat completions;
    one that serves them gets their own paths."""
    upstream = UpstreamAddress("127.0.0.1", 9)
    plain = targets_of(upstream, ())
    assert plain["/v1/messages"] == plain["/v1/responses"] == plain["/v1/chat/completions"]
    assert plain["/messages/count_tokens"] == b"/v1/chat/completions"
    native = targets_of(upstream, NATIVE_APIS)
    assert native["/v1/messages"] == b"/v1/messages"
    assert native["/v1/messages/count_tokens"] == b"/v1/messages/count_tokens"
    assert native["/v1/responses"] == b"/v1/responses"
    assert native["/v1/embeddings"] == b"/v1/embeddings"
    only = targets_of(upstream, ("responses",))
    assert only["/v1/responses"] == b"/v1/responses"
    assert only["/v1/messages"] == b"/v1/chat/completions"


def _head(stream: bytes) -> bytes:
    return last_event_head(stream, b"", True)


@pytest.mark.parametrize(
    "stream",
    [
        b'event: message_delta\ndata: {"type":"message_delta"}\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
        b'data: {"type":"message_stop"}\n\n',
        b'data: {"type": "message_stop"}\r\n\r\n',
        b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"x"}}\n\n',
    ],
)
def test_a_messages_stream_ends_with_message_stop_or_an_error(stream: bytes) -> None:
    """The Messages API's stream is whole when its last event is message_stop (or an error)."""
    assert MESSAGES.ends_stream(stream[-32:], _head(stream))


@pytest.mark.parametrize(
    "stream",
    [
        b'event: content_block_delta\ndata: {"type":"content_block_delta",'
        b'"delta":{"text":"message_stop"}}\n\n',
        b'event: message_stop\ndata: {"type":"message_stop"}\n\nevent: ping\ndata: {"type":"ping"}\n\n',
        b"data: [DONE]\n\n",
    ],
)
def test_a_messages_stream_without_message_stop_last_is_not_whole(stream: bytes) -> None:
    """Text that says message_stop, an event after it, or OpenAI's [DONE] do not end a Messages stream."""
    assert not MESSAGES.ends_stream(stream[-32:], _head(stream))


@pytest.mark.parametrize("end", [b"response.completed", b"response.failed", b"response.incomplete", b"error"])
def test_a_responses_stream_ends_with_its_final_events(end: bytes) -> None:
    """A Responses stream is whole when its last event is completed, failed, incomplete or an error."""
    stream = b"event: " + end + b'\ndata: {"type":"' + end + b'","response":{}}\n\n'
    assert RESPONSES_API.ends_stream(stream[-32:], _head(stream))


def test_a_responses_delta_naming_the_end_does_not_end_it() -> None:
    """A text delta whose text is "response.completed" is not the stream's end."""
    stream = (
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        b'"delta":"event: response.completed"}\n\n'
    )
    assert not RESPONSES_API.ends_stream(stream[-32:], _head(stream))


def test_a_final_event_larger_than_a_read_is_judged_by_its_start() -> None:
    """A response.completed event split over several reads (a long reply) is still seen as the end."""
    first = (
        b'event: response.output_text.done\ndata: {"x":1}\n\n'
        b'event: response.completed\ndata: {"type":"response.completed","response":{"text":"'
    )
    head = last_event_head(first, b"", True)
    middle = b"a" * 100_000
    head = last_event_head(middle, head, first.endswith(b"\n\n"))
    end = b'"}}\n\n'
    head = last_event_head(end, head, middle.endswith(b"\n\n"))
    assert RESPONSES_API.ends_stream(end, head)


def test_chat_keeps_done_as_its_end() -> None:
    """Chat completions end with [DONE] (or an error event), judged on the tail and the last write."""
    assert CHAT.ends_stream(b"data: [DONE]\n\n", b"data: [DONE]\n\n")
    assert not CHAT.ends_stream(b'data: {"choices":[]}\n\n', b'data: {"choices":[]}\n\n')


def test_a_streams_tail_comes_from_its_last_two_writes() -> None:
    """The tail that holds [DONE] is the last write's end, or reaches into the write before it."""
    assert tail_of(b"x" * 100, b"data: [DONE]\n\n").endswith(b"data: [DONE]\n\n")
    assert tail_of(b'data: {"a":1}\n\ndata: [DO', b"NE]\n\n") == b'data: {"a":1}\n\ndata: [DONE]\n\n'
    long = b"y" * 40 + b"data: [DONE]\n\n"
    assert tail_of(b"", long) == long[-32:]
    assert tail_of(b"", b"") == b""
