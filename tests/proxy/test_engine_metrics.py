"""GET /admin/models/NAME/metrics: each ready replica's engine metrics, scraped through the gateway."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import orjson
import pytest

from engines.spec import Guards
from proxy.app import build_app
from proxy.auth import ApiKeys
from proxy.routing import Replica, Route, RoutingTable, UpstreamAddress
from proxy.startup.settings import Settings

# What llama-server's --metrics serves (tools/server), one replica's worth.
ENGINE_TEXT = b"""\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 12
"""


class _Engine(BaseHTTPRequestHandler):
    """A child's HTTP server: Prometheus text on GET /metrics, 404 elsewhere."""

    def do_GET(self) -> None:
        if self.path == "/metrics":
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(ENGINE_TEXT)))
            self.end_headers()
            self.wfile.write(ENGINE_TEXT)
        else:
            self.send_error(404)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def engine() -> Iterator[UpstreamAddress]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield UpstreamAddress("127.0.0.1", server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class ChildGate:
    """A replica's gate (``routing.ReplicaGate``): whether its child is ready."""

    def __init__(self, ready: bool) -> None:
        self.ready = ready
        self.starts = 1
        self.name = "child-0"

    def exited(self) -> bool:
        return not self.ready


class ModelGate:
    """A model's gate, as much of ``routing.Gate`` as the admin route reads."""

    ready = False
    state = "loading"


def route(replicas: list[tuple[UpstreamAddress, bool]], metrics_path: str = "/metrics") -> Route:
    return Route(
        model="org/m",
        upstream=replicas[0][0],
        guards=Guards(),
        gate=ModelGate(),  # type: ignore[arg-type]
        replicas=tuple(Replica(address, ChildGate(ready)) for address, ready in replicas),
        metrics_path=metrics_path,
    )


async def scrape(
    table: list[Route],
    path: str = "/admin/models/org/m/metrics",
    *,
    keys: tuple[str, ...] = (),
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """GET ``path`` from a gateway over ``table`` (with ``keys`` checked, when given)."""
    app = build_app(RoutingTable(table), Settings(), api_keys=ApiKeys(keys))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        return await client.get(path, headers=headers)


@pytest.mark.anyio
async def test_each_ready_replica_s_metrics_come_labelled_with_the_model_and_replica(
    engine: UpstreamAddress,
) -> None:
    """Two ready replicas and one starting: the ready ones' samples, labelled replica 0 and 2."""
    down = UpstreamAddress("127.0.0.1", 1)
    answer = await scrape([route([(engine, True), (down, False), (engine, True)])])
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    assert answer.text.splitlines() == [
        "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.",
        "# TYPE llamacpp:prompt_tokens_total counter",
        'llamacpp:prompt_tokens_total{model="org/m",replica="0"} 12',
        'llamacpp:prompt_tokens_total{model="org/m",replica="2"} 12',
    ]


@pytest.mark.anyio
async def test_an_unknown_model_is_a_404(engine: UpstreamAddress) -> None:
    answer = await scrape([route([(engine, True)])], "/admin/models/other/metrics")
    assert answer.status_code == 404
    assert orjson.loads(answer.content)["error"]["code"] == "model_not_found"


@pytest.mark.anyio
async def test_an_engine_without_metrics_is_a_404_that_says_so(engine: UpstreamAddress) -> None:
    """A route whose spec names no metrics_path (mlx) answers 404 no_engine_metrics, scraping nothing."""
    answer = await scrape([route([(engine, True)], metrics_path="")])
    assert answer.status_code == 404
    assert orjson.loads(answer.content)["error"]["code"] == "no_engine_metrics"


@pytest.mark.anyio
async def test_no_ready_replica_is_a_503_to_retry(engine: UpstreamAddress) -> None:
    """Every replica starting: 503 model_not_ready with Retry-After, naming the model's state."""
    answer = await scrape([route([(engine, False), (engine, False)])])
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "2"
    error = orjson.loads(answer.content)["error"]
    assert error["code"] == "model_not_ready" and "it is loading" in error["message"]


@pytest.mark.anyio
async def test_a_replica_that_does_not_answer_its_scrape_is_a_502() -> None:
    """The only ready replica refuses the connection: 502 engine_metrics_failed."""
    answer = await scrape([route([(UpstreamAddress("127.0.0.1", 1), True)])])
    assert answer.status_code == 502
    assert orjson.loads(answer.content)["error"]["code"] == "engine_metrics_failed"


@pytest.mark.anyio
async def test_the_scrape_is_behind_the_api_key(engine: UpstreamAddress) -> None:
    """With keys set, no key is a 401 and the model's key gets the metrics."""
    table = [route([(engine, True)])]
    refused = await scrape(table, keys=("sk-1",))
    assert refused.status_code == 401
    assert "llamacpp" not in refused.text
    allowed = await scrape(table, keys=("sk-1",), headers={"authorization": "Bearer sk-1"})
    assert allowed.status_code == 200
    assert 'replica="0"' in allowed.text
