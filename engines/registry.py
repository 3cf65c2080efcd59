"""Which served models run: room for loads, idle unloading, reload swaps, start and shutdown.

One registry per gateway process; it keeps the models (``engines.served``)
and the policy between them. Each model owns its own state; the registry
asks it to start, stop or retire, and answers its one question, ``admit``:
may it load now, and whom must it displace?

- ``admit`` is synchronous: the count of models holding a slot is read and
  changed in one step, with no await, so two loads never both take the
  last slot. Before a load would pass ``max_loaded``, the least recently
  used loaded model that is not always-loaded and has no request in flight
  is stopped; its state changes at once, so no request enters it between
  the choice and the stop. If there is none, the load fails with a clear
  reason (the client gets 503 with Retry-After) rather than stopping a
  model that is serving. The loading model then waits for every stop under
  way before its children start: their memory is not free until then.
- Always-loaded models start with the registry, with three attempts; one
  that cannot start stops the gateway (``start``'s ``on_start_failed``).
- A sweeper asks each model to ``expire``: one idle past its TTL stops.
- ``replace`` swaps models on a config reload: the new ones are added, and
  the replaced ones retire once their requests in flight have finished.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

from engines.process import last_words
from engines.served import Lifetime, LoadFailed, ModelState, ServedModel

log = logging.getLogger("blazar.engines")

_SWEEP_MAX_S = 1.0
# Start attempts in a row, restarts with backoff between them (1 s, 2 s), after
# which an always-loaded model that never became ready has failed for good.
# A start whose failure another would repeat (a generation that fails the
# same way each time, the readiness deadline) is final at once.
_START_ATTEMPTS = 3
# Engine output lines shown when an always-loaded model cannot start.
_FAILURE_LINES = 8


class Registry:
    """The served models of one gateway process, and the policy that runs them."""

    def __init__(
        self,
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
        self._tasks: set[asyncio.Task[None]] = set()
        self._retiring: set[ServedModel] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False

    def add(self, model: ServedModel) -> None:
        """Take a model in (at startup, or from ``replace``); it was made with this registry as keeper."""
        if model.name in self.models:
            raise ValueError(f"model {model.name!r} is given twice")
        if model.keeper is not self:
            raise ValueError(f"model {model.name!r} was made for another registry")
        self.models[model.name] = model

    def loaded(self) -> list[ServedModel]:
        """Models holding a slot: their children are wanted running (ready or starting)."""
        return [m for m in self.models.values() if m.lifecycle in (ModelState.LOADING, ModelState.LOADED)]

    def _running_count(self) -> int:
        # Retiring models still hold their memory until their last request ends.
        return len(self.loaded()) + sum(1 for m in self._retiring if m.running)

    # -- what a model asks (engines.served.Keeper) -----------------------------

    @property
    def unload_wait_s(self) -> float:
        return self._unload_wait_s

    def announce(self, line: str) -> None:
        self._announce(line)

    def admit(self, model: ServedModel) -> list[Awaitable[None]]:
        """Make room for ``model`` to load, now, with no await; or ``LoadFailed`` with why not.

        The models it displaces are asked to stop in the same step as the
        choice, so no request can enter them between choosing and stopping.
        Returns their stops and every other one under way, for the model to
        wait on before its children start.
        """
        if self._closed:
            raise LoadFailed("the gateway is shutting down")
        if self.models.get(model.name) is not model:
            raise LoadFailed(f"model `{model.name}` was removed by a configuration reload; retry")
        if self.max_loaded:
            while self._running_count() >= self.max_loaded:
                candidates = [m for m in self.loaded() if m is not model and m.evictable]
                if not candidates:
                    names = ", ".join(sorted(m.name for m in self.loaded())) or "models being replaced"
                    raise LoadFailed(
                        f"model `{model.name}` cannot be loaded now: {self.max_loaded} models are loaded "
                        f"(--max-loaded) and none can be unloaded ({names}: in use or always loaded); "
                        "retry shortly"
                    )
                victim = min(candidates, key=lambda m: m.last_used)
                self._announce(
                    f"unloading model {victim.name!r} (least recently used) to load {model.name!r}"
                )
                victim.stop()
        return [m.stop() for m in self.models.values() if m.lifecycle is ModelState.STOPPING]

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
        # The model holds its slot from this call on: no request sees it unloaded.
        starting = model.start(_START_ATTEMPTS)
        if starting is not None:
            self._background(self._report_start(model, starting, at_start=at_start))

    async def _report_start(
        self, model: ServedModel, starting: Awaitable[list[str | None]], *, at_start: bool
    ) -> None:
        """Say which replicas failed to start; if all did, why (and stop the gateway, if started with it)."""
        errors = await starting
        failed = [(child, error) for child, error in zip(model.children, errors, strict=True) if error]
        if len(failed) < len(model.children):
            for child, error in failed:
                # It keeps restarting with backoff, out of rotation, while the others serve.
                log_path = child.config.log_path
                self._announce(f"engine child {child.config.name} failed to start: {error} (log: {log_path})")
            return
        child = failed[-1][0]
        summary = f"model {model.name!r} cannot start"
        self._announce(f"{summary}: its engine did not become ready: {child.failure or child.last_error}")
        lines = last_words(child.output(), _FAILURE_LINES)
        if lines:
            self._announce(f"the engine's last lines (its whole output is in {child.config.log_path}):")
            for line in lines:
                self._announce(f"  | {line}")
            if any("libcuda.so" in line for line in lines):
                self._announce(
                    "the engine's CUDA variant needs an NVIDIA driver, and it found none (libcuda.so): "
                    "start it with --engine-variant cpu, or auto, which picks the variant the machine has"
                )
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
        await asyncio.gather(*(model.shutdown() for model in models), return_exceptions=True)

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
            stopping = model.expire(time.monotonic())
            if stopping is not None:
                self._announce(f"unloading model {model.name!r}: idle for {model.lifetime.ttl_s:g} s")
                await stopping

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
            self._background(self._retire(model, model.retire()))

    def retune(self, model: ServedModel, lifetime: Lifetime) -> None:
        """A running model's lifetime changed on a reload: it takes it, and starts if now always-loaded."""
        model.retune(lifetime)
        if lifetime.always_loaded:
            self._start_eagerly(model)

    async def _retire(self, model: ServedModel, retiring: Awaitable[None]) -> None:
        # Nothing new can reach it (it is out of the routing table); its
        # requests in flight end by their own timeouts.
        await retiring
        self._retiring.discard(model)
        self._announce(f"model {model.name!r} retired")

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
