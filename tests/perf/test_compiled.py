"""`python -m perf compiled`: a copy of the checkout with the request path compiled by mypyc, which serves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from perf.compiled import _PATCHES, _ROOT, MODULES, build


def test_each_module_and_patch_is_there() -> None:
    """Every module named is a source of this checkout, and each patch finds its text once."""
    assert all((_ROOT / name).is_file() for name in MODULES)
    for name, text, _ in _PATCHES:
        assert (_ROOT / name).read_text().count(text) == 1, name


def test_a_folder_it_did_not_make_is_left_alone(tmp_path: Path) -> None:
    """``--out`` naming a folder with files in it that no earlier run made: refused, nothing removed."""
    kept = tmp_path / "notes.txt"
    kept.write_text("mine")
    with pytest.raises(SystemExit, match="not a copy made here"):
        build(tmp_path)
    with pytest.raises(SystemExit, match="is a file"):
        build(kept)
    assert kept.read_text() == "mine"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_compiled_copy_serves_the_fast_path(tmp_path: Path) -> None:
    """Each module is an extension in the copy, and the in-process tests of the gateway pass there."""
    out = tmp_path / "copy"
    report = build(out)
    assert all(name in report for name in MODULES)
    code = (
        "import importlib, sys\n"
        f"names = {[name[:-3].replace('/', '.') for name in MODULES]!r}\n"
        "files = [importlib.import_module(n).__file__ for n in names]\n"
        "sys.exit(0 if all(f.endswith('.so') and f.startswith(sys.argv[1]) for f in files) else f'{files}')\n"
    )
    subprocess.run([sys.executable, "-c", code, str(out)], cwd=out, check=True)
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/proxy"],
        cwd=out,
        capture_output=True,
        text=True,
    )
    assert tests.returncode == 0, tests.stdout[-3000:]
