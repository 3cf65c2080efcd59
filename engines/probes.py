"""What proves a child works: the readiness generation, then its health checks.

mlx_lm.server's ``/health`` is 200 before the model loads, so a child is
ready when a real 1-token generation answers 200. Once ready, ``/health`` is
polled (when the engine has one), and a 1-token generation now and then
catches an engine whose HTTP server answers while its generation hangs.
Each watcher runs until it has a verdict; the child's owner task
(``engines.child``) races it against the process's exit and its next command.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from engines.process import ChildConfig

log = logging.getLogger("blazar.engines")

# Readiness generations answered with the same error this many times in a
# row (0.2 s apart) end the start: an engine whose generation thread died
# (mlx after a failed download or load) answers 404 for ever, and waiting
# out the readiness deadline would only hide why.
_SAME_FAILURES = 5
# Statuses that mean "not yet" (loading, busy), never counted as failures.
_NOT_YET = frozenset({429, 503})
# A generation probe that ran out of time (see watch_health for what that means).
_TIMED_OUT = "timed out"
# Probes that may time out in a row behind a child's own work before it counts as hung.
_BUSY_EXCUSES = 3
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


async def await_ready(config: ChildConfig, note: Callable[[str], None]) -> str | None:
    """Poll until a real generation answers 200 (None), or it fails the same way too often (why).

    ``note`` is told each answer that is not yet readiness, for the child's status.
    """
    body = _probe_body(config)
    last = "no answer yet"
    same = 0
    async with _probe_client() as client:
        while True:
            try:
                response = await client.post(config.base_url + config.ready_path, json=body)
                if response.status_code == 200:
                    return None
                answer = f"readiness generation answered {response.status_code}: {response.text[:200]}"
                same = same + 1 if answer == last else 1
                if response.status_code in _NOT_YET:
                    same = 0
                last = answer
            except httpx.TransportError as exc:
                # Not listening yet, most often: never a verdict.
                last, same = f"readiness generation failed: {exc!r}", 0
            note(last)
            if same >= _SAME_FAILURES:
                return f"{last} ({same} times in a row, the same way)"
            await asyncio.sleep(0.2)


async def watch_health(config: ChildConfig, cpu_s: Callable[[], float | None] = lambda: None) -> str:
    """Poll the health path, and now and then a generation; return why, when either fails.

    /health fails after too many failures in a row (mlx answers 503 once
    its generation thread died). The generation probe catches an engine
    whose HTTP server answers while generation hangs: its deadline is
    generous, because a probe joins the engine's queue like any request.
    A probe that times out while the child worked all along (``cpu_s``, its
    CPU seconds, grew by at least half the deadline) waited behind a long
    prefill, not a hang: an agent's 40 KB prompt takes minutes on a CPU, and
    a restart would kill it and every request queued behind it. That counts
    ``_BUSY_EXCUSES`` times in a row at most (an engine spinning in a loop
    is hung too). An empty health path means the engine has none: only the
    probe runs.
    """
    failures = 0
    busy = 0
    next_probe = time.monotonic() + config.probe_interval_s
    async with _probe_client(timeout_s=max(2.0, config.health_interval_s)) as client:
        while True:
            await asyncio.sleep(config.health_interval_s)
            if time.monotonic() >= next_probe:
                before = cpu_s()
                problem = await _probe_generation(config, client)
                after = cpu_s()
                if problem is _TIMED_OUT and busy < _BUSY_EXCUSES and _worked(before, after, config):
                    busy += 1
                    log.info(
                        "%s: a 1-token generation waited more than %g s behind the child's work "
                        "(it used %.0f s of CPU meanwhile): busy, not hung",
                        config.name,
                        config.probe_timeout_s,
                        (after or 0.0) - (before or 0.0),
                    )
                elif problem is _TIMED_OUT:
                    return f"a 1-token generation did not answer within {config.probe_timeout_s:g} s"
                elif problem:
                    return problem
                else:
                    busy = 0
                next_probe = time.monotonic() + config.probe_interval_s
            if not config.health_path:
                continue  # no health route: the probe alone watches it
            try:
                response = await client.get(config.base_url + config.health_path)
                problem = None if response.status_code == 200 else f"health answered {response.status_code}"
            except httpx.TransportError as exc:
                problem = f"health check failed: {exc!r}"
            failures = failures + 1 if problem else 0
            if problem and failures >= config.health_failures:
                return problem


async def _probe_generation(config: ChildConfig, client: httpx.AsyncClient) -> str | None:
    """None if a 1-token generation answers within the probe deadline, else why not."""
    try:
        response = await client.post(
            config.base_url + config.ready_path,
            json=_probe_body(config),
            timeout=httpx.Timeout(config.probe_timeout_s, connect=1.0),
        )
    except httpx.TimeoutException:
        return _TIMED_OUT
    except httpx.TransportError as exc:
        return f"a 1-token generation failed: {exc!r}"
    if response.status_code != 200:
        return f"a 1-token generation answered {response.status_code}: {response.text[:200]}"
    return None


def _worked(before: float | None, after: float | None, config: ChildConfig) -> bool:
    """Whether the child used CPU for at least half the probe's deadline while the probe waited."""
    return before is not None and after is not None and after - before >= config.probe_timeout_s / 2


def process_cpu_s(pid: int | None) -> float | None:
    """The CPU seconds (user and system) process ``pid`` has used, or None where it cannot be read."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # After the command's closing parenthesis: state is field 3, utime 14, stime 15.
    fields = stat.rsplit(b")", 1)[-1].split()
    try:
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (IndexError, ValueError):
        return None


# The kernel's flag of a task in its exit (``PF_EXITING``, include/linux/sched.h): set before its
# files (its listening socket) are closed.
_PF_EXITING = 0x4
# Where processes can be read (Linux); elsewhere ``process_exiting`` cannot tell.
_PROC = Path("/proc/self/stat").exists()


def process_exiting(pid: int | None) -> bool:
    """Whether process ``pid`` has exited or is exiting: no such process, a zombie, or one whose
    exit has begun (the kernel closes its sockets during it). False where that cannot be read
    (no ``/proc``): the caller then knows only what its own watch of the process says."""
    if pid is None:
        return True
    if not _PROC:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return True  # reaped (between the open and the read: ESRCH)
    except OSError:
        return False
    # After the command's closing parenthesis: state is field 3, flags field 9.
    fields = stat.rsplit(b")", 1)[-1].split()
    try:
        return fields[0] in (b"Z", b"X", b"x") or bool(int(fields[6]) & _PF_EXITING)
    except (IndexError, ValueError):
        return False


def _probe_body(config: ChildConfig) -> dict[str, Any]:
    """A 1-token generation request, as the child's spec says to prove it works."""
    body: dict[str, Any] = {"model": config.served_model, "max_tokens": config.ready_max_tokens}
    if config.ready_path.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": "ping"}]
    else:
        body["prompt"] = "ping"
    return body


def _probe_client(timeout_s: float = 30.0) -> httpx.AsyncClient:
    """An httpx client for probes: no environment, explicit limits, no kept connections."""
    return httpx.AsyncClient(
        trust_env=False,
        timeout=httpx.Timeout(timeout_s, connect=1.0),
        limits=httpx.Limits(max_connections=2, max_keepalive_connections=0),
    )
