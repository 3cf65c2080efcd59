"""The routing table: which upstream serves which model name.

Built once at startup into frozen objects; the hot path does one dict lookup.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol
from urllib.parse import urlsplit

from proxy.payload import RequestGuards


class UpstreamSpecError(ValueError):
    """A ``NAME=URL`` upstream argument that cannot be used."""


@dataclass(frozen=True, slots=True)
class UpstreamAddress:
    """Where an OpenAI-compatible server listens.

    ``prefix`` is the URL path before ``/v1``: users paste base URLs both with
    and without ``/v1``, and both mean the same server.
    """

    host: str
    port: int
    prefix: str = ""

    @property
    def host_header(self) -> bytes:
        host = f"[{self.host}]" if _is_ipv6(self.host) else self.host
        return f"{host}:{self.port}".encode("ascii")

    @property
    def base_url(self) -> str:
        return f"http://{self.host_header.decode()}{self.prefix}/v1"

    def target(self, endpoint: bytes) -> bytes:
        """The request target for an endpoint like ``b"/chat/completions"``."""
        return self.prefix.encode() + b"/v1" + endpoint


class ReplicaGate(Protocol):
    """Whether one upstream can take requests now (an engine child that is ready), and how
    many times it has started (another start means an empty prompt cache)."""

    @property
    def ready(self) -> bool: ...

    @property
    def starts(self) -> int: ...

    @property
    def name(self) -> str:
        """The child's name, as the status page shows it."""
        ...

    def exited(self) -> bool:
        """Whether the child's process has exited or is exiting (read after an empty reply)."""
        ...


class Gate(Protocol):
    """A model served by engine children: whether it can take requests, and its usage.

    ``wait_ready`` may start the model (a lazy start) or wait for a restart;
    ``enter`` and ``leave`` bracket each relayed request, so that a model in
    use is never unloaded under it.
    """

    @property
    def ready(self) -> bool: ...

    @property
    def state(self) -> str:
        """``loaded``, ``loading`` or ``unloaded``, for /v1/models."""
        ...

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait for readiness (``timeout_s`` for a restart); whether it came."""
        ...

    def not_ready_reason(self) -> str: ...

    def enter(self) -> None: ...

    def leave(self) -> None: ...

    async def load(self) -> str | None:
        """Load the model and wait until it serves; None, or why it could not."""
        ...

    async def unload(self) -> str | None:
        """Stop the model's children once its requests in flight have ended; None, or why not."""
        ...


@dataclass(frozen=True, slots=True)
class Replica:
    """One of the upstreams that serve a model, as configured; ``gate`` None means always tried.

    Its running side (pool, requests in flight) is the relay's ``Peer``.
    """

    upstream: UpstreamAddress
    gate: ReplicaGate | None = None


@dataclass(frozen=True, slots=True)
class Route:
    """A model name as clients see it, and the upstreams that serve it.

    ``gate`` is None for static upstreams, which are always tried; engine
    children gate their routes while they start or restart. A model served
    by several children lists them in ``replicas`` (``upstream`` is then the
    first one's address); a request goes to the least busy ready one.
    Requests naming one of ``aliases`` are sent on with ``model`` renamed.
    """

    model: str
    upstream: UpstreamAddress
    # What its engine needs checked (the defaults for a route with no engine named).
    guards: RequestGuards
    gate: Gate | None = None
    # Requests in flight at once; more wait in a queue. None: no limit.
    max_in_flight: int | None = None
    aliases: tuple[str, ...] = ()
    replicas: tuple[Replica, ...] = ()
    # Where its engine serves Prometheus metrics ("": it does not), scraped
    # through the gateway's /admin/models/NAME/metrics.
    metrics_path: str = ""

    @property
    def all_replicas(self) -> tuple[Replica, ...]:
        """The replicas that serve the model: a route given as one upstream has that one."""
        return self.replicas or (Replica(self.upstream),)


class RoutingTable:
    """Model name → route. Immutable once built."""

    def __init__(self, routes: Iterable[Route]) -> None:
        table: dict[str, Route] = {}
        names: dict[str, Route] = {}
        for route in routes:
            for name in (route.model, *route.aliases):
                if name in names:
                    raise UpstreamSpecError(f"model name {name!r} is given twice")
                names[name] = route
            table[route.model] = route
        self._routes: Mapping[str, Route] = MappingProxyType(table)
        self._names: Mapping[str, Route] = MappingProxyType(names)

    def get(self, model: str) -> Route | None:
        """The route for a model name or one of its aliases."""
        return self._names.get(model)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._routes.values())

    def __len__(self) -> int:
        return len(self._routes)

    def upstreams(self) -> list[UpstreamAddress]:
        """Each distinct upstream once, in the order first named."""
        return list(dict.fromkeys(b.upstream for r in self._routes.values() for b in r.all_replicas))


# OpenAI endpoints: an upstream URL that ends in one was copied from a request, not a base URL.
_ENDPOINT_PATHS = ("/chat/completions", "/completions", "/embeddings", "/models", "/responses")


def parse_upstream_url(url: str) -> UpstreamAddress:
    """Parse ``http://host:port[/prefix][/v1]`` into an address."""
    if "://" not in url:
        raise UpstreamSpecError(f"upstream URL {url!r} has no scheme: write http://{url.strip()}")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise UpstreamSpecError(f"upstream URL {url!r}: {exc}") from None
    if parts.scheme != "http":
        raise UpstreamSpecError(
            f"upstream URL {url!r}: only http:// is supported (TLS to local engines is not)"
        )
    host = parts.hostname
    if not host:
        raise UpstreamSpecError(f"upstream URL {url!r} has no host")
    if not host.isascii() or any(not 0x21 <= ord(c) <= 0x7E for c in host):
        raise UpstreamSpecError(f"upstream URL {url!r}: the host must be an IP address or an ASCII host name")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise UpstreamSpecError(f"upstream URL {url!r}: no query, fragment or credentials allowed")
    if port == 0:
        raise UpstreamSpecError(f"upstream URL {url!r}: port 0 is not a port to connect to")
    prefix = "/" + parts.path.strip("/")
    if prefix.endswith(_ENDPOINT_PATHS):
        base = url.strip().rstrip("/")
        for endpoint in _ENDPOINT_PATHS:
            if base.endswith(endpoint):
                base = base[: -len(endpoint)]
                break
        raise UpstreamSpecError(
            f"upstream URL {url!r} names an endpoint; give the server's base URL "
            f"(the gateway adds the endpoint): {base}"
        )
    if prefix == "/v1" or prefix.endswith("/v1"):
        prefix = prefix[: -len("/v1")]
    return UpstreamAddress(host=host, port=80 if port is None else port, prefix=prefix.rstrip("/"))


def parse_upstream_spec(spec: str) -> tuple[str, UpstreamAddress]:
    """Parse one ``NAME=URL`` command-line argument: the model's name and its upstream."""
    name, sep, url = spec.partition("=")
    name = name.strip()
    if not sep or not name or not url.strip():
        raise UpstreamSpecError(f"upstream {spec!r}: expected NAME=URL, e.g. qwen=http://127.0.0.1:8080")
    return name, parse_upstream_url(url)


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False
