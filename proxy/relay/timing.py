"""The Server-Timing header: the gateway's own time, and the upstream's until its answer."""

from __future__ import annotations

from time import perf_counter


def server_timing(started: float, sent_at: float = 0.0, answered_at: float = 0.0) -> tuple[bytes, bytes]:
    """The Server-Timing header: the gateway's own time, and the upstream's until its answer.

    The gateway's time is everything from the request's arrival to now except
    the wait between sending upstream and the upstream's answer.
    """
    now = perf_counter()
    if not sent_at:
        return (b"server-timing", b"gateway;dur=%.3f" % ((now - started) * 1000))
    return timing_header(sent_at - started + now - answered_at, answered_at - sent_at)


# Server-Timing's value: the gateway's own time, then the upstream's, in milliseconds.
TIMING = b"gateway;dur=%.3f, upstream;dur=%.3f"


def timing_header(own_s: float, upstream_s: float) -> tuple[bytes, bytes]:
    """Server-Timing from the two times already measured, in seconds."""
    return (b"server-timing", TIMING % (own_s * 1000, upstream_s * 1000))
