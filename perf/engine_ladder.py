"""`python -m perf engine-ladder`: aggregate tok/s on a real engine, direct and through the gateway.

The gateway runs as a user runs it: ``blazar-proxy --engine ENGINE`` with its
defaults (the built-in model unless ``--model``; access log and metrics on;
admission at the engine's slots). The harness finds the engine child the
gateway started and loads it two ways, one after the other: straight to the
child's port ("direct") and through the gateway. At each concurrency C, C
workers each send chat completions back to back (temperature 0, a fixed
max_tokens, each worker its own prompt, the same prompts on both sides) for a
warmup and then a measured window. A non-stream request's completion tokens count in the window in
proportion to the part of its time that falls inside it, so a window's
figure is not quantized to whole requests; a stream's count by the arrival
time of its events. Each round measures every
C on both sides, the side first measured alternating round by round; the
ratio gateway ÷ direct is taken per round (adjacent cells) and its median over
rounds is the goal's figure.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from perf import report
from perf.receipt import (
    ReceiptError,
    child_cmdline,
    engine_server,
    engine_versions,
    pin_process,
    resolve_model,
    start_gateway,
)

ENGINE = "llamacpp-b11434"
# The goal: aggregate tok/s through the gateway within this fraction of direct's.
GOAL_PCT = 3.0
SIDES = ("direct", "gateway")
# One prompt per worker (worker i sends PROMPTS[i % len]); long answers, so that
# most requests run to max_tokens and every request costs about the same.
PROMPTS = (
    "Write a long story about a cat who learns to sail.",
    "Write a long story about a lighthouse keeper and a storm.",
    "Write a long story about a robot who plants a garden.",
    "Write a long story about two friends crossing a desert.",
    "Write a long story about a baker in a small mountain town.",
    "Write a long story about a girl who finds a map in a library.",
    "Write a long story about an old train and its last journey.",
    "Write a long story about a fox, a crow and a river.",
    "Write a long story about a city where it never stops raining.",
    "Write a long story about a boy who builds a kite.",
    "Write a long story about a ship's cook at the end of the world.",
    "Write a long story about a clockmaker and a missing hour.",
    "Write a long story about a musician who loses her voice.",
    "Write a long story about a village under the snow.",
    "Write a long story about an astronaut who misses the sea.",
    "Write a long story about a dog who waits at a station.",
)


class LadderError(ReceiptError):
    """The ladder cannot run as asked."""


@dataclass
class LadderPlan:
    engine: str = ENGINE
    variant: str = "cpu"
    # None: no --model, the engine's built-in default, as a user runs it.
    model: str | None = None
    ladder: tuple[int, ...] = (1, 4, 8)
    rounds: int = 5
    max_tokens: int = 128
    warmup_s: float = 3.0
    duration_s: float = 15.0
    # Streamed requests too (each read to its end), in their own cells.
    stream: bool = False
    # Core for the client and the gateway, and the engine child's; None: not pinned (as a user runs it).
    cpu: int | None = None
    engine_cpu: int | None = 1


@dataclass
class Request:
    start: float
    end: float
    tokens: int
    finish: str | None
    # A stream: when each event with content arrived (its tokens are spread over them).
    times: list[float] | None = None


@dataclass
class Cell:
    round: int
    concurrency: int
    side: str
    stream: bool
    tok_s: float
    requests: int
    window_requests: float
    errors: int
    finish: dict[str, int]
    latency_p50_s: float | None
    gateway_cpu_s: float
    engine_cpu_s: float
    wall_s: float
    error_samples: list[str] = field(default_factory=list)


def _body(served: str, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": served,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _one(client: httpx.Client, url: str, body: dict[str, Any]) -> Request:
    """One chat completion; its completion tokens from usage (a stream: its usage event)."""
    start = time.perf_counter()
    if not body.get("stream"):
        response = client.post(url, json=body)
        response.raise_for_status()
        data = response.json()
        end = time.perf_counter()
        tokens = int(data["usage"]["completion_tokens"])
        return Request(start, end, tokens, data["choices"][0].get("finish_reason"))
    tokens, finish, buffer = 0, None, b""
    times: list[float] = []
    with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        for chunk in response.iter_raw():
            now = time.perf_counter()
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                data = orjson.loads(event[6:])
                if data.get("usage"):
                    tokens = int(data["usage"]["completion_tokens"])
                for choice in data.get("choices") or ():
                    finish = choice.get("finish_reason") or finish
                    if (choice.get("delta") or {}).get("content"):
                        times.append(now)
    return Request(start, time.perf_counter(), tokens, finish, times)


def _cpu_s(pid: int) -> float:
    """CPU seconds of one process's threads (not its children), from schedstat."""
    total = 0
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    return total / 1e9


def in_window(requests: list[Request], lo: float, hi: float) -> tuple[float, float]:
    """(tokens, requests) inside [lo, hi]: each request counts by the share of its time inside.

    A stream's tokens count by the share of its content events that arrived inside.
    """
    tokens = count = 0.0
    for r in requests:
        if r.times:
            share = sum(lo <= t <= hi for t in r.times) / len(r.times)
            tokens += r.tokens * share
            count += share
            continue
        overlap = min(r.end, hi) - max(r.start, lo)
        if overlap <= 0 or r.end <= r.start:
            continue
        share = overlap / (r.end - r.start)
        tokens += r.tokens * share
        count += share
    return tokens, count


def run_cell(
    url: str, served: str, c: int, plan: LadderPlan, stream: bool, pids: dict[str, int]
) -> tuple[float, list[Request], list[str], float, dict[str, float]]:
    """C workers back to back for warmup + window; (window start, requests, errors, wall, CPU seconds)."""
    done: list[Request] = []
    errors: list[str] = []
    lock = threading.Lock()
    started = time.perf_counter()
    lo = started + plan.warmup_s
    hi = lo + plan.duration_s
    cpu0 = {name: _cpu_s(pid) for name, pid in pids.items()}

    def worker(index: int) -> None:
        body = _body(served, PROMPTS[index % len(PROMPTS)], plan.max_tokens, stream)
        with httpx.Client(trust_env=False, timeout=600) as client:
            while time.perf_counter() < hi:
                try:
                    request = _one(client, url, body)
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    with lock:
                        errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    time.sleep(0.1)
                    continue
                with lock:
                    done.append(request)

    with concurrent.futures.ThreadPoolExecutor(c) as pool:
        list(pool.map(worker, range(c)))
    wall = time.perf_counter() - started
    cpu = {name: _cpu_s(pid) - cpu0[name] for name, pid in pids.items()}
    return lo, done, errors, wall, cpu


def run_engine_ladder(plan: LadderPlan, out_dir: Path) -> dict[str, Any]:
    from engines import install
    from engines.home import Home, blazar_home

    if plan.cpu is not None:
        os.sched_setaffinity(0, {plan.cpu})
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    home = Home(blazar_home())
    try:
        _, installation = install.ensure_installed(plan.engine, plan.variant, home, progress=print)
    except Exception as exc:
        raise LadderError(f"{plan.engine} ({plan.variant}) is not installed and could not be: {exc}") from exc
    model_info: dict[str, Any] = {"source": plan.model or "the engine's default (no --model)"}
    if plan.model is not None:
        # Made ready (fetched, converted) before the gateway starts, so its start is not timed out by it.
        _, model_info = resolve_model(plan.model, installation, home, print)
    gateway, child_pid, child_port, served = start_gateway(
        plan.engine, plan.variant, plan.model, plan.cpu, log_dir, "engine-ladder"
    )
    child_argv = child_cmdline(child_pid)
    if plan.cpu is not None and plan.engine_cpu is not None:
        pin_process(child_pid, plan.engine_cpu)
    urls = {
        "direct": f"http://127.0.0.1:{child_port}/v1/chat/completions",
        "gateway": f"{gateway.url}/v1/chat/completions",
    }
    pids = {"gateway": gateway.proc.pid, "engine": child_pid}
    cells: list[Cell] = []
    kinds = (False, True) if plan.stream else (False,)
    total = plan.rounds * len(plan.ladder) * len(kinds) * 2
    try:
        # One short request per side first: the first request of a fresh child is slower.
        with httpx.Client(trust_env=False, timeout=600) as client:
            for side in SIDES:
                _one(client, urls[side], _body(served, PROMPTS[0], min(plan.max_tokens, 16), False))
        for rnd in range(plan.rounds):
            order = SIDES if rnd % 2 == 0 else SIDES[::-1]
            for stream in kinds:
                for c in plan.ladder:
                    for side in order:
                        lo, done, errors, wall, cpu = run_cell(urls[side], served, c, plan, stream, pids)
                        tokens, count = in_window(done, lo, lo + plan.duration_s)
                        latencies = [r.end - r.start for r in done]
                        finish: dict[str, int] = {}
                        for r in done:
                            finish[str(r.finish)] = finish.get(str(r.finish), 0) + 1
                        cell = Cell(
                            round=rnd + 1,
                            concurrency=c,
                            side=side,
                            stream=stream,
                            tok_s=tokens / plan.duration_s,
                            requests=len(done),
                            window_requests=count,
                            errors=len(errors),
                            finish=finish,
                            latency_p50_s=statistics.median(latencies) if latencies else None,
                            gateway_cpu_s=cpu["gateway"],
                            engine_cpu_s=cpu["engine"],
                            wall_s=wall,
                            error_samples=errors[:3],
                        )
                        cells.append(cell)
                        print(
                            f"engine-ladder: {len(cells)}/{total} round {cell.round} "
                            f"{'stream' if stream else 'json'} C={c} {side:7} {cell.tok_s:7.1f} tok/s, "
                            f"{cell.requests} requests, {cell.errors} errors, "
                            f"gateway CPU {cell.gateway_cpu_s:.2f} s",
                            flush=True,
                        )
    finally:
        gateway.stop()
    return {
        "kind": "engine-ladder",
        "engine": plan.engine,
        "engine_server": engine_server(plan.engine),
        "model": served,
        "model_info": model_info,
        "child_argv": child_argv,
        "plan": asdict(plan),
        "goal_pct": GOAL_PCT,
        "cells": [asdict(c) for c in cells],
        "summary": summarize(cells, plan),
        "environment": report.environment(engine_versions(plan.engine, child_argv)),
    }


def summarize(cells: list[Cell], plan: LadderPlan) -> list[dict[str, Any]]:
    """Per (stream, C): each side's median tok/s, the per-round ratios, their median and spread, the goal."""
    rows = []
    for stream in sorted({c.stream for c in cells}):
        for conc in plan.ladder:
            mine = [c for c in cells if c.stream == stream and c.concurrency == conc]
            by_round: dict[int, dict[str, Cell]] = {}
            for cell in mine:
                by_round.setdefault(cell.round, {})[cell.side] = cell
            ratios = [
                pair["gateway"].tok_s / pair["direct"].tok_s
                for pair in by_round.values()
                if set(pair) == set(SIDES) and pair["direct"].tok_s > 0
            ]
            side_tok = {s: [c.tok_s for c in mine if c.side == s] for s in SIDES}
            gw_cells = [c for c in mine if c.side == "gateway"]
            gw_tokens = sum(c.tok_s * plan.duration_s for c in gw_cells)
            median_ratio = statistics.median(ratios) if ratios else None
            rows.append(
                {
                    "stream": stream,
                    "concurrency": conc,
                    "direct_tok_s": statistics.median(side_tok["direct"]) if side_tok["direct"] else None,
                    "gateway_tok_s": statistics.median(side_tok["gateway"]) if side_tok["gateway"] else None,
                    "ratios": ratios,
                    "ratio_median": median_ratio,
                    "ratio_min": min(ratios) if ratios else None,
                    "ratio_max": max(ratios) if ratios else None,
                    "rounds_gateway_slower": sum(r < 1 for r in ratios),
                    "errors": sum(c.errors for c in mine),
                    "direct_latency_p50_s": _median([c.latency_p50_s for c in mine if c.side == "direct"]),
                    "gateway_latency_p50_s": _median([c.latency_p50_s for c in gw_cells]),
                    # Whole cell (warmup and tail too) over the window's tokens: an upper bound per token.
                    "gateway_cpu_ms_per_100_tokens": (
                        sum(c.gateway_cpu_s for c in gw_cells) * 1000 / gw_tokens * 100 if gw_tokens else None
                    ),
                    "met": median_ratio is not None and median_ratio >= 1 - GOAL_PCT / 100,
                }
            )
    return rows


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def markdown(data: dict[str, Any]) -> str:
    env = data["environment"]
    plan = data["plan"]
    pinning = (
        f"client and gateway pinned to CPU {plan['cpu']}, engine child to CPU {plan['engine_cpu']}"
        if plan["cpu"] is not None
        else "nothing pinned (as a user runs it)"
    )
    server = data["engine_server"]
    lines = [
        "# blazar-proxy engine ladder: aggregate tok/s, direct and through the gateway",
        "",
        f"Engine {data['engine']} ({plan['variant']}), model `{data['model']}` "
        f"({data['model_info'].get('source', '?')}); git {env['git_sha'][:12]}"
        f"{' (dirty)' if env['git_dirty'] else ''}, {env['cpu']}, {env['cpus']} CPUs; {pinning}."
        + report.engine_line(env),
        f"Engine child: `{' '.join([Path(data['child_argv'][0]).name, *data['child_argv'][1:]])}`."
        if data["child_argv"]
        else "Engine child: gone before its command line was read.",
        "The gateway runs as a user runs it: `blazar-proxy --engine "
        f"{data['engine']}{' --model ' + plan['model'] if plan['model'] else ''}`, its defaults otherwise "
        "(access log and metrics on, admission at the engine's slots).",
        f"At each C, C workers send chat completions back to back (max_tokens {plan['max_tokens']}, "
        "temperature 0, each worker its own prompt, the same prompts on both sides): "
        f"{plan['warmup_s']:g} s warmup, then a {plan['duration_s']:g} s window; a request's completion "
        "tokens count in proportion to its time inside the window. "
        f"{plan['rounds']} rounds; in each, every C on both sides, adjacent, the side measured first "
        "alternating by round. tok/s: median over rounds; ratio: gateway ÷ direct per round (adjacent "
        "cells), its median over rounds, and its range. Goal: the median ratio ≥ "
        f"{1 - data['goal_pct'] / 100:.2f} (within {data['goal_pct']:g} % of direct).",
        "",
        f"| requests | C | direct {server} tok/s | via blazar-proxy tok/s | ratio (median) | ratio range "
        "| rounds gateway slower | latency p50 direct → gateway | gateway CPU ms / 100 tokens | errors | "
        f"within {data['goal_pct']:g} % |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in data["summary"]:
        ratio = row["ratio_median"]
        lines.append(
            f"| {'stream' if row['stream'] else 'non-stream'} | {row['concurrency']} | "
            f"{_f(row['direct_tok_s'], 1)} | {_f(row['gateway_tok_s'], 1)} | "
            f"{_f(ratio, 4)} ({_pct(ratio)}) | {_f(row['ratio_min'], 3)}–{_f(row['ratio_max'], 3)} | "
            f"{row['rounds_gateway_slower']} of {len(row['ratios'])} | "
            f"{_f(row['direct_latency_p50_s'], 3)} → {_f(row['gateway_latency_p50_s'], 3)} s | "
            f"{_f(row['gateway_cpu_ms_per_100_tokens'], 2)} | {row['errors']} | "
            f"{'yes' if row['met'] else '**no**'} |"
        )
    lines += [
        "",
        "## Every cell",
        "",
        "| round | requests | C | side | tok/s | requests done | in window | finish | latency p50 s | "
        "gateway CPU s | engine CPU s | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in data["cells"]:
        finish = ", ".join(f"{k} {v}" for k, v in sorted(c["finish"].items()))
        lines.append(
            f"| {c['round']} | {'stream' if c['stream'] else 'non-stream'} | {c['concurrency']} | "
            f"{c['side']} | {c['tok_s']:.1f} | {c['requests']} | {c['window_requests']:.1f} | {finish} | "
            f"{_f(c['latency_p50_s'], 3)} | {c['gateway_cpu_s']:.2f} | {c['engine_cpu_s']:.2f} | "
            f"{c['errors']} |"
        )
    samples = [s for c in data["cells"] for s in c["error_samples"]]
    if samples:
        lines += ["", "Errors (first of each cell): " + "; ".join(f"`{s}`" for s in samples[:6])]
    return "\n".join(lines) + "\n"


def _f(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pct(ratio: float | None) -> str:
    return "–" if ratio is None else f"{(ratio - 1) * 100:+.1f} %"
