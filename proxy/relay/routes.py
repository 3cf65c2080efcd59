"""The routes as the relay serves them: per model, its replicas' pools, its queue and its metrics.

Built from a ``RoutingTable`` at start and on each reload, never per
request: the hot path does one dict lookup and finds everything it needs.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from typing import Any, Final, NamedTuple

from proxy.admission import Admission
from proxy.affinity import Affinity
from proxy.endpoints import CHAT, ENDPOINTS
from proxy.health import Checked, HealthChecks, PeerHealth, Probe
from proxy.metrics import Metrics, ModelMetrics, ReplicaSample
from proxy.payload import FieldChecks, RequestGuards
from proxy.pool import Pool
from proxy.relay.settings import RelaySettings
from proxy.routing import Gate, ReplicaGate, Route, RoutingTable, UpstreamAddress

# Azure OpenAI's paths (openai.AzureOpenAI writes /deployments/MODEL before the
# endpoint, after its azure_endpoint's /openai or its base_url's /v1).
_DEPLOYMENTS: Final = ("/openai/deployments/", "/v1/deployments/")


def deployment_path(path: str) -> str | None:
    """The relay path an Azure OpenAI deployment path stands for, else None.

    ``/openai/deployments/NAME/chat/completions`` is ``/v1/chat/completions``:
    the body's ``model`` picks the route, as on every path (openai.AzureOpenAI
    writes the same name in both).
    """
    for prefix in _DEPLOYMENTS:
        if path.startswith(prefix):
            _, slash, endpoint = path[len(prefix) :].partition("/")
            relayed = "/v1/" + endpoint
            return relayed if slash and relayed in ENDPOINTS else None
    return None


# Client path → the `route` label of the request metrics.
ROUTE_LABELS: Final[Mapping[str, str]] = {path: endpoint.name for path, endpoint in ENDPOINTS.items()}


def targets_of(upstream: UpstreamAddress, native_apis: Collection[str]) -> dict[str, bytes]:
    """Client path → the request target on ``upstream``: the endpoint's own where the server serves
    it, else chat completions' (the request is translated)."""
    return {
        path: upstream.target(e.target if e.api is None or e.api in native_apis else CHAT.target)
        for path, e in ENDPOINTS.items()
    }


class Peer:
    """One replica of a model as the relay sends to it: its pool, its request targets, its load.

    ``proxy.routing.Replica`` is the replica as configured (an address and a
    gate); a peer is its running side here (nginx's word for it).
    ``health`` is None for a model's only replica: nothing to eject it
    from, and nothing for the request path to do.
    """

    __slots__ = (
        "addr",
        "gate",
        "health",
        "host_header",
        "in_flight",
        "label",
        "moved_away",
        "name",
        "pool",
        "served",
        "starts",
        "targets",
    )

    def __init__(
        self,
        pool: Pool,
        host_header: bytes,
        targets: dict[str, bytes],
        gate: ReplicaGate | None,
        name: str = "",
        health: PeerHealth | None = None,
    ) -> None:
        self.pool = pool
        self.host_header = host_header
        self.targets = targets
        self.gate = gate
        self.name = name
        self.health = health
        self.in_flight = 0
        self.served = 0
        # Requests that could not connect to it and went to another peer.
        self.moved_away = 0
        # Where it is, as nginx's $upstream_addr names a server (host:port): for the access log.
        self.addr = host_header.decode("latin-1")
        # The child's start count when last seen: another start means an empty prompt cache.
        self.starts = 0
        # As the status page names it: its child's name, else its base URL.
        self.label = gate.name if gate is not None else name

    @property
    def available(self) -> bool:
        """Whether the peer may take a request: its child ready, and not ejected."""
        gate, health = self.gate, self.health
        return (gate is None or gate.ready) and (health is None or health.up)


class PeerLoad(NamedTuple):
    """A replica's requests and whether it is in rotation, read for the status page."""

    name: str
    addr: str
    in_flight: int
    up: bool
    reason: str


class ModelLoad(NamedTuple):
    """A model's requests in flight and queued (or waiting for its load), and its replicas'."""

    in_flight: int
    queued: int
    peers: tuple[PeerLoad, ...]


class RouteEntry(NamedTuple):
    """Everything the hot path needs about a model, resolved once."""

    peers: tuple[Peer, ...]
    gate: Gate | None
    guards: RequestGuards
    # The field checks of its guards, built with the entry (not per request).
    fields: FieldChecks
    admission: Admission
    stats: ModelMetrics | None
    # For an alias: the model's own name, put in the body sent upstream.
    rename: str | None
    # Several peers and affinity on: which one has the conversation's prompt cache.
    affinity: Affinity | None = None


def engine_side(route: Route) -> tuple[object, ...]:
    """What a route's entry is built from, but for its aliases and its limit: an entry whose route
    changed only in those is kept (its admission gets the new limit)."""
    return (route.model, route.upstream, route.gate, route.guards, route.replicas)


def least_busy(peers: tuple[Peer, ...], skip: Collection[Peer] = ()) -> Peer | None:
    """The available peer with the fewest requests in flight; ties go to the one that served fewest."""
    best: Peer | None = None
    for peer in peers:
        if not peer.available or peer in skip:
            continue  # out of rotation until it is ready (or answers) again
        if best is None or (peer.in_flight, peer.served) < (best.in_flight, best.served):
            best = peer
    return best


def by_affinity(peers: tuple[Peer, ...], affinity: Affinity, doc: Any) -> Peer | None:
    """The peer whose prompt cache knows most of the conversation, within the slack; else least busy.

    A peer whose child started again since it was last seen has an empty
    cache: it is forgotten first.
    """
    loads: list[int | None] = []
    for index, peer in enumerate(peers):
        gate = peer.gate
        if gate is not None:
            starts = gate.starts
            if starts != peer.starts:
                peer.starts = starts
                affinity.forget(index)
        loads.append(peer.in_flight if peer.available else None)
    chosen = affinity.choose(doc, loads)
    return None if chosen is None else peers[chosen]


class Routes:
    """Route entries by model name (and alias), and one connection pool per upstream address."""

    def __init__(self, settings: RelaySettings, metrics: Metrics | None) -> None:
        self._settings = settings
        self.checks = HealthChecks(settings.health_interval_s)
        self._metrics = metrics
        self.pools: dict[UpstreamAddress, Pool] = {}
        self.table = RoutingTable(())
        self._built: dict[Route, RouteEntry] = {}
        self.by_name: dict[str, RouteEntry] = {}

    def update(self, table: RoutingTable) -> dict[str, RouteEntry]:
        """Serve ``table`` from now on; return the new entries by name.

        A route that is unchanged, or changed only in its aliases or its
        limit, keeps its entry: its admission queue, its requests in flight,
        its counters and its pooled connections carry on (a new limit applies
        to the same admission).
        Requests already past the lookup finish on the entry they found.
        """
        built: dict[Route, RouteEntry] = {}
        by_name: dict[str, RouteEntry] = {}
        # A route whose engine side is the same (its aliases or limit changed) keeps its entry too.
        running = {engine_side(r): e for r, e in self._built.items()}
        for route in table:
            entry = self._built.get(route)
            if entry is None:
                entry = running.get(engine_side(route))
                if entry is not None:
                    # The same slots and queue, under the new limit: nothing in flight or
                    # queued is forgotten or overtaken.
                    entry.admission.set_limit(route.max_in_flight)
                else:
                    entry = self._entry(route)
            built[route] = entry
            by_name[route.model] = entry
            for alias in route.aliases:
                by_name[alias] = entry._replace(rename=route.model)
        wanted = set(table.upstreams())
        for address in list(self.pools):
            if address not in wanted:
                # Requests still on it finish; their connections are closed on release.
                self.pools.pop(address).close()
        self.table, self._built, self.by_name = table, built, by_name
        # Keyed by the entry's peers: a reload that rebuilds a model's route checks its new peers,
        # one that keeps them keeps their checks.
        self.checks.watch(
            (
                e.peers,
                tuple(
                    Checked(r.upstream, p.health, r.gate)
                    for r, p in zip(route.all_replicas, e.peers, strict=True)
                    if p.health is not None
                ),
            )
            for route, e in built.items()
            if len(e.peers) > 1
        )
        return by_name

    def _entry(self, route: Route) -> RouteEntry:
        peers: list[Peer] = []
        replicas = route.all_replicas
        several = len(replicas) > 1
        slack = self._settings.affinity_slack
        affinity = Affinity(len(replicas), slack) if several and slack is not None else None
        checked = bool(self._settings.health_interval_s)
        for index, replica in enumerate(replicas):
            pool = self.pools.get(replica.upstream)
            if pool is None:
                pool = self.pools[replica.upstream] = Pool(
                    replica.upstream, connect_timeout_s=self._settings.connect_timeout_s
                )
            targets = targets_of(replica.upstream, route.guards.native_apis)
            name = replica.upstream.base_url
            health = None
            if several:
                forget = functools.partial(affinity.forget, index) if affinity is not None else None
                # An engine child is watched by its manager, not by the active checks
                # (proxy/health.py): ejected, it comes back by time or by a new start.
                active = checked and replica.gate is None
                probe = Probe(
                    replica.upstream,
                    route.model,
                    self._settings.first_byte_timeout_s,
                    self._settings.connect_timeout_s,
                )
                health = PeerHealth(f"{route.model} {name}", active=active, on_eject=forget, probe=probe)
            peers.append(Peer(pool, replica.upstream.host_header, targets, replica.gate, name, health))
        return RouteEntry(
            tuple(peers),
            route.gate,
            route.guards,
            FieldChecks(route.guards),
            Admission(
                route.max_in_flight,
                max_queued=self._settings.max_queued,
                queue_timeout_s=self._settings.queue_timeout_s,
            ),
            self._metrics.for_model(route.model) if self._metrics is not None else None,
            None,
            affinity,
        )

    def replica_sample(self) -> list[ReplicaSample]:
        """Each replica of a model with several, read at scrape time."""
        rows = []
        for route, entry in self._built.items():
            if len(entry.peers) < 2:
                continue
            affinity = entry.affinity
            for index, peer in enumerate(entry.peers):
                hits = misses = spills = 0
                if affinity is not None:
                    hits, misses, spills = (
                        affinity.hits[index],
                        affinity.misses[index],
                        affinity.spills[index],
                    )
                ejections = peer.health.ejections if peer.health is not None else 0
                rows.append(
                    ReplicaSample(
                        route.model,
                        peer.name,
                        peer.in_flight,
                        hits,
                        misses,
                        spills,
                        ejections,
                        peer.moved_away,
                    )
                )
        return rows

    def load(self) -> dict[str, ModelLoad]:
        """Each model's requests in flight and queued, and its replicas' (for the status page)."""
        return {
            route.model: ModelLoad(
                entry.admission.in_flight,
                entry.admission.queued + entry.admission.loading,
                tuple(
                    PeerLoad(
                        peer.name,
                        peer.addr,
                        peer.in_flight,
                        peer.health is None or peer.health.up,
                        peer.health.reason if peer.health is not None else "",
                    )
                    for peer in entry.peers
                ),
            )
            for route, entry in self._built.items()
        }

    def admission_sample(self) -> list[tuple[str, int, int]]:
        """(model, in flight, queued or waiting for its load), read at scrape time."""
        return [
            (r.model, e.admission.in_flight, e.admission.queued + e.admission.loading)
            for r, e in self._built.items()
        ]
