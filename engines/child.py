"""One engine child: an OS process serving one model, and the task that owns it.

The lifecycle is a state machine (``ChildState`` and ``TRANSITIONS``) with one
writer, the owner task. Callers never read the state and then act on it: they
ask the owner (``ensure_ready``, ``stop``, ``shutdown``) and wait for what it
did. The gateway's hot path only reads ``ready`` to decide between relaying
and a 503.

    STOPPED ─start─► STARTING ─ready─► READY ─stop─► STOPPING ─exited─► STOPPED
    STARTING ─exit/timeout─► STOPPED (error kept)   READY ─crash─► STOPPED ─backoff─► STARTING
    any ─shutdown─► SHUTDOWN (final)

A child runs in its own session (process group), with a parent-death signal
on Linux, so a gateway killed with SIGKILL leaves no orphan. Stopping is
SIGTERM to the group, a grace period, SIGKILL to the group, then reaping.
Readiness is a real 1-token generation, raced against the child's exit and a
deadline. The child's output goes to a log file and a bounded in-memory tail,
drained continuously so the child never blocks on a full pipe.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import enum
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger("blazar.engines")

_TAIL_LINES = 200
_TAIL_LINE_CHARS = 2000
_PR_SET_PDEATHSIG = 1
# Readiness generations answered with the same error this many times in a
# row (0.2 s apart) end the start: an engine whose generation thread died
# (mlx after a failed download or load) answers 404 for ever, and waiting
# out the readiness deadline would only hide why.
_SAME_FAILURES = 5
# Statuses that mean "not yet" (loading, busy), never counted as failures.
_NOT_YET = frozenset({429, 503})
# What says nothing about why a child failed: HTTP access lines (the
# readiness probe's own), traceback frames and chaining notes.
_NOISE = re.compile(
    r"^\s|^Traceback \(most recent call last\):|^(The above exception|During handling of the above)"
    r'|"(GET|POST|HEAD|PUT|DELETE|OPTIONS) \S+ HTTP/\d(\.\d)?" \d{3}'
)


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


def last_words(lines: Iterable[str], count: int) -> list[str]:
    """The last ``count`` lines of a child's output that can say why it failed.

    Blank lines, traceback frames and HTTP access lines (the probes') are
    left out: what remains are the engine's own messages and exceptions.
    """
    telling = [line.rstrip() for line in lines if line.strip() and not _NOISE.search(line)]
    return telling[-count:] if count > 0 else []


@dataclass(frozen=True, slots=True)
class ChildConfig:
    """Everything needed to run one child, resolved before it starts."""

    name: str
    served_model: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: Path
    host: str
    port: int
    log_path: Path
    ready_path: str = "/v1/chat/completions"
    ready_max_tokens: int = 1
    ready_timeout_s: float = 600.0
    health_path: str = "/health"  # "" when the engine has no health route
    health_interval_s: float = 5.0
    health_failures: int = 3
    probe_interval_s: float = 60.0
    probe_timeout_s: float = 300.0
    stop_grace_s: float = 10.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


class _Command(enum.Enum):
    RUN = "run"
    STOP = "stop"
    SHUTDOWN = "shutdown"


@dataclass
class _Outcome:
    """What ended a wait in the owner loop."""

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
        self.ready_in_s: float | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        # Lines ever added to the tail, and how many there were when the last process started.
        self._lines = 0
        self._lines_before = 0
        # The last failed attempt, as compared with the next (``_signature``).
        self._last_failure: tuple[str, ...] | None = None
        self._on_ready = on_ready
        self._commands: asyncio.Queue[_Command] = asyncio.Queue(maxsize=16)
        self._changed = asyncio.Condition()
        self._attempts = 0  # start attempts that have ended, ready or not
        # Whether the last attempt failed in a way another start would repeat
        # (a generation that fails the same way every time, the deadline).
        self.hopeless = False
        self._owner: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"<Child {self.config.name} {self.state.name} pid={self.pid} port={self.config.port}>"

    @property
    def ready(self) -> bool:
        """Read by the relay for each request: relay, or answer 503."""
        return self.state is ChildState.READY

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
        """SIGKILL the child's process group at once, from any context (a last-resort exit)."""
        if self.pid is not None:
            _signal_group(self.pid, signal.SIGKILL)

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

    def output(self) -> list[str]:
        """The tail's lines written by the last process started (all it still holds of them)."""
        count = min(self._lines - self._lines_before, len(self.tail))
        return list(self.tail)[-count:] if count > 0 else []

    async def _attempt_ended(
        self, error: str | None, *, failure: str | None = None, hopeless: bool = False
    ) -> None:
        async with self._changed:
            self.last_error = error
            self.failure = failure if error else None
            self.hopeless = hopeless
            self._attempts += 1
            self._changed.notify_all()

    async def _own(self) -> None:
        backoff_s = self.config.backoff_initial_s
        want_running = False
        while True:
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
                outcome = await self._run_once(control)
            finally:
                control.cancel()
            if outcome.command is _Command.SHUTDOWN:
                return
            if outcome.command is _Command.STOP:
                want_running = False
                continue
            late = control.result() if control.done() and not control.cancelled() else None
            if late is _Command.SHUTDOWN:
                # Taken from the queue while the ended process was reaped.
                await self._move(ChildState.SHUTDOWN)
                return
            if late is _Command.STOP:
                want_running = False
                continue
            if outcome.was_ready:
                backoff_s = self.config.backoff_initial_s
            # Crashed, unhealthy or never ready: back off, then start again,
            # unless told otherwise meanwhile.
            self.restarts += 1
            log.warning("child %s: %s; starting again in %.1f s", self.config.name, outcome.detail, backoff_s)
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

    async def _run_once(self, control: asyncio.Future[_Command]) -> _Outcome:
        """One life of the process: start, serve, end. Returns why it ended."""
        await self._move(ChildState.STARTING)
        self.starts += 1
        started = time.monotonic()
        try:
            proc = await self._spawn()
        except OSError as exc:
            detail = f"cannot start {self.config.argv[0]}: {exc}"
            await self._move(ChildState.STOPPED)
            await self._attempt_ended(detail, failure=detail)
            return _Outcome("failed", detail)
        self.pid = proc.pid
        drain = asyncio.ensure_future(self._drain(proc))
        exited = asyncio.ensure_future(proc.wait())
        try:
            outcome = await _first(exited, self._await_ready(), control, self.config.ready_timeout_s)
            if outcome.kind == "ready":
                self.ready_in_s = time.monotonic() - started
                self._last_failure = None
                await self._move(ChildState.READY)
                await self._attempt_ended(None)
                if self._on_ready is not None:
                    self._on_ready(self)
                outcome = await _first(exited, self._watch_health(), control)
                outcome.was_ready = True
            elif outcome.command is None:
                if outcome.kind == "exited":
                    await _settle(exited, drain)
                failure = outcome.detail
                words = last_words(self.output(), 3)
                # A process that ends as the one before it did will end so again.
                signature = _signature(failure, words)
                repeated = outcome.kind == "exited" and signature == self._last_failure
                self._last_failure = signature
                outcome.detail += f"; last output: {' | '.join(words) or '(none)'}"
                await self._attempt_ended(
                    f"child {self.config.name} did not become ready: {outcome.detail}",
                    failure=failure,
                    hopeless=repeated or outcome.kind in ("broken", "timeout"),
                )
            else:
                await self._attempt_ended(f"child {self.config.name} was stopped before it was ready")
            if outcome.command is not None:
                await self._move(ChildState.STOPPING)
            await self._terminate(proc, exited)
            await self._move(
                ChildState.SHUTDOWN if outcome.command is _Command.SHUTDOWN else ChildState.STOPPED
            )
            return outcome
        finally:
            self.pid = None
            await _finish(drain)
            if not exited.done():
                exited.cancel()

    async def _spawn(self) -> asyncio.subprocess.Process:
        self.config.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._lines_before = self._lines
        parent = os.getpid()
        return await asyncio.create_subprocess_exec(
            *self.config.argv,
            cwd=self.config.cwd,
            env=dict(self.config.env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=(lambda: _die_with_parent(parent)) if sys.platform == "linux" else None,
        )

    async def _drain(self, proc: asyncio.subprocess.Process) -> None:
        """Copy the child's output to its log file and the in-memory tail."""
        assert proc.stdout is not None
        with self.config.log_path.open("ab") as logfile:
            logfile.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} start pid {proc.pid}\n".encode())
            pending = b""
            while chunk := await proc.stdout.read(65536):
                logfile.write(chunk)
                logfile.flush()
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self._keep(line)
                if len(pending) > _TAIL_LINE_CHARS:
                    self._keep(pending)
                    pending = b""
            if pending:
                self._keep(pending)

    def _keep(self, line: bytes) -> None:
        self.tail.append(line[:_TAIL_LINE_CHARS].decode("utf-8", "replace"))
        self._lines += 1

    def _probe_body(self) -> dict[str, Any]:
        """A 1-token generation request, as the child's spec says to prove it works."""
        config = self.config
        body: dict[str, Any] = {"model": config.served_model, "max_tokens": config.ready_max_tokens}
        if config.ready_path.endswith("/chat/completions"):
            body["messages"] = [{"role": "user", "content": "ping"}]
        else:
            body["prompt"] = "ping"
        return body

    async def _await_ready(self) -> _Outcome:
        """Poll until a real generation answers 200."""
        config = self.config
        body = self._probe_body()
        last = "no answer yet"
        same = 0
        async with _probe_client() as client:
            while True:
                try:
                    response = await client.post(config.base_url + config.ready_path, json=body)
                    if response.status_code == 200:
                        return _Outcome("ready")
                    answer = f"readiness generation answered {response.status_code}: {response.text[:200]}"
                    same = same + 1 if answer == last else 1
                    if response.status_code in _NOT_YET:
                        same = 0
                    last = answer
                except httpx.TransportError as exc:
                    # Not listening yet, most often: never a verdict.
                    last, same = f"readiness generation failed: {exc!r}", 0
                self.last_error = last
                if same >= _SAME_FAILURES:
                    return _Outcome("broken", f"{last} ({same} times in a row, the same way)")
                await asyncio.sleep(0.2)

    async def _watch_health(self) -> _Outcome:
        """Poll the health path, and now and then a generation; return when either fails.

        /health fails after too many failures in a row (mlx answers 503 once
        its generation thread died). The generation probe catches an engine
        whose HTTP server answers while generation hangs: its deadline is
        generous, because a probe joins the engine's queue like any request.
        An empty health path means the engine has none: only the probe runs.
        """
        config = self.config
        failures = 0
        next_probe = time.monotonic() + config.probe_interval_s
        async with _probe_client(timeout_s=max(2.0, config.health_interval_s)) as client:
            while True:
                await asyncio.sleep(config.health_interval_s)
                if time.monotonic() >= next_probe:
                    problem = await self._probe_generation(client)
                    if problem:
                        return _Outcome("unhealthy", problem)
                    next_probe = time.monotonic() + config.probe_interval_s
                if not config.health_path:
                    continue  # no health route (llama_cpp.server): the probe alone watches it
                try:
                    response = await client.get(config.base_url + config.health_path)
                    problem = (
                        None if response.status_code == 200 else f"health answered {response.status_code}"
                    )
                except httpx.TransportError as exc:
                    problem = f"health check failed: {exc!r}"
                failures = failures + 1 if problem else 0
                if problem and failures >= config.health_failures:
                    return _Outcome("unhealthy", problem)

    async def _probe_generation(self, client: httpx.AsyncClient) -> str | None:
        """None if a 1-token generation answers within the probe deadline, else why not."""
        config = self.config
        try:
            response = await client.post(
                config.base_url + config.ready_path,
                json=self._probe_body(),
                timeout=httpx.Timeout(config.probe_timeout_s, connect=1.0),
            )
        except httpx.TimeoutException:
            return f"a 1-token generation did not answer within {config.probe_timeout_s:g} s"
        except httpx.TransportError as exc:
            return f"a 1-token generation failed: {exc!r}"
        if response.status_code != 200:
            return f"a 1-token generation answered {response.status_code}: {response.text[:200]}"
        return None

    async def _terminate(self, proc: asyncio.subprocess.Process, exited: asyncio.Future[int]) -> None:
        """SIGTERM the group, wait the grace period, SIGKILL the group, reap."""
        if not exited.done():
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(exited), self.config.stop_grace_s)
            except TimeoutError:
                log.warning(
                    "child %s did not exit within %.0f s; killing it",
                    self.config.name,
                    self.config.stop_grace_s,
                )
        # Whatever the leader left behind in its group goes too.
        _signal_group(proc.pid, signal.SIGKILL)
        await exited


def _signature(failure: str, words: list[str]) -> tuple[str, ...]:
    """A failed attempt, comparable with the next: the numbers in its output (times, ports) left out."""
    return (failure, *(re.sub(r"\d+", "#", word) for word in words))


async def _first(
    exited: asyncio.Future[int],
    ready: Any,
    command: asyncio.Future[_Command],
    timeout_s: float | None = None,
) -> _Outcome:
    """Race the process's exit, a watcher coroutine and the next command."""
    watcher = asyncio.ensure_future(ready)
    try:
        done, _ = await asyncio.wait(
            {exited, watcher, command}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        if not watcher.done():
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    if command in done:
        return _Outcome("command", command=command.result())
    if exited in done:
        return _Outcome("exited", f"exited with code {exited.result()}")
    if watcher in done:
        result: _Outcome = watcher.result()
        return result
    return _Outcome("timeout", f"not ready within {timeout_s:g} s")


async def _next_command(commands: asyncio.Queue[_Command], wait_s: float) -> _Command | None:
    """The next command if one comes within ``wait_s``, else None."""
    try:
        return await asyncio.wait_for(commands.get(), wait_s)
    except TimeoutError:
        return None


async def _settle(exited: asyncio.Future[int], drain: asyncio.Future[None]) -> None:
    """Give an exiting child a moment to flush its last words into the tail."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(exited), 1.0)
    if exited.done():
        with contextlib.suppress(TimeoutError, Exception):
            await asyncio.wait_for(asyncio.shield(drain), 1.0)


async def _finish(task: asyncio.Future[None]) -> None:
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await asyncio.wait_for(task, 5)


def _probe_client(timeout_s: float = 30.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        trust_env=False,
        timeout=httpx.Timeout(timeout_s, connect=1.0),
        limits=httpx.Limits(max_connections=2, max_keepalive_connections=0),
    )


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _die_with_parent(parent: int) -> None:
    """In the forked child, before exec: die when the gateway dies (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        # The gateway died between fork and prctl.
        os._exit(1)
