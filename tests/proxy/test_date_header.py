"""The Date header a response carries: written at the first tick of each second (``GatewayServer.on_tick``).

uvicorn writes it every tenth tick of its main loop (ticks 0.1 s apart),
from the clock of that tick, so a response's Date lagged the time it was
sent by up to two seconds; the gateway writes it as each second begins.
"""

from __future__ import annotations

import time
from email.utils import formatdate
from typing import Any

import pytest
import uvicorn

from proxy.startup.server import GatewayServer

pytestmark = pytest.mark.anyio


async def _app(scope: Any, receive: Any, send: Any) -> None:
    pass


def date_of(server: uvicorn.Server) -> bytes:
    return dict(server.server_state.default_headers)[b"date"]


async def test_the_date_header_is_written_as_each_second_begins(monkeypatch: pytest.MonkeyPatch) -> None:
    config = uvicorn.Config(_app)
    config.load()
    server = GatewayServer(config, gateway=None, drain_timeout_s=1.0)  # type: ignore[arg-type]
    clock = [1_796_351_439.95]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    assert await server.on_tick(1) is False
    assert date_of(server) == formatdate(1_796_351_439, usegmt=True).encode()
    clock[0] = 1_796_351_439.99
    server.server_state.default_headers = [(b"date", b"left as it is")]
    await server.on_tick(2)
    assert date_of(server) == b"left as it is"  # the same second: not written again
    clock[0] = 1_796_351_440.01
    await server.on_tick(3)  # not a tenth tick, but a new second
    assert date_of(server) == formatdate(1_796_351_440, usegmt=True).encode()
    server.should_exit = True
    assert await server.on_tick(4) is True  # uvicorn's exit check still runs every tick
