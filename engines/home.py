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
    if env.get("BLAZAR_HOME"):
        return Path(env["BLAZAR_HOME"]).expanduser()
    data = env.get("XDG_DATA_HOME") or str(Path(env.get("HOME") or Path.home()) / ".local" / "share")
    return Path(data).expanduser() / "blazar"


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
