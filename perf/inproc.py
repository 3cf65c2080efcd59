"""`python -m perf inproc`: the Python work of one request, counted, with no socket and no other process.

The gateway's app with its defaults (access log on, to /dev/null; metrics on)
and its protocols, driven in one process: each request's bytes are fed to the
client protocol's ``data_received`` as one read, the bytes it writes upstream
are taken from a transport that keeps them, and the upstream's response is fed
to the pooled ``Connection``'s ``data_received``, as one read. No system call,
no other process on the core: what is left is the gateway's own Python work,
and the work of the C code it calls (httptools, orjson, uvloop's loop).

Four workloads, each its requests alternating between two bodies of
different lengths (as a client's requests are: a cache keyed on the request's
head would miss):

- ``json``: the matrix's ~800-byte chat request, head and body in one read (as
  wrk writes it), answered with a ~1 KB completion: the lean protocol and the
  relay's fast path;
- ``json-split``: the same, head and body in two reads (as httpx, under the
  OpenAI and Anthropic SDKs, writes them);
- ``stream``: a stream of 128 events in one read, served as a client's stream
  is: on the lean protocol, relayed from the upstream connection's callbacks
  (a build whose lean protocol declines streams gives the connection to the
  full protocol at the first, and serves the rest there, as it did);
- ``stream-task``: the same stream on the full protocol and the relay's task
  path (where a stream goes on a connection the full protocol has, and where
  one goes whose head is slower than the first heartbeat).

Each figure is measured two ways:

- ``opcodes``: bytecode instructions executed a request (``sys.settrace`` with
  opcode events, over 100 requests), and Python calls a request (a coroutine's
  or generator's resumption counts as one, as the tracer sees it). Deterministic
  within a build: it does not move with the load on a shared machine, and it
  follows the interpreted work (not that of C code).
- ``CPU µs``: the process's CPU time a request, the least of ``rounds`` rounds
  (the least is the one the machine disturbed least).

With ``--baseline DIR`` the same figures are taken of the checkout in DIR, in
its own process (this file is run with DIR's ``proxy`` on the path), and the
table shows both.

    python -m perf inproc [--baseline DIR] [--quick | --smoke]
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import orjson

WORKLOADS = ("json", "json-split", "stream", "stream-task")
_PORT = 8000
_TRACED = 100


def _chat(stream: bool, pad: str) -> bytes:
    """A chat request of about 800 bytes, as the matrix's json cells send."""
    return orjson.dumps(
        {
            "model": "m1",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant. " * 20},
                {"role": "user", "content": f"Tell me about the gateway{pad}."},
            ],
            "max_tokens": 128,
            "temperature": 0.7,
            **({"stream": True} if stream else {}),
        }
    )


def _request(body: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nUser-Agent: bench\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (_PORT, len(body), body)
    )


def _completion() -> bytes:
    body = orjson.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "m1",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "x" * 800}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30},
        }
    )
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
        b"Connection: keep-alive\r\n\r\n%b" % (len(body), body)
    )


def _event_stream(events: int = 128) -> bytes:
    """An engine's stream of ``events`` chunks and ``[DONE]``, chunked, as the fake engine writes it."""
    parts = [
        b"HTTP/1.1 200 OK\r\nDate: Thu, 03 Dec 2026 05:45:20 GMT\r\nContent-Type: text/event-stream\r\n"
        b"Cache-Control: no-cache\r\nAccess-Control-Allow-Origin: *\r\nTransfer-Encoding: chunked\r\n\r\n"
    ]
    for n in range(events):
        chunk = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "model": "m1",
            "created": 1,
            "choices": [{"index": 0, "finish_reason": None, "delta": {"content": f"tok{n} "}}],
        }
        event = b"data: %b\n\n" % orjson.dumps(chunk)
        parts.append(b"%x\r\n%b\r\n" % (len(event), event))
    done = b"data: [DONE]\n\n"
    parts.append(b"%x\r\n%b\r\n0\r\n\r\n" % (len(done), done))
    return b"".join(parts)


class _Transport:
    """A transport that keeps what is written."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.closed = False
        self.protocol: Any = None

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"sockname": ("127.0.0.1", _PORT), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def writelines(self, pieces: list[bytes]) -> None:
        self.out.append(b"".join(pieces))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol


@contextlib.contextmanager
def _access_log_to_nowhere() -> Iterator[None]:
    """The access log as the gateway configures it (``cli._configure_logging``), to /dev/null."""
    log = logging.getLogger("blazar.access")
    saved = (log.handlers[:], log.level, log.propagate)
    with open(os.devnull, "w") as sink:
        handler = logging.StreamHandler(sink)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.handlers = [handler]
        log.setLevel(logging.INFO)
        log.propagate = False
        try:
            yield
        finally:
            log.handlers, log.level, log.propagate = saved


async def _serve(workload: str) -> Callable[[], Any]:
    """The gateway in this process, and a coroutine function that runs one request of ``workload``."""
    import uvicorn

    from engines.spec import Guards
    from proxy.accesslog import AccessLog
    from proxy.app import build_app
    from proxy.browser import AllowedHosts
    from proxy.lean import server_protocol
    from proxy.metrics import Metrics
    from proxy.protocol import protocol_class
    from proxy.routing import Route, RoutingTable, UpstreamAddress
    from proxy.startup.settings import Settings
    from proxy.upstream import Connection, ConnState

    stream = workload.startswith("stream")
    route = Route(model="m1", upstream=UpstreamAddress("127.0.0.1", 9), guards=Guards())
    app = build_app(
        RoutingTable([route]),
        Settings(),
        metrics=Metrics(),
        access_log=AccessLog("text"),
        hosts=AllowedHosts([], port=_PORT),
    )
    settings = Settings()
    limits = (settings.header_timeout_s, settings.max_header_bytes, settings.body_timeout_s)
    full = workload == "stream-task"
    http: type[asyncio.Protocol] = protocol_class(*limits) if full else server_protocol(*limits)
    config = uvicorn.Config(
        app, http=http, lifespan="off", access_log=False, server_header=False, proxy_headers=False
    )
    config.load()
    server = uvicorn.Server(config)
    protocol = http(config=config, server_state=server.server_state, app_state={})  # type: ignore[call-arg]
    client = _Transport()
    protocol.connection_made(client)  # type: ignore[arg-type]
    pool = app.relay._entries["m1"].peers[0].pool
    conn = Connection()
    upstream = _Transport()
    conn.connection_made(upstream)  # type: ignore[arg-type]
    conn.state = ConnState.IDLE
    conn.idle_since = asyncio.get_running_loop().time()
    pool.put_back(conn)
    requests = [_request(_chat(stream, "")), _request(_chat(stream, ", in a few words"))]
    response = _event_stream() if stream else _completion()
    end = b"0\r\n\r\n" if stream else b""
    split = workload == "json-split"
    sleep = asyncio.sleep

    async def one() -> None:
        requests.reverse()
        if split:
            head, _, body = requests[0].partition(b"\r\n\r\n")
            (client.protocol or protocol).data_received(head + b"\r\n\r\n")
            (client.protocol or protocol).data_received(body)
        else:
            (client.protocol or protocol).data_received(requests[0])
        # A pass of the loop after each read, as a server has: whatever a build leaves for the
        # pass's end (``proxy/outbox.py``) is written in it, and every build pays for it alike.
        await sleep(0)
        while not upstream.out:
            await sleep(0)
        upstream.out.clear()
        conn.data_received(response)
        await sleep(0)
        while not (client.out and client.out[-1].endswith(end)):
            await sleep(0)
        if not client.out[0].startswith(b"HTTP/1.1 200 "):
            raise RuntimeError(f"the gateway answered {client.out[0][:200]!r}")
        if client.protocol is not None and not stream:
            raise RuntimeError(f"{workload}: the lean protocol gave the connection to the full one")
        client.out.clear()
        while not pool._idle:
            await sleep(0)

    return one


async def _repeat(one: Callable[[], Any], requests: int) -> None:
    for _ in range(requests):
        await one()


async def _traced(one: Callable[[], Any]) -> dict[str, float]:
    """Bytecode instructions and Python calls a request, over ``_TRACED`` requests."""
    counts = [0, 0]

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        # Set on each frame the tracer sees: the loop's callbacks and the coroutines' steps alike.
        frame.f_trace_opcodes = True
        if event == "opcode":
            counts[0] += 1
        elif event == "call":
            counts[1] += 1
        return tracer

    sys.settrace(tracer)
    try:
        await _repeat(one, _TRACED)
    finally:
        sys.settrace(None)
    return {"opcodes": counts[0] / _TRACED, "calls": counts[1] / _TRACED}


def _worker() -> None:
    """Serve measurements on stdin: a line ``WORKLOAD REQUESTS`` is answered with one round's CPU µs
    a request (and, the first time a workload is asked for, its opcodes and calls), as JSON."""
    import uvloop

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    served: dict[str, Callable[[], Any]] = {}
    with _access_log_to_nowhere():
        for line in sys.stdin:
            workload, requests = line.split()
            reply: dict[str, float] = {}
            one = served.get(workload)
            if one is None:
                one = served[workload] = loop.run_until_complete(_serve(workload))
                # Warm: the pool, the access log's batch, the interpreter's caches.
                loop.run_until_complete(_repeat(one, 200))
                reply = loop.run_until_complete(_traced(one))
            started = time.process_time()
            loop.run_until_complete(_repeat(one, int(requests)))
            reply["cpu_us"] = (time.process_time() - started) / int(requests) * 1e6
            sys.stdout.write(orjson.dumps(reply).decode() + "\n")
            sys.stdout.flush()


class _Worker:
    """A worker process measuring the checkout at ``root`` (its ``proxy`` first on the path)."""

    def __init__(self, root: Path, cpu: int | None, log: Path) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker"]
        if cpu is not None:
            argv = ["taskset", "-c", str(cpu), *argv]
        self.root = root
        self.log = log
        # Its stderr to a file: a pipe nobody reads would stop a worker that writes much there.
        with log.open("wb") as stderr:
            self.proc = subprocess.Popen(
                argv,
                cwd=root,
                env=dict(os.environ, PYTHONPATH=str(root)),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
            )

    def round(self, workload: str, requests: int) -> dict[str, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"%s %d\n" % (workload.encode(), requests))
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            error = self.log.read_text(errors="replace")
            raise RuntimeError(f"measuring {self.root} failed:\n{error[-3000:]}")
        figures: dict[str, float] = orjson.loads(line)
        return figures

    def close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self.proc.wait(timeout=30)


def measure(
    roots: dict[str, Path], requests: int, rounds: int, cpu: int | None, out: Path
) -> dict[str, dict[str, dict[str, float]]]:
    """Each checkout's figures for each workload: the rounds interleaved (a round of each checkout
    in turn), so that the machine's drift hits them alike; CPU µs the least of the rounds. Each
    worker's stderr goes to ``out``."""
    workers: dict[str, _Worker] = {}
    figures: dict[str, dict[str, dict[str, float]]] = {name: {} for name in roots}
    try:
        for index, (name, root) in enumerate(roots.items()):
            workers[name] = _Worker(root, cpu, out / f"inproc-worker-{index}.log")
        for _ in range(rounds):
            for workload in WORKLOADS:
                for name, worker in workers.items():
                    got = worker.round(workload, requests)
                    kept = figures[name].setdefault(workload, {"cpu_us": float("inf")})
                    kept["cpu_us"] = min(kept["cpu_us"], got.pop("cpu_us"))
                    kept.update(got)
    finally:
        for worker in workers.values():
            worker.close()
    return figures


def run_inproc(
    out: Path, *, baseline: Path | None = None, quick: bool = False, smoke: bool = False, cpu: int | None = 0
) -> str:
    """Measure this checkout (and ``baseline``), write ``inproc.md`` and ``inproc.json`` to ``out``."""
    requests, rounds = (200, 2) if smoke else (500, 10) if quick else (500, 40)
    roots = {"this checkout": Path(__file__).resolve().parent.parent}
    if baseline is not None:
        roots = {"baseline": baseline.resolve(), **roots}
    runs = measure(roots, requests, rounds, cpu, out)
    (out / "inproc.json").write_bytes(orjson.dumps(runs, option=orjson.OPT_INDENT_2))
    names = list(runs)
    lines = [
        "# The Python work of one request, in process",
        "",
        "`python -m perf inproc`: the gateway's app and protocols fed each request's bytes, no socket "
        f"(perf/inproc.py). Opcodes and calls over {_TRACED} requests; CPU µs the least of {rounds} "
        f"rounds of {requests} requests, the checkouts' rounds interleaved.",
    ]
    if baseline is not None:
        lines.append(f"Baseline: `{baseline}`.")
    # Here, not at the top: the worker runs this file with a baseline's ``perf`` on the path.
    from perf.report import request_path

    lines.append(
        "Request path: "
        + "; ".join(f"{name}: {request_path(root)}" for name, root in roots.items())
        + " (a compiled module's work is C code: no opcodes of its own)."
    )
    lines += ["", "| workload | figure | " + " | ".join(names) + (" | change |" if len(names) > 1 else "")]
    lines.append("|---|---|" + "---:|" * (len(names) + (len(names) > 1)))
    for workload in WORKLOADS:
        for figure, label in (("opcodes", "opcodes"), ("calls", "calls and resumes"), ("cpu_us", "CPU µs")):
            values = [runs[name][workload][figure] for name in names]
            row = f"| {workload} | {label} | " + " | ".join(f"{v:.1f}" for v in values) + " |"
            if len(values) > 1:
                row += f" {100 * (values[1] - values[0]) / values[0]:+.1f} % |"
            lines.append(row)
    text = "\n".join(lines) + "\n"
    (out / "inproc.md").write_text(text)
    return text


if __name__ == "__main__":
    if sys.argv[1:] != ["--worker"]:
        sys.exit("run as python -m perf inproc")
    # Run as a script: this checkout's (or the baseline's) root first on the path, and its ``proxy``
    # the one measured (not one installed elsewhere).
    sys.path.insert(0, os.getcwd())
    import proxy

    if not Path(proxy.__file__).resolve().is_relative_to(Path.cwd().resolve()):
        sys.exit(f"no gateway in {os.getcwd()}: proxy is imported from {proxy.__file__}")
    _worker()
