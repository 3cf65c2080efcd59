"""Admission: slots per model, a FIFO queue, and exactly one release per slot."""

from __future__ import annotations

import asyncio
import math

import pytest

from proxy.admission import Admission
from proxy.errors import HTTPError

pytestmark = pytest.mark.anyio


@pytest.mark.fault("overload", "the limit and the queue: 429 and 503 with Retry-After")
async def test_slots_up_to_the_limit_then_queue_in_order() -> None:
    """Requests past the limit wait, and leave() hands slots to them first come, first served."""
    admission = Admission(2, max_queued=5, queue_timeout_s=5)
    assert admission.try_enter() and admission.try_enter()
    assert not admission.try_enter()
    order: list[int] = []

    async def wait(i: int) -> None:
        await admission.enter("m")
        order.append(i)

    waiters = [asyncio.create_task(wait(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert admission.queued == 3
    for _ in range(3):
        admission.leave()
        await asyncio.sleep(0.01)
    await asyncio.gather(*waiters)
    assert order == [0, 1, 2]
    assert admission.in_flight == 2 and admission.queued == 0


@pytest.mark.fault("overload", "the limit and the queue: 429 and 503 with Retry-After")
async def test_full_queue_is_429_with_retry_after() -> None:
    """A request that finds the queue full is refused with 429 and Retry-After."""
    admission = Admission(1, max_queued=1, queue_timeout_s=5)
    assert admission.try_enter()
    first = asyncio.create_task(admission.enter("m"))
    await asyncio.sleep(0)
    with pytest.raises(HTTPError) as info:
        await admission.enter("m")
    assert info.value.status == 429 and info.value.code == "queue_full"
    assert (b"retry-after", b"1") in info.value.headers
    first.cancel()


@pytest.mark.fault("overload", "the limit and the queue: 429 and 503 with Retry-After")
async def test_queue_timeout_is_503_and_leaves_the_queue() -> None:
    """A request that waits past the queue timeout gets 503 with Retry-After and no longer queues."""
    admission = Admission(1, max_queued=4, queue_timeout_s=0.05)
    assert admission.try_enter()
    with pytest.raises(HTTPError) as info:
        await admission.enter("m")
    assert info.value.status == 503 and info.value.code == "queue_timeout"
    assert admission.queued == 0
    admission.leave()
    assert admission.in_flight == 0


@pytest.mark.fault("overload", "slots released on every path, cancelled waiters too")
async def test_cancelled_waiter_gives_up_its_place() -> None:
    """A waiter cancelled while queued (its client left) is removed, and the slot goes to the next."""
    admission = Admission(1, max_queued=4, queue_timeout_s=5)
    assert admission.try_enter()
    gone = asyncio.create_task(admission.enter("m"))
    stays = asyncio.create_task(admission.enter("m"))
    await asyncio.sleep(0.01)
    gone.cancel()
    await asyncio.sleep(0.01)
    admission.leave()
    await asyncio.wait_for(stays, 1)
    assert admission.in_flight == 1 and admission.queued == 0


@pytest.mark.fault("overload", "slots released on every path, cancelled waiters too")
async def test_slot_handed_to_a_waiter_cancelled_at_that_moment_is_passed_on() -> None:
    """A slot handed over just as the waiter is cancelled is not lost: the next waiter gets it."""
    admission = Admission(1, max_queued=4, queue_timeout_s=5)
    assert admission.try_enter()
    unlucky = asyncio.create_task(admission.enter("m"))
    lucky = asyncio.create_task(admission.enter("m"))
    await asyncio.sleep(0.01)
    admission.leave()  # the slot goes to `unlucky`...
    unlucky.cancel()  # ...which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await unlucky
    await asyncio.wait_for(lucky, 1)
    assert admission.in_flight == 1
    admission.leave()
    assert admission.in_flight == 0


@pytest.mark.fault("overload", "the limit and the queue: 429 and 503 with Retry-After")
async def test_no_limit_means_no_queue() -> None:
    """Without a limit every request enters at once."""
    admission = Admission(None)
    assert all(admission.try_enter() for _ in range(1000))
    for _ in range(1000):
        admission.leave()
    assert admission.in_flight == 0


async def test_a_new_limit_applies_to_the_same_slots_and_queue() -> None:
    """A reload's limit: the requests in flight still count; a higher one lets the queue in, in order."""
    admission = Admission(1, max_queued=5, queue_timeout_s=5)
    assert admission.try_enter()
    order: list[int] = []

    async def wait(i: int) -> None:
        await admission.enter("m")
        order.append(i)

    waiters = [asyncio.create_task(wait(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    admission.set_limit(1)  # unchanged: nobody moves, a newcomer still queues
    assert admission.in_flight == 1 and admission.queued == 3 and not admission.try_enter()
    admission.set_limit(3)
    await asyncio.sleep(0.01)
    assert order == [0, 1] and admission.in_flight == 3 and admission.queued == 1
    admission.set_limit(None)  # no limit: the rest go at once
    await asyncio.gather(*waiters)
    assert order == [0, 1, 2] and admission.in_flight == 4 and admission.queued == 0


@pytest.mark.fault("overload", "the limit and the queue: 429 and 503 with Retry-After")
async def test_a_lowered_limit_applies_while_requests_are_queued() -> None:
    """A lowered limit retires freed slots until in flight is within it; then the queue goes on in order."""
    admission = Admission(4, max_queued=10, queue_timeout_s=5)
    for _ in range(4):
        assert admission.try_enter()
    order: list[int] = []

    async def wait(i: int) -> None:
        await admission.enter("m")
        order.append(i)

    waiters = [asyncio.create_task(wait(i)) for i in range(6)]
    await asyncio.sleep(0.01)
    admission.set_limit(1)
    in_flight: list[int] = []
    for _ in range(4):
        admission.leave()
        await asyncio.sleep(0.01)
        in_flight.append(admission.in_flight)
    # Three slots retired (4 -> 1), then the fourth went to the first in the queue.
    assert in_flight == [3, 2, 1, 1] and order == [0] and admission.queued == 5
    for _ in range(5):
        admission.leave()
        await asyncio.sleep(0.01)
        assert admission.in_flight == 1
    await asyncio.gather(*waiters)
    assert order == [0, 1, 2, 3, 4, 5] and admission.queued == 0
    admission.leave()
    assert admission.in_flight == 0


async def test_retry_after_is_the_queues_drain_time_bounded() -> None:
    """Retry-After = waiting × mean time a slot is held / slots, in whole seconds from 1 to 60."""
    admission = Admission(2, max_queued=100, queue_timeout_s=5)
    assert admission.retry_after_s() == 1  # nothing known yet
    assert admission.try_enter() and admission.try_enter()
    waiters = [asyncio.create_task(admission.enter("m")) for _ in range(8)]
    await asyncio.sleep(0.01)
    admission.leave(2.0)  # a slot held 2 s, passed on to the first waiter
    await asyncio.sleep(0.01)
    assert admission.queued == 7 and admission.service_s == 2.0
    assert admission.retry_after_s() == 7  # 7 × 2 s / 2 slots
    admission.leave(0.0)  # the average moves a tenth of the way: 1.8 s
    await asyncio.sleep(0.01)
    assert admission.retry_after_s() == math.ceil(6 * 1.8 / 2)
    admission.service_s = 1000.0
    assert admission.retry_after_s() == 60
    admission.service_s = 0.001
    assert admission.retry_after_s() == 1
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)


async def test_a_full_queue_s_429_says_how_long_the_queue_needs() -> None:
    """The 429 of a full queue carries the drain time, not a fixed second."""
    admission = Admission(1, max_queued=3, queue_timeout_s=5)
    admission.service_s = 2.0
    assert admission.try_enter()
    waiters = [asyncio.create_task(admission.enter("m")) for _ in range(3)]
    await asyncio.sleep(0.01)
    with pytest.raises(HTTPError) as refused:
        await admission.enter("m")
    assert refused.value.status == 429 and (b"retry-after", b"6") in refused.value.headers
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
