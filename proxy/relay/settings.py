"""What the relay reads of the gateway's settings: resolved once at startup, read by no request."""

from __future__ import annotations

from typing import Protocol


class RelaySettings(Protocol):
    """The settings the relay reads, by name and type only.

    Each setting's default, flag, variable and help are written once, in
    ``proxy.startup.settings.Settings``, the frozen object the composition
    root hands to the relay as it is (the request path may not import
    ``startup``; mypy checks that the one fits the other where it is handed
    over).
    """

    @property
    def max_body_bytes(self) -> int: ...
    # Request-body bytes all requests may hold at once (past it, 503).
    @property
    def body_budget_bytes(self) -> int: ...
    @property
    def connect_timeout_s(self) -> float: ...
    @property
    def first_byte_timeout_s(self) -> float: ...
    @property
    def read_timeout_s(self) -> float: ...
    @property
    def max_queued(self) -> int: ...
    @property
    def queue_timeout_s(self) -> float: ...
    # The gateway checks API keys: the client's credentials are for it alone.
    @property
    def strip_credentials(self) -> bool: ...
    # A request for a model whose child is starting waits this long for it
    # (0: answer 503 model_loading at once).
    @property
    def load_wait_s(self) -> float: ...
    # A stream whose head takes longer than this gets SSE keepalive comments.
    @property
    def heartbeat_s(self) -> float: ...
    # A whole exchange may take this long (0: no limit).
    @property
    def total_timeout_s(self) -> float: ...
    # A client that takes no bytes for this long while some wait is cut (0: never).
    @property
    def send_stall_s(self) -> float: ...
    # Proxies whose X-Forwarded-For is believed (and passed on, with the peer appended).
    @property
    def forwarded_allow_ips(self) -> tuple[str, ...]: ...
    # A model's replica with its conversation's prompt cache keeps it while it has at
    # most this many requests in flight more than the least busy (None: least busy only).
    @property
    def affinity_slack(self) -> int | None: ...
    # Seconds between active checks of a model's replicas (0: passive only).
    @property
    def health_interval_s(self) -> float: ...
