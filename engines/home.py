"""Where blazar keeps engines, models and logs: ``$BLAZAR_HOME``.

Default ``$XDG_DATA_HOME/blazar``, that is ``~/.local/share/blazar``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def blazar_home(environ: dict[str, str] | None = None) -> Path:
    """Resolve BLAZAR_HOME from the environment (pure: pass ``environ`` to test)."""
    env = os.environ if environ is None else environ
    home = env.get("HOME") or str(Path.home())

    def expand(path: str) -> Path:
        return Path(home + path[1:]) if path == "~" or path.startswith("~/") else Path(path)

    if env.get("BLAZAR_HOME"):
        return expand(env["BLAZAR_HOME"])
    data = env.get("XDG_DATA_HOME") or str(Path(home) / ".local" / "share")
    return expand(data) / "blazar"


@dataclass(frozen=True, slots=True)
class Home:
    root: Path

    def engine_dir(self, name: str) -> Path:
        return self.root / "engines" / name

    def venv(self, name: str) -> Path:
        return self.engine_dir(name) / "venv"

    def cuda_home(self, name: str) -> Path:
        return self.engine_dir(name) / "cuda-home"

    def ptx_cache(self, name: str) -> Path:
        return self.engine_dir(name) / "ptx-cache"

    def manifest(self, name: str) -> Path:
        return self.engine_dir(name) / "engine.json"

    def lock(self, name: str) -> Path:
        return self.root / "engines" / f".{name}.lock"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def run(self) -> Path:
        return self.root / "run"
