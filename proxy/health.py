"""Replica health: which replicas of a model are in rotation, passively and by active checks.

Only models served by several replicas have it; a model with one replica
keeps the plain path (a refused connection is a 503 there, as before).

Passive (the relay reports, ``PeerHealth``):

- a refused or timed-out connect ejects the replica at once: the request
  never reached it and goes to another one, and the next would only fail
  the same way;
- a 5xx head (or a broken or missing head) counts against it; ``MAX_FAILS``
  in a row eject it (nginx's ``max_fails``). One 5xx is often the request's
  own fault (a prompt too long, a bad field an engine reports as 500), and
  three in a row from one replica while the others answer is the engine.
  Any answer below 500 resets the count. The 5xx itself still reaches the
  client as it is.

Rejoining: with active checks on, the next check that passes, but not
before ``REJOIN_S`` (nginx's ``fail_timeout``, 10 s) for a replica ejected
for its 5xx: its ``/health`` may well pass while its generations fail, and
it should not flap back every check. With checks off
(``--health-interval 0``), after ``REJOIN_S`` the replica is tried again,
and a failure ejects it again.

Active (``HealthChecks``): every ``interval_s`` (2 s by default, HAProxy's
``inter``) each server of a set is asked ``GET /readyz`` (a gateway: 503
while draining or with nothing ready) and, once that answers 404 or 405 (an
engine has none), ``GET /health`` from then on. A 2xx passes. ``FALL``
failed checks in a row eject; one that passes brings the server back
(HAProxy's ``fall``/``rise``, with a rise of 1: a server that answers again
is wanted at once). The checks run as one task per replica set, with httpx,
off the request path.

An engine child on this host (a replica with a gate) is not asked anything
over HTTP: its manager already watches it (its exit at once, its engine's
own health route if it has one, a 1-token generation now and then, and a
restart when any fails), and its readiness is already the replica's gate.
A second poller would only disagree with the first: llama_cpp.server has no
``/health``, and its replicas were ejected for good 4 s after they started.
The manager's state feeds the replica's health instead: a child ejected by
the passive rules is back in rotation as soon as its manager has it ready in
a new process (the check task reads its start count, in memory), else after
``REJOIN_S``, as with checks off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

import httpx

from proxy.routing import ReplicaGate, UpstreamAddress

log = logging.getLogger("blazar.health")

# 5xx answers in a row that eject a replica (nginx's max_fails is 1, with a
# fail_timeout of 10 s; an engine's 5xx is more often the request's fault).
MAX_FAILS = 3
# With no active checks, an ejected replica is tried again after this long.
REJOIN_S = 10.0
# Active checks: the default interval, the failed checks in a row that eject.
DEFAULT_INTERVAL_S = 2.0
FALL = 2


class PeerHealth:
    """One replica's place in rotation: ``up``, its 5xx count, and how often it was ejected."""

    __slots__ = (
        "_active",
        "_hold_until",
        "_on_eject",
        "_timer",
        "ejections",
        "fails",
        "name",
        "reason",
        "up",
    )

    def __init__(self, name: str, *, active: bool, on_eject: Callable[[], None] | None = None) -> None:
        self.name = name
        self.up = True
        self.fails = 0
        self.ejections = 0
        self.reason = ""
        self._active = active
        self._on_eject = on_eject
        self._timer: asyncio.TimerHandle | None = None
        # Before this (the loop's clock), a passed check does not bring it back.
        self._hold_until = 0.0

    def connect_failed(self, reason: str) -> None:
        """The replica refused or did not take a connection: out at once."""
        self.eject(reason)

    def answered(self, status: int) -> None:
        """The replica's head came with ``status`` (or a broken head: pass 502)."""
        if status < 500:
            self.fails = 0
            return
        self.fails += 1
        if self.fails >= MAX_FAILS:
            self.eject(f"{self.fails} answers of 5xx in a row", hold_s=REJOIN_S)

    def eject(self, reason: str, hold_s: float = 0.0) -> None:
        """Out of rotation until a check passes, ``hold_s`` at the earliest (without checks,
        ``REJOIN_S`` later)."""
        self.reason = reason
        if not self.up:
            return
        self.up = False
        if hold_s:
            with contextlib.suppress(RuntimeError):  # no running loop: a test's direct call
                self._hold_until = asyncio.get_running_loop().time() + hold_s
        self.ejections += 1
        log.warning("replica %s is out of rotation: %s", self.name, reason)
        if self._on_eject is not None:
            self._on_eject()  # its prompt cache is not to be counted on any more
        if not self._active:
            with contextlib.suppress(RuntimeError):  # no running loop: a test's direct call
                self._timer = asyncio.get_running_loop().call_later(REJOIN_S, self.rejoin)

    def passed(self, now: float) -> None:
        """A check passed at ``now`` (the loop's clock): back in rotation unless held."""
        if not self.up and now >= self._hold_until:
            self.rejoin()

    def rejoin(self) -> None:
        """Back in rotation."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.up:
            log.warning("replica %s is back in rotation", self.name)
        self.up = True
        self.fails = 0

    def __repr__(self) -> str:
        state = "up" if self.up else f"out ({self.reason})"
        return f"<PeerHealth {self.name} {state} fails={self.fails} ejections={self.ejections}>"


class Checked:
    """One replica as the checker sees it: where to ask, its health, its gate (engine children)."""

    __slots__ = ("address", "failed", "gate", "health", "path", "starts", "why")

    def __init__(self, address: UpstreamAddress, health: PeerHealth, gate: ReplicaGate | None) -> None:
        self.address = address
        self.health = health
        self.gate = gate
        self.path = "/readyz"
        self.failed = 0
        # What the last failed check saw (a refused connection, a status).
        self.why = ""
        # An engine child's start count when last seen: another start is a new process.
        self.starts = gate.starts if gate is not None else 0


def follow_child(replica: Checked) -> None:
    """An engine child's health from its manager's state: a new process, once ready, is back in
    rotation (whatever the old one did); nothing is asked over HTTP."""
    gate = replica.gate
    assert gate is not None
    if gate.ready and gate.starts != replica.starts:
        replica.starts = gate.starts
        replica.health.rejoin()


async def check_once(client: httpx.AsyncClient, replica: Checked) -> bool:
    """Ask one replica whether it serves; True when it does."""
    base = f"http://{replica.address.host_header.decode()}{replica.address.prefix}"
    try:
        response = await client.get(base + replica.path)
        try:
            status = response.status_code
        finally:
            await response.aclose()
        if status in (404, 405, 501) and replica.path == "/readyz":
            replica.path = "/health"  # an engine: no /readyz, but /health
            response = await client.get(base + replica.path)
            try:
                status = response.status_code
            finally:
                await response.aclose()
    except httpx.HTTPError as exc:
        replica.why = _reason(exc)
        return False
    if 200 <= status < 300:
        return True
    replica.why = f"it answered {status}"
    return False


def _reason(exc: httpx.HTTPError) -> str:
    """What a failed check met, in a few words (httpx's own text, or its kind)."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        cause = cause.__cause__ or cause.__context__
    if isinstance(exc, httpx.TimeoutException):
        return "no answer in time"
    return str(exc) or type(exc).__name__


async def _check_set(replicas: tuple[Checked, ...], interval_s: float) -> None:
    servers = tuple(r for r in replicas if r.gate is None)
    children = tuple(r for r in replicas if r.gate is not None)
    timeout = httpx.Timeout(min(interval_s, 5.0))
    limits = httpx.Limits(max_connections=max(len(servers), 1), max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        while True:
            await asyncio.sleep(interval_s)
            for child in children:
                follow_child(child)
            if not servers:
                continue
            results = await asyncio.gather(*(check_once(client, r) for r in servers))
            for replica, passed in zip(servers, results, strict=True):
                if passed:
                    replica.failed = 0
                    replica.health.passed(asyncio.get_running_loop().time())
                    continue
                replica.failed += 1
                if replica.failed >= FALL:
                    replica.health.eject(f"{replica.failed} failed checks of {replica.path} ({replica.why})")


class HealthChecks:
    """The active checks: one task per replica set, started and stopped with the gateway."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._sets: dict[Any, tuple[Checked, ...]] = {}
        self._tasks: dict[Any, asyncio.Task[None]] = {}
        self._running = False

    def watch(self, sets: Iterable[tuple[Any, tuple[Checked, ...]]]) -> None:
        """Check these sets from now on (by a key each: a reload keeps an unchanged set's task)."""
        wanted = dict(sets)
        for key in list(self._tasks):
            if key not in wanted:
                self._tasks.pop(key).cancel()
        self._sets = wanted
        if self._running:
            self._start_missing()

    def start(self) -> None:
        """Start the checks (in the event loop); nothing when the interval is 0."""
        self._running = True
        self._start_missing()

    def _start_missing(self) -> None:
        if not self.interval_s:
            return
        for key, replicas in self._sets.items():
            if key not in self._tasks:
                self._tasks[key] = asyncio.get_running_loop().create_task(
                    _check_set(replicas, self.interval_s), name=f"health {getattr(key, 'model', key)}"
                )

    async def stop(self) -> None:
        self._running = False
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
