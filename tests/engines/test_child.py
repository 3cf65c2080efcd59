"""A child's lifecycle, with real processes: the fake engine, and programs that misbehave.

The fake engine is a real HTTP server that answers a 1-token generation, so
readiness, crashes, health failures and stops all happen for real; only the
model is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engines.child import Child, ChildFailed, ChildState
from engines.process import ChildConfig, Output, last_words, spawn
from tests.helpers import free_port, pid_alive, wait_until_async

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]


def config(tmp_path: Path, argv: list[str] | None = None, **overrides: object) -> ChildConfig:
    port = free_port()
    values: dict[str, object] = {
        "name": "fake",
        "served_model": "fake",
        "argv": tuple(argv or [sys.executable, "-m", "tests.fake_engine", "--port", str(port)]),
        "env": {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
        "cwd": ROOT,
        "host": "127.0.0.1",
        "port": port,
        "log_path": tmp_path / "logs" / "fake.log",
        "ready_timeout_s": 15.0,
        "health_interval_s": 0.2,
        "health_failures": 2,
        "stop_grace_s": 2.0,
        "backoff_initial_s": 0.1,
        "backoff_max_s": 0.4,
    }
    values.update(overrides)
    return ChildConfig(**values)  # type: ignore[arg-type]


@pytest.mark.fault("engines", "a child's start: proven, shared, or failing with why")
async def test_child_becomes_ready_and_logs(tmp_path: Path) -> None:
    """ensure_ready starts the process, proves readiness by a generation, and logs its output."""
    child = Child(config(tmp_path))
    try:
        await child.ensure_ready(15)
        assert child.state is ChildState.READY and child.ready
        assert child.pid is not None and pid_alive(child.pid)
        assert child.ready_in_s is not None and child.ready_in_s > 0
        await wait_until_async(
            lambda: any(line.startswith("PORT ") for line in child.tail), "a PORT line in the tail"
        )
        assert "PORT " in child.config.log_path.read_text()
        # Readiness was a real generation, not /health.
        async with httpx.AsyncClient(trust_env=False) as client:
            records = (await client.get(f"{child.config.base_url}/_fake/requests")).json()
        assert records[0]["path"] == "/v1/chat/completions"
        assert records[0]["model"] == "fake"
    finally:
        await child.shutdown()
    assert child.status().state == "shutdown"


@pytest.mark.fault("engines", "a child stopped: its group killed and reaped")
async def test_child_runs_in_its_own_process_group(tmp_path: Path) -> None:
    """The child leads a new session, so signals to the gateway's group do not reach it by accident."""
    child = Child(config(tmp_path))
    try:
        await child.ensure_ready(15)
        assert child.pid is not None
        assert os.getpgid(child.pid) == child.pid != os.getpgid(0)
    finally:
        await child.shutdown()


@pytest.mark.fault("engines", "a child that crashes, hangs or turns unhealthy")
async def test_crashed_child_is_restarted(tmp_path: Path) -> None:
    """SIGKILL of a ready child moves it out of READY, and it comes back on a new process."""
    child = Child(config(tmp_path))
    try:
        await child.ensure_ready(15)
        first = child.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await wait_until_async(lambda: not child.ready, "the killed child not ready")
        await wait_until_async(lambda: child.ready, "the child ready again", timeout_s=15)
        assert child.pid not in (None, first)
        assert child.restarts == 1
    finally:
        await child.shutdown()


@pytest.mark.fault("engines", "a child that crashes, hangs or turns unhealthy")
async def test_unhealthy_child_is_restarted(tmp_path: Path) -> None:
    """A child whose /health turns 503 (mlx after max_tokens 0) is restarted like a crashed one."""
    child = Child(config(tmp_path))
    try:
        await child.ensure_ready(15)
        first = child.pid
        async with httpx.AsyncClient(trust_env=False) as client:
            # The fake engine, like mlx_lm.server 0.32, breaks for good on this.
            await client.post(
                f"{child.config.base_url}/v1/chat/completions",
                json={"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            )
            assert (await client.get(f"{child.config.base_url}/health")).status_code == 503
        await wait_until_async(lambda: child.pid != first and child.ready, "a new child ready", timeout_s=15)
        assert child.restarts == 1
    finally:
        await child.shutdown()


@pytest.mark.fault("engines", "a child that crashes, hangs or turns unhealthy")
async def test_child_without_health_path_is_watched_by_the_probe_alone(tmp_path: Path) -> None:
    """With no health path (a spec may have none) nothing but the generation probe reaches the child."""
    child = Child(config(tmp_path, health_path="", probe_interval_s=0.3))
    try:
        await child.ensure_ready(15)
        first = child.pid
        async with httpx.AsyncClient(trust_env=False) as client:
            since = len((await client.get(f"{child.config.base_url}/_fake/requests")).json())
            await asyncio.sleep(1.5)  # 7 health intervals, 5 probe intervals
            records = (await client.get(f"{child.config.base_url}/_fake/requests")).json()[since:]
        # Polling "" would GET / (a 404 here) and restart the child after two failures.
        assert child.pid == first and child.ready and child.restarts == 0
        paths = [r["path"] for r in records]
        assert len(paths) >= 2
        assert set(paths) == {"/v1/chat/completions"}
    finally:
        await child.shutdown()


@pytest.mark.fault("engines", "a child that crashes, hangs or turns unhealthy")
async def test_child_whose_generation_hangs_is_restarted(tmp_path: Path) -> None:
    """A child that answers /health but no longer generates is restarted after the probe deadline."""
    port = free_port()
    argv = [sys.executable, "-m", "tests.fake_engine", "--port", str(port), "--hang-after", "1"]
    child = Child(config(tmp_path, argv, port=port, probe_interval_s=0.3, probe_timeout_s=0.5))
    try:
        await child.ensure_ready(15)
        first = child.pid
        async with httpx.AsyncClient(trust_env=False) as client:
            assert (await client.get(f"{child.config.base_url}/health")).status_code == 200
        await wait_until_async(lambda: child.pid != first and child.ready, "a new child ready", timeout_s=15)
        assert child.restarts == 1
    finally:
        await child.shutdown()


@pytest.mark.fault("engines", "a child stopped: its group killed and reaped")
async def test_stop_kills_the_whole_group_and_reaps(tmp_path: Path) -> None:
    """stop() ends the child and anything it started in its group, then it can start again."""
    port = free_port()
    marker = tmp_path / "grandchild.pid"
    script = f"sleep 300 & echo $! > {marker}; exec {sys.executable} -m tests.fake_engine --port {port}"
    child = Child(config(tmp_path, ["sh", "-c", script], port=port))
    try:
        await child.ensure_ready(15)
        pid = child.pid
        assert pid is not None
        grandchild = int(marker.read_text())
        assert pid_alive(grandchild)
        await child.stop()
        assert child.state is ChildState.STOPPED and child.pid is None
        await wait_until_async(
            lambda: not pid_alive(pid) and not pid_alive(grandchild),
            "the child and grandchild gone",
            timeout_s=5,
        )
        await child.ensure_ready(15)
        assert child.ready
    finally:
        await child.shutdown()


@pytest.mark.fault("engines", "a child stopped: its group killed and reaped")
async def test_sigterm_ignored_is_followed_by_sigkill(tmp_path: Path) -> None:
    """A child that ignores SIGTERM is killed after the grace period."""
    port = free_port()
    script = f"trap '' TERM; {sys.executable} -m tests.fake_engine --port {port}; sleep 300"
    child = Child(config(tmp_path, ["sh", "-c", script], port=port, stop_grace_s=0.5))
    await child.ensure_ready(15)
    pid = child.pid
    assert pid is not None
    started = time.monotonic()
    await child.shutdown()
    assert not pid_alive(pid)
    assert time.monotonic() - started < 5


@pytest.mark.fault("engines", "a child's start: proven, shared, or failing with why")
async def test_child_that_exits_reports_why(tmp_path: Path) -> None:
    """A child that exits at once makes ensure_ready fail with its exit code and last output."""
    argv = [sys.executable, "-c", "print('model not found: nope'); raise SystemExit(3)"]
    child = Child(config(tmp_path, argv))
    try:
        with pytest.raises(ChildFailed, match="exited with code 3") as info:
            await child.ensure_ready(15)
        assert "model not found: nope" in str(info.value)
        assert child.state in (ChildState.STOPPED, ChildState.STARTING)
    finally:
        await child.shutdown()


@pytest.mark.fault("engines", "a child's start: proven, shared, or failing with why")
async def test_child_that_never_answers_times_out(tmp_path: Path) -> None:
    """A child that never answers a generation fails readiness at its deadline and is killed."""
    argv = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(300)"]
    child = Child(config(tmp_path, argv, ready_timeout_s=0.5))
    try:
        with pytest.raises(ChildFailed, match=r"not ready within 0\.5 s"):
            await child.ensure_ready(15)
    finally:
        await child.shutdown()
    assert child.status().state == "shutdown"


@pytest.mark.fault("engines", "a child's start: proven, shared, or failing with why")
async def test_requests_to_a_starting_child_wait_for_one_start(tmp_path: Path) -> None:
    """Concurrent ensure_ready calls share one start: one process serves them all."""
    child = Child(config(tmp_path))
    try:
        await asyncio.gather(*(child.ensure_ready(15) for _ in range(10)))
        assert child.restarts == 0
        async with httpx.AsyncClient(trust_env=False) as client:
            records = (await client.get(f"{child.config.base_url}/_fake/requests")).json()
        assert len({r["conn_id"] for r in records}) == 1
    finally:
        await child.shutdown()


@pytest.mark.fault("engines", "a child stopped: its group killed and reaped")
async def test_shutdown_before_start_is_final(tmp_path: Path) -> None:
    """A child shut down before it ever started cannot be started afterwards."""
    child = Child(config(tmp_path))
    await child.shutdown()
    assert child.state is ChildState.SHUTDOWN


@pytest.mark.fault("engines", "a child's start: proven, shared, or failing with why")
async def test_child_whose_generation_fails_the_same_way_every_time_fails_at_once(tmp_path: Path) -> None:
    """A child that answers every readiness generation with the same error is not left starting."""
    port = free_port()
    argv = [sys.executable, "-m", "tests.fake_engine", "--port", str(port), "--broken"]
    child = Child(config(tmp_path, argv, port=port, ready_timeout_s=60.0))
    started = time.monotonic()
    try:
        with pytest.raises(ChildFailed, match=r"answered 404.*5 times in a row, the same way"):
            await child.ensure_ready(30, attempts=3)
        # Well before the readiness deadline, and after one attempt: another would fail the same way.
        assert time.monotonic() - started < 15
        assert child.hopeless and child.starts == 1
        assert child.failure is not None and "404" in child.failure and "last output" not in child.failure
    finally:
        await child.shutdown()


@pytest.mark.fault("engines", "a child's start: proven, shared, or failing with why")
async def test_child_that_exits_the_same_way_twice_has_failed_for_good(tmp_path: Path) -> None:
    """Two attempts that exit with the same code and words are enough: a third would only repeat them."""
    argv = [sys.executable, "-c", "print('model not found: nope'); raise SystemExit(3)"]
    child = Child(config(tmp_path, argv))
    try:
        with pytest.raises(ChildFailed, match="exited with code 3") as info:
            await child.ensure_ready(15, attempts=3)
        assert "model not found: nope" in str(info.value)
        assert child.starts == 2 and child.hopeless
    finally:
        await child.shutdown()


@pytest.mark.fault("engines", "a child's start: proven, shared, or failing with why")
async def test_child_that_exits_differently_each_time_gets_every_attempt(tmp_path: Path) -> None:
    """Exits that differ (a transient fault) are retried with backoff up to the attempts asked for."""
    counter = tmp_path / "count"
    script = (
        f"import pathlib; p = pathlib.Path({str(counter)!r}); n = len(p.read_text()) if p.exists() else 0; "
        "p.write_text('x' * (n + 1)); print('try', 'x' * n); raise SystemExit(1)"
    )
    child = Child(config(tmp_path, [sys.executable, "-c", script]))
    try:
        with pytest.raises(ChildFailed, match="exited with code 1"):
            await child.ensure_ready(15, attempts=3)
        assert child.starts == 3 and not child.hopeless
    finally:
        await child.shutdown()


@pytest.mark.fault("engines", "a child's start: proven, shared, or failing with why")
async def test_output_is_the_last_process_s_own(tmp_path: Path) -> None:
    """output() holds what the last process wrote, not the lines of the attempts before it."""
    counter = tmp_path / "count"
    script = (
        f"import pathlib; p = pathlib.Path({str(counter)!r}); n = len(p.read_text()) if p.exists() else 0; "
        "p.write_text('x' * (n + 1)); print(f'attempt {n}'); raise SystemExit(1)"
    )
    child = Child(config(tmp_path, [sys.executable, "-c", script]))
    try:
        with pytest.raises(ChildFailed):
            await child.ensure_ready(15, attempts=2)
        assert child.output() == ["attempt 1"]
        assert list(child.tail)[-2:] == ["attempt 0", "attempt 1"]
    finally:
        await child.shutdown()


@pytest.mark.fault("engines", "a child's start: proven, shared, or failing with why")
def test_last_words_leave_out_access_lines_frames_and_blanks() -> None:
    """The lines that can say why a child failed: its messages and exceptions, not probes or frames."""
    lines = [
        "2026-12-01 09:20:48,226 - ERROR - generation thread died: Got: ConnectError",
        "Traceback (most recent call last):",
        '  File "/x/server.py", line 95, in run',
        "    yield",
        "",
        "The above exception was the direct cause of the following exception:",
        "huggingface_hub.errors.LocalEntryNotFoundError: Got: ConnectError",
        '127.0.0.1 - - [01/Dec/2026 09:20:48] "POST /v1/chat/completions HTTP/1.1" 404 -',
        'INFO:     127.0.0.1:5000 - "POST /v1/chat/completions HTTP/1.1" 500 Internal Server Error',
    ]
    assert last_words(lines, 5) == [
        "2026-12-01 09:20:48,226 - ERROR - generation thread died: Got: ConnectError",
        "huggingface_hub.errors.LocalEntryNotFoundError: Got: ConnectError",
    ]
    assert last_words(lines, 1) == ["huggingface_hub.errors.LocalEntryNotFoundError: Got: ConnectError"]
    assert last_words(lines, 0) == []


# A program that writes far more than a pipe holds (64 KiB), then serves as the fake engine.
_SPEW_THEN_SERVE = """
import runpy, sys
for i in range(20000):
    print(f"line {i} " + "x" * 100)
print("spewed", flush=True)
sys.argv = ["fake_engine", "--port", sys.argv[1]]
runpy.run_module("tests.fake_engine", run_name="__main__")
"""


@pytest.mark.fault("engines", "a child's log on a full disk")
async def test_a_full_log_disk_does_not_block_the_child(tmp_path: Path) -> None:
    """A child whose log cannot be written (ENOSPC) keeps writing, starts and serves; its lines counted."""
    (tmp_path / "logs").mkdir()
    log_path = tmp_path / "logs" / "fake.log"
    log_path.symlink_to("/dev/full")  # every write: ENOSPC, as on a full disk
    base = config(tmp_path)
    argv = (sys.executable, "-c", _SPEW_THEN_SERVE, str(base.port))
    child = Child(config(tmp_path, list(argv), port=base.port, log_path=log_path))
    try:
        await child.ensure_ready(30)
        assert "spewed" in child.output()
        assert child.pid is not None and pid_alive(child.pid)
        async with httpx.AsyncClient(trust_env=False) as client:
            body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            reply = await client.post(f"{child.config.base_url}/v1/chat/completions", json=body)
        assert reply.status_code == 200
    finally:
        await child.shutdown()
    assert child._output.dropped_lines > 20000


# Writes lines, waits for a file to appear, writes more, exits.
_TWO_PHASES = """
import os, sys, time
for i in range(3000):
    print(f"before {i} " + "x" * 100)
print("phase one over", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
for i in range(10):
    print(f"after {i}")
"""


@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs with a ``logs`` folder, filled up by ``filler``; skipped unless it can be mounted."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mount)], check=False)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (mount / "logs").mkdir()
        with contextlib.suppress(OSError), (mount / "filler").open("wb") as fill:
            while True:
                fill.write(b"\0" * 4096)
                fill.flush()
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.fault("engines", "a child's log on a full disk")
async def test_a_log_disk_with_room_again_gets_the_lines_and_a_note_of_those_dropped(
    tmp_path: Path, full_tmpfs: Path
) -> None:
    """On a full disk the copier drops and counts lines; once there is room it writes on, noting the loss."""
    flag = tmp_path / "room"
    log_path = full_tmpfs / "logs" / "x.log"
    cfg = config(tmp_path, [sys.executable, "-c", _TWO_PHASES, str(flag)], log_path=log_path)
    output = Output(cfg.log_path)
    proc = await spawn(cfg, output)
    drain = asyncio.ensure_future(output.drain(proc))
    await wait_until_async(
        lambda: "phase one over" in output.tail, "phase one over in the tail", timeout_s=30
    )
    (full_tmpfs / "filler").unlink()
    flag.touch()
    await asyncio.wait_for(proc.wait(), 30)
    await asyncio.wait_for(drain, 30)
    text = log_path.read_text()
    assert "after 9" in text
    assert re.search(r"--- \d+ lines dropped: the log could not be written: No space left on device", text)
    assert output.dropped_lines > 0
    assert list(output.tail)[-1] == "after 9"
