"""proxy.startup.reload: the file read off the event loop, and a read that does not end."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from proxy.relay import Relay
from proxy.routing import RoutingTable
from proxy.startup import reload as reload_module
from proxy.startup.catalog import Catalog
from proxy.startup.configfile import FileConfig
from proxy.startup.reload import Reloader
from proxy.startup.settings import Settings

pytestmark = pytest.mark.anyio


class RecordingCatalog(Catalog):
    """A catalog that only records the files a reload hands it."""

    def __init__(self) -> None:
        super().__init__(home=None, registry=None)
        self.files: list[FileConfig] = []

    async def reload(self, file: FileConfig, keep: Any, relay: Relay) -> None:
        self.files.append(file)


def _check(key: str, value: object) -> tuple[str, object]:
    return key, value


async def test_a_read_that_does_not_end_fails_its_reload_and_the_next_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO nobody writes: the reload fails after READ_TIMEOUT_S, saying why; the next one starts no
    second reader but waits for the first, and gets what is written."""
    monkeypatch.setattr(reload_module, "READ_TIMEOUT_S", 0.2)
    path = tmp_path / "blazar.toml"
    os.mkfifo(path)
    said: list[str] = []
    catalog = RecordingCatalog()
    reloader = Reloader(
        FileConfig(path=path), catalog, [], read_option=_check, announce=said.append, watch=False
    )
    reloader.start(Relay(RoutingTable(()), Settings()))
    await reloader.reload()
    assert said[-1].startswith("reload failed; the running configuration stays: ")
    assert "did not end within 0.2 s (a FIFO nobody writes" in said[-1]
    threads = threading.active_count()

    monkeypatch.setattr(reload_module, "READ_TIMEOUT_S", 30.0)  # generous: the writer comes at once
    second = asyncio.create_task(reloader.reload())
    await asyncio.sleep(0.05)
    assert threading.active_count() == threads  # no second reader
    await asyncio.to_thread(path.write_text, '[models.m]\nupstream = "http://127.0.0.1:9"\n')
    await second
    assert [m.name for m in catalog.files[-1].models] == ["m"]
