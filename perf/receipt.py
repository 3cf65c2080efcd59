"""`python -m perf receipt`: the reference gateway's receipt, regenerated for blazar-proxy.

A real engine child (mlx-0.32.0 with the bench preset of the demo model, or a
model the user names) behind the gateway; the same non-streamed chat, direct
to the child and through the gateway, interleaved. Reports the warm mean,
tok/s and the overhead; streaming time to first data byte on both; content
parity at temperature 0; and aggregate tok/s at C=8.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from perf import report, surfaces

ENGINE = "mlx-0.32.0"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
PARITY_PROMPTS = ("Say hello.", "Count to ten.", "What is the capital of France?", "Describe the sea.")


@dataclass
class ReceiptPlan:
    cpu: int | None = 0
    # The engine child's core: apart from the gateway's, so that its compute
    # does not delay the gateway's turn on the CPU. None: same as `cpu`.
    engine_cpu: int | None = 1
    model: str | None = None
    preset: str = "bench"
    variant: str = "cpu"
    runs: int = 30
    warmup: int = 1
    stream_runs: int = 5
    max_tokens: int = 128
    concurrent: int = 8
    concurrent_rounds: int = 2


def _prepare_model(plan: ReceiptPlan) -> tuple[str, dict[str, Any]]:
    """The model directory to serve, installing the engine and the demo model if needed."""
    from engines import install
    from engines.home import Home, blazar_home
    from engines.manager import ensure_demo_model

    home = Home(blazar_home())
    _, installation = install.ensure_installed(ENGINE, plan.variant, home, progress=print)
    if plan.model:
        return plan.model, {"model": plan.model}
    path = ensure_demo_model(installation, home, plan.preset)
    return str(path), {"model": path.name, "preset": plan.preset, "resolved": installation.variant}


def _start_gateway(model: str, plan: ReceiptPlan, log_dir: Path) -> tuple[surfaces.Process, int]:
    port = surfaces.free_port()
    log_path = log_dir / f"receipt-gateway-{port}.log"
    argv = [
        sys.executable, "-m", "proxy", "--engine", ENGINE, "--engine-variant", plan.variant,
        "--model", model, "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            surfaces.pinned(argv, plan.cpu),
            cwd=surfaces.ROOT,
            env=surfaces.child_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        match = re.search(r"pid (\d+), port (\d+), ready in", log_path.read_text(errors="replace"))
        if match:
            if plan.engine_cpu is not None and plan.cpu is not None:
                _pin_process(int(match.group(1)), plan.engine_cpu)
            return surfaces.Process("blazar", proc, port), int(match.group(2))
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"gateway with engine did not get ready: {log_path.read_text(errors='replace')}")


def _pin_process(pid: int, cpu: int) -> None:
    """Move every thread of a running process to one core."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), {cpu})


def _chat(
    client: httpx.Client, base: str, model: str, prompt: str, max_tokens: int
) -> tuple[float, int, str, float | None]:
    """One chat: (wall s, completion tokens, content, the gateway's own ms from Server-Timing)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    started = time.perf_counter()
    response = client.post(f"{base}/v1/chat/completions", json=body)
    wall = time.perf_counter() - started
    response.raise_for_status()
    data = response.json()
    timing = re.search(r"gateway;dur=([0-9.]+)", response.headers.get("server-timing", ""))
    return (
        wall,
        int(data["usage"]["completion_tokens"]),
        str(data["choices"][0]["message"]["content"]),
        float(timing.group(1)) if timing else None,
    )


def _ttfb(client: httpx.Client, base: str, model: str, max_tokens: int) -> float:
    """Seconds to the first `data:` byte of a stream (SSE comments do not count)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    first = 0.0
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for chunk in response.iter_raw():
            if not first and b"data:" in chunk:
                first = time.perf_counter()
    return first - started


def run_receipt(plan: ReceiptPlan, out_dir: Path) -> dict[str, Any]:
    if plan.cpu is not None:
        os.sched_setaffinity(0, {plan.cpu})
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    model_path, model_info = _prepare_model(plan)
    gateway, child_port = _start_gateway(model_path, plan, log_dir)
    served = Path(model_path).resolve().name
    surfaces_ = {"direct": f"http://127.0.0.1:{child_port}", "gateway": gateway.url}
    timings: dict[str, list[dict[str, float]]] = {"direct": [], "gateway": []}
    ttfbs: dict[str, list[float]] = {"direct": [], "gateway": []}
    parity: list[dict[str, Any]] = []
    at_c: dict[str, list[float]] = {"direct": [], "gateway": []}
    try:
        with httpx.Client(trust_env=False, timeout=600) as client:
            for index in range(plan.warmup + plan.runs):
                order = ["direct", "gateway"] if index % 2 == 0 else ["gateway", "direct"]
                for name in order:
                    wall, tokens, _, own_ms = _chat(client, surfaces_[name], served, PROMPT, plan.max_tokens)
                    if index >= plan.warmup:
                        run: dict[str, float] = {"wall_s": wall, "completion_tokens": tokens}
                        if own_ms is not None:
                            run["gateway_own_ms"] = own_ms
                        timings[name].append(run)
            for index in range(plan.stream_runs):
                order = ["direct", "gateway"] if index % 2 == 0 else ["gateway", "direct"]
                for name in order:
                    ttfbs[name].append(_ttfb(client, surfaces_[name], served, plan.max_tokens))
            for prompt in PARITY_PROMPTS[: max(3, len(PARITY_PROMPTS) - 1)]:
                direct = _chat(client, surfaces_["direct"], served, prompt, 32)[2]
                proxied = _chat(client, surfaces_["gateway"], served, prompt, 32)[2]
                parity.append(
                    {"prompt": prompt, "identical": direct == proxied, "direct": direct, "gateway": proxied}
                )
        with (
            httpx.Client(
                trust_env=False, timeout=600, limits=httpx.Limits(max_connections=plan.concurrent)
            ) as client,
            concurrent.futures.ThreadPoolExecutor(plan.concurrent) as pool,
        ):
            for index in range(plan.concurrent_rounds):
                order = ["direct", "gateway"] if index % 2 == 0 else ["gateway", "direct"]
                for name in order:
                    base = surfaces_[name]
                    started = time.perf_counter()
                    results = list(
                        pool.map(
                            lambda _, base=base: _chat(client, base, served, PROMPT, plan.max_tokens),
                            range(plan.concurrent),
                        )
                    )
                    wall = time.perf_counter() - started
                    at_c[name].append(sum(r[1] for r in results) / wall)
    finally:
        gateway.stop()

    def mean(name: str) -> float:
        return statistics.fmean(t["wall_s"] for t in timings[name])

    def tok_s(name: str) -> float:
        return statistics.fmean(t["completion_tokens"] / t["wall_s"] for t in timings[name])

    # Runs were interleaved in pairs: the paired differences cancel drift.
    pairs_ms = [
        (g["wall_s"] - d["wall_s"]) * 1000 for d, g in zip(timings["direct"], timings["gateway"], strict=True)
    ]
    paired_sem_ms = statistics.stdev(pairs_ms) / len(pairs_ms) ** 0.5 if len(pairs_ms) > 1 else 0.0
    summary = {
        "paired_median_ms": statistics.median(pairs_ms),
        "paired_mean_ms": statistics.fmean(pairs_ms),
        "paired_ci95_ms": 1.96 * paired_sem_ms,
        "paired_stdev_ms": statistics.stdev(pairs_ms) if len(pairs_ms) > 1 else 0.0,
        "gateway_own_median_ms": statistics.median(t["gateway_own_ms"] for t in timings["gateway"]),
        "direct_stdev_ms": statistics.stdev(t["wall_s"] * 1000 for t in timings["direct"])
        if len(timings["direct"]) > 1
        else 0.0,
        "direct_mean_s": mean("direct"),
        "gateway_mean_s": mean("gateway"),
        "overhead_ms": (mean("gateway") - mean("direct")) * 1000,
        "overhead_pct": (mean("gateway") / mean("direct") - 1) * 100,
        "direct_tok_s": tok_s("direct"),
        "gateway_tok_s": tok_s("gateway"),
        "direct_ttfb_ms": statistics.median(ttfbs["direct"]) * 1000,
        "gateway_ttfb_ms": statistics.median(ttfbs["gateway"]) * 1000,
        "parity_prompts": len(parity),
        "parity_identical": sum(p["identical"] for p in parity),
        "direct_c_tok_s": statistics.fmean(at_c["direct"]),
        "gateway_c_tok_s": statistics.fmean(at_c["gateway"]),
    }
    return {
        "kind": "receipt",
        "engine": ENGINE,
        "variant": plan.variant,
        "model": model_info.get("model"),
        "model_info": model_info,
        "cpu": plan.cpu,
        "engine_cpu": plan.engine_cpu if plan.cpu is not None else None,
        "max_tokens": plan.max_tokens,
        "runs": plan.runs,
        "warmup": plan.warmup,
        "stream_runs": plan.stream_runs,
        "concurrent": plan.concurrent,
        "plan": asdict(plan),
        "summary": summary,
        "timings": timings,
        "ttfb_s": ttfbs,
        "parity": parity,
        "concurrent_tok_s": at_c,
        "environment": report.environment(_engine_versions()),
    }


def _engine_versions() -> dict[str, Any]:
    from engines import install
    from engines.home import Home, blazar_home

    manifest = install.read_manifest(Home(blazar_home()), ENGINE)
    if manifest is None:
        return {}
    import json

    data = json.loads(Home(blazar_home()).manifest(ENGINE).read_text())
    wanted = ("mlx==", "mlx-lm==", "mlx-cpu==", "mlx-cuda-12==", "mlx-cuda-13==", "transformers==")
    return {"engine_packages": [p for p in data.get("resolved", []) if p.lower().startswith(wanted)]}
