"""What a client has not taken of the responses written to it, watched between requests."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

from proxy.timers import LoopTimer

logger: Final = logging.getLogger("blazar.server")


class UnsentWatch:
    """Cuts a client connection that takes none of the bytes left for it for ``stall_s``, once
    its response is written (``--send-stall``, which the relay keeps while it writes one).

    The last write of a response leaves its tail in the transport's buffer when the client is
    not reading. Nothing then waits on it: the connection waits for the next request, and its
    close (keep-alive's end, ``connection: close``, a shutdown) waits for those bytes to go, for
    ever if the client never takes them. Checked every ``stall_s`` while bytes are left: fewer
    than at the last check is progress; none taken is a stalled client, whose connection is
    aborted. While a response is under way (``busy``) the relay's own watch decides.
    """

    __slots__ = ("_busy", "_handle", "_loop", "_size", "_stall_s", "_transport")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        transport: asyncio.Transport,
        stall_s: float,
        busy: Callable[[], bool],
    ) -> None:
        self._loop = loop
        self._transport = transport
        self._stall_s = stall_s
        self._busy = busy
        self._handle: LoopTimer | None = None
        self._size = 0

    def arm(self) -> None:
        """A response is written: watch what it left, if anything, from now (what an earlier one
        left may have been taken since: its count is no measure of progress now)."""
        if not self._stall_s:
            return
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        size = self._transport.get_write_buffer_size()
        if size:
            self._size = size
            self._handle = self._loop.call_later(self._stall_s, self._check)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _check(self) -> None:
        self._handle = None
        transport = self._transport
        size = transport.get_write_buffer_size()
        if not size:
            return  # all taken
        if size < self._size or (self._busy() and not transport.is_closing()):
            # Taken in part; or a response under way, whose relay watches it: looked at again
            # (a response that ends in a close of its own, a refusal, is never "over").
            self._size = size
            self._handle = self._loop.call_later(self._stall_s, self._check)
            return
        peer = self._transport.get_extra_info("peername")
        logger.warning(
            "client %s took none of the %d bytes left for it for %g s: its connection is cut",
            f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?",
            size,
            self._stall_s,
        )
        self._transport.abort()
