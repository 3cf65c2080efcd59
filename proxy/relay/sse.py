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
from proxy.upstream import Connection
from proxy.upstream_errors import UpstreamError

# Enough of a stream's end to hold "data: [DONE]" and its newlines.
_TAIL_BYTES = 32
# Enough of an event's start to hold its name and its type.
_HEAD_BYTES = 256
# How an SSE event ends: a blank line, LF or CRLF (sse-starlette writes CRLF).
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")
# The most of a half-written SSE event held back to wait for its end.
_PARTIAL_EVENT_LIMIT_BYTES = 64 * 1024


class EventStream:
    """What an SSE stream's reads leave to relay, read by read: the half-event held back for
    the rest of it, the first event with data (its time), and whether the stream's end has come.

    The stream's end is judged by its endpoint's rules, whatever the framing
    (OpenAI's chat and text completions: ``data: [DONE]``; the Messages API:
    ``message_stop``; the Responses API: ``response.completed``, ``.failed``,
    ``.incomplete``). Used by ``relay_events`` (a task) and by the fast path's
    stream (``proxy/relay/fast.py``, from the upstream's callbacks).
    """

    __slots__ = (
        "_at_boundary",
        "_by_event",
        "_ends_stream",
        "_head",
        "_outcome",
        "_waiting",
        "last",
        "pending",
        "prev",
    )

    def __init__(self, outcome: Outcome) -> None:
        self._outcome = outcome
        # The bytes after the last complete event of the reads so far.
        self.pending = b""
        # The stream's last write, and the one before it: its tail is read from them at the end (a
        # slice per read would cost every event).
        self.last = self.prev = b""
        # An API whose stream ends with an event of its own (not [DONE]): the start of its last event.
        self._ends_stream = outcome.endpoint.ends_stream
        self._by_event = outcome.endpoint.api is not None
        self._head = b""
        self._at_boundary = True
        # Until the first event with data (comments such as mlx's `: keepalive N/M` come before it).
        self._waiting = True

    def cut(self, chunk: bytes) -> bytes:
        """What of a read goes out: the half-event held back before it, and none of a half-event at
        its end (held back, up to ``_PARTIAL_EVENT_LIMIT_BYTES``); ``b""`` when the read only adds
        to a half-event."""
        if self.pending:
            chunk = self.pending + chunk
            self.pending = b""
        if self._waiting and b"data:" in chunk:
            self._waiting = False
            outcome = self._outcome
            outcome.first_s = perf_counter() - outcome.started
        if not chunk.endswith(b"\n\n"):
            cut = event_end(chunk)
            if cut < len(chunk) and len(chunk) - cut <= _PARTIAL_EVENT_LIMIT_BYTES:
                chunk, self.pending = chunk[:cut], chunk[cut:]
                if not chunk:
                    return chunk
        if self._by_event:
            self._head = last_event_head(chunk, self._head, self._at_boundary)
            self._at_boundary = chunk.endswith(_EVENT_ENDS)
        return chunk

    def wrote(self, chunk: bytes, before: bytes | None = None) -> None:
        """``chunk`` (what ``cut`` gave, or its last slice, ``before`` being the bytes before that
        slice) is the stream's last write so far."""
        self.prev, self.last = (self.last if before is None else before), chunk

    def ended(self) -> bool:
        """Whether the stream's last writes hold its end."""
        return self._ends_stream(tail_of(self.prev, self.last), self._head if self._by_event else self.last)

    def truncated(self) -> bytes:
        """The error event that ends a stream cut short (see ``relay_events``)."""
        endpoint = self._outcome.endpoint
        message = f"upstream stream ended without {endpoint.end_name}: the response is truncated"
        return endpoint.envelope.event(502, message, "upstream_truncated")


async def relay_events(conn: Connection, out: Writer, outcome: Outcome, read_timeout_s: float) -> str | None:
    """Relay an SSE stream event by event as bytes arrive, after the head ``out`` holds; vouch for its end.

    Bytes after the last complete event of a read wait for the rest of
    their event (they are rare: servers write whole events), so that an
    error event never lands inside a half-written one. A stream that ends
    without its end (``EventStream``), and without an error event of its own
    (a chained gateway's), ends with an error event in its API's shape.
    """
    events = EventStream(outcome)
    try:
        if not conn.ready and (wait := out.flush()) is not None:
            # Nothing of the body yet (a prefill): the head goes out alone.
            await wait
        while chunk := await conn.read(read_timeout_s):
            chunk = events.cut(chunk)
            if not chunk:
                # Half an event only: a held head must not wait for the rest.
                if (wait := out.flush()) is not None:
                    await wait
                continue
            before = None
            if len(chunk) > SLICE_BYTES:
                whole = chunk
                chunk = await write_all_but_last_slice(out, chunk, outcome)
                before = whole[-len(chunk) - _TAIL_BYTES : -len(chunk)]
            events.wrote(chunk, before)
            # Counted once handed on: a write to a client that has gone raises ClientGone.
            if conn.complete and not conn.close_delimited and not events.pending and events.ended():
                outcome.tail = usage_tail(events.prev, chunk)
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
    if not events.ended():
        # An HTTP/1.0 stream ends with the close either way, and a chunked
        # one may end cleanly too: without [DONE], the engine crashed or
        # cut it, or sent something else, and the client must know.
        event = events.truncated()
        wait = out.write(event, False)
        outcome.bytes_out += len(event)
        if wait is not None:
            await wait
        return "upstream_truncated"
    outcome.tail = usage_tail(events.prev, events.last)
    # Half an event after the end: the client gets it as sent, and it counts.
    wait = out.write(events.pending, False)
    outcome.bytes_out += len(events.pending)
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
