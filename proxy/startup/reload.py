"""Configuration reloads: the file's models applied again on SIGHUP or when the file changes.

Part of the composition root: what a reload changes is the catalog's
(``Catalog.reload``, planned by ``plan_reload``); this only decides when,
one reload at a time, and says what happened.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from proxy.relay import Relay
from proxy.startup import configfile
from proxy.startup.catalog import Catalog
from proxy.startup.configfile import ConfigError, FileConfig

log = logging.getLogger("blazar.cli")


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
            stamp = _stamp(self._file.path)
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
                file = configfile.load(path, self._read_option)
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


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size
