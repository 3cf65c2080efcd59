"""Heartbeats before a stream's head: the gateway starts the SSE response itself during a long prefill.

After each ``heartbeat_s`` without a head, the gateway sends the client a
200 text/event-stream head of its own and ``: keepalive`` comments, so that
an nginx ``proxy_read_timeout`` in front of it does not cut the stream. The
upstream's head then only continues the stream, or ends it with its error as
one event.
"""

from __future__ import annotations

from time import perf_counter

import orjson

from proxy.asgi import Send
from proxy.errors import OPENAI
from proxy.headers import SSE_HEADERS, is_event_stream_type
from proxy.relay.failures import read_error_body
from proxy.relay.out import AsgiWriter
from proxy.relay.outcome import Outcome
from proxy.relay.sse import relay_events
from proxy.relay.timing import server_timing
from proxy.upstream import Connection
from proxy.upstream_errors import HeadTimeout, UpstreamError

_HEARTBEAT = b": keepalive\n\n"


async def await_head_with_heartbeats(
    conn: Connection, send: Send, outcome: Outcome, heartbeat_s: float, head_timeout_s: float
) -> None:
    """Wait for a stream's head; during a long prefill, keep the client's proxies from timing out."""
    deadline = outcome.sent_at + head_timeout_s
    # The first heartbeat is due a heartbeat after the request was sent (a stream the fast path
    # began hands its wait over at that time, ``proxy/relay/fast.py``); each next one, one after it.
    beat = outcome.sent_at + heartbeat_s
    while not await conn.wait_head(max(0.0, min(beat, deadline) - perf_counter())):
        now = perf_counter()
        beat = now + heartbeat_s
        if now >= deadline:
            conn.close()
            raise HeadTimeout(f"upstream sent no response within {head_timeout_s:g} s")
        if not outcome.sse_started:
            headers = [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                *SSE_HEADERS,
                (b"x-request-id", outcome.request_id),
                server_timing(outcome.started),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            outcome.sse_started = True
            outcome.status = 200
        await send({"type": "http.response.body", "body": _HEARTBEAT, "more_body": True})
        outcome.bytes_out += len(_HEARTBEAT)


async def continue_stream(
    conn: Connection, send: Send, status: int, outcome: Outcome, read_timeout_s: float
) -> None:
    """The upstream's head after the gateway's heartbeats: relay its events, or its error as one."""
    if (
        outcome.translator is None
        and 200 <= status < 300
        and is_event_stream_type(conn.content_type)
        and conn.content_encoding is None
    ):
        # The head went out as the gateway's own: the events follow it (rare: no fast path).
        # A translated request's chat stream (a 200) is translated before this; any other
        # answer to it ends its stream with its API's error.
        outcome.error = await relay_events(conn, AsgiWriter(send), outcome, read_timeout_s)
        return
    try:
        body = await read_error_body(conn, OPENAI, read_timeout_s) if status >= 400 else b""
    except UpstreamError as exc:
        conn.close()
        outcome.failed(exc)
        event = started_stream_error(outcome, 502, exc.message, exc.code)
    else:
        if body:
            error = orjson.loads(body)["error"]
            event = started_stream_error(outcome, status, error["message"], error.get("code"))
        else:
            conn.close()
            what = "a coded event stream" if conn.content_encoding is not None else "no event stream"
            event = started_stream_error(
                outcome, 502, f"upstream answered {status} with {what}", "upstream_bad_response"
            )
    outcome.error = outcome.error or "upstream_status"
    outcome.bytes_out += len(event)
    await send({"type": "http.response.body", "body": event})


def started_stream_error(outcome: Outcome, status: int, message: str, code: str | None) -> bytes:
    """The error that ends a stream the gateway started with heartbeats: for a translated request,
    its API's first events and its error end; else its API's error events."""
    translator = outcome.translator
    if translator is not None:
        return translator.start() + translator.failed(status, message, code)
    return outcome.endpoint.envelope.only_event(status, message, code)
