"""`python -m perf matrix`: the gateway's own cost, against direct and nginx, as concurrency grows.

The workloads come in two groups, each with its own upstream and its own
set of surfaces, started for the group and stopped after it:

- ``json`` (non-stream): the fast upstream (``perf/fast_upstream.py``: a
  fixed ~1 KB completion per POST, one write, keep-alive), one of it, and
  an ~800-byte chat request from wrk; nginx with one ``server`` in its
  upstream block and nginx's default request buffering. The added time of
  every surface is then its own, not inflated by a heavy upstream on the
  same core (see perf/README.md, "what made the difference").
- ``sse``, ``sse-4ms``, ``mix``: two fake engines (``tests/fake_engine.py``,
  which stream and take ``x-fake`` workloads), nginx round-robin over both
  with ``proxy_request_buffering off``, as before.

In front of each upstream: blazar-proxy with its defaults (access log and
metrics on, as a user runs it), nginx (keepalive to the upstream, no
response buffering, its default access log to a file), the httpx reference
relay and, where they are installed, the peers: LiteLLM's proxy and Portkey's gateway; on request also
blazar-proxy from another checkout (``--baseline``: before and after in one
run) and blazar-proxy with ``--no-access-log``. Each cell (workload ×
concurrency) is measured on every surface in turn, rounds interleaved, so
that drift on this shared machine hits all surfaces alike; figures are
medians over rounds, and the gateway's cost is quoted as the difference to
direct and as a ratio to nginx's. The cells the goals read (json at C=1 and
C=64) run at least ``goal_duration_s`` each, and every cell a goal reads (sse
at C=1 and C=16 too) at least ``goal_rounds`` rounds, whatever the plan's
own duration and rounds.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from perf import surfaces
from perf.loadgen import CellResult, stream_load, wrk_load

SURFACES = (
    "direct",
    "blazar",
    "blazar-base",
    "blazar-no-log",
    "nginx",
    "floor",
    "fused",
    "blazar-httpx",
    "litellm",
    "portkey",
)
# What a plain run measures; blazar-base comes with --baseline, blazar-no-log when asked for.
DEFAULT_SURFACES = ("direct", "blazar", "nginx", "floor", "fused", "blazar-httpx", "litellm", "portkey")
# Other gateways, measured where installed; each has a section of the report (and a status if not).
PEERS = ("litellm", "portkey")
# The blazar-proxy builds whose goals are reported beside blazar's.
OTHER_BLAZARS = ("blazar-base", "blazar-no-log")
PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class Workload:
    name: str
    stream: bool
    models: tuple[str, ...]
    fake: str  # the x-fake header: what the fake engine does (not sent to the fast upstream)
    description: str
    # "fast": perf/fast_upstream.py, one of it, the ~800-byte chat request; "fake": two fake engines.
    upstream: str = "fake"


WORKLOADS = {
    "json": Workload(
        "json",
        False,
        ("m1",),
        "chunks=16",
        "non-stream chat, an ~800-byte request, the fast upstream's fixed ~1 KB reply",
        upstream="fast",
    ),
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
    # The cells the goals read (GOAL_CELLS) run at least this many rounds, each surface's runs in
    # several places of the rotating order: with one round, the surface measured first in an sse
    # cell came out up to 30 % dearer than the same build measured next (an A/A run). The json
    # ones run at least this long, so that a p50 difference of ~20 µs and a p99 are measured, not
    # guessed (0: the plan's).
    goal_duration_s: float = 3.0
    goal_rounds: int = 3

    def shape(self, workload: str, concurrency: int) -> tuple[int, float]:
        """(rounds, seconds per run) of one cell."""
        if (workload, concurrency) not in GOAL_CELLS:
            return self.rounds, self.duration_s
        rounds = max(self.rounds, self.goal_rounds)
        if workload != "json":
            return rounds, self.duration_s
        return rounds, max(self.duration_s, self.goal_duration_s)


# The cells the goals read: json at C=1 (added p50 and p99, CPU) and C=64 (req/s, CPU), sse at C=1
# (added time to first byte) and C=16 (CPU per event).
GOAL_CELLS = frozenset({("json", 1), ("json", 64), ("sse", 1), ("sse", 16)})


@dataclass
class Cell:
    workload: str
    concurrency: int
    surface: str
    runs: list[dict[str, Any]] = field(default_factory=list)

    def median(self, key: str) -> float | None:
        values = [r[key] for r in self.runs if r.get(key) is not None]
        return statistics.median(values) if values else None


# The json cells' request: a system prompt and a question, ~800 bytes, the same every time.
_SYSTEM = (
    "You are a helpful assistant for the operations team of a small company. Answer briefly and "
    "precisely; when you are not sure, say so, and name what you would need to know to answer. "
    "Prefer plain words over jargon, give commands in code blocks, and never invent numbers."
)
_QUESTION = (
    "Our gateway sits in front of two inference engines and relays chat completions between the "
    "clients and the engines. Last week its p99 latency went up after a deploy, while the engines' "
    "own timings stayed flat. What should we look at first, and how would we tell whether the "
    "gateway or the network between it and the engines is to blame? Please keep it short, and "
    "list the three checks in order."
)


def chat_body(model: str = "m1") -> bytes:
    """The ~800-byte non-stream chat request of the json cells."""
    return orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _QUESTION}],
            "max_tokens": 128,
            "temperature": 0.7,
        }
    )


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
    workload: Workload, surface: surfaces.Process, concurrency: int, plan: Plan, duration_s: float
) -> dict[str, Any]:
    if workload.upstream == "fast":
        bodies = [chat_body(m) for m in workload.models]
        headers: dict[str, str] = {}
    else:
        bodies = [body(m, workload.stream) for m in workload.models]
        headers = {"x-fake": workload.fake}
    headers = {**headers, **surface.headers}
    cpu_before = surface.cpu_s()
    if workload.stream:
        result: CellResult = stream_load(
            "127.0.0.1",
            surface.port,
            PATH,
            bodies,
            connections=concurrency,
            duration_s=duration_s,
            headers=headers,
        )
    else:
        result = wrk_load(
            surface.url + PATH,
            bodies,
            connections=concurrency,
            duration_s=duration_s,
            cpu=plan.cpu,
            headers=headers,
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
    started = time.time()
    cells: dict[tuple[str, int, str], Cell] = {}
    peers: dict[str, dict[str, Any]] = {peer: {"status": "not in this plan"} for peer in PEERS}
    # One group of workloads per upstream, in the plan's order, each with its own surfaces.
    groups: dict[str, list[str]] = {}
    for name in plan.workloads:
        groups.setdefault(WORKLOADS[name].upstream, []).append(name)
    for upstream, names in groups.items():
        infos = _run_group(plan, upstream, names, out_dir, log_dir, cells)
        for peer, info in infos.items():
            # The first failure to start stands: a later group's success does not hide it.
            if info["status"] != "not in this plan" and not peers[peer]["status"].startswith("did not start"):
                peers[peer] = info
    data = summarize(plan, cells, started)
    data.update(peers)
    return data


def _start_upstreams(plan: Plan, upstream: str, log_dir: Path) -> list[surfaces.Process]:
    if upstream == "fast":
        return [surfaces.start_fast_upstream(plan.cpu, log_dir)]
    return [surfaces.start_fake_engine(plan.cpu, log_dir) for _ in range(2)]


def _run_group(
    plan: Plan,
    upstream: str,
    names: list[str],
    out_dir: Path,
    log_dir: Path,
    cells: dict[tuple[str, int, str], Cell],
) -> dict[str, dict[str, Any]]:
    """Start the upstream(s) and the surfaces for one group of workloads, measure its cells, stop all.

    Returns what became of each peer (``PEERS``), for the report.
    """
    engines = _start_upstreams(plan, upstream, log_dir)
    procs: dict[str, surfaces.Process] = {}
    models = ("m1",) if upstream == "fast" else ("m1", "m2")
    upstreams = {model: engine.url for model, engine in zip(models, engines, strict=True)}
    peers: dict[str, dict[str, Any]] = {peer: {"status": "not in this plan"} for peer in PEERS}
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
            # The fast upstream's nginx: one server, nginx's default request buffering (the
            # outside reference's config); the fake engines': both, proxy_request_buffering off.
            procs["nginx"] = surfaces.start_nginx(
                [e.port for e in engines], plan.cpu, out_dir, request_buffering=upstream == "fast"
            )
        if "floor" in plan.surfaces:
            procs["floor"] = surfaces.start_floor(upstreams, plan.cpu, log_dir)
        if "fused" in plan.surfaces:
            procs["fused"] = surfaces.start_fused(upstreams, plan.cpu, log_dir)
        if "blazar-httpx" in plan.surfaces:
            procs["blazar-httpx"] = surfaces.start_httpx_gateway(upstreams, plan.cpu, log_dir)
        peers["litellm"] = _start_litellm(plan, upstreams, out_dir, procs)
        peers["portkey"] = _start_portkey(plan, upstreams, out_dir, procs)
        for proc in procs.values():
            _warm(proc, models, streams=upstream != "fast")
        for name in names:
            workload = WORKLOADS[name]
            for concurrency in plan.ladder:
                rounds, duration_s = plan.shape(name, concurrency)
                for round_index in range(rounds):
                    for surface_name in round_order([s for s in plan.surfaces if s in procs], round_index):
                        key = (name, concurrency, surface_name)
                        cell = cells.setdefault(key, Cell(name, concurrency, surface_name))
                        measured = _measure(workload, procs[surface_name], concurrency, plan, duration_s)
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
    return peers


def round_order(names: list[str], round_index: int) -> list[str]:
    """The order the surfaces are measured in, in round ``round_index`` of a cell: rotated each round so
    no surface always goes first, and reversed every other round so that of two surfaces next to each
    other neither always follows the other. A surface measured right after another gateway paid for
    it: in an A/A run (``blazar-base`` the same code as ``blazar``) the one that followed the other in
    two rounds of three spent 32 % more CPU a request at json C=64; listed the other way round, the
    other one did."""
    order = names[::-1] if round_index % 2 else names
    shift = round_index % len(order)
    return order[shift:] + order[:shift]


def _warm(surface: surfaces.Process, models: tuple[str, ...], *, streams: bool, requests: int = 20) -> None:
    """A few requests of each kind before measuring: LiteLLM's first request takes ~0.6 s here."""
    headers = {"content-type": "application/json", "x-fake": "chunks=16", **surface.headers}
    with httpx.Client(trust_env=False, timeout=60) as client:
        for index in range(requests):
            for model in models:
                stream = streams and index % 4 == 0
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


def _start_portkey(
    plan: Plan, upstreams: dict[str, str], out_dir: Path, procs: dict[str, surfaces.Process]
) -> dict[str, Any]:
    """Add Portkey's gateway to ``procs`` where it is installed; what became of it, for the report."""
    if "portkey" not in plan.surfaces:
        return {"status": "not in this plan"}
    found = surfaces.find_portkey()
    if found is None:
        hint = (
            "npm install --prefix DIR @portkey-ai/gateway, with Node on PATH, and set "
            f"${surfaces.PORTKEY_ENV}=DIR; see perf/README.md"
        )
        return {"status": "not installed", "hint": hint}
    info: dict[str, Any] = {"version": found.version, "entry": found.entry, "found_by": found.found_by}
    info["node"] = _node_version(found.node)
    try:
        procs["portkey"] = surfaces.start_portkey(found, upstreams, plan.cpu, out_dir)
    except RuntimeError as exc:
        print(f"matrix: Portkey {found.version} did not start: {exc}", flush=True)
        return {**info, "status": f"did not start: {exc}"}
    return {**info, "status": "measured"}


def _node_version(node: str) -> str:
    try:
        return subprocess.run([node, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


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


# A p99 is judged only on cells this long and this many rounds (shorter: a few stalls decide it).
P99_MIN_RUNS = 3
P99_MIN_DURATION_S = 3.0


def goals(rows: list[dict[str, Any]], surface: str = "blazar") -> list[dict[str, Any]]:
    """The goals for ``surface``, each with the figures it compares and whether it is met.

    ``met`` is True, False, or None when the figures cannot decide it (``why`` says so): an added
    figure at or below zero (the surface faster than direct: noise, not a result), a p99 from cells
    too short or too few. None is never counted as met.
    """
    out: list[dict[str, Any]] = []

    def ratio_goal(
        name: str,
        workload: str,
        c: int,
        key: str,
        limit: float,
        *,
        at_least: bool = False,
        added: bool = False,
    ) -> None:
        ours, theirs = _find(rows, workload, c, surface), _find(rows, workload, c, "nginx")
        if not ours or not theirs or ours.get(key) is None or theirs.get(key) is None:
            return
        goal: dict[str, Any] = {
            "goal": name,
            "blazar": ours[key],
            "nginx": theirs[key],
            "ratio": None,
            "limit": f"{'≥' if at_least else '≤'} {limit:g}× nginx",
            "met": None,
        }
        if theirs[key] <= 0 or (added and ours[key] <= 0):
            # A ratio to a difference at or below zero says nothing (and once said "met" for any value).
            who = "nginx's" if theirs[key] <= 0 else f"{surface}'s"
            goal["why"] = f"{who} figure is not above zero: not resolved"
        else:
            goal["ratio"] = value = ours[key] / theirs[key]
            goal["met"] = value >= limit if at_least else value <= limit
        out.append(goal)

    ratio_goal("added p50 at C=1 (json)", "json", 1, "added_p50_ms", 4.0, added=True)
    out.append(_p99_goal(_find(rows, "json", 1, surface), _find(rows, "json", 1, "direct")))
    ratio_goal("added time to first byte at C=1 (sse)", "sse", 1, "added_ttfb_p50_ms", 3.0, added=True)
    ratio_goal("req/s at C=64 (json)", "json", 64, "rps", 0.35, at_least=True)
    ratio_goal("CPU per request at C=1 (json)", "json", 1, "cpu_us_per_request", 3.0)
    ratio_goal("CPU per request at C=64 (json)", "json", 64, "cpu_us_per_request", 3.0)
    ratio_goal("CPU per SSE chunk at C=16 (sse)", "sse", 16, "cpu_us_per_chunk", 2.0)
    return [goal for goal in out if goal]


def _p99_goal(ours: dict[str, Any] | None, direct: dict[str, Any] | None) -> dict[str, Any]:
    """Added p99 at C=1 ≤ 0.5 ms, judged only where it can fail and where it can be trusted to pass."""
    if not ours or not direct or ours.get("added_p99_ms") is None:
        return {}
    goal: dict[str, Any] = {
        "goal": "added p99 at C=1 (json)",
        "blazar": ours["added_p99_ms"],
        "limit": "≤ 0.5 ms",
        "met": None,
    }
    runs = min(len(ours["runs"]), len(direct["runs"]))
    shortest = min(r["duration_s"] for r in (*ours["runs"], *direct["runs"]))
    if runs < P99_MIN_RUNS or shortest < P99_MIN_DURATION_S * 0.9:
        goal["why"] = (
            f"{runs} run(s), the shortest {shortest:.1f} s: a p99 needs {P99_MIN_RUNS} runs of "
            f"{P99_MIN_DURATION_S:g} s"
        )
    elif ours["added_p99_ms"] <= 0:
        goal["why"] = "not above zero (direct's own p99 was the higher): not resolved"
    else:
        goal["met"] = ours["added_p99_ms"] <= 0.5
    return goal
