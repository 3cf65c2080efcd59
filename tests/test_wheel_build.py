"""hatch_build.py: `pip install .`'s wheel carries the request path compiled, or, where nothing can
compile it, the sources alone and a warning that says why."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from proxy.compiled import GROUP, MANIFEST, MODULES

ROOT = Path(__file__).resolve().parent.parent
_STATE = "import proxy, proxy.lean; print(proxy.compiled.STATE); print(proxy.lean.__file__)"


def _wheel(out: Path, **env: str) -> tuple[Path, str]:
    """The wheel ``pip wheel`` builds of this checkout (as ``pip install .`` does), and pip's words."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--disable-pip-version-check",
            "-w",
            out,
            ROOT,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=500,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (wheel,) = out.glob("blazar_proxy-*.whl")
    return wheel, done.stdout + done.stderr


def _run_unpacked(wheel: Path, site: Path) -> list[str]:
    """What the unpacked wheel says of itself, imported outside the checkout."""
    zipfile.ZipFile(wheel).extractall(site)
    env = {k: v for k, v in os.environ.items() if k != "BLAZAR_INTERPRETED"}
    done = subprocess.run(
        [sys.executable, "-c", _STATE],
        cwd=site,
        env={**env, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.splitlines()


@pytest.mark.timeout(600)
def test_the_wheel_has_the_request_path_compiled(tmp_path: Path) -> None:
    wheel, _ = _wheel(tmp_path / "dist")
    assert not wheel.name.endswith("-none-any.whl"), wheel.name  # a platform's wheel
    names = zipfile.ZipFile(wheel).namelist()
    for module in MODULES:
        assert any(n.startswith(module[:-3] + ".") and n.endswith(".so") for n in names), module
        assert module in names  # the source too, for tracebacks and the check
    assert any(n.startswith(f"{GROUP}__mypyc.") for n in names)
    assert f"proxy/{MANIFEST}" in names
    state, lean = _run_unpacked(wheel, tmp_path / "site")
    assert state == "compiled"
    assert lean.startswith(str(tmp_path / "site")) and lean.endswith(".so"), lean


@pytest.mark.timeout(600)
def test_without_a_compiler_the_wheel_is_the_sources_and_says_why(tmp_path: Path) -> None:
    wheel, said = _wheel(tmp_path / "dist", CC="false")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    assert "the request path could not be compiled, so it runs interpreted" in said
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")]
    state, lean = _run_unpacked(wheel, tmp_path / "site")
    assert state.startswith("interpreted: no compiled build beside these sources") and lean.endswith(
        "proxy/lean.py"
    ), (state, lean)
