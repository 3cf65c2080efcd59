"""The blazar-proxy command line: flags, their BLAZAR_* variables, and bad input."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.e2e.conftest import ROOT, FakeEngine, Running, StartGateway
from tests.helpers import free_port


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_help_shows_every_flags_variable() -> None:
    """--help names the BLAZAR_* variable of every flag."""
    result = run_cli("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for variable in (
        "BLAZAR_UPSTREAM",
        "BLAZAR_HOST",
        "BLAZAR_PORT",
        "BLAZAR_MAX_BODY_BYTES",
        "BLAZAR_CONNECT_TIMEOUT",
        "BLAZAR_FIRST_BYTE_TIMEOUT",
        "BLAZAR_LOG_LEVEL",
    ):
        assert variable in text, variable
    assert "default: 127.0.0.1" in text
    assert "BLAZAR_HOME" in text and "~/.local/share/blazar" in text


def test_engines_list_shows_what_can_be_installed(tmp_path: Path) -> None:
    """`engines list` on an empty home lists every shipped engine version as not installed, and the home."""
    result = run_cli("engines", "list", env={"BLAZAR_HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:] if line.split()}
    for engine in ("mlx-0.32.0", "llamacpp-b11434"):
        assert engine in rows and " no " in rows[engine], result.stdout
    assert "cuda12" in rows["mlx-0.32.0"]
    assert "cpu" in rows["llamacpp-b11434"] and "compiled from source" in rows["llamacpp-b11434"]
    # The retired llama-cpp-python engine is not offered.
    assert "llamacpp-0.3.36" not in result.stdout
    assert str(tmp_path / "engines") in result.stdout


def test_help_documents_the_exit_codes() -> None:
    """--help ends with what each exit code means: 0, 1, 2 and 130."""
    result = run_cli("--help")
    text = " ".join(result.stdout.split())
    assert "Exit codes: 0 stopped by SIGTERM or SIGINT" in text
    for code in ("; 1 an error at start", "; 2 a usage error", "; 130 interrupted before serving"):
        assert code in text, code


def test_nothing_to_serve_is_a_usage_error() -> None:
    """Without an upstream the command exits 2 with a message saying what is missing."""
    result = run_cli(env={"BLAZAR_UPSTREAM": ""})
    assert result.returncode == 2
    assert "--upstream NAME=URL" in result.stderr


def test_bad_upstream_is_a_clear_error() -> None:
    """A malformed NAME=URL exits 2 naming the flag, without a traceback."""
    for spec in ("no-equals-sign", "m=https://h:1", "m=http://[::1:80"):
        result = run_cli("--upstream", spec)
        assert result.returncode == 2, spec
        assert "--upstream" in result.stderr and "Traceback" not in result.stderr


def test_environment_variables_configure_the_gateway(fake: FakeEngine) -> None:
    """BLAZAR_UPSTREAM (several, space-separated) and BLAZAR_PORT work without any flag."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy"],
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "BLAZAR_UPSTREAM": f"a={fake.url} b={fake.url}/v1",
            "BLAZAR_PORT": str(port),
            "BLAZAR_LOG_LEVEL": "warning",
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    gateway = Running(proc=proc, port=port, log_path=ROOT / "unused")
    try:
        with httpx.Client(trust_env=False, timeout=2) as client:
            for _ in range(200):
                try:
                    models = client.get(f"{gateway.url}/v1/models")
                    break
                except httpx.TransportError:
                    if proc.poll() is not None:
                        raise AssertionError("gateway exited") from None
                    time.sleep(0.05)
            assert [m["id"] for m in models.json()["data"]] == ["a", "b"]
    finally:
        gateway.stop()


def test_ready_line_names_the_gateways_url_and_a_request_that_works(
    start_gateway: StartGateway, fake: FakeEngine
) -> None:
    """Once serving, the gateway prints its own URL, its models and a curl command that gets a 200."""
    gateway = start_gateway({"fake": fake.url})
    for _ in range(100):
        if "status page:" in gateway.log():  # the last of the three lines
            break
        time.sleep(0.05)
    lines = gateway.log().splitlines()
    ready = next(line for line in lines if "blazar-proxy: ready:" in line)
    assert f"http://127.0.0.1:{gateway.port}/v1 serves fake" in ready
    curl = next(line for line in lines if "try it: curl" in line)
    argv = shlex.split(curl.split("try it: ", 1)[1])
    url, body = argv[2], argv[argv.index("-d") + 1]
    assert url == f"http://127.0.0.1:{gateway.port}/v1/chat/completions"
    sent = json.loads(body)
    assert sent["model"] == "fake" and sent["max_tokens"] >= 1
    answer = httpx.post(url, content=body, headers={"content-type": "application/json"}, trust_env=False)
    assert answer.status_code == 200, answer.text
    page = next(line for line in lines if "status page:" in line).split("status page: ", 1)[1]
    assert page == f"http://127.0.0.1:{gateway.port}/ui"
    assert httpx.get(page, trust_env=False).headers["content-type"].startswith("text/html")


def test_an_upstream_that_refuses_connections_at_start_is_named(
    start_gateway: StartGateway, fake: FakeEngine
) -> None:
    """The ready line is followed by a warning for each server that refuses connections, and none for
    one that answers."""
    dead = free_port()
    gateway = start_gateway({"fake": fake.url, "gone": f"http://127.0.0.1:{dead}"})
    warning = f"warning: nothing answers at http://127.0.0.1:{dead}/v1 (gone): connection refused"
    for _ in range(100):
        if warning in gateway.log():
            break
        time.sleep(0.05)
    assert warning in gateway.log()
    assert gateway.log().count("warning: nothing answers") == 1
