"""`python -m perf receipt`: the reference gateway's receipt, regenerated for blazar-proxy on a real model.

A real engine child (mlx-0.32.0 unless ``--engine`` names another, e.g.
llamacpp-b11434; by default the built-in SmolLM2-135M-Instruct,
``--model builtin:smollm2``) behind the gateway, which runs as a user runs it
(its defaults: access log and metrics on). The same non-streamed chat goes
direct to the child and through the gateway, interleaved. Reported: the warm
mean, tok/s and the wall-clock overhead; the gateway's own time from its
``Server-Timing: gateway;dur`` header (on a CPU engine the engine's jitter is
far larger than the overhead); streaming time to the first data byte on both;
content parity of three prompts at temperature 0; and, when asked for
(``--concurrent N``), aggregate tok/s at C=N.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from perf import report, surfaces
from tests.helpers import free_port

ENGINE = "mlx-0.32.0"
# What the report calls the engine's own server, by engine kind.
SERVERS = {"mlx": "mlx_lm.server", "llamacpp": "llama-server"}
PROMPT = "Explain in two sentences why the sky is blue."
# The timed prompt first: its parity is read from the timed runs themselves.
PARITY_PROMPTS = (PROMPT, "What is the capital of France?", "Count from 1 to 5.")
DEFAULT_MODEL = "builtin:smollm2"


class ReceiptError(RuntimeError):
    """The receipt cannot run as asked (a model that cannot be had, a gateway that does not start)."""


@dataclass
class ReceiptPlan:
    engine: str = ENGINE
    cpu: int | None = 0
    # The engine child's core: apart from the gateway's, so that its compute
    # does not delay the gateway's turn on the CPU. None: same as `cpu`.
    engine_cpu: int | None = 1
    # "builtin:NAME" (smollm2, or the random-weight tiny/bench) or a model directory.
    model: str = DEFAULT_MODEL
    variant: str = "cpu"
    runs: int = 5
    warmup: int = 1
    stream_runs: int = 5
    # A stream is read to its end; only its first data byte is timed, so it can be short.
    stream_max_tokens: int = 16
    max_tokens: int = 128
    # Aggregate tok/s with this many requests at once; 0: not measured.
    concurrent: int = 0
    concurrent_rounds: int = 1


@dataclass(frozen=True)
class Answer:
    """One non-stream chat as the client saw it."""

    wall_s: float
    completion_tokens: int
    content: str
    finish_reason: str | None
    gateway_ms: float | None
    upstream_ms: float | None


def server_timing(header: str) -> tuple[float | None, float | None]:
    """(gateway;dur, upstream;dur) in ms from a Server-Timing header; None where absent."""

    def dur(name: str) -> float | None:
        match = re.search(rf"(?:^|,)\s*{name};dur=([0-9.]+)", header)
        return float(match.group(1)) if match else None

    return dur("gateway"), dur("upstream")


def resolve_model(
    spec: str, installation: Any, home: Any, progress: Callable[[str], None]
) -> tuple[Path, dict[str, Any]]:
    """The model directory for ``--model``: ``builtin:NAME`` or a path."""
    from engines import builtin

    if not spec.startswith(builtin.PREFIX):
        path = Path(spec).expanduser()
        if not path.exists():
            raise ReceiptError(f"--model {spec}: no such file or directory")
        return path.resolve(), {"source": spec, "path": str(path.resolve())}
    try:
        name = builtin.parse(spec)
    except builtin.BuiltinError as exc:
        raise ReceiptError(f"--model {spec}: {exc}") from None
    assert name is not None
    path = builtin.ensure_builtin(name, installation, home, progress)
    return path, {"source": spec, "path": str(path), "via": "engines.builtin.ensure_builtin"}


def _prepare_model(plan: ReceiptPlan) -> tuple[Path, dict[str, Any]]:
    """Install the engine if needed; the model directory to serve."""
    from engines import install
    from engines.home import Home, blazar_home

    home = Home(blazar_home())
    _, installation = install.ensure_installed(plan.engine, plan.variant, home, progress=print)
    return resolve_model(plan.model, installation, home, print)


def model_argument(spec: str, path: Path) -> str:
    """What the gateway is given as ``--model``: a built-in by its name, as a user gives it; else the path."""
    return spec if spec.startswith("builtin:") else str(path)


def _start_gateway(model: Path, plan: ReceiptPlan, log_dir: Path) -> tuple[surfaces.Process, int, int, str]:
    """The gateway with its defaults, serving ``model``: (process, the child's pid and port, served name)."""
    gateway, child_pid, child_port, served = start_gateway(
        plan.engine, plan.variant, model_argument(plan.model, model), plan.cpu, log_dir, "receipt"
    )
    if plan.engine_cpu is not None and plan.cpu is not None:
        pin_process(child_pid, plan.engine_cpu)
    return gateway, child_pid, child_port, served


def start_gateway(
    engine: str, variant: str, model: str | None, cpu: int | None, log_dir: Path, label: str
) -> tuple[surfaces.Process, int, int, str]:
    """``blazar-proxy --engine ENGINE [--model M]`` with its defaults otherwise, ready.

    (process, the engine child's pid and port, the served model name).
    """
    port = free_port()
    log_path = log_dir / f"{label}-gateway-{port}.log"
    argv = [
        sys.executable, "-m", "proxy", "--engine", engine, "--engine-variant", variant, "--port", str(port),
    ]  # fmt: skip
    if model is not None:
        argv += ["--model", model]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            surfaces.pinned(argv, cpu),
            cwd=surfaces.ROOT,
            env=surfaces.child_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    gateway = surfaces.Process("blazar", proc, port)
    try:
        surfaces.wait_until_ready(f"{gateway.url}/readyz", proc, timeout_s=900)
        child_pid, child_port = engine_child(proc.pid)
        with httpx.Client(trust_env=False, timeout=10) as client:
            served = str(client.get(f"{gateway.url}/v1/models").json()["data"][0]["id"])
    except Exception as exc:
        gateway.stop()
        raise ReceiptError(
            f"the gateway did not get ready ({exc}); its log, {log_path}:\n"
            + log_path.read_text(errors="replace")[-3000:]
        ) from exc
    return gateway, child_pid, child_port, served


def engine_child(gateway_pid: int) -> tuple[int, int]:
    """(pid, port) of the gateway's engine child: the descendant started with ``--port``."""
    pending, seen = [gateway_pid], set()
    while pending:
        pid = pending.pop()
        seen.add(pid)
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if pid != gateway_pid and b"--port" in argv:
                return pid, int(argv[argv.index(b"--port") + 1])
            for task in os.listdir(f"/proc/{pid}/task"):
                children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
                pending += [int(c) for c in children if int(c) not in seen]
    raise ReceiptError(f"no engine child under the gateway (pid {gateway_pid})")


def child_cmdline(pid: int) -> list[str]:
    """A running process's command line ([] once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def pin_process(pid: int, cpu: int) -> None:
    """Move every thread of a running process to one core."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), {cpu})


def _body(model: str, prompt: str, max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if stream:
        body["stream"] = True
    return body


def _chat(client: httpx.Client, base: str, model: str, prompt: str, max_tokens: int) -> Answer:
    started = time.perf_counter()
    response = client.post(f"{base}/v1/chat/completions", json=_body(model, prompt, max_tokens))
    wall = time.perf_counter() - started
    response.raise_for_status()
    data = response.json()
    choice = data["choices"][0]
    own, upstream = server_timing(response.headers.get("server-timing", ""))
    return Answer(
        wall_s=wall,
        completion_tokens=int(data["usage"]["completion_tokens"]),
        content=str(choice["message"]["content"]),
        finish_reason=choice.get("finish_reason"),
        gateway_ms=own,
        upstream_ms=upstream,
    )


def _stream(client: httpx.Client, base: str, model: str, max_tokens: int) -> dict[str, Any]:
    """One stream read to its end: seconds to the first ``data:`` byte (SSE comments do not count)."""
    started = time.perf_counter()
    first = 0.0
    tail = b""
    body = _body(model, PROMPT, max_tokens, stream=True)
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        own, _ = server_timing(response.headers.get("server-timing", ""))
        for chunk in response.iter_raw():
            if not first and b"data:" in (tail + chunk):
                first = time.perf_counter()
            tail = (tail + chunk)[-64:]
    return {"ttfb_s": first - started, "done": b"[DONE]" in tail, "gateway_ms": own}


def _alternating(index: int) -> list[str]:
    return ["direct", "gateway"] if index % 2 == 0 else ["gateway", "direct"]


def run_receipt(plan: ReceiptPlan, out_dir: Path) -> dict[str, Any]:
    if plan.cpu is not None:
        os.sched_setaffinity(0, {plan.cpu})
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    model_path, model_info = _prepare_model(plan)
    gateway, child_pid, child_port, served = _start_gateway(model_path, plan, log_dir)
    child_argv = child_cmdline(child_pid)
    bases = {"direct": f"http://127.0.0.1:{child_port}", "gateway": gateway.url}
    answers: dict[str, list[Answer]] = {"direct": [], "gateway": []}
    warmups: dict[str, list[Answer]] = {"direct": [], "gateway": []}
    streams: dict[str, list[dict[str, Any]]] = {"direct": [], "gateway": []}
    others: dict[str, dict[str, Answer]] = {}
    at_c: dict[str, list[float]] = {"direct": [], "gateway": []}
    try:
        with httpx.Client(trust_env=False, timeout=900) as client:
            for index in range(plan.warmup + plan.runs):
                for name in _alternating(index):
                    answer = _chat(client, bases[name], served, PROMPT, plan.max_tokens)
                    (answers if index >= plan.warmup else warmups)[name].append(answer)
                    print(
                        f"receipt: {'run' if index >= plan.warmup else 'warmup'} {name:7} "
                        f"{answer.wall_s:.3f} s, {answer.completion_tokens} tokens, "
                        f"gateway;dur {answer.gateway_ms}",
                        flush=True,
                    )
            for index in range(plan.stream_runs):
                for name in _alternating(index):
                    streams[name].append(_stream(client, bases[name], served, plan.stream_max_tokens))
            for prompt in PARITY_PROMPTS[1:]:
                others[prompt] = {
                    name: _chat(client, bases[name], served, prompt, plan.max_tokens)
                    for name in ("direct", "gateway")
                }
        if plan.concurrent > 0:
            at_c = _at_concurrency(plan, bases, served)
    finally:
        gateway.stop()
    parity = [_parity(PROMPT, warmups["direct"] + answers["direct"], warmups["gateway"] + answers["gateway"])]
    parity += [_parity(p, [pair["direct"]], [pair["gateway"]]) for p, pair in others.items()]
    return {
        "kind": "receipt",
        "engine": plan.engine,
        "engine_server": engine_server(plan.engine),
        "variant": plan.variant,
        "model": served,
        "model_info": model_info,
        "prompt": PROMPT,
        "cpu": plan.cpu,
        "engine_cpu": plan.engine_cpu if plan.cpu is not None else None,
        "max_tokens": plan.max_tokens,
        "stream_max_tokens": plan.stream_max_tokens,
        "runs": plan.runs,
        "warmup": plan.warmup,
        "stream_runs": plan.stream_runs,
        "concurrent": plan.concurrent,
        "plan": asdict(plan),
        "summary": summarize(answers, streams, parity, at_c),
        "timings": {name: [asdict(a) for a in runs] for name, runs in answers.items()},
        "streams": streams,
        "parity": parity,
        "concurrent_tok_s": at_c,
        "environment": report.environment(engine_versions(plan.engine, child_argv)),
    }


def _at_concurrency(plan: ReceiptPlan, bases: dict[str, str], served: str) -> dict[str, list[float]]:
    """Aggregate completion tok/s with ``plan.concurrent`` chats at once, per surface."""
    at_c: dict[str, list[float]] = {"direct": [], "gateway": []}
    limits = httpx.Limits(max_connections=plan.concurrent)
    with (
        httpx.Client(trust_env=False, timeout=900, limits=limits) as client,
        concurrent.futures.ThreadPoolExecutor(plan.concurrent) as pool,
    ):
        for index in range(plan.concurrent_rounds):
            for name in _alternating(index):
                base = bases[name]
                started = time.perf_counter()
                results = list(
                    pool.map(
                        lambda _, base=base: _chat(client, base, served, PROMPT, plan.max_tokens),
                        range(plan.concurrent),
                    )
                )
                at_c[name].append(sum(r.completion_tokens for r in results) / (time.perf_counter() - started))
    return at_c


def _parity(prompt: str, direct: list[Answer], gateway: list[Answer]) -> dict[str, Any]:
    """Whether every answer, direct and through the gateway, has the same content."""
    contents = {a.content for a in direct + gateway}
    return {
        "prompt": prompt,
        "answers": len(direct) + len(gateway),
        "identical": len(contents) == 1,
        "completion_tokens": direct[0].completion_tokens,
        "finish_reason": direct[0].finish_reason,
        "direct": direct[0].content,
        "gateway": gateway[0].content,
    }


def summarize(
    answers: dict[str, list[Answer]],
    streams: dict[str, list[dict[str, Any]]],
    parity: list[dict[str, Any]],
    at_c: dict[str, list[float]],
) -> dict[str, Any]:
    def mean(name: str) -> float:
        return statistics.fmean(a.wall_s for a in answers[name])

    def tok_s(name: str) -> float:
        return statistics.fmean(a.completion_tokens / a.wall_s for a in answers[name])

    def stdev(values: list[float]) -> float:
        return statistics.stdev(values) if len(values) > 1 else 0.0

    # Runs were interleaved in pairs: the paired differences cancel drift.
    pairs = zip(answers["direct"], answers["gateway"], strict=True)
    pairs_ms = [(g.wall_s - d.wall_s) * 1000 for d, g in pairs]
    own_ms = [a.gateway_ms for a in answers["gateway"] if a.gateway_ms is not None]
    stream_own_ms = [s["gateway_ms"] for s in streams["gateway"] if s.get("gateway_ms") is not None]
    ttfb = {name: [s["ttfb_s"] * 1000 for s in runs] for name, runs in streams.items()}
    return {
        "paired_median_ms": statistics.median(pairs_ms),
        "paired_mean_ms": statistics.fmean(pairs_ms),
        "paired_ci95_ms": 1.96 * stdev(pairs_ms) / len(pairs_ms) ** 0.5,
        "paired_stdev_ms": stdev(pairs_ms),
        "direct_stdev_ms": stdev([a.wall_s * 1000 for a in answers["direct"]]),
        "gateway_own_p50_ms": statistics.median(own_ms) if own_ms else None,
        "gateway_own_max_ms": max(own_ms) if own_ms else None,
        "gateway_own_runs": len(own_ms),
        "stream_gateway_own_p50_ms": statistics.median(stream_own_ms) if stream_own_ms else None,
        "stream_gateway_own_max_ms": max(stream_own_ms) if stream_own_ms else None,
        "direct_mean_s": mean("direct"),
        "gateway_mean_s": mean("gateway"),
        "completion_tokens": statistics.median(a.completion_tokens for a in answers["direct"]),
        "overhead_ms": (mean("gateway") - mean("direct")) * 1000,
        "overhead_pct": (mean("gateway") / mean("direct") - 1) * 100,
        "direct_tok_s": tok_s("direct"),
        "gateway_tok_s": tok_s("gateway"),
        "direct_ttfb_ms": statistics.median(ttfb["direct"]) if ttfb["direct"] else None,
        "gateway_ttfb_ms": statistics.median(ttfb["gateway"]) if ttfb["gateway"] else None,
        "direct_ttfb_max_ms": max(ttfb["direct"], default=None),
        "gateway_ttfb_max_ms": max(ttfb["gateway"], default=None),
        "streams_done": sum(bool(s["done"]) for runs in streams.values() for s in runs),
        "streams": sum(len(runs) for runs in streams.values()),
        "parity_prompts": len(parity),
        "parity_identical": sum(p["identical"] for p in parity),
        "direct_c_tok_s": statistics.fmean(at_c["direct"]) if at_c["direct"] else None,
        "gateway_c_tok_s": statistics.fmean(at_c["gateway"]) if at_c["gateway"] else None,
    }


def engine_server(engine: str) -> str:
    """The engine's own server, as the reports name it (mlx_lm.server, llama-server)."""
    from engines import spec as specs

    try:
        kind = specs.load(engine).kind
    except Exception:
        return engine
    return SERVERS.get(kind, engine)


def engine_versions(engine: str, child_argv: list[str] | None = None) -> dict[str, Any]:
    """The engine's name and the versions of its packages as installed; its server's own ``--version``.

    ``child_argv``: the running child's command line, whose executable is asked
    its version when it is not a Python (llama-server prints its build).
    """
    import json

    from engines import install
    from engines.home import Home, blazar_home

    home = Home(blazar_home())
    if install.read_manifest(home, engine) is None:
        return {"engine": engine}
    data = json.loads(home.manifest(engine).read_text())
    # The engine's own requirements, and what mlx_lm pulls in that decides its output.
    names = {re.split(r"[=<>~!\[ ]", p, maxsplit=1)[0].lower() for p in data.get("packages", [])}
    names |= {"mlx", "mlx-lm", "mlx-cpu", "mlx-cuda-12", "mlx-cuda-13", "transformers"}
    versions: dict[str, Any] = {
        "engine": engine,
        "engine_variant": data.get("variant"),
        "engine_packages": [p for p in data.get("resolved", []) if p.split("==")[0].lower() in names],
    }
    if child_argv and "python" not in Path(child_argv[0]).name:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            result = subprocess.run(
                [child_argv[0], "--version"], capture_output=True, text=True, timeout=20, check=False
            )
            versions["engine_server_version"] = " ".join((result.stdout + result.stderr).split())[:300]
    return versions
