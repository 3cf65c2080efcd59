"""engines.cudahome: an engine-local CUDA_HOME assembled from the nvidia-* wheels."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.cudahome import assemble_cuda_home, has_runtime_headers, site_packages


def touch(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def fake_site(root: Path) -> Path:
    """A site-packages with the nvidia/* layout the pip CUDA wheels install."""
    site = root / "venv" / "lib" / "python3.11" / "site-packages"
    nvidia = site / "nvidia"
    touch(nvidia / "__init__.py")
    touch(nvidia / "cuda_runtime" / "include" / "cuda_runtime.h", "runtime")
    touch(nvidia / "cuda_runtime" / "include" / "crt" / "host_config.h", "crt")
    touch(nvidia / "cuda_runtime" / "include" / "__init__.py")
    touch(nvidia / "cuda_runtime" / "lib" / "libcudart.so.12")
    touch(nvidia / "cuda_nvrtc" / "include" / "nvrtc.h", "nvrtc")
    touch(nvidia / "cublas" / "include" / "cublas.h", "cublas")
    # The same name in two packages: cublas sorts before cuda_runtime, so cublas's is kept.
    touch(nvidia / "cublas" / "include" / "clash.h", "from cublas")
    touch(nvidia / "cuda_runtime" / "include" / "clash.h", "from cuda_runtime")
    touch(nvidia / "cudnn" / "lib" / "libcudnn.so.9")
    return site


def test_include_links_to_each_package_header(tmp_path: Path) -> None:
    """include/ holds a symlink per header (and header directory), pointing at the wheel's file."""
    site = fake_site(tmp_path)
    target = tmp_path / "cuda-home"
    assemble_cuda_home(site, target)
    include = target / "include"
    nvidia = site / "nvidia"
    for name, package in [
        ("cuda_runtime.h", "cuda_runtime"),
        ("nvrtc.h", "cuda_nvrtc"),
        ("cublas.h", "cublas"),
    ]:
        assert (include / name).is_symlink()
        assert (include / name).resolve() == (nvidia / package / "include" / name).resolve()
    assert (include / "crt").is_symlink()
    assert (include / "crt" / "host_config.h").read_text() == "crt"


def test_only_headers_are_linked(tmp_path: Path) -> None:
    """include/ gets the headers and nothing else: no __init__.py, no lib, no package without include."""
    site = fake_site(tmp_path)
    target = tmp_path / "cuda-home"
    assemble_cuda_home(site, target)
    assert sorted(p.name for p in (target / "include").iterdir()) == [
        "clash.h",
        "crt",
        "cublas.h",
        "cuda_runtime.h",
        "nvrtc.h",
    ]
    assert sorted(p.name for p in target.iterdir()) == ["include"]


def test_clash_is_reported_and_first_package_wins(tmp_path: Path) -> None:
    """A header shipped by two packages is kept from the first in name order and reported once."""
    site = fake_site(tmp_path)
    target = tmp_path / "cuda-home"
    notes = assemble_cuda_home(site, target)
    assert notes == ["clash.h: kept cublas's, skipped cuda_runtime's"]
    assert (target / "include" / "clash.h").read_text() == "from cublas"


def test_packages_without_include_are_skipped(tmp_path: Path) -> None:
    """A package with only lib/ (cudnn here) contributes nothing and raises no note."""
    site = fake_site(tmp_path)
    target = tmp_path / "cuda-home"
    notes = assemble_cuda_home(site, target)
    assert not any("cudnn" in note for note in notes)
    assert not any("libcudnn" in p.name for p in (target / "include").iterdir())


def test_has_runtime_headers_after_assembly(tmp_path: Path) -> None:
    """With cuda_runtime installed, the assembled cuda-home has the runtime headers NVRTC needs."""
    site = fake_site(tmp_path)
    target = tmp_path / "cuda-home"
    assemble_cuda_home(site, target)
    assert has_runtime_headers(target)


def test_empty_site_gives_a_note_and_no_runtime_headers(tmp_path: Path) -> None:
    """A site-packages without nvidia/ yields an empty include/, a note, and no runtime headers."""
    site = tmp_path / "site-packages"
    site.mkdir()
    target = tmp_path / "cuda-home"
    notes = assemble_cuda_home(site, target)
    assert len(notes) == 1
    assert "no nvidia/*/include" in notes[0]
    assert (target / "include").is_dir()
    assert list((target / "include").iterdir()) == []
    assert not has_runtime_headers(target)


def test_nvidia_without_runtime_has_no_runtime_headers(tmp_path: Path) -> None:
    """Headers from other packages alone (nvrtc only) do not count as runtime headers."""
    site = tmp_path / "site-packages"
    touch(site / "nvidia" / "cuda_nvrtc" / "include" / "nvrtc.h")
    target = tmp_path / "cuda-home"
    assert assemble_cuda_home(site, target) == []
    assert not has_runtime_headers(target)


def test_has_runtime_headers_false_when_missing(tmp_path: Path) -> None:
    """A directory that was never assembled has no runtime headers."""
    assert not has_runtime_headers(tmp_path / "nowhere")


def test_rerun_replaces_the_old_cuda_home(tmp_path: Path) -> None:
    """Assembling again discards the previous cuda-home, including entries the wheels no longer have."""
    site = fake_site(tmp_path)
    target = tmp_path / "cuda-home"
    assemble_cuda_home(site, target)
    touch(target / "include" / "leftover.h")
    touch(target / "stray")
    (site / "nvidia" / "cublas" / "include" / "cublas.h").unlink()
    assemble_cuda_home(site, target)
    names = sorted(p.name for p in (target / "include").iterdir())
    assert "leftover.h" not in names
    assert "cublas.h" not in names
    assert "cuda_runtime.h" in names
    assert not (target / "stray").exists()


def test_site_packages_finds_the_venv_layout(tmp_path: Path) -> None:
    """site_packages() finds lib/python3.X/site-packages under a venv."""
    site = fake_site(tmp_path)
    assert site_packages(tmp_path / "venv") == site


def test_site_packages_missing_raises(tmp_path: Path) -> None:
    """A directory without lib/python3*/site-packages raises FileNotFoundError."""
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    with pytest.raises(FileNotFoundError):
        site_packages(tmp_path / "venv")
