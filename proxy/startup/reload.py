"""Configuration reloads: the file's models applied again on SIGHUP or when the file changes.

Part of the composition root: what a reload changes is the catalog's
(``Catalog.reload``, planned by ``plan_reload``); this only decides when,
one reload at a time, and says what happened.

The file is read (and, with ``--watch-config``, stat'ed) off the event
loop, in a daemon thread: a path that blocks (a FIFO nobody writes, a
stalled network mount) froze the loop, ``/livez`` included. A read that
has not ended after ``READ_TIMEOUT_S`` fails its reload, and the next
reload waits for that same read rather than start another, so a path that
never answers holds one thread, not one per SIGHUP. A daemon thread, not
the loop's executor: an executor's thread stuck in ``open`` would hold the
gateway's exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from proxy.relay import Relay
from proxy.startup import configfile
from proxy.startup.catalog import Catalog
from proxy.startup.configfile import ConfigError, FileConfig

log = logging.getLogger("blazar.cli")

# A read of the file not ended after this long fails the reload (it goes on in its thread).
READ_TIMEOUT_S = 30.0

T = TypeVar("T")


class Reloader:
    """Reloads the models from the configuration file on SIGHUP or when it changes."""

    _POLL_S = 1.0

    def __init__(
        self,
        file: FileConfig,
        catalog: Catalog,
        keep: list[str],
        *,
        read_option: Callable[[str, object], tuple[str, object]],
        announce: Callable[[str], None],
        watch: bool,
    ) -> None:
        """``keep``: the models named on the command line; ``read_option`` checks a ``[gateway]`` key."""
        self._read_option = read_option
        self._announce = announce
        self._file = file
        self._catalog = catalog
        self._keep = keep
        self._watch = watch
        self._relay: Relay | None = None
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._stamp = _stamp(file.path)
        # The read of the file in progress (in its thread), kept while it has not ended.
        self._reading: asyncio.Future[FileConfig] | None = None

    def start(self, relay: Relay) -> None:
        self._relay = relay
        if self._watch:
            self._spawn(self._watch_file())

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    def reload_soon(self) -> None:
        """The SIGHUP handler (in the event loop): queue a reload."""
        self._spawn(self.reload())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch_file(self) -> None:
        while True:
            await asyncio.sleep(self._POLL_S)
            stamp = await in_thread(_stamp, self._file.path)
            if stamp != self._stamp:
                self._stamp = stamp
                await self.reload()

    async def reload(self) -> None:
        """Apply the file's models now; a file with an error changes nothing."""
        assert self._relay is not None
        async with self._lock:
            path = self._file.path
            self._announce(f"reload: reading {path}")
            try:
                file = await self._read(path)
                await self._catalog.reload(file, self._keep, self._relay)
            except ConfigError as exc:
                self._announce(f"reload failed; the running configuration stays: {exc}")
                return
            except Exception:
                # A bug, not a bad file: say so, keep serving what runs.
                log.exception("reload failed; the running configuration stays")
                self._announce(
                    "reload failed on an internal error (traceback above); the running configuration stays"
                )
                return
            changed = sorted(
                k
                for k in {*file.gateway, *self._file.gateway}
                if file.gateway.get(k) != self._file.gateway.get(k)
            )
            if changed:
                self._announce(
                    f"reload: [gateway] {', '.join(changed)} changed; gateway settings take effect on restart"
                )
            self._file = dataclasses.replace(self._file, models=file.models)

    async def _read(self, path: Path) -> FileConfig:
        """The file, read and checked in a thread; a ``ConfigError`` if that takes too long."""
        if self._reading is None or self._reading.done():
            self._reading = in_thread(configfile.load, path, self._read_option)
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                return await asyncio.shield(self._reading)
        except TimeoutError:
            raise ConfigError(
                f"{path}: reading it did not end within {READ_TIMEOUT_S:g} s (a FIFO nobody writes, "
                "or a stalled network mount?); the next reload waits for this same read"
            ) from None


def in_thread(function: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """``function(*args)`` in a daemon thread of its own, as a future of the running loop.

    For what may block for good (a read of a FIFO): neither the loop nor
    the process's exit waits for it.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(setter: Callable[[Any], None], value: object) -> None:
        if not future.done():  # not cancelled meanwhile
            setter(value)

    def run() -> None:
        setter: Callable[[Any], None]
        value: object
        try:
            value, setter = function(*args), future.set_result
        except BaseException as exc:  # handed to the awaiting task, which decides
            value, setter = exc, future.set_exception
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(settle, setter, value)

    threading.Thread(target=run, name=f"blazar {getattr(function, '__name__', 'read')}", daemon=True).start()
    return future


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size
