"""The engine manager's part of the gateway's state: each engine model's engine, children and lifetime.

``proxy.status`` reads every model through ``proxy.app.model_views``; for an
engine model it asks ``engine_view`` here (the request path may not import
``engines``), and for the children's logs ``child_logs``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from engines.child import ChildState
from engines.served import HOLDING, ServedModel
from proxy.metrics import EngineSample
from proxy.routing import Route, RoutingTable
from proxy.status import ModelView


def engine_view(route: Route, view: ModelView) -> None:
    """Add an engine model's engine, lifetime, failure and children to its view."""
    served = route.gate
    if not isinstance(served, ServedModel):
        return
    view["engine"] = served.engine or None
    view["variant"] = served.variant or None
    lifetime = served.lifetime
    view["ttl_s"] = lifetime.ttl_s
    view["always_loaded"] = lifetime.always_loaded
    view["idle_s"] = round(time.monotonic() - served.last_used, 1)
    view["reason"] = served.load_error
    if view["state"] == "unloaded" and served.load_error:
        # Its last load failed: the next request tries again, and meets the same reason or not.
        view["state"] = "failed"
    holding = served.lifecycle in HOLDING
    replicas = view["replicas"]
    for index, child in enumerate(served.children):
        if index >= len(replicas):
            replicas.append({"in_flight": 0, "address": f"{child.config.host}:{child.config.port}"})
        state = child.state
        last_error: str | None
        if holding and state in (ChildState.STOPPED, ChildState.STARTING) and child.crash is not None:
            # It served, then died: started again (after its backoff) while its model wants it.
            shown, last_error = "restarting", child.crash
        else:
            # A start's progress notes (a probe that found no server yet) are no error.
            shown, last_error = state.value, None if state is ChildState.STARTING else child.last_error
        replicas[index].update(
            name=child.config.name,
            state=shown,
            # Only while its model wants it running: a stopped child is not unhealthy.
            healthy=child.ready if holding else None,
            pid=child.pid,
            restarts=child.restarts,
            starts=child.starts,
            last_error=last_error,
            log=child.config.name,
        )


def child_logs(table: Callable[[], RoutingTable]) -> Callable[[], Iterator[tuple[str, str, int, list[str]]]]:
    """Each engine child's last lines: (child, model, replica, lines), for the status page's snapshot."""

    def logs() -> Iterator[tuple[str, str, int, list[str]]]:
        for route in table():
            if isinstance(route.gate, ServedModel):
                for index, child in enumerate(route.gate.children):
                    yield child.config.name, route.model, index, list(child.tail)

    return logs


def engine_samples(views: list[ModelView]) -> list[EngineSample]:
    """The engine children as /metrics reports them, from the same views the page shows."""
    return [
        EngineSample(
            model=view["id"],
            replica=str(index),
            up=replica["pid"] is not None,
            ready=replica["state"] == "ready",
            restarts=replica["restarts"],
            starts=replica["starts"],
        )
        for view in views
        for index, replica in enumerate(view["replicas"])
        # A child's replica (engine_view named its log): a static upstream has no process.
        if replica["log"] is not None
    ]
