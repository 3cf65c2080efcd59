"""An engine child that cannot become ready, with the real mlx engine: say why, at once.

The one-line start and always-loaded models end the gateway with exit code 1,
printing the engine's last lines and the path of its log, within seconds of
the failure (not after the 600 s readiness deadline). A lazily loaded model
answers its requests 503 with the same reason. The models are broken on
purpose: a hub repo that cannot be downloaded (this machine has no hub; one
that has gets "repository not found"), weights that are not safetensors, an
engine flag the engine refuses.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT
from tests.e2e.test_engine_llamacpp import ENGINE as LLAMACPP
from tests.e2e.test_engine_llamacpp import engine_python as engine_python
from tests.e2e.test_engine_mlx import ENGINE, _env
from tests.e2e.test_engine_mlx import engine_installed as engine_installed
from tests.e2e.test_engine_models import ConfigGateway
from tests.helpers import Events, engine_home, free_port

pytestmark = [
    pytest.mark.usefixtures("engine_installed"),
    pytest.mark.fault("engines", "a child's start: proven, shared, or failing with why"),
]

# Two mlx starts (imports take seconds on a busy machine) and a backoff.
_EXIT_WITHIN_S = 120.0


def run_to_exit(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "--port", str(free_port()), "--log-level", "warning", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=_EXIT_WITHIN_S + 60,
    )
    return result, time.monotonic() - started


def broken_weights(root: Path, name: str) -> Path:
    """An MLX directory by its files (config.json, *.safetensors) whose weights are not safetensors."""
    model = root / name
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    (model / "model.safetensors").write_bytes(b"not safetensors at all")
    return model


def assert_stopped_with_reason(
    result: subprocess.CompletedProcess[str], model: str, *engine_says: str
) -> Path:
    """Exit code 1; the reason, the engine's own words and its log's path; no traceback. Returns the log."""
    stderr = result.stderr
    assert result.returncode == 1, stderr
    assert f"blazar-proxy: model {model!r} cannot start: its engine did not become ready: " in stderr, stderr
    assert "blazar-proxy: the engine's last lines (its whole output is in " in stderr
    for words in engine_says:
        assert any(line.startswith("blazar-proxy:   | ") and words in line for line in stderr.splitlines()), (
            stderr
        )
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"blazar-proxy: stopped: model {model!r} cannot start; why is in "), last
    log = Path(last.rsplit(" ", 1)[1])
    assert log.is_file() and log.parent == engine_home() / "logs"
    assert "Traceback" not in stderr
    return log


def test_a_hub_model_that_cannot_be_downloaded_ends_the_one_line_start(tmp_path: Path) -> None:
    """--model org/name that the child cannot download: exit 1 within seconds, with the engine's error."""
    result, took_s = run_to_exit(
        "--engine", ENGINE, "--engine-variant", "cpu", "--model", "blazar-test/no-such-model"
    )
    assert_stopped_with_reason(result, "blazar-test/no-such-model", "generation thread died")
    assert "503" not in result.stderr
    assert took_s < _EXIT_WITHIN_S
    assert not engine_running("blazar-test/no-such-model")


def test_weights_that_do_not_load_end_the_one_line_start(tmp_path: Path) -> None:
    """A model directory whose weights are garbage: exit 1, the engine's load error among the lines shown."""
    model = broken_weights(tmp_path, "garbage-weights")
    result, took_s = run_to_exit("--engine", ENGINE, "--engine-variant", "cpu", "--model", str(model))
    assert_stopped_with_reason(result, "garbage-weights", "load_safetensors")
    assert took_s < _EXIT_WITHIN_S


def test_an_always_loaded_model_whose_engine_exits_at_once_ends_the_gateway(tmp_path: Path) -> None:
    """An always-loaded model whose child exits the same way twice: exit 1 after two starts, no crash loop."""
    model = broken_weights(tmp_path, "refused-flag")
    path = tmp_path / "blazar.toml"
    path.write_text(
        f'[models.m]\nengine = "{ENGINE}"\nvariant = "cpu"\nmodel = "{model}"\n'
        'engine-args = ["--no-such-flag"]\nalways-loaded = true\n'
    )
    result, took_s = run_to_exit("--config", str(path))
    log = assert_stopped_with_reason(result, "m", "unrecognized arguments: --no-such-flag")
    assert "exited with code 2" in result.stderr
    assert took_s < _EXIT_WITHIN_S
    # This run's starts: the log file may hold earlier runs' too.
    assert log.read_text(errors="replace").count("--no-such-flag\n") >= 2


@pytest.mark.llamacpp
def test_a_gguf_file_that_does_not_load_ends_the_llamacpp_one_line_start(
    engine_python: Path, tmp_path: Path
) -> None:
    """A file with the GGUF magic and garbage after it: llama-server exits the same way twice; exit 1,
    the one line saying why (it cannot read the header), within seconds."""
    model = tmp_path / "truncated.gguf"
    model.write_bytes(b"GGUF\x03\x00\x00\x00" + b"garbage after the magic")
    result, took_s = run_to_exit("--engine", LLAMACPP, "--engine-variant", "cpu", "--model", str(model))
    assert_stopped_with_reason(result, "truncated", "failed to read header", "failed to load model")
    assert "its engine did not become ready: exited with code 1" in result.stderr
    assert took_s < _EXIT_WITHIN_S


def test_a_lazy_model_that_cannot_start_answers_503_saying_why_and_where_its_log_is(tmp_path: Path) -> None:
    """A model loaded on its first request that cannot start: 503 with the engine's words and its log."""
    model = broken_weights(tmp_path, "lazy-garbage")
    config = f'[models.lazy]\nengine = "{ENGINE}"\nvariant = "cpu"\nmodel = "{model}"\n'
    gateway = ConfigGateway(config, tmp_path)
    try:
        started = time.monotonic()
        response = gateway.chat("lazy")
        assert response.status_code == 503
        message = response.json()["error"]["message"]
        assert "model `lazy` failed to load" in message and "load_safetensors" in message, message
        assert f"(log: {engine_home() / 'logs'}/" in message
        assert "retry shortly" not in message
        assert time.monotonic() - started < _EXIT_WITHIN_S
        # The gateway serves on; the model is not left crash-looping.
        assert gateway.proc.poll() is None
        assert gateway.states()["lazy"] == "failed"
        # The status page's stream says the same, with the reason, and the engine's own lines.
        events = Events(gateway.url)
        try:
            snapshot = events.next("snapshot")
        finally:
            events.close()
        (view,) = [m for m in snapshot["models"] if m["id"] == "lazy"]
        assert view["state"] == "failed"
        assert "load_safetensors" in view["reason"]
        assert view["replicas"][0]["last_error"]
        (log,) = [entry for entry in snapshot["logs"] if entry["model"] == "lazy"]
        assert any("load_safetensors" in line for line in log["lines"]), log["lines"][-20:]
    finally:
        gateway.stop()


def engine_running(model: str) -> bool:
    """Whether an mlx_lm.server child serving ``model`` still runs."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b"mlx_lm_server.py") for arg in cmdline) and model.encode() in cmdline:
            return True
    return False
