"""The ASGI application: the relay for the API paths, Starlette for the rest.

The relay paths are picked with one dict lookup before Starlette's router,
middleware and exception handling see the request: those cost more per
request than the whole relay is allowed to add. Everything else (models,
probes, unknown paths) goes through Starlette.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from time import perf_counter

import httpx
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy import __version__, ui
from proxy.accesslog import AccessLog
from proxy.asgi import Message, Receive, Scope, Send, send_error
from proxy.auth import PUBLIC_PATHS, ApiKeys
from proxy.browser import AllowedHosts, BrowserChecks
from proxy.cors import Cors
from proxy.endpoints import envelope_of
from proxy.entry import FastEntry, GatewayState
from proxy.errors import HTTPError, echo, error_body
from proxy.exposition import merge_expositions
from proxy.health import DEFAULT_INTERVAL_S
from proxy.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from proxy.metrics import Metrics
from proxy.readiness import NOT_CHECKED, Readiness
from proxy.relay import (
    ENDPOINTS,
    ModelLoad,
    Relay,
    RelaySettings,
    RequestIds,
    deployment_path,
    server_timing,
)
from proxy.routing import Route as RouteConfig
from proxy.routing import RoutingTable
from proxy.status import ModelView, Status


class Gateway:
    """Top-level ASGI app: a choice of which app serves the request."""

    def __init__(
        self,
        relay: Relay,
        admin: Starlette,
        keys: ApiKeys | None = None,
        state: GatewayState | None = None,
        cors: Cors | None = None,
        hosts: AllowedHosts | None = None,
        status: Status | None = None,
    ) -> None:
        self.relay = relay
        self.admin = admin
        self.status = status or Status()
        self.keys = keys or ApiKeys(())
        self.state = state or GatewayState()
        self.cors = cors or Cors(())
        self.browser = BrowserChecks(hosts or AllowedHosts(()), self.cors)
        # Asked once: each is a Python __bool__ the request would otherwise call.
        self._with_keys = bool(self.keys)
        self._with_cors = bool(self.cors)
        # What the protocol offers a request before any task: compiled, the checks ``__call__``
        # makes of a head, then the relay's fast path (``proxy/entry.py``).
        entry = FastEntry(relay, self.state, self.browser, self.keys, self._with_cors)
        self.fast = entry.fast
        self.fast_after_head = entry.fast_after_head
        self.serves_head = entry.serves_head
        # The paths whose POSTs the protocol offers to ``fast`` before any task (the OpenAI
        # endpoints; another API's requests may need translating).
        self.fast_paths = frozenset(path for path, endpoint in ENDPOINTS.items() if endpoint.api is None)
        # Charged by the protocol for the bytes of a body it holds while the rest comes.
        self.body_budget = relay.body_budget
        # How long the protocol lets a client take none of the bytes left for it between requests.
        self.send_stall_s = relay.send_stall_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            # Before anything else, the probes and the preflights included: DNS rebinding, foreign origins.
            refusal = self.browser.refusal(scope)
            if refusal is not None:
                await self._refuse(scope, send, refusal)
                return
            if self._with_cors:
                origin = self.cors.origin_of(scope)
                if self.cors.is_preflight(scope):
                    await self._preflight(scope, send, origin)
                    return
                send = self.cors.marking(send, origin)
        await self._dispatch(scope, receive, send)

    async def _refuse(self, scope: Scope, send: Send, refusal: HTTPError) -> None:
        started = perf_counter()
        headers = [
            # The answer depends on the Origin: no cache may give it to another.
            (b"vary", b"Origin"),
            (b"x-request-id", self.relay.request_id_of(scope)),
            server_timing(started),
        ]
        await send_error(send, envelope_of(scope["path"]), refusal, headers)

    async def _preflight(self, scope: Scope, send: Send, origin: bytes | None) -> None:
        if origin is None:
            refusal = HTTPError(
                403, "this origin is not allowed (see --cors-origin)", code="origin_not_allowed"
            )
            await send_error(send, envelope_of(scope["path"]), refusal, [])
            return
        await send(
            {
                "type": "http.response.start",
                "status": 204,
                "headers": self.cors.preflight_headers(scope, origin),
            }
        )
        await send({"type": "http.response.body", "body": b""})

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.admin(scope, receive, send)
        elif self._with_keys and scope["path"] not in PUBLIC_PATHS and not self.keys.allows(scope):
            await self._unauthorized(scope, send)
        elif scope["path"] in ENDPOINTS or _deployment(scope):
            state = self.state
            if state.draining:
                await self._draining(scope, send)
                return
            state.in_flight += 1
            try:
                await self.relay(scope, receive, send)
            finally:
                state.leave()
        elif scope["path"].startswith("/v1/v1/"):
            await self._doubled_v1(scope, send)
        else:
            await self.admin(scope, receive, _stamped(scope, send, self.relay.request_id_of))

    async def _doubled_v1(self, scope: Scope, send: Send) -> None:
        """A base URL given with /v1 to a client that adds /v1 itself (Claude Code): say so."""
        path = scope["path"]
        refusal = HTTPError(
            404,
            f"Invalid URL ({echo(scope['method'])} {echo(path)}): the client's base URL ends in /v1 and "
            "the client adds /v1 itself; give it the gateway's address without /v1 (Claude Code: "
            "ANTHROPIC_BASE_URL=http://HOST:PORT; OpenAI clients: base_url=http://HOST:PORT/v1)",
            code="unknown_url",
        )
        headers = [(b"x-request-id", self.relay.request_id_of(scope)), server_timing(perf_counter())]
        await send_error(send, envelope_of(path[3:]), refusal, headers)

    async def _draining(self, scope: Scope, send: Send) -> None:
        started = perf_counter()
        refusal = HTTPError(503, "the gateway is shutting down; retry on another instance", code="draining")
        headers = [
            (b"connection", b"close"),
            (b"retry-after", b"1"),
            (b"x-request-id", self.relay.request_id_of(scope)),
            server_timing(started),
        ]
        await send_error(send, envelope_of(scope["path"]), refusal, headers)

    async def _unauthorized(self, scope: Scope, send: Send) -> None:
        started = perf_counter()
        refusal = HTTPError(
            401,
            "Incorrect or missing API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`",
            code="invalid_api_key",
        )
        headers = [
            (b"www-authenticate", b"Bearer"),
            (b"x-request-id", self.relay.request_id_of(scope)),
            server_timing(started),
        ]
        await send_error(send, envelope_of(scope["path"]), refusal, headers)


def _deployment(scope: Scope) -> bool:
    """Whether the path is an Azure OpenAI deployment's; if so, the relay's path is put in its place."""
    path = deployment_path(scope["path"])
    if path is None:
        return False
    scope["path"] = path
    return True


def _stamped(scope: Scope, send: Send, request_id_of: RequestIds) -> Send:
    """Wrap ``send`` so that the response carries x-request-id and Server-Timing, as relayed ones do."""
    started = perf_counter()
    request_id = request_id_of(scope)

    async def stamped_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [
                *message.get("headers", ()),
                (b"x-request-id", request_id),
                server_timing(started),
            ]
        await send(message)

    return stamped_send


def build_app(
    table: RoutingTable,
    settings: RelaySettings,
    *,
    on_startup: Callable[[], Awaitable[None]] | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    api_keys: ApiKeys | None = None,
    metrics: Metrics | None = None,
    access_log: AccessLog | None = None,
    cors: Cors | None = None,
    hosts: AllowedHosts | None = None,
    status: Status | None = None,
    engine_view: EngineView | None = None,
) -> Gateway:
    """Build the gateway for a routing table and the relay's settings, resolved before.

    ``settings`` is the gateway's own ``Settings`` (the composition root's,
    with every default): the relay reads it as it is. ``on_startup`` and
    ``on_shutdown`` run in the server's event loop (the engine manager's
    start and stop). ``status`` is where the gateway's state is read
    (made here if not given); ``engine_view`` adds an engine model's
    engine, children and lifetime to its view (the composition root's).
    """
    state = GatewayState()
    status = status if status is not None else Status(metrics)
    relay = Relay(table, settings, metrics, access_log, arrived=status.activity.append)
    status.bind(lambda: model_views(relay.table, relay.load(), engine_view))
    # The static upstreams' readiness, checked at most as often as a replica set's servers are.
    readiness = Readiness(lambda: relay.table, settings.health_interval_s or DEFAULT_INTERVAL_S)
    routes = _AdminRoutes(relay, state, cors, metrics, readiness, status)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if on_startup is not None:
            await on_startup()
        relay.checks.start()
        status.start()
        try:
            yield
        finally:
            try:
                await status.close()
                await readiness.stop()
                await relay.checks.stop()
                if on_shutdown is not None:
                    await on_shutdown()
            finally:
                for pool in relay.pools.values():
                    pool.close()

    admin = Starlette(
        routes=routes.table(),
        exception_handlers={HTTPException: _http_exception, Exception: _unexpected},
        lifespan=lifespan,
    )
    return Gateway(relay, admin, api_keys, state, cors, hosts, status)


# Adds an engine model's engine, children and lifetime to its view (the composition root's).
EngineView = Callable[[RouteConfig, ModelView], None]


def model_views(
    table: RoutingTable, load: Mapping[str, ModelLoad], engine_view: EngineView | None
) -> list[ModelView]:
    """Each model as the gateway shows it (README, "Status page"): from the routing table and the
    relay's counts; an engine model's engine part from ``engine_view``."""
    views = []
    for route in table:
        counts = load.get(route.model)
        peers = counts.peers if counts is not None else ()
        view: ModelView = {
            "id": route.model,
            "kind": "engine" if route.gate is not None else "upstream",
            # Static upstreams are always there as far as the gateway knows.
            "state": route.gate.state if route.gate is not None else "loaded",
            "reason": None,
            "engine": None,
            "variant": None,
            "aliases": list(route.aliases),
            "in_flight": counts.in_flight if counts is not None else 0,
            "queued": counts.queued if counts is not None else 0,
            "max_in_flight": route.max_in_flight,
            "ttl_s": 0,
            "idle_s": None,
            "always_loaded": False,
            "replicas": [
                {
                    "name": peer.name,
                    "state": "in rotation" if peer.up else "out of rotation",
                    "healthy": peer.up,
                    "pid": None,
                    "address": peer.addr,
                    "restarts": 0,
                    "starts": 0,
                    "in_flight": peer.in_flight,
                    "last_error": peer.reason or None,
                    "log": None,
                }
                for peer in peers
            ],
        }
        if route.gate is not None and engine_view is not None:
            engine_view(route, view)
        views.append(view)
    return views


# How long an engine's metrics scrape may take, through the gateway.
_SCRAPE_TIMEOUT_S = 5.0


class _AdminRoutes:
    """What the gateway answers itself: the model list, load and unload, the probes, metrics, version."""

    def __init__(
        self,
        relay: Relay,
        state: GatewayState,
        cors: Cors | None,
        metrics: Metrics | None,
        readiness: Readiness,
        status: Status,
    ) -> None:
        self.relay = relay
        self.status = status
        self.readiness = readiness
        self.state = state
        self.cors = cors
        self.metrics = metrics
        self.created = int(time.time())

    def table(self) -> list[Route]:
        return [
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
            Route("/models/{model:path}", self.get_model, methods=["GET"]),
            Route("/admin/models/{model:path}/load", self.load_model, methods=["POST"]),
            Route("/admin/models/{model:path}/unload", self.unload_model, methods=["POST"]),
            Route("/admin/models/{model:path}/metrics", self.engine_metrics, methods=["GET"]),
            Route("/admin/requests/{request_id:path}/cancel", self.cancel_request, methods=["POST"]),
            # The status page and its stream (proxy.status, proxy/ui).
            Route("/events", _Asgi(self.status.stream), methods=["GET"]),
            Route("/ui", self.page, methods=["GET"]),
            Route("/ui/", self.page, methods=["GET"]),
            Route("/ui/{name}", self.page_file, methods=["GET"]),
            Route("/livez", self.livez, methods=["GET"]),
            # What mlx_lm.server, vLLM and llama.cpp's server answer; benchmark tools
            # (guidellm) probe it first and give up on a 404.
            Route("/health", self.livez, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            # A plain route: Mount("/metrics", app) answers 307 and Prometheus scrapes nothing.
            *([Route("/metrics", self.metrics_route, methods=["GET"])] if self.metrics is not None else []),
            Route("/version", lambda r: _json(200, orjson.dumps({"version": __version__})), methods=["GET"]),
            # Claude Code's first request (HEAD /): whether the server is there at all.
            Route("/", self.root, methods=["GET", "HEAD"]),
        ]

    def describe(self, route: RouteConfig, view: ModelView | None = None) -> dict[str, object]:
        if view is None:
            view = self.status.model(route.model)
        return {
            "id": route.model,
            "object": "model",
            "created": self.created,
            "owned_by": "blazar-proxy",
            # The status page's state (proxy.status): static upstreams are always there as far
            # as the gateway knows.
            "state": view["state"] if view is not None else "loaded",
            **({"aliases": list(route.aliases)} if route.aliases else {}),
        }

    async def list_models(self, request: Request) -> Response:
        views = {view["id"]: view for view in self.status.models()}
        models = [self.describe(r, views.get(r.model)) for r in self.relay.table]
        return _json(200, orjson.dumps({"object": "list", "data": models}))

    def route_of(self, request: Request) -> RouteConfig | Response:
        name = request.path_params["model"]
        route = self.relay.table.get(name)
        if route is None:
            return _json(
                404,
                error_body(
                    404,
                    f"The model `{echo(name)}` does not exist or is not served here",
                    param="model",
                    code="model_not_found",
                ),
            )
        return route

    async def get_model(self, request: Request) -> Response:
        route = self.route_of(request)
        if isinstance(route, Response):
            return route
        return _json(200, orjson.dumps(self.describe(route)))

    def engine_route(self, request: Request, verb: str) -> RouteConfig | Response:
        # A web page's POST got here only from an origin CORS allows or the gateway's own page
        # (proxy.browser refused every other before any route).
        route = self.route_of(request)
        if isinstance(route, Response) or route.gate is not None:
            return route
        message = f"model `{route.model}` is a static upstream: the gateway has no engine to {verb} for it"
        return _json(409, error_body(409, message, param="model", code="not_an_engine_model"))

    async def load_model(self, request: Request) -> Response:
        route = self.engine_route(request, "load")
        if isinstance(route, Response):
            return route
        assert route.gate is not None
        problem = await route.gate.load()
        if problem is not None:
            return _json(
                503, error_body(503, problem, code="model_load_failed"), headers={"retry-after": "2"}
            )
        return _json(200, orjson.dumps(self.describe(route)))

    async def unload_model(self, request: Request) -> Response:
        route = self.engine_route(request, "unload")
        if isinstance(route, Response):
            return route
        assert route.gate is not None
        problem = await route.gate.unload()
        if problem is not None:
            return _json(409, error_body(409, problem, param="model", code="model_busy"))
        return _json(200, orjson.dumps(self.describe(route)))

    async def engine_metrics(self, request: Request) -> Response:
        """The model's engine metrics, scraped now from each ready replica, labelled model and replica."""
        route = self.route_of(request)
        if isinstance(route, Response):
            return route
        if not route.metrics_path:
            message = f"model `{route.model}`'s engine exports no metrics"
            return _json(404, error_body(404, message, param="model", code="no_engine_metrics"))
        ready = [
            (index, replica)
            for index, replica in enumerate(route.all_replicas)
            if replica.gate is not None and replica.gate.ready
        ]
        if not ready:
            state = route.gate.state if route.gate is not None else "unknown"
            message = f"model `{route.model}` has no ready engine child to scrape (it is {state})"
            return _json(503, error_body(503, message, code="model_not_ready"), headers={"retry-after": "2"})
        async with httpx.AsyncClient(timeout=_SCRAPE_TIMEOUT_S) as client:
            answers = await asyncio.gather(
                *(
                    client.get(f"http://{r.upstream.host}:{r.upstream.port}{route.metrics_path}")
                    for _, r in ready
                ),
                return_exceptions=True,
            )
        texts = []
        for (index, _), answer in zip(ready, answers, strict=True):
            if isinstance(answer, httpx.Response) and answer.status_code == 200:
                texts.append(({"model": route.model, "replica": str(index)}, answer.text))
        if not texts:
            message = f"model `{route.model}`'s engine did not answer its metrics scrape"
            return _json(502, error_body(502, message, code="engine_metrics_failed"))
        return Response(merge_expositions(texts), media_type=METRICS_CONTENT_TYPE)

    async def cancel_request(self, request: Request) -> Response:
        """End a request under way: its engine stops, its client gets an error (``request_cancelled``)."""
        request_id = request.path_params["request_id"]
        status, reason = self.status.cancel(request_id)
        if status != 200:
            code = "request_not_found" if status == 404 else "request_not_cancellable"
            return _json(status, error_body(status, reason, code=code))
        return _json(200, orjson.dumps({"id": request_id, "cancelled": True}))

    async def page(self, request: Request) -> Response:
        return ui.response("index.html")

    async def page_file(self, request: Request) -> Response:
        return ui.response(request.path_params["name"])

    async def metrics_route(self, request: Request) -> Response:
        assert self.metrics is not None
        return Response(await self.metrics.render_off_loop(), media_type=METRICS_CONTENT_TYPE)

    async def root(self, request: Request) -> Response:
        # Public (no key needed, as the probes): it says nothing but that the gateway is here.
        return _json(200, b'{"status":"ok"}')

    async def livez(self, request: Request) -> Response:
        return _json(200, b'{"status":"ok"}')

    async def readyz(self, request: Request) -> Response:
        if self.state.draining:
            return _json(503, b'{"status":"draining","reason":"the gateway is shutting down"}')
        return await _readiness(self.relay.table, self.readiness)


async def _readiness(table: RoutingTable, readiness: Readiness) -> Response:
    """200 when at least one model can be served now.

    An engine model counts when a child of it is ready, or when it is
    unloaded (its first request starts it); a static upstream when it
    accepted a TCP connection at its last check (``proxy.readiness``: at
    most one round of checks per interval, however many calls come).
    """
    reachable = await readiness.problems()
    models: dict[str, str] = {}
    reasons: set[str] = set()
    for route in table:
        if route.gate is not None:
            state = "ready" if route.gate.ready else route.gate.state
            models[route.model] = state
            if state == "loading":
                reasons.add(f"{route.model}: engine child is not ready")
        else:
            # A replica set is ready while one of its servers is.
            problems = [reachable.get(b.upstream, NOT_CHECKED) for b in route.all_replicas]
            ready = None in problems
            models[route.model] = "ready" if ready else "unreachable"
            if not ready:
                reasons.update(p for p in problems if p)
    if not models:
        return _json(503, orjson.dumps({"status": "unavailable", "reason": "no models are configured"}))
    if "ready" not in models.values() and "unloaded" not in models.values():
        return _json(
            503,
            orjson.dumps(
                {
                    "status": "unavailable",
                    "reason": "no model can be served now: " + "; ".join(sorted(reasons)),
                    "models": models,
                }
            ),
            headers={"retry-after": "2"},
        )
    return _json(200, orjson.dumps({"status": "ready", "models": models}))


class _Asgi:
    """An ASGI callable as Starlette's ``Route`` takes one as an app (a bound method would be
    taken for a request-response endpoint)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def _json(status: int, body: bytes, headers: Mapping[str, str] | None = None) -> Response:
    return Response(body, status_code=status, media_type="application/json", headers=headers)


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Invalid URL ({echo(request.method)} {echo(request.url.path)})"
        return _json(404, error_body(404, message, code="unknown_url"))
    if exc.status_code == 405:
        message = f"method {echo(request.method)} is not allowed on {echo(request.url.path)}"
        return _json(405, error_body(405, message, code="method_not_allowed"), headers=exc.headers)
    return _json(exc.status_code, error_body(exc.status_code, str(exc.detail)), headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> Response:
    # Starlette re-raises after this for the server's log; the client still
    # gets the OpenAI envelope rather than a bare text 500.
    return _json(500, error_body(500, "internal gateway error; see the gateway's log", code="internal_error"))
