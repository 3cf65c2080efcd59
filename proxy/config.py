"""Gateway settings, resolved once at startup into one frozen object."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.routing import Route


@dataclass(frozen=True, slots=True)
class Settings:
    routes: tuple[Route, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 32 * 1024 * 1024
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 600.0
    read_timeout_s: float = 300.0
    max_queued: int = 256
    queue_timeout_s: float = 60.0
    # Kept out of repr: settings may be logged.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    drain_timeout_s: float = 30.0
    load_wait_s: float = 0.0
    heartbeat_s: float = 15.0
    total_timeout_s: float = 0.0
    send_stall_s: float = 120.0
    # None: affinity off (least busy only).
    affinity_slack: int | None = 4
    health_interval_s: float = 2.0
    header_timeout_s: float = 10.0
    # Above the common balancers' idle timeouts for upstreams (nginx, AWS ALB: 60 s).
    keep_alive_timeout_s: int = 75
    body_timeout_s: float = 60.0
    max_header_bytes: int = 64 * 1024
    metrics: bool = True
    cors_origins: tuple[str, ...] = ()
    access_log: bool = True
    log_format: str = "text"
    forwarded_allow_ips: tuple[str, ...] = ()
    log_level: str = "info"
