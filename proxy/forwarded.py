"""Who the client is, behind proxies: the peer, or what trusted proxies say.

Only the proxies named by ``--forwarded-allow-ips`` are believed. The chain
sent upstream is rebuilt as nginx's ``$proxy_add_x_forwarded_for`` with
``set_real_ip_from`` does: a trusted peer's X-Forwarded-For with the peer
appended; from anyone else, the peer alone (what an untrusted client claims,
in X-Forwarded-For or Forwarded, never reaches the engine).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from proxy.asgi import Scope


class ProxyTrust:
    """The proxies whose X-Forwarded-For is believed; resolved once, at startup."""

    def __init__(self, trusted_proxies: Iterable[str] = ()) -> None:
        self._trusted = [ipaddress.ip_network(p.strip(), strict=False) for p in trusted_proxies if p.strip()]

    def is_trusted(self, address: str) -> bool:
        if not self._trusted:
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in net for net in self._trusted)

    def client(self, scope: Scope) -> str:
        """The client's address, trusting X-Forwarded-For only from configured proxies."""
        client = scope.get("client")
        peer = str(client[0]) if client else "-"  # ``_peer``, written out
        if not self._trusted or not self.is_trusted(peer):
            return peer
        for hop in reversed(_claimed(scope)):
            # Right to left: the first hop that is not one of our proxies is the client.
            if hop and not self.is_trusted(hop):
                return hop
        return peer

    def x_forwarded_for(self, scope: Scope) -> bytes:
        """The X-Forwarded-For to send upstream: the trusted chain, then the peer."""
        if not self._trusted:
            client = scope.get("client")
            return str(client[0]).encode("latin-1") if client else b"-"
        peer = _peer(scope)
        if self.is_trusted(peer):
            claimed = [hop for hop in _claimed(scope) if hop]
            if claimed:
                return ", ".join([*claimed, peer]).encode("latin-1")
        return peer.encode("latin-1")


def _peer(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "-"


def _claimed(scope: Scope) -> list[str]:
    hops: list[str] = []
    for name, value in scope["headers"]:
        if name == b"x-forwarded-for":
            hops += (hop.strip() for hop in value.decode("latin-1").split(","))
    return hops
