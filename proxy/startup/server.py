"""The server: uvicorn, with the gateway's own handling of SIGTERM and SIGINT.

uvicorn alone closes its listener at once on SIGTERM and then waits without
limit for open streams. A gateway behind a load balancer must instead:

1. turn /readyz to 503 at once, so the balancer stops sending;
2. answer new requests 503 `draining` with `Connection: close`;
3. let the requests in flight finish, up to the drain timeout;
4. end what remains with an SSE error event (or a 503 before the head);
5. shut down: stop and reap the engine children (lifespan), exit 0.

A second signal ends every exchange at once with an SSE error event (or a
503), then shuts down: the children are stopped and reaped as usual. A third
exits without waiting for anything; the children then die with the gateway
(they are sent SIGKILL), and the exit code is 130.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from proxy.app import Gateway

log = logging.getLogger("blazar.server")

# How many container objects are made, less those freed, between young collections (Python: 700).
_YOUNG_COLLECTION_EVERY = 20_000
# After the drain timeout, how long the ended exchanges get to tell their clients.
_AFTER_ABORT_S = 5.0
# After a second signal, the same, but short: the operator wants it gone.
_STOP_NOW_S = 1.0


class GatewayServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        gateway: Gateway,
        drain_timeout_s: float,
        on_hangup: Callable[[], None] | None = None,
        on_force_exit: Callable[[], None] | None = None,
        on_listening: Callable[[list[tuple[str, int]]], None] | None = None,
    ) -> None:
        super().__init__(config)
        # Told the addresses actually bound (port 0 included), once they listen.
        self.on_listening = on_listening
        self.gateway = gateway
        self.drain_timeout_s = drain_timeout_s
        self.on_hangup = on_hangup
        # Kills the children at once: a forced exit skips their orderly stop.
        self.on_force_exit = on_force_exit
        # Why the gateway stopped on its own (``fail``); None after a signal.
        self.failure: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._drain_task: asyncio.Future[None] | None = None
        self._stop_task: asyncio.Future[None] | None = None
        # The second the Date header was last written for.
        self._date_second = -1

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        if self.on_hangup is not None:
            # SIGHUP reloads the configuration (nginx's meaning), in the loop.
            self._loop.add_signal_handler(signal.SIGHUP, self.on_hangup)
        await super().startup(sockets)
        # What start-up built lives as long as the gateway: out of the
        # collector's sight, each collection visits only what requests made.
        # (A reload's first replacement of start-up objects that sit in
        # reference cycles leaves them uncollected: once, and bounded.)
        gc.collect()
        gc.freeze()
        # A request's objects are freed by their counts as it ends; a young collection every
        # 700 allocations visits instead the objects of every request still in flight, again
        # and again (at 64 in flight, most of the collector's work). Every 20,000: a young
        # generation of at most ~20,000 objects, and a tenth of the visits.
        gc.set_threshold(_YOUNG_COLLECTION_EVERY, *gc.get_threshold()[1:])
        if self.on_listening is not None and not self.should_exit:
            bound = [sock.getsockname()[:2] for server in self.servers for sock in server.sockets]
            self.on_listening(bound)

    async def on_tick(self, counter: int) -> bool:
        # uvicorn writes the Date header every tenth tick (0.1 s apart), from the clock of that
        # tick: a response's Date lagged the time it was sent by up to two seconds. Here it is
        # written at the first tick of each new second, so it lags by at most a tick.
        second = int(time.time())
        if second == self._date_second:
            return await super().on_tick(1)  # not a tenth tick: the header is left as it is
        self._date_second = second
        return await super().on_tick(0)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler only records and queues; the loop does the work.
        # Not calling uvicorn's: it would re-raise the signal at exit, and a
        # gateway that drained and reaped its children has ended cleanly (0).
        if self._loop is None:
            self.should_exit = True  # before the loop runs: nothing to drain
            return
        self._signals += 1
        if self._signals == 1:
            self._loop.call_soon_threadsafe(self._start_drain)
        elif self._signals == 2:
            # Stop now, but tell each client why and still reap the children.
            self._loop.call_soon_threadsafe(self._start_stop_now)
        else:
            self.should_exit = self.force_exit = True
            if self.on_force_exit is not None:
                # Not left to the parent-death signal, which only Linux has.
                self.on_force_exit()

    def fail(self, reason: str) -> None:
        """Stop, because what the gateway was started to serve cannot be served (in the loop)."""
        if self.failure is None:
            self.failure = reason
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # The status page's streams never end by themselves: ended first, or uvicorn would wait
        # for their connections without end.
        await self.gateway.status.close()
        await super().shutdown(sockets)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self.drain())

    def _start_stop_now(self) -> None:
        self._stop_task = asyncio.ensure_future(self.stop_now())

    async def stop_now(self) -> None:
        """End every exchange with an error its client can read, then shut down without waiting."""
        self.gateway.state.draining = True
        ended = self.gateway.relay.abort_all("the gateway was told to stop at once (a second signal)")
        log.warning("second signal: ended %d exchanges; shutting down", ended)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.gateway.state.wait_idle(), _STOP_NOW_S)
        self.should_exit = True

    async def drain(self) -> None:
        """Stop taking requests, let those in flight finish, then shut down."""
        state = self.gateway.state
        state.draining = True
        self.gateway.status.set_draining()
        log.info("draining: %d requests in flight, up to %.0f s", state.in_flight, self.drain_timeout_s)
        try:
            await asyncio.wait_for(state.wait_idle(), self.drain_timeout_s)
        except TimeoutError:
            ended = self.gateway.relay.abort_all(
                f"the gateway is shutting down and its drain time ({self.drain_timeout_s:g} s) is over"
            )
            log.warning("drain timeout: ended %d exchanges still running", ended)
            # They answer their clients (an error event, or a 503) and leave.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(state.wait_idle(), _AFTER_ABORT_S)
        self.should_exit = True
