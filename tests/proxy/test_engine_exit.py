"""A request that reaches an engine child as it exits: 503 with Retry-After, not the engine's 502.

A child killed (or crashing) closes its listening socket as it exits: a
connection the kernel had accepted into its backlog, with the request in
it, is reset unread. The gateway sees an empty reply on a fresh
connection, which from a live engine is its answer (502, never sent
twice). From a child that has exited, the request is answered 503
``engine_exited`` with Retry-After (the child is gone, as for a connect
refused a moment later).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess

import orjson
import pytest

from engines.probes import process_exiting
from engines.spec import Guards
from proxy.app import build_app
from proxy.routing import Replica, Route, RoutingTable, UpstreamAddress
from proxy.startup.settings import Settings
from tests.helpers import in_process_server

pytestmark = pytest.mark.anyio


class ExitingChild:
    """A replica's gate (``routing.ReplicaGate``): a ready child, whose process may be exiting."""

    def __init__(self) -> None:
        self.ready = True
        self.starts = 1
        self.name = "child-0"
        self.exiting = False

    def exited(self) -> bool:
        return self.exiting


CHAT = b'{"model":"m1","messages":[{"role":"user","content":"hi"}]}'


async def post_to_a_closing_backlog(
    target: bytes = b"/v1/chat/completions", *, exits: bool = True
) -> tuple[bytes, dict[str, object]]:
    """POST a chat completion to ``target`` through a gateway whose upstream listens but never
    accepts; once the request sits in its backlog the listener closes, as at a child's exit
    (``exits``: its gate says so)."""
    child = ExitingChild()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    address = UpstreamAddress("127.0.0.1", listener.getsockname()[1])
    route = Route(model="m1", upstream=address, guards=Guards(), replicas=(Replica(address, child),))
    app = build_app(RoutingTable([route]), Settings())
    try:
        async with in_process_server(app) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST %b HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (target, len(CHAT), CHAT)
            )
            await asyncio.sleep(0.3)  # the gateway connects, and writes the request into the backlog
            child.exiting = exits
            listener.close()  # the backlog's connection is reset, its request unread
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            fields = (line.partition(b": ") for line in head.lower().split(b"\r\n"))
            length = int(next(value for name, _, value in fields if name == b"content-length"))
            answer = orjson.loads(await reader.readexactly(length))
            writer.close()
    finally:
        listener.close()
    return head, answer


@pytest.mark.parametrize(
    "target",
    # A query sends the request to the full protocol and its task (the lean one takes exact paths).
    [b"/v1/chat/completions", b"/v1/chat/completions?api-version=1"],
    ids=["fast path", "task path"],
)
async def test_a_request_reset_in_an_exiting_child_s_backlog_is_answered_503_to_retry(target: bytes) -> None:
    head, answer = await post_to_a_closing_backlog(target)
    assert head.startswith(b"HTTP/1.1 503 "), head
    assert b"\r\nretry-after: " in head.lower(), head
    error = answer["error"]
    assert isinstance(error, dict) and error["code"] == "engine_exited", answer
    assert "child-0 exited" in error["message"], answer


async def test_the_same_reset_from_a_child_still_running_is_its_answer_502() -> None:
    """An engine that closes a fresh connection unanswered (mlx_lm.server does on a field it
    cannot handle) is alive: its empty reply stays 502, sent once."""
    head, answer = await post_to_a_closing_backlog(exits=False)
    assert head.startswith(b"HTTP/1.1 502 "), head
    error = answer["error"]
    assert isinstance(error, dict) and error["code"] == "upstream_empty_reply", answer


def test_a_process_reads_as_exiting_once_killed_and_while_unreaped() -> None:
    """``process_exiting``: a live process is not; a killed one is, reaped or not (a zombie)."""
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert not process_exiting(proc.pid)
        proc.kill()
        deadline = 50
        while not process_exiting(proc.pid) and deadline:  # the signal is delivered at once, or nearly
            deadline -= 1
            subprocess.run(["true"], check=True)
        assert process_exiting(proc.pid)  # a zombie: not yet reaped by its parent
    finally:
        proc.kill()
        proc.wait()
    assert process_exiting(proc.pid)  # reaped: no such process
    assert process_exiting(None)
