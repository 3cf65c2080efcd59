"""One engine child: an OS process serving one model, and the task that owns it.

The lifecycle is a state machine (``ChildState`` and ``TRANSITIONS``) with one
writer, the owner task. Callers never read the state and then act on it: they
ask the owner (``ensure_ready``, ``stop``, ``shutdown``) and wait for what it
did. The gateway's hot path only reads ``ready`` to decide between relaying
and a 503.

    STOPPED ─start─► STARTING ─ready─► READY ─stop─► STOPPING ─exited─► STOPPED
    STARTING ─exit/timeout─► STOPPED (error kept)   READY ─crash─► STOPPED ─backoff─► STARTING
    any ─shutdown─► SHUTDOWN (final)

Readiness is a real 1-token generation, raced against the child's exit and a
deadline; then health checks watch it (``engines.probes``). The OS process
itself, started in its own session and stopped as a group, and its output
are ``engines.process``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import re
import signal
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from engines import probes
from engines.process import ChildConfig, Output, finish, last_words, settle, signal_group, spawn, terminate

log = logging.getLogger("blazar.engines")


class ChildState(enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    SHUTDOWN = "shutdown"


# The allowed moves; the owner asserts every move against this table.
TRANSITIONS: Mapping[ChildState, frozenset[ChildState]] = {
    ChildState.STOPPED: frozenset({ChildState.STARTING, ChildState.SHUTDOWN}),
    ChildState.STARTING: frozenset(
        {ChildState.READY, ChildState.STOPPED, ChildState.STOPPING, ChildState.SHUTDOWN}
    ),
    ChildState.READY: frozenset({ChildState.STOPPED, ChildState.STOPPING, ChildState.SHUTDOWN}),
    ChildState.STOPPING: frozenset({ChildState.STOPPED, ChildState.SHUTDOWN}),
    ChildState.SHUTDOWN: frozenset(),
}


class ChildFailed(RuntimeError):
    """A start attempt ended without the child becoming ready."""


class _Command(enum.Enum):
    RUN = "run"
    STOP = "stop"
    SHUTDOWN = "shutdown"


@dataclass
class _WaitEnd:
    """What ended one of the owner's waits (a start, a life), first of the things it raced.

    The readiness or health verdict, the process's exit, the deadline, a
    command; returned by ``_run_once`` as why the process's life ended.
    """

    kind: str  # "ready", "exited", "broken", "unhealthy", "timeout", "failed", "command"
    detail: str = ""
    command: _Command | None = None
    was_ready: bool = False


@dataclass
class ChildStatus:
    """A snapshot for display: never used to decide anything."""

    name: str
    state: str
    pid: int | None
    port: int
    restarts: int
    last_error: str | None
    ready_in_s: float | None
    tail: list[str] = field(default_factory=list)


class Child:
    """One supervised engine process; all state changes happen in the owner task."""

    def __init__(self, config: ChildConfig, on_ready: Callable[[Child], None] | None = None) -> None:
        self.config = config
        self.state = ChildState.STOPPED
        self.pid: int | None = None
        self.restarts = 0
        # Processes spawned, for any reason (a lazy load, a restart).
        self.starts = 0
        self.last_error: str | None = None
        # Why the last start attempt failed, without the output (None: it did not).
        self.failure: str | None = None
        # Why the process died after it had served (None once a start is ready again, or it is stopped).
        self.crash: str | None = None
        self.ready_in_s: float | None = None
        self._output = Output(config.log_path)
        self.tail = self._output.tail
        # The last failed attempt, as compared with the next (``_signature``).
        self._last_failure: tuple[str, ...] | None = None
        self._on_ready = on_ready
        self._commands: asyncio.Queue[_Command] = asyncio.Queue(maxsize=16)
        self._changed = asyncio.Condition()
        self._attempts = 0  # start attempts that have ended, ready or not
        # Whether the last attempt failed in a way another start would repeat
        # (a generation that fails the same way every time, the deadline).
        self.hopeless = False
        # Set by ``kill_now``: the gateway itself ends the process, so its exit is no crash.
        self._killed = False
        self._owner: asyncio.Task[None] | None = None
        # Told after each change of state or of its last error (the status page); never asked anything.
        self.on_change: Callable[[], None] | None = None

    def observe(self, on_change: Callable[[], None], on_line: Callable[[str], None]) -> None:
        """Be told of each change of state (``on_change``) and each line the child writes (``on_line``)."""
        self.on_change = on_change
        self._output.on_line = on_line

    def __repr__(self) -> str:
        return f"<Child {self.config.name} {self.state.name} pid={self.pid} port={self.config.port}>"

    @property
    def name(self) -> str:
        """The child's name (its model's, with the replica's index): its log file's."""
        return self.config.name

    @property
    def ready(self) -> bool:
        """Read by the relay for each request: relay, or answer 503."""
        return self.state is ChildState.READY

    def exited(self) -> bool:
        """Read by the relay after an empty reply: whether this child's process has exited or is
        exiting (its listening socket closes during the exit, before the exit is seen here)."""
        return self.state is not ChildState.READY or probes.process_exiting(self.pid)

    def status(self) -> ChildStatus:
        return ChildStatus(
            name=self.config.name,
            state=self.state.value,
            pid=self.pid,
            port=self.config.port,
            restarts=self.restarts,
            last_error=self.last_error,
            ready_in_s=self.ready_in_s,
            tail=list(self.tail)[-20:],
        )

    # -- asking the owner ---------------------------------------------------

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait, up to ``timeout_s``, for the child to be ready; whether it is.

        For requests that arrive while the child starts or restarts: they
        wait instead of failing at once (``--load-wait``).
        """
        if self.state is ChildState.READY:
            return True
        try:
            async with asyncio.timeout(timeout_s), self._changed:
                await self._changed.wait_for(lambda: self.state in (ChildState.READY, ChildState.SHUTDOWN))
        except TimeoutError:
            return False
        return self.ready

    async def ensure_ready(self, timeout_s: float | None = None, *, attempts: int = 1) -> None:
        """Start the child if needed and wait until it is ready.

        Raises ChildFailed when ``attempts`` start attempts in a row (the
        one under way counts) end without readiness, the child restarting
        with its backoff in between; at once after an attempt that another
        would only repeat (``hopeless``). TimeoutError after ``timeout_s``.
        """
        self._spawn_owner()
        ended = self._attempts
        await self._commands.put(_Command.RUN)

        def settled() -> bool:
            failed = self._attempts - ended
            return (
                self.state in (ChildState.READY, ChildState.SHUTDOWN)
                or failed >= attempts
                or (failed > 0 and self.hopeless)
            )

        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(settled)
            if self.state is not ChildState.READY:
                raise ChildFailed(self.last_error or f"child {self.config.name} is {self.state.value}")

    async def stop(self) -> None:
        """Stop the child (it may be started again) and wait until it has exited."""
        if self._owner is None:
            return
        await self._commands.put(_Command.STOP)
        async with self._changed:
            await self._changed.wait_for(lambda: self.state in (ChildState.STOPPED, ChildState.SHUTDOWN))

    async def shutdown(self) -> None:
        """Stop the child for good and wait until it has been reaped."""
        if self._owner is None:
            self.state = ChildState.SHUTDOWN
            return
        await self._commands.put(_Command.SHUTDOWN)
        await asyncio.shield(self._owner)

    def kill_now(self) -> None:
        """SIGKILL the child's process group at once, from any context (a last-resort exit).

        The owner takes the exit that follows for what it is, the gateway's
        own stop: the child is not started again, nor said to be.
        """
        self._killed = True
        if self.pid is not None:
            signal_group(self.pid, signal.SIGKILL)

    # -- the owner ----------------------------------------------------------

    def _spawn_owner(self) -> None:
        if self._owner is None:
            self._owner = asyncio.get_running_loop().create_task(
                self._own(), name=f"child:{self.config.name}"
            )

    async def _move(self, to: ChildState) -> None:
        if to not in TRANSITIONS[self.state]:
            raise AssertionError(f"child {self.config.name}: {self.state.name} → {to.name} is not allowed")
        log.debug("child %s: %s → %s", self.config.name, self.state.name, to.name)
        async with self._changed:
            self.state = to
            self._changed.notify_all()
        if self.on_change is not None:
            self.on_change()

    def output(self) -> list[str]:
        """The tail's lines written by the last process started (all it still holds of them)."""
        return self._output.latest()

    async def _attempt_ended(
        self, error: str | None, *, failure: str | None = None, hopeless: bool = False
    ) -> None:
        async with self._changed:
            self.last_error = error
            self.failure = failure if error else None
            self.hopeless = hopeless
            self._attempts += 1
            self._changed.notify_all()
        if self.on_change is not None:
            self.on_change()

    async def _own(self) -> None:
        backoff_s = self.config.backoff_initial_s
        want_running = False
        while True:
            if self._killed:
                await self._move(ChildState.SHUTDOWN)
                return
            if not want_running:
                command = await self._commands.get()
                if command is _Command.SHUTDOWN:
                    await self._move(ChildState.SHUTDOWN)
                    return
                want_running = command is _Command.RUN
                self._last_failure = None  # a new run: nothing to repeat yet
                continue
            control = asyncio.ensure_future(self._next_control())
            try:
                ended = await self._run_once(control)
            finally:
                control.cancel()
            if ended.command is _Command.SHUTDOWN:
                return
            if self._killed:
                continue  # its exit was the gateway's own doing: no restart to announce
            if ended.command is _Command.STOP:
                want_running = False
                self.crash = None
                continue
            late = control.result() if control.done() and not control.cancelled() else None
            if late is _Command.SHUTDOWN:
                # Taken from the queue while the ended process was reaped.
                await self._move(ChildState.SHUTDOWN)
                return
            if late is _Command.STOP:
                want_running = False
                continue
            if ended.was_ready:
                backoff_s = self.config.backoff_initial_s
            # Crashed, unhealthy or never ready: back off, then start again,
            # unless told otherwise meanwhile.
            self.restarts += 1
            log.warning("child %s: %s; starting again in %.1f s", self.config.name, ended.detail, backoff_s)
            interrupt = await _next_command(self._commands, backoff_s)
            if interrupt is _Command.SHUTDOWN:
                await self._move(ChildState.SHUTDOWN)
                return
            if interrupt is _Command.STOP:
                want_running = False
            backoff_s = min(backoff_s * 2, self.config.backoff_max_s)

    async def _next_control(self) -> _Command:
        """The next STOP or SHUTDOWN; RUN means nothing to a running child."""
        while True:
            command = await self._commands.get()
            if command is not _Command.RUN:
                return command

    async def _run_once(self, control: asyncio.Future[_Command]) -> _WaitEnd:
        """One life of the process: start, serve, end. Returns why it ended."""
        await self._move(ChildState.STARTING)
        self.starts += 1
        started = time.monotonic()
        try:
            proc = await spawn(self.config, self._output)
        except OSError as exc:
            detail = f"cannot start {self.config.argv[0]}: {exc}"
            await self._move(ChildState.STOPPED)
            await self._attempt_ended(detail, failure=detail)
            return _WaitEnd("failed", detail)
        self.pid = proc.pid
        drain = asyncio.ensure_future(self._output.drain(proc))
        exited = asyncio.ensure_future(proc.wait())
        try:
            ended = await _first(exited, self._readiness(), control, self.config.ready_timeout_s)
            if ended.kind == "ready":
                self.crash = None
                self.ready_in_s = time.monotonic() - started
                self._last_failure = None
                await self._move(ChildState.READY)
                await self._attempt_ended(None)
                if self._on_ready is not None:
                    self._on_ready(self)
                ended = await _first(exited, self._health(), control)
                ended.was_ready = True
                if ended.command is None:
                    # It served, then crashed or stopped answering: why, until a start is ready.
                    self.crash = f"child {self.config.name} {ended.detail}"
            elif ended.command is None:
                if ended.kind == "exited":
                    await settle(exited, drain)
                failure = ended.detail
                words = last_words(self.output(), 3)
                # A process that ends as the one before it did will end so again.
                signature = _signature(failure, words)
                repeated = ended.kind == "exited" and signature == self._last_failure
                self._last_failure = signature
                ended.detail += f"; last output: {' | '.join(words) or '(none)'}"
                await self._attempt_ended(
                    f"child {self.config.name} did not become ready: {ended.detail}",
                    failure=failure,
                    hopeless=repeated or ended.kind in ("broken", "timeout"),
                )
            else:
                await self._attempt_ended(f"child {self.config.name} was stopped before it was ready")
            if ended.command is not None:
                await self._move(ChildState.STOPPING)
            await terminate(self.config, proc, exited)
            await self._move(
                ChildState.SHUTDOWN if ended.command is _Command.SHUTDOWN else ChildState.STOPPED
            )
            return ended
        finally:
            self.pid = None
            await finish(drain)
            if not exited.done():
                exited.cancel()

    async def _readiness(self) -> _WaitEnd:
        broken = await probes.await_ready(self.config, self._note)
        return _WaitEnd("ready") if broken is None else _WaitEnd("broken", broken)

    def _note(self, answer: str) -> None:
        self.last_error = answer  # shown while the child starts

    async def _health(self) -> _WaitEnd:
        return _WaitEnd("unhealthy", await probes.watch_health(self.config, self._cpu_s))

    def _cpu_s(self) -> float | None:
        return probes.process_cpu_s(self.pid)


def _signature(failure: str, words: list[str]) -> tuple[str, ...]:
    """A failed attempt, comparable with the next: the numbers in its output (times, ports) left out."""
    return (failure, *(re.sub(r"\d+", "#", word) for word in words))


async def _first(
    exited: asyncio.Future[int],
    ready: Coroutine[Any, Any, _WaitEnd],
    command: asyncio.Future[_Command],
    timeout_s: float | None = None,
) -> _WaitEnd:
    """Race the process's exit, a watcher coroutine and the next command."""
    watcher = asyncio.ensure_future(ready)
    racing: set[asyncio.Future[Any]] = {exited, watcher, command}
    try:
        done, _ = await asyncio.wait(racing, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not watcher.done():
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    if command in done:
        return _WaitEnd("command", command=command.result())
    if exited in done:
        return _WaitEnd("exited", f"exited with code {exited.result()}")
    if watcher in done:
        return watcher.result()
    return _WaitEnd("timeout", f"not ready within {timeout_s:g} s")


async def _next_command(commands: asyncio.Queue[_Command], wait_s: float) -> _Command | None:
    """The next command if one comes within ``wait_s``, else None."""
    try:
        return await asyncio.wait_for(commands.get(), wait_s)
    except TimeoutError:
        return None
