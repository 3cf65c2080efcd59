"""The chat events a translated request reads from its engine's stream (proxy.relay.translated)."""

from __future__ import annotations

import pytest

from proxy.errors import HTTPError
from proxy.relay.translated import ChatEvents


def test_events_split_across_reads_come_whole_in_order() -> None:
    """An event cut between two reads is parsed once its end arrives; the order is kept."""
    events = ChatEvents()
    assert events.feed(b'data: {"n":1}\n\ndata: {"n"') == [{"n": 1}]
    assert events.feed(b":2}\n\n") == [{"n": 2}]
    assert not events.done


def test_done_ends_the_stream_and_nothing_after_it_is_read() -> None:
    """[DONE] sets done; an event after it in the same read is not parsed."""
    events = ChatEvents()
    assert events.feed(b'data: {"n":1}\n\ndata: [DONE]\n\ndata: {"n":3}\n\n') == [{"n": 1}]
    assert events.done


def test_crlf_framing_comments_and_named_events_are_read() -> None:
    """CRLF framing (sse-starlette), comments (keepalives) and data after an event line all parse."""
    events = ChatEvents()
    stream = b': ping\r\n\r\nevent: chunk\r\ndata: {"n":1}\r\n\r\ndata:{"n":2}\r\n\r\ndata: [DONE]\r\n\r\n'
    assert events.feed(stream) == [{"n": 1}, {"n": 2}]
    assert events.done


def test_an_error_event_is_an_upstream_error() -> None:
    """A data event holding an error (the engine failed mid-stream) raises with its message."""
    events = ChatEvents()
    with pytest.raises(HTTPError) as caught:
        events.feed(b'data: {"error": {"message": "boom"}}\n\n')
    assert caught.value.status == 502 and "boom" in caught.value.message


@pytest.mark.parametrize("payload", [b"data: {not json\n\n", b"data: [1, 2]\n\n", b'data: "text"\n\n'])
def test_an_event_that_is_not_a_json_object_is_a_bad_response(payload: bytes) -> None:
    """Garbage in an event is a 502 upstream_bad_response, never an exception of another type."""
    with pytest.raises(HTTPError) as caught:
        ChatEvents().feed(payload)
    assert caught.value.code == "upstream_bad_response"


def test_an_event_without_end_is_bounded() -> None:
    """Bytes without an event's end are held only up to a bound, then refused."""
    events = ChatEvents()
    events.feed(b"data: " + b"x" * (1024 * 1024))
    with pytest.raises(HTTPError) as caught:
        for _ in range(4):
            events.feed(b"x" * (1024 * 1024))
    assert caught.value.code == "upstream_bad_response"
