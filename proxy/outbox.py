"""Writes made once the event loop's pass has run its callbacks, not as each callback makes them.

A request sent upstream and an answer written to a client each wake the
process at the other end. Where that process shares the gateway's core (an
engine, a load generator, a local client), the kernel runs it at once: the
rest of the pass's callbacks, other connections' requests and answers, wait
behind it, and run after it with the caches it left. Under load a pass
brings many connections' reads. Their callbacks leave what they write
here, and the pass's work runs together; the writes then go out one after
the other, at the pass's end (a ``call_soon`` made by the first of them:
the loop's ready callbacks run once its I/O callbacks have).

Nothing waits on a write the gateway makes from a callback, so nothing else
changes: a connection's bytes go out in the order written, and anything
that would write or close a connection otherwise (a close, a hand-over to
another protocol, an abort) first sends what it left here, or drops it.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Protocol


class Sender(Protocol):
    """A connection with bytes left in the outbox."""

    def send_out(self) -> None:
        """Write what was left (nothing if it was written or dropped since)."""


class Outbox:
    """The connections of one event loop with bytes to write at the pass's end (see ``for_loop``).

    A connection leaves its bytes with itself, appends itself to ``due``, and, if ``due`` was
    empty, has the loop ``call_soon(flush)`` (done in the caller, a frame less on every request).
    """

    __slots__ = ("__weakref__", "_loop", "due", "flush")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.due: list[Sender] = []
        self.flush = self._flush

    def add(self, sender: Sender) -> None:
        """Call ``sender.send_out()`` once this pass's callbacks have run."""
        if not self.due:
            self._loop.call_soon(self.flush)
        self.due.append(sender)

    def _flush(self) -> None:
        due = self.due
        if len(due) == 1:
            due.clear()  # the pass's one write, made at once (``WRITTEN``)
            return
        senders = due[:]
        due.clear()
        for sender in senders:
            try:
                sender.send_out()
            except Exception as exc:  # as the loop's own callbacks: report it, and go on
                self._loop.call_exception_handler({"message": f"{sender!r}: write failed", "exception": exc})


class _Written:
    """In ``due`` first: the pass has made a write (its first is made at once), so the rest wait."""

    def send_out(self) -> None:
        pass


WRITTEN = _Written()

_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Outbox] = weakref.WeakKeyDictionary()


def for_loop(loop: asyncio.AbstractEventLoop) -> Outbox:
    """The outbox of ``loop`` (made on first use)."""
    outbox = _BY_LOOP.get(loop)
    if outbox is None:
        outbox = _BY_LOOP[loop] = Outbox(loop)
    return outbox
