"""The relay's settings: resolved once at startup, read by no request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RelaySettings:
    max_body_bytes: int = 32 * 1024 * 1024
    first_byte_timeout_s: float = 600.0
    read_timeout_s: float = 300.0
    max_queued: int = 256
    queue_timeout_s: float = 60.0
    # The gateway checks API keys: the client's credentials are for it alone.
    strip_credentials: bool = False
    # A request for a model whose child is starting waits this long for it
    # (0: answer 503 model_loading at once).
    load_wait_s: float = 0.0
    # A stream whose head takes longer than this gets SSE keepalive comments.
    heartbeat_s: float = 15.0
    # A whole exchange may take this long (0: no limit).
    total_timeout_s: float = 0.0
    # A client that takes no bytes for this long while some wait is cut (0: never).
    send_stall_s: float = 120.0
    # Proxies whose X-Forwarded-For is believed (and passed on, with the peer appended).
    forwarded_allow_ips: tuple[str, ...] = ()
    # A model's replica with its conversation's prompt cache keeps it while it has at
    # most this many requests in flight more than the least busy (None: least busy only).
    affinity_slack: int | None = 4
    # Seconds between active checks of a model's replicas (0: passive only).
    health_interval_s: float = 2.0
