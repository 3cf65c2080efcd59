"""Requests that wait for a slot: ended by the drain deadline, and one cancelled while it waits leaks none."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from proxy.admission import Admission
from proxy.relay.ticket import wait_for_slot
from tests.e2e.conftest import FakeEngine, StartGateway
from tests.e2e.raw_http import payload, raw_request, read_all


@pytest.mark.fault("drain", "the drain deadline")
def test_drain_timeout_also_ends_queued_requests(start_gateway: StartGateway, fake: FakeEngine) -> None:
    """Requests still queued at the drain deadline get 503 draining; nothing starts after it."""
    gateway = start_gateway({"fake": fake.url}, "--max-in-flight", "1", "--drain-timeout", "1")
    running = raw_request(gateway, "chunks=200; chunk-delay=0.05", payload(stream=True))
    fake.wait_for_record(lambda r: True)
    queued = raw_request(gateway, "chunks=200; chunk-delay=0.05", payload(stream=True))
    try:
        time.sleep(0.2)
        started = time.monotonic()
        gateway.proc.send_signal(signal.SIGTERM)
        assert b'"code":"draining"' in read_all(running)
        queued_answer = read_all(queued)
        assert queued_answer.startswith(b"HTTP/1.1 503") and b"draining" in queued_answer
        assert gateway.proc.wait(15) == 0
        assert time.monotonic() - started < 8
        assert len(fake.records()) == 1  # the queued request never reached the engine
    finally:
        running.close()
        queued.close()


@pytest.mark.fault("overload", "slots released on every path, cancelled waiters too")
@pytest.mark.anyio
async def test_request_cancelled_while_queued_leaks_no_slot() -> None:
    """A relay task cancelled while it waits for a slot gives its place back."""
    admission = Admission(1, max_queued=4, queue_timeout_s=10)
    assert admission.try_enter()
    never = asyncio.Event()

    async def receive() -> dict[str, object]:
        await never.wait()
        return {"type": "http.disconnect"}

    waiter = asyncio.ensure_future(wait_for_slot(admission, "m", receive))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    admission.leave()
    assert admission.in_flight == 0 and admission.queued == 0
