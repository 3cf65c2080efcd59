"""An SSE stream relayed event by event, and vouched for at its end.

No per-event parsing: the only looks at the relayed bytes are where the last
complete event of a read ends (``bytes.rfind``) and whether the stream's last
bytes hold ``[DONE]``.
"""

from __future__ import annotations

from time import perf_counter

from proxy.relay.body import SLICE_BYTES, usage_tail, write_all_but_last_slice
from proxy.relay.out import Writer
from proxy.relay.outcome import Outcome
from proxy.upstream import Connection, UpstreamError

# Enough of a stream's end to hold "data: [DONE]" and its newlines.
_TAIL_BYTES = 32
# Enough of an event's start to hold its name and its type.
_HEAD_BYTES = 256
# How an SSE event ends: a blank line, LF or CRLF (sse-starlette writes CRLF).
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")
# The most of a half-written SSE event held back to wait for its end.
_PARTIAL_EVENT_LIMIT_BYTES = 64 * 1024


async def relay_events(conn: Connection, out: Writer, outcome: Outcome, read_timeout_s: float) -> str | None:
    """Relay an SSE stream event by event as bytes arrive, after the head ``out`` holds; vouch for its end.

    Bytes after the last complete event of a read wait for the rest of
    their event (they are rare: servers write whole events), so that an
    error event never lands inside a half-written one. The stream's end is
    judged by its endpoint's rules, whatever the framing (OpenAI's chat and
    text completions: ``data: [DONE]``; the Messages API: ``message_stop``;
    the Responses API: ``response.completed``, ``.failed``, ``.incomplete``):
    a stream that ends without its end (and without an error event of its
    own, a chained gateway's) ends with an error event in its API's shape.
    """
    pending = b""
    # The stream's last write, and the one before it: its tail is read from them at the end (a
    # slice per read would cost every event).
    last = prev = b""
    # An API whose stream ends with an event of its own (not [DONE]): the start of its last event.
    ends_stream = outcome.endpoint.ends_stream
    by_event = outcome.endpoint.api is not None
    head = b""
    at_boundary = True
    # Until the first event with data (comments such as mlx's `: keepalive N/M` come before it).
    waiting = True
    try:
        if not conn.ready and (wait := out.flush()) is not None:
            # Nothing of the body yet (a prefill): the head goes out alone.
            await wait
        while chunk := await conn.read(read_timeout_s):
            if pending:
                chunk = pending + chunk
                pending = b""
            if waiting and b"data:" in chunk:
                waiting = False
                outcome.first_s = perf_counter() - outcome.started
            if not chunk.endswith(b"\n\n"):
                cut = event_end(chunk)
                if cut < len(chunk) and len(chunk) - cut <= _PARTIAL_EVENT_LIMIT_BYTES:
                    chunk, pending = chunk[:cut], chunk[cut:]
                    if not chunk:
                        # Half an event only: a held head must not wait for the rest.
                        if (wait := out.flush()) is not None:
                            await wait
                        continue
            if by_event:
                head = last_event_head(chunk, head, at_boundary)
                at_boundary = chunk.endswith(_EVENT_ENDS)
            if len(chunk) > SLICE_BYTES:
                whole = chunk
                chunk = await write_all_but_last_slice(out, chunk, outcome)
                last = whole[-len(chunk) - _TAIL_BYTES : -len(chunk)]
            prev, last = last, chunk
            # Counted once handed on: a write to a client that has gone raises ClientGone.
            if (
                conn.complete
                and not conn.close_delimited
                and not pending
                and ends_stream(tail_of(prev, last), head if by_event else last)
            ):
                outcome.tail = usage_tail(prev, chunk)
                wait = out.write(chunk, False)
                outcome.bytes_out += len(chunk)
                if wait is not None:
                    await wait
                return None
            wait = out.write(chunk, True)
            outcome.bytes_out += len(chunk)
            if wait is not None:
                await wait
            outcome.sends += 1
    except UpstreamError as exc:
        conn.close()
        event = outcome.endpoint.envelope.event(exc.status, exc.message, exc.code)
        wait = out.write(event, False)
        outcome.bytes_out += len(event)
        if wait is not None:
            await wait
        return exc.code
    if not ends_stream(tail_of(prev, last), head if by_event else last):
        # An HTTP/1.0 stream ends with the close either way, and a chunked
        # one may end cleanly too: without [DONE], the engine crashed or
        # cut it, or sent something else, and the client must know.
        end = outcome.endpoint.end_name
        message = f"upstream stream ended without {end}: the response is truncated"
        event = outcome.endpoint.envelope.event(502, message, "upstream_truncated")
        wait = out.write(event, False)
        outcome.bytes_out += len(event)
        if wait is not None:
            await wait
        return "upstream_truncated"
    outcome.tail = usage_tail(prev, last)
    # Half an event after the end: the client gets it as sent, and it counts.
    wait = out.write(pending, False)
    outcome.bytes_out += len(pending)
    if wait is not None:
        await wait
    return None


def tail_of(prev: bytes, last: bytes) -> bytes:
    """A stream's last bytes (enough to hold ``data: [DONE]``), from its last two writes."""
    return last[-_TAIL_BYTES:] if len(last) >= _TAIL_BYTES else (prev + last)[-_TAIL_BYTES:]


def last_event_head(chunk: bytes, previous: bytes, at_boundary: bool) -> bytes:
    """The first bytes of the last event in ``chunk`` (``previous`` when the chunk only continues it).

    Comments and ``data: [DONE]`` are passed over: after an API's last event they end nothing
    of their own (LiteLLM sends ``[DONE]`` after ``response.completed``).
    """
    body = chunk.rstrip(b"\r\n")
    while True:
        lf = body.rfind(b"\n\n")
        crlf = body.rfind(b"\r\n\r\n")
        start = max(lf + 2 if lf >= 0 else -1, crlf + 4 if crlf >= 0 else -1)
        event = body[start:] if start >= 0 else body
        if not event.startswith(b":") and event != b"data: [DONE]":
            break
        if start < 0:
            return previous
        body = body[:start].rstrip(b"\r\n")
    if start >= 0:
        return body[start : start + _HEAD_BYTES]
    return body[:_HEAD_BYTES] if at_boundary else previous


def event_end(data: bytes) -> int:
    """Where the last complete SSE event in ``data`` ends (0 if none does)."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
