"""A child's OS process: what it runs, how it is started and stopped, and its output.

A child runs in its own session (process group), with a parent-death signal
on Linux, so a gateway killed with SIGKILL leaves no orphan. Stopping is
SIGTERM to the group, a grace period, SIGKILL to the group, then reaping.
The child's output goes to a log file and a bounded in-memory tail, drained
continuously so the child never blocks on a full pipe. Nothing here decides
anything: the child's owner task (``engines.child``) does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import errno
import io
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("blazar.engines")

_TAIL_LINES = 200
_TAIL_LINE_CHARS = 2000
_PR_SET_PDEATHSIG = 1
# What says nothing about why a child failed: HTTP access lines (the
# readiness probe's own), traceback frames and chaining notes.
_NOISE = re.compile(
    r"^\s|^Traceback \(most recent call last\):|^(The above exception|During handling of the above)"
    r'|"(GET|POST|HEAD|PUT|DELETE|OPTIONS) \S+ HTTP/\d(\.\d)?" \d{3}'
)


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


def last_words(lines: Iterable[str], count: int) -> list[str]:
    """The last ``count`` lines of a child's output that can say why it failed.

    Blank lines, traceback frames and HTTP access lines (the probes') are
    left out: what remains are the engine's own messages and exceptions.
    """
    telling = [line.rstrip() for line in lines if line.strip() and not _NOISE.search(line)]
    return telling[-count:] if count > 0 else []


class Output:
    """A child's output over all its processes: the log file, and the last lines in memory."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        # Lines ever added to the tail, and how many there were when the last process started.
        self._lines = 0
        self._lines_before = 0
        # Lines the log file could not take (a full disk), over all processes.
        self.dropped_lines = 0
        # Told each line as it is kept (the status page's live log); None: nobody listens.
        self.on_line: Callable[[str], None] | None = None

    def latest(self) -> list[str]:
        """The tail's lines written by the last process started (all it still holds of them)."""
        count = min(self._lines - self._lines_before, len(self.tail))
        return list(self.tail)[-count:] if count > 0 else []

    async def drain(self, proc: asyncio.subprocess.Process) -> None:
        """Copy the process's output to the log file and the tail until it closes.

        The pipe is read to its end whatever the log file does: a line that
        cannot be written (a full disk) is dropped and counted, never left
        in the pipe, where the child would block on its next write.
        """
        assert proc.stdout is not None
        with LogFile(self.log_path) as logfile:
            logfile.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} start pid {proc.pid}\n".encode())
            pending = b""
            while chunk := await proc.stdout.read(65536):
                logfile.write(chunk)
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self._keep(line)
                if len(pending) > _TAIL_LINE_CHARS:
                    self._keep(pending)
                    pending = b""
            if pending:
                self._keep(pending)
        self.dropped_lines += logfile.dropped_lines

    def _keep(self, line: bytes) -> None:
        text = line[:_TAIL_LINE_CHARS].decode("utf-8", "replace")
        self.tail.append(text)
        self._lines += 1
        if self.on_line is not None:
            self.on_line(text)

    def process_started(self) -> None:
        """What comes next is the new process's (``latest``)."""
        self._lines_before = self._lines


class LogFile:
    """A child's log file that never fails its writer: what it cannot write is dropped and counted.

    Opened for appending, unbuffered (each write is one ``write(2)``). A write
    that fails (ENOSPC, EIO, the file gone) drops its bytes; the gateway's
    log says so once, and the first write that succeeds again is preceded by
    a line in the file saying how many lines were lost. A file that cannot
    be opened is tried again at the next write.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: io.FileIO | None = None
        self.dropped_lines = 0
        self._dropped_since = 0  # lines dropped since the last write that succeeded
        self._error: str | None = None

    def __enter__(self) -> LogFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(self, data: bytes) -> None:
        """Append ``data``, or drop and count its lines."""
        try:
            if self._file is None:
                self._file = io.FileIO(self.path, "ab")
            if self._dropped_since:
                note = f"--- {self._dropped_since} lines dropped: the log could not be written: {self._error}"
                _write_all(self._file, note.encode() + b"\n")
                log.warning(
                    "log %s can be written again; %d lines of the child's output were dropped",
                    self.path,
                    self._dropped_since,
                )
                self._dropped_since = 0
            _write_all(self._file, data)
        except OSError as exc:
            lines = data.count(b"\n") or 1
            self.dropped_lines += lines
            if not self._dropped_since:
                self._error = exc.strerror or str(exc)
                log.warning(
                    "cannot write the child's log %s (%s): dropping its lines until it can be written",
                    self.path,
                    self._error,
                )
            self._dropped_since += lines

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


def _write_all(file: io.FileIO, data: bytes) -> None:
    """Write all of ``data`` (a short write, then the error that ended it, raises OSError)."""
    view = memoryview(data)
    while view:
        written = file.write(view)
        if not written:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]


async def spawn(config: ChildConfig, output: Output) -> asyncio.subprocess.Process:
    """Start the child's process in its own session, its output to ``output`` (drain it)."""
    config.log_path.parent.mkdir(parents=True, exist_ok=True)
    output.process_started()
    parent = os.getpid()
    return await asyncio.create_subprocess_exec(
        *config.argv,
        cwd=config.cwd,
        env=dict(config.env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=(lambda: _die_with_parent(parent)) if sys.platform == "linux" else None,
    )


async def terminate(
    config: ChildConfig, proc: asyncio.subprocess.Process, exited: asyncio.Future[int]
) -> None:
    """SIGTERM the group, wait the grace period, SIGKILL the group, reap."""
    if not exited.done():
        signal_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(exited), config.stop_grace_s)
        except TimeoutError:
            log.warning("child %s did not exit within %.0f s; killing it", config.name, config.stop_grace_s)
    # Whatever the leader left behind in its group goes too.
    signal_group(proc.pid, signal.SIGKILL)
    await exited


async def settle(exited: asyncio.Future[int], drain: asyncio.Future[None]) -> None:
    """Give an exiting child a moment to flush its last words into the tail."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(exited), 1.0)
    if exited.done():
        with contextlib.suppress(TimeoutError, Exception):
            await asyncio.wait_for(asyncio.shield(drain), 1.0)


async def finish(drain: asyncio.Future[None]) -> None:
    """Let the output's drain end (the process is gone), within 5 s."""
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await asyncio.wait_for(drain, 5)


def signal_group(pid: int, sig: signal.Signals) -> None:
    """Signal the process group led by ``pid``, if it still exists."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _die_with_parent(parent: int) -> None:
    """In the forked child, before exec: die when the gateway dies (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        # The gateway died between fork and prctl.
        os._exit(1)
