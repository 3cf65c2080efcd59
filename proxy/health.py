"""Replica health: which replicas of a model are in rotation, passively and by active checks.

Only models served by several replicas have it; a model with one replica
keeps the plain path (a refused connection is a 503 there, as before).

What counts against a replica is only what says the server itself is
unwell, never what a request's own content can cause (a field the engine
cannot take, a prompt too long: mlx_lm.server closes the socket without a
reply on those). Passive (the relay reports, ``PeerHealth``):

- a refused or timed-out connect ejects the replica at once: no byte of a
  request was sent, so no content can have caused it; the request goes to
  another one, and the next would only fail the same way;
- a 5xx head, or a broken or missing head, counts for nothing by itself.
  It makes the replica suspect, and the gateway sends it its own test
  request (``Probe``: one token, a body known to be good, on the endpoint
  that failed). If that fails too (a 5xx, no head, no connection, no
  answer within the first-byte timeout), the server is unwell whatever it
  was sent, and is ejected; if it passes, the request was at fault and the
  replica stays. One probe at a time per replica, and none within
  ``PROBE_COOLDOWN_S`` of the last: a client that repeats a bad request
  costs the replica one 1-token generation every few seconds at most.
  The 5xx itself still reaches the client as it is.

Rejoining: a replica ejected by its probe comes back only when a probe
passes, tried every ``REJOIN_S`` (nginx's ``fail_timeout``, 10 s): its
``/health`` may well pass while its generations fail, so a passed check
does not bring it back (an engine child's new process does, below). One
ejected for its connection or its checks comes back at the next check that
passes; with checks off (``--health-interval 0``), after ``REJOIN_S`` it is
tried again, and a failure ejects it again.

Active (``HealthChecks``): every ``interval_s`` (2 s by default, HAProxy's
``inter``) each server of a set is asked ``GET /readyz`` (a gateway: 503
while draining or with nothing ready) and, once that answers 404 or 405 (an
engine has none), ``GET /health`` from then on. A 2xx passes. ``FALL``
failed checks in a row eject; one that passes brings the server back
(HAProxy's ``fall``/``rise``, with a rise of 1: a server that answers again
is wanted at once). The checks run as one task per replica set, with httpx,
off the request path.

An engine child on this host (a replica with a gate) is not asked anything
over HTTP by the checks: its manager already watches it (its exit at once,
its engine's own health route if it has one, a 1-token generation now and
then, and a restart when any fails), and its readiness is already the
replica's gate. A second poller would only disagree with the first:
llama_cpp.server has no ``/health``, and its replicas were ejected for good
4 s after they started. The manager's state feeds the replica's health
instead: a child ejected by the passive rules is back in rotation as soon as
its manager has it ready in a new process (the check task reads its start
count, in memory), else by a passing probe (ejected by its probe) or after
``REJOIN_S`` (ejected for its connection), as with checks off.
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

# An ejected replica is tried again after this long (nginx's fail_timeout): by
# its probe when its probe ejected it, else (with no active checks) by rejoining.
REJOIN_S = 10.0
# After a probe, the next is not sent before this long: a client repeating a
# bad request costs a replica one 1-token generation this often at most.
PROBE_COOLDOWN_S = 5.0
# Active checks: the default interval, the failed checks in a row that eject.
DEFAULT_INTERVAL_S = 2.0
FALL = 2


class Probe:
    """A replica's own test request: one token, a body known to be good, sent by the gateway.

    It answers whether the server can serve a request at all, whatever a
    client sent it: any answer below 500 passes (a 4xx is the server's
    own, well-formed refusal: an embeddings-only server asked for a chat,
    a key it wants); a 5xx, no head, no connection or no answer within
    ``timeout_s`` (the relay's first-byte timeout) fails.
    """

    __slots__ = ("address", "connect_timeout_s", "model", "timeout_s")

    def __init__(
        self, address: UpstreamAddress, model: str, timeout_s: float, connect_timeout_s: float
    ) -> None:
        self.address = address
        self.model = model
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s

    def body(self, target: bytes) -> dict[str, Any]:
        """The known-good request for the endpoint ``target`` names."""
        if target.endswith(b"/chat/completions"):
            return {"model": self.model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
        if target.endswith(b"/embeddings"):
            return {"model": self.model, "input": "ping"}
        return {"model": self.model, "prompt": "ping", "max_tokens": 1}

    async def run(self, target: bytes) -> str | None:
        """Send the test request to ``target``; None when it passed, else what went wrong."""
        url = f"http://{self.address.host_header.decode()}{target.decode()}"
        timeout = httpx.Timeout(self.timeout_s, connect=min(self.connect_timeout_s, self.timeout_s))
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            try:
                response = await client.post(
                    url, json=self.body(target), headers={"user-agent": "blazar-proxy replica probe"}
                )
            except httpx.HTTPError as exc:
                return _reason(exc)
        if response.status_code >= 500:
            return f"it answered {response.status_code}"
        return None


class PeerHealth:
    """One replica's place in rotation: ``up``, why not, and how often it was ejected.

    ``probe`` None (a test's replica) means a 5xx is never followed up: only
    connect failures and the active checks eject.
    """

    __slots__ = (
        "_active",
        "_by_probe",
        "_on_eject",
        "_probe",
        "_probed_at",
        "_probing",
        "_target",
        "_timer",
        "ejections",
        "name",
        "reason",
        "suspects",
        "up",
    )

    def __init__(
        self,
        name: str,
        *,
        active: bool,
        on_eject: Callable[[], None] | None = None,
        probe: Probe | None = None,
    ) -> None:
        self.name = name
        self.up = True
        self.ejections = 0
        # 5xx answers (or broken heads) seen: each made the replica suspect, none ejects by itself.
        self.suspects = 0
        self.reason = ""
        self._active = active
        self._on_eject = on_eject
        self._probe = probe
        # The probe running now (a task), when it last ended (the loop's clock), what it asks.
        self._probing: asyncio.Task[None] | None = None
        self._probed_at = -PROBE_COOLDOWN_S
        self._target = b""
        # Ejected by its probe: only a probe (or a child's new process) brings it back.
        self._by_probe = False
        self._timer: asyncio.TimerHandle | None = None

    def connect_failed(self, reason: str) -> None:
        """The replica refused or did not take a connection: out at once."""
        self.eject(reason)

    def answered(self, status: int, target: bytes) -> None:
        """A request sent to ``target`` got a 5xx head (or a broken one: pass its 502 or 504).

        That alone may be the request's own fault: the replica is suspect,
        and its probe decides (at once, unless one runs or ran within
        ``PROBE_COOLDOWN_S``).
        """
        self.suspects += 1
        if self._probe is None or self._probing is not None or not self.up:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no running loop: a test's direct call
            return
        if loop.time() < self._probed_at + PROBE_COOLDOWN_S:
            return
        self._target = target
        self._probing = loop.create_task(self._verify(status), name=f"probe {self.name}")

    async def _verify(self, status: int) -> None:
        """Probe a suspect replica: out of rotation only if its own test request fails too."""
        problem = await self._run_probe()
        if problem is None:
            log.info(
                "replica %s answered a request %s; its own test request passed: it stays", self.name, status
            )
            return
        self.eject(f"a request got {status}, and its own test request failed: {problem}", by_probe=True)

    async def _run_probe(self) -> str | None:
        assert self._probe is not None
        try:
            return await self._probe.run(self._target)
        finally:
            self._probing = None
            self._probed_at = asyncio.get_running_loop().time()

    def eject(self, reason: str, *, by_probe: bool = False) -> None:
        """Out of rotation: until a check passes (without checks, ``REJOIN_S`` later);
        ``by_probe``: until its probe passes, tried every ``REJOIN_S``."""
        self.reason = reason
        if not self.up:
            return
        self.up = False
        self._by_probe = by_probe
        self.ejections += 1
        log.warning("replica %s is out of rotation: %s", self.name, reason)
        if self._on_eject is not None:
            self._on_eject()  # its prompt cache is not to be counted on any more
        if by_probe or not self._active:
            with contextlib.suppress(RuntimeError):  # no running loop: a test's direct call
                self._timer = asyncio.get_running_loop().call_later(REJOIN_S, self._try_again)

    def _try_again(self) -> None:
        """``REJOIN_S`` after an ejection: probe again (ejected by its probe), else rejoin."""
        self._timer = None
        if self.up:
            return
        if not self._by_probe:
            self.rejoin()
        elif self._probing is None:
            self._probing = asyncio.get_running_loop().create_task(self._reprobe(), name=f"probe {self.name}")

    async def _reprobe(self) -> None:
        problem = await self._run_probe()
        if self.up:
            return  # a child's new process brought it back meanwhile
        if problem is None:
            self.rejoin()
            return
        self.reason = f"its own test request still fails: {problem}"
        self._timer = asyncio.get_running_loop().call_later(REJOIN_S, self._try_again)

    def back_in_s(self) -> float | None:
        """When an ejected replica is next tried (a probe, or rejoining), in seconds from now; None
        when that is a check's to say (the next within the check interval) or it is in rotation."""
        timer = self._timer
        if self.up or timer is None:
            return None
        return max(0.0, timer.when() - asyncio.get_running_loop().time())

    def passed(self) -> None:
        """A check passed: back in rotation, unless its probe ejected it (its generations may
        fail while its health route passes)."""
        if not self.up and not self._by_probe:
            self.rejoin()

    def rejoin(self) -> None:
        """Back in rotation."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.up:
            log.warning("replica %s is back in rotation", self.name)
        self.up = True
        self._by_probe = False

    def __repr__(self) -> str:
        state = "up" if self.up else f"out ({self.reason})"
        return f"<PeerHealth {self.name} {state} suspects={self.suspects} ejections={self.ejections}>"


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
                    replica.health.passed()
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
                    _check_set(replicas, self.interval_s),
                    name=f"health {replicas[0].health.name if replicas else key}",
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
