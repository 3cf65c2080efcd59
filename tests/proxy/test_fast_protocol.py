"""The protocol's side of the relay's fast path, in process, against a fake transport.

As uvicorn tests its own protocols: the gateway's protocol class made by
hand, a transport that keeps what is written, bytes fed to
``data_received``. The app stands in for the gateway: it has ``fast`` (which
takes or declines the request, and may answer through the ``Client`` it is
given) and ``fast_paths``, and records the requests it is run for as an
ASGI app (a task, as any request is).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from proxy.protocol import Client, GatewayProtocol, protocol_class

pytestmark = pytest.mark.anyio

PATH = "/v1/chat/completions"
BODY = b'{"model":"m1","messages":[]}'


def post(body: bytes = BODY, *, path: str = PATH, version: bytes = b"1.1", extra: bytes = b"") -> bytes:
    return (
        b"POST %b HTTP/%b\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%b\r\n%b"
        % (path.encode(), version, len(body), extra, body)
    )


class FakeTransport:
    """What the protocol writes, and whether it closed or paused reading."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False
        self.paused = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.written += data

    def writelines(self, pieces: list[bytes]) -> None:
        self.written += b"".join(pieces)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_write_buffer_size(self) -> int:
        return 0


class App:
    """The gateway's stand-in: ``fast`` takes the request when ``take`` says so."""

    fast_paths = frozenset({PATH})

    def __init__(self, take: bool = True) -> None:
        self.take = take
        self.offered: list[tuple[dict[str, Any], bytes]] = []
        self.clients: list[Client] = []
        # Each request run as an ASGI app: its path and every message its receive gave.
        self.runs: list[tuple[str, list[dict[str, Any]]]] = []

    def fast(self, scope: dict[str, Any], data: bytes, client: Client) -> bool:
        self.offered.append((scope, data))
        if self.take:
            self.clients.append(client)
        return self.take

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        messages = [await receive()]
        while messages[-1].get("more_body"):
            messages.append(await receive())
        self.runs.append((scope["path"], messages))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


def connect(app: App) -> tuple[GatewayProtocol, FakeTransport]:
    config = uvicorn.Config(
        app, lifespan="off", access_log=False, server_header=False, proxy_headers=False, log_level="critical"
    )
    config.load()
    protocol = protocol_class(10.0, 64 * 1024)(config=config, server_state=ServerState(), app_state={})
    transport = FakeTransport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return protocol, transport


def answer(client: Client, body: bytes = b"fast") -> None:
    """What the relay's fast path does once the upstream's answer is whole: one write."""
    writer = client.writer()
    writer.start(200, [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))])
    writer.write(body, False)
    client.ended()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_post_whose_body_came_with_its_head_is_offered_and_answered_without_a_task() -> None:
    app = App()
    protocol, transport = connect(app)
    protocol.data_received(post())
    assert [(scope["path"], data) for scope, data in app.offered] == [(PATH, BODY)]
    assert not protocol.tasks
    answer(app.clients[0])
    await settle()
    assert app.runs == []
    assert transport.written.startswith(b"HTTP/1.1 200 OK\r\n")
    assert transport.written.endswith(b"\r\n\r\nfast")
    assert not transport.closed
    # The connection is kept alive and serves the next request the same way.
    protocol.data_received(post(b'{"model":"m1"}'))
    assert [data for _, data in app.offered] == [BODY, b'{"model":"m1"}']


async def test_a_request_the_fast_path_declines_runs_as_a_task_with_its_whole_body() -> None:
    app = App(take=False)
    protocol, transport = connect(app)
    protocol.data_received(post())
    await settle()
    assert len(app.offered) == 1
    assert app.runs == [(PATH, [{"type": "http.request", "body": BODY, "more_body": False}])]
    assert transport.written.endswith(b"\r\n\r\nok")


async def test_a_body_that_ends_in_a_later_read_is_not_offered() -> None:
    app = App()
    protocol, _ = connect(app)
    request = post()
    protocol.data_received(request[:-5])
    protocol.data_received(request[-5:])
    await settle()
    assert app.offered == []
    assert [b"".join(m["body"] for m in messages) for _, messages in app.runs] == [BODY]


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(post(version=b"1.0"), id="HTTP/1.0"),
        pytest.param(post(extra=b"Expect: 100-continue\r\n"), id="expect-100"),
        pytest.param(post(path="/v1/models"), id="another path"),
        pytest.param(b"GET /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n\r\n", id="GET"),
    ],
)
async def test_other_requests_are_not_offered(request_bytes: bytes) -> None:
    app = App()
    protocol, _ = connect(app)
    protocol.data_received(request_bytes)
    await settle()
    assert app.offered == []
    assert len(app.runs) == 1


async def test_a_pipelined_request_waits_for_the_fast_answer_and_then_runs_as_a_task() -> None:
    app = App()
    protocol, transport = connect(app)
    protocol.data_received(post() + post(b'{"model":"m2"}'))
    await settle()
    assert [data for _, data in app.offered] == [BODY]
    assert app.runs == []
    answer(app.clients[0])
    await settle()
    assert [messages[0]["body"] for _, messages in app.runs] == [b'{"model":"m2"}']
    assert transport.written.count(b"HTTP/1.1 200 OK") == 2
    assert transport.written.index(b"fast") < transport.written.index(b"ok")


async def test_a_hand_over_runs_in_a_task_whose_receive_gives_the_disconnect_not_the_body() -> None:
    app = App()
    protocol, transport = connect(app)
    protocol.data_received(post())
    client = app.clients[0]
    received: list[dict[str, Any]] = []

    async def rest(scope: dict[str, Any], receive: Any, send: Any) -> None:
        received.append(await receive())

    handed: list[bool] = []
    client.lost = lambda: handed.append(True)
    client.run(rest)
    await settle()
    assert received == [] and len(protocol.tasks) == 1  # its receive waits: the body was the fast path's
    protocol.connection_lost(None)
    await settle()
    assert received == [{"type": "http.disconnect"}]
    assert handed == [True]  # the connection's loss is told to the exchange the fast path serves
    assert transport.written == b""


async def test_a_connection_lost_after_the_answer_tells_nobody() -> None:
    app = App()
    protocol, _ = connect(app)
    protocol.data_received(post())
    client = app.clients[0]
    handed: list[bool] = []
    client.lost = lambda: handed.append(True)
    answer(client)
    protocol.connection_lost(None)
    assert handed == []


async def test_an_accepted_request_reads_its_connection_again_and_its_watch_does_after_a_pipelined_head() -> (
    None
):
    """A body over uvicorn's high-water mark, or a pipelined head, pauses reading: the client's
    close would go unseen. Accepted, the request reads again (as the relay's ``receive`` of its
    body would); its ``watch`` does so after a pipelined head (as the relay's watcher would)."""
    app = App()
    protocol, transport = connect(app)
    protocol.data_received(post(b'{"model":"m1","pad":"%b"}' % (b"x" * 70_000)))
    assert len(app.offered) == 1 and not transport.paused
    protocol.data_received(post())
    assert transport.paused  # pipelined behind the first: uvicorn pauses reading
    app.clients[0].watch()
    assert not transport.paused
