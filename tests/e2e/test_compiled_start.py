"""The gateway's start says when its request path runs interpreted (``proxy/compiled.py``), and serves
the same either way."""

from __future__ import annotations

import httpx
import pytest

from proxy import compiled
from tests.e2e.conftest import FakeEngine, Running, StartGateway
from tests.e2e.test_exposure import log_once_ready

NOTE = "blazar-proxy: note: the request path runs "
WHY = "; compiled, it takes about 40 % less CPU"


def _answered(gateway: Running) -> None:
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": "fake", "messages": [{"role": "user", "content": "hi"}]},
        trust_env=False,
        timeout=10,
    )
    assert response.status_code == 200 and response.json()["choices"], response.text


def test_the_install_s_build_starts_without_a_note(start_gateway: StartGateway, fake: FakeEngine) -> None:
    """As scripts/test installs it (compiled): no note; a build that could not be used would say why."""
    gateway = start_gateway({"fake": fake.url})
    notes = [line for line in log_once_ready(gateway).splitlines() if line.startswith(NOTE)]
    if compiled.STATE == "compiled":
        assert notes == []
    else:
        assert notes == [f"{NOTE}{compiled.STATE}{WHY}"]
    _answered(gateway)


def test_blazar_interpreted_runs_the_sources_and_says_so(
    start_gateway: StartGateway, fake: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BLAZAR_INTERPRETED", "1")
    gateway = start_gateway({"fake": fake.url})
    log = log_once_ready(gateway)
    notes = [line for line in log.splitlines() if line.startswith(NOTE)]
    assert notes == [f"{NOTE}interpreted: BLAZAR_INTERPRETED is set{WHY}"]
    _answered(gateway)
