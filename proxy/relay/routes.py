"""The routes as the relay serves them: per model, its replicas' pools, its queue and its metrics.

Built from a ``RoutingTable`` at start and on each reload, never per
request: the hot path does one dict lookup and finds everything it needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from proxy.admission import Admission
from proxy.metrics import Metrics, ModelMetrics
from proxy.payload import RequestGuards
from proxy.relay.settings import RelaySettings
from proxy.routing import Gate, ReplicaGate, Route, RoutingTable, UpstreamAddress
from proxy.upstream import Pool

# Client path → the endpoint below the upstream's /v1. Paths without /v1 are
# served too: clients often get the base URL wrong.
ENDPOINTS: Mapping[str, bytes] = {
    "/v1/chat/completions": b"/chat/completions",
    "/chat/completions": b"/chat/completions",
    "/v1/completions": b"/completions",
    "/completions": b"/completions",
    "/v1/embeddings": b"/embeddings",
    "/embeddings": b"/embeddings",
}

# Client path → the `route` label of the request metrics.
ROUTE_LABELS: Mapping[str, str] = {
    path: endpoint.decode().lstrip("/") for path, endpoint in ENDPOINTS.items()
}


class Peer:
    """One replica of a model as the relay sends to it: its pool, its request targets, its load.

    ``proxy.routing.Replica`` is the replica as configured (an address and a
    gate); a peer is its running side here (nginx's word for it).
    """

    __slots__ = ("gate", "host_header", "in_flight", "pool", "served", "targets")

    def __init__(
        self, pool: Pool, host_header: bytes, targets: dict[str, bytes], gate: ReplicaGate | None
    ) -> None:
        self.pool = pool
        self.host_header = host_header
        self.targets = targets
        self.gate = gate
        self.in_flight = 0
        self.served = 0


class RouteEntry(NamedTuple):
    """Everything the hot path needs about a model, resolved once."""

    peers: tuple[Peer, ...]
    gate: Gate | None
    guards: RequestGuards
    admission: Admission
    stats: ModelMetrics | None
    # For an alias: the model's own name, put in the body sent upstream.
    rename: str | None


def least_busy(peers: tuple[Peer, ...]) -> Peer | None:
    """The ready peer with the fewest requests in flight; ties go to the one that served fewest."""
    best: Peer | None = None
    for peer in peers:
        if peer.gate is not None and not peer.gate.ready:
            continue  # out of rotation until it is ready again
        if best is None or (peer.in_flight, peer.served) < (best.in_flight, best.served):
            best = peer
    return best


class Routes:
    """Route entries by model name (and alias), and one connection pool per upstream address."""

    def __init__(self, settings: RelaySettings, metrics: Metrics | None, connect_timeout_s: float) -> None:
        self._settings = settings
        self._metrics = metrics
        self._connect_timeout_s = connect_timeout_s
        self.pools: dict[UpstreamAddress, Pool] = {}
        self.table = RoutingTable(())
        self._built: dict[Route, RouteEntry] = {}
        self.by_name: dict[str, RouteEntry] = {}

    def update(self, table: RoutingTable) -> dict[str, RouteEntry]:
        """Serve ``table`` from now on; return the new entries by name.

        A route that is unchanged keeps its entry: its admission queue, its
        requests in flight and its pooled connections carry on untouched.
        Requests already past the lookup finish on the entry they found.
        """
        built: dict[Route, RouteEntry] = {}
        by_name: dict[str, RouteEntry] = {}
        for route in table:
            entry = self._built.get(route) or self._entry(route)
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
        return by_name

    def _entry(self, route: Route) -> RouteEntry:
        peers = []
        for replica in route.all_replicas:
            pool = self.pools.get(replica.upstream)
            if pool is None:
                pool = self.pools[replica.upstream] = Pool(
                    replica.upstream, connect_timeout_s=self._connect_timeout_s
                )
            targets = {path: replica.upstream.target(endpoint) for path, endpoint in ENDPOINTS.items()}
            peers.append(Peer(pool, replica.upstream.host_header, targets, replica.gate))
        return RouteEntry(
            tuple(peers),
            route.gate,
            route.guards,
            Admission(
                route.max_in_flight,
                max_queued=self._settings.max_queued,
                queue_timeout_s=self._settings.queue_timeout_s,
            ),
            self._metrics.for_model(route.model) if self._metrics is not None else None,
            None,
        )

    def admission_sample(self) -> list[tuple[str, int, int]]:
        """(model, in flight, queued or waiting for its load), read at scrape time."""
        return [
            (r.model, e.admission.in_flight, e.admission.queued + e.admission.loading)
            for r, e in self._built.items()
        ]
