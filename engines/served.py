"""A served model: the replicas (children) behind one model name, and its lifecycle.

The lifecycle is a state machine (``ModelState`` and ``TRANSITIONS``) whose
one writer is the model itself: every move goes through ``_move`` and is
asserted against the table. Callers never read the state and then act on
it; they ask (``ensure_loaded``, ``unload``, ``start``, ``stop``, ``expire``,
``retire``, ``shutdown``) and wait for what the model did. Each ask makes
its move at once, synchronously, so a model chosen to stop takes no new
request from that moment.

    UNLOADED ─load─► LOADING ─ready─► LOADED ─unload─► UNLOADING ─drained─► STOPPING ─stopped─► UNLOADED
    LOADED ─idle / evicted─► STOPPING     LOADING ─failed─► STOPPING
    LOADED ─load (restarting)─► LOADING   UNLOADING ─load / still busy─► LOADING or LOADED
    any ─retire / shutdown─► RETIRED (final)

The relay sees a ``ServedModel`` as the gate of its route: ``ready`` when
it holds its slot and a replica is ready, ``wait_ready`` to wait for (or
cause) a load, ``enter``/``leave`` around each request so that idle
unloading and eviction never stop a model with requests in flight. Which
replica takes a request is the relay's choice (the least busy ready one).

What the model cannot decide alone, whether there is room for it beside
the others (``--max-loaded``), it asks its ``Keeper`` (``engines.registry``),
given when the model is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from engines.child import Child, ChildFailed, ChildState

log = logging.getLogger("blazar.engines")

# A child's stop is SIGTERM, its grace, SIGKILL and a reap; past this, something is wrong.
_STOP_MARGIN_S = 10.0


class LoadFailed(RuntimeError):
    """A model could not be loaded; the message says why, for the client."""


class ModelState(enum.Enum):
    # No child wanted, all stopped; a request loads it.
    UNLOADED = "unloaded"
    # Holds a slot; its children are starting (a load, an eager start, or a restart waited for).
    LOADING = "loading"
    # Holds a slot; it served. A replica that crashes restarts on its own.
    LOADED = "loaded"
    # Slot given up, no new requests; waits for its requests in flight, children still up.
    UNLOADING = "unloading"
    # Slot given up; its children are being stopped. A load waits for the stop first.
    STOPPING = "stopping"
    # Out of the registry (a reload replaced or removed it, or the gateway stops); final.
    RETIRED = "retired"


S = ModelState

# The allowed moves; ``_move`` asserts every move against this table.
TRANSITIONS: Mapping[ModelState, frozenset[ModelState]] = {
    S.UNLOADED: frozenset({S.LOADING, S.RETIRED}),
    S.LOADING: frozenset({S.LOADED, S.UNLOADING, S.STOPPING, S.RETIRED}),
    S.LOADED: frozenset({S.LOADING, S.UNLOADING, S.STOPPING, S.RETIRED}),
    S.UNLOADING: frozenset({S.LOADING, S.LOADED, S.STOPPING, S.RETIRED}),
    S.STOPPING: frozenset({S.UNLOADED, S.RETIRED}),
    S.RETIRED: frozenset(),
}

# The states that hold one of the --max-loaded slots: the children are wanted running.
HOLDING = frozenset({S.LOADING, S.LOADED})


@dataclass(frozen=True, slots=True)
class Lifetime:
    """When a model's children run."""

    # Started with the gateway and never unloaded for being idle or least used.
    always_loaded: bool = False
    # Unloaded after this many seconds without a request (0: never).
    ttl_s: float = 0.0


class Keeper(Protocol):
    """What a model asks of the registry that keeps it (``engines.registry.Registry``)."""

    @property
    def unload_wait_s(self) -> float:
        """How long an unload waits for the requests in flight (``--drain-timeout``)."""
        ...

    def admit(self, model: ServedModel) -> Sequence[Awaitable[None]]:
        """Make room for ``model`` to load, synchronously, or raise ``LoadFailed`` with why not.

        Returns the stops (of the models it displaced, and any other under
        way) to wait for before its children start: their memory is not
        free until then.
        """
        ...

    def announce(self, line: str) -> None: ...


class ServedModel:
    """One model name's replicas, their usage and their lifecycle; the gate of its route."""

    def __init__(
        self,
        name: str,
        children: Sequence[Child],
        lifetime: Lifetime = Lifetime(),
        *,
        keeper: Keeper | None = None,
        description: str = "",
        engine: str = "",
        variant: str = "",
    ) -> None:
        if not children:
            raise ValueError(f"model {name!r} needs at least one child")
        self.name = name
        self.children = tuple(children)
        self.keeper = keeper
        self.description = description
        # The engine and its variant (mlx-0.32.0, cpu), for people to read.
        self.engine = engine
        self.variant = variant
        self._lifetime = lifetime
        self._state = ModelState.UNLOADED
        # Read per request: whether the state holds a slot, kept beside the state by _move.
        self._holding = False
        self.in_flight = 0
        self.last_used = time.monotonic()
        # Why the last load or start failed, for the 503 of the requests that waited.
        self.load_error: str | None = None
        # The lazy load under way, shared by every request that waits for it.
        self._loading: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._idle: asyncio.Event | None = None
        # Told after each move of the state machine (the status page); never asked anything.
        self.on_change: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return f"<ServedModel {self.name} {self._state.name} in_flight={self.in_flight}>"

    @property
    def lifecycle(self) -> ModelState:
        """The state machine's state: for tests and the registry's choices, never written outside."""
        return self._state

    @property
    def lifetime(self) -> Lifetime:
        return self._lifetime

    def _move(self, to: ModelState) -> None:
        if to not in TRANSITIONS[self._state]:
            raise AssertionError(f"model {self.name}: {self._state.name} → {to.name} is not allowed")
        log.debug("model %s: %s → %s", self.name, self._state.name, to.name)
        self._state = to
        self._holding = to in HOLDING
        if self.on_change is not None:
            self.on_change()

    # -- read per request by the relay ----------------------------------------

    @property
    def ready(self) -> bool:
        # Not once it has given up its slot: a request let in between that
        # decision and the child's move to STOPPING would be cut.
        if not self._holding:
            return False
        # Read per request: a plain loop costs less than any() over a generator.
        for child in self.children:  # noqa: SIM110
            if child.state is ChildState.READY:
                return True
        return False

    def enter(self) -> None:
        self.in_flight += 1
        self.last_used = time.monotonic()

    def leave(self) -> None:
        self.in_flight -= 1
        self.last_used = time.monotonic()
        if not self.in_flight and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout_s: float | None) -> bool:
        """Wait up to ``timeout_s`` (None: no limit) for no request in flight; whether none is."""
        try:
            async with asyncio.timeout(timeout_s):
                while self.in_flight:
                    # One event per busy spell, shared by every waiter.
                    if self._idle is None or self._idle.is_set():
                        self._idle = asyncio.Event()
                    await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait until a replica is ready; whether one is.

        An unloaded model is loaded first, and the wait is then as long as
        its start may take, not ``timeout_s``: the request caused the start.
        A loaded model that is restarting (a crash) is waited for only
        ``timeout_s`` (``--load-wait``).
        """
        if self.ready:
            return True
        if self.keeper is not None and (not self._holding or self._loading is not None):
            try:
                await self.ensure_loaded()
            except LoadFailed:
                return False
            return self.ready
        if timeout_s <= 0:
            return False
        waits = [asyncio.ensure_future(child.wait_ready(timeout_s)) for child in self.children]
        try:
            for done in asyncio.as_completed(waits):
                if await done:
                    return True
            return False
        finally:
            for wait in waits:
                wait.cancel()

    def not_ready_reason(self) -> str:
        """For the 503 a request gets when no replica is ready."""
        if self.load_error:
            return self.load_error
        return f"model `{self.name}` is loading: its engine is starting or restarting; retry shortly"

    # -- shown on /v1/models, /readyz ------------------------------------------

    @property
    def state(self) -> str:
        """``loaded`` (a replica serves), ``loading`` (one is starting), ``unloading`` or ``unloaded``.

        ``unloading``: being stopped (idle, evicted, unloaded by hand, or
        replaced), with its children still up while its last requests finish.
        """
        if self.ready:
            return "loaded"
        if self._holding or self._loading is not None:
            return "loading"
        if self.running:
            return "unloading"
        return "unloaded"

    @property
    def running(self) -> bool:
        """Whether it holds a slot or any child process is up or on its way (memory in use)."""
        return self._holding or any(
            c.state not in (ChildState.STOPPED, ChildState.SHUTDOWN) for c in self.children
        )

    @property
    def busy(self) -> bool:
        return self.in_flight > 0

    # -- loading --------------------------------------------------------------

    async def load(self) -> str | None:
        """For the admin endpoint: load and wait until it serves; None, or why it could not."""
        try:
            await self.ensure_loaded()
        except LoadFailed as exc:
            return str(exc)
        return None

    async def ensure_loaded(self) -> None:
        """Load the model, one start however many callers ask at once; ``LoadFailed`` with why not."""
        if self._loading is None:
            if self.ready:
                return
            if self.keeper is None:
                raise LoadFailed(f"model `{self.name}` has no registry to load it")
            self.load_error = None
            self._loading = asyncio.ensure_future(self._load())
            self._loading.add_done_callback(self._load_ended)
        try:
            # Shielded: one waiter giving up (its client left) must not cancel
            # the start that the others wait for.
            await asyncio.shield(self._loading)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this waiter itself is being cancelled
            self.load_error = (
                f"model `{self.name}` stopped loading: the gateway is shutting down or its "
                "configuration was reloaded; retry"
            )
            raise LoadFailed(self.load_error) from None

    def _load_ended(self, task: asyncio.Task[None]) -> None:
        if self._loading is task:
            self._loading = None

    async def _load(self) -> None:
        try:
            await self._load_once()
        except LoadFailed as exc:
            # Kept for the 503 of the requests that waited for this load.
            self.load_error = str(exc)
            raise

    async def _load_once(self) -> None:
        assert self.keeper is not None
        if self._state is S.STOPPING and self._stopping is not None:
            # Its children must be down before they start again.
            await asyncio.shield(self._stopping)
        was = self._state
        fresh = was not in HOLDING
        if fresh:
            # Room is made and the slot taken in one step, with no await.
            stops = self.keeper.admit(self)
            self._move(S.LOADING)
            await asyncio.gather(*stops)
            self.keeper.announce(f"loading model {self.name!r} ({self.description or 'engine'})")
        elif was is S.LOADED:
            self._move(S.LOADING)  # a restart, waited for
        started = time.monotonic()
        failure = await self._first_ready()
        if failure is None:
            self.last_used = time.monotonic()
            if self._state is S.LOADING:
                self._move(S.LOADED)
            if fresh:
                self.keeper.announce(f"model {self.name!r} loaded in {time.monotonic() - started:.1f} s")
            return
        reason = f"model `{self.name}` failed to load: {failure}"
        self.keeper.announce(reason)
        if self._state is S.LOADING:
            if fresh and not self.busy and not self.ready:
                # A model that was not running is not left crash-looping in the
                # background; the next request tries again. One that was
                # already loaded keeps its children's own restarts with backoff.
                await self.stop()
            elif was is not S.LOADING:
                self._move(S.LOADED)
        raise LoadFailed(reason)

    async def _first_ready(self) -> str | None:
        """Start every replica; None once one is ready, else the last failure."""
        starts_of = {asyncio.ensure_future(child.ensure_ready()): child for child in self.children}
        starts = set(starts_of)
        failure = "no replica became ready"
        try:
            while starts:
                done, starts = await asyncio.wait(starts, return_when=asyncio.FIRST_COMPLETED)
                for task, child in ((t, starts_of[t]) for t in done):
                    exc = task.exception()
                    if exc is None:
                        return None
                    failure = f"{exc} (log: {child.config.log_path})"
            return failure
        finally:
            # The others keep starting under their children's owners; only the waits end.
            for task in starts:
                task.cancel()

    def start(self, attempts: int) -> asyncio.Task[list[str | None]] | None:
        """Start every replica now (an always-loaded model), each with up to ``attempts`` tries.

        Holds its slot from this call on, with no room asked for (always-loaded
        models are counted, never displaced). The task gives each replica's
        failure (None: it became ready); if none became ready the model is
        stopped, its reason kept for its 503s. None when it already holds its
        slot or is retired: nothing to start.
        """
        if self._holding or self._state is S.RETIRED:
            return None
        if self._state is not S.STOPPING:
            self._begin_start()
        return asyncio.ensure_future(self._start(attempts))

    def _begin_start(self) -> None:
        self._move(S.LOADING)
        self.last_used = time.monotonic()

    async def _start(self, attempts: int) -> list[str | None]:
        if self._state is S.STOPPING and self._stopping is not None:
            await asyncio.shield(self._stopping)
            # Read again after the wait (a property: the type checker would keep STOPPING).
            if self.lifecycle is S.UNLOADED:
                self._begin_start()
        errors = list(await asyncio.gather(*(_start_child(child, attempts) for child in self.children)))
        if any(error is None for error in errors):
            if self._state is S.LOADING:
                self._move(S.LOADED)
            return errors
        child = self.children[-1]
        # No crash loop in the background: a request tries again (a lazy load) and gets the reason.
        self.load_error = (
            f"model `{self.name}` cannot start: {child.last_error} (log: {child.config.log_path})"
        )
        await self.stop()
        return errors

    # -- unloading ------------------------------------------------------------

    async def unload(self) -> str | None:
        """Stop the children once the requests in flight end; None, or why not.

        New requests stop entering at once. If some are still running after
        the keeper's unload wait (``--drain-timeout``), the model stays
        loaded and the reason is returned: unloading never cuts a request.
        """
        if self.keeper is None:
            return f"model `{self.name}` has no registry to unload it"
        if self._loading is not None:
            with contextlib.suppress(LoadFailed, asyncio.CancelledError):
                await asyncio.shield(self._loading)
        if not self._holding:
            return None
        was = self._state
        self._move(S.UNLOADING)
        wait_s = self.keeper.unload_wait_s
        if not await self.wait_idle(wait_s):
            if self._state is S.UNLOADING:
                self._move(was)
            return (
                f"model `{self.name}` still has {self.in_flight} requests in flight after "
                f"{wait_s:g} s; it stays loaded"
            )
        if self._state is S.RETIRED:
            return None
        if self._holding:
            return f"model `{self.name}` was asked for again while it was unloading; it stays loaded"
        # From UNLOADING; or it is being stopped already (a start that failed meanwhile).
        await self.stop()
        self.keeper.announce(f"model {self.name!r} unloaded")
        return None

    def stop(self) -> Awaitable[None]:
        """Give up the slot and take no request from now on; wait on it for the children's exit.

        One stop however many ask; a caller that stops waiting does not cancel it.
        """
        if self._stopping is None:
            if self._state in (S.UNLOADED, S.RETIRED):
                return _done()
            self._move(S.STOPPING)
            self._stopping = asyncio.ensure_future(self._stop_children())
        return asyncio.shield(self._stopping)

    async def _stop_children(self) -> None:
        try:
            async with asyncio.timeout(max(c.config.stop_grace_s for c in self.children) + _STOP_MARGIN_S):
                await asyncio.gather(*(child.stop() for child in self.children))
        except TimeoutError:
            log.error("model %s: its children did not stop in time", self.name)
        finally:
            self._stopping = None
            if self._state is S.STOPPING:
                self._move(S.UNLOADED)

    def expire(self, now: float) -> Awaitable[None] | None:
        """Stop the model if it has been idle for its TTL (and may be); the stop, or None."""
        ttl_s = self._lifetime.ttl_s
        if (
            self._state is S.LOADED
            and self._loading is None
            and ttl_s > 0
            and not self._lifetime.always_loaded
            and not self.busy
            and now - self.last_used >= ttl_s
        ):
            return self.stop()
        return None

    @property
    def evictable(self) -> bool:
        """Whether another model's load may stop this one now: loaded lazily, and idle."""
        return (
            self._state is S.LOADED
            and self._loading is None
            and not self._lifetime.always_loaded
            and not self.busy
        )

    def retune(self, lifetime: Lifetime) -> None:
        """Take a new lifetime (a reload changed only it); its children keep running."""
        self._lifetime = lifetime

    # -- the end --------------------------------------------------------------

    def retire(self) -> Awaitable[None]:
        """Stop for good (a reload replaced or removed it): new requests at once, the children
        once the requests in flight have ended (by their own timeouts)."""
        self._retire_now()
        return asyncio.ensure_future(self._retire())

    async def _retire(self) -> None:
        await self.wait_idle(None)
        await self._shutdown_children()

    async def shutdown(self) -> None:
        """Stop for good now (the gateway stops) and reap the children."""
        self._retire_now()
        await self._shutdown_children()

    def _retire_now(self) -> None:
        if self._state is not S.RETIRED:
            self._move(S.RETIRED)
        if self._loading is not None:
            self._loading.cancel()

    async def _shutdown_children(self) -> None:
        await asyncio.gather(*(child.shutdown() for child in self.children), return_exceptions=True)


async def _start_child(child: Child, attempts: int) -> str | None:
    """None once the child is ready, or why it did not become ready within its start attempts."""
    try:
        await child.ensure_ready(attempts=attempts)
    except ChildFailed as exc:
        return str(exc)
    return None


def _done() -> Awaitable[None]:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future
