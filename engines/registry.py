"""Which served models run: lazy starts, idle unloading, least-recently-used eviction.

One registry per gateway process. Every decision to start or stop a model is
taken under one lock, so the count of loaded models is never read and then
acted on by two tasks at once:

- ``load`` is single-flight per model: the first request for an unloaded
  model starts its children; every request that arrives meanwhile awaits the
  same task. The load is done when one replica is ready; a replica that
  fails keeps retrying on its own, out of rotation.
- Before a load would pass ``max_loaded``, the least recently used loaded
  model that is not always-loaded and has no request in flight is stopped.
  If there is none, the load fails with a clear reason (the client gets 503
  with Retry-After) rather than stopping a model that is serving.
- Stopping starts by clearing ``wanted``, synchronously: from then on the
  model is not ready, so no request can be let in under a stopping child.
- A sweeper unloads models idle for longer than their TTL.
- ``replace`` swaps models on a config reload: the new ones are added, and
  the replaced ones are stopped once their requests in flight have finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from engines.child import Child, ChildFailed, last_words
from engines.served import LoadFailed, ServedModel

log = logging.getLogger("blazar.engines")

_SWEEP_MAX_S = 1.0
# Start attempts in a row, restarts with backoff between them (1 s, 2 s), after
# which an always-loaded model that never became ready has failed for good.
# A start whose failure another would repeat (a generation that fails the
# same way each time, the readiness deadline) is final at once.
_START_ATTEMPTS = 3
# Engine output lines shown when an always-loaded model cannot start.
_FAILURE_LINES = 8
# A child's stop is SIGTERM, its grace, SIGKILL and a reap; past this, something is wrong.
_STOP_MARGIN_S = 10.0


class Registry:
    """The served models of one gateway process, and the policy that runs them."""

    def __init__(
        self,
        models: Iterable[ServedModel] = (),
        *,
        max_loaded: int = 0,
        announce: Callable[[str], None] = log.info,
        unload_wait_s: float = 30.0,
    ) -> None:
        self.models: dict[str, ServedModel] = {}
        self.max_loaded = max_loaded
        self._announce = announce
        # Told why, when a model started with the registry can never be ready (start()).
        self._on_start_failed: Callable[[str], None] | None = None
        self._unload_wait_s = unload_wait_s
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._retiring: set[ServedModel] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False
        for model in models:
            self.add(model)

    def add(self, model: ServedModel) -> None:
        """Take a model in (at startup, or from ``replace``)."""
        if model.name in self.models:
            raise ValueError(f"model {model.name!r} is given twice")
        model.registry = self
        self.models[model.name] = model

    def loaded(self) -> list[ServedModel]:
        """Models whose children are wanted running (ready or starting)."""
        return [m for m in self.models.values() if m.wanted]

    def _running_count(self) -> int:
        # Retiring models still hold their memory until their last request ends.
        return len(self.loaded()) + sum(1 for m in self._retiring if m.running)

    # -- lifecycle of the whole registry --------------------------------------

    async def start(self, on_start_failed: Callable[[str], None] | None = None) -> None:
        """Start the always-loaded models (in the background) and the idle sweeper.

        ``on_start_failed(reason)`` is called when one of them cannot become
        ready (the gateway then stops: it cannot serve what it was started for).
        """
        self._on_start_failed = on_start_failed
        always = [m for m in self.models.values() if m.lifetime.always_loaded]
        if self.max_loaded and len(always) >= self.max_loaded and len(always) < len(self.models):
            self._announce(
                f"{len(always)} always-loaded models fill --max-loaded {self.max_loaded}: "
                "the other models can never be loaded"
            )
        for model in always:
            self._start_eagerly(model, at_start=True)
        self._sweeper = asyncio.ensure_future(self._sweep())

    def _start_eagerly(self, model: ServedModel, *, at_start: bool = False) -> None:
        # Wanted at once, before any request can see the model as unloaded.
        model.wanted = True
        model.last_used = time.monotonic()
        self._background(self._start_model(model, at_start=at_start))

    async def _start_model(self, model: ServedModel, *, at_start: bool) -> None:
        """Start an always-loaded model's replicas; if none can become ready, stop it and say why."""
        errors = await asyncio.gather(*(_start_child(child) for child in model.children))
        failed = [(child, error) for child, error in zip(model.children, errors, strict=True) if error]
        if len(failed) < len(model.children):
            for child, error in failed:
                # It keeps restarting with backoff, out of rotation, while the others serve.
                log_path = child.config.log_path
                self._announce(f"engine child {child.config.name} failed to start: {error} (log: {log_path})")
            return
        child = failed[-1][0]
        summary = f"model {model.name!r} cannot start"
        reason = f"{summary}: its engine did not become ready: {child.failure or child.last_error}"
        # No crash loop in the background: a request tries again (a lazy load) and gets the reason.
        model.load_error = (
            f"model `{model.name}` cannot start: {child.last_error} (log: {child.config.log_path})"
        )
        async with self._lock:
            await self._stop(model)
        self._announce(reason)
        lines = last_words(child.output(), _FAILURE_LINES)
        if lines:
            self._announce(f"the engine's last lines (its whole output is in {child.config.log_path}):")
            for line in lines:
                self._announce(f"  | {line}")
        else:
            self._announce(f"the engine wrote nothing (its log: {child.config.log_path})")
        if at_start and self._on_start_failed is not None:
            self._on_start_failed(
                f"{summary}; why is in its engine's last lines above and in {child.config.log_path}"
            )

    async def shutdown(self) -> None:
        """Stop every model's children, retiring ones included, and reap them."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for task in list(self._tasks):
            task.cancel()
        models = [*self.models.values(), *self._retiring]
        for model in models:
            model.wanted = False
            if model.loading is not None:
                model.loading.cancel()
        children = [c for m in models for c in m.children]
        await asyncio.gather(*(child.shutdown() for child in children), return_exceptions=True)

    def kill_now(self) -> None:
        """SIGKILL every child, retiring ones included, without waiting (the gateway exits at once)."""
        for model in [*self.models.values(), *self._retiring]:
            for child in model.children:
                child.kill_now()

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until every always-loaded model is ready (for tests and scripts)."""
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(
                *(
                    child.ensure_ready()
                    for model in self.models.values()
                    if model.lifetime.always_loaded
                    for child in model.children
                )
            )

    # -- load -----------------------------------------------------------------

    async def load(self, model: ServedModel) -> None:
        """Make ``model`` loaded; one start however many callers ask at once.

        Raises ``LoadFailed`` with the reason when it cannot be loaded.
        """
        if model.loading is None:
            if model.ready:
                return
            model.load_error = None
            model.loading = asyncio.ensure_future(self._load(model))
            model.loading.add_done_callback(lambda _: setattr(model, "loading", None))
        try:
            # Shielded: one waiter giving up (its client left) must not cancel
            # the start that the others wait for.
            await asyncio.shield(model.loading)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this waiter itself is being cancelled
            model.load_error = (
                f"model `{model.name}` stopped loading: the gateway is shutting down or its "
                "configuration was reloaded; retry"
            )
            raise LoadFailed(model.load_error) from None

    async def _load(self, model: ServedModel) -> None:
        try:
            await self._load_once(model)
        except LoadFailed as exc:
            # Kept for the 503 of the requests that waited for this load.
            model.load_error = str(exc)
            raise

    async def _load_once(self, model: ServedModel) -> None:
        if self._closed:
            raise LoadFailed("the gateway is shutting down")
        async with self._lock:
            if self.models.get(model.name) is not model:
                raise LoadFailed(f"model `{model.name}` was removed by a configuration reload; retry")
            was_wanted = model.wanted
            if not was_wanted:
                victims = self._make_room(model)
                model.wanted = True
                for victim in victims:
                    await self._stop(victim)
        started = time.monotonic()
        if not was_wanted:
            self._announce(f"loading model {model.name!r} ({model.description or 'engine'})")
        failure = await self._first_ready(model)
        if failure is None:
            model.last_used = time.monotonic()
            if not was_wanted:
                self._announce(f"model {model.name!r} loaded in {time.monotonic() - started:.1f} s")
            return
        reason = f"model `{model.name}` failed to load: {failure}"
        self._announce(reason)
        if not was_wanted:
            # A model that was not running is not left crash-looping in the
            # background (an always-loaded one that could not start either);
            # the next request tries again. One that was already wanted keeps
            # its children's own restarts with backoff.
            async with self._lock:
                if not model.busy and not model.ready:
                    await self._stop(model)
        raise LoadFailed(reason)

    async def _first_ready(self, model: ServedModel) -> str | None:
        """Start every replica; None once one is ready, else the last failure."""
        starts_of = {asyncio.ensure_future(child.ensure_ready()): child for child in model.children}
        starts = set(starts_of)
        failure = "no replica became ready"
        try:
            while starts:
                done, starts = await asyncio.wait(starts, return_when=asyncio.FIRST_COMPLETED)
                for task, child in ((t, starts_of[t]) for t in done):
                    exc = task.exception()
                    if exc is None:
                        return None
                    failure = f"{exc} (log: {child.config.log_path})"
            return failure
        finally:
            # The others keep starting under their children's owners; only the waits end.
            for task in starts:
                task.cancel()

    def _make_room(self, model: ServedModel) -> list[ServedModel]:
        """Under the lock, with no await: pick the models to stop so that ``model`` fits.

        Their ``wanted`` is cleared here, in the same step as the choice, so
        that no request can enter them between choosing and stopping.
        """
        victims: list[ServedModel] = []
        if not self.max_loaded:
            return victims
        while self._running_count() >= self.max_loaded:
            candidates = [
                m
                for m in self.loaded()
                if m is not model and not m.lifetime.always_loaded and not m.busy and m.loading is None
            ]
            if not candidates:
                names = ", ".join(sorted(m.name for m in self.loaded())) or "models being replaced"
                raise LoadFailed(
                    f"model `{model.name}` cannot be loaded now: {self.max_loaded} models are loaded "
                    f"(--max-loaded) and none can be unloaded ({names}: in use or always loaded); "
                    "retry shortly"
                )
            victim = min(candidates, key=lambda m: m.last_used)
            self._announce(f"unloading model {victim.name!r} (least recently used) to load {model.name!r}")
            victim.wanted = False
            victims.append(victim)
        return victims

    # -- unload ---------------------------------------------------------------

    async def unload(self, model: ServedModel) -> str | None:
        """Stop ``model``'s children once its requests in flight end; None, or why not.

        New requests stop entering at once. If some are still running after
        the unload wait (``--drain-timeout``), the model is left loaded and
        the reason is returned: unloading never cuts a request.
        """
        if model.loading is not None:
            with contextlib.suppress(LoadFailed, asyncio.CancelledError):
                await asyncio.shield(model.loading)
        async with self._lock:
            if not model.wanted:
                return None
            model.wanted = False
        if not await model.wait_idle(self._unload_wait_s):
            async with self._lock:
                model.wanted = True
            return (
                f"model `{model.name}` still has {model.in_flight} requests in flight after "
                f"{self._unload_wait_s:g} s; it stays loaded"
            )
        async with self._lock:
            if model.wanted:
                return f"model `{model.name}` was asked for again while it was unloading; it stays loaded"
            await self._stop(model)
        self._announce(f"model {model.name!r} unloaded")
        return None

    async def _stop(self, model: ServedModel) -> None:
        model.wanted = False
        try:
            async with asyncio.timeout(max(c.config.stop_grace_s for c in model.children) + _STOP_MARGIN_S):
                await asyncio.gather(*(child.stop() for child in model.children))
        except TimeoutError:
            log.error("model %s: its children did not stop in time", model.name)

    # -- idle unloading -------------------------------------------------------

    async def _sweep(self) -> None:
        while True:
            ttls = [m.lifetime.ttl_s for m in self.models.values() if m.lifetime.ttl_s > 0]
            await asyncio.sleep(min([_SWEEP_MAX_S, *(t / 4 for t in ttls)]))
            try:
                await self._sweep_once()
            except Exception:
                log.exception("idle sweep failed; trying again")

    async def _sweep_once(self) -> None:
        for model in list(self.models.values()):
            ttl_s = model.lifetime.ttl_s
            if not (
                ttl_s > 0 and model.wanted and not model.lifetime.always_loaded and model.loading is None
            ):
                continue
            async with self._lock:
                # Checked under the lock, and stopped in the same step: a
                # request may have come in while the lock was awaited.
                if model.wanted and not model.busy and time.monotonic() - model.last_used >= ttl_s:
                    self._announce(f"unloading model {model.name!r}: idle for {ttl_s:g} s")
                    await self._stop(model)

    # -- configuration reload -------------------------------------------------

    async def replace(self, added: Iterable[ServedModel], removed: Iterable[str]) -> None:
        """Add new models and retire removed ones (after their requests in flight end).

        A model whose settings changed is both removed (old object) and added
        (new object under the same name).
        """
        retiring = [self.models.pop(name) for name in removed if name in self.models]
        for model in added:
            self.add(model)
            if model.lifetime.always_loaded:
                self._start_eagerly(model)
        for model in retiring:
            self._retiring.add(model)
            self._background(self._retire(model))

    def retune(self, model: ServedModel) -> None:
        """A running model's lifetime changed on a reload: start it if it is now always-loaded."""
        if model.lifetime.always_loaded and not model.wanted:
            self._start_eagerly(model)

    async def _retire(self, model: ServedModel) -> None:
        # Nothing new can reach it (it is out of the routing table); its
        # requests in flight end by their own timeouts.
        model.wanted = False
        await model.wait_idle(None)
        if model.loading is not None:
            model.loading.cancel()
        await asyncio.gather(*(child.shutdown() for child in model.children), return_exceptions=True)
        self._retiring.discard(model)
        self._announce(f"model {model.name!r} retired")

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _start_child(child: Child) -> str | None:
    """None once the child is ready, or why it did not become ready within its start attempts."""
    try:
        await child.ensure_ready(attempts=_START_ATTEMPTS)
    except ChildFailed as exc:
        return str(exc)
    return None
