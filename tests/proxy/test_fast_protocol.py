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
import gc
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import uvicorn
import uvloop
from uvicorn.server import ServerState

from proxy.lean import server_protocol
from proxy.protocol import MAX_PIPELINED, Client, GatewayProtocol, _BoundedFlow, protocol_class
from proxy.relay.request import BodyBudget
from tests.helpers import wait_until_async

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
        self.aborted = False
        # What the client has not taken yet (``get_write_buffer_size``).
        self.buffered = 0

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.written += data

    def writelines(self, pieces: list[bytes]) -> None:
        self.written += b"".join(pieces)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_write_buffer_size(self) -> int:
        return self.buffered


class App:
    """The gateway's stand-in: ``fast`` takes the request when ``take`` says so."""

    fast_paths = frozenset({PATH})
    send_stall_s = 0.0

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


async def test_pipelined_requests_are_read_no_further_than_the_bound_whatever_asks_to_read_on() -> None:
    """A client that writes requests faster than they are answered: past ``MAX_PIPELINED`` queued,
    reading stays paused, even where uvicorn would read on (a response's end, an app's receive,
    the relay's watch), and goes on once the queue is under the bound."""
    app = App()
    protocol, transport = connect(app)
    protocol.data_received(post() + b"".join(post(b'{"n":%d}' % n) for n in range(MAX_PIPELINED)))
    assert len(protocol.pipeline) == MAX_PIPELINED and transport.paused
    protocol.flow.resume_reading()  # what a watch or a receive does
    assert transport.paused
    answer(app.clients[0])  # the response's end starts the first queued one
    assert len(protocol.pipeline) == MAX_PIPELINED - 1 and not transport.paused
    for _ in range(MAX_PIPELINED + 1):
        await settle()
    assert len(app.runs) == MAX_PIPELINED and transport.written.count(b"HTTP/1.1 200 OK") == MAX_PIPELINED + 1


async def test_a_request_is_not_begun_while_the_client_takes_no_answers() -> None:
    """Its buffer over the high-water mark, the client's next request waits, unread behind it,
    until it takes bytes again: neither the fast path nor a task answers into that buffer."""
    app = App()
    protocol, transport = connect(app)
    protocol.data_received(post())
    answer(app.clients[0])
    protocol.pause_writing()
    protocol.data_received(post(b'{"model":"m2"}'))
    protocol.data_received(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
    await settle()
    assert len(app.offered) == 1 and app.runs == [] and transport.paused
    assert transport.written.count(b"HTTP/1.1 200 OK") == 1
    protocol.resume_writing()
    await settle()
    await settle()
    assert [path for path, _ in app.runs] == [PATH, "/v1/models"]
    assert transport.written.count(b"HTTP/1.1 200 OK") == 3


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


# The lean protocol (``proxy/lean.py``): the connection while its requests are the fast path's, and
# the full protocol above for the rest of its life, fed the request's bytes from its first.


class SwitchingTransport(FakeTransport):
    """A transport whose protocol may be replaced (``set_protocol``), as the lean protocol does."""

    def __init__(self) -> None:
        super().__init__()
        self.protocol: Any = None

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol

    def feed(self, data: bytes) -> None:
        self.protocol.data_received(data)


def connect_lean(
    app: App,
    *,
    header_timeout_s: float = 10.0,
    max_header_bytes: int = 64 * 1024,
    body_timeout_s: float = 60.0,
    keep_alive_s: float = 5,
) -> tuple[ServerState, SwitchingTransport]:
    config = uvicorn.Config(
        app,
        lifespan="off",
        access_log=False,
        server_header=False,
        proxy_headers=False,
        log_level="critical",
        timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]
    )
    config.load()
    state = ServerState()
    protocol = server_protocol(header_timeout_s, max_header_bytes, body_timeout_s)(
        config=config, server_state=state, app_state={}
    )
    transport = SwitchingTransport()
    transport.protocol = protocol
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return state, transport


async def test_lean_a_post_whose_body_came_with_its_head_is_answered_without_the_full_protocol() -> None:
    app = App()
    state, transport = connect_lean(app)
    lean = transport.protocol
    transport.feed(post())
    scope, data = app.offered[0]
    assert (scope["method"], scope["path"], scope["http_version"], data) == ("POST", PATH, "1.1", BODY)
    assert dict(scope["headers"])[b"host"] == b"gw" and scope["client"] == ("127.0.0.1", 50000)
    answer(app.clients[0])
    await settle()
    assert transport.protocol is lean and not state.tasks and app.runs == []
    assert transport.written.startswith(b"HTTP/1.1 200 OK\r\n")
    assert transport.written.endswith(b"\r\ncontent-length: 4\r\n\r\nfast")
    assert not transport.closed and state.total_requests == 1
    # Kept alive: the next request the same way.
    transport.feed(post(b'{"model":"m1"}'))
    answer(app.clients[1])
    assert [data for _, data in app.offered] == [BODY, b'{"model":"m1"}']
    await settle()
    assert transport.written.count(b"HTTP/1.1 200 OK") == 2 and transport.protocol is lean


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(post(version=b"1.0"), id="HTTP/1.0"),
        pytest.param(post(extra=b"Expect: 100-continue\r\n"), id="expect-100"),
        pytest.param(post(path="/v1/models"), id="another path"),
        pytest.param(post(path=PATH + "?a=1"), id="a query"),
        pytest.param(post(extra=b"Host: other\r\n"), id="two Host fields"),
        pytest.param(b"GET /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n\r\n", id="GET"),
        pytest.param(
            b"POST %b HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n"
            % (PATH.encode(), len(BODY), BODY),
            id="chunked",
        ),
    ],
)
async def test_lean_other_requests_go_to_the_full_protocol_whole(request_bytes: bytes) -> None:
    app = App()
    _, transport = connect_lean(app)
    transport.feed(request_bytes)
    await settle()
    assert isinstance(transport.protocol, GatewayProtocol)
    assert app.offered == []
    assert len(app.runs) == 1 or transport.written.startswith(b"HTTP/1.1 400 ")


async def test_lean_a_declined_request_runs_as_a_task_with_its_whole_body_offered_once() -> None:
    app = App(take=False)
    _, transport = connect_lean(app)
    transport.feed(post())
    await settle()
    assert len(app.offered) == 1  # not offered again by the full protocol
    assert app.runs == [(PATH, [{"type": "http.request", "body": BODY, "more_body": False}])]
    assert transport.written.endswith(b"\r\n\r\nok")
    # The connection stays with the full protocol, which offers what comes next.
    transport.feed(post())
    assert len(app.offered) == 2


async def test_lean_a_head_cut_across_reads_is_served_whole_by_the_full_protocol() -> None:
    app = App(take=False)
    _, transport = connect_lean(app)
    request = post()
    transport.feed(request[:10])
    assert isinstance(transport.protocol, GatewayProtocol)
    transport.feed(request[10:])
    await settle()
    assert len(app.offered) == 1  # the full protocol's offer: the body ended with the head
    assert [b"".join(m["body"] for m in messages) for _, messages in app.runs] == [BODY]


@pytest.mark.parametrize("cuts", [[-5], [-20, -5]], ids=["one cut", "two cuts"])
async def test_lean_a_body_that_comes_after_its_head_is_awaited_and_offered(cuts: list[int]) -> None:
    """httpx (the OpenAI and Anthropic SDKs) writes a request's head and body apart: the body
    is read on, and the request offered whole, by the lean protocol."""
    app = App()
    _, transport = connect_lean(app)
    lean = transport.protocol
    request = post()
    for start, end in zip([0, *cuts], [*cuts, len(request)], strict=True):
        transport.feed(request[start:end])
    assert transport.protocol is lean
    assert [data for _, data in app.offered] == [BODY]
    answer(app.clients[0])
    await settle()
    assert transport.written.endswith(b"fast")
    # A hand-over replays the request from its first byte, every read of it.
    transport.feed(post()[:-5])
    transport.feed(post()[-5:])
    received: list[dict[str, Any]] = []

    async def rest(scope: dict[str, Any], receive: Any, send: Any) -> None:
        received.append(await receive())

    app.clients[1].run(rest)
    full = transport.protocol
    assert isinstance(full, GatewayProtocol) and full.cycle.scope["path"] == PATH and not full.cycle.more_body


async def test_lean_a_body_that_does_not_come_gets_the_full_protocol_s_408() -> None:
    _, transport = connect_lean(App(), body_timeout_s=0.05)
    transport.feed(post()[:-5])
    await asyncio.sleep(0.15)
    assert transport.written.startswith(b"HTTP/1.1 408 ") and transport.closed
    assert b"request body did not arrive" in transport.written


async def test_lean_a_client_that_leaves_before_its_body_ends_is_the_full_protocol_s_to_record() -> None:
    """As on the full protocol: the request runs, and its receive gives the disconnect."""
    app = App()
    state, transport = connect_lean(app)
    lean = transport.protocol
    transport.feed(post()[:-5])
    transport.closed = True
    lean.connection_lost(None)
    await settle()
    assert app.offered == []
    assert app.runs == [(PATH, [{"type": "http.disconnect"}])]
    assert not state.connections


async def test_lean_two_requests_in_one_read_are_served_in_order_by_the_full_protocol() -> None:
    app = App()
    _, transport = connect_lean(app)
    transport.feed(post() + post(b'{"model":"m2"}'))
    await settle()
    assert [messages[0]["body"] for _, messages in app.runs] == [BODY, b'{"model":"m2"}']
    assert transport.written.count(b"HTTP/1.1 200 OK") == 2


async def test_lean_a_malformed_request_gets_the_full_protocol_s_refusal() -> None:
    _, transport = connect_lean(App())
    transport.feed(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: x\r\n\r\n")
    assert transport.written.startswith(b"HTTP/1.1 400 Bad Request\r\n") and transport.closed


async def test_lean_a_head_over_the_limit_gets_the_full_protocol_s_431() -> None:
    _, transport = connect_lean(App(), max_header_bytes=1024)
    transport.feed(post(extra=b"X-Pad: %b\r\n" % (b"a" * 2000)))
    assert transport.written.startswith(b"HTTP/1.1 431 ") and transport.closed


async def test_lean_a_request_read_while_one_is_served_waits_for_its_answer() -> None:
    app = App()
    _, transport = connect_lean(app)
    transport.feed(post())
    transport.feed(post(b'{"model":"m2"}'))
    assert len(app.offered) == 1
    answer(app.clients[0])
    assert len(app.offered) == 1  # after the exchange's own ending, not inside its write
    await settle()
    assert [data for _, data in app.offered] == [BODY, b'{"model":"m2"}']
    answer(app.clients[1])
    await settle()
    assert transport.written.count(b"HTTP/1.1 200 OK") == 2


def answered_elsewhere() -> SwitchingTransport:
    """Another connection's answer, written in this pass of the loop: the pass's first write."""
    app = App()
    _, transport = connect_lean(app)
    transport.feed(post())
    answer(app.clients[0])
    assert transport.written.endswith(b"fast")  # the pass's first write is made at once
    return transport


async def test_lean_answers_after_the_pass_s_first_write_are_written_once_its_callbacks_have_run() -> None:
    """The first write of a pass of the loop is made at once; the answers after it are written
    at the end of the pass (``proxy/outbox.py``), after the pass's other callbacks."""
    answered_elsewhere()
    app = App()
    _, first = connect_lean(app)
    _, second = connect_lean(app)
    first.feed(post())
    second.feed(post())
    answer(app.clients[1])
    answer(app.clients[0])
    # The next request on the first connection, read and answered in the same pass: after it.
    first.feed(post())
    answer(app.clients[2], b"next")
    assert first.written == second.written == b""
    await asyncio.sleep(0)
    assert first.written.count(b"HTTP/1.1 200 OK") == 2
    assert first.written.index(b"\r\n\r\nfast") < first.written.index(b"\r\n\r\nnext")
    assert second.written.endswith(b"fast")
    # A pass later: its first write, made at once.
    first.feed(post())
    answer(app.clients[3])
    assert first.written.count(b"HTTP/1.1 200 OK") == 3


async def test_lean_an_answer_left_for_the_pass_s_end_goes_before_what_the_full_protocol_writes() -> None:
    """A request read in the same pass as the answer before it, and refused by the full protocol
    there and then: the answer goes first."""
    app = App()
    _, transport = connect_lean(app)
    transport.feed(post())
    answered_elsewhere()
    answer(app.clients[0])
    transport.feed(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: x\r\n\r\n")
    await settle()
    assert transport.written.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"fastHTTP/1.1 400 Bad Request\r\n" in transport.written and transport.closed


@pytest.mark.parametrize("how", ["closing", "lost"])
async def test_lean_an_answer_left_for_the_pass_s_end_is_dropped_with_its_connection(how: str) -> None:
    """Closed before the pass ends (its loss told, or still to be): nothing is written to it."""
    app = App()
    _, transport = connect_lean(app)
    transport.feed(post())
    answered_elsewhere()
    answer(app.clients[0])
    transport.closed = True
    if how == "lost":
        transport.protocol.connection_lost(None)
    await settle()
    assert transport.written == b""


async def test_lean_an_answer_left_for_the_pass_s_end_is_made_before_the_client_s_half_close_closes() -> None:
    """The answer and the client's FIN read in the same pass, the answer first and held: uvloop
    calls ``eof_received`` and then closes the transport itself, a close that waits for the
    bytes written before it; the held answer is among them."""
    app = App()
    _, transport = connect_lean(app)
    lean = transport.protocol
    transport.feed(post())
    answered_elsewhere()
    answer(app.clients[0])
    lean.eof_received()
    transport.close()  # what uvloop does when eof_received returns a false value
    await settle()
    assert transport.written.endswith(b"fast")


def test_lean_an_answer_left_for_the_pass_s_end_restarts_the_unsent_watch_from_its_end() -> None:
    """An earlier answer's tail is watched (``UnsentWatch``); the next answer is held for the
    pass's end, and the watch's check falls due in that pass. uvloop runs due timers before the
    pass's ``call_soon`` callbacks: the check must not find the connection idle with its count
    unchanged and cut it (the held answer with it). Each answer's end starts the watch again,
    a held one's once it is out."""

    async def scenario() -> tuple[bool, bytes]:
        app = App()
        app.send_stall_s = 0.2
        _, transport = connect_lean(app)
        lean = transport.protocol
        transport.feed(post())
        transport.buffered = 5000
        answer(app.clients[0])  # the pass's first write: at once; the watch armed
        await asyncio.sleep(0.1)
        transport.buffered = 4000  # the client takes a little: its check looks again in stall_s
        await asyncio.sleep(0.15)
        handle = lean._unsent._handle
        assert handle is not None
        transport.feed(post(b'{"model":"m2"}'))
        loop = asyncio.get_running_loop()
        await asyncio.sleep(handle.when() - loop.time() - 0.05)
        answered_elsewhere()
        answer(app.clients[1], b"next")  # held for the pass's end
        time.sleep(0.1)  # noqa: ASYNC251 (this pass runs past the earlier check's deadline, on purpose)
        await settle()
        return transport.aborted, transport.written

    aborted, written = uvloop.run(scenario())
    assert not aborted and written.endswith(b"next")


async def test_lean_a_hand_over_runs_on_the_full_protocol_with_the_body_taken() -> None:
    app = App()
    _, transport = connect_lean(app)
    transport.feed(post())
    transport.feed(post(b'{"model":"m2"}'))  # read while the first is served
    client = app.clients[0]
    received: list[dict[str, Any]] = []

    async def rest(scope: dict[str, Any], receive: Any, send: Any) -> None:
        received.append(await receive())
        await send({"type": "http.response.start", "status": 502, "headers": [(b"content-length", b"3")]})
        await send({"type": "http.response.body", "body": b"bad"})

    client.ended()
    client.run(rest)
    full = transport.protocol
    assert isinstance(full, GatewayProtocol) and full.cycle.scope["path"] == PATH
    await settle()
    assert received == []  # its receive waits: the body was the fast path's
    assert transport.written == b""
    full.connection_lost(None)
    await settle()
    assert received == [{"type": "http.disconnect"}]


async def test_lean_a_connection_lost_while_served_is_told_and_the_hand_over_sees_it() -> None:
    app = App()
    state, transport = connect_lean(app)
    lean = transport.protocol
    transport.feed(post())
    client = app.clients[0]
    received: list[dict[str, Any]] = []

    async def rest(scope: dict[str, Any], receive: Any, send: Any) -> None:
        received.append(await receive())

    def lost() -> None:
        # What the exchange does: close its upstream, hand the request over.
        client.ended()
        client.run(rest)

    client.lost = lost
    transport.closed = True
    lean.connection_lost(None)
    await settle()
    assert received == [{"type": "http.disconnect"}]
    assert transport.protocol.cycle.scope["extensions"]["blazar.gone"] is True
    assert not state.connections


async def test_lean_connection_close_is_answered_and_closed() -> None:
    app = App()
    _, transport = connect_lean(app)
    transport.feed(post(extra=b"Connection: close\r\n"))
    answer(app.clients[0])
    assert b"\r\nconnection: close\r\n" in transport.written and transport.closed


async def test_lean_a_silent_connection_gets_408_and_an_idle_one_is_closed() -> None:
    _, silent = connect_lean(App(), header_timeout_s=0.05)
    app = App()
    _, idle = connect_lean(app, keep_alive_s=0.05)
    idle.feed(post())
    answer(app.clients[0])
    await asyncio.sleep(0.15)
    assert silent.written.startswith(b"HTTP/1.1 408 ") and silent.closed
    assert idle.closed and idle.written.count(b"HTTP/1.1") == 1


async def test_lean_shutdown_closes_an_idle_connection_now_and_a_busy_one_after_its_answer() -> None:
    app = App()
    _, idle = connect_lean(app)
    idle.protocol.shutdown()
    assert idle.closed
    _, busy = connect_lean(app)
    busy.feed(post())
    busy.protocol.shutdown()
    assert not busy.closed
    answer(app.clients[0])
    assert busy.closed and b"\r\nconnection: close\r\n" in busy.written


async def test_lean_bytes_read_after_an_answer_come_after_those_that_waited_behind_it() -> None:
    """The next read can come before the bytes that waited behind the answered request are read
    (one loop turn): they are still read first, in the order sent."""
    app = App(take=False)
    _, transport = connect_lean(app)
    app.take = True
    transport.feed(post())
    transport.feed(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")  # waits behind the first
    answer(app.clients[0])
    app.take = False
    transport.feed(post(b'{"model":"m3"}'))  # before the loop's next turn
    await settle()
    assert [path for path, _ in app.runs] == ["/v1/models", PATH]
    assert app.runs[1][1][0]["body"] == b'{"model":"m3"}'


async def test_lean_a_head_split_around_an_answer_is_read_whole() -> None:
    app = App()
    _, transport = connect_lean(app)
    second = post(b'{"model":"m2"}')
    transport.feed(post())
    transport.feed(second[:40])
    answer(app.clients[0])
    transport.feed(second[40:])
    await settle()
    assert b" 400 " not in transport.written
    assert [data for _, data in app.offered] == [BODY, b'{"model":"m2"}']


async def test_lean_the_first_head_is_due_when_the_connection_opened_not_when_it_began() -> None:
    """A head begun on a new connection and passed to the full protocol keeps its deadline (the
    connection's start + ``header_timeout_s``): no second wait for a slow client."""
    _, transport = connect_lean(App())
    due = transport.protocol._first_deadline
    await asyncio.sleep(0.02)
    transport.feed(post()[:30])
    full = transport.protocol
    assert isinstance(full, GatewayProtocol)
    assert full._head_timer is not None and full._head_timer.when() == due


async def test_lean_a_request_is_not_answered_while_the_client_takes_no_answers() -> None:
    """A client that sends requests and reads none of the answers: the next is read and served
    once it takes bytes again (its buffer under the low-water mark), not answered into a buffer
    that grows without end."""
    app = App()
    _, transport = connect_lean(app)
    lean = transport.protocol
    transport.feed(post())
    answer(app.clients[0])
    lean.pause_writing()  # the answer is still in the transport's buffer
    transport.feed(post(b'{"model":"m2"}'))
    await settle()
    assert len(app.offered) == 1 and transport.paused
    assert transport.written.count(b"HTTP/1.1 200 OK") == 1
    lean.resume_writing()
    await settle()
    assert [data for _, data in app.offered] == [BODY, b'{"model":"m2"}'] and not transport.paused
    answer(app.clients[1])
    transport.feed(post(b'{"model":"m3"}'))
    answer(app.clients[2])
    await settle()
    assert transport.written.count(b"HTTP/1.1 200 OK") == 3 and transport.protocol is lean


async def test_lean_a_request_held_for_a_client_that_reads_nothing_is_not_idle() -> None:
    """Held while the client takes no answers, a request is not an idle connection's silence."""
    app = App()
    _, transport = connect_lean(app, keep_alive_s=0.01)
    lean = transport.protocol
    transport.feed(post())
    answer(app.clients[0])
    lean.pause_writing()
    transport.feed(post(b'{"model":"m2"}'))
    await asyncio.sleep(0.05)
    assert not transport.closed
    lean.resume_writing()
    await settle()
    assert len(app.offered) == 2


async def test_lean_a_full_write_buffer_is_told_to_the_full_protocol() -> None:
    app = App()
    _, transport = connect_lean(app)
    transport.feed(post())
    transport.protocol.pause_writing()  # a stream's bytes, say, not taken yet

    async def rest(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    app.clients[0].ended()
    app.clients[0].run(rest)  # handed over
    full = transport.protocol
    assert full.flow.write_paused
    full.resume_writing()  # the client reads again: the response goes out
    await settle()
    assert transport.written.endswith(b"ok")


async def test_lean_a_body_whose_end_comes_with_the_next_request_goes_whole_to_the_full_protocol() -> None:
    app = App()
    _, transport = connect_lean(app)
    first = post()
    transport.feed(first[:-5])
    transport.feed(first[-5:] + post(b'{"model":"m2"}'))
    await settle()
    assert isinstance(transport.protocol, GatewayProtocol) and app.offered == []
    assert [messages[0]["body"] for _, messages in app.runs] == [BODY, b'{"model":"m2"}']


async def test_lean_shutdown_while_a_body_comes_lets_the_full_protocol_finish_it() -> None:
    app = App()
    _, transport = connect_lean(app)
    transport.feed(post()[:-5])
    transport.protocol.shutdown()
    assert not transport.closed
    transport.feed(post()[-5:])
    await settle()
    assert [b"".join(m["body"] for m in messages) for _, messages in app.runs] == [BODY]
    assert transport.closed and b"\r\nconnection: close\r\n" in transport.written


@pytest.mark.parametrize("how", ["over the size limit", "shutdown"])
async def test_lean_a_body_still_coming_keeps_its_deadline_when_the_full_protocol_takes_it(how: str) -> None:
    """Its deadline stays ``body_timeout_s`` after its head, not a new wait from the switch."""
    big = post(b'{"model":"m1","pad":"%b"}' % (b"z" * 2000))
    end_of_head = big.index(b"\r\n\r\n") + 4
    _, transport = connect_lean(App(), max_header_bytes=1024, body_timeout_s=30)
    lean = transport.protocol
    transport.feed(big[:end_of_head])
    due = lean._body_timer.when()
    await asyncio.sleep(0.02)
    if how == "shutdown":
        lean.shutdown()
    else:
        transport.feed(big[end_of_head : end_of_head + 1000])
    full = transport.protocol
    assert isinstance(full, GatewayProtocol)
    assert full._body_timer is not None and full._body_timer.when() == due


async def test_lean_a_body_in_many_reads_is_offered_whole() -> None:
    app = App()
    _, transport = connect_lean(app)
    body = b'{"model":"m1","pad":"%b"}' % (b"y" * 3000)
    request = post(body)
    end_of_head = request.index(b"\r\n\r\n") + 4
    transport.feed(request[:end_of_head])
    for at in range(end_of_head, len(request), 7):
        transport.feed(request[at : at + 7])
    assert [data for _, data in app.offered] == [body]


class GuardedApp(App):
    """The gateway's budget for bodies held, and its check of a head whose body is still coming."""

    def __init__(self, budget_bytes: int = 10_000, serves: bool = True) -> None:
        super().__init__()
        self.body_budget = BodyBudget(budget_bytes)
        self.serves = serves
        self.heads: list[dict[str, Any]] = []

    def serves_head(self, scope: dict[str, Any]) -> bool:
        self.heads.append(scope)
        return self.serves


def head_and(body_bytes: int, body: bytes = BODY) -> tuple[bytes, bytes]:
    """A request cut after its head and ``body_bytes`` of its body: the two parts."""
    request = post(body)
    cut = request.index(b"\r\n\r\n") + 4 + body_bytes
    return request[:cut], request[cut:]


async def test_lean_a_body_still_coming_holds_the_budget_for_its_bytes_until_offered() -> None:
    """A head alone holds nothing; the bytes that came hold their size, given back at the offer
    (the fast path charges the whole body itself)."""
    app = GuardedApp()
    _, transport = connect_lean(app)
    head, rest = head_and(0)
    transport.feed(head)
    assert app.body_budget.held_bytes == 0
    transport.feed(rest[:10])
    transport.feed(rest[10:20])
    assert app.body_budget.held_bytes == 20
    transport.feed(rest[20:])
    assert [data for _, data in app.offered] == [BODY] and app.body_budget.held_bytes == 0
    assert [scope["path"] for scope in app.heads] == [PATH]
    # A body that came with its head is not shown twice.
    answer(app.clients[0])
    transport.feed(post())
    assert len(app.offered) == 2 and len(app.heads) == 1


class CheckingOnceApp(GuardedApp):
    """The gateway's ``fast_after_head``: ``fast`` for a body whose head ``serves_head`` passed."""

    def __init__(self) -> None:
        super().__init__()
        self.after_head: list[bytes] = []

    def fast_after_head(self, scope: dict[str, Any], data: bytes, client: Client) -> bool:
        self.after_head.append(data)
        return self.fast(scope, data, client)


async def test_lean_a_body_after_its_checked_head_is_offered_as_checked() -> None:
    """The head ``serves_head`` passed is not the app's to check again at the offer: the offer is
    ``fast_after_head``'s; a request whose head and body came together is ``fast``'s alone."""
    app = CheckingOnceApp()
    _, transport = connect_lean(app)
    head, rest = head_and(0)
    transport.feed(head)
    transport.feed(rest)
    assert app.after_head == [BODY] and [data for _, data in app.offered] == [BODY]
    answer(app.clients[0])
    transport.feed(post())
    assert app.after_head == [BODY] and len(app.offered) == 2 and len(app.heads) == 1


async def test_lean_body_bytes_the_budget_has_no_room_for_go_to_the_full_protocol() -> None:
    """Refused as the full protocol refuses them: its request reads (and charges) them."""
    app = GuardedApp(budget_bytes=1000)
    app.body_budget.held_bytes = 990  # other requests' bodies
    _, transport = connect_lean(app)
    first, rest = head_and(20)
    transport.feed(first)
    assert isinstance(transport.protocol, GatewayProtocol)
    assert app.body_budget.held_bytes == 990 and app.offered == []
    transport.feed(rest)
    await settle()
    assert [b"".join(m["body"] for m in messages) for _, messages in app.runs] == [BODY]


@pytest.mark.parametrize("how", ["client leaves", "body too slow", "shutdown", "over the size limit"])
async def test_lean_a_body_coming_gives_the_budget_back_when_the_full_protocol_takes_it(how: str) -> None:
    app = GuardedApp()
    _, transport = connect_lean(app, max_header_bytes=1024, body_timeout_s=0.05)
    lean = transport.protocol
    first, rest = head_and(10, b'{"model":"m1","pad":"%b"}' % (b"z" * 2000))
    transport.feed(first)
    assert app.body_budget.held_bytes == 10
    if how == "client leaves":
        transport.closed = True
        lean.connection_lost(None)
    elif how == "body too slow":
        await asyncio.sleep(0.15)
        assert transport.written.startswith(b"HTTP/1.1 408 ")
    elif how == "shutdown":
        lean.shutdown()
    else:
        transport.feed(rest[:1500])
    assert transport.protocol is not lean and app.body_budget.held_bytes == 0


async def test_lean_a_head_the_app_would_refuse_goes_to_the_full_protocol_before_its_body() -> None:
    """A wrong key, a foreign Origin, a declared length with no room: refused at the head, as the
    full protocol refuses it, not after waiting for (and holding) a body from anyone."""
    app = GuardedApp(serves=False)
    _, transport = connect_lean(app)
    first, rest = head_and(5)
    transport.feed(first)
    full = transport.protocol
    assert isinstance(full, GatewayProtocol) and app.body_budget.held_bytes == 0
    await settle()
    assert full.cycle.scope["path"] == PATH and app.offered == []
    transport.feed(rest)
    await settle()
    assert [b"".join(m["body"] for m in messages) for _, messages in app.runs] == [BODY]


def connect_either(
    app: App, lean: bool, body_timeout_s: float = 60.0
) -> tuple[FakeTransport, Callable[[bytes], None]]:
    """A connection on the lean protocol or the full one, and what gives it a read."""
    if lean:
        _, switching = connect_lean(app, body_timeout_s=body_timeout_s)
        return switching, switching.feed
    protocol, transport = connect(app)
    protocol.body_timeout_s = body_timeout_s
    return transport, protocol.data_received


async def freed_without_the_collector(ref: weakref.ref[Any]) -> bool:
    """Whether what ``ref`` refers to is gone once the loop has turned, with the collector off."""
    gc.disable()
    try:
        await settle()
        return ref() is None
    finally:
        gc.enable()


async def _stall_passes(stall_s: float) -> None:
    await asyncio.sleep(stall_s * 5)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "full"])
async def test_a_client_that_takes_nothing_of_an_answer_s_tail_is_cut_after_the_send_stall(
    lean: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The answer written whole, its tail left in the buffer: a client that takes none of it for
    ``send_stall_s`` is aborted (a close would wait for it for ever)."""
    app = App()
    app.send_stall_s = 0.01
    transport, feed = connect_either(app, lean)
    feed(post())
    transport.buffered = 5000
    answer(app.clients[0])
    assert not transport.closed
    await _stall_passes(app.send_stall_s)
    assert transport.aborted
    assert "client 127.0.0.1:50000 took none of the 5000 bytes left for it" in caplog.text


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "full"])
async def test_a_client_that_takes_an_answer_s_tail_slowly_is_not_cut(lean: bool) -> None:
    app = App()
    app.send_stall_s = 0.01
    transport, feed = connect_either(app, lean)
    feed(post())
    left = iter([5000, 4000, 3000, 2000, 1000, 0])
    asked: list[int] = []

    def taken_slowly() -> int:
        asked.append(next(left, 0))  # some taken by each look at it
        return asked[-1]

    transport.get_write_buffer_size = taken_slowly  # type: ignore[method-assign]
    answer(app.clients[0])
    await wait_until_async(lambda: asked[-1:] == [0], "the tail taken", timeout_s=5)
    assert asked[:6] == [5000, 4000, 3000, 2000, 1000, 0]  # a check each interval, each saw less
    await _stall_passes(app.send_stall_s)
    assert not transport.closed


async def test_a_client_with_a_response_under_way_is_left_to_the_relay_s_watch() -> None:
    """The tail of one answer is not watched while the next is written (a stream's client is
    the relay's to cut, and its record says so); the next answer's end watches again."""
    app = App()
    app.send_stall_s = 0.01
    _, transport = connect_lean(app)
    transport.feed(post())
    transport.buffered = 5000
    answer(app.clients[0])
    transport.feed(post(b'{"model":"m2"}'))  # served: the buffer is under its high-water mark
    await _stall_passes(app.send_stall_s)
    assert not transport.closed
    answer(app.clients[1])
    await _stall_passes(app.send_stall_s)
    assert transport.aborted


async def test_an_answer_s_tail_is_still_watched_once_the_full_protocol_has_the_connection() -> None:
    app = App()
    app.send_stall_s = 0.01
    _, transport = connect_lean(app)
    transport.feed(post())
    transport.buffered = 5000
    answer(app.clients[0])
    transport.feed(b"GET /v1/models HTTP/1.1\r\nHo")  # a head cut across reads: the full protocol's
    assert isinstance(transport.protocol, GatewayProtocol)
    await _stall_passes(app.send_stall_s)
    assert transport.aborted


async def test_a_held_request_whose_body_breaks_is_refused_and_never_run() -> None:
    app = App()
    protocol, transport = connect(app)
    protocol.body_timeout_s = 0.2
    protocol.data_received(post())
    answer(app.clients[0])
    protocol.pause_writing()
    protocol.data_received(
        b"POST /other HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n"
    )
    assert b"HTTP/1.1 400" in transport.written and transport.closed
    protocol.resume_writing()
    await settle()
    assert app.runs == [] and not protocol.tasks


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "full"])
async def test_a_client_taking_one_answer_s_tail_while_the_next_lands_is_not_cut(lean: bool) -> None:
    """Each answer's end starts the watch afresh: bytes an earlier answer left, taken since, are
    not counted against a client that goes on taking the next one's."""
    app = App()
    app.send_stall_s = 0.1
    transport, feed = connect_either(app, lean)
    feed(post())
    transport.buffered = 5000
    answer(app.clients[0])
    await asyncio.sleep(0.03)
    transport.buffered = 0  # all of the first taken
    feed(post(b'{"model":"m2"}'))
    transport.buffered = 8000  # the second, larger, written whole
    answer(app.clients[1])
    await asyncio.sleep(0.04)
    transport.buffered = 6000  # some of it taken
    await asyncio.sleep(0.08)  # past the first answer's interval
    assert not transport.aborted


async def test_a_hand_over_while_the_client_s_buffer_is_full_runs_the_hand_over() -> None:
    app = App()
    _, transport = connect_lean(app)
    transport.feed(post())
    transport.protocol.pause_writing()
    ran: list[str] = []

    async def rest(scope: dict[str, Any], receive: Any, send: Any) -> None:
        ran.append("rest")
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
        await send({"type": "http.response.body", "body": b"REST"})

    app.clients[0].ended()
    app.clients[0].run(rest)
    full = transport.protocol
    full.resume_writing()
    await settle()
    assert ran == ["rest"] and app.runs == [] and transport.written.endswith(b"REST")


async def test_lean_shutdown_while_a_request_is_held_serves_it_with_close() -> None:
    app = App(take=False)
    _, transport = connect_lean(app)
    lean = transport.protocol
    app.take = True
    transport.feed(post())
    answer(app.clients[0])
    app.take = False
    lean.pause_writing()
    transport.feed(post(b'{"model":"m2"}'))
    lean.shutdown()
    full = transport.protocol
    assert isinstance(full, GatewayProtocol) and not transport.closed
    full.resume_writing()
    await settle()
    await settle()
    assert [messages[0]["body"] for _, messages in app.runs] == [b'{"model":"m2"}']
    assert transport.written.count(b"HTTP/1.1 200 OK") == 2 and transport.closed
    assert transport.written.rsplit(b"HTTP/1.1 200 OK", 1)[1].count(b"connection: close") == 1


@pytest.mark.parametrize("stall_s", [0.0, 0.1])
async def test_a_closed_connection_s_protocol_is_freed_without_the_collector(stall_s: float) -> None:
    app = App(take=False)
    app.send_stall_s = stall_s
    protocol, _ = connect(app)
    protocol.data_received(b"GET /x HTTP/1.1\r\nHost: gw\r\n\r\n")
    await settle()
    protocol.connection_lost(None)
    await settle()
    ref = weakref.ref(protocol)
    del protocol
    assert await freed_without_the_collector(ref)


async def test_the_read_ahead_bound_counts_the_queue_a_refused_body_leaves() -> None:
    app = App()
    protocol, _ = connect(app)
    protocol.data_received(post())
    protocol.data_received(
        post(b'{"n":1}') + b"POST /other HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    )
    assert len(protocol.pipeline) == 1
    flow = protocol.flow
    assert isinstance(flow, _BoundedFlow) and flow._pipeline is protocol.pipeline


async def test_a_held_request_refused_for_its_broken_body_still_cuts_a_client_that_reads_nothing() -> None:
    app = App()
    app.send_stall_s = 0.01
    protocol, transport = connect(app)
    protocol.data_received(post())
    transport.buffered = 100_000
    answer(app.clients[0])
    protocol.pause_writing()
    protocol.data_received(
        b"POST /other HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n"
    )
    assert b"HTTP/1.1 400" in transport.written and transport.closed  # a close that waits for the rest
    await _stall_passes(app.send_stall_s)
    assert transport.aborted


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "full"])
async def test_a_request_refused_mid_body_after_an_untaken_tail_still_cuts_the_client(lean: bool) -> None:
    """An answer's tail left (under the high-water mark, so the next request begins); that
    request's body never ends: its 408 closes the connection, and the client that takes none of
    what is left is still cut."""
    app = App()
    app.send_stall_s = 0.01
    transport, feed = connect_either(app, lean, body_timeout_s=0.05)
    feed(post())
    transport.buffered = 5000
    answer(app.clients[0])
    feed(post(b'{"model":"m2","pad":"xxxxxxxxxx"}')[:-10])
    await wait_until_async(lambda: transport.aborted, "the client cut", timeout_s=5)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "full"])
async def test_a_close_after_a_failed_answer_still_cuts_a_client_that_reads_nothing(lean: bool) -> None:
    """The fast path closes the client's connection when an answer fails past its start: the
    close waits for what the client has not taken, and a client that takes none is cut."""
    app = App()
    app.send_stall_s = 0.01
    transport, feed = connect_either(app, lean)
    feed(post())
    transport.buffered = 5000
    app.clients[0].close()
    assert transport.closed and not transport.aborted
    await _stall_passes(app.send_stall_s)
    assert transport.aborted


async def test_a_connection_lost_with_a_request_held_frees_its_protocol_without_the_collector() -> None:
    app = App()
    protocol, _ = connect(app)
    protocol.data_received(post())
    answer(app.clients[0])
    protocol.pause_writing()
    protocol.data_received(b"GET /x HTTP/1.1\r\nHost: gw\r\n\r\n")  # held
    await settle()
    protocol.connection_lost(None)
    await settle()
    app.clients.clear()  # the fast path's client refers to the protocol
    ref = weakref.ref(protocol)
    del protocol
    assert await freed_without_the_collector(ref)
