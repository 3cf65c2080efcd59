"""`python -m perf assembly` runs and reports the built reply's CPU for each reply length."""

from __future__ import annotations

from pathlib import Path

import orjson

from perf.assembly import mlx_stream, run_assembly
from proxy.assembly import ReplyAssembler


def test_the_benchmark_streams_build_the_reply_they_describe() -> None:
    """The measured stream is a real one: it ends with [DONE] and builds a reply of its token count."""
    assembler = ReplyAssembler(chat=True)
    for chunk in mlx_stream(16):
        assembler.feed(chunk)
    assert assembler.done
    reply = orjson.loads(assembler.reply())
    assert reply["choices"][0]["message"]["content"] == " word" * 16
    assert reply["usage"]["completion_tokens"] == 16


def test_report_has_a_row_per_reply_length(tmp_path: Path) -> None:
    """The report is written to the output folder with a row for 16, 128 and 512 tokens."""
    text = run_assembly(tmp_path, quick=True)
    assert (tmp_path / "assembly.md").read_text() == text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["16", "128", "512"]
