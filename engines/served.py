"""A served model: the replicas (children) behind one model name, and when they run.

The relay sees a ``ServedModel`` as the gate of its route: ``ready`` when
any replica is ready, ``wait_ready`` to wait for (or cause) a start, and
``enter``/``leave`` around each request so that idle unloading and
least-recently-used eviction never stop a model with requests in flight.
Which replica takes a request is the relay's choice (the least busy ready
one); this object only says which replicas exist.

Whether the replicas should run is the registry's decision
(``engines.registry``): it starts always-loaded models at once and the
others on their first request, one start however many requests ask at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engines.child import Child, ChildState

if TYPE_CHECKING:
    from engines.registry import Registry


_DOWN = (ChildState.STOPPED, ChildState.SHUTDOWN)


class LoadFailed(RuntimeError):
    """A model could not be loaded; the message says why, for the client."""


@dataclass(frozen=True, slots=True)
class Lifetime:
    """When a model's children run."""

    # Started with the gateway and never unloaded for being idle or least used.
    always_loaded: bool = False
    # Unloaded after this many seconds without a request (0: never).
    ttl_s: float = 0.0


class ServedModel:
    """One model name's replicas and their usage; the gate of its route."""

    def __init__(
        self,
        name: str,
        children: Sequence[Child],
        lifetime: Lifetime = Lifetime(),
        *,
        registry: Registry | None = None,
        description: str = "",
    ) -> None:
        if not children:
            raise ValueError(f"model {name!r} needs at least one child")
        self.name = name
        self.children = tuple(children)
        self.lifetime = lifetime
        self.description = description
        self.registry = registry
        # Whether the registry wants the children running: set by load, cleared by unload.
        self.wanted = False
        self.in_flight = 0
        self.last_used = time.monotonic()
        # The lazy start under way, shared by every request that waits for it.
        self.loading: asyncio.Task[None] | None = None
        self.load_error: str | None = None
        self._idle: asyncio.Event | None = None

    def __repr__(self) -> str:
        return f"<ServedModel {self.name} {self.state} in_flight={self.in_flight}>"

    # -- read per request by the relay ----------------------------------------

    @property
    def ready(self) -> bool:
        # Not once the registry has decided to stop it: a request let in
        # between that decision and the child's move to STOPPING would be cut.
        if not self.wanted:
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
        ``timeout_s`` (``--load-wait``), as before.
        """
        if self.ready:
            return True
        if self.registry is not None and (not self.wanted or self.loading is not None):
            try:
                await self.registry.load(self)
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

    # -- for the admin endpoints ----------------------------------------------

    async def load(self) -> str | None:
        if self.registry is None:
            return f"model `{self.name}` has no registry to load it"
        try:
            await self.registry.load(self)
        except LoadFailed as exc:
            return str(exc)
        return None

    async def unload(self) -> str | None:
        if self.registry is None:
            return f"model `{self.name}` has no registry to unload it"
        return await self.registry.unload(self)

    # -- for /v1/models and the registry --------------------------------------

    @property
    def state(self) -> str:
        """``loaded`` (a replica serves), ``loading`` (one is starting), ``unloading`` or ``unloaded``.

        ``unloading``: being stopped (idle, evicted, unloaded by hand, or
        replaced), with its children still up while its last requests finish.
        """
        if self.ready:
            return "loaded"
        if self.wanted or self.loading is not None:
            return "loading"
        if self.running:
            return "unloading"
        return "unloaded"

    @property
    def running(self) -> bool:
        """Whether any child process is up or on its way (for the --max-loaded count)."""
        return self.wanted or any(
            c.state not in (ChildState.STOPPED, ChildState.SHUTDOWN) for c in self.children
        )

    @property
    def busy(self) -> bool:
        return self.in_flight > 0
