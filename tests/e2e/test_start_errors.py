"""Errors at start say what went wrong, at once: before any engine is installed, with no traceback.

Each case runs `blazar-proxy` as a user does, with a fresh BLAZAR_HOME: an
error found before the install leaves that home without an engines/ folder.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT
from tests.helpers import free_port


def run_to_exit(
    *args: str, home: Path, cwd: Path = ROOT, env: dict[str, str] | None = None, timeout_s: float = 60
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the gateway (on a free port unless told one) until it exits; its result and how long it took."""
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith("BLAZAR_") or k.startswith("BLAZAR_TEST")
    }
    environ.update(
        {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "BLAZAR_HOME": str(home), **(env or {})}
    )
    port = (
        []
        if "--port" in args or "BLAZAR_PORT" in environ or "--config" in args
        else ["--port", str(free_port())]
    )
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "proxy", *port, *args],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return result, time.monotonic() - started


def assert_failed_before_install(
    result: subprocess.CompletedProcess[str], home: Path, *expected: str
) -> None:
    """Exit code 1, one blazar-proxy line holding each of ``expected``, no traceback, nothing installed."""
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blazar-proxy: "), result.stderr
    for part in expected:
        assert part in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert not (home / "engines").exists(), "an engine was installed before the error"


# -- the model, checked before the install ------------------------------------------


@pytest.mark.parametrize("model", ["./nope", "nope", "x.gguf", "../nope/model", "~/nope", "/no/such/model"])
def test_a_model_path_that_names_nothing_does_not_exist_before_any_install(
    tmp_path: Path, model: str
) -> None:
    """--model naming no path, not shaped org/name: "does not exist" with the resolved path, at once."""
    work = tmp_path / "work"
    work.mkdir()
    result, took_s = run_to_exit("--engine", "mlx-0.32.0", "--model", model, home=tmp_path / "home", cwd=work)
    resolved = (work / os.path.expanduser(model)).resolve()
    assert_failed_before_install(result, tmp_path / "home", f"--model {model}: {resolved} does not exist")
    assert took_s < 5


def test_a_hub_shaped_path_under_an_existing_directory_does_not_exist(tmp_path: Path) -> None:
    """models/x, where models/ is a local directory, is a path that does not exist, not a hub repo."""
    (tmp_path / "models").mkdir()
    result, _ = run_to_exit(
        "--engine", "mlx-0.32.0", "--model", "models/x", home=tmp_path / "home", cwd=tmp_path
    )
    assert_failed_before_install(result, tmp_path / "home", f"{tmp_path / 'models' / 'x'} does not exist")


def test_a_text_file_for_llamacpp_is_not_gguf_before_the_build(tmp_path: Path) -> None:
    """llamacpp-b11434 with --model notes.txt says the file is not GGUF at once, compiling nothing."""
    (tmp_path / "notes.txt").write_text("shopping list\n")
    result, took_s = run_to_exit(
        "--engine", "llamacpp-b11434", "--model", "notes.txt", home=tmp_path / "home", cwd=tmp_path
    )
    assert_failed_before_install(
        result, tmp_path / "home", "notes.txt is not a GGUF file", "serves a GGUF file"
    )
    assert took_s < 5


def test_a_gguf_file_for_mlx_names_the_engine_that_serves_it(tmp_path: Path) -> None:
    """A GGUF file given to the mlx engine: the error says it is GGUF and which engine serves it."""
    (tmp_path / "m.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(24))
    result, _ = run_to_exit(
        "--engine", "mlx-0.32.0", "--model", "m.gguf", home=tmp_path / "home", cwd=tmp_path
    )
    assert_failed_before_install(result, tmp_path / "home", "is a GGUF file", "llamacpp-b11434")


def test_a_hub_repo_for_llamacpp_does_not_exist(tmp_path: Path) -> None:
    """llama.cpp downloads nothing: org/name is a local path for it, and it does not exist."""
    result, _ = run_to_exit(
        "--engine", "llamacpp-b11434", "--model", "org/name", home=tmp_path / "home", cwd=tmp_path
    )
    assert_failed_before_install(result, tmp_path / "home", "does not exist", "it downloads nothing")


def test_served_name_for_a_hub_model_says_how_to_serve_it_under_that_name(tmp_path: Path) -> None:
    """--served-name with a hub repo id: the error names the flag and says to download the model."""
    result, _ = run_to_exit(
        "--engine", "mlx-0.32.0", "--model", "org/name", "--served-name", "qwen", home=tmp_path / "home"
    )
    assert_failed_before_install(result, tmp_path / "home", "--served-name qwen:", "repo id 'org/name'")


# -- the config file, checked whole -----------------------------------------------


def readme_toml() -> str:
    """The TOML example of the README's "Many models" section, as written."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"```toml\n(.*?)```", text, re.DOTALL)
    assert match is not None
    return match.group(1)


def test_the_readme_config_example_fails_naming_file_table_and_key(tmp_path: Path) -> None:
    """The README's TOML, its model paths missing here, fails with "does not exist" before any install."""
    path = tmp_path / "blazar.toml"
    path.write_text(readme_toml())
    result, took_s = run_to_exit("--config", str(path), home=tmp_path / "home", cwd=tmp_path)
    assert_failed_before_install(
        result, tmp_path / "home", f"{path}: [models.qwen] model: ", "does not exist"
    )
    assert "--served-name" not in result.stderr
    assert took_s < 5


def test_a_later_model_in_the_file_is_checked_before_the_first_is_installed(tmp_path: Path) -> None:
    """A file whose first model is fine and whose second names no path installs nothing."""
    model = tmp_path / "mlx-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    (model / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    path = tmp_path / "blazar.toml"
    path.write_text(
        f'[models.good]\nengine = "mlx-0.32.0"\nmodel = "{model}"\n\n'
        '[models.bad]\nengine = "llamacpp-b11434"\nmodel = "missing.gguf"\n'
    )
    result, _ = run_to_exit("--config", str(path), home=tmp_path / "home", cwd=tmp_path)
    assert_failed_before_install(result, tmp_path / "home", f"{path}: [models.bad] model: ", "does not exist")


def test_a_hub_model_in_a_table_of_another_name_says_how_to_name_it(tmp_path: Path) -> None:
    """[models.qwen] with a hub repo: the error names the table and suggests the repo id as its name."""
    path = tmp_path / "blazar.toml"
    path.write_text('[models.qwen]\nengine = "mlx-0.32.0"\nmodel = "org/name"\n')
    result, _ = run_to_exit("--config", str(path), home=tmp_path / "home")
    assert_failed_before_install(
        result, tmp_path / "home", f"{path}: [models.qwen]:", '[models."org/name"]', 'aliases = ["qwen"]'
    )
    assert "--served-name" not in result.stderr


def test_an_unknown_variant_and_a_reserved_engine_argument_are_found_before_the_install(
    tmp_path: Path,
) -> None:
    """A variant the engine lacks, an engine argument the gateway sets itself: errors before any install."""
    path = tmp_path / "blazar.toml"
    path.write_text('[models.a]\nengine = "llamacpp-b11434"\nvariant = "cuda13"\nmodel = "x.gguf"\n')
    result, _ = run_to_exit("--config", str(path), home=tmp_path / "home")
    assert_failed_before_install(
        result, tmp_path / "home", f"{path}: [models.a] variant:", "no 'cuda13' variant"
    )
    path.write_text(
        '[models.a]\nengine = "llamacpp-b11434"\nengine-args = ["-m", "other.gguf"]\nmodel = "x.gguf"\n'
    )
    result, _ = run_to_exit("--config", str(path), home=tmp_path / "home")
    assert_failed_before_install(result, tmp_path / "home", f"{path}: [models.a] engine-args:", "'-m'")
    path.write_text('[models.a]\nengine = "mlx-0.32.0"\nengine-args = ["--port", "1"]\nmodel = "org/a"\n')
    result, _ = run_to_exit("--config", str(path), home=tmp_path / "home")
    assert_failed_before_install(result, tmp_path / "home", f"{path}: [models.a] engine-args:", "'--port'")


# -- the port -------------------------------------------------------------------


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another server listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_port_in_use_names_the_flag_before_any_engine_is_installed(tmp_path: Path, taken_port: int) -> None:
    """--port naming a port in use: one line that says to change --port; no engine installed or started."""
    result, took_s = run_to_exit("--engine", "mlx-0.32.0", "--port", str(taken_port), home=tmp_path / "home")
    assert_failed_before_install(
        result,
        tmp_path / "home",
        f"port {taken_port} on 127.0.0.1 is already in use",
        "another port with --port",
    )
    assert took_s < 5


def test_a_port_in_use_names_the_variable_or_the_file_it_came_from(tmp_path: Path, taken_port: int) -> None:
    """A port from BLAZAR_PORT names that variable; one from [gateway] names the file's key."""
    upstream = "a=http://127.0.0.1:9/v1"
    result, _ = run_to_exit("--upstream", upstream, home=tmp_path, env={"BLAZAR_PORT": str(taken_port)})
    assert_failed_before_install(result, tmp_path, "already in use", "another port with BLAZAR_PORT")
    path = tmp_path / "blazar.toml"
    path.write_text(f'[gateway]\nport = {taken_port}\n\n[models.a]\nupstream = "http://127.0.0.1:9/v1"\n')
    result, _ = run_to_exit("--config", str(path), home=tmp_path)
    assert_failed_before_install(
        result, tmp_path, "already in use", f"another port with port in {path}'s [gateway] table"
    )


def test_an_address_of_another_machine_names_the_host_flag(tmp_path: Path) -> None:
    """--host that is no address of this machine: one line saying to give one of its own with --host."""
    result, _ = run_to_exit("--upstream", "a=http://127.0.0.1:9/v1", "--host", "192.0.2.1", home=tmp_path)
    assert_failed_before_install(
        result, tmp_path, "192.0.2.1 is not an address of this machine", "with --host"
    )


def test_a_port_taken_after_the_check_is_one_line_and_exit_code_1(tmp_path: Path, taken_port: int) -> None:
    """uvicorn's own failure to bind (the port taken between the check and the bind): a line, exit 1."""
    code = (
        "from proxy.startup.cli import serve; from proxy.startup.settings import Settings; "
        f"serve(Settings(routes=(), port={taken_port}, log_level='warning'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"blazar-proxy: stopped: cannot listen on 127.0.0.1:{taken_port}"), result.stderr
    assert "--port" in last and "Traceback" not in result.stderr


# -- interrupted ------------------------------------------------------------------


def test_ctrl_c_while_an_engine_installs_exits_130_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C during the install (here one stuck on an index that never answers): a line, exit code 130."""
    with socket.socket() as index:
        # Accepts connections (the kernel's backlog) and never answers: the install waits.
        index.bind(("127.0.0.1", 0))
        index.listen()
        url = f"http://127.0.0.1:{index.getsockname()[1]}/simple"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("BLAZAR_", "UV_"))}
        env.update(
            {
                "PYTHONPATH": str(ROOT),
                "PYTHONUNBUFFERED": "1",
                "BLAZAR_HOME": str(tmp_path / "home"),
                "UV_CACHE_DIR": str(tmp_path / "uv-cache"),
                "UV_DEFAULT_INDEX": url,
                "UV_INDEX_URL": url,
            }
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "--engine", "mlx-0.32.0", "--port", str(free_port())],
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, as a terminal's foreground job
        )
        assert proc.stderr is not None
        seen = []
        try:
            for line in proc.stderr:
                seen.append(line)
                if line.startswith("blazar-proxy: installing "):
                    break
            time.sleep(0.5)
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the whole group
            rest = proc.stderr.read()
            proc.wait(30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            proc.stderr.close()
    output = "".join(seen) + rest
    assert proc.returncode == 130, output
    assert output.strip().splitlines()[-1] == (
        "blazar-proxy: interrupted before the gateway started; no engine child was started"
    )
    assert "Traceback" not in output and "Aborted" not in output
