"""Writing results: JSON with every raw figure, a markdown report, a PNG plot, the environment."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import orjson

from perf.surfaces import ROOT


def environment(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Versions, machine and git SHA, recorded with every result."""
    import httptools
    import starlette
    import uvicorn
    import uvloop

    from proxy import __version__

    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "blazar_proxy": __version__,
        "git_sha": _run(["git", "-C", str(ROOT), "rev-parse", "HEAD"]),
        "git_dirty": bool(_run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])),
        "python": platform.python_version(),
        "uvicorn": uvicorn.__version__,
        "uvloop": getattr(uvloop, "__version__", ""),
        "httptools": httptools.__version__,
        "starlette": starlette.__version__,
        "nginx": _run(["nginx", "-v"], stderr=True),
        "wrk": (_run(["wrk", "-v"]) + _run(["wrk", "-v"], stderr=True)).split(" Copyright")[0].strip(),
        "cpu": cpu_model,
        "cpus": os.cpu_count(),
        "gpu": _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]) or None,
        "kernel": platform.release(),
        **(extra or {}),
    }


def _run(argv: list[str], *, stderr: bool = False) -> str:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return (result.stderr if stderr else result.stdout).strip()


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def matrix_markdown(data: dict[str, Any]) -> str:
    plan = data["plan"]
    env = data["environment"]
    lines = [
        "# blazar-proxy matrix",
        "",
        f"git {env['git_sha'][:12]}{' (dirty)' if env['git_dirty'] else ''}, {env['cpu']}, "
        f"{env['cpus']} CPUs, Python {env['python']}, {env['nginx']}, {env['wrk']}.",
        f"All processes pinned to CPU {plan['cpu']}. {plan['duration_s']:g} s per run, "
        f"{plan['rounds']} rounds interleaved; figures are medians over rounds. Upstream: the fake "
        "engine (HTTP/1.1 keep-alive). Non-stream load: wrk; stream load: an asyncio client "
        "(its own CPU per request is in the last column).",
        "",
        "## Goals",
        "",
        "| goal | blazar | nginx | ratio | limit | met |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {goal['goal']} | {_fmt(goal.get('blazar'))} | {_fmt(goal.get('nginx'))} | "
        f"{_fmt(goal.get('ratio'), 2)} | {goal['limit']} | {'yes' if goal['met'] else '**no**'} |"
        for goal in data["goals"]
    ]
    workloads = list(dict.fromkeys(r["workload"] for r in data["rows"]))
    for workload in workloads:
        lines += [
            "",
            f"## {workload}",
            "",
            "| C | surface | p50 ms | p99 ms | added p50 | added p99 | TTFB p50 | added TTFB | req/s | "
            "CPU µs/req | CPU µs/chunk | errors | client µs/req |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in (r for r in data["rows"] if r["workload"] == workload):
            lines.append(
                f"| {row['concurrency']} | {row['surface']} | {_fmt(row['p50_ms'])} | {_fmt(row['p99_ms'])} | "
                f"{_fmt(row.get('added_p50_ms'))} | {_fmt(row.get('added_p99_ms'))} | "
                f"{_fmt(row['ttfb_p50_ms'])} | {_fmt(row.get('added_ttfb_p50_ms'))} | {_fmt(row['rps'], 0)} | "
                f"{_fmt(row['cpu_us_per_request'], 1)} | {_fmt(row['cpu_us_per_chunk'], 2)} | {row['errors']} | "
                f"{_fmt(row['client_cpu_us_per_request'], 1)} |"
            )
    return "\n".join(lines) + "\n"


_COLORS = {"direct": "tab:gray", "blazar": "tab:blue", "nginx": "tab:green", "blazar-httpx": "tab:red"}


def matrix_plot(data: dict[str, Any], path: Path) -> bool:
    """Added p50 latency and req/s against concurrency, per surface and workload."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    workloads = list(dict.fromkeys(r["workload"] for r in data["rows"]))
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.2 * len(workloads)), squeeze=False)
    for row_index, workload in enumerate(workloads):
        rows = [r for r in data["rows"] if r["workload"] == workload]
        for surface in dict.fromkeys(r["surface"] for r in rows):
            mine = [r for r in rows if r["surface"] == surface]
            xs = [r["concurrency"] for r in mine]
            color = _COLORS.get(surface)
            if surface != "direct":
                added = [(r.get("added_p50_ms") or 0.0) * 1000 for r in mine]
                axes[row_index][0].plot(xs, added, marker="o", label=surface, color=color)
            axes[row_index][1].plot(xs, [r["rps"] or 0 for r in mine], marker="o", label=surface, color=color)
        for col, title in enumerate(("added p50 latency (µs)", "req/s")):
            ax = axes[row_index][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_title(f"{workload}: {title}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        axes[row_index][0].set_yscale("symlog", linthresh=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def receipt_markdown(data: dict[str, Any]) -> str:
    env = data["environment"]
    s = data["summary"]
    lines = [
        "# blazar-proxy receipt",
        "",
        f"Engine {data['engine']} ({data['variant']}), model {data['model']}; "
        f"git {env['git_sha'][:12]}{' (dirty)' if env['git_dirty'] else ''}, {env['cpu']}, {env['cpus']} CPUs"
        f"{', GPU ' + env['gpu'] if env.get('gpu') else ''}; client and gateway pinned to CPU {data['cpu']}, "
        f"engine child to CPU {data.get('engine_cpu')}.",
        f"Non-stream chat, fixed prompt, max_tokens {data['max_tokens']}, temperature 0; "
        f"{data['runs']} runs per surface after {data['warmup']} warmup, direct and gateway interleaved.",
        "",
        "| Surface | warm mean | tok/s | overhead |",
        "|---|---|---|---|",
        f"| direct mlx_lm.server | {s['direct_mean_s']:.3f} s | ~{s['direct_tok_s']:.0f} | — |",
        f"| via blazar-proxy | {s['gateway_mean_s']:.3f} s | ~{s['gateway_tok_s']:.0f} | "
        f"{s['overhead_ms']:+.2f} ms ({s['overhead_pct']:+.2f} %), {s['gateway_tok_s'] - s['direct_tok_s']:+.1f} tok/s |",
        "",
        f"Paired differences (gateway − direct, run by run): mean {s['paired_mean_ms']:+.2f} ± {s['paired_ci95_ms']:.2f} ms "
        f"(95 % CI), median {s['paired_median_ms']:+.2f} ms, stdev {s['paired_stdev_ms']:.2f} ms; one direct run's own "
        f"stdev is {s['direct_stdev_ms']:.2f} ms, so the engine's jitter, not the gateway, sets the error bars.",
        "",
        f"The gateway's own time per request (its Server-Timing `gateway;dur`, median): "
        f"{s['gateway_own_median_ms']:.3f} ms, {s['gateway_own_median_ms'] / (s['direct_mean_s'] * 1000) * 100:.3f} % "
        f"of the request.",
        "",
        f"Streaming time to first data byte (median of {data['stream_runs']}): direct "
        f"{s['direct_ttfb_ms']:.2f} ms, gateway {s['gateway_ttfb_ms']:.2f} ms "
        f"({s['gateway_ttfb_ms'] - s['direct_ttfb_ms']:+.2f} ms). SSE comments are not counted.",
        "",
        f"Parity: {s['parity_identical']}/{s['parity_prompts']} prompts byte-identical in content.",
        "",
        f"At C={data['concurrent']}: direct {s['direct_c_tok_s']:.0f} tok/s, gateway {s['gateway_c_tok_s']:.0f} "
        f"tok/s ({(s['gateway_c_tok_s'] / s['direct_c_tok_s'] - 1) * 100 if s['direct_c_tok_s'] else 0:+.1f} %).",
    ]
    return "\n".join(lines) + "\n"
