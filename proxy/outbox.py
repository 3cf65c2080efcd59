"""Writes after the first of an event loop's pass, made once the pass has run its callbacks.

A request sent upstream and an answer written to a client each wake the
process at the other end. Where that process shares the gateway's core (an
engine, a load generator, a local client), the kernel runs it at once: the
rest of the pass's callbacks, other connections' requests and answers, wait
behind it, and run after it with the caches it left. Under load a pass
brings many connections' reads. The pass's first write is made at once;
those after it are left here, so that the pass's work runs together, and go
out one after the other at the pass's end (a ``call_soon`` made by the
first: the loop's ready callbacks run once its I/O callbacks have). At one
request at a time every write is its pass's first, and nothing waits.

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

    A connection's write, where ``due`` is empty, is the pass's first: it appends ``WRITTEN`` to
    ``due``, has the loop ``call_soon(flush)`` and writes at once. Where ``due`` is not empty,
    it leaves its bytes with itself and appends itself. (Done in the connection's own code: a
    frame less on every request.)
    """

    __slots__ = ("__weakref__", "due", "flush")

    def __init__(self) -> None:
        self.due: list[Sender] = []
        self.flush = self._flush

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
                asyncio.get_running_loop().call_exception_handler(
                    {"message": f"{sender!r}: write failed", "exception": exc}
                )


class _Written:
    """In ``due`` first: the pass has made a write (its first is made at once), so the rest wait."""

    def send_out(self) -> None:
        pass


WRITTEN = _Written()

_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Outbox] = weakref.WeakKeyDictionary()


def for_loop(loop: asyncio.AbstractEventLoop) -> Outbox:
    """The outbox of ``loop`` (made on first use; it holds no reference to the loop, which a
    value of a weak-keyed dict must not, lest the loop live for ever)."""
    outbox = _BY_LOOP.get(loop)
    if outbox is None:
        outbox = _BY_LOOP[loop] = Outbox()
    return outbox
