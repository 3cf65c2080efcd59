"""Messages and Responses streams from engines that frame them unlike the fake engine.

Passed through: their end is judged whatever the engine's SSE framing.
Translated: an engine's error status comes in the API's envelope even when
its body is an event stream.

The upstream here is a scripted HTTP/1.1 server on a thread (the fake engine
writes ``\\n`` only): it answers each stream with the events given, one
chunk and one read each, framed as the test says.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.conftest import Running, StartGateway

Events = list[tuple[str, dict[str, Any]]]

MESSAGE_EVENTS: Events = [
    ("message_start", {"type": "message_start", "message": {"id": "m", "content": [], "usage": {}}}),
    ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"text": "hi"}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}),
    ("message_stop", {"type": "message_stop"}),
]
RESPONSE_EVENTS: Events = [
    ("response.created", {"type": "response.created", "response": {"id": "r", "status": "in_progress"}}),
    ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "hi"}),
    ("response.completed", {"type": "response.completed", "response": {"id": "r", "status": "completed"}}),
]


class ScriptedUpstream:
    """Answers every POST with a chunked event stream of ``events``, each event its own chunk."""

    def __init__(
        self, events: Events, newline: bytes, status: bytes = b"200 OK", head_delay_s: float = 0.0
    ) -> None:
        self.events = [
            (b"event: " + name.encode() + newline if name else b"")
            + b"data: "
            + orjson.dumps(data)
            + newline
            + newline
            for name, data in events
        ]
        self.status = status
        # A prefill before the head: the gateway's heartbeats start the client's stream meanwhile.
        self.head_delay_s = head_delay_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                if not (read := conn.recv(65536)):
                    return  # a connection opened and closed unused
                data += read
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.lower().split(b"\r\n")
            if not lines[0].startswith(b"post "):
                conn.sendall(b'HTTP/1.1 200 OK\r\ncontent-length: 11\r\nconnection: close\r\n\r\n{"data":[]}')
                return
            length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length:"))
            while len(body) < length:
                body += conn.recv(65536)
            try:
                self._stream(conn)
            except (BrokenPipeError, ConnectionResetError):
                return  # the gateway cut the stream short: each test judges that by what its client got

    def _stream(self, conn: socket.socket) -> None:
        time.sleep(self.head_delay_s)
        conn.sendall(
            b"HTTP/1.1 "
            + self.status
            + b"\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
            b"connection: close\r\n\r\n"
        )
        for event in self.events:
            conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
            time.sleep(0.05)  # one read per event at the gateway
        conn.sendall(b"0\r\n\r\n")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def crlf_upstreams() -> Iterator[dict[str, ScriptedUpstream]]:
    """A Messages and a Responses engine that frame their events with CRLF."""
    upstreams = {
        "/v1/messages": ScriptedUpstream(MESSAGE_EVENTS, b"\r\n"),
        "/v1/responses": ScriptedUpstream(RESPONSE_EVENTS, b"\r\n"),
    }
    yield upstreams
    for upstream in upstreams.values():
        upstream.close()


def native_gateway(
    start_gateway: StartGateway, tmp_path: Path, upstreams: dict[str, ScriptedUpstream]
) -> Running:
    """A gateway whose model "messages" and "responses" are those upstreams, serving both APIs."""
    config = tmp_path / "blazar.toml"
    config.write_text(
        "".join(
            f'[models.{path.rsplit("/", 1)[1]}]\nupstream = "http://127.0.0.1:{u.port}/v1"\n'
            'native-apis = ["messages", "responses"]\n'
            for path, u in upstreams.items()
        )
    )
    return start_gateway({}, "--config", str(config))


@pytest.mark.fault("upstreams", "a stream without [DONE], or not an event stream")
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_crlf_framed_passthrough_stream_is_not_judged_truncated(
    start_gateway: StartGateway, tmp_path: Path, crlf_upstreams: dict[str, ScriptedUpstream], path: str
) -> None:
    """A whole native stream framed with CRLF (as sse-starlette writes), an event per read, ends as sent."""
    gateway = native_gateway(start_gateway, tmp_path, crlf_upstreams)
    upstream = crlf_upstreams[path]
    body = {"model": path.rsplit("/", 1)[1], "stream": True, "max_tokens": 4, "input": "hi", "messages": []}
    with httpx.Client(trust_env=False, timeout=20) as client:
        reply = client.post(gateway.url + path, json=body)
    assert reply.status_code == 200, reply.text
    assert reply.content == b"".join(upstream.events), reply.content[-300:]


@pytest.mark.fault("upstreams", "error statuses")
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_translated_error_status_with_an_event_stream_body_comes_in_the_api_envelope(
    start_gateway: StartGateway, tmp_path: Path, path: str, stream: bool
) -> None:
    """An engine's 500 whose body is a chat error event: the client gets it in its API's JSON envelope."""
    upstream = ScriptedUpstream(
        [("", {"error": {"message": "engine exploded"}})], b"\n", b"500 Internal Server Error"
    )
    try:
        config = tmp_path / "blazar.toml"
        config.write_text(f'[models.chat]\nupstream = "http://127.0.0.1:{upstream.port}/v1"\n')
        gateway = start_gateway({}, "--config", str(config))
        body = {
            "model": "chat",
            "stream": stream,
            "max_tokens": 4,
            "input": "hi",
            "messages": [{"role": "user", "content": "hi"}],
        }
        with httpx.Client(trust_env=False, timeout=20) as client:
            reply = client.post(gateway.url + path, json=body)
    finally:
        upstream.close()
    assert reply.status_code == 500, reply.text
    assert reply.headers["content-type"].startswith("application/json"), reply.text
    doc = reply.json()
    if path == "/v1/messages":
        assert doc["type"] == "error" and doc["error"]["type"] == "api_error", doc
    assert "engine exploded" in (doc["error"]["message"]), doc


@pytest.mark.fault("upstreams", "a stream without [DONE], or not an event stream")
@pytest.mark.parametrize(
    "trailer", [b"data: [DONE]\n\n", b": ping\n\ndata: [DONE]\n\n"], ids=["done", "ping-done"]
)
@pytest.mark.parametrize("same_read", [False, True], ids=["own-read", "same-read"])
def test_passthrough_stream_ended_then_done_is_not_judged_truncated(
    start_gateway: StartGateway, tmp_path: Path, trailer: bytes, same_read: bool
) -> None:
    """A Responses stream with ``data: [DONE]`` after response.completed (LiteLLM's) ends as sent."""
    upstream = ScriptedUpstream(RESPONSE_EVENTS, b"\n")
    if same_read:
        upstream.events[-1] += trailer
    else:
        upstream.events.append(trailer)
    _assert_passed_through_whole(start_gateway, tmp_path, upstream)


@pytest.mark.fault("upstreams", "a body cut short or malformed mid-way")
@pytest.mark.parametrize("stream", [True, False])
def test_translated_responses_usage_past_64_bits_when_summed_still_answers(
    start_gateway: StartGateway, tmp_path: Path, stream: bool
) -> None:
    """An engine's usage whose prompt and completion counts sum past 2**64: the Response still comes whole."""
    huge = 2**64 - 1
    chunk = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": huge, "completion_tokens": huge},
    }
    upstream = ScriptedUpstream([("", chunk)], b"\n")
    upstream.events.append(b"data: [DONE]\n\n")
    try:
        config = tmp_path / "blazar.toml"
        config.write_text(f'[models.chat]\nupstream = "http://127.0.0.1:{upstream.port}/v1"\n')
        gateway = start_gateway({}, "--config", str(config))
        with httpx.Client(trust_env=False, timeout=20) as client:
            reply = client.post(
                gateway.url + "/v1/responses", json={"model": "chat", "input": "hi", "stream": stream}
            )
    finally:
        upstream.close()
    assert reply.status_code == 200, reply.text
    if stream:
        assert b"event: response.completed\n" in reply.content, reply.content[-300:]
    else:
        assert reply.json()["status"] == "completed", reply.text


@pytest.mark.fault("upstreams", "a stream without [DONE], or not an event stream")
@pytest.mark.parametrize("cuts", [(30_000, 90_000), (10, 70_000)], ids=["mid-event", "in-its-name"])
def test_passthrough_final_event_past_64_kib_split_across_reads_ends_the_stream(
    start_gateway: StartGateway, tmp_path: Path, cuts: tuple[int, int]
) -> None:
    """A response.completed of 100 KB in three reads (past the 64 KiB held back for half an event) ends it."""
    upstream = ScriptedUpstream(RESPONSE_EVENTS[:-1], b"\n")
    text = "x" * 100_000
    final = orjson.dumps({"type": "response.completed", "response": {"status": "completed", "text": text}})
    last = b"event: response.completed\ndata: " + final + b"\n\n"
    first, second = cuts
    upstream.events[-1] += last[:first]
    upstream.events += [last[first:second], last[second:]]
    _assert_passed_through_whole(start_gateway, tmp_path, upstream)


CHAT_EVENTS: Events = [
    ("", {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "raw"}}]}),
]


@pytest.mark.fault("upstreams", "a long prefill, bridged by heartbeats")
@pytest.mark.parametrize(
    ("path", "first", "last"),
    [("/v1/messages", "message_start", "error"), ("/v1/responses", "response.created", "response.failed")],
    ids=["messages", "responses"],
)
def test_a_translated_stream_answered_206_after_heartbeats_ends_with_the_api_error(
    start_gateway: StartGateway, tmp_path: Path, path: str, first: str, last: str
) -> None:
    """A chat event stream under a 2xx other than 200, after the gateway's heartbeats began: the
    client gets its API's first event and error end, never the engine's raw chat events."""
    upstream = ScriptedUpstream(CHAT_EVENTS * 3, b"\n", b"206 Partial Content", head_delay_s=1.0)
    try:
        config = tmp_path / "blazar.toml"
        config.write_text(f'[models.chat]\nupstream = "http://127.0.0.1:{upstream.port}/v1"\n')
        gateway = start_gateway({}, "--config", str(config), "--sse-heartbeat", "0.2")
        body = {
            "model": "chat",
            "stream": True,
            "max_tokens": 4,
            "input": "hi",
            "messages": [{"role": "user", "content": "hi"}],
        }
        with httpx.Client(trust_env=False, timeout=20) as client:
            reply = client.post(gateway.url + path, json=body)
    finally:
        upstream.close()
    assert reply.status_code == 200 and reply.content.startswith(b": keepalive"), reply.content[:200]
    assert b"chat.completion.chunk" not in reply.content, reply.content[-400:]
    names = [
        line.removeprefix(b"event: ").decode()
        for line in reply.content.split(b"\n")
        if line.startswith(b"event: ")
    ]
    assert names[0] == first and names[-1] == last, names


def _assert_passed_through_whole(
    start_gateway: StartGateway, tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    """A Responses stream from ``upstream`` (serving the API itself) reaches the client as it was sent."""
    try:
        config = tmp_path / "blazar.toml"
        config.write_text(
            f'[models.native]\nupstream = "http://127.0.0.1:{upstream.port}/v1"\n'
            'native-apis = ["responses"]\n'
        )
        gateway = start_gateway({}, "--config", str(config))
        with httpx.Client(trust_env=False, timeout=20) as client:
            reply = client.post(
                gateway.url + "/v1/responses", json={"model": "native", "input": "hi", "stream": True}
            )
    finally:
        upstream.close()
    assert reply.status_code == 200, reply.text
    assert reply.content == b"".join(upstream.events), reply.content[-300:]
