"""Interrupted builds of a built-in model leave nothing behind; a later start sweeps what older ones left.

The gateway makes a built-in model by running a script with the engine's
Python, which writes into a ``.NAME.build-*`` folder and renames it into
place. Interrupted, the gateway gave the script 0.25 s and then SIGKILLed it
(``subprocess.run``'s way): a script inside a long call (writing the weights)
left its folder, and no later start removed it. Now the interrupt is passed
on and the script is given time to clean up; and each start, under the
models' lock that every build holds, removes what interrupted builds left,
never the folder of a build under way in another gateway.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT
from tests.e2e.test_engine_mlx import ENGINE
from tests.e2e.test_engine_mlx import engine_installed as engine_installed
from tests.helpers import engine_home, free_port, wait_until

pytestmark = [
    pytest.mark.usefixtures("engine_installed"),
    pytest.mark.fault("engines", "a built-in model's conversion interrupted"),
]


def fresh_home(tmp_path: Path) -> Path:
    """A BLAZAR_HOME with the installed engines and no models yet."""
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "engines").symlink_to(engine_home() / "engines")
    return home


def start(home: Path, model: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BLAZAR_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "proxy", "--engine", ENGINE, "--engine-variant", "cpu", "--model", model]
    return subprocess.Popen(
        [*argv, "--port", str(free_port())],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def leftovers(home: Path) -> list[str]:
    return sorted(p.name for p in (home / "models").iterdir() if ".build-" in p.name or ".stale-" in p.name)


def test_an_interrupted_build_of_a_builtin_model_leaves_no_build_folder(tmp_path: Path) -> None:
    """SIGINT to the gateway while its script writes the model: the script removes its build folder."""
    home = fresh_home(tmp_path)
    gateway = start(home, "builtin:bench")
    try:
        wait_until(
            lambda: leftovers(home) or gateway.poll() is not None,
            "a build folder, or the gateway's exit",
            timeout_s=120,
            interval_s=0.01,
        )
        assert gateway.poll() is None, gateway.communicate()[0].decode()
        gateway.send_signal(signal.SIGINT)  # the gateway alone, as a supervisor signals it
        output = gateway.communicate(timeout=60)[0].decode()
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()
    time.sleep(0.5)  # a script still cleaning up would show its folder now
    assert leftovers(home) == [], output


def test_a_start_sweeps_builds_left_by_interrupted_ones_but_not_one_under_way(tmp_path: Path) -> None:
    """A start removes the build folders left behind once no build holds the models' lock (it waits)."""
    home = fresh_home(tmp_path)
    models = home / "models"
    left = models / ".blazar-demo-qwen2-tiny.build-left1234"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"half")
    (models / ".blazar-demo-llama-tiny.gguf.build-abcd").write_bytes(b"half")
    # Another gateway's build under way: it holds the lock.
    with (models / ".builtin.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        gateway = start(home, "builtin:tiny")
        try:
            time.sleep(3)
            assert gateway.poll() is None
            assert left.is_dir(), "a build under way was removed"
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    try:
        wait_until(
            lambda: (models / "blazar-demo-qwen2-tiny").is_dir() or gateway.poll() is not None,
            "the model, or the gateway's exit",
            timeout_s=120,
            interval_s=0.01,
        )
        assert gateway.poll() is None
        assert leftovers(home) == []
    finally:
        gateway.send_signal(signal.SIGTERM)
        gateway.communicate(timeout=60)
