"""A response body relayed as it arrives, and large reads handed on in slices."""

from __future__ import annotations

import logging
from typing import Final

from proxy.relay.out import Writer
from proxy.relay.outcome import Outcome
from proxy.status import USAGE_BYTES
from proxy.upstream import Connection
from proxy.upstream_errors import UpstreamError

log: Final = logging.getLogger("blazar.relay")

# Larger reads are handed to the client in slices of this size.
SLICE_BYTES: Final = 64 * 1024


async def relay_body(conn: Connection, out: Writer, outcome: Outcome, read_timeout_s: float) -> str | None:
    """Relay a body as it arrives, after the head ``out`` holds; the upstream error's code if it broke.

    The head goes out with the first body bytes when they are already here,
    else on its own before the wait.
    """
    # The read before the last: a reply's usage may straddle two reads.
    prev = b""
    try:
        if not conn.ready and (wait := out.flush()) is not None:
            await wait
        while chunk := await conn.read(read_timeout_s):
            if len(chunk) > SLICE_BYTES:
                chunk = await write_all_but_last_slice(out, chunk, outcome)
            # Counted once handed on: a write to a client that has gone raises ClientGone.
            if conn.complete:
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
            prev = chunk
    except UpstreamError as exc:
        # Headers are out (or go out now): the only honest signal left is to
        # cut the client's connection before the declared end of the body.
        conn.close()
        log.warning("upstream body broken, cutting the client's response: %s", exc)
        if (wait := out.flush()) is not None:
            await wait
        return exc.code
    if (wait := out.write(b"", False)) is not None:
        await wait
    return None


def usage_tail(prev: bytes, last: bytes) -> bytes:
    """A response's last ``USAGE_BYTES`` from its last two reads (its usage, for the status page),
    copying no more than that."""
    if len(last) >= USAGE_BYTES:
        # bytes: a slice of a memoryview (a large read's last slice) would keep the whole read.
        return bytes(last[-USAGE_BYTES:])
    return bytes(prev[len(last) - USAGE_BYTES :]) + last


async def write_all_but_last_slice(out: Writer, chunk: bytes, outcome: Outcome) -> bytes:
    """Write a large chunk in slices, so that a slow but steady client shows progress; return the last.

    The slices written are counted in ``outcome.bytes_out``; the last is the caller's to write and count.
    """
    view = memoryview(chunk)
    last = (len(chunk) - 1) // SLICE_BYTES * SLICE_BYTES
    for offset in range(0, last, SLICE_BYTES):
        wait = out.write(bytes(view[offset : offset + SLICE_BYTES]), True)
        outcome.bytes_out += SLICE_BYTES
        if wait is not None:
            await wait
        outcome.sends += 1
    return bytes(view[last:])
