"""Timers that may fire a tick late, on one loop timer for all of them: the request path's deadlines.

Every request used to arm three or four of the loop's own timers (the
client watch's start, the head wait, the keep-alive after the response) and
cancel them a few milliseconds later; on uvloop each costs a timer object, a
libuv handle and its close, about 4 µs a pair. Those deadlines need no
precision finer than ``TICK_S``: a client watch that starts at 60 ms instead
of 50, a keep-alive that closes 20 ms late.

Here a timer is an entry in a queue of its own delay. Deadlines of one delay
come in the order they are set, so each queue is a ``dict`` in insertion
order whose first entries are the first due; cancelling is a ``dict.pop``.
Callers use a few fixed delays (a queue that empties is dropped at the next tick).
One loop timer, armed for the earliest deadline (at least a tick ahead),
runs what is due and re-arms itself while anything is waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final, Protocol

# How late a timer may fire.
TICK_S: Final = 0.02

_Entry = tuple[float, Callable[..., object], tuple[Any, ...]]


class LoopTimer(Protocol):
    """A timer handle of the running loop (uvloop's is not an ``asyncio.TimerHandle``)."""

    def cancel(self) -> None: ...


class CoarseTimers:
    """The coarse timers of one event loop (see ``for_loop``)."""

    __slots__ = ("__weakref__", "_armed_at", "_handle", "_key", "_loop", "_queues")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # One queue per delay: key -> (deadline, callback, args), in deadline order.
        self._queues: dict[float, dict[int, _Entry]] = {}
        self._key = 0
        self._handle: LoopTimer | None = None
        self._armed_at = 0.0

    def later(self, delay_s: float, callback: Callable[..., object], *args: Any) -> int:
        """Call ``callback(*args)`` after ``delay_s`` (up to a tick late); the key to ``cancel`` it."""
        self._key = key = self._key + 1
        deadline = self._loop.time() + delay_s
        queue = self._queues.get(delay_s)
        if queue is None:
            queue = self._queues[delay_s] = {}
        queue[key] = (deadline, callback, args)
        if self._handle is None or deadline < self._armed_at:
            self._arm(deadline)
        return key

    def cancel(self, delay_s: float, key: int) -> None:
        """Cancel the timer ``later(delay_s, ...)`` returned ``key`` for (nothing if it has run)."""
        queue = self._queues.get(delay_s)
        if queue is not None:
            queue.pop(key, None)

    def pending(self) -> int:
        """How many timers wait."""
        return sum(len(queue) for queue in self._queues.values())

    def _armed(self) -> bool:
        return self._handle is not None

    def _arm(self, deadline: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        at = max(deadline, self._loop.time() + TICK_S)
        self._armed_at = at
        self._handle = self._loop.call_at(at, self._run)

    def _run(self) -> None:
        self._handle = None
        now = self._loop.time()
        due: list[tuple[dict[int, _Entry], int]] = []
        for queue in self._queues.values():
            for key, entry in queue.items():
                if entry[0] > now:
                    break
                due.append((queue, key))
        for queue, key in due:
            if key not in queue:
                continue  # cancelled by a timer that ran before it
            entry = queue.pop(key)
            try:
                entry[1](*entry[2])
            except Exception as exc:  # as the loop's own timers: report it, and go on
                self._loop.call_exception_handler(
                    {"message": f"coarse timer {entry[1]!r} failed", "exception": exc}
                )
        for delay_s in [d for d, q in self._queues.items() if not q]:
            del self._queues[delay_s]  # a delay no longer in use
        # ``_armed()``, not ``self._handle``: a callback above may have armed it since (a test of the
        # attribute here would be taken, compiled, for the None it was set to at the start).
        if self._queues and not self._armed():
            self._arm(min(next(iter(q.values()))[0] for q in self._queues.values()))


# Each loop's timers. They hold their loop (its clock, its handle), so a weak key would never
# die: a closed loop's entry is dropped when the next loop's timers are made.
_BY_LOOP: dict[asyncio.AbstractEventLoop, CoarseTimers] = {}


def for_loop(loop: asyncio.AbstractEventLoop) -> CoarseTimers:
    """The coarse timers of ``loop`` (made on first use)."""
    timers = _BY_LOOP.get(loop)
    if timers is None:
        for closed in [known for known in _BY_LOOP if known.is_closed()]:
            del _BY_LOOP[closed]
        timers = _BY_LOOP[loop] = CoarseTimers(loop)
    return timers
