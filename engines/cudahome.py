"""An engine-local CUDA_HOME, assembled from the nvidia-* wheels in its venv.

mlx's CUDA backend compiles kernels with NVRTC at the first kernel and needs
the CUDA runtime headers; it finds them through ``$CUDA_HOME/include``. The
pip ``nvidia-*`` wheels carry headers under
``site-packages/nvidia/<pkg>/include``. Linking those into one ``include/``
gives each engine version the headers its own wheels were built against,
whatever toolkit the machine has. Only ``include/`` is read through
CUDA_HOME: the libraries come through the wheels' RPATH.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def site_packages(venv: Path) -> Path:
    """The venv's site-packages directory (POSIX layout)."""
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise FileNotFoundError(f"no site-packages under {venv}")
    return found[-1]


def assemble_cuda_home(site: Path, target: Path) -> list[str]:
    """Build ``target/include`` from every ``site/nvidia/*/include``; return notes on clashes.

    Entries are symlinks, so the cuda-home costs no space and always matches
    the installed wheels. Where two packages ship the same name, the first in
    name order wins and the clash is reported.
    """
    if target.exists():
        shutil.rmtree(target)
    include = target / "include"
    include.mkdir(parents=True)
    notes: list[str] = []
    owners: dict[str, str] = {}
    nvidia = site / "nvidia"
    packages = sorted(p for p in nvidia.iterdir() if (p / "include").is_dir()) if nvidia.is_dir() else []
    for package in packages:
        for entry in sorted((package / "include").iterdir()):
            if entry.name in ("__pycache__", "__init__.py"):
                continue
            if entry.name in owners:
                notes.append(f"{entry.name}: kept {owners[entry.name]}'s, skipped {package.name}'s")
                continue
            owners[entry.name] = package.name
            os.symlink(entry.resolve(), include / entry.name)
    if not owners:
        notes.append(f"no nvidia/*/include found under {site}")
    return notes


def has_runtime_headers(cuda_home: Path) -> bool:
    """Whether NVRTC will find the runtime headers (cuda_runtime.h) here."""
    return (cuda_home / "include" / "cuda_runtime.h").exists()
