"""Which served models run: lazy starts, idle unloading, least-recently-used eviction.

One registry per gateway process. Every start and stop of a model goes
through it, one at a time (a lock), so the count of loaded models is never
read and then acted on by two tasks at once:

- ``load`` is single-flight per model: the first request for an unloaded
  model starts its children; every request that arrives meanwhile awaits the
  same task.
- Before a load would pass ``max_loaded``, the least recently used loaded
  model that is not always-loaded and has no request in flight is unloaded.
  If there is none, the load fails with a clear reason (the client gets 503
  with Retry-After) rather than stopping a model that is serving.
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

from engines.child import Child, ChildFailed
from engines.served import LoadFailed, ServedModel

log = logging.getLogger("blazar.engines")

_SWEEP_MAX_S = 1.0


class Registry:
    """The served models of one gateway process, and the policy that runs them."""

    def __init__(
        self,
        models: Iterable[ServedModel] = (),
        *,
        max_loaded: int = 0,
        announce: Callable[[str], None] = log.info,
        retire_timeout_s: float = 30.0,
    ) -> None:
        self.models: dict[str, ServedModel] = {}
        self.max_loaded = max_loaded
        self._announce = announce
        self._retire_timeout_s = retire_timeout_s
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False
        for model in models:
            self._adopt(model)

    def add(self, model: ServedModel) -> None:
        """Take a model in before ``start`` (at startup)."""
        self._adopt(model)

    def _adopt(self, model: ServedModel) -> None:
        if model.name in self.models:
            raise ValueError(f"model {model.name!r} is given twice")
        model.registry = self
        self.models[model.name] = model

    def loaded(self) -> list[ServedModel]:
        """Models whose children are wanted running (ready or starting)."""
        return [m for m in self.models.values() if m.wanted]

    # -- lifecycle of the whole registry --------------------------------------

    async def start(self) -> None:
        """Start the always-loaded models (in the background) and the idle sweeper."""
        always = [m for m in self.models.values() if m.lifetime.always_loaded]
        if self.max_loaded and len(always) >= self.max_loaded and len(always) < len(self.models):
            self._announce(
                f"{len(always)} always-loaded models fill --max-loaded {self.max_loaded}: "
                "the other models can never be loaded"
            )
        for model in always:
            # Wanted at once, before any request can see the model as unloaded.
            model.wanted = True
            self._background(self._start_eagerly(model))
        self._sweeper = asyncio.ensure_future(self._sweep())

    async def _start_eagerly(self, model: ServedModel) -> None:
        model.wanted = True
        await asyncio.gather(*(self._start_child(model, child) for child in model.children))

    async def _start_child(self, model: ServedModel, child: Child) -> None:
        try:
            await child.ensure_ready()
        except ChildFailed as exc:
            # The child keeps retrying with backoff; say why it is not up yet.
            self._announce(
                f"engine child {child.config.name} failed to start: {exc} (log: {child.config.log_path})"
            )

    async def shutdown(self) -> None:
        """Stop every model's children and reap them."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for task in list(self._tasks):
            task.cancel()
        children = [c for m in self.models.values() for c in m.children]
        for model in self.models.values():
            if model.loading is not None:
                model.loading.cancel()
        await asyncio.gather(*(child.shutdown() for child in children), return_exceptions=True)

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

    # -- load and unload ------------------------------------------------------

    async def load(self, model: ServedModel) -> None:
        """Make ``model`` loaded; one start however many callers ask at once.

        Raises ``LoadFailed`` with the reason when it cannot be loaded.
        """
        if model.loading is None:
            if model.wanted and model.ready:
                return
            model.load_error = None
            model.loading = asyncio.ensure_future(self._load(model))
            model.loading.add_done_callback(lambda _: setattr(model, "loading", None))
        # Shielded: one waiter giving up (its client left) must not cancel
        # the start that the others wait for.
        await asyncio.shield(model.loading)

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
                raise LoadFailed(f"model `{model.name}` was removed by a configuration reload")
            if not model.wanted:
                await self._make_room(model)
                model.wanted = True
        started = time.monotonic()
        self._announce(f"loading model {model.name!r} ({model.description or 'engine'})")
        try:
            await asyncio.gather(*(child.ensure_ready() for child in model.children))
        except ChildFailed as exc:
            reason = f"model `{model.name}` failed to load: {exc}"
            self._announce(reason)
            async with self._lock:
                await self._stop(model)
            raise LoadFailed(reason) from None
        self._announce(f"model {model.name!r} loaded in {time.monotonic() - started:.1f} s")

    async def _make_room(self, model: ServedModel) -> None:
        """Under the lock: unload least recently used models until ``model`` fits."""
        if not self.max_loaded:
            return
        while len(self.loaded()) >= self.max_loaded:
            candidates = [
                m
                for m in self.loaded()
                if m is not model and not m.lifetime.always_loaded and not m.busy and m.loading is None
            ]
            if not candidates:
                names = ", ".join(sorted(m.name for m in self.loaded()))
                raise LoadFailed(
                    f"model `{model.name}` cannot be loaded now: {self.max_loaded} models are loaded "
                    f"(--max-loaded) and none can be unloaded ({names}: in use or always loaded); "
                    "retry shortly"
                )
            victim = min(candidates, key=lambda m: m.last_used)
            self._announce(f"unloading model {victim.name!r} (least recently used) to load {model.name!r}")
            await self._stop(victim)

    async def unload(self, model: ServedModel, *, wait_s: float = 30.0) -> None:
        """Stop ``model``'s children, after its requests in flight end (up to ``wait_s``)."""
        if model.loading is not None:
            with contextlib.suppress(LoadFailed):
                await asyncio.shield(model.loading)
        await model.wait_idle(wait_s)
        async with self._lock:
            await self._stop(model)

    async def _stop(self, model: ServedModel) -> None:
        model.wanted = False
        await asyncio.gather(*(child.stop() for child in model.children))

    # -- idle unloading -------------------------------------------------------

    async def _sweep(self) -> None:
        while True:
            ttls = [m.lifetime.ttl_s for m in self.models.values() if m.lifetime.ttl_s > 0]
            await asyncio.sleep(min([_SWEEP_MAX_S, *(t / 4 for t in ttls)]))
            now = time.monotonic()
            for model in list(self.models.values()):
                ttl_s = model.lifetime.ttl_s
                if (
                    ttl_s > 0
                    and model.wanted
                    and not model.lifetime.always_loaded
                    and not model.busy
                    and model.loading is None
                    and now - model.last_used >= ttl_s
                ):
                    async with self._lock:
                        # Checked again under the lock: a request may have come in.
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
            self._adopt(model)
            if model.lifetime.always_loaded:
                self._background(self._start_eagerly(model))
        for model in retiring:
            self._background(self._retire(model))

    async def _retire(self, model: ServedModel) -> None:
        await model.wait_idle(self._retire_timeout_s)
        if model.loading is not None:
            model.loading.cancel()
        await asyncio.gather(*(child.shutdown() for child in model.children), return_exceptions=True)
        self._announce(f"model {model.name!r} retired")

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
