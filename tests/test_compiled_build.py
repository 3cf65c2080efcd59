"""proxy/compiled.py: the compiled request path used only where it is the sources' build, all or none."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import proxy.lean
from proxy import compiled
from proxy.compiled import MANIFEST, MODULES, _check, _FromSource, manifest

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _build(root: Path, *, extensions: bool = True, record: bool = True) -> None:
    """A tree as an install leaves it: each module's source, its extension beside it, the record."""
    for name in (*MODULES, "proxy/app.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"WHERE = {name!r}\n")
        if extensions and name in MODULES:
            (root / name).with_suffix(SUFFIX).write_bytes(b"not an extension")
    if record:
        (root / "proxy" / MANIFEST).write_text(manifest(root, MODULES))


@pytest.fixture(autouse=True)
def _unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BLAZAR_INTERPRETED", raising=False)


def test_a_build_of_these_sources_is_used(tmp_path: Path) -> None:
    _build(tmp_path)
    assert _check(tmp_path) == ("compiled", [])


def test_no_build_is_the_sources(tmp_path: Path) -> None:
    _build(tmp_path, extensions=False, record=False)
    state, interpreted = _check(tmp_path)
    assert state.startswith("interpreted: no compiled build beside these sources") and interpreted == []


@pytest.mark.parametrize("edited", ["proxy/relay/head.py", "proxy/app.py"], ids=["compiled", "not compiled"])
def test_a_source_edited_after_its_build_makes_every_module_interpreted(tmp_path: Path, edited: str) -> None:
    """Any source of the package: compiled code may hold another module's ``Final`` values."""
    _build(tmp_path)
    with (tmp_path / edited).open("a") as f:
        f.write("# edited\n")
    state, interpreted = _check(tmp_path)
    assert f"{edited} changed since the request path was compiled" in state
    assert sorted(interpreted) == sorted(MODULES)


def test_a_source_removed_after_the_build_makes_it_stale(tmp_path: Path) -> None:
    _build(tmp_path)
    (tmp_path / "proxy/app.py").unlink()
    state, interpreted = _check(tmp_path)
    assert "proxy/app.py changed since the request path was compiled" in state
    assert sorted(interpreted) == sorted(MODULES)


def test_extensions_with_no_record_are_not_trusted(tmp_path: Path) -> None:
    _build(tmp_path, record=False)
    state, interpreted = _check(tmp_path)
    assert "no record of its source" in state and sorted(interpreted) == sorted(MODULES)


def test_a_record_whose_extension_is_gone_is_not_half_used(tmp_path: Path) -> None:
    _build(tmp_path)
    Path(tmp_path / "proxy/upstream.py").with_suffix(SUFFIX).unlink()
    state, interpreted = _check(tmp_path)
    assert "proxy/upstream.py has no compiled build" in state and sorted(interpreted) == sorted(MODULES)


@pytest.mark.parametrize(
    "record",
    [
        "not json",
        "[1, 2]",
        '{"proxy/lean.py": "0"}',
        '{"compiled": 1, "sources": {}}',
    ],
)
def test_a_record_that_cannot_be_read_is_not_trusted(tmp_path: Path, record: str) -> None:
    _build(tmp_path)
    (tmp_path / "proxy" / MANIFEST).write_text(record)
    state, interpreted = _check(tmp_path)
    assert state.startswith("interpreted: ") and interpreted, state


@pytest.mark.parametrize(("value", "used"), [("1", False), ("yes", False), ("0", True), ("", True)])
def test_blazar_interpreted_asks_for_the_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, used: bool
) -> None:
    _build(tmp_path)
    monkeypatch.setenv("BLAZAR_INTERPRETED", value)
    state, interpreted = _check(tmp_path)
    assert (state == "compiled") is used and (interpreted == []) is used, state


@pytest.fixture
def shadowed(tmp_path: Path) -> Iterator[Path]:
    """A package whose module has a (broken) extension beside its source, on the path."""
    package = tmp_path / "shadowpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text("WHERE = 'source'\n")
    (package / f"mod{SUFFIX}").write_bytes(b"not an extension")
    sys.path.insert(0, str(tmp_path))
    yield package
    sys.path.remove(str(tmp_path))
    for name in ("shadowpkg.mod", "shadowpkg"):
        sys.modules.pop(name, None)


def test_an_extension_beside_its_source_is_what_python_imports(shadowed: Path) -> None:
    """Why the check is needed: the extension comes first (here a broken one, which fails)."""
    with pytest.raises(ImportError):
        importlib.import_module("shadowpkg.mod")


def test_the_finder_imports_the_source_in_its_place(shadowed: Path) -> None:
    finder = _FromSource({"shadowpkg.mod": shadowed / "mod.py"})
    sys.meta_path.insert(0, finder)
    try:
        assert importlib.import_module("shadowpkg.mod").WHERE == "source"
    finally:
        sys.meta_path.remove(finder)


def test_this_process_runs_what_its_state_says() -> None:
    """The suite runs the build that the install made (compiled where it could): and what is
    imported is that, not the other."""
    extension = proxy.lean.__file__ is not None and not proxy.lean.__file__.endswith(".py")
    assert extension is (compiled.STATE == "compiled"), (compiled.STATE, proxy.lean.__file__)
