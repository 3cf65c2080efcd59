"""The Host and Origin checks, without sockets."""

from __future__ import annotations

import ipaddress

import pytest

from proxy import browser
from proxy.asgi import Scope
from proxy.browser import AllowedHosts, BrowserChecks, host_name
from proxy.cors import Cors


@pytest.mark.parametrize(
    ("value", "name"),
    [
        (b"localhost", b"localhost"),
        (b"LocalHost:8000", b"localhost"),
        (b"localhost.:8000", b"localhost"),
        (b"localhost:", b"localhost"),
        (b"[::1]:8000", b"[::1]"),
        (b"[::1]", b"[::1]"),
        (b"[::1", None),
        (b"::1", None),
        (b"a:b", None),
        (b"a:1:2", None),
        (b"[::1]x", None),
        (b"", None),
        (b":8000", None),
    ],
)
def test_host_name_drops_case_port_and_trailing_dot(value: bytes, name: bytes | None) -> None:
    """A Host value names its host in lower case, without port or trailing dot; a malformed one names none."""
    assert host_name(value) == name


def test_a_bound_address_and_listed_names_are_own() -> None:
    """The bound name and listed names are the gateway's own, as Host carries them (IPv6 in brackets)."""
    hosts = AllowedHosts(["Llm.Example.com.", "münchen.example"], bound="::1", port=8000)
    assert {b"[::1]", b"llm.example.com", b"xn--mnchen-3ya.example"} <= hosts.names
    assert hosts.allows(b"llm.example.com:8000")
    assert hosts.allows(b"xn--mnchen-3ya.example")
    assert not hosts.allows(b"example.com")
    assert AllowedHosts([], bound="gw.lan").allows(b"GW.LAN:1")


@pytest.mark.parametrize("given", ["https://llm.example.com", "a/b", "a:b", ":80"])
def test_a_name_that_is_no_host_is_refused(given: str) -> None:
    """A URL, a path or a malformed name in --allowed-hosts is a ValueError, not a name never matched."""
    with pytest.raises(ValueError, match="is not a host name"):
        AllowedHosts([given])
    # As --host, the listen check reports it.
    assert AllowedHosts([], bound=given).names == AllowedHosts([]).names


def test_star_allows_any_host_but_owns_none() -> None:
    """With *, any Host is served, yet only the gateway's own names count for same-origin."""
    hosts = AllowedHosts(["*"])
    assert hosts.allows(b"rebind.attacker.example")
    assert not hosts.is_own(b"rebind.attacker.example")
    assert hosts.is_own(b"localhost:1")


def scope(**headers: str) -> Scope:
    return {"headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


def test_the_checks_in_order() -> None:
    """Host first, then Origin (CORS or same-origin), then Sec-Fetch-Site; an API client passes."""
    checks = BrowserChecks(AllowedHosts([], port=8000), Cors(["https://app.example"]))
    assert checks.refusal(scope(host="localhost:8000")) is None
    assert checks.refusal(scope()) is None  # an HTTP/1.0 client without Host
    refused = checks.refusal(scope(host="evil.example", origin="https://app.example"))
    assert refused is not None and refused.code == "host_not_allowed"
    assert checks.refusal(scope(host="localhost:8000", origin="https://app.example")) is None
    assert checks.refusal(scope(host="localhost:8000", origin="http://localhost:8000")) is None
    assert checks.refusal(scope(host="localhost:8000", origin="https://localhost:8000")) is None
    for origin in ("null", "http://localhost:8001", "ftp://localhost:8000", "localhost:8000", "https://evil"):
        refused = checks.refusal(scope(host="localhost:8000", origin=origin))
        assert refused is not None and refused.code == "origin_not_allowed", origin
    refused = checks.refusal(scope(host="localhost:8000", sec_fetch_site="cross-site"))
    assert refused is not None and refused.status == 403
    assert checks.refusal(scope(host="localhost:8000", sec_fetch_site="same-site")) is None


def test_a_foreign_one_of_several_hosts_or_any_second_origin_is_refused() -> None:
    """Of two Host values a foreign one decides, in either order; two Origins are never a page's request."""
    checks = BrowserChecks(AllowedHosts([]), Cors(["https://app.example"]))
    for first, second in (("localhost", "evil.example"), ("evil.example", "localhost")):
        headers = [(b"host", first.encode()), (b"host", second.encode())]
        refused = checks.refusal({"headers": headers})
        assert refused is not None and refused.code == "host_not_allowed"
    for origins in (("https://evil", "http://localhost"), ("https://app.example", "https://app.example")):
        headers = [(b"host", b"localhost"), *((b"origin", o.encode()) for o in origins)]
        refused = checks.refusal({"headers": headers})
        assert refused is not None and refused.code == "origin_not_allowed", origins


@pytest.mark.parametrize(
    "name",
    [
        b"127.0.0.1",
        b"10.0.0.7",
        b"255.255.255.255",
        b"0.0.0.0",
        b"256.1.1.1",
        b"01.2.3.4",
        b"1.2.3.04",
        b"1.2.3",
        b"1.2.3.4.5",
        b"2130706433",
        b"0x7f.0.0.1",
        b"127.1",
        b"1.2.3.4\n",
        b"evil.example",
        b"[::1]",
        b"[::ffff:127.0.0.1]",
        b"[::1",
        b"::1]",
        b"[]",
        b"[zz]",
        b"[1.2.3.4]",
    ],
)
def test_an_address_host_is_one_exactly_when_ipaddress_takes_it(name: bytes) -> None:
    """The IPv4 pattern matches what ipaddress.IPv4Address takes (no leading zeros, no short forms)."""
    text = name.decode("latin-1")
    try:
        if text.startswith("[") and text.endswith("]"):
            ipaddress.IPv6Address(text[1:-1])
        else:
            ipaddress.IPv4Address(text)
        expected = True
    except ValueError:
        expected = False
    assert browser._is_address(name) is expected
