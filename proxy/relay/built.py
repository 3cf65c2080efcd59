"""A non-stream reply built from the stream the engine was asked for (``[nonstream] via_stream``).

mlx_lm.server writes a non-stream reply only when it is complete, so it
cannot tell that its client has left; asked for a stream instead, it stops
within a token. The events are kept and parsed once at the end
(``proxy.assembly``), into the one JSON reply the engine would have sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from time import perf_counter

from proxy.asgi import Send
from proxy.errors import HTTPError
from proxy.relay.failures import send_upstream_error
from proxy.relay.outcome import Outcome
from proxy.relay.timing import server_timing, timing_header
from proxy.status import USAGE_BYTES
from proxy.upstream import Connection
from proxy.upstream_errors import ClientGone, UpstreamError

# A built reply waits this long after [DONE] for its stream's end (it follows at once).
_AFTER_DONE_S = 1.0


async def respond_built(
    conn: Connection, send: Send, outcome: Outcome, head_at: float, read_timeout_s: float
) -> None:
    """Read the stream the engine was asked for, and answer with the non-stream reply it makes.

    Nothing reaches the client before the reply is whole: a stream that
    breaks or ends without ``[DONE]`` (the engine died) is a 502 in the
    OpenAI envelope, never a short reply. The time to the first event with
    data is the request's time to first token.
    """
    assembler = outcome.built
    assert assembler is not None
    started, sent_at = outcome.started, outcome.sent_at
    own_s = sent_at - started + perf_counter() - head_at
    try:
        while chunk := await conn.read(read_timeout_s):
            at = perf_counter()
            had_data = assembler.first_data
            assembler.feed(chunk)
            if not had_data and assembler.first_data:
                outcome.head_s = at - started
            own_s += perf_counter() - at
            if assembler.done:
                break
        at = perf_counter()
        body = assembler.reply()
    except HTTPError as exc:  # the upstream's failures, and a stream that makes no reply
        await refuse_built(conn, send, outcome, exc)
        return
    await send_built(send, outcome, body, own_s + perf_counter() - at, head_at)
    await await_stream_end(conn, read_timeout_s)


async def refuse_built(conn: Connection, send: Send, outcome: Outcome, exc: HTTPError) -> None:
    """A reply that could not be built: the error in the API's envelope, nothing of the reply."""
    conn.close()
    outcome.status, outcome.error = exc.status, exc.code
    timing = server_timing(outcome.started, outcome.sent_at, perf_counter())
    outcome.bytes_out = await send_upstream_error(
        send, outcome.endpoint.envelope, exc, outcome.request_id, timing
    )


async def send_built(send: Send, outcome: Outcome, body: bytes, own_s: float, head_at: float) -> None:
    """The whole reply, with one Content-Length; ``own_s`` is the gateway's own time in it."""
    outcome.status = 200
    outcome.bytes_out = len(body)
    outcome.own_s = own_s
    outcome.tail = body[-USAGE_BYTES:]
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"x-request-id", outcome.request_id),
        timing_header(own_s, head_at - outcome.sent_at),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def await_stream_end(conn: Connection, read_timeout_s: float) -> None:
    """After [DONE], the stream's end follows at once (mlx closes; a chunked body sends its last
    chunk): once the client has its reply, wait for it briefly, so that the connection ends cleanly
    and the pool can use it again (or opens the next one ahead)."""
    if conn.complete:
        return
    with contextlib.suppress(UpstreamError, ClientGone, TimeoutError):
        async with asyncio.timeout(_AFTER_DONE_S):
            while await conn.read(read_timeout_s):
                pass
    if not conn.complete:
        conn.close()
