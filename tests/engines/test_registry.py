"""Which models run: lazy single-flight starts, idle unloading, LRU eviction, with real child processes.

Each child is the fake engine (a real HTTP server that answers a 1-token
generation), so starts and stops are real; only the model is missing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from engines.child import Child, ChildState
from engines.registry import Registry
from engines.served import Lifetime, LoadFailed, ServedModel
from tests.engines.test_child import alive, config, wait_until

pytestmark = pytest.mark.anyio


def served(tmp_path: Path, name: str, lifetime: Lifetime | None = None, replicas: int = 1) -> ServedModel:
    children = [
        Child(config(tmp_path, name=f"{name}-{i}", log_path=tmp_path / "logs" / f"{name}-{i}.log"))
        for i in range(replicas)
    ]
    return ServedModel(name, children, lifetime or Lifetime())


async def test_fifty_concurrent_first_requests_start_exactly_one_child(tmp_path: Path) -> None:
    """50 requests for a cold model at once all wait for one start, and all find it ready."""
    model = served(tmp_path, "cold")
    registry = Registry([model])
    await registry.start()
    try:
        assert model.state == "unloaded"
        results = await asyncio.gather(*(model.wait_ready(0) for _ in range(50)))
        assert all(results)
        assert model.children[0].starts == 1
        assert model.state == "loaded"
    finally:
        await registry.shutdown()


async def test_idle_model_is_unloaded_after_its_ttl_but_not_while_in_use(tmp_path: Path) -> None:
    """A model with a TTL stays while a request is in flight, and is unloaded once idle that long."""
    model = served(tmp_path, "ttl", Lifetime(ttl_s=0.5))
    registry = Registry([model])
    await registry.start()
    try:
        assert await model.wait_ready(0)
        pid = model.children[0].pid
        assert pid is not None
        model.enter()
        await asyncio.sleep(1.5)
        assert model.state == "loaded", "a model with a request in flight was unloaded"
        model.leave()
        await wait_until(lambda: model.children[0].state is ChildState.STOPPED, timeout_s=10)
        assert model.state == "unloaded"
        assert not alive(pid)
        # The next request loads it again.
        assert await model.wait_ready(0)
        assert model.children[0].starts == 2
    finally:
        await registry.shutdown()


async def test_max_loaded_unloads_the_least_recently_used_idle_model(tmp_path: Path) -> None:
    """With two slots, loading a third model unloads the one used longest ago."""
    a, b, c = (served(tmp_path, n) for n in "abc")
    registry = Registry([a, b, c], max_loaded=2)
    await registry.start()
    try:
        assert await a.wait_ready(0)
        assert await b.wait_ready(0)
        a.enter()
        a.leave()  # a is now the more recently used
        assert await c.wait_ready(0)
        assert (a.state, b.state, c.state) == ("loaded", "unloaded", "loaded")
        assert b.children[0].state is ChildState.STOPPED
    finally:
        await registry.shutdown()


async def test_max_loaded_never_evicts_a_model_with_requests_in_flight(tmp_path: Path) -> None:
    """When every loaded model is in use, a load fails with a reason instead of stopping one."""
    a, b = served(tmp_path, "a"), served(tmp_path, "b")
    registry = Registry([a, b], max_loaded=1)
    await registry.start()
    try:
        assert await a.wait_ready(0)
        a.enter()
        assert not await b.wait_ready(0)
        assert "--max-loaded" in b.not_ready_reason()
        assert a.state == "loaded" and b.state == "unloaded"
        a.leave()
        assert await b.wait_ready(0)
        assert a.state == "unloaded"
    finally:
        await registry.shutdown()


async def test_always_loaded_model_starts_with_the_registry_and_is_never_evicted(tmp_path: Path) -> None:
    """An always-loaded model runs from the start and holds its slot against lazy ones."""
    always = served(tmp_path, "always", Lifetime(always_loaded=True))
    lazy = served(tmp_path, "lazy")
    registry = Registry([always, lazy], max_loaded=1)
    await registry.start()
    try:
        await registry.wait_ready(15)
        assert always.state == "loaded"
        with pytest.raises(LoadFailed, match="always loaded"):
            await registry.load(lazy)
        assert always.state == "loaded"
    finally:
        await registry.shutdown()


async def test_failed_lazy_load_stops_the_child_and_says_why(tmp_path: Path) -> None:
    """A model whose engine exits at once is not retried in the background; the reason is kept for the 503."""
    argv = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    child = Child(config(tmp_path, argv=argv))
    model = ServedModel("broken", [child])
    registry = Registry([model])
    await registry.start()
    try:
        assert not await model.wait_ready(0)
        assert "failed to load" in model.not_ready_reason()
        assert "no model here" in model.not_ready_reason()
        assert model.state == "unloaded"
        await asyncio.sleep(0.5)  # longer than the child's backoff: no restart happens
        assert child.state is ChildState.STOPPED and child.starts == 1
    finally:
        await registry.shutdown()


async def test_unload_waits_for_requests_in_flight(tmp_path: Path) -> None:
    """An admin unload lets the request in flight finish before stopping the children."""
    model = served(tmp_path, "busy")
    registry = Registry([model])
    await registry.start()
    try:
        assert await model.wait_ready(0)
        model.enter()
        unloading = asyncio.ensure_future(model.unload())
        await asyncio.sleep(0.5)
        assert not unloading.done() and model.state == "loaded"
        model.leave()
        await asyncio.wait_for(unloading, 10)
        assert model.state == "unloaded"
    finally:
        await registry.shutdown()


async def test_replace_retires_the_old_model_once_idle_and_starts_an_always_loaded_new_one(
    tmp_path: Path,
) -> None:
    """A reload's replaced model stops after its request ends; its always-loaded successor starts."""
    old = served(tmp_path, "m", Lifetime(always_loaded=True))
    registry = Registry([old])
    await registry.start()
    try:
        await registry.wait_ready(15)
        old.enter()
        new = ServedModel(
            "m",
            [Child(config(tmp_path, name="m-new", log_path=tmp_path / "logs" / "m-new.log"))],
            Lifetime(always_loaded=True),
        )
        await registry.replace(added=[new], removed=["m"])
        assert registry.models["m"] is new
        await wait_until(lambda: new.state == "loaded", timeout_s=15)
        assert old.state == "loaded", "the replaced model was stopped under its request"
        old.leave()
        await wait_until(lambda: old.children[0].state is ChildState.SHUTDOWN, timeout_s=15)
    finally:
        await registry.shutdown()


async def test_a_replica_that_crashes_leaves_the_model_ready_on_the_others(tmp_path: Path) -> None:
    """With two replicas, killing one keeps the model ready; the dead one restarts."""
    model = served(tmp_path, "pair", Lifetime(always_loaded=True), replicas=2)
    registry = Registry([model])
    await registry.start()
    try:
        await registry.wait_ready(15)
        first = model.children[0]
        assert first.pid is not None
        os.kill(first.pid, signal.SIGKILL)
        await wait_until(lambda: not first.ready, timeout_s=10)
        assert model.ready
        await wait_until(lambda: first.ready, timeout_s=15)
        assert first.restarts == 1
    finally:
        await registry.shutdown()
