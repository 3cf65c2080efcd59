"""Load generators: wrk for non-streamed requests, an asyncio client for streams.

wrk (Debian's package) is C and costs a few µs a request, so it is not the
bottleneck for the non-stream cells; a Lua script picks the body per request
(for the two-model mix) and prints its summary as JSON.

Streams need time to first byte and a chunk count, which wrk cannot give, so
`stream_load` is an asyncio client on uvloop with httptools' parser: C
keep-alive connections, each sending the next request when the last stream
ends. Its own CPU per request is measured and reported with every cell, so
its cost is on the record; it is the same client for every surface, so it
cancels out of the added-latency figures.
"""

from __future__ import annotations

import asyncio
import json
import resource
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httptools

_WRK_SCRIPT = """
local bodies = {%(bodies)s}
local headers = {%(headers)s}
local i = 0
request = function()
  i = i + 1
  return wrk.format("POST", "%(path)s", headers, bodies[(i %% #bodies) + 1])
end
done = function(summary, latency, requests)
  local errors = summary.errors.connect + summary.errors.read + summary.errors.write
    + summary.errors.status + summary.errors.timeout
  io.write(string.format(
    '\\nWRKJSON {"requests": %%d, "duration_us": %%d, "errors": %%d, "non2xx": %%d, '
    .. '"p50_us": %%.1f, "p90_us": %%.1f, "p99_us": %%.1f, "mean_us": %%.1f, "max_us": %%.1f}\\n',
    summary.requests, summary.duration, errors, summary.errors.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean, latency.max))
end
"""


@dataclass
class CellResult:
    """What one load run against one surface measured."""

    requests: int
    duration_s: float
    errors: int
    # None when no request finished within the run (a slow surface at high C).
    p50_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    ttfb_p50_ms: float | None = None
    ttfb_p99_ms: float | None = None
    chunks: int = 0
    client_cpu_us_per_request: float | None = None
    latencies_ms: list[float] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0


def have_wrk() -> bool:
    return shutil.which("wrk") is not None


def wrk_load(
    url: str,
    bodies: list[bytes],
    *,
    connections: int,
    duration_s: float,
    cpu: int | None,
    headers: dict[str, str] | None = None,
) -> CellResult:
    """Non-streamed POSTs with wrk (one thread) for ``duration_s``."""
    lua_bodies = ", ".join(json.dumps(b.decode()) for b in bodies)
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    lua_headers = ", ".join(f"[{json.dumps(k)}] = {json.dumps(v)}" for k, v in all_headers.items())
    path = "/" + url.split("/", 3)[3]
    script = _WRK_SCRIPT % {"bodies": lua_bodies, "headers": lua_headers, "path": path}
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as handle:
        handle.write(script)
        script_path = handle.name
    argv = [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(duration_s))}s",
        "--timeout",
        "30s",
        "-s",
        script_path,
        url,
    ]
    if cpu is not None:
        argv = ["taskset", "-c", str(cpu), *argv]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=duration_s + 60).stdout
    finally:
        Path(script_path).unlink(missing_ok=True)
    line = next(line for line in out.splitlines() if line.startswith("WRKJSON "))
    data = json.loads(line.removeprefix("WRKJSON "))
    finished = data["requests"] > 0
    return CellResult(
        requests=data["requests"],
        duration_s=data["duration_us"] / 1e6,
        errors=data["errors"],
        p50_ms=data["p50_us"] / 1000 if finished else None,
        p99_ms=data["p99_us"] / 1000 if finished else None,
        mean_ms=data["mean_us"] / 1000 if finished else None,
    )


class _StreamConn(asyncio.Protocol):
    """One keep-alive client connection that runs streamed requests back to back."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.done: asyncio.Future[None] | None = None
        self.first_data_at = 0.0
        self.chunks = 0
        self.status = 0
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(exc or ConnectionError("closed"))
        if not self.lost.done():
            self.lost.set_result(None)

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        # Events, not reads: a relay may coalesce several events in one write.
        self.chunks += body.count(b"\n\n")
        # SSE comments (": keepalive") are not the first token.
        if not self.first_data_at and b"data:" in body:
            self.first_data_at = time.perf_counter()

    def on_message_complete(self) -> None:
        self._finish(None)

    def _finish(self, exc: BaseException | None) -> None:
        if self.done is not None and not self.done.done():
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)

    async def request(self, payload: bytes) -> tuple[float, float, int, int]:
        """Send one request; (ttfb_s, total_s, body chunks, status) once its body ends."""
        assert self.transport is not None
        self.done = asyncio.get_running_loop().create_future()
        self.first_data_at = 0.0
        self.chunks = 0
        started = time.perf_counter()
        self.transport.write(payload)
        await self.done
        ended = time.perf_counter()
        first = self.first_data_at or ended
        return first - started, ended - started, self.chunks, self.status


async def _stream_load(
    host: str, port: int, payloads: list[bytes], connections: int, duration_s: float
) -> CellResult:
    loop = asyncio.get_running_loop()
    conns = []
    for _ in range(connections):
        _, conn = await loop.create_connection(_StreamConn, host, port)
        conns.append(conn)
    ttfbs: list[float] = []
    totals: list[float] = []
    counters = {"errors": 0, "chunks": 0}
    deadline = time.perf_counter() + duration_s
    usage_before = resource.getrusage(resource.RUSAGE_SELF)

    async def worker(index: int, conn: _StreamConn) -> None:
        n = index
        while time.perf_counter() < deadline:
            payload = payloads[n % len(payloads)]
            n += 1
            if conn.lost.done():
                # The server closed an idle keep-alive connection: open another.
                _, conn = await loop.create_connection(_StreamConn, host, port)
                conns.append(conn)
            try:
                ttfb, total, chunks, status = await conn.request(payload)
            except (ConnectionError, httptools.HttpParserError):
                counters["errors"] += 1
                continue
            if status != 200:
                counters["errors"] += 1
            ttfbs.append(ttfb)
            totals.append(total)
            counters["chunks"] += chunks

    started = time.perf_counter()
    await asyncio.gather(*(worker(i, c) for i, c in enumerate(conns)))
    elapsed = time.perf_counter() - started
    usage_after = resource.getrusage(resource.RUSAGE_SELF)
    for conn in conns:
        if conn.transport is not None:
            conn.transport.close()
    cpu_s = (usage_after.ru_utime - usage_before.ru_utime) + (usage_after.ru_stime - usage_before.ru_stime)
    ms = sorted(t * 1000 for t in totals)
    first = sorted(t * 1000 for t in ttfbs)
    return CellResult(
        requests=len(totals),
        duration_s=elapsed,
        errors=counters["errors"],
        p50_ms=percentile(ms, 50) if ms else None,
        p99_ms=percentile(ms, 99) if ms else None,
        mean_ms=sum(ms) / len(ms) if ms else None,
        ttfb_p50_ms=percentile(first, 50) if first else None,
        ttfb_p99_ms=percentile(first, 99) if first else None,
        chunks=counters["chunks"],
        client_cpu_us_per_request=cpu_s * 1e6 / len(totals) if totals else None,
        latencies_ms=ms,
    )


def stream_load(
    host: str,
    port: int,
    path: str,
    bodies: list[bytes],
    *,
    connections: int,
    duration_s: float,
    headers: dict[str, str] | None = None,
) -> CellResult:
    """Streamed POSTs over ``connections`` keep-alive connections for ``duration_s``."""
    import uvloop

    extra = b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in (headers or {}).items())
    payloads = [
        b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n"
        % (path.encode(), host.encode(), port, extra, len(body))
        + body
        for body in bodies
    ]
    return uvloop.run(_stream_load(host, port, payloads, connections, duration_s))


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile of an already sorted list (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = max(0, min(len(sorted_values) - 1, round(pct / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[rank]
