"""`python -m perf compiled`: a copy of the checkout with a set of modules compiled by mypyc."""

from __future__ import annotations

from pathlib import Path

import pytest

from perf.compiled import build


def test_a_folder_it_did_not_make_is_left_alone(tmp_path: Path) -> None:
    """``--out`` naming a folder with files in it that no earlier run made: refused, nothing removed."""
    kept = tmp_path / "notes.txt"
    kept.write_text("mine")
    with pytest.raises(SystemExit, match="not a copy made here"):
        build(tmp_path)
    with pytest.raises(SystemExit, match="is a file"):
        build(kept)
    assert kept.read_text() == "mine"


def test_a_module_the_checkout_lacks_is_refused_before_a_build(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no such module in this checkout: proxy/nothing\.py"):
        build(tmp_path / "copy", ["proxy/lean.py", "proxy/nothing.py"])
