"""The access log: one line per relayed request, as text or JSON.

Written after the response has ended, never per chunk. Probes and /metrics
are not logged. The client address is the peer's, or, when the peer is one
of the configured proxies (--forwarded-allow-ips), the nearest untrusted
address in its X-Forwarded-For; keys and bodies are never logged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import orjson

from proxy.asgi import Scope
from proxy.forwarded import ProxyTrust

log = logging.getLogger("blazar.access")


class AccessLog:
    def __init__(self, fmt: str = "text", trusted_proxies: Iterable[str] = ()) -> None:
        if fmt not in ("text", "json"):
            raise ValueError(f"log format {fmt!r}: text or json")
        self.json = fmt == "json"
        self.client = ProxyTrust(trusted_proxies).client

    def write(
        self,
        scope: Scope,
        *,
        request_id: bytes,
        model: str,
        status: int,
        bytes_out: int,
        duration_s: float,
        ttfb_s: float | None,
        overhead_s: float | None,
    ) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        client = self.client(scope)
        if self.json:
            line = orjson.dumps(
                {
                    "client": client,
                    "method": scope["method"],
                    "path": scope["path"],
                    "request_id": request_id.decode("latin-1"),
                    "model": model,
                    "status": status,
                    "bytes": bytes_out,
                    "duration_ms": round(duration_s * 1000, 3),
                    "ttfb_ms": round(ttfb_s * 1000, 3) if ttfb_s is not None else None,
                    "overhead_ms": round(overhead_s * 1000, 3) if overhead_s is not None else None,
                }
            ).decode()
        else:
            ttfb = f"{ttfb_s * 1000:.3f}" if ttfb_s is not None else "-"
            overhead = f"{overhead_s * 1000:.3f}" if overhead_s is not None else "-"
            line = (
                f'{client} "{scope["method"]} {scope["path"]}" {status} {bytes_out} '
                f"{duration_s * 1000:.3f}ms ttfb={ttfb}ms overhead={overhead}ms "
                f"model={model or '-'} id={request_id.decode('latin-1')}"
            )
        log.info(line)
