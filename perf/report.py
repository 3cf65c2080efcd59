"""Writing results: JSON with every raw figure, a markdown report, a PNG plot, the environment."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
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
        "request_path": request_path(ROOT),
        **(extra or {}),
    }


def request_path(root: Path) -> str:
    """How the checkout at ``root`` runs its request path: "compiled", or "interpreted: why"
    (``proxy/compiled.py``), as ``python -m proxy`` run from there does."""
    code = "import proxy; print(getattr(getattr(proxy, 'compiled', None), 'STATE', 'interpreted: no build'))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.stdout.strip() or f"unknown ({done.stderr.strip()[-200:]})"


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
        f"blazar's request path: {env.get('request_path', 'not recorded')}"
        + (f"; blazar-base's: {env['baseline_request_path']}" if env.get("baseline_request_path") else "")
        + ".",
        f"All processes pinned to CPU {plan['cpu']}. {plan['duration_s']:g} s per run, "
        f"{plan['rounds']} rounds interleaved; figures are medians over rounds"
        + (
            f"; json at C=1 and C=64: at least {plan['goal_duration_s']:g} s per run; the cells the goals "
            f"read (those and sse at C=1 and C=16): at least {plan['goal_rounds']} rounds"
            if plan.get("goal_duration_s") or plan.get("goal_rounds")
            else ""
        )
        + ". json cells: the fast upstream (perf/fast_upstream.py, a fixed ~1 KB completion in one "
        "write, HTTP/1.1 keep-alive), an ~800-byte chat request from wrk (one thread), nginx with one "
        "upstream server and its default request buffering. Other cells: two fake engines "
        "(tests/fake_engine.py, HTTP/1.1 keep-alive), nginx round-robin over both with "
        "proxy_request_buffering off; stream load: an asyncio client (its own CPU per request is in "
        "the last column). As shipped: blazar-proxy with its defaults (access log on stderr, "
        "redirected to a file; metrics on), nginx with its default combined access log to a file."
        + (
            f" blazar-base: blazar-proxy from {plan['baseline']}, same defaults."
            if plan.get("baseline")
            else ""
        ),
        "",
        "## Goals",
        "",
        "| goal | blazar | nginx | ratio | limit | met |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {goal['goal']} | {_fmt(goal.get('blazar'))} | {_fmt(goal.get('nginx'))} | "
        f"{_fmt(goal.get('ratio'), 2)} | {goal['limit']} | {_met(goal)} |"
        for goal in data["goals"]
    ]
    lines += other_goals_markdown(data)
    lines += peers_markdown(data)
    lines += litellm_markdown(data)
    lines += portkey_markdown(data)
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


def other_goals_markdown(data: dict[str, Any]) -> list[str]:
    """The same goals for the other blazar-proxy builds of the run (the baseline, no access log)."""
    others: dict[str, list[dict[str, Any]]] = data.get("other_goals") or {}
    if not others:
        return []
    ours = {g["goal"]: g for g in data["goals"]}
    names = list(others)
    lines = [
        "",
        "## The same goals, other builds in this run",
        "",
        "| goal | nginx | blazar | " + " | ".join(names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for goal, mine in ours.items():
        cells = []
        for name in names:
            theirs = next((g for g in others[name] if g["goal"] == goal), None)
            cells.append(_goal_cell(theirs))
        lines.append(
            f"| {goal} | {_fmt(mine.get('nginx'))} | {_goal_cell(mine)} | " + " | ".join(cells) + " |"
        )
    return lines


def _met(goal: dict[str, Any]) -> str:
    """yes, **no**, or why the figures cannot decide (never counted as met)."""
    if goal["met"] is None:
        return f"**not judged**: {goal.get('why', 'no figures')}"
    return "yes" if goal["met"] else "**no**"


def _goal_cell(goal: dict[str, Any] | None) -> str:
    if goal is None:
        return "–"
    ratio = f" ({goal['ratio']:.2f}×)" if goal.get("ratio") is not None else ""
    verdict = "" if goal["met"] else " **no**" if goal["met"] is False else " (not judged)"
    return f"{_fmt(goal.get('blazar'))}{ratio}{verdict}"


def litellm_markdown(data: dict[str, Any]) -> list[str]:
    """LiteLLM's proxy beside blazar-proxy and nginx, or a line saying why it is not there."""
    info = data.get("litellm") or {"status": "not in this run"}
    if info["status"] != "measured":
        status = "not installed" if info["status"] == "not installed" else info["status"]
        hint = f" ({info['hint']})" if info.get("hint") else ""
        return ["", f"LiteLLM: {status}{hint}."]
    rows = data["rows"]
    ladder = sorted({r["concurrency"] for r in rows})
    top = 64 if 64 in ladder else ladder[-1]
    mid = 16 if 16 in ladder else ladder[-1]
    figures = [
        ("added p50 at C=1 (json), ms", "json", 1, "added_p50_ms", 3),
        ("added p99 at C=1 (json), ms", "json", 1, "added_p99_ms", 3),
        ("added time to first byte at C=1 (sse), ms", "sse", 1, "added_ttfb_p50_ms", 3),
        (f"req/s at C={top} (json)", "json", top, "rps", 0),
        ("CPU µs per request at C=1 (json)", "json", 1, "cpu_us_per_request", 1),
        (f"CPU µs per SSE chunk at C={mid} (sse)", "sse", mid, "cpu_us_per_chunk", 2),
    ]
    lines = [
        "",
        "## LiteLLM",
        "",
        f"LiteLLM {info['version']} (found by {info['found_by']}): its proxy with one uvicorn worker, the fake "
        "engines as `openai/<name>` models with api_base, no database, callbacks or message logging, "
        "its log at ERROR (no access log), x- headers forwarded (the fake engine's workload header).",
        "",
        "| figure | blazar | nginx | litellm | litellm ÷ blazar |",
        "|---|---|---|---|---|",
    ]
    for label, workload, c, key, digits in figures:
        values = {
            surface: (row or {}).get(key)
            for surface in ("blazar", "nginx", "litellm")
            for row in [_row(rows, workload, c, surface)]
        }
        ours, theirs = values["blazar"], values["litellm"]
        litellm_row = _row(rows, workload, c, "litellm")
        if litellm_row is not None and not litellm_row["requests"]:
            theirs = None
            shown = f"none finished in {data['plan']['duration_s']:g} s"
        else:
            shown = _fmt(theirs, digits)
        ratio = _ratio(theirs / ours) if ours and theirs is not None and ours > 0 else "–"
        lines.append(
            f"| {label} | {_fmt(ours, digits)} | {_fmt(values['nginx'], digits)} | {shown} | {ratio} |"
        )
    return lines


def portkey_markdown(data: dict[str, Any]) -> list[str]:
    """Portkey's gateway: how it ran, or a line saying why it is not there (its figures: the peers' table)."""
    info = data.get("portkey") or {"status": "not in this run"}
    if info["status"] != "measured":
        hint = f" ({info['hint']})" if info.get("hint") else ""
        return ["", f"Portkey: {info['status']}{hint}."]
    return [
        "",
        "## Portkey",
        "",
        f"Portkey's gateway {info['version']} (`@portkey-ai/gateway`, found by {info['found_by']}) on Node "
        f"{info.get('node') or '?'}: one process, `--headless` and NODE_ENV=production (no console, no log "
        "stream; it writes no line per request either way), routed by request headers: provider openai at "
        "a custom host (`x-portkey-custom-host`), or a conditional config on the model for two upstreams; "
        "`x-fake` forwarded.",
    ]


# The figures of the peers' table: (label, workload, concurrency, key, digits, higher is better).
_PEER_FIGURES = (
    ("added p50 at C=1 (json), ms", "json", 1, "added_p50_ms", 3, False),
    ("req/s at C=64 (json)", "json", 64, "rps", 0, True),
    ("CPU µs per request at C=1 (json)", "json", 1, "cpu_us_per_request", 1, False),
    ("CPU µs per request at C=64 (json)", "json", 64, "cpu_us_per_request", 1, False),
)


def peers_markdown(data: dict[str, Any]) -> list[str]:
    """The measured peers beside nginx and blazar-proxy, each figure also as a ratio to both.

    A ratio is the peer's figure over the other's, so for req/s below 1 is slower and for the rest
    above 1 is costlier.
    """
    peers = [p for p in ("litellm", "portkey") if (data.get(p) or {}).get("status") == "measured"]
    if not peers:
        return []
    rows = data["rows"]
    header = "| figure | nginx | blazar | " + " | ".join(f"{p} | {p} ÷ nginx | {p} ÷ blazar" for p in peers)
    lines = [
        "",
        "## Peers, same core, same upstream",
        "",
        "Each peer's figure, and its ratio to nginx's and to blazar-proxy's (for req/s below 1 is slower; "
        "for the rest above 1 costs more).",
        "",
        header + " |",
        "|---|---|---|" + "---|---|---|" * len(peers),
    ]
    for label, workload, c, key, digits, _ in _PEER_FIGURES:
        value = {
            surface: row.get(key) if row and row["requests"] else None
            for surface in ("nginx", "blazar", *peers)
            for row in [_row(rows, workload, c, surface)]
        }
        cells = [label, _fmt(value["nginx"], digits), _fmt(value["blazar"], digits)]
        for peer in peers:
            mine = value[peer]
            row = _row(rows, workload, c, peer)
            shown = (
                f"none finished in {data['plan']['duration_s']:g} s"
                if row is not None and not row["requests"]
                else _fmt(mine, digits)
            )
            cells.append(shown)
            for other in ("nginx", "blazar"):
                theirs = value[other]
                cells.append(_ratio(mine / theirs) if mine and theirs and mine > 0 and theirs > 0 else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _ratio(value: float) -> str:
    return f"{value:.0f}×" if value >= 100 else f"{value:.1f}×" if value >= 1 else f"{value:.3f}×"


def _row(rows: list[dict[str, Any]], workload: str, c: int, surface: str) -> dict[str, Any] | None:
    return next(
        (r for r in rows if (r["workload"], r["concurrency"], r["surface"]) == (workload, c, surface)), None
    )


_COLORS = {
    "direct": "tab:gray",
    "blazar": "tab:blue",
    "blazar-base": "tab:cyan",
    "blazar-no-log": "tab:purple",
    "nginx": "tab:green",
    "floor": "tab:olive",
    "fused": "tab:pink",
    "blazar-httpx": "tab:red",
    "litellm": "tab:orange",
    "portkey": "tab:brown",
}


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


def _cell(text: str, limit: int = 600) -> str:
    """Model output as one markdown table cell: newlines shown as ⏎, pipes escaped, cut at ``limit``."""
    flat = text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "⏎")
    return flat if len(flat) <= limit else flat[:limit] + "…"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _ms(value: float | None, digits: int = 3, unit: str = " ms") -> str:
    return "–" if value is None else f"{value:.{digits}f}{unit}"


def engine_line(env: dict[str, Any]) -> str:
    """The engine's packages and its server's own version, as the environment recorded them."""
    parts = []
    if env.get("engine_packages"):
        parts.append(", ".join(env["engine_packages"]))
    if env.get("engine_server_version"):
        parts.append(f"`--version`: {env['engine_server_version']}")
    return f" Engine: {'; '.join(parts)}." if parts else ""


def receipt_markdown(data: dict[str, Any]) -> str:
    env = data["environment"]
    s = data["summary"]
    info = data.get("model_info", {})
    request_ms = s["gateway_mean_s"] * 1000
    own_share = (
        f" ({s['gateway_own_p50_ms'] / request_ms * 100:.4f} % of the request)"
        if s.get("gateway_own_p50_ms") is not None
        else ""
    )
    pinning = (
        f"client and gateway pinned to CPU {data['cpu']}, engine child to CPU {data.get('engine_cpu')}"
        if data["cpu"] is not None
        else "nothing pinned"
    )
    server = data.get("engine_server", "mlx_lm.server")
    lines = [
        "# blazar-proxy receipt",
        "",
        f"Engine {data['engine']} ({data['variant']}), model `{data['model']}` "
        f"(`{info.get('source', '?')}`{', via ' + info['via'] if info.get('via') else ''}); "
        f"git {env['git_sha'][:12]}{' (dirty)' if env['git_dirty'] else ''}, {env['cpu']}, {env['cpus']} CPUs"
        f"{', GPU ' + env['gpu'] if env.get('gpu') else ''}; {pinning}. "
        "The gateway runs with its defaults (access log and metrics on)." + engine_line(env),
        f'Non-stream chat "{data.get("prompt", "")}", max_tokens {data["max_tokens"]}, temperature 0; '
        f"{_count(data['runs'], 'run')} per surface after {data['warmup']} warmup, direct and gateway interleaved "
        "(the order alternates).",
        "",
        "| Surface | warm mean | tokens | tok/s | overhead (wall clock) | gateway's own time (Server-Timing), p50 / max |",
        "|---|---|---|---|---|---|",
        f"| direct {server} | {s['direct_mean_s']:.3f} s | {s['completion_tokens']:g} | "
        f"~{s['direct_tok_s']:.1f} | — | — |",
        f"| via blazar-proxy | {s['gateway_mean_s']:.3f} s | {s['completion_tokens']:g} | ~{s['gateway_tok_s']:.1f} | "
        f"{s['overhead_ms']:+.2f} ms ({s['overhead_pct']:+.2f} %), {s['gateway_tok_s'] - s['direct_tok_s']:+.2f} tok/s | "
        f"{_ms(s.get('gateway_own_p50_ms'))} / {_ms(s.get('gateway_own_max_ms'))} |",
        "",
        f"The gateway's own time is its `Server-Timing: gateway;dur` header, over "
        f"{_count(s.get('gateway_own_runs', 0), 'run')}: from the request's arrival to the response head's departure, less the wait for the engine; "
        f"p50 {_ms(s.get('gateway_own_p50_ms'))}{own_share}. The wall clock cannot resolve it: "
        f"paired differences (gateway − direct, run by run) have mean {s['paired_mean_ms']:+.2f} ± "
        f"{s['paired_ci95_ms']:.2f} ms (95 % CI), median {s['paired_median_ms']:+.2f} ms, stdev "
        f"{s['paired_stdev_ms']:.2f} ms; one direct run's own stdev is {s['direct_stdev_ms']:.2f} ms: the engine's "
        "jitter, not the gateway, sets the error bars.",
        "",
        "## Streaming: time to the first data byte",
        "",
        f"The same prompt streamed (max_tokens {data.get('stream_max_tokens', '?')}, read to the end), "
        f"{_count(data['stream_runs'], 'run')} per surface interleaved; SSE comments are not counted. "
        f"{s.get('streams_done', 0)}/{s.get('streams', 0)} streams ended with `data: [DONE]`.",
        "",
        "| Surface | TTFB p50 | TTFB max | added p50 | gateway's own time to the head, p50 / max |",
        "|---|---|---|---|---|",
        f"| direct {server} | {_ms(s['direct_ttfb_ms'], 2)} | {_ms(s.get('direct_ttfb_max_ms'), 2)} | — | — |",
        f"| via blazar-proxy | {_ms(s['gateway_ttfb_ms'], 2)} | {_ms(s.get('gateway_ttfb_max_ms'), 2)} | "
        + (
            f"{s['gateway_ttfb_ms'] - s['direct_ttfb_ms']:+.2f} ms"
            if s["gateway_ttfb_ms"] is not None and s["direct_ttfb_ms"] is not None
            else "–"
        )
        + f" | {_ms(s.get('stream_gateway_own_p50_ms'))} / {_ms(s.get('stream_gateway_own_max_ms'))} |",
        "",
        "## Parity at temperature 0",
        "",
        f"{s['parity_identical']}/{s['parity_prompts']} prompts byte-identical in content, direct and through "
        f"the gateway (max_tokens {data['max_tokens']}; the first prompt over every timed and warmup run).",
        "",
        "| prompt | answers compared | identical | tokens | finish | content (direct) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {_cell(p['prompt'])} | {p.get('answers', 2)} | {'yes' if p['identical'] else '**no**'} | "
        f"{p.get('completion_tokens', '–')} | {p.get('finish_reason') or '–'} | {_cell(p['direct'])} |"
        for p in data["parity"]
    ]
    if s.get("direct_c_tok_s"):
        lines += [
            "",
            f"## At C={data['concurrent']}",
            "",
            f"Aggregate completion tok/s: direct {s['direct_c_tok_s']:.1f}, gateway {s['gateway_c_tok_s']:.1f} "
            f"({(s['gateway_c_tok_s'] / s['direct_c_tok_s'] - 1) * 100:+.1f} %).",
        ]
    return "\n".join(lines) + "\n"
