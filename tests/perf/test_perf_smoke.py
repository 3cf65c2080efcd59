"""The benchmark harness runs end to end for a few seconds, so it cannot rot.

No figure is asserted: timings belong in perf/, not in tests. What is checked
is that every surface ran, that the gateway served every request, and that
the reports were written.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _need(tool: str) -> None:
    if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is not installed: scripts/test installs it (apt-get install {tool})")
        pytest.skip(f"{tool} is not installed; scripts/test installs it")


def _run(*args: str, env: dict[str, str] | None = None) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "perf", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_matrix_smoke(tmp_path: Path) -> None:
    """`perf matrix --smoke` measures every default surface with no gateway errors; writes md, json, png."""
    _need("nginx")
    _need("wrk")
    _run("matrix", "--smoke", "--out", str(tmp_path))
    data = orjson.loads((tmp_path / "matrix.json").read_bytes())
    surfaces = {(r["workload"], r["surface"]) for r in data["rows"]}
    for workload in ("json", "sse"):
        for surface in ("direct", "blazar", "nginx", "floor", "fused", "blazar-httpx"):
            assert (workload, surface) in surfaces
    for row in data["rows"]:
        assert row["requests"] > 0, row
        if row["surface"] in ("blazar", "floor", "fused"):
            assert row["errors"] == 0, row
            assert row["cpu_us_per_request"] > 0
    assert {g["goal"] for g in data["goals"]} >= {
        "added p50 at C=1 (json)",
        "added p99 at C=1 (json)",
        "CPU per request at C=1 (json)",
    }
    # The json cells ran against the fast upstream, the sse cells against the fake engines.
    assert list(tmp_path.glob("logs/fast-upstream-*.log")) and list(tmp_path.glob("logs/fake-engine-*.log"))
    assert "## Goals" in (tmp_path / "matrix.md").read_text()
    assert (tmp_path / "matrix.png").read_bytes().startswith(b"\x89PNG")


def test_matrix_measures_the_gateway_as_shipped_beside_a_baseline(tmp_path: Path) -> None:
    """blazar and nginx log every request; --baseline adds blazar-base, and blazar-no-log logs nothing."""
    _need("nginx")
    _need("wrk")
    _run(
        "matrix", "--smoke", "--workloads", "json", "--surfaces", "direct,blazar,blazar-no-log,nginx",
        "--baseline", str(ROOT), "--out", str(tmp_path),
    )  # fmt: skip
    data = orjson.loads((tmp_path / "matrix.json").read_bytes())
    assert {r["surface"] for r in data["rows"]} == {
        "direct",
        "blazar",
        "blazar-base",
        "blazar-no-log",
        "nginx",
    }
    assert set(data["other_goals"]) == {"blazar-base", "blazar-no-log"}
    assert "## The same goals, other builds in this run" in (tmp_path / "matrix.md").read_text()

    def logged(pattern: str) -> int:
        (log,) = tmp_path.glob(pattern)
        return sum(1 for line in log.read_text().splitlines() if '"POST /v1/chat/completions' in line)

    requests = {r["surface"]: r["requests"] for r in data["rows"]}
    assert logged("logs/blazar-[0-9]*.log") >= requests["blazar"] > 0
    assert logged("logs/blazar-base-*.log") >= requests["blazar-base"] > 0
    assert logged("logs/blazar-no-log-*.log") == 0
    assert logged("nginx-*/access.log") >= requests["nginx"] > 0


def test_paired_smoke(tmp_path: Path) -> None:
    """`perf paired --smoke` loads each build at once and reports each one's CPU over blazar-no-log's."""
    _need("wrk")
    _run("paired", "--smoke", "--baseline", str(ROOT), "--out", str(tmp_path))
    text = (tmp_path / "paired.md").read_text()
    builds = [line.split("|")[2].strip() for line in text.splitlines() if line.startswith("| 1 |")]
    assert builds == ["blazar", "blazar-base", "blazar-no-log"]
    assert "| 1 | blazar-no-log | " in text and "| +0.0 |" in text


def test_paired_stream_smoke(tmp_path: Path) -> None:
    """`perf paired --workloads sse --smoke` streams through each build at once and reports each one's CPU."""
    _run("paired", "--smoke", "--workloads", "sse", "--baseline", str(ROOT), "--out", str(tmp_path))
    text = (tmp_path / "paired.md").read_text()
    assert text.splitlines()[2].startswith("sse (stream, 128 chunks")
    builds = [line.split("|")[2].strip() for line in text.splitlines() if line.startswith("| 1 |")]
    assert builds == ["blazar", "blazar-base", "blazar-no-log"]
    cpu = [float(line.split("|")[3]) for line in text.splitlines() if line.startswith("| 1 |")]
    assert all(value > 0 for value in cpu), text


@pytest.fixture(scope="module")
def receipt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One `perf receipt --smoke` run, for the tests that read its reports."""
    out = tmp_path_factory.mktemp("receipt")
    home = os.environ.get("BLAZAR_TEST_HOME") or str(Path.home() / ".cache" / "blazar-test")
    _run("receipt", "--smoke", "--out", str(out), env={"BLAZAR_HOME": home})
    return out


def test_receipt_smoke(receipt_dir: Path) -> None:
    """`perf receipt --smoke` runs the real engine direct and through the gateway, with content parity."""
    data = orjson.loads((receipt_dir / "receipt.json").read_bytes())
    summary = data["summary"]
    assert summary["parity_identical"] == summary["parity_prompts"] == 3
    assert data["timings"]["direct"] and data["timings"]["gateway"]
    assert summary["streams_done"] == summary["streams"] > 0
    assert data["environment"]["git_sha"]
    assert "| via blazar-proxy |" in (receipt_dir / "receipt.md").read_text()


def test_receipt_reports_server_timing_and_parity(receipt_dir: Path) -> None:
    """The receipt reports the gateway's own time from Server-Timing and a parity table of the 3 prompts."""
    from perf.receipt import PARITY_PROMPTS

    data = orjson.loads((receipt_dir / "receipt.json").read_bytes())
    summary = data["summary"]
    assert summary["gateway_own_runs"] == len(data["timings"]["gateway"])
    assert summary["gateway_own_p50_ms"] > 0
    assert summary["gateway_own_max_ms"] >= summary["gateway_own_p50_ms"]
    assert all(run["gateway_ms"] is None for run in data["timings"]["direct"])
    text = (receipt_dir / "receipt.md").read_text()
    assert "Server-Timing" in text
    assert f"{summary['gateway_own_p50_ms']:.3f} ms / {summary['gateway_own_max_ms']:.3f} ms" in text
    assert "## Parity at temperature 0" in text
    for prompt in PARITY_PROMPTS:
        assert f"| {prompt} |" in text
