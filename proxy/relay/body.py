"""A response body relayed as it arrives, and large reads handed on in slices."""

from __future__ import annotations

import logging

from proxy.asgi import Send
from proxy.relay.outcome import Outcome
from proxy.upstream import Connection, UpstreamError

log = logging.getLogger("blazar.relay")

# Larger reads are handed to the client in slices of this size.
SLICE_BYTES = 64 * 1024


async def relay_body(conn: Connection, send: Send, outcome: Outcome, read_timeout_s: float) -> str | None:
    """Relay a body as it arrives; the upstream error's code if it broke."""
    try:
        while chunk := await conn.read(read_timeout_s):
            outcome.bytes_out += len(chunk)
            if len(chunk) > SLICE_BYTES:
                chunk = await send_all_but_last_slice(send, chunk, outcome)
            if conn.complete:
                await send({"type": "http.response.body", "body": chunk})
                return None
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            outcome.sends += 1
    except UpstreamError as exc:
        # Headers are out: the only honest signal left is to cut the
        # client's connection before the declared end of the body.
        conn.close()
        log.warning("upstream body broken, cutting the client's response: %s", exc)
        return exc.code
    await send({"type": "http.response.body", "body": b""})
    return None


async def send_all_but_last_slice(send: Send, chunk: bytes, outcome: Outcome) -> bytes:
    """Send a large chunk in slices, so that a slow but steady client shows progress; return the last."""
    view = memoryview(chunk)
    last = (len(chunk) - 1) // SLICE_BYTES * SLICE_BYTES
    for offset in range(0, last, SLICE_BYTES):
        await send(
            {
                "type": "http.response.body",
                "body": bytes(view[offset : offset + SLICE_BYTES]),
                "more_body": True,
            }
        )
        outcome.sends += 1
    return bytes(view[last:])
