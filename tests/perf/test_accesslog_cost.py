"""`python -m perf accesslog` runs and reports each way of writing the access log, with the same output."""

from __future__ import annotations

from pathlib import Path

from perf.accesslog import FORMATS, WAYS, measure, run_accesslog
from proxy.accesslog import MAX_LINES


def test_report_has_a_row_per_way_and_format_and_the_same_lines(tmp_path: Path) -> None:
    """The report is written with a row for each way and format, and every way wrote the same bytes."""
    text = run_accesslog(tmp_path, quick=True)
    assert (tmp_path / "accesslog.md").read_text() == text
    rows = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert [(way.strip(), fmt.strip()) for way, fmt in rows[1:]] == [(w, f) for f in FORMATS for w in WAYS]
    assert "every way: yes" in text


def test_the_buffered_way_makes_no_system_call_per_line(tmp_path: Path) -> None:
    """Per-line logging writes once a line; the buffered log writes a batch at a time (counted, not timed)."""
    per_line = measure("per-line", "text", 1000, tmp_path, rounds=1)
    buffered = measure("buffered", "text", 1000, tmp_path, rounds=1)
    assert per_line.output == buffered.output
    assert len(buffered.output.splitlines()) == 1000
    if per_line.syscalls_per_1000 is not None and buffered.syscalls_per_1000 is not None:
        assert per_line.syscalls_per_1000 >= 1000
        # One write per batch: a batch is at most MAX_LINES lines (and the timer's, fewer).
        assert buffered.syscalls_per_1000 <= 1000 / MAX_LINES + 2
