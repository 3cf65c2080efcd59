"""engines.variant: which build of an engine fits the machine."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest

import engines.variant
from engines.variant import Machine, detect_variant


def test_linux_with_nvidia_driver_is_cuda12() -> None:
    """Linux with an NVIDIA driver gets cuda12, the variant that runs on the most drivers."""
    assert detect_variant(Machine("Linux", "x86_64", "550.54.15")) == "cuda12"


def test_linux_with_driver_of_unknown_version_is_cuda12() -> None:
    """A driver seen only through nvidia-smi ("unknown" version) still counts as NVIDIA."""
    assert detect_variant(Machine("Linux", "aarch64", "unknown")) == "cuda12"


def test_linux_without_nvidia_driver_is_cpu() -> None:
    """Linux without an NVIDIA driver gets cpu."""
    assert detect_variant(Machine("Linux", "x86_64", None)) == "cpu"


def test_macos_arm64_is_metal() -> None:
    """Apple silicon macOS gets metal."""
    assert detect_variant(Machine("Darwin", "arm64", None)) == "metal"


def test_macos_x86_64_is_cpu() -> None:
    """Intel macOS has no Metal mlx build and gets cpu."""
    assert detect_variant(Machine("Darwin", "x86_64", None)) == "cpu"


def test_probe_on_this_machine_is_cpu() -> None:
    """Machine.probe() here (Linux, no NVIDIA driver) detects cpu."""
    if (
        platform.system() != "Linux"
        or Path("/proc/driver/nvidia/version").exists()
        or shutil.which("nvidia-smi")
    ):
        pytest.skip("this test pins the GPU-less Linux machine the suite is developed on")
    machine = Machine.probe()
    assert machine.nvidia_driver is None
    assert detect_variant(machine) == "cpu"


def test_probe_reads_the_driver_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """probe() takes the driver version from /proc/driver/nvidia/version's Kernel Module line."""
    version_file = tmp_path / "version"
    version_file.write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build\n"
        "GCC version:  gcc version 12.3.0\n"
    )
    monkeypatch.setattr(engines.variant, "_NVIDIA_VERSION_FILE", version_file)
    assert Machine.probe().nvidia_driver == "570.86.15"


def test_probe_without_version_file_falls_back_to_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no /proc version file, an nvidia-smi on PATH means a driver of unknown version."""
    monkeypatch.setattr(engines.variant, "_NVIDIA_VERSION_FILE", tmp_path / "missing")
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    assert Machine.probe().nvidia_driver == "unknown"
