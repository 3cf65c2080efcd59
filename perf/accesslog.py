"""`python -m perf accesslog`: what one access-log line costs the gateway, three ways.

The same lines, written in this process from an event loop (uvloop, as in the
gateway) to a file, as a gateway's redirected stderr is:

- ``per-line``: one ``logging`` record per line through a ``StreamHandler`` (a
  ``write`` and a flush, so a system call, each), the way ``AccessLog`` replaced;
- ``queue``: ``logging.handlers.QueueHandler`` on the loop and a
  ``QueueListener`` thread doing the writes (the stdlib's way off the loop);
- ``buffered``: ``proxy.accesslog.AccessLog`` as shipped: the fields appended to a list,
  formatted and written in one write per batch from a timer on the loop (or when
  the batch is full).

Each request of the benchmark writes one line and then yields to the loop
(``await asyncio.sleep(0)``) so timers and callbacks run as they would
between requests. Figures per line: the process's CPU (all threads, so the
listener's too) less that of the same loop writing nothing, best of three;
the time of the ``write`` call itself (the request's path); and ``write``
system calls (``/proc/self/io``). The output of every way is compared byte for
byte with the per-line one's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import logging.handlers
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import orjson

from proxy import accesslog
from proxy.accesslog import AccessLog, Clock
from proxy.asgi import Scope
from proxy.forwarded import ProxyTrust

WAYS = ("per-line", "queue", "buffered")


def _read_clock_give_fixed_time() -> int:
    """A clock's cost (``time_ns()``) with one fixed time, 2026-12-01T20:00:03.123Z."""
    time.time_ns()
    return 1_796_155_203_123_456_000


# Every way's lines carry the same time, so that their bytes can be compared.
_SAME_TIME = Clock(_read_clock_give_fixed_time)
FORMATS = ("text", "json")

SCOPE: Scope = {
    "type": "http",
    "method": "POST",
    "path": "/v1/chat/completions",
    "client": ("127.0.0.1", 51234),
    "headers": [(b"host", b"127.0.0.1:8080"), (b"content-type", b"application/json")],
}


class PerLineAccessLog:
    """The per-line access log ``AccessLog`` replaced: a ``logging`` record per line, formatted then."""

    def __init__(self, logger: logging.Logger, fmt: str = "text", clock: Clock | None = None) -> None:
        self.log = logger
        self.json = fmt == "json"
        self.client = ProxyTrust(()).client
        # The time each line now carries (the same clock as the buffered way's, to compare the bytes).
        self.clock = clock or Clock()

    def write(
        self,
        scope: Scope,
        *,
        request_id: bytes,
        model: str,
        status: int,
        bytes_out: int,
        duration_s: float,
        ttfb_s: float | None,
        overhead_s: float | None,
    ) -> None:
        if not self.log.isEnabledFor(logging.INFO):
            return
        client = self.client(scope)
        if self.json:
            line = orjson.dumps(
                {
                    "time": self.clock(),
                    "client": client,
                    "method": scope["method"],
                    "path": scope["path"],
                    "request_id": request_id.decode("latin-1"),
                    "model": model,
                    "status": status,
                    "bytes": bytes_out,
                    "duration_ms": round(duration_s * 1000, 3),
                    "ttfb_ms": round(ttfb_s * 1000, 3) if ttfb_s is not None else None,
                    "overhead_ms": round(overhead_s * 1000, 3) if overhead_s is not None else None,
                }
            ).decode()
        else:
            ttfb = f"{ttfb_s * 1000:.3f}" if ttfb_s is not None else "-"
            overhead = f"{overhead_s * 1000:.3f}" if overhead_s is not None else "-"
            line = (
                f'{client} [{self.clock()}] "{scope["method"]} {scope["path"]}" {status} {bytes_out} '
                f"{duration_s * 1000:.3f}ms ttfb={ttfb}ms overhead={overhead}ms "
                f"model={model or '-'} id={request_id.decode('latin-1')}"
            )
        self.log.info(line)


Writer = Callable[..., None]


@dataclass
class Figures:
    way: str
    fmt: str
    lines: int
    cpu_us_per_line: float
    write_us_mean: float
    write_us_max: float
    syscalls_per_1000: float | None
    output: bytes


def request(index: int) -> dict[str, object]:
    """The fields of one request's line; they vary a little, as real ones do."""
    return {
        "request_id": b"%032x" % index,
        "model": "m1" if index % 7 else "",
        "status": 200 if index % 11 else 429,
        "bytes_out": 1200 + index % 97,
        "duration_s": 0.000234 + index * 1e-9,
        "ttfb_s": 0.000123 if index % 5 else None,
        "overhead_s": 0.0000456 if index % 5 else None,
    }


def _write_syscalls() -> int | None:
    try:
        for row in Path("/proc/self/io").read_text().splitlines():
            if row.startswith("syscw:"):
                return int(row.split()[1])
    except OSError:
        pass
    return None


def _plain_handler(path: Path) -> logging.StreamHandler[TextIO]:
    """What the CLI puts on "blazar.access": the bare message, to a stream (here a file)."""
    handler: logging.StreamHandler[TextIO] = logging.StreamHandler(
        path.open("w", encoding="utf-8", errors="backslashreplace")
    )
    handler.setFormatter(logging.Formatter("%(message)s"))
    return handler


@contextlib.contextmanager
def _way(way: str, fmt: str, path: Path) -> Iterator[tuple[Writer, Callable[[], None]]]:
    """A writer for ``way`` whose lines go to ``path``, and what writes what is left."""
    handler = _plain_handler(path)
    if way == "buffered":
        logger = accesslog.log
        saved = (logger.handlers[:], logger.level, logger.propagate)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False
        buffered = AccessLog(fmt, clock=_SAME_TIME)
        try:
            yield buffered.write, buffered.flush
        finally:
            buffered.flush()
            logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]
            handler.close()
            handler.stream.close()
        return
    logger = logging.getLogger(f"blazar.perf.accesslog.{way}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    listener: logging.handlers.QueueListener | None = None
    if way == "queue":
        lines: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        logger.handlers[:] = [logging.handlers.QueueHandler(lines)]
        listener = logging.handlers.QueueListener(lines, handler)
        listener.start()
    else:
        logger.handlers[:] = [handler]
    per_line = PerLineAccessLog(logger, fmt, clock=_SAME_TIME)
    try:
        yield per_line.write, (listener.stop if listener is not None else lambda: None)
    finally:
        logger.handlers[:] = []
        handler.close()
        handler.stream.close()


async def _requests(write: Writer | None, count: int) -> tuple[float, float]:
    """``count`` requests of one line each; the total and the longest time in ``write``."""
    total = longest = 0.0
    fields = [request(i) for i in range(count)]
    clock = time.perf_counter
    for one in fields:
        if write is not None:
            started = clock()
            write(SCOPE, **one)
            spent = clock() - started
            total += spent
            longest = max(longest, spent)
        await asyncio.sleep(0)
    return total, longest


def _loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _loop_name() -> str:
    loop = _loop()
    loop.close()
    return type(loop).__module__.split(".")[0]


def _cpu_of(way: str | None, fmt: str, count: int, path: Path) -> tuple[float, float, float, int | None]:
    """CPU seconds, write-call total and max, and write system calls for one pass of ``count`` lines."""
    loop = _loop()
    try:
        if way is None:
            started, calls = time.process_time(), _write_syscalls()
            loop.run_until_complete(_requests(None, count))
            cpu_s, after = time.process_time() - started, _write_syscalls()
            return cpu_s, 0.0, 0.0, None if calls is None or after is None else after - calls
        with _way(way, fmt, path) as (write, finish):
            started, calls = time.process_time(), _write_syscalls()
            spent, longest = loop.run_until_complete(_requests(write, count))
            finish()
            cpu_s, after = time.process_time() - started, _write_syscalls()
        return cpu_s, spent, longest, None if calls is None or after is None else after - calls
    finally:
        loop.close()


def measure(way: str, fmt: str, count: int, work: Path, rounds: int = 3) -> Figures:
    """Best of ``rounds``: ``way``'s CPU per line over the empty loop's, and its other figures."""
    best: tuple[float, float, float, int | None] | None = None
    empty = min(_cpu_of(None, fmt, count, work / "empty.log")[0] for _ in range(rounds))
    path = work / f"{way}-{fmt}.log"
    for _ in range(rounds):
        result = _cpu_of(way, fmt, count, path)
        if best is None or result[0] < best[0]:
            best = result
    assert best is not None
    cpu_s, spent, longest, calls = best
    return Figures(
        way=way,
        fmt=fmt,
        lines=count,
        cpu_us_per_line=max(cpu_s - empty, 0.0) * 1e6 / count,
        write_us_mean=spent * 1e6 / count,
        write_us_max=longest * 1e6,
        syscalls_per_1000=None if calls is None else calls * 1000 / count,
        output=path.read_bytes(),
    )


def run_accesslog(out: Path, *, quick: bool = False) -> str:
    count = 2_000 if quick else 20_000
    work = out / "lines"
    work.mkdir(parents=True, exist_ok=True)
    rows = [measure(way, fmt, count, work) for fmt in FORMATS for way in WAYS]
    identical = all(
        row.output == next(r.output for r in rows if r.fmt == row.fmt and r.way == "per-line") for row in rows
    )
    lines = [
        "# The access log: what one line costs",
        "",
        f"{count} lines per pass, one per request, from a {_loop_name()} loop "
        "to a file; CPU per line is the process's (all threads) over the same loop writing nothing, "
        "best of three. `write()` is the time in the call itself, on the request's path.",
        "",
        "| way | format | CPU µs per line | write() µs, mean | write() µs, max | write syscalls per 1000 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        syscalls = "–" if row.syscalls_per_1000 is None else f"{row.syscalls_per_1000:.1f}"
        lines.append(
            f"| {row.way} | {row.fmt} | {row.cpu_us_per_line:.2f} | {row.write_us_mean:.2f} | "
            f"{row.write_us_max:.1f} | {syscalls} |"
        )
    lines += [
        "",
        f"Output byte for byte the same as per-line's, every way: {'yes' if identical else '**no**'}.",
    ]
    text = "\n".join(lines) + "\n"
    (out / "accesslog.md").write_text(text)
    return text
