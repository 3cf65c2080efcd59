"""The coarse timers: each fires once, not before its deadline and at most about a tick after it."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from typing import Any

import pytest

from proxy.timers import TICK_S, CoarseTimers, for_loop

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_timer_fires_after_its_delay_and_not_before() -> None:
    loop = asyncio.get_running_loop()
    timers = CoarseTimers(loop)
    fired: list[float] = []
    start = loop.time()
    timers.later(0.05, lambda: fired.append(loop.time()))
    await asyncio.sleep(0.03)
    assert fired == []
    await asyncio.sleep(0.05 + 3 * TICK_S)
    assert len(fired) == 1
    assert 0.05 <= fired[0] - start < 0.05 + 3 * TICK_S
    assert timers.pending() == 0


async def test_a_cancelled_timer_never_fires_and_the_others_do() -> None:
    timers = CoarseTimers(asyncio.get_running_loop())
    fired: list[str] = []
    first = timers.later(0.02, fired.append, "first")
    timers.later(0.02, fired.append, "second")
    timers.cancel(0.02, first)
    timers.cancel(0.02, first)  # twice: nothing
    await asyncio.sleep(0.02 + 3 * TICK_S)
    assert fired == ["second"]


async def test_timers_of_several_delays_fire_in_deadline_order() -> None:
    timers = CoarseTimers(asyncio.get_running_loop())
    fired: list[str] = []
    timers.later(0.3, fired.append, "long")
    # Set after the long one and due before it: the loop timer is re-armed earlier.
    timers.later(0.02, fired.append, "short")
    await asyncio.sleep(0.02 + 3 * TICK_S)
    assert fired == ["short"]
    await asyncio.sleep(0.3)
    assert fired == ["short", "long"]


async def test_a_failing_callback_is_reported_and_the_rest_still_run() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        timers = CoarseTimers(loop)
        fired: list[str] = []

        def fail() -> None:
            raise RuntimeError("boom")

        timers.later(0.02, fail)
        timers.later(0.02, fired.append, "after")
        await asyncio.sleep(0.02 + 3 * TICK_S)
        assert fired == ["after"]
        assert len(reported) == 1 and isinstance(reported[0]["exception"], RuntimeError)
    finally:
        loop.set_exception_handler(None)


async def test_a_callback_may_cancel_a_timer_due_in_the_same_tick_and_set_another() -> None:
    timers = CoarseTimers(asyncio.get_running_loop())
    fired: list[str] = []
    victim: list[int] = []

    def first() -> None:
        fired.append("first")
        timers.cancel(0.02, victim[0])
        timers.later(0.02, fired.append, "again")

    timers.later(0.02, first)
    victim.append(timers.later(0.02, fired.append, "victim"))
    time.sleep(0.05)  # noqa: ASYNC251 - the loop held, so that both are due when the tick comes
    await asyncio.sleep(0.02 + 4 * TICK_S)
    assert fired == ["first", "again"]
    assert timers.pending() == 0


async def test_one_set_of_timers_per_loop() -> None:
    loop = asyncio.get_running_loop()
    assert for_loop(loop) is for_loop(loop)


@pytest.mark.parametrize("make", [asyncio.new_event_loop, "uvloop"])
def test_a_closed_loops_timers_do_not_keep_it_alive(make: Any) -> None:
    """The timers hold their loop (its clock, its handle): once it is closed, the next loop's
    timers let it go, as tests make a loop each."""
    if make == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        make = uvloop.new_event_loop
    first = make()
    timers = for_loop(first)
    timers.later(60.0, lambda: None)  # its handle armed on the loop
    gone = weakref.ref(first)
    first.close()
    del first, timers
    second = make()
    try:
        for_loop(second)
        gc.collect()
        assert gone() is None
    finally:
        second.close()
