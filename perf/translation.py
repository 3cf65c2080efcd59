"""`python -m perf translation`: what translating a chat stream to another API costs, beside the relay.

A request on ``/v1/messages`` or ``/v1/responses`` for an engine that serves
only chat completions is sent as a chat stream, whose events the gateway
parses and rewrites one by one (``proxy.relay.translated``); a chat stream is
relayed byte for byte (``proxy.relay.sse``). Two measures:

- **In this process** (``time.process_time``, best of three): the relay's
  own work per upstream read, ``relay_events``, against the translated
  stream's, ``respond_translated`` (parsing each event, the translator,
  writing what it returns), both driven to their end over an in-memory
  upstream (one read per event, as mlx_lm.server writes them) and a writer
  that drops the bytes. The coroutines are stepped by hand (no event loop):
  every ``await`` in them returns at once here, and the loop's cost per read
  is the same for both paths. The non-stream replies (a translator fed
  the whole stream, then ``reply()``) per request, beside chat's own built
  reply (``proxy.assembly``) from the same stream.
- **End to end** (real sockets): the fake engine behind the gateway with its
  defaults, streams of 128 chunks on each API at C=1 and C=16, interleaved
  round by round, the load generator reading every stream to its end. The
  gateway's CPU (its ``/proc`` schedstat) per request and per engine chunk,
  and req/s, each as a ratio to chat's in the same round.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from pathlib import Path
from typing import Any, cast

import httpx
import orjson

from perf import report, surfaces
from perf.assembly import cpu_per_request_s, mlx_stream
from perf.loadgen import stream_load
from proxy.asgi import Message
from proxy.endpoints import CHAT, MESSAGES, RESPONSES_API, Endpoint
from proxy.relay.outcome import Outcome
from proxy.relay.sse import relay_events
from proxy.relay.translated import ChatEvents, respond_translated
from proxy.upstream import Connection

TOKENS = (16, 128, 512, 2048)
# The translated APIs, by the name the report gives them.
APIS: dict[str, Endpoint] = {"messages": MESSAGES, "responses": RESPONSES_API}
# The engine's chunks per streamed request, end to end.
E2E_CHUNKS = 128
# Each API's request, as its client sends it, for a stream of E2E_CHUNKS tokens.
_PROMPT = "Tell me about the gateway."
_MESSAGE = {"role": "user", "content": _PROMPT}
E2E_REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "/v1/chat/completions",
        {"model": "m1", "stream": True, "max_tokens": 128, "messages": [_MESSAGE]},
    ),
    "messages": (
        "/v1/messages",
        {"model": "m1", "stream": True, "max_tokens": 128, "messages": [_MESSAGE]},
    ),
    "responses": (
        "/v1/responses",
        {"model": "m1", "stream": True, "max_output_tokens": 128, "input": _PROMPT},
    ),
}
# The event a whole stream of each API ends with (the fake's streams stop at their length).
_LAST_EVENT: dict[str, tuple[bytes, ...]] = {
    "chat": (b"data: [DONE]",),
    "messages": (b"event: message_stop",),
    "responses": (b"event: response.completed", b"event: response.incomplete"),
}


class Upstream:
    """Stands in for ``proxy.upstream.Connection``: the prepared reads, then b"" (a chunked body's end)."""

    __slots__ = ("_at", "_reads", "close_delimited")

    def __init__(self, reads: list[bytes]) -> None:
        self._reads = reads
        self._at = 0
        self.close_delimited = False

    @property
    def ready(self) -> bool:
        return True

    @property
    def complete(self) -> bool:
        return self._at >= len(self._reads)

    async def read(self, timeout_s: float) -> bytes:
        at = self._at
        if at >= len(self._reads):
            return b""
        self._at = at + 1
        return self._reads[at]

    def close(self) -> None:
        pass


class NullWriter:
    """A client that takes every write at once and keeps nothing."""

    __slots__ = ()

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        pass

    def flush(self) -> Awaitable[None] | None:
        return None

    def write(self, body: bytes, more: bool) -> Awaitable[None] | None:
        return None


class KeptWriter(NullWriter):
    """A client that keeps what it is written (to check what was measured)."""

    __slots__ = ("body",)

    def __init__(self) -> None:
        self.body = bytearray()

    def write(self, body: bytes, more: bool) -> Awaitable[None] | None:
        self.body += body
        return None


async def _asgi_send(message: Message) -> None:
    return None


def _scope(writer: NullWriter) -> dict[str, Any]:
    """A request scope whose server offers ``writer`` as its own (``proxy.relay.out.writer_for``)."""
    return {"extensions": {"blazar.writer": lambda send: writer}}


def drive(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never waits (each await returns at once) to its end, without a loop."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("the coroutine waited: something in it was not ready")


def relay_once(reads: list[bytes], writer: NullWriter) -> Outcome:
    """One chat stream relayed byte for byte by ``relay_events``."""
    outcome = Outcome(b"0123456789abcdef", CHAT)
    drive(relay_events(cast(Connection, Upstream(reads)), writer, outcome, 60.0))
    return outcome


def translate_once(api: str, reads: list[bytes], writer: NullWriter, *, stream: bool = True) -> Outcome:
    """One chat stream answered in ``api`` by ``respond_translated`` (a stream, or the built reply)."""
    endpoint = APIS[api]
    assert endpoint.translate is not None
    outcome = Outcome(b"0123456789abcdef", endpoint)
    doc = dict(E2E_REQUESTS[api][1], stream=stream)
    outcome.translator = endpoint.translate(doc)
    scope = _scope(writer)
    drive(respond_translated(cast(Connection, Upstream(reads)), scope, _asgi_send, outcome, 0.0, 60.0))
    return outcome


def parse_once(reads: list[bytes]) -> int:
    """The translated path's parsing alone: each read's events as dicts (``ChatEvents``)."""
    events = ChatEvents()
    parsed = 0
    for chunk in reads:
        parsed += len(events.feed(chunk))
    return parsed


def best_cpu_s(once: Callable[[], object], repeat: int) -> float:
    """The best of three: CPU seconds per call of ``once``."""
    best = float("inf")
    for _ in range(3):
        started = time.process_time()
        for _ in range(repeat):
            once()
        best = min(best, (time.process_time() - started) / repeat)
    return best


def in_process(*, events_per_trial: int) -> list[dict[str, Any]]:
    """CPU per event and per request of each path, for each stream length."""
    rows = []
    writer = NullWriter()
    for tokens in TOKENS:
        reads = mlx_stream(tokens)
        # The whole stream in one read, as a stream written without delay arrives end to end.
        whole = [b"".join(reads)]
        repeat = max(3, events_per_trial // len(reads))
        row: dict[str, Any] = {"tokens": tokens, "reads": len(reads), "repeat": repeat}
        row["relay_us"] = best_cpu_s(partial(relay_once, reads, writer), repeat) * 1e6
        row["parse_us"] = best_cpu_s(partial(parse_once, reads), repeat) * 1e6
        for api in APIS:
            row[f"{api}_us"] = best_cpu_s(partial(translate_once, api, reads, writer), repeat) * 1e6
            reply = partial(translate_once, api, reads, writer, stream=False)
            row[f"{api}_reply_us"] = best_cpu_s(reply, repeat) * 1e6
        row["chat_reply_us"] = cpu_per_request_s(reads, repeat) * 1e6
        row["relay_whole_us"] = best_cpu_s(partial(relay_once, whole, writer), repeat) * 1e6
        for api in APIS:
            row[f"{api}_whole_us"] = best_cpu_s(partial(translate_once, api, whole, writer), repeat) * 1e6
        rows.append(row)
    return rows


def _check_stream(api: str, url: str) -> None:
    """One stream of each API through the gateway before measuring: a 200 that ends as its API ends."""
    path, doc = E2E_REQUESTS[api]
    headers = {"x-fake": f"chunks={E2E_CHUNKS}"}
    with httpx.Client(trust_env=False, timeout=60) as client:
        reply = client.post(url + path, json=doc, headers=headers)
    last = reply.content.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    if reply.status_code != 200 or not last.startswith(_LAST_EVENT[api]):
        raise RuntimeError(f"{api}: {reply.status_code}, the stream ends with {last[:200]!r}")


def end_to_end(
    *, ladder: tuple[int, ...], rounds: int, duration_s: float, cpu: int | None, log_dir: Path
) -> list[dict[str, Any]]:
    """Each API's streams through the gateway, interleaved: the gateway's CPU and req/s of each run."""
    if cpu is not None:
        # The load generator runs in this process: on the same core as the rest, as the matrix does.
        os.sched_setaffinity(0, {cpu})
    engine = surfaces.start_fake_engine(cpu, log_dir)
    runs: list[dict[str, Any]] = []
    try:
        gateway = surfaces.start_blazar({"m1": engine.url}, cpu, log_dir)
        with surfaces.running(gateway):
            for api in E2E_REQUESTS:
                _check_stream(api, gateway.url)
            for concurrency in ladder:
                order = list(E2E_REQUESTS)
                for round_index in range(rounds):
                    shift = round_index % len(order)
                    for api in order[shift:] + order[:shift]:
                        path, doc = E2E_REQUESTS[api]
                        before = gateway.cpu_s()
                        result = stream_load(
                            "127.0.0.1",
                            gateway.port,
                            path,
                            [orjson.dumps(doc)],
                            connections=concurrency,
                            duration_s=duration_s,
                            headers={"x-fake": f"chunks={E2E_CHUNKS}"},
                        )
                        cpu_s = gateway.cpu_s() - before
                        requests = result.requests
                        run = {
                            "api": api,
                            "concurrency": concurrency,
                            "round": round_index,
                            "requests": requests,
                            "errors": result.errors,
                            "rps": result.rps,
                            "events_per_request": result.chunks / requests if requests else None,
                            "cpu_us_per_request": cpu_s * 1e6 / requests if requests else None,
                            "cpu_us_per_chunk": cpu_s * 1e6 / (requests * E2E_CHUNKS) if requests else None,
                            "client_cpu_us_per_request": result.client_cpu_us_per_request,
                        }
                        runs.append(run)
                        print(
                            f"translation: C={concurrency:<3} {api:9} {result.rps:7.0f} req/s  "
                            f"{run['cpu_us_per_request'] or 0:7.0f} µs/req  errors {result.errors}",
                            flush=True,
                        )
    finally:
        engine.stop()
    return runs


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def e2e_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per API and C: the medians over rounds, and the median over rounds of the ratio to chat's run."""
    rows = []
    for concurrency in sorted({r["concurrency"] for r in runs}):
        cell = [r for r in runs if r["concurrency"] == concurrency]
        chat = {r["round"]: r for r in cell if r["api"] == "chat"}
        for api in E2E_REQUESTS:
            mine = [r for r in cell if r["api"] == api]
            row: dict[str, Any] = {"api": api, "concurrency": concurrency, "rounds": len(mine)}
            for key in ("rps", "cpu_us_per_request", "cpu_us_per_chunk", "events_per_request"):
                row[key] = _median([r[key] for r in mine])
            for key in ("rps", "cpu_us_per_request"):
                ratios = [
                    r[key] / chat[r["round"]][key]
                    for r in mine
                    if r[key] and r["round"] in chat and chat[r["round"]][key]
                ]
                row[f"{key}_ratio"] = statistics.median(ratios) if ratios else None
            row["requests"] = sum(r["requests"] for r in mine)
            row["errors"] = sum(r["errors"] for r in mine)
            rows.append(row)
    return rows


def _f(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(data: dict[str, Any]) -> str:
    plan = data["plan"]
    env = data.get("environment", {})
    lines = [
        "# Translated streams: the gateway's cost per event, beside the relay's",
        "",
        f"git {env.get('git_sha', '?')[:10]}{' (dirty)' if env.get('git_dirty') else ''}, "
        f"{env.get('cpu', '?')}, {env.get('cpus', '?')} CPUs; load average "
        f"{data['load_before']} before, {data['load_after']} after.",
        "",
        "## In one process",
        "",
        "CPU µs (`time.process_time`, best of three) over streams shaped like mlx_lm.server's "
        "(one read per event: the tokens, a finish, a usage event, `[DONE]`), driven to their end "
        "over an in-memory upstream and a writer that drops the bytes. *relay*: `relay_events`, "
        "chat completions byte for byte; *messages*, *responses*: `respond_translated`, the stream "
        "in that API; *parse*: `ChatEvents.feed` alone, which both translations do first. "
        "Per event = per request ÷ reads.",
        "",
        "| tokens | relay µs/event | parse µs/event | messages µs/event | responses µs/event "
        "| messages ÷ relay | responses ÷ relay |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in data["in_process"]:
        n = row["reads"]
        relay = row["relay_us"] / n
        lines.append(
            f"| {row['tokens']} | {relay:.2f} | {row['parse_us'] / n:.2f} | {row['messages_us'] / n:.2f} "
            f"| {row['responses_us'] / n:.2f} | {row['messages_us'] / row['relay_us']:.1f}× "
            f"| {row['responses_us'] / row['relay_us']:.1f}× |"
        )
    lines += [
        "",
        "The same streams arriving in one read (as a stream written without delay reaches the gateway "
        "end to end: the relay's work is per read, the translation's per event):",
        "",
        "| tokens | relay µs/event | messages µs/event | responses µs/event | messages ÷ relay "
        "| responses ÷ relay |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in data["in_process"]:
        n = row["reads"]
        relay = row["relay_whole_us"]
        lines.append(
            f"| {row['tokens']} | {relay / n:.2f} | {row['messages_whole_us'] / n:.2f} "
            f"| {row['responses_whole_us'] / n:.2f} | {row['messages_whole_us'] / relay:.0f}× "
            f"| {row['responses_whole_us'] / relay:.0f}× |"
        )
    lines += [
        "",
        "Per request, the same streams: the stream paths, and the non-stream replies "
        "(the whole stream parsed and fed, then `reply()`; chat: `ReplyAssembler`, the reply "
        "an engine that streams non-stream requests gets built).",
        "",
        "| tokens | relay µs/req | messages µs/req | responses µs/req | chat reply µs/req "
        "| messages reply µs/req | responses reply µs/req |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in data["in_process"]:
        figures = ("relay_us", "messages_us", "responses_us", "chat_reply_us", "messages_reply_us")
        shown = " | ".join(f"{row[key]:.0f}" for key in (*figures, "responses_reply_us"))
        lines.append(f"| {row['tokens']} | {shown} |")
    lines += [
        "",
        "## End to end",
        "",
        f"The fake engine behind the gateway (its defaults: access log and metrics on), streams of "
        f"{E2E_CHUNKS} chunks (`x-fake: chunks={E2E_CHUNKS}`), each API in turn, "
        f"{plan['duration_s']:g} s a run, {plan['rounds']} rounds, order rotated each round, "
        f"everything on CPU {plan['cpu']}; the load generator reads every stream to its end. "
        "Gateway CPU from its schedstat; per chunk = per request ÷ the engine's "
        f"{E2E_CHUNKS} chunks; ratios to chat's run of the same round (median over rounds).",
        "",
        "| C | API | req/s | ÷ chat | CPU µs/req | ÷ chat | CPU µs/chunk | events/req to the client "
        "| requests | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in data["end_to_end"]:
        lines.append(
            f"| {row['concurrency']} | {row['api']} | {_f(row['rps'], 0)} | {_f(row['rps_ratio'], 2)}× "
            f"| {_f(row['cpu_us_per_request'], 0)} | {_f(row['cpu_us_per_request_ratio'], 2)}× "
            f"| {_f(row['cpu_us_per_chunk'], 2)} | {_f(row['events_per_request'], 0)} "
            f"| {row['requests']} | {row['errors']} |"
        )
    return "\n".join(lines) + "\n"


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_translation(
    out: Path,
    *,
    quick: bool = False,
    smoke: bool = False,
    cpu: int | None = 0,
    duration_s: float | None = None,
    rounds: int | None = None,
    ladder: tuple[int, ...] = (1, 16),
) -> str:
    """Both measures; the report (also written to ``out``/translation.md, the figures to .json)."""
    events_per_trial = 2_000 if smoke else 20_000 if quick else 100_000
    rounds = rounds or (1 if smoke else 2 if quick else 3)
    duration_s = duration_s or (0.5 if smoke else 1.0 if quick else 3.0)
    plan = {
        "ladder": list(ladder),
        "rounds": rounds,
        "duration_s": duration_s,
        "cpu": cpu,
        "events_per_trial": events_per_trial,
    }
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    load_before = _load()
    data: dict[str, Any] = {"kind": "translation", "plan": plan, "load_before": load_before}
    data["in_process"] = in_process(events_per_trial=events_per_trial)
    runs = end_to_end(ladder=ladder, rounds=rounds, duration_s=duration_s, cpu=cpu, log_dir=log_dir)
    data["runs"] = runs
    data["end_to_end"] = e2e_rows(runs)
    data["load_after"] = _load()
    data["environment"] = report.environment()
    report.write_json(out / "translation.json", data)
    text = markdown(data)
    (out / "translation.md").write_text(text)
    return text
