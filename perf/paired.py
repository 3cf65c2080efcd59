"""`python -m perf paired`: blazar-proxy builds loaded at the same moments, for their CPU per request.

On a shared machine the load of other work changes from second to second,
and the matrix, which measures one surface after another, sees it as a
difference between surfaces: a gateway's CPU per request moved by 2× from
run to run here. This runs the builds side by side instead: each round
starts one wrk per build at the same moment (json, the fake engine, all on
one core), so every build meets the same load, and compares their CPU per
request round by round. The builds: ``blazar`` (this checkout, its
defaults), ``blazar-no-log`` (``--no-access-log``) and, with a baseline
checkout, ``blazar-base``. Quoted: the median over rounds of each build's
CPU µs per request less blazar-no-log's in the same round, which is what its
access log (and any other difference) costs.
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
from pathlib import Path
from typing import Any

from perf import surfaces
from perf.loadgen import CellResult, stream_load, wrk_load
from perf.matrix import PATH, WORKLOADS, body


def run_paired(
    out: Path,
    *,
    baseline: Path | None = None,
    ladder: tuple[int, ...] = (1, 64),
    rounds: int = 7,
    duration_s: float = 3.0,
    cpu: int | None = 0,
    workload: str = "json",
) -> dict[str, Any]:
    spec = WORKLOADS[workload]
    if spec.stream and cpu is not None:
        # The stream load generators run in this process: on the same core as the rest.
        os.sched_setaffinity(0, {cpu})
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    engines = [surfaces.start_fake_engine(cpu, log_dir) for _ in range(2)]
    upstreams = {"m1": engines[0].url, "m2": engines[1].url}
    builds: dict[str, surfaces.Process] = {}
    runs: dict[str, dict[str, list[float]]] = {}
    try:
        builds["blazar"] = surfaces.start_blazar(upstreams, cpu, log_dir)
        if baseline is not None:
            builds["blazar-base"] = surfaces.start_blazar(
                upstreams, cpu, log_dir, name="blazar-base", root=baseline.resolve()
            )
        builds["blazar-no-log"] = surfaces.start_blazar(
            upstreams, cpu, log_dir, "--no-access-log", name="blazar-no-log"
        )
        for concurrency in ladder:
            cell = runs.setdefault(str(concurrency), {name: [] for name in builds})
            for _ in range(rounds):
                before = {name: build.cpu_s() for name, build in builds.items()}
                with concurrent.futures.ThreadPoolExecutor(len(builds)) as pool:
                    loads = {
                        name: pool.submit(_load, build, spec.stream, spec.fake, concurrency, duration_s, cpu)
                        for name, build in builds.items()
                    }
                    results = {name: load.result() for name, load in loads.items()}
                for name, build in builds.items():
                    requests = results[name].requests
                    cell[name].append((build.cpu_s() - before[name]) * 1e6 / requests if requests else 0.0)
                print(
                    f"paired: C={concurrency:<3} "
                    + "  ".join(f"{name} {cell[name][-1]:.0f} µs/req" for name in builds),
                    flush=True,
                )
    finally:
        for build in builds.values():
            build.stop()
        for engine in engines:
            engine.stop()
    data = {
        "kind": "paired",
        "plan": {
            "ladder": list(ladder),
            "rounds": rounds,
            "duration_s": duration_s,
            "cpu": cpu,
            "workload": workload,
        },
        "baseline": str(baseline) if baseline is not None else None,
        "runs": runs,
    }
    (out / "paired.md").write_text(paired_markdown(data))
    return data


def _load(
    build: surfaces.Process, stream: bool, fake: str, concurrency: int, duration_s: float, cpu: int | None
) -> CellResult:
    """One build's load for a round: wrk, or the stream client reading every stream to its end."""
    if stream:
        return stream_load(
            "127.0.0.1",
            build.port,
            PATH,
            [body("m1", True)],
            connections=concurrency,
            duration_s=duration_s,
            headers={"x-fake": fake},
        )
    return wrk_load(
        build.url + PATH,
        [body("m1", False)],
        connections=concurrency,
        duration_s=duration_s,
        cpu=cpu,
        headers={"x-fake": fake},
    )


def paired_markdown(data: dict[str, Any]) -> str:
    plan = data["plan"]
    workload = WORKLOADS[plan.get("workload", "json")]
    load = "stream client" if workload.stream else "wrk"
    lines = [
        "# blazar-proxy builds, loaded side by side",
        "",
        f"{workload.name} ({workload.description}) through the fake engine; each round one {load} "
        "per build at the same moment, "
        f"{plan['duration_s']:g} s, {plan['rounds']} rounds, all on CPU {plan['cpu']}"
        + (f"; blazar-base is {data['baseline']}" if data.get("baseline") else "")
        + ". CPU µs per request of each build (median over rounds), and less blazar-no-log's "
        "in the same round (median of the differences).",
        "",
        "| C | build | CPU µs/req | over blazar-no-log | rounds |",
        "|---|---|---:|---:|---|",
    ]
    for concurrency, cell in data["runs"].items():
        for name, values in cell.items():
            floor = cell["blazar-no-log"]
            over = statistics.median(a - b for a, b in zip(values, floor, strict=True))
            shown = ", ".join(f"{v:.0f}" for v in values)
            lines.append(
                f"| {concurrency} | {name} | {statistics.median(values):.1f} | {over:+.1f} | {shown} |"
            )
    return "\n".join(lines) + "\n"
