"""`python -m perf compiled --out DIR`: a copy of this checkout with the request path compiled by mypyc.

An experiment, not the gateway as shipped: what the gateway's Python costs
on its common case is mostly the interpreter's (``python -m perf inproc``
counts the instructions), and mypyc compiles the same typed sources to C
extensions. The copy in DIR is this checkout's files (tracked, and untracked
ones git does not ignore) with ``MODULES`` built in place beside their
sources; ``python -m proxy`` run from DIR imports those. Measure it beside
this checkout in one run:

    python -m perf compiled --out /tmp/compiled
    python -m perf matrix --quick --baseline /tmp/compiled   # the copy is blazar-base
    python -m perf inproc --baseline /tmp/compiled

What a compiled build changes besides speed (each seen in the suite run on
such a copy, and what the sources do about it):

- a compiled class's methods and attributes are fixed: a test that replaces
  one on an instance fails (a test counts calls at the app, which stays
  Python, or replaces a module's function);
- a class made at run time from a compiled one must be allowed to be: the
  copy's ``LeanProtocol``, which ``server_protocol`` subclasses, is marked so
  (``_PATCHES``: the one change made to the copy's sources), and the limits
  that subclass sets are class variables;
- the checker's narrowing is trusted: an attribute tested before a call or
  an ``await`` that changes it raises ``TypeError`` when read after it
  (``Connection._head_awaited`` asks by a call for that reason);
- a Python class declared in a compiled module is told by a test that
  misses its subclasses (the upstream's errors live in
  ``proxy/upstream_errors.py``, not compiled, for that reason);
- a list subclass's ``append`` is not called by compiled code (a stray
  message's fields are emptied after each read instead).

It needs mypy (``pip install 'mypy>=2.4,<2.5'``), a C compiler and the
Python headers; the build takes about a minute on two cores.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

# The modules compiled: the relay's common case, from the request's read to its record, but for
# the pool (whose ``connect`` the tests replace).
MODULES = (
    "proxy/lean.py",
    "proxy/relay/fast.py",
    "proxy/upstream.py",
    "proxy/relay/head.py",
    "proxy/relay/handler.py",
    "proxy/relay/outcome.py",
    "proxy/metrics.py",
    "proxy/headers.py",
)
_ROOT = Path(__file__).resolve().parent.parent
# What the copy's sources need that this checkout's do not (mypy_extensions comes with mypy):
# file, the text replaced, its replacement.
_MARK = "from mypy_extensions import mypyc_attr\n\n\n@mypyc_attr(allow_interpreted_subclasses=True)\n"
_PATCHES = (("proxy/lean.py", "\n\n\nclass LeanProtocol(", "\n" + _MARK + "class LeanProtocol("),)
# The copy has no pyproject.toml while it is built (setuptools, which mypyc builds with, would read
# the project's metadata from it): mypy's settings come from this instead.
_MYPY_INI = "[mypy]\nignore_missing_imports = True\n"
# Written in each copy: a folder without it is not emptied.
_MARKER = ".perf-compiled"


def build(out: Path, modules: tuple[str, ...] = MODULES) -> str:
    """Copy the checkout to ``out`` (a new folder, or one an earlier run made: emptied first) and
    compile ``modules`` there; the report."""
    if importlib.util.find_spec("mypyc") is None:
        sys.exit("perf compiled: mypyc is not installed: pip install 'mypy>=2.4,<2.5'")
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    if out.exists() and not out.is_dir():
        sys.exit(f"perf compiled: {out} is a file: give a new folder")
    if out.exists() and any(out.iterdir()) and not (out / _MARKER).is_file():
        # Emptied only where this made it: never a folder of the user's.
        sys.exit(f"perf compiled: {out} is not empty and not a copy made here: give a new folder")
    if out.exists():
        shutil.rmtree(out)
    for name in files:
        source = _ROOT / name
        if name == "pyproject.toml" or not source.is_file():
            continue
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    for name, text, replacement in _PATCHES:
        path = out / name
        code = path.read_text()
        if code.count(text) != 1:
            sys.exit(f"perf compiled: {name} no longer has {text.strip()!r} once; update _PATCHES")
        path.write_text(code.replace(text, replacement))
    (out / "mypy.ini").write_text(_MYPY_INI)
    (out / _MARKER).write_text("a copy made by python -m perf compiled; emptied by its next run\n")
    script = Path(sys.executable).with_name("mypyc")
    command = [str(script) if script.exists() else "mypyc", *modules]
    done = subprocess.run(command, cwd=out, capture_output=True, text=True)
    if done.returncode != 0:
        errors = [line for line in (done.stdout + done.stderr).splitlines() if "error" in line]
        sys.exit("perf compiled: mypyc failed:\n" + "\n".join(errors[-20:] or [done.stderr[-3000:]]))
    shutil.rmtree(out / "build", ignore_errors=True)
    (out / "mypy.ini").unlink()
    shutil.copy2(_ROOT / "pyproject.toml", out / "pyproject.toml")  # its settings, for pytest and mypy
    built = sorted(str(path.relative_to(out)) for path in out.glob("proxy/**/*.so"))
    missing = [name for name in modules if not any(b.startswith(name[:-3] + ".") for b in built)]
    if missing:
        sys.exit(f"perf compiled: no extension was built for {', '.join(missing)}")
    return (
        f"compiled {len(modules)} modules in {out}:\n"
        + "".join(f"  {name}\n" for name in modules)
        + f"measure it: python -m perf matrix --quick --baseline {out}\n"
    )
