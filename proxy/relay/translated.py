"""Another API's response made from the chat stream the engine answered with, event by event.

A request translated to a chat completion (``proxy.translate``) is always
sent as a stream. Its events are parsed here as they arrive, each handed to
the request's translator, and what the translator returns goes out at once:
one write per upstream read, nothing held back but half an event. A stream
that breaks, or ends without ``[DONE]``, ends with the API's own error end
(the translator's ``failed``). A non-stream client gets the translator's
reply once the stream is whole, or an error in its API's envelope.
"""

from __future__ import annotations

from time import perf_counter
from typing import Any

import orjson

from proxy.asgi import Scope, Send
from proxy.errors import HTTPError
from proxy.headers import SSE_HEADERS
from proxy.relay.built import await_stream_end, refuse_built, send_built
from proxy.relay.out import AsgiWriter, Writer, writer_for
from proxy.relay.outcome import Outcome
from proxy.relay.timing import timing_header
from proxy.status import USAGE_BYTES
from proxy.translate import Translator
from proxy.upstream import Connection
from proxy.upstream_errors import ReadTimeout, UpstreamError

# The most of one event held while waiting for its end: an upstream fault past it.
_EVENT_LIMIT_BYTES = 4 * 1024 * 1024
_TRUNCATED = "upstream stream ended without [DONE]: the response is truncated"


class ChatEvents:
    """The ``chat.completion.chunk`` documents of an SSE byte stream, as its complete events arrive."""

    __slots__ = ("_pending", "done")

    def __init__(self) -> None:
        self._pending = b""
        # The stream's [DONE] has come: nothing after it is read.
        self.done = False

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """The chunks of the events ``data`` completes; an ``HTTPError`` for an error event or bad JSON."""
        if self._pending:
            data = self._pending + data
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        end = data.rfind(b"\n\n")
        if end < 0:
            if len(data) > _EVENT_LIMIT_BYTES:
                raise HTTPError(502, "upstream sent an event larger than 4 MiB", code="upstream_bad_response")
            self._pending = data
            return []
        self._pending = data[end + 2 :]
        chunks: list[dict[str, Any]] = []
        for event in data[:end].split(b"\n\n"):
            payload = _data_of(event)
            if payload is None:
                continue  # a comment (keepalive), or an event with no data
            if payload == b"[DONE]":
                self.done = True
                break
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                raise HTTPError(
                    502, "upstream sent an event that is not JSON", code="upstream_bad_response"
                ) from None
            if not isinstance(chunk, dict):
                raise HTTPError(
                    502, "upstream sent an event that is not an object", code="upstream_bad_response"
                )
            error = chunk.get("error")
            if error is not None:
                message = error.get("message") if isinstance(error, dict) else error
                raise HTTPError(502, f"upstream failed: {message}", code="upstream_error")
            chunks.append(chunk)
        return chunks


def _data_of(event: bytes) -> bytes | None:
    """An event's data (its ``data:`` lines joined), or None for one without."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # the common case: one data line
    lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


async def respond_translated(
    conn: Connection,
    scope: Scope,
    send: Send,
    outcome: Outcome,
    head_at: float,
    read_timeout_s: float,
    heartbeat_s: float = 0.0,
) -> None:
    """The engine's 200 chat stream is in: answer the client in its own API, as a stream (with a
    keepalive event every ``heartbeat_s`` the engine sends nothing, unless 0) or a reply."""
    translator = outcome.translator
    assert translator is not None
    if translator.stream:
        outcome.error = await _stream(
            conn, scope, send, outcome, translator, head_at, read_timeout_s, heartbeat_s
        )
    else:
        await _reply(conn, send, outcome, translator, head_at, read_timeout_s)


async def _stream(
    conn: Connection,
    scope: Scope,
    send: Send,
    outcome: Outcome,
    translator: Translator,
    head_at: float,
    read_timeout_s: float,
    heartbeat_s: float,
) -> str | None:
    """Translate the stream event by event; the error code it ended with, if any."""
    out: Writer
    if outcome.sse_started:
        # The gateway's heartbeats started the response: the events follow them.
        out = AsgiWriter(send)
    else:
        out = writer_for(scope, send)
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            *SSE_HEADERS,
            (b"x-request-id", outcome.request_id),
            timing_header(outcome.own_s or 0.0, head_at - outcome.sent_at),
        ]
        out.start(200, headers)
        outcome.status = 200
    events = ChatEvents()
    pending = b""
    try:
        # The head and the opening events go out at once: the client knows that its request
        # is taken before a long prefill, not after it.
        await _write(out, outcome, translator.start(), True)
        last_data_at = sent_at = perf_counter()
        while True:
            if heartbeat_s and not conn.ready:
                sent_at = await _keep_alive(
                    conn, out, outcome, translator, heartbeat_s, read_timeout_s, last_data_at, sent_at
                )
            chunk = await conn.read(read_timeout_s)
            if not chunk:
                break
            last_data_at = perf_counter()
            if not outcome.first_s and b"data:" in chunk:
                outcome.first_s = last_data_at - outcome.started
            # Joined once: a read may hold thousands of events (a client or a gateway behind),
            # and adding each event's bytes to the rest would copy the rest again each time.
            pending += b"".join([translator.feed(parsed) for parsed in events.feed(chunk)])
            if events.done:
                pending += translator.finish()
                outcome.tail = pending[-USAGE_BYTES:]
                await _write(out, outcome, pending, False)
                await await_stream_end(conn, read_timeout_s)
                return None
            if pending:
                await _write(out, outcome, pending, True)
                pending = b""
                sent_at = last_data_at
            elif heartbeat_s and last_data_at - sent_at >= heartbeat_s:
                # Bytes that make no event (mlx's comments during a prefill): the client gets
                # its API's keepalive instead, or it would see nothing.
                await _write(out, outcome, translator.keepalive(), True)
                sent_at = last_data_at
        error = HTTPError(502, _TRUNCATED, code="upstream_truncated")
    except (UpstreamError, HTTPError) as exc:
        conn.close()
        error = exc
    await _write(out, outcome, pending + translator.failed(error.status, error.message, error.code), False)
    return error.code


async def _keep_alive(
    conn: Connection,
    out: Writer,
    outcome: Outcome,
    translator: Translator,
    heartbeat_s: float,
    read_timeout_s: float,
    last_data_at: float,
    sent_at: float,
) -> float:
    """While the engine sends nothing, the API's keepalive event once the client has had nothing for
    ``heartbeat_s``: agent clients give up on a stream idle for a while (Codex: 300 s), whatever
    the engine is doing. Return when the client was last sent something. The read deadline still
    holds: nothing from the engine for ``read_timeout_s`` is a ReadTimeout."""
    # One wait of heartbeat_s each time (the coarse timers keep a queue per delay): a keepalive
    # at most twice that after the last bytes the client had.
    while not await conn.wait_body(heartbeat_s):
        now = perf_counter()
        if now - last_data_at >= read_timeout_s:
            conn.close()
            raise ReadTimeout(f"upstream sent nothing for {read_timeout_s:g} s in the middle of its response")
        if now - sent_at >= heartbeat_s:
            await _write(out, outcome, translator.keepalive(), True)
            sent_at = now
    return sent_at


async def _write(out: Writer, outcome: Outcome, data: bytes, more: bool) -> None:
    wait = out.write(data, more)
    # Counted once handed on: a write to a client that has gone raises ClientGone.
    outcome.bytes_out += len(data)
    if wait is not None:
        await wait
    outcome.sends += 1


async def _reply(
    conn: Connection,
    send: Send,
    outcome: Outcome,
    translator: Translator,
    head_at: float,
    read_timeout_s: float,
) -> None:
    """Read the whole stream, then answer with the translator's reply (or an error in the API's envelope)."""
    started, sent_at = outcome.started, outcome.sent_at
    own_s = sent_at - started + perf_counter() - head_at
    events = ChatEvents()
    try:
        while chunk := await conn.read(read_timeout_s):
            at = perf_counter()
            for parsed in events.feed(chunk):
                translator.feed(parsed)
            own_s += perf_counter() - at
            if events.done:
                break
        if not events.done:
            raise HTTPError(502, _TRUNCATED, code="upstream_truncated")
        at = perf_counter()
        translator.finish()
        body = translator.reply()
    except HTTPError as exc:  # the upstream's failures (UpstreamError), a bad or cut stream
        await refuse_built(conn, send, outcome, exc)
        return
    await send_built(send, outcome, body, own_s + perf_counter() - at, head_at)
    await await_stream_end(conn, read_timeout_s)
