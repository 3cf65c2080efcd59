"""`python -m perf inproc` runs each workload in process, through the paths it names, and reports them."""

from __future__ import annotations

from pathlib import Path

import pytest

from perf.inproc import WORKLOADS, run_inproc


def test_every_workload_is_measured_and_reported(tmp_path: Path) -> None:
    """Each workload ran (its requests answered 200 by the path it names, else the worker fails) and
    has its three figures in the report."""
    text = run_inproc(tmp_path, smoke=True, cpu=None)
    assert (tmp_path / "inproc.md").read_text() == text
    rows = [line.split("|")[1:4] for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert [(w.strip(), f.strip()) for w, f, _ in rows[1:]] == [
        (w, f) for w in WORKLOADS for f in ("opcodes", "calls and resumes", "CPU µs")
    ]
    # A request is a thousand opcodes or more interpreted, and compiled still the harness's own and
    # asyncio's (~200 a json request) and a score of calls: a tracer that saw none failed. Every
    # figure is measured: none is zero.
    figures = {(w.strip(), f.strip()): float(value) for w, f, value in rows[1:]}
    assert all(value > 0 for value in figures.values())
    assert all(figures[(w, "opcodes")] > 100 and figures[(w, "calls and resumes")] > 10 for w in WORKLOADS)


def test_a_worker_that_fails_says_why(tmp_path: Path) -> None:
    """A checkout that cannot be measured (no gateway there) is an error naming it, not a hang."""
    with pytest.raises(RuntimeError, match=r"measuring .* failed"):
        run_inproc(tmp_path, baseline=tmp_path, smoke=True, cpu=None)
