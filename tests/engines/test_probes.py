"""engines.probes: a generation probe that times out behind the child's own work is not a hang."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines import probes
from engines.process import ChildConfig


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers (a child whose generation queue is full)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield listener.getsockname()[1]


def _config(port: int, tmp_path: Path) -> ChildConfig:
    return ChildConfig(
        name="c",
        served_model="m",
        argv=("x",),
        env={},
        cwd=tmp_path,
        host="127.0.0.1",
        port=port,
        log_path=tmp_path / "log",
        health_path="",
        health_interval_s=0.01,
        probe_interval_s=0.0,
        probe_timeout_s=0.2,
    )


class _Cpu:
    """The child's CPU seconds as a test sets them: each reading adds ``step``."""

    def __init__(self, step: float) -> None:
        self.step = step
        self.used = 0.0
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        self.used += self.step
        return self.used


@pytest.mark.anyio
async def test_a_probe_that_times_out_behind_a_busy_child_is_excused_a_few_times(
    silent_port: int, tmp_path: Path
) -> None:
    """The child worked while the probe waited: no verdict for three probes in a row, then hung."""
    cpu = _Cpu(step=1.0)  # a second of CPU between readings, against a 0.2 s deadline
    verdict = await asyncio.wait_for(probes.watch_health(_config(silent_port, tmp_path), cpu), 30)
    assert verdict == "a 1-token generation did not answer within 0.2 s"
    # Two readings per probe: three excused, the fourth the verdict.
    assert cpu.readings == 8


@pytest.mark.anyio
async def test_a_probe_that_times_out_while_the_child_is_idle_is_a_hang(
    silent_port: int, tmp_path: Path
) -> None:
    """No CPU used while the probe waited: the first timeout is the verdict, as before."""
    cpu = _Cpu(step=0.0)
    verdict = await asyncio.wait_for(probes.watch_health(_config(silent_port, tmp_path), cpu), 30)
    assert verdict == "a 1-token generation did not answer within 0.2 s"
    assert cpu.readings == 2


def test_process_cpu_reads_proc_and_none_for_no_process() -> None:
    """A live process's CPU seconds come from /proc; a pid that is gone, or none, gives None."""
    used = probes.process_cpu_s(os.getpid())
    assert used is not None and used > 0
    assert probes.process_cpu_s(None) is None
    assert probes.process_cpu_s(2**22 + 12345) is None
