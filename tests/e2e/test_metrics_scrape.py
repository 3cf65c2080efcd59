"""A large /metrics scrape is written off the event loop: streams keep flowing while it is.

Writing 20k series took about a quarter of a second, and on the loop every
stream the gateway relayed stopped for as long. The figures are now copied
on the loop and the text written in a thread. The test compares, in the same
run, the longest pause between a stream's events during a scrape with the
time the scrape took: on the loop they were the same; off it, the pause is a
small part of it.
"""

from __future__ import annotations

import itertools
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import FakeEngine, StartGateway

pytestmark = pytest.mark.fault("overload", "a large /metrics scrape while streams run")

# Each model has ~65 series (four histograms and their counters): 300 models, ~20k series.
_MODELS = 300


def test_a_large_metrics_scrape_does_not_stall_a_stream(
    fake: FakeEngine, start_gateway: StartGateway
) -> None:
    """While /metrics writes ~20k series, a stream's events keep coming: no pause near the scrape's length."""
    args = [arg for i in range(_MODELS) for arg in ("--upstream", f"m{i}={fake.url}")]
    gateway = start_gateway({"fake": fake.url}, *args)
    arrivals: list[float] = []
    streaming = threading.Event()
    stop = threading.Event()
    body = {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5000,
        "stream": True,
    }

    def stream() -> None:
        with (
            httpx.Client(trust_env=False, timeout=60) as client,
            client.stream(
                "POST",
                f"{gateway.url}/v1/chat/completions",
                json=body,
                headers={"x-fake": "chunk-delay=0.004"},
            ) as response,
        ):
            for _ in response.iter_raw():
                arrivals.append(time.monotonic())
                streaming.set()
                if stop.is_set():
                    return

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert streaming.wait(30)
    scrapes: list[tuple[float, float]] = []
    series = 0
    with httpx.Client(trust_env=False, timeout=60) as client:
        client.get(f"{gateway.url}/metrics").raise_for_status()  # warm
        for _ in range(3):
            began = time.monotonic()
            response = client.get(f"{gateway.url}/metrics")
            scrapes.append((began, time.monotonic()))
            response.raise_for_status()
            series = sum(1 for line in response.text.splitlines() if not line.startswith("#"))
    stop.set()
    reader.join(30)
    assert series > 15000, series
    for began, ended in scrapes:
        took_s = ended - began
        inside = [t for t in arrivals if began <= t <= ended]
        # The events around the scrape: the one before it, those during it, the one after.
        before = [t for t in arrivals if t < began][-1:]
        after = [t for t in arrivals if t > ended][:1]
        times = before + inside + after
        assert len(times) >= 2, "the stream had ended before the scrape"
        gap_s = max(b - a for a, b in itertools.pairwise(times))
        assert gap_s < took_s / 2, (
            f"the stream paused {gap_s * 1000:.0f} ms in a scrape of {took_s * 1000:.0f} ms"
        )
