"""Optional API keys: `Authorization: Bearer KEY`, `x-api-key: KEY` or `api-key: KEY` (Azure OpenAI's).

Keys are compared in constant time, never logged, never echoed in an error,
and never forwarded to an upstream (the relay drops these headers when keys
are configured). Probes need no key, so a load balancer can check health.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path

from proxy.asgi import Scope

# Paths that answer without a key: liveness and readiness probes.
# "/": what Claude Code asks first (HEAD /), whether the server is there at all.
# The status page's files: a browser asks for them with no key; the page then asks for the key
# and sends it with every request for data (they hold none).
PUBLIC_PATHS = frozenset(
    {"/livez", "/readyz", "/health", "/", "/ui", "/ui/", "/ui/index.html", "/ui/app.js", "/ui/app.css"}
)
CREDENTIAL_HEADERS = frozenset({b"authorization", b"x-api-key", b"api-key"})


class ApiKeys:
    """The set of accepted keys; empty means no authentication."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(dict.fromkeys(k.strip().encode() for k in keys if k.strip()))

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __repr__(self) -> str:
        # Never the keys themselves.
        return f"<ApiKeys {len(self._keys)} configured>"

    def allows(self, scope: Scope) -> bool:
        """Whether the request carries one of the keys."""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and self._matches(token.strip()):
                    return True
            elif (name == b"x-api-key" or name == b"api-key") and self._matches(value.strip()):
                return True
        return False

    def _matches(self, candidate: bytes) -> bool:
        # Compare with every key, so the time taken says nothing about which matched.
        found = False
        for key in self._keys:
            found |= hmac.compare_digest(candidate, key)
        return found


def read_key_file(path: Path) -> list[str]:
    """Keys from a file: one per line; blank lines and lines starting with # are skipped."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
