"""Shared fixtures: the anyio backend for async tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    # The gateway runs on asyncio (uvloop in production); trio is not a target.
    return "asyncio"
