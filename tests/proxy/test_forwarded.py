"""Who the client is behind proxies (proxy/forwarded.py), and the chain sent upstream."""

from __future__ import annotations

import pytest

from proxy.asgi import Scope
from proxy.forwarded import ProxyTrust

pytestmark = pytest.mark.fault("clients", "spoofed forwarding and cookies")


def scope(peer: str, *xff: str) -> Scope:
    return {"client": (peer, 5555), "headers": [(b"x-forwarded-for", v.encode()) for v in xff]}


def test_an_untrusted_peers_claims_are_dropped() -> None:
    """Without trusted proxies, or from a peer that is not one, the chain is the peer alone."""
    for trust in (ProxyTrust(), ProxyTrust(["10.0.0.0/8"])):
        assert trust.x_forwarded_for(scope("192.0.2.7", "6.6.6.6")) == b"192.0.2.7"
        assert trust.client(scope("192.0.2.7", "6.6.6.6")) == "192.0.2.7"


def test_a_trusted_peers_chain_is_kept_with_the_peer_appended() -> None:
    """As nginx's $proxy_add_x_forwarded_for: the chain it sent, then the peer; several headers joined."""
    trust = ProxyTrust(["10.0.0.0/8"])
    got = trust.x_forwarded_for(scope("10.1.2.3", "203.0.113.9, 10.9.9.9", "10.8.8.8"))
    assert got == b"203.0.113.9, 10.9.9.9, 10.8.8.8, 10.1.2.3"
    assert trust.x_forwarded_for(scope("10.1.2.3")) == b"10.1.2.3"


def test_the_client_is_the_nearest_untrusted_hop() -> None:
    """Right to left, the first address that is not a trusted proxy; the peer if every hop is one."""
    trust = ProxyTrust(["10.0.0.0/8"])
    assert trust.client(scope("10.1.2.3", "198.51.100.1, 203.0.113.9, 10.9.9.9")) == "203.0.113.9"
    assert trust.client(scope("10.1.2.3", "10.9.9.9")) == "10.1.2.3"
    assert trust.client({"client": None, "headers": []}) == "-"
