"""Which models run: lazy single-flight starts, idle unloading, LRU eviction, with real child processes.

Each child is the fake engine (a real HTTP server that answers a 1-token
generation), so starts and stops are real; only the model is missing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from engines.child import Child, ChildState
from engines.registry import Registry
from engines.served import Lifetime, LoadFailed, ModelState, ServedModel
from engines.spec import Guards
from proxy.relay import Relay
from proxy.routing import Replica, Route, RoutingTable, UpstreamAddress
from proxy.startup.settings import Settings
from tests.engines.test_child import config
from tests.helpers import free_port, pid_alive, wait_until_async

pytestmark = pytest.mark.anyio


def kept(
    registry: Registry, name: str, children: list[Child], lifetime: Lifetime | None = None
) -> ServedModel:
    """A model made with ``registry`` as its keeper, and taken in by it."""
    model = ServedModel(name, children, lifetime or Lifetime(), keeper=registry)
    registry.add(model)
    return model


def served(
    tmp_path: Path, registry: Registry, name: str, lifetime: Lifetime | None = None, replicas: int = 1
) -> ServedModel:
    children = [
        Child(config(tmp_path, name=f"{name}-{i}", log_path=tmp_path / "logs" / f"{name}-{i}.log"))
        for i in range(replicas)
    ]
    return kept(registry, name, children, lifetime)


def slow_fake_engine(port: int, delay_s: float) -> list[str]:
    """The argv of a fake engine that takes ``delay_s`` to start listening on ``port`` (a slow load)."""
    return [
        sys.executable,
        "-c",
        f"import time, runpy, sys; time.sleep({delay_s}); sys.argv = ['x', '--port', '{port}']; "
        "runpy.run_module('tests.fake_engine', run_name='__main__')",
    ]


async def test_fifty_concurrent_first_requests_start_exactly_one_child(tmp_path: Path) -> None:
    """50 requests for a cold model at once all wait for one start, and all find it ready."""
    registry = Registry()
    model = served(tmp_path, registry, "cold")
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
    registry = Registry()
    model = served(tmp_path, registry, "ttl", Lifetime(ttl_s=0.5))
    await registry.start()
    try:
        assert await model.wait_ready(0)
        pid = model.children[0].pid
        assert pid is not None
        model.enter()
        await asyncio.sleep(1.5)
        assert model.state == "loaded", "a model with a request in flight was unloaded"
        model.leave()
        await wait_until_async(
            lambda: model.children[0].state is ChildState.STOPPED, "the child stopped", timeout_s=10
        )
        assert model.state == "unloaded"
        assert not pid_alive(pid)
        # The next request loads it again.
        assert await model.wait_ready(0)
        assert model.children[0].starts == 2
    finally:
        await registry.shutdown()


async def test_max_loaded_unloads_the_least_recently_used_idle_model(tmp_path: Path) -> None:
    """With two slots, loading a third model unloads the one used longest ago."""
    registry = Registry(max_loaded=2)
    a, b, c = (served(tmp_path, registry, n) for n in "abc")
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
    registry = Registry(max_loaded=1)
    a, b = served(tmp_path, registry, "a"), served(tmp_path, registry, "b")
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
    registry = Registry(max_loaded=1)
    always = served(tmp_path, registry, "always", Lifetime(always_loaded=True))
    lazy = served(tmp_path, registry, "lazy")
    await registry.start()
    try:
        await registry.wait_ready(15)
        assert always.state == "loaded"
        with pytest.raises(LoadFailed, match="always loaded"):
            await lazy.ensure_loaded()
        assert always.state == "loaded"
    finally:
        await registry.shutdown()


async def test_failed_lazy_load_stops_the_child_and_says_why(tmp_path: Path) -> None:
    """A model whose engine exits at once is not retried in the background; the reason is kept for the 503."""
    registry = Registry()
    argv = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    child = Child(config(tmp_path, argv=argv))
    model = kept(registry, "broken", [child])
    await registry.start()
    try:
        assert not await model.wait_ready(0)
        assert "failed to load" in model.not_ready_reason()
        assert "no model here" in model.not_ready_reason()
        assert f"(log: {child.config.log_path})" in model.not_ready_reason()
        assert model.state == "unloaded"
        await asyncio.sleep(0.5)  # longer than the child's backoff: no restart happens
        assert child.state is ChildState.STOPPED and child.starts == 1
    finally:
        await registry.shutdown()


async def test_unload_waits_for_requests_in_flight(tmp_path: Path) -> None:
    """An admin unload lets the request in flight finish before stopping the children."""
    registry = Registry()
    model = served(tmp_path, registry, "busy")
    await registry.start()
    try:
        assert await model.wait_ready(0)
        model.enter()
        unloading = asyncio.ensure_future(model.unload())
        await asyncio.sleep(0.5)
        assert not unloading.done() and model.state == "unloading"
        assert not model.ready, "new requests would still be let in"
        model.leave()
        await asyncio.wait_for(unloading, 10)
        assert model.state == "unloaded"
    finally:
        await registry.shutdown()


async def test_replace_retires_the_old_model_once_idle_and_starts_an_always_loaded_new_one(
    tmp_path: Path,
) -> None:
    """A reload's replaced model stops after its request ends; its always-loaded successor starts."""
    registry = Registry()
    old = served(tmp_path, registry, "m", Lifetime(always_loaded=True))
    await registry.start()
    try:
        await registry.wait_ready(15)
        old.enter()
        new = ServedModel(
            "m",
            [Child(config(tmp_path, name="m-new", log_path=tmp_path / "logs" / "m-new.log"))],
            Lifetime(always_loaded=True),
            keeper=registry,
        )
        await registry.replace(added=[new], removed=["m"])
        assert registry.models["m"] is new
        await wait_until_async(lambda: new.state == "loaded", "the new model loaded", timeout_s=15)
        assert old.children[0].state is ChildState.READY, "the replaced model was stopped under its request"
        assert old.state == "unloading"
        old.leave()
        retired = old.children[0]
        await wait_until_async(
            lambda: retired.state is ChildState.SHUTDOWN, "the retired child shut down", timeout_s=15
        )
    finally:
        await registry.shutdown()


async def test_a_replica_that_crashes_leaves_the_model_ready_on_the_others(tmp_path: Path) -> None:
    """With two replicas, killing one keeps the model ready; the dead one restarts."""
    registry = Registry()
    model = served(tmp_path, registry, "pair", Lifetime(always_loaded=True), replicas=2)
    await registry.start()
    try:
        await registry.wait_ready(15)
        first = model.children[0]
        assert first.pid is not None
        os.kill(first.pid, signal.SIGKILL)
        await wait_until_async(lambda: not first.ready, "the first child not ready", timeout_s=10)
        assert model.ready
        await wait_until_async(lambda: first.ready, "the first child ready again", timeout_s=15)
        assert first.restarts == 1
    finally:
        await registry.shutdown()


# -- regressions from the review of the registry (each named after what went wrong) ----------


def _route(model: ServedModel) -> Route:
    first = model.children[0].config
    return Route(
        model=model.name,
        upstream=UpstreamAddress(first.host, first.port),
        guards=Guards(),
        gate=model,
        replicas=tuple(Replica(UpstreamAddress(c.config.host, c.config.port), c) for c in model.children),
    )


async def _relay_call(relay: Relay, model: str, *, gone: bool = False) -> tuple[int | None, bytes]:
    """One request through the relay in-process; ``gone``: the client has already left."""
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    messages: list[dict[str, object]] = [{"type": "http.request", "body": body, "more_body": False}]
    never = asyncio.Event()

    async def receive() -> dict[str, object]:
        if messages:
            return messages.pop(0)
        if not gone:
            await never.wait()
        return {"type": "http.disconnect"}

    sent: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
    }
    await relay(scope, receive, send)  # type: ignore[arg-type]
    status = next((m["status"] for m in sent if m["type"] == "http.response.start"), None)
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")  # type: ignore[misc]
    return status, data  # type: ignore[return-value]


async def test_a_model_chosen_for_eviction_is_not_ready_from_that_moment(tmp_path: Path) -> None:
    """Once the registry picks a model to stop, the relay sees it not ready at once, not loop turns later."""
    registry = Registry(max_loaded=1)
    a, b = served(tmp_path, registry, "a"), served(tmp_path, registry, "b")
    await registry.start()
    try:
        assert await a.wait_ready(0)
        loading_b = asyncio.ensure_future(b.wait_ready(0))
        while a.lifecycle is ModelState.LOADED:  # noqa: ASYNC110 - one loop turn at a time is the point
            await asyncio.sleep(0)
        assert a.children[0].state is ChildState.READY  # still up, being stopped
        assert not a.ready and a.state == "unloading"
        assert await loading_b
    finally:
        await registry.shutdown()


async def test_admin_load_counts_as_use_for_the_ttl(tmp_path: Path) -> None:
    """A model loaded by hand with ttl = 2 stays at least 2 s after the load, not unloaded at once."""
    registry = Registry()
    model = served(tmp_path, registry, "t", Lifetime(ttl_s=2))
    await registry.start()
    try:
        await asyncio.sleep(2.5)  # older than its TTL before it is ever loaded
        assert await model.load() is None
        loaded_at = time.monotonic()
        await wait_until_async(lambda: model.state == "unloaded", "the model unloaded", timeout_s=15)
        assert time.monotonic() - loaded_at >= 1.9
    finally:
        await registry.shutdown()


async def test_two_waiters_for_idle_are_both_woken(tmp_path: Path) -> None:
    """wait_idle shares one event per busy spell, so a second waiter does not strand the first."""
    model = ServedModel("w", [Child(config(tmp_path, name="w-0", log_path=tmp_path / "logs" / "w-0.log"))])
    model.enter()
    first = asyncio.ensure_future(model.wait_idle(10))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(model.wait_idle(10))
    await asyncio.sleep(0.05)
    started = time.monotonic()
    model.leave()
    assert list(await asyncio.wait_for(asyncio.gather(first, second), 2)) == [True, True]
    assert time.monotonic() - started < 1


async def test_shutdown_stops_the_children_of_models_being_retired(tmp_path: Path) -> None:
    """A model replaced by a reload and still busy is stopped by the registry's shutdown, not left running."""
    registry = Registry()
    old = served(tmp_path, registry, "r", Lifetime(always_loaded=True))
    await registry.start()
    await registry.wait_ready(15)
    old.enter()
    await registry.replace(added=[], removed=["r"])
    pid = old.children[0].pid
    assert pid is not None
    await registry.shutdown()
    assert old.children[0].state is ChildState.SHUTDOWN
    assert not pid_alive(pid)


async def test_requests_waiting_on_a_load_cancelled_by_a_reload_get_a_503_not_a_500(tmp_path: Path) -> None:
    """A shared load ended by a reload answers its waiters with LoadFailed (503), not CancelledError."""
    registry = Registry()
    port = free_port()
    slow = slow_fake_engine(port, delay_s=2)
    model = kept(registry, "s", [Child(config(tmp_path, argv=slow, port=port))])
    await registry.start()
    try:
        waiters = [asyncio.ensure_future(model.wait_ready(0)) for _ in range(3)]
        await asyncio.sleep(0.3)
        assert model.state == "loading"
        await registry.replace(added=[], removed=["s"])
        assert await asyncio.wait_for(asyncio.gather(*waiters), 10) == [False, False, False]
        assert "stopped loading" in model.not_ready_reason()
    finally:
        await registry.shutdown()


async def test_a_failing_replica_does_not_stop_the_healthy_one_serving_a_lazy_load(tmp_path: Path) -> None:
    """When one of two replicas fails to start, the load succeeds on the other, which keeps serving."""
    registry = Registry()
    bad = Child(config(tmp_path, argv=["/bin/sh", "-c", "sleep 1; echo 'out of memory'; exit 3"], name="bad"))
    good = Child(config(tmp_path, name="good", log_path=tmp_path / "logs" / "good.log"))
    model = kept(registry, "m", [bad, good])
    await registry.start()
    relay = Relay(RoutingTable([_route(model)]), Settings(heartbeat_s=0))
    try:
        status, _ = await _relay_call(relay, "m")
        assert status == 200
        await asyncio.sleep(2.0)  # the bad replica has failed by now, more than once
        assert good.ready and model.state == "loaded"
        assert bad.restarts >= 1 and not bad.ready
        status, _ = await _relay_call(relay, "m")
        assert status == 200
    finally:
        await registry.shutdown()


async def test_a_failed_load_does_not_switch_off_an_always_loaded_model(tmp_path: Path) -> None:
    """An admin load that fails on an always-loaded model leaves its children restarting with backoff."""
    registry = Registry()
    flag = tmp_path / "broken"
    flag.write_text("1")
    port = free_port()
    script = (
        f"import os, sys, runpy; sys.exit(3) if os.path.exists({str(flag)!r}) else None; "
        f"sys.argv = ['x', '--port', '{port}']; runpy.run_module('tests.fake_engine', run_name='__main__')"
    )
    child = Child(config(tmp_path, argv=[sys.executable, "-c", script], port=port))
    model = kept(registry, "a", [child], Lifetime(always_loaded=True))
    await registry.start()
    try:
        problem = await model.load()
        assert problem is not None and "failed to load" in problem
        assert model.lifecycle is ModelState.LOADING, "the always-loaded start was given up"
        flag.unlink()
        await wait_until_async(lambda: model.state == "loaded", "the model loaded", timeout_s=15)
    finally:
        await registry.shutdown()


async def test_an_always_loaded_model_added_by_a_reload_is_never_seen_unloaded(tmp_path: Path) -> None:
    """Right after replace(), a new always-loaded model is already wanted: requests wait, not lazy-load."""
    registry = Registry()
    await registry.start()
    try:
        child = Child(config(tmp_path, name="n-0", log_path=tmp_path / "logs" / "n-0.log"))
        new = ServedModel("n", [child], Lifetime(always_loaded=True), keeper=registry)
        await registry.replace(added=[new], removed=[])
        assert new.lifecycle is ModelState.LOADING and new.state == "loading"
    finally:
        await registry.shutdown()


async def test_unload_never_cuts_a_request_that_outlasts_the_wait(tmp_path: Path) -> None:
    """An unload whose model is still busy after the wait leaves it loaded and says why."""
    registry = Registry(unload_wait_s=0.5)
    model = served(tmp_path, registry, "u")
    await registry.start()
    try:
        assert await model.wait_ready(0)
        model.enter()
        problem = await model.unload()
        assert problem is not None and "in flight" in problem
        assert model.state == "loaded" and model.children[0].ready
        model.leave()
        assert await model.unload() is None
        assert model.state == "unloaded"
    finally:
        await registry.shutdown()


async def test_clients_that_leave_while_their_model_loads_are_not_relayed(tmp_path: Path) -> None:
    """A request whose client is gone stops waiting for the load; the engine never receives it."""
    registry = Registry()
    port = free_port()
    slow = slow_fake_engine(port, delay_s=1.5)
    model = kept(registry, "g", [Child(config(tmp_path, argv=slow, port=port))])
    await registry.start()
    relay = Relay(RoutingTable([_route(model)]), Settings(heartbeat_s=0))
    try:
        results = await asyncio.gather(*(_relay_call(relay, "g", gone=True) for _ in range(5)))
        assert [status for status, _ in results] == [None] * 5
        assert await model.wait_ready(0)
        async with httpx.AsyncClient(trust_env=False) as client:
            records = (await client.get(f"http://127.0.0.1:{port}/_fake/requests")).json()
        # Only the readiness probe's generation reached the engine.
        assert sum(1 for r in records if r.get("path") == "/v1/chat/completions") == 1, records
        assert model.in_flight == 0
    finally:
        await registry.shutdown()


async def test_requests_waiting_for_a_load_are_bounded_by_max_queued(tmp_path: Path) -> None:
    """Past --max-queued, a request for a model that is still loading gets 429 instead of waiting too."""
    registry = Registry()
    port = free_port()
    slow = slow_fake_engine(port, delay_s=1.5)
    model = kept(registry, "q", [Child(config(tmp_path, argv=slow, port=port))])
    await registry.start()
    relay = Relay(RoutingTable([_route(model)]), Settings(heartbeat_s=0, max_queued=2))
    try:
        results = await asyncio.gather(*(_relay_call(relay, "q") for _ in range(5)))
        statuses = sorted(status for status, _ in results if status is not None)
        assert statuses == [200, 200, 429, 429, 429], results
        assert b"to load" in next(body for status, body in results if status == 429)
        assert model.in_flight == 0
    finally:
        await registry.shutdown()


async def test_a_drain_that_ends_answers_requests_waiting_for_a_load(tmp_path: Path) -> None:
    """abort_all (drain timeout, second signal) answers a request waiting for a load with 503 draining."""
    registry = Registry()
    port = free_port()
    slow = slow_fake_engine(port, delay_s=30)
    model = kept(registry, "d", [Child(config(tmp_path, argv=slow, port=port))])
    await registry.start()
    relay = Relay(RoutingTable([_route(model)]), Settings(heartbeat_s=0))
    try:
        waiting = asyncio.ensure_future(_relay_call(relay, "d"))
        await wait_until_async(lambda: model.state == "loading", "the model loading")
        await asyncio.sleep(0.1)
        relay.abort_all("the gateway is shutting down now")
        status, body = await asyncio.wait_for(waiting, 5)
        assert status == 503 and b"draining" in body and b"shutting down now" in body
        assert model.in_flight == 0
    finally:
        await registry.shutdown()


async def test_max_queued_zero_still_lets_the_first_request_start_a_model(tmp_path: Path) -> None:
    """With --max-queued 0, the request that finds its model unloaded starts it and is answered."""
    registry = Registry()
    model = served(tmp_path, registry, "z")
    await registry.start()
    relay = Relay(RoutingTable([_route(model)]), Settings(heartbeat_s=0, max_queued=0))
    try:
        status, _ = await _relay_call(relay, "z")
        assert status == 200
    finally:
        await registry.shutdown()


async def test_a_cuda_variant_without_a_driver_is_told_to_use_the_cpu_variant(tmp_path: Path) -> None:
    """mlx[cuda12] on a machine with no NVIDIA driver dies importing libcuda: the report says what to do."""
    lines: list[str] = []
    registry = Registry(announce=lines.append)
    # What mlx's CUDA build prints there (seen with --engine-variant cuda12 on this CPU-only machine).
    error = "ImportError: libcuda.so.1: cannot open shared object file: No such file or directory"
    argv = [sys.executable, "-c", f"print({error!r}); raise SystemExit(1)"]
    child = Child(config(tmp_path, argv=argv))
    kept(registry, "m", [child], Lifetime(always_loaded=True))
    failures: list[str] = []
    await registry.start(on_start_failed=failures.append)
    try:
        await wait_until_async(lambda: bool(failures), "a start failure reported", timeout_s=15)
        assert f"  | {error}" in lines
        assert any("--engine-variant cpu" in line and "NVIDIA driver" in line for line in lines), lines
    finally:
        await registry.shutdown()


async def test_an_always_loaded_model_that_cannot_start_is_stopped_and_reported(tmp_path: Path) -> None:
    """A child that exits the same way twice: the model stops, its reason is kept, the start hook told."""
    lines: list[str] = []
    registry = Registry(announce=lines.append)
    argv = [sys.executable, "-c", "print('weights are broken'); raise SystemExit(3)"]
    child = Child(config(tmp_path, argv=argv))
    model = kept(registry, "m", [child], Lifetime(always_loaded=True))
    failures: list[str] = []
    started = time.monotonic()
    await registry.start(on_start_failed=failures.append)
    try:
        await wait_until_async(lambda: bool(failures), "a start failure reported", timeout_s=15)
        assert time.monotonic() - started < 10
        assert failures == [
            f"model 'm' cannot start; why is in its engine's last lines above and in {child.config.log_path}"
        ]
        assert "model 'm' cannot start: its engine did not become ready: exited with code 3" in lines
        assert "  | weights are broken" in lines
        assert model.lifecycle is ModelState.UNLOADED
        assert child.state is ChildState.STOPPED and child.starts == 2
        # Its requests are told why, not to retry shortly.
        assert "weights are broken" in model.not_ready_reason()
        assert str(child.config.log_path) in model.not_ready_reason()
    finally:
        await registry.shutdown()


async def test_a_replica_that_cannot_start_beside_one_that_serves_is_not_a_start_failure(
    tmp_path: Path,
) -> None:
    """One replica of two failing: the model serves on the other, and the gateway is not told to stop."""
    lines: list[str] = []
    registry = Registry(announce=lines.append)
    argv = [sys.executable, "-c", "raise SystemExit(3)"]
    bad = Child(config(tmp_path, argv=argv, name="m-1", log_path=tmp_path / "logs" / "m-1.log"))
    good = Child(config(tmp_path, name="m-0", log_path=tmp_path / "logs" / "m-0.log"))
    model = kept(registry, "m", [good, bad], Lifetime(always_loaded=True))
    failures: list[str] = []
    await registry.start(on_start_failed=failures.append)
    try:
        await wait_until_async(
            lambda: any("engine child m-1 failed to start" in line for line in lines),
            "m-1's failed start logged",
            timeout_s=15,
        )
        assert failures == [] and model.state == "loaded"
    finally:
        await registry.shutdown()


async def test_an_always_loaded_model_added_by_a_reload_that_cannot_start_does_not_stop_the_gateway(
    tmp_path: Path,
) -> None:
    """Only a model started with the registry stops the gateway; one from a reload stops with its reason."""
    lines: list[str] = []
    registry = Registry(announce=lines.append)
    argv = [sys.executable, "-c", "print('bad weights'); raise SystemExit(3)"]
    child = Child(config(tmp_path, argv=argv))
    model = ServedModel("late", [child], Lifetime(always_loaded=True), keeper=registry)
    failures: list[str] = []
    await registry.start(on_start_failed=failures.append)
    try:
        await registry.replace(added=[model], removed=[])
        await wait_until_async(
            lambda: "model 'late' cannot start" in " ".join(lines), "late's failure logged", timeout_s=15
        )
        assert failures == []
        assert model.lifecycle is ModelState.UNLOADED and "bad weights" in model.not_ready_reason()
    finally:
        await registry.shutdown()
