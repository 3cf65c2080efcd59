"""Helpers the test modules share: ports, waits, processes, SSE bodies and the /events stream.

Plain functions and small classes, no fixtures. Waits are conditions with
deadlines, never fixed sleeps: the suite runs on small, busy machines.
"""

from __future__ import annotations

import asyncio
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import orjson
import pytest
import uvicorn

from proxy import compiled
from proxy.lean import server_protocol

ROOT = Path(__file__).resolve().parents[1]
# The line a gateway logs once an engine child proved itself ready: the child's pid and port.
ENGINE_READY = re.compile(r"pid (\d+), port (\d+), ready in")

T = TypeVar("T")


# -- the compiled build ----------------------------------------------------------


def replaces_calls_into(*modules: str) -> pytest.MarkDecorator:
    """For a test that counts or breaks calls into ``modules`` by replacing their functions or a
    method of their objects: compiled, a module calls another compiled module's functions directly,
    past a replacement, and a compiled class's methods cannot be replaced. Skipped where one of
    them runs compiled; ``scripts/test``'s interpreted pass runs it."""
    return pytest.mark.skipif(
        bool(compiled.COMPILED & set(modules)),
        reason=f"replaces calls into {', '.join(modules)}, compiled here: run with BLAZAR_INTERPRETED=1",
    )


# -- ports and waits -------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until(
    probe: Callable[[], T | None], what: str, timeout_s: float = 10.0, interval_s: float = 0.05
) -> T:
    """``probe``'s first truthy value, called every ``interval_s``; an AssertionError naming ``what``
    once ``timeout_s`` has passed without one."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(interval_s)


async def wait_until_async(
    probe: Callable[[], T | None], what: str, timeout_s: float = 10.0, interval_s: float = 0.02
) -> T:
    """``wait_until`` for a test on an event loop: the loop runs between the calls of ``probe``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(interval_s)


# -- processes -------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a zombie is gone for our purposes)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def terminate(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """SIGTERM a running ``proc``, SIGKILL it if it is still there after ``grace_s``, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def rss_mib(pid: int) -> float:
    """Process ``pid``'s resident memory in MiB (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# -- engine gateways ---------------------------------------------------------------


def engine_home() -> Path:
    """The BLAZAR_HOME whose installed engines and models the engine tests share (BLAZAR_TEST_HOME)."""
    return Path(os.environ.get("BLAZAR_TEST_HOME") or Path.home() / ".cache" / "blazar-test")


@dataclass
class EngineGateway:
    """A gateway process running an engine child, and the child's pid and port from its ready line."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    child_pid: int
    child_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def child_url(self) -> str:
        return f"http://127.0.0.1:{self.child_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s: a gateway stops its children first."""
        terminate(self.proc, 20)


def spawn_engine_gateway(
    args: Sequence[str],
    *,
    port: int,
    log_path: Path,
    env: Mapping[str, str],
    timeout_s: float,
    interval_s: float = 0.1,
    what: str = "gateway",
) -> EngineGateway:
    """Start `blazar-proxy ARGS` (listening on ``port``) and return it once an engine child is ready.

    A gateway that exits first, or is not ready within ``timeout_s``, is killed
    and fails with ``what`` and its log.
    """
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", *args],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + timeout_s
    while True:
        match = ENGINE_READY.search(log_path.read_text(errors="replace"))
        if match:
            return EngineGateway(proc, port, log_path, int(match.group(1)), int(match.group(2)))
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{what} did not get ready: {log_path.read_text(errors='replace')}")
        time.sleep(interval_s)


# -- responses and streams ---------------------------------------------------------


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The error object, after checking the envelope has exactly OpenAI's four keys."""
    error = response.json()["error"]
    assert isinstance(error, dict)
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def sse_events(raw: bytes) -> list[bytes]:
    """The events of an SSE body as they were sent (blank-line separated, empty ones left out)."""
    return [e for e in raw.split(b"\n\n") if e.strip()]


def named_events(payload: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, parsed data) for each event of a named-event SSE body; comments and [DONE] left out."""
    out = []
    for block in payload.replace(b"\r\n", b"\n").split(b"\n\n"):
        name, data = "", b""
        for line in block.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                data += line[5:].strip()
        if data and data != b"[DONE]":
            out.append((name, orjson.loads(data)))
    return out


class Events:
    """A ``GET /events`` stream read in a thread: each event as (name, data), in order."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._client = httpx.Client(trust_env=False, timeout=httpx.Timeout(5, read=30))
        self._response = self._client.send(
            self._client.build_request("GET", url + "/events", headers=headers), stream=True
        )
        self.status = self._response.status_code
        self.headers = self._response.headers
        self._thread = threading.Thread(target=self._read, daemon=True)
        if self.status == 200:
            self._thread.start()

    def _read(self) -> None:
        name = ""
        try:
            for line in self._response.iter_lines():
                if line.startswith("event: "):
                    name = line[len("event: ") :]
                elif line.startswith("data: "):
                    self.events.put((name, orjson.loads(line[len("data: ") :])))
        except httpx.HTTPError:
            pass
        self.events.put(("<end>", None))

    def next(self, name: str, where: Callable[[Any], bool] = lambda data: True, timeout_s: float = 10) -> Any:
        """The next event called ``name`` whose data passes ``where`` (the others are passed over)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {name} event within {timeout_s} s")
            got, data = self.events.get(timeout=left)
            if got == "<end>":
                raise AssertionError(f"the stream ended before a {name} event")
            if got == name and where(data):
                return data

    def close(self) -> None:
        self._response.close()
        self._client.close()


# -- an in-process server ---------------------------------------------------------


@asynccontextmanager
async def in_process_server(app: Any) -> AsyncIterator[int]:
    """``app`` served by uvicorn with the gateway's protocols (the lean one, then the full one), on
    a free port (yielded), in this process's loop; stopped at the end."""
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        http=server_protocol(10.0, 64 * 1024),
        lifespan="on",
        access_log=False,
        server_header=False,
        proxy_headers=False,
        log_level="critical",
    )
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn sets a flag, it has no event to wait on
        await asyncio.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task
