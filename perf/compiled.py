"""`python -m perf compiled --out DIR [--modules A,B]`: a copy of this checkout, a set of modules compiled.

An install compiles the request path (``proxy/compiled.py``'s ``MODULES``,
by ``hatch_build.py``); this makes a copy that compiles another set (by
default the same one), with the same builder and its record, so that a set
can be measured beside the checkout in one run before it is shipped:

    python -m perf compiled --out /tmp/compiled --modules proxy/lean.py,proxy/payload.py
    python -m perf matrix --quick --baseline /tmp/compiled   # the copy is blazar-base
    python -m perf inproc --baseline /tmp/compiled

What a compiled build changes besides speed (each seen in the suite run on
such a copy, and what the sources do about it):

- a compiled class's methods and attributes are fixed: a test that replaces
  one on an instance fails (a test counts calls at the app, which stays
  Python, or replaces a module's function);
- a class made at run time from a compiled one must be allowed to be:
  ``LeanProtocol``, which ``server_protocol`` subclasses, is marked so
  (``mypyc_attr``), and the limits that subclass sets are class variables;
- the checker's narrowing is trusted: an attribute tested before a call or
  an ``await`` that changes it raises ``TypeError`` when read after it
  (``Connection._head_awaited`` asks by a call for that reason);
- a Python class declared in a compiled module is told by a test that
  misses its subclasses (the upstream's errors live in
  ``proxy/upstream_errors.py``, not compiled, for that reason);
- a class deriving from a dependency's class is not compiled (mypy reads no
  dependency: ``proxy/exposition.py``'s collectors, apart from the figures);
- a list subclass's ``append`` is not called by compiled code (a stray
  message's fields are emptied after each read instead).

It needs mypy (``pip install 'mypy>=2.4,<2.5'``), setuptools, a C compiler
and the Python headers; the build takes 30 to 45 s on two cores.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from proxy.compiled import MANIFEST, MODULES, compile_modules, manifest

_ROOT = Path(__file__).resolve().parent.parent
# Written in each copy: a folder without it is not emptied.
_MARKER = ".perf-compiled"


def build(out: Path, modules: Sequence[str] = MODULES) -> str:
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
        if not source.is_file():
            continue
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    (out / _MARKER).write_text("a copy made by python -m perf compiled; emptied by its next run\n")
    unknown = [name for name in modules if not (out / name).is_file()]
    if unknown:
        sys.exit(f"perf compiled: no such module in this checkout: {', '.join(unknown)}")
    with tempfile.TemporaryDirectory(prefix="perf-compiled-") as work:
        try:
            built = compile_modules(out, Path(work), modules)
        except RuntimeError as e:
            sys.exit(f"perf compiled: mypyc failed:\n{e}")
        for extension in built:
            shutil.copy2(Path(work) / extension, out / extension)
    (out / "proxy" / MANIFEST).write_text(manifest(out, modules))
    return (
        f"compiled {len(modules)} modules in {out}:\n"
        + "".join(f"  {name}\n" for name in modules)
        + f"measure it: python -m perf matrix --quick --baseline {out}\n"
    )
