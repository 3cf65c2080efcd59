"""What a web page may not make the gateway do: DNS rebinding and cross-origin requests.

A page on any site can make its visitor's browser send requests to a gateway
on the visitor's machine or network. Two checks keep those out, before any
route (and before the API key check) sees the request:

- **Host.** A page that rebinds its own name to the gateway's address (DNS
  rebinding) talks to the gateway as its own origin, so CORS never applies;
  but its requests carry its name in ``Host``. Only the gateway's own names
  are served: loopback names, the bound address, the names given with
  ``--allowed-hosts``, and any IP address (a rebinding page is always reached
  by a name, so an address in ``Host`` is never one). Ports are not compared:
  port mappings and proxies in front change them, and the name is what an
  attacker controls.
- **Origin.** A cross-origin page can send a request without a preflight (a
  ``no-cors`` fetch, a form) and run a generation even though it cannot read
  the answer. A request with an ``Origin`` is served only when CORS allows
  that origin, or when the origin is the gateway itself (same-origin: a page
  the gateway serves). A request without one that the browser marks
  ``Sec-Fetch-Site: cross-site`` is refused too.

Non-browser clients (SDKs, curl) send a local or listed name, and no Origin:
the whole cost on their path is one scan of the headers and a set lookup.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from collections.abc import Iterable

from proxy.asgi import Scope
from proxy.cors import Cors
from proxy.errors import HTTPError, echo

# A DNS name as Host carries it (IDNA, lower case): labels of letters, digits, - and _.
_NAME = re.compile(rb"[a-z0-9_-]+(\.[a-z0-9_-]+)*")
# Names of this machine whatever the bind (RFC 6761: browsers resolve *.localhost to loopback).
_LOOPBACK_NAMES = (b"localhost", b"127.0.0.1", b"[::1]")


def host_name(host: bytes) -> bytes | None:
    """The name a Host value names: lower case, without its port or a trailing dot; None if malformed."""
    host = host.strip().lower()
    if host.startswith(b"["):
        end = host.find(b"]")
        if end < 0:
            return None
        name, rest = host[: end + 1], host[end + 1 :]
    else:
        name, colon, port = host.partition(b":")
        rest = colon + port
    if rest and not (rest.startswith(b":") and rest[1:].isdigit()) and rest != b":":
        return None
    name = name.removesuffix(b".")
    return name or None


# A dotted-quad IPv4 address as ipaddress.IPv4Address takes it (no leading zeros), matched without
# its parse: Kubernetes probes and LAN clients send one as Host on every request.
_OCTET = rb"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = re.compile(rb"%s(?:\.%s){3}" % (_OCTET, _OCTET))


def _is_address(name: bytes) -> bool:
    if not name.startswith(b"["):
        return _IPV4.fullmatch(name) is not None
    try:
        ipaddress.IPv6Address(name[1:-1].decode("latin-1") if name.endswith(b"]") else "")
    except ValueError:
        return False
    return True


def _configured(text: str) -> bytes:
    """A name as --host or --allowed-hosts gives it, as a Host value names it; ValueError if it is none."""
    try:
        # An address as --host takes it (::1), as Host carries it ([::1]).
        raw = b"[%s]" % ipaddress.IPv6Address(text).compressed.encode()
    except ValueError:
        try:
            raw = text.encode("idna")
        except UnicodeError:
            raw = b""
    name = host_name(raw)
    if name is None or not (_NAME.fullmatch(name) or _is_address(name)):
        raise ValueError(
            f"{text!r} is not a host name: give names or addresses without a scheme or path "
            "(llm.example.com, 10.0.0.7), or * alone for any"
        )
    return name


class AllowedHosts:
    """The names the gateway answers to; ``*`` among them allows any."""

    def __init__(self, names: Iterable[str], *, bound: str = "127.0.0.1", port: int = 0) -> None:
        given = [n.strip() for n in names if n.strip()]
        self.any_host = "*" in given
        own = {*_LOOPBACK_NAMES, *(_configured(text) for text in given if text != "*")}
        # A --host that names no host is the listen check's to report (cli._check_listen).
        with contextlib.suppress(ValueError):
            own.add(_configured(bound))
        self.names = frozenset(own)
        # What clients send most: a name as it is, or with the port the gateway listens on.
        ports = [b""] if not port else [b"", b":%d" % port]
        self._exact = frozenset(name + p for name in own for p in ports)

    def allows(self, host: bytes) -> bool:
        """Whether a request with this Host value is served (the hot path: a set lookup)."""
        return host in self._exact or self.any_host or self.is_own(host)

    def is_own(self, host: bytes) -> bool:
        """Whether the Host value names this gateway itself (``*`` aside)."""
        if host in self._exact:
            return True
        name = host_name(host)
        if name is None:
            return False
        return name in self.names or name.endswith(b".localhost") or _is_address(name)


class BrowserChecks:
    """The Host and Origin checks of every request, from one scan of its headers."""

    def __init__(self, hosts: AllowedHosts, cors: Cors) -> None:
        self.hosts = hosts
        self.cors = cors

    def refusal(self, scope: Scope) -> HTTPError | None:
        """Why the request is refused, or None when it may go on."""
        host = origin = site = None
        several_origins = False
        for name, value in scope["headers"]:
            if name == b"host":
                # Of several (the protocol's to refuse), a foreign one decides.
                if host is None or not self.hosts.allows(value):
                    host = value
            elif name == b"origin":
                several_origins = origin is not None
                origin = value
            elif name == b"sec-fetch-site":
                site = value
        return self.refusal_of(host, origin, several_origins, site)

    def refusal_of(
        self, host: bytes | None, origin: bytes | None, several_origins: bool, site: bytes | None
    ) -> HTTPError | None:
        """``refusal`` from the values its walk notes: the Host that decides (of several, a foreign
        one), the last Origin and whether there were more, the last Sec-Fetch-Site."""
        # No Host, or an empty one, is not a browser's request (every browser names the host).
        if host and not self.hosts.allows(host):
            return HTTPError(
                403,
                f"Host {echo(bytes(host).decode('latin-1'))!r} is not a name of this gateway; "
                "a gateway reached by another name is given it with --allowed-hosts "
                "(BLAZAR_ALLOWED_HOSTS, or allowed-hosts in the config file)",
                code="host_not_allowed",
            )
        if origin is not None:
            # A browser sends one Origin; several are not a page's request to serve.
            if not several_origins and (self.cors.allows(origin) or self._same_origin(origin, host)):
                return None
            return HTTPError(
                403,
                f"origin {echo(bytes(origin).decode('latin-1'))!r} is not allowed (see --cors-origin)",
                code="origin_not_allowed",
            )
        if site == b"cross-site":
            return HTTPError(
                403,
                "a cross-site browser request is not allowed; a web page needs its origin in --cors-origin",
                code="origin_not_allowed",
            )
        return None

    def _same_origin(self, origin: bytes, host: bytes | None) -> bool:
        """The origin is the gateway itself: its authority is the request's Host, one of the gateway's own."""
        if not host:
            return False
        scheme, sep, authority = origin.lower().partition(b"://")
        return (
            bool(sep)
            and scheme in (b"http", b"https")
            and authority == host.lower()
            and self.hosts.is_own(host)
        )
