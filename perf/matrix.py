"""`python -m perf matrix`: the gateway's own cost, against direct and nginx, as concurrency grows.

One run starts two fast fake engines and, in front of them, blazar-proxy
with its defaults (access log and metrics on, as a user runs it), nginx
(keepalive to the upstream, no buffering, its default access log to a file),
the httpx reference relay and, where it is installed, LiteLLM's proxy; on
request also blazar-proxy from another checkout (``--baseline``: before and
after in one run) and blazar-proxy with ``--no-access-log``. Each cell (workload ×
concurrency) is measured on every surface in turn, rounds interleaved, so
that drift on this shared machine hits all surfaces alike; figures are
medians over rounds, and the gateway's cost is quoted as the difference to
direct and as a ratio to nginx's.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from perf import surfaces
from perf.loadgen import CellResult, stream_load, wrk_load

SURFACES = ("direct", "blazar", "blazar-base", "blazar-no-log", "nginx", "blazar-httpx", "litellm")
# What a plain run measures; blazar-base comes with --baseline, blazar-no-log when asked for.
DEFAULT_SURFACES = ("direct", "blazar", "nginx", "blazar-httpx", "litellm")
# The blazar-proxy builds whose goals are reported beside blazar's.
OTHER_BLAZARS = ("blazar-base", "blazar-no-log")
PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class Workload:
    name: str
    stream: bool
    models: tuple[str, ...]
    fake: str  # the x-fake header: what the engine does
    description: str


WORKLOADS = {
    "json": Workload("json", False, ("m1",), "chunks=16", "non-stream chat, 16 tokens"),
    "sse": Workload("sse", True, ("m1",), "chunks=128", "stream, 128 chunks, no delay"),
    "sse-4ms": Workload(
        "sse-4ms",
        True,
        ("m1",),
        "chunks=128; chunk-delay=0.004",
        "stream, 128 chunks, 4 ms apart (a decode step)",
    ),
    "mix": Workload(
        "mix", False, ("m1", "m2"), "chunks=16", "non-stream, 2 models routed by the model field"
    ),
}


@dataclass
class Plan:
    ladder: tuple[int, ...] = (1, 4, 16, 64, 256)
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    surfaces: tuple[str, ...] = DEFAULT_SURFACES
    duration_s: float = 3.0
    rounds: int = 2
    cpu: int | None = 0
    # Another checkout (a worktree of main, say) run as the surface blazar-base.
    baseline: str | None = None


@dataclass
class Cell:
    workload: str
    concurrency: int
    surface: str
    runs: list[dict[str, Any]] = field(default_factory=list)

    def median(self, key: str) -> float | None:
        values = [r[key] for r in self.runs if r.get(key) is not None]
        return statistics.median(values) if values else None


def body(model: str, stream: bool) -> bytes:
    payload: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me about the gateway."}],
        "max_tokens": 128,
    }
    if stream:
        payload["stream"] = True
    return orjson.dumps(payload)


def _measure(
    workload: Workload, surface: surfaces.Process, concurrency: int, plan: Plan, direct_port: int | None
) -> dict[str, Any]:
    bodies = [body(m, workload.stream) for m in workload.models]
    cpu_before = surface.cpu_s()
    if workload.stream:
        result: CellResult = stream_load(
            "127.0.0.1",
            surface.port,
            PATH,
            bodies,
            connections=concurrency,
            duration_s=plan.duration_s,
            headers={"x-fake": workload.fake},
        )
    else:
        result = wrk_load(
            surface.url + PATH,
            bodies,
            connections=concurrency,
            duration_s=plan.duration_s,
            cpu=plan.cpu,
            headers={"x-fake": workload.fake},
        )
    cpu_s = surface.cpu_s() - cpu_before
    run = asdict(result)
    run.pop("latencies_ms")
    run["rps"] = result.rps
    run["cpu_us_per_request"] = cpu_s * 1e6 / result.requests if result.requests else None
    run["cpu_us_per_chunk"] = cpu_s * 1e6 / result.chunks if result.chunks else None
    return run


def run_matrix(plan: Plan, out_dir: Path) -> dict[str, Any]:
    """Start every surface, measure every cell, and return the report's data."""
    if plan.cpu is not None:
        # The stream load generator runs in this process: same core as the rest.
        os.sched_setaffinity(0, {plan.cpu})
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    engines = [surfaces.start_fake_engine(plan.cpu, log_dir) for _ in range(2)]
    procs: dict[str, surfaces.Process] = {}
    upstreams = {"m1": engines[0].url, "m2": engines[1].url}
    started = time.time()
    try:
        procs["direct"] = engines[0]
        if "blazar" in plan.surfaces:
            procs["blazar"] = surfaces.start_blazar(upstreams, plan.cpu, log_dir)
        if "blazar-base" in plan.surfaces:
            if plan.baseline is None:
                raise ValueError("the surface blazar-base needs a baseline checkout (--baseline DIR)")
            procs["blazar-base"] = surfaces.start_blazar(
                upstreams, plan.cpu, log_dir, name="blazar-base", root=Path(plan.baseline).resolve()
            )
        if "blazar-no-log" in plan.surfaces:
            procs["blazar-no-log"] = surfaces.start_blazar(
                upstreams, plan.cpu, log_dir, "--no-access-log", name="blazar-no-log"
            )
        if "nginx" in plan.surfaces:
            procs["nginx"] = surfaces.start_nginx([e.port for e in engines], plan.cpu, out_dir)
        if "blazar-httpx" in plan.surfaces:
            procs["blazar-httpx"] = surfaces.start_httpx_gateway(upstreams, plan.cpu, log_dir)
        litellm = _start_litellm(plan, upstreams, out_dir, procs)
        for proc in procs.values():
            _warm(proc)
        cells: dict[tuple[str, int, str], Cell] = {}
        for name in plan.workloads:
            workload = WORKLOADS[name]
            for concurrency in plan.ladder:
                for round_index in range(plan.rounds):
                    # Rotate the order each round so no surface always goes first.
                    order = [s for s in plan.surfaces if s in procs]
                    shift = round_index % len(order)
                    for surface_name in order[shift:] + order[:shift]:
                        key = (name, concurrency, surface_name)
                        cell = cells.setdefault(key, Cell(name, concurrency, surface_name))
                        measured = _measure(workload, procs[surface_name], concurrency, plan, engines[0].port)
                        cell.runs.append(measured)
                        print(
                            f"matrix: {name:8} C={concurrency:<4} {surface_name:13} "
                            f"p50 {measured['p50_ms'] or 0:.3f} ms  {measured['rps']:.0f} req/s  "
                            f"errors {measured['errors']}",
                            flush=True,
                        )
    finally:
        for proc in procs.values():
            proc.stop()
        for engine in engines:
            engine.stop()
    data = summarize(plan, cells, started)
    data["litellm"] = litellm
    return data


def _warm(surface: surfaces.Process, requests: int = 20) -> None:
    """A few requests of each kind before measuring: LiteLLM's first request takes ~0.6 s here."""
    headers = {"content-type": "application/json", "x-fake": "chunks=16"}
    with httpx.Client(trust_env=False, timeout=60) as client:
        for index in range(requests):
            for model in ("m1", "m2"):
                stream = index % 4 == 0
                with client.stream(
                    "POST", surface.url + PATH, content=body(model, stream), headers=headers
                ) as response:
                    response.read()
                    response.raise_for_status()


def _start_litellm(
    plan: Plan, upstreams: dict[str, str], out_dir: Path, procs: dict[str, surfaces.Process]
) -> dict[str, Any]:
    """Add LiteLLM's proxy to ``procs`` where it is installed; what became of it, for the report."""
    if "litellm" not in plan.surfaces:
        return {"status": "not in this plan"}
    found = surfaces.find_litellm()
    if found is None:
        hint = f"pip install 'litellm[proxy]' (or set ${surfaces.LITELLM_ENV})"
        return {"status": "not installed", "hint": hint}
    info: dict[str, Any] = {"version": found.version, "python": found.python, "found_by": found.found_by}
    try:
        procs["litellm"] = surfaces.start_litellm(found, upstreams, plan.cpu, out_dir)
    except RuntimeError as exc:
        print(f"matrix: LiteLLM {found.version} did not start: {exc}", flush=True)
        return {**info, "status": f"did not start: {exc}"}
    return {**info, "status": "measured"}


def summarize(plan: Plan, cells: dict[tuple[str, int, str], Cell], started: float) -> dict[str, Any]:
    rows = []
    for (workload, concurrency, surface), cell in sorted(cells.items(), key=lambda kv: _order(kv[0])):
        direct = cells.get((workload, concurrency, "direct"))
        row: dict[str, Any] = {
            "workload": workload,
            "concurrency": concurrency,
            "surface": surface,
            "p50_ms": cell.median("p50_ms"),
            "p99_ms": cell.median("p99_ms"),
            "ttfb_p50_ms": cell.median("ttfb_p50_ms"),
            "rps": cell.median("rps"),
            "cpu_us_per_request": cell.median("cpu_us_per_request"),
            "cpu_us_per_chunk": cell.median("cpu_us_per_chunk"),
            "client_cpu_us_per_request": cell.median("client_cpu_us_per_request"),
            "errors": sum(r["errors"] for r in cell.runs),
            "requests": sum(r["requests"] for r in cell.runs),
            "runs": cell.runs,
        }
        if direct is not None:
            for key in ("p50_ms", "p99_ms", "ttfb_p50_ms"):
                mine, base = cell.median(key), direct.median(key)
                row[f"added_{key}"] = (mine - base) if mine is not None and base is not None else None
        rows.append(row)
    present = {surface for _, _, surface in cells}
    return {
        "kind": "matrix",
        "plan": asdict(plan),
        "started": started,
        "rows": rows,
        "goals": goals(rows),
        "other_goals": {s: goals(rows, s) for s in OTHER_BLAZARS if s in present},
    }


def _order(key: tuple[str, int, str]) -> tuple[int, int, int]:
    workload, concurrency, surface = key
    return (
        list(WORKLOADS).index(workload),
        concurrency,
        SURFACES.index(surface) if surface in SURFACES else 99,
    )


def _find(rows: list[dict[str, Any]], workload: str, concurrency: int, surface: str) -> dict[str, Any] | None:
    return next(
        (
            r
            for r in rows
            if (r["workload"], r["concurrency"], r["surface"]) == (workload, concurrency, surface)
        ),
        None,
    )


def goals(rows: list[dict[str, Any]], surface: str = "blazar") -> list[dict[str, Any]]:
    """The issue's goals for ``surface``, each with the figures it compares and whether it is met."""
    out: list[dict[str, Any]] = []

    def ratio_goal(
        name: str, workload: str, c: int, key: str, limit: float, *, at_least: bool = False
    ) -> None:
        ours, theirs = _find(rows, workload, c, surface), _find(rows, workload, c, "nginx")
        if not ours or not theirs or ours.get(key) is None or not theirs.get(key):
            return
        value = ours[key] / theirs[key]
        met = value >= limit if at_least else value <= limit
        out.append(
            {
                "goal": name,
                "blazar": ours[key],
                "nginx": theirs[key],
                "ratio": value,
                "limit": f"{'≥' if at_least else '≤'} {limit}× nginx",
                "met": met,
            }
        )

    ratio_goal("added p50 at C=1 (json)", "json", 1, "added_p50_ms", 4.0)
    blazar_c1 = _find(rows, "json", 1, surface)
    if blazar_c1 and blazar_c1.get("added_p99_ms") is not None:
        out.append(
            {
                "goal": "added p99 at C=1 (json)",
                "blazar": blazar_c1["added_p99_ms"],
                "limit": "≤ 0.5 ms",
                "met": blazar_c1["added_p99_ms"] <= 0.5,
            }
        )
    ratio_goal("added time to first byte at C=1 (sse)", "sse", 1, "added_ttfb_p50_ms", 3.0)
    ratio_goal("req/s at C=64 (json)", "json", 64, "rps", 0.35, at_least=True)
    ratio_goal("CPU per SSE chunk at C=16 (sse)", "sse", 16, "cpu_us_per_chunk", 2.0)
    return out
