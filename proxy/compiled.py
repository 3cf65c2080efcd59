"""The request path compiled by mypyc, and the interpreted modules where it cannot be used.

An install (``pip install .``, or ``pip install -e .``) compiles ``MODULES`` to
C extensions with mypyc (``hatch_build.py``): the relay's common case, from the
request's read to its record, costs about 40 % less CPU compiled. The
build writes ``_compiled.json`` beside this file: the modules compiled, and the
SHA-256 of each source of the package it was compiled from. Where there is no C compiler, the
install ships the same modules interpreted, and runs the same.

A compiled module shadows its source: Python imports ``lean.*.so`` before
``lean.py``. So at the package's import (``proxy/__init__.py``, before any of
them is imported) ``use()`` checks the build against the sources and imports
every compiled module from its source, as one, where

- a source of the package changed since the build (an editable install,
  edited): the build is stale, and would run code that is no longer there
  (compiled code may also hold another module's ``Final`` values);
- extensions are there with no record of what they were built from;
- ``BLAZAR_INTERPRETED`` is set (to anything but ``0``): a check of the
  interpreted modules, or a way round a compiled one's fault.

All or none: compiled modules call each other's classes directly, so one of
them interpreted beside compiled ones would not be the class they call.
``STATE`` says which it is, and why, for the gateway's start to say.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# The modules compiled, relative to the project's root: the relay's common case, from the request's
# read to its record. Not compiled: the stream's events (tests break ``EventStream.cut``), the
# routing (a compiled ``Ticket``'s class-level defaults were undefined on its instances), the
# protocols built on uvicorn's and the app built on Starlette (a class that derives from a
# dependency's: mypy sees none of them), and the rest, which a request of the common case does
# not run.
MODULES = (
    "proxy/lean.py",
    "proxy/relay/fast.py",
    "proxy/upstream.py",
    "proxy/relay/head.py",
    "proxy/relay/handler.py",
    "proxy/relay/outcome.py",
    "proxy/metrics.py",
    "proxy/headers.py",
    "proxy/relay/request.py",
    "proxy/relay/ticket.py",
    "proxy/payload.py",
    "proxy/relay/body.py",
    "proxy/forwarded.py",
    "proxy/relay/ids.py",
    "proxy/admission.py",
    "proxy/relay/routes.py",
    "proxy/timers.py",
    "proxy/outbox.py",
    "proxy/accesslog.py",
    "proxy/pool.py",
    "proxy/browser.py",
    "proxy/relay/exchange.py",
    "proxy/entry.py",
    "proxy/unsent.py",
)
# mypyc's shared library for them, a top-level module beside the ``proxy`` package.
GROUP = "blazar_proxy"
MANIFEST = "_compiled.json"
_PACKAGE = Path(__file__).resolve().parent
_ROOT = _PACKAGE.parent

# mypy reads the sources alone, in every build: what the dependencies are is unknown to it (a
# pip install's build has none of them), so a build does not change with what else is installed.
_MYPY_INI = "[mypy]\nignore_missing_imports = True\nfollow_imports = silent\nno_site_packages = True\n"
_SETUP = """\
import sys
from setuptools import setup
from mypyc.build import mypycify

setup(
    name="blazar-proxy-compiled",
    ext_modules=mypycify(sys.argv[2:], opt_level="3", group_name=sys.argv[1]),
    script_args=["build_ext", "--inplace"],
)
"""

_NOT_COMPILED = (
    "interpreted: no compiled build beside these sources (installed without a C compiler or with "
    "BLAZAR_INTERPRETED set, or not installed): installing with gcc or clang and Python's headers "
    "compiles it"
)
# What the start says: "compiled", or "interpreted: <why>".
STATE = _NOT_COMPILED
# The modules this process runs compiled (as in MODULES: "proxy/lean.py").
COMPILED: frozenset[str] = frozenset()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sources(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in (root / "proxy").rglob("*.py"))


def manifest(root: Path, modules: Sequence[str]) -> str:
    """The record of a build of ``modules`` from the sources under ``root``, as written: the modules,
    and every source of the package (compiled code may hold what another module defined, such as
    a ``Final`` constant's value, so a change to any of them makes the build stale)."""
    sources = {name: digest(root / name) for name in _sources(root)}
    return json.dumps({"compiled": list(modules), "sources": sources}, indent=1) + "\n"


def _same(source: Path, sha: str) -> bool:
    """The source is there, as it was built (one removed since is a change too)."""
    return source.is_file() and digest(source) == sha


def _extension(source: Path) -> bool:
    return any(source.with_suffix(suffix).exists() for suffix in importlib.machinery.EXTENSION_SUFFIXES)


class _FromSource(importlib.abc.MetaPathFinder):
    """Imports these modules from their sources, never from the extensions beside them."""

    def __init__(self, sources: dict[str, Path]) -> None:
        self.sources = sources

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        source = self.sources.get(fullname)
        return None if source is None else importlib.util.spec_from_file_location(fullname, source)


def _check(root: Path) -> tuple[str, list[str]]:
    """The build's state, and the modules to import from source (none where it is usable)."""
    record = root / "proxy" / MANIFEST
    if not record.is_file():
        present = [name for name in MODULES if _extension(root / name)]
        if present:
            return f"interpreted: {present[0]} has a compiled build with no record of its source", present
        return _NOT_COMPILED, []
    try:
        built = json.loads(record.read_text())
        modules: list[str] = [str(name) for name in built["compiled"]]
        sources: dict[str, str] = built["sources"]
        changed = [name for name, sha in sources.items() if not _same(root / name, sha)]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        return f"interpreted: {record} cannot be read ({e!r})", [n for n in MODULES if _extension(root / n)]
    absent = [name for name in modules if not _extension(root / name)]
    if absent:
        return f"interpreted: {absent[0]} has no compiled build beside it (reinstall to compile it)", modules
    if changed:
        return (
            f"interpreted: {changed[0]} changed since the request path was compiled "
            "(`pip install -e .` compiles it again)",
            modules,
        )
    if os.environ.get("BLAZAR_INTERPRETED", "0") not in ("", "0"):
        return "interpreted: BLAZAR_INTERPRETED is set", modules
    return "compiled", []


def use(root: Path = _ROOT) -> str:
    """Decide between the compiled build and the sources, before any of the modules is imported."""
    global STATE, COMPILED
    STATE, interpreted = _check(root)
    if STATE == "compiled":
        COMPILED = frozenset(json.loads((root / "proxy" / MANIFEST).read_text())["compiled"])
    if interpreted:
        sources = {name[:-3].replace("/", "."): root / name for name in interpreted}
        sys.meta_path.insert(0, _FromSource(sources))
    return STATE


def compile_modules(root: Path, work: Path, modules: Sequence[str] = MODULES) -> list[Path]:
    """Compile ``modules`` of the sources under ``root`` in ``work`` (a copy of them, made here: mypyc
    builds beside the sources); the extensions built, relative to ``work``. Needs mypy, setuptools
    and a C compiler; raises ``RuntimeError`` with mypyc's or the compiler's last words."""
    for package in ("proxy", "engines"):
        shutil.copytree(
            root / package, work / package, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd")
        )
    (work / "mypy.ini").write_text(_MYPY_INI)
    (work / "setup_compiled.py").write_text(_SETUP)
    done = subprocess.run(
        [sys.executable, "setup_compiled.py", GROUP, *modules],
        cwd=work,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        lines = (done.stdout + done.stderr).strip().splitlines()
        errors = [line for line in lines if "error" in line.lower()]
        raise RuntimeError("\n".join((errors or lines)[-5:]))
    built = [p.relative_to(work) for p in work.glob("*.so")] + [
        p.relative_to(work) for p in work.glob("proxy/**/*.so")
    ]
    missing = [name for name in modules if not any(str(b).startswith(name[:-3] + ".") for b in built)]
    if missing:
        raise RuntimeError(f"no extension was built for {', '.join(missing)}")
    return built
