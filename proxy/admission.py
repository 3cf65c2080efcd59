"""Admission control: a limit on requests in flight per model, and a bounded FIFO queue.

A request over the limit waits in the model's queue for a slot; a full queue
answers 429 and a wait past the queue timeout 503, both with Retry-After
(openai-python retries those by itself). Retry-After is how long the queue
needs to drain: the requests waiting × the mean time a slot is held (a
moving average of the slots released, each given its time held) / the
slots, in whole seconds from 1 to ``RETRY_AFTER_MAX_S`` (1 before any slot
was released). It costs a multiply-add per release, and is computed only
for a refusal. A slot is taken once and released
exactly once, on every path: the relay releases it in one ``finally``, and a
slot handed to a waiter that has already given up is passed on to the next.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math

from proxy.errors import HTTPError

# Retry-After's bounds, in seconds: a refusal never says "now", nor to come back much later.
RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60
# Weight of the newest time held in the moving average (about the last 10 releases count).
_SERVICE_WEIGHT = 0.1


class Admission:
    """Slots for one model. ``limit`` None means no limit (and no queue)."""

    def __init__(self, limit: int | None, *, max_queued: int = 256, queue_timeout_s: float = 60.0) -> None:
        self.limit = limit
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.in_flight = 0
        # Requests waiting for the model itself to load; bounded by max_queued too.
        self.loading = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        # Moving average of the time a slot is held (s); None until one was released with its time.
        self.service_s: float | None = None

    def __repr__(self) -> str:
        return f"<Admission {self.in_flight}/{self.limit} queued={len(self._waiters)}>"

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def retry_after_s(self) -> int:
        """Seconds until the queue has drained at the recent pace: waiting × mean time held / slots."""
        service_s, limit = self.service_s, self.limit
        if service_s is None or not limit:
            return RETRY_AFTER_MIN_S
        drain_s = (len(self._waiters) + self.loading) * service_s / limit
        return max(RETRY_AFTER_MIN_S, min(RETRY_AFTER_MAX_S, math.ceil(drain_s)))

    def _retry_after(self) -> tuple[bytes, bytes]:
        return (b"retry-after", str(self.retry_after_s()).encode())

    def try_enter(self) -> bool:
        """Take a slot if one is free and nobody is queued before us."""
        if self.limit is None or (self.in_flight < self.limit and not self._waiters):
            self.in_flight += 1
            return True
        return False

    def set_limit(self, limit: int | None) -> None:
        """A reload's new limit, applied to these same slots and queue: the requests in flight
        still count, and waiters take, in order, the slots a higher limit frees."""
        self.limit = limit
        while self._waiters and (limit is None or self.in_flight < limit):
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)

    def wait_for_load(self, model: str) -> None:
        """Count one more request waiting for the model to load, or raise 429 when too many do."""
        # The request that starts the load always may wait for it (even with
        # max_queued 0); the others share the queue's one budget.
        if self.loading and self.loading + len(self._waiters) >= self.max_queued:
            raise HTTPError(
                429,
                f"too many requests wait for model `{model}` to load ({self.max_queued}); retry shortly",
                code="queue_full",
                headers=(self._retry_after(),),
            )
        self.loading += 1

    async def enter(self, model: str) -> None:
        """Wait in the queue for a slot; raise 429 when the queue is full, 503 past the timeout."""
        if len(self._waiters) + self.loading >= self.max_queued:
            raise HTTPError(
                429,
                f"too many requests queued for model `{model}` ({self.max_queued}); retry shortly",
                code="queue_full",
                headers=(self._retry_after(),),
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await waiter
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                # The slot came just as the timer fired: keep it.
                return
            self._remove(waiter)
            raise HTTPError(
                503,
                f"model `{model}` is busy: no slot within {self.queue_timeout_s:g} s; retry shortly",
                code="queue_timeout",
                headers=(self._retry_after(),),
            ) from None
        except HTTPError:
            raise
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # Handed a slot, then cancelled (the client left): pass it on.
                self.leave()
            else:
                self._remove(waiter)
            raise

    def leave(self, held_s: float | None = None) -> None:
        """Give back a slot, held ``held_s`` (for the drain rate; None: not timed): to the first
        live waiter, else to the pool; while more are in flight than a lowered limit, to nobody."""
        if self.limit is None:
            self.in_flight -= 1
            return
        if held_s is not None:
            average = self.service_s
            self.service_s = held_s if average is None else average + (held_s - average) * _SERVICE_WEIGHT
        if self.in_flight > self.limit:
            # A reload lowered the limit: this slot is retired, not handed on.
            self.in_flight -= 1
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                # The slot moves to the waiter: in_flight is unchanged.
                waiter.set_result(None)
                return
        self.in_flight -= 1

    def fail_waiters(self, error: BaseException) -> int:
        """Turn every queued request away with ``error`` (a drain); return how many."""
        failed = 0
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)
                failed += 1
        return failed

    def _remove(self, waiter: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        if not waiter.done():
            waiter.cancel()
