"""Fixtures shared by the in-process tests of the gateway."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest


@pytest.fixture
def lines() -> Iterator[io.StringIO]:
    """The access log's lines, caught in a buffer (its handlers, level and propagation restored)."""
    access = logging.getLogger("blazar.access")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    old = access.handlers[:], access.level, access.propagate
    access.handlers[:] = [handler]
    access.setLevel(logging.INFO)
    access.propagate = False
    try:
        yield stream
    finally:
        access.handlers[:], access.propagate = old[0], old[2]
        access.setLevel(old[1])
