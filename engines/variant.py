"""Which build of an engine fits this machine: cpu, cuda12, cuda13 or metal."""

from __future__ import annotations

import platform
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

_NVIDIA_VERSION_FILE = Path("/proc/driver/nvidia/version")


@dataclass(frozen=True, slots=True)
class Machine:
    """What variant detection looks at; ``probe()`` reads it off this machine."""

    system: str
    arch: str
    nvidia_driver: str | None

    @classmethod
    def probe(cls) -> Machine:
        return cls(platform.system(), platform.machine(), _nvidia_driver_version())


def detect_variant(machine: Machine) -> str:
    """NVIDIA driver present → cuda12, macOS arm64 → metal, else cpu.

    cuda12 runs on every driver that cuda13 does (and older ones), so it is
    the default; ask for cuda13 with ``--engine-variant``.
    """
    if machine.system == "Darwin" and machine.arch == "arm64":
        return "metal"
    if machine.system == "Linux" and machine.nvidia_driver:
        return "cuda12"
    return "cpu"


def _nvidia_driver_version() -> str | None:
    try:
        text = _NVIDIA_VERSION_FILE.read_text()
    except OSError:
        return "unknown" if shutil.which("nvidia-smi") else None
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", text)
    return match.group(1) if match else "unknown"
