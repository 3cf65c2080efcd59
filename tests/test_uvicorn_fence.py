"""uvicorn's internals that the gateway uses, by name and shape: a release that reshapes one fails here.

``proxy/protocol.py`` subclasses uvicorn's httptools protocol and writes its
request cycles' state itself; ``proxy/lean.py`` is a protocol uvicorn makes in
its place, which reads its config and server state and makes uvicorn's protocol
in turn; ``proxy/startup`` subclasses ``uvicorn.Server``.
None of that is public API, so ``pyproject.toml`` pins uvicorn to the range
these tests passed on, and this file lists every name the gateway relies on,
with the parameters of each method it overrides or calls, and the attributes
it reads or writes on a live protocol and cycle.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections import deque
from collections.abc import Callable
from typing import Any

import pytest
import uvicorn
import uvicorn.config
from uvicorn.protocols import utils
from uvicorn.protocols.http import flow_control, httptools_impl
from uvicorn.server import ServerState

from proxy.protocol import ClientWriter, GatewayProtocol, protocol_class

pytestmark = pytest.mark.anyio


def parameters(function: Callable[..., Any]) -> list[str]:
    """A function's parameter names, without ``self``."""
    return [name for name in inspect.signature(function).parameters if name != "self"]


# Method -> its parameters, for each uvicorn method the gateway overrides or calls.
PROTOCOL_METHODS = {
    "__init__": ["config", "server_state", "app_state", "_loop"],
    "connection_made": ["transport"],
    "connection_lost": ["exc"],
    "data_received": ["data"],
    "eof_received": [],
    "on_message_begin": [],
    "on_url": ["url"],
    "on_header": ["name", "value"],
    "on_headers_complete": [],
    "on_body": ["body"],
    "on_message_complete": [],
    "on_response_complete": [],
    "send_400_response": ["msg"],
    "_unset_keepalive_if_required": [],
    "_start_asgi_task": ["cycle", "app"],
    "timeout_keep_alive_handler": [],
}
CYCLE_METHODS = {
    "__init__": [
        "scope",
        "transport",
        "flow",
        "logger",
        "access_logger",
        "access_log",
        "default_headers",
        "message_event",
        "expect_100_continue",
        "keep_alive",
        "on_response",
    ],
    "send": ["message"],
    "receive": [],
    "run_asgi": ["app"],
}
FLOW_METHODS: dict[str, list[str]] = {
    "drain": [],
    "pause_reading": [],
    "resume_reading": [],
    "pause_writing": [],
    "resume_writing": [],
}


def test_the_module_names_the_protocol_imports_are_there_with_their_meaning() -> None:
    """HEADER_RE and HEADER_VALUE_RE match one refused byte; STATUS_LINE maps each status to its line."""
    assert isinstance(httptools_impl.HEADER_RE, re.Pattern) and isinstance(
        httptools_impl.HEADER_VALUE_RE, re.Pattern
    )
    assert httptools_impl.HEADER_RE.match(b":") and not httptools_impl.HEADER_RE.match(b"a")
    assert httptools_impl.HEADER_VALUE_RE.match(b"\n") and not httptools_impl.HEADER_VALUE_RE.match(b"\t")
    assert httptools_impl.STATUS_LINE[200] == b"HTTP/1.1 200 OK\r\n"
    assert set(httptools_impl.STATUS_LINE) >= set(range(100, 600))
    assert issubclass(GatewayProtocol, httptools_impl.HttpToolsProtocol)


@pytest.mark.parametrize(
    ("cls", "methods"),
    [
        (httptools_impl.HttpToolsProtocol, PROTOCOL_METHODS),
        (httptools_impl.RequestResponseCycle, CYCLE_METHODS),
        (flow_control.FlowControl, FLOW_METHODS),
    ],
    ids=["protocol", "cycle", "flow"],
)
def test_the_methods_the_gateway_overrides_or_calls_keep_their_parameters(
    cls: type, methods: dict[str, list[str]]
) -> None:
    """Each method is uvicorn's own (defined on the class) with the parameters the gateway passes."""
    for name, expected in methods.items():
        assert name in vars(cls), f"uvicorn's {cls.__name__}.{name} is gone"
        assert parameters(getattr(cls, name)) == expected, f"{cls.__name__}.{name}"


def test_the_server_hooks_the_gateway_overrides_keep_their_shape() -> None:
    """uvicorn.Server's startup and handle_exit, its flags, and the exit code of a failed start."""
    assert parameters(uvicorn.Server.startup) == ["sockets"]
    assert parameters(uvicorn.Server.handle_exit) == ["sig", "frame"]
    assert parameters(uvicorn.Server.__init__) == ["config"]
    # on_tick(counter) writes the Date header where counter % 10 == 0 (GatewayServer.on_tick
    # passes 0 to have it written, 1 not to), and the main loop calls it every tick.
    assert parameters(uvicorn.Server.on_tick) == ["counter"]
    assert "counter % 10 == 0" in inspect.getsource(uvicorn.Server.on_tick)
    assert "self.on_tick(counter)" in inspect.getsource(uvicorn.Server.main_loop)
    server = uvicorn.Server(uvicorn.Config(_app))
    for name in ("should_exit", "force_exit", "started"):
        assert hasattr(server, name), name
    # Set by startup: the listening servers, whose sockets the gateway reports.
    assert "self.servers" in inspect.getsource(uvicorn.Server.startup)
    assert isinstance(uvicorn.config.STARTUP_FAILURE, int)
    # Every setting the CLI gives uvicorn.Config (proxy/startup/cli.py).
    config_parameters = inspect.signature(uvicorn.Config).parameters
    for name in (
        "host",
        "port",
        "loop",
        "http",
        "ws",
        "timeout_keep_alive",
        "lifespan",
        "access_log",
        "server_header",
        "proxy_headers",
        "timeout_graceful_shutdown",
        "log_level",
    ):
        assert name in config_parameters, name


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


class _Transport(asyncio.Transport):
    """Enough of a transport for uvicorn's protocol: it records writes."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def write(self, data: Any) -> None:
        self.written += bytes(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def test_a_live_protocol_and_cycle_have_the_attributes_the_gateway_reads_and_writes() -> None:
    """On a protocol that has read a request: its own fields, its cycle's, and the cycle's keep-alive
    from the client's Connection: close (the server's writer closes by it, without send)."""
    gateway_protocol = protocol_class(10.0, 65536)
    config = uvicorn.Config(_app, http=gateway_protocol, ws="none", lifespan="off")
    config.load()
    assert config.http_protocol_class is gateway_protocol
    state = ServerState()
    protocol = gateway_protocol(config=config, server_state=state, app_state={})
    transport = _Transport()
    protocol.connection_made(transport)
    protocol.data_received(b"GET /x HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n")
    for name in ("loop", "parser", "transport", "flow", "cycle", "scope", "headers", "url", "server_state"):
        assert hasattr(protocol, name), name
    assert isinstance(protocol.pipeline, deque)
    assert isinstance(protocol.timeout_keep_alive, (int, float))
    assert hasattr(protocol, "expect_100_continue") and hasattr(protocol, "timeout_keep_alive_task")
    assert isinstance(state.default_headers, list) and isinstance(state.total_requests, int)
    cycle = protocol.cycle
    assert isinstance(cycle, httptools_impl.RequestResponseCycle)
    for name in (
        "scope",
        "transport",
        "flow",
        "disconnected",
        "waiting_for_100_continue",
        "response_started",
        "response_complete",
        "chunked_encoding",
        "expected_content_length",
        "message_event",
        "on_response",
        "default_headers",
    ):
        assert hasattr(cycle, name), name
    assert cycle.keep_alive is False
    assert isinstance(cycle.flow, flow_control.FlowControl) and hasattr(cycle.flow, "write_paused")
    assert isinstance(ClientWriter.of(cycle.send), ClientWriter)
    for _ in range(50):
        if cycle.response_complete:
            break
        await asyncio.sleep(0.01)
    assert transport.written.startswith(b"HTTP/1.1 204") and transport.closing
    protocol.connection_lost(None)


def test_what_the_lean_protocol_reads_of_uvicorn_is_there() -> None:
    """``proxy/lean.py``: the address helpers, the config and server-state fields it reads, and
    the shutdown call uvicorn makes on every connection (the lean protocol answers it)."""
    for name in ("get_local_addr", "get_remote_addr", "is_ssl"):
        assert parameters(getattr(utils, name)) == ["transport"], name
    config = uvicorn.Config(_app, timeout_keep_alive=7)
    config.load()
    assert config.loaded_app is not None and config.timeout_keep_alive == 7
    assert config.root_path == "" and config.limit_concurrency is None
    state = ServerState()
    assert isinstance(state.connections, set) and isinstance(state.tasks, set)
    assert state.total_requests == 0 and state.default_headers == []
    assert "connection.shutdown()" in inspect.getsource(uvicorn.Server.shutdown)
    assert parameters(httptools_impl.HttpToolsProtocol.shutdown) == []
