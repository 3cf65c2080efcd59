"""Pins the fake engine's wire behaviour, which the gateway's tests and benchmarks rely on."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.fake_engine import TOOL_RESULT_PREFIX, start_fake_engine

REPO_ROOT = Path(__file__).resolve().parent.parent


class Engine:
    """A fake engine child process and what the tests need of it."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.proc = proc
        self.port = port
        self.http = httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            trust_env=False,
            timeout=httpx.Timeout(5.0),
            limits=httpx.Limits(max_connections=4),
        )

    def records(self, tag: str) -> list[dict[str, Any]]:
        """Records of the requests that carried ``x-test: tag``."""
        response = self.http.get("/_fake/requests")
        try:
            response.raise_for_status()
            rows: list[dict[str, Any]] = response.json()
        finally:
            response.close()
        return [r for r in rows if r["headers"].get("x-test") == tag]

    def wait_record(self, tag: str, until: Any, timeout_s: float = 2.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            rows = self.records(tag)
            if rows and until(rows[-1]):
                return rows[-1]
            if time.monotonic() > deadline:
                raise AssertionError(f"no record for {tag} matched in time: {rows}")
            time.sleep(0.01)


def _spawn(*flags: str) -> Iterator[Engine]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_engine", "--port", "0", *flags],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line.startswith("PORT "), f"engine did not start: {line!r}"
    engine = Engine(proc, int(line.split()[1]))
    try:
        yield engine
    finally:
        engine.http.close()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=5)
        finally:
            proc.stdout.close()
        assert code == 0


@pytest.fixture(scope="module")
def mlx() -> Iterator[Engine]:
    yield from _spawn()


@pytest.fixture(scope="module")
def vllm_like() -> Iterator[Engine]:
    yield from _spawn("--http11")


def _tag() -> str:
    return uuid.uuid4().hex[:12]


def _request(
    path: str, body: dict[str, Any] | None, tag: str, *, fake: str = "", length: bool = True
) -> bytes:
    data = orjson.dumps(body) if body is not None else b""
    lines = [f"POST {path} HTTP/1.1", "Host: fake", f"x-test: {tag}"]
    if fake:
        lines.append(f"x-fake: {fake}")
    if length:
        lines.append(f"Content-Length: {len(data)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


def _exchange(port: int, payload: bytes, timeout_s: float = 5.0) -> bytes:
    """Send one request and read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(payload)
        chunks: list[bytes] = []
        while True:
            data = sock.recv(65536)
            if not data:
                return b"".join(chunks)
            chunks.append(data)


def _split(raw: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return lines[0], headers, body


class _Reader:
    """Reads framed HTTP/1.1 responses off one socket, for keep-alive checks."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise AssertionError("connection closed early")
        self.buf += data

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def response(self) -> tuple[str, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        status, headers, _ = _split(head + b"\r\n\r\n")
        if "content-length" in headers:
            return status, headers, self._take(int(headers["content-length"]))
        assert headers.get("transfer-encoding") == "chunked"
        body = b""
        while True:
            size = int(self._line(), 16)
            if size == 0:
                assert self._line() == b""
                return status, headers, body
            body += self._take(size)
            assert self._take(2) == b"\r\n"


CHAT = "/v1/chat/completions"


def test_http10_stream_is_close_delimited_and_ends_with_done(mlx: Engine) -> None:
    """By default a stream is HTTP/1.0 SSE with no length or chunking, ended by [DONE] and the close."""
    tag = _tag()
    body = {"model": "m", "messages": [], "max_tokens": 3, "stream": True}
    status, headers, payload = _split(_exchange(mlx.port, _request(CHAT, body, tag)))
    assert status == "HTTP/1.0 200 OK"
    assert headers["content-type"] == "text/event-stream"
    assert "content-length" not in headers and "transfer-encoding" not in headers
    events = payload.split(b"\n\n")[:-1]
    assert events[-1] == b"data: [DONE]"
    chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["tok0 ", "tok1 ", "tok2 ", None]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert {c["model"] for c in chunks} == {"m"}
    record = mlx.wait_record(tag, lambda r: r["outcome"] == "completed")
    assert record["model"] == "m" and record["events_sent"] == 4


def test_http10_json_has_content_length_and_usage_chunk_shape(mlx: Engine) -> None:
    """A non-stream completion carries Content-Length under HTTP/1.0, and the usage chunk is mlx's."""
    tag = _tag()
    raw = _exchange(mlx.port, _request(CHAT, {"model": "x/y", "messages": [], "max_tokens": 2}, tag))
    status, headers, payload = _split(raw)
    assert status == "HTTP/1.0 200 OK"
    assert int(headers["content-length"]) == len(payload)
    doc = orjson.loads(payload)
    assert doc["object"] == "chat.completion" and doc["model"] == "x/y"
    assert doc["choices"][0]["message"]["content"] == "tok0 tok1 "
    assert doc["usage"]["completion_tokens"] == 2

    body = {"messages": [], "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}}
    _, _, payload = _split(_exchange(mlx.port, _request(CHAT, body, tag)))
    usage = orjson.loads(payload.split(b"\n\n")[-3].removeprefix(b"data: "))
    assert usage["object"] == "chat.completion" and usage["choices"] == []


def test_http11_keeps_alive_and_chunks_streams(vllm_like: Engine) -> None:
    """With --http11 one connection serves several requests and streams are chunked."""
    tag = _tag()
    with socket.create_connection(("127.0.0.1", vllm_like.port), timeout=5) as sock:
        reader = _Reader(sock)
        sock.sendall(_request(CHAT, {"messages": [], "max_tokens": 2}, tag))
        status, headers, payload = reader.response()
        assert status == "HTTP/1.1 200 OK"
        assert int(headers["content-length"]) == len(payload)
        sock.sendall(_request(CHAT, {"messages": [], "max_tokens": 2, "stream": True}, tag))
        status, headers, payload = reader.response()
        assert status == "HTTP/1.1 200 OK" and headers["transfer-encoding"] == "chunked"
        assert payload.endswith(b"data: [DONE]\n\n")
    rows = vllm_like.records(tag)
    assert [r["conn_seq"] for r in rows] == [1, 2]
    assert rows[0]["conn_id"] == rows[1]["conn_id"]

    with httpx.Client(trust_env=False, timeout=5.0) as client:
        url = f"http://127.0.0.1:{vllm_like.port}{CHAT}"
        body = {"messages": [], "max_tokens": 1, "stream": True}
        with client.stream("POST", url, json=body, headers={"x-test": tag}) as response:
            text = b"".join(response.iter_bytes())
        assert response.http_version == "HTTP/1.1"
        assert text.endswith(b"data: [DONE]\n\n")


def test_post_without_content_length_gets_411(mlx: Engine) -> None:
    """A completion POST without Content-Length gets mlx's 411 JSON error."""
    tag = _tag()
    status, _, payload = _split(_exchange(mlx.port, _request(CHAT, None, tag, length=False)))
    assert status == "HTTP/1.0 411 Length Required"
    assert orjson.loads(payload) == {"error": "Content-Length header is required"}


def test_die_after_truncates_stream_without_done(mlx: Engine) -> None:
    """die-after=N ends a stream after N data events with no [DONE]."""
    tag = _tag()
    body = {"messages": [], "max_tokens": 10, "stream": True}
    raw = _exchange(mlx.port, _request(CHAT, body, tag, fake="die-after=3"))
    _, _, payload = _split(raw)
    assert payload.count(b"data: ") == 3
    assert b"[DONE]" not in payload
    record = mlx.wait_record(tag, lambda r: r["outcome"] is not None)
    assert record["outcome"] == "aborted_by_fault" and record["fault"] == "die-after"


def test_empty_reply_and_bad_field_types_give_zero_bytes(mlx: Engine) -> None:
    """The empty fault and an mlx-invalid field both close the socket with 0 bytes written."""
    tag = _tag()
    assert _exchange(mlx.port, _request(CHAT, {"messages": []}, tag, fake="empty")) == b""
    bad = {"messages": [], "temperature": "x"}
    assert _exchange(mlx.port, _request(CHAT, bad, tag)) == b""
    faults = [r["fault"] for r in mlx.records(tag)]
    assert faults == ["empty", "mlx-empty-reply"]


def test_status_fault_is_flat_error_with_retry_after(mlx: Engine) -> None:
    """status=503 answers mlx's flat error body and Retry-After: 7."""
    tag = _tag()
    raw = _exchange(mlx.port, _request(CHAT, {"messages": []}, tag, fake="status=503"))
    status, headers, payload = _split(raw)
    assert status == "HTTP/1.0 503 Service Unavailable"
    assert headers["retry-after"] == "7"
    assert orjson.loads(payload) == {"error": "fake error"}


def test_reset_fault_sends_rst(mlx: Engine) -> None:
    """reset aborts the connection with a TCP RST right after the request is read."""
    tag = _tag()
    with pytest.raises(ConnectionResetError):
        _exchange(mlx.port, _request(CHAT, {"messages": []}, tag, fake="reset"))


def test_peer_close_during_prefill_is_recorded_at_once(mlx: Engine) -> None:
    """A client that hangs up during prefill is seen within 1 s and the response is abandoned."""
    tag = _tag()
    body = {"messages": [], "stream": True}
    sock = socket.create_connection(("127.0.0.1", mlx.port), timeout=5)
    try:
        sock.sendall(_request(CHAT, body, tag, fake="prefill=5"))
        mlx.wait_record(tag, lambda r: True)
    finally:
        closed_at = time.time()
        sock.close()
    record = mlx.wait_record(tag, lambda r: r["outcome"] is not None)
    assert record["outcome"] == "peer_closed"
    assert record["closed_at"] is not None
    assert -0.05 < record["closed_at"] - closed_at < 1.0
    assert record["events_sent"] == 0 and record["status"] is None


def test_in_process_engine_applies_options_and_closes() -> None:
    """start_fake_engine runs in the caller's loop, applies its options, records, and closes."""

    async def scenario() -> None:
        engine = await start_fake_engine(chunk_delay_s=0.001, chunks=3)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", engine.port)
            writer.write(_request(CHAT, {"messages": [], "stream": True}, "inproc"))
            raw = await reader.read()
            writer.close()
            await writer.wait_closed()
        finally:
            await engine.close()
        assert raw.count(b"data: ") == 5  # 3 tokens, the finish chunk, [DONE]
        assert [r.outcome for r in engine.records] == ["completed"]

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def scripted() -> Iterator[Engine]:
    yield from _spawn("--tool-call", 'Bash={"command": "echo hi"}', "--tool-call", 'shell={"cmd": ["ls"]}')


def _events(raw: bytes) -> list[dict[str, Any]]:
    _, _, body = _split(raw)
    return [orjson.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: {")]


_TOOLS = [
    {"type": "function", "function": {"name": "Read", "parameters": {}}},
    {"type": "function", "function": {"name": "shell", "parameters": {}}},
]


def test_scripted_tool_call_is_one_call_of_the_offered_tool(scripted: Engine) -> None:
    """--tool-call answers a request offering that tool with one call of it, its arguments, no text."""
    body = {"messages": [{"role": "user", "content": "go"}], "tools": _TOOLS}
    _, _, raw = _split(_exchange(scripted.port, _request(CHAT, body, _tag())))
    choice = orjson.loads(raw)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "shell", "arguments": '{"cmd":["ls"]}'}

    events = _events(_exchange(scripted.port, _request(CHAT, {**body, "stream": True}, _tag())))
    deltas = [e["choices"][0]["delta"] for e in events]
    assert not any(d.get("content") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert {c["index"] for c in calls} == {0}
    assert calls[0]["function"]["name"] == "shell"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"cmd":["ls"]}'
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_scripted_tool_result_is_echoed_in_the_final_text(scripted: Engine) -> None:
    """A last `tool` message is answered with the prefix and its content (text parts joined), finish stop."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "shell"}}],
        },
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [{"type": "text", "text": "out-"}, {"type": "text", "text": "42"}],
        },
    ]
    body = {"messages": messages, "tools": _TOOLS, "stream": True}
    events = _events(_exchange(scripted.port, _request(CHAT, body, _tag())))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text == TOOL_RESULT_PREFIX + "out-42"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any("tool_calls" in e["choices"][0]["delta"] for e in events)

    messages[-1]["content"] = "plain"
    _, _, raw = _split(_exchange(scripted.port, _request(CHAT, {"messages": messages}, _tag())))
    assert orjson.loads(raw)["choices"][0]["message"]["content"] == TOOL_RESULT_PREFIX + "plain"


def test_scripted_engine_without_the_tool_answers_as_before(scripted: Engine) -> None:
    """A request that offers none of the scripted tools gets the usual generated text."""
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 3, "tools": _TOOLS[:1]}
    _, _, raw = _split(_exchange(scripted.port, _request(CHAT, body, _tag())))
    choice = orjson.loads(raw)["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "tok0 tok1 tok2 "}
    assert choice["finish_reason"] == "length"


def test_scripted_tool_call_flag_rejects_arguments_that_are_not_a_json_object() -> None:
    """--tool-call NAME=JSON refuses a value whose arguments are not a JSON object, before listening."""
    for value in ("Bash", "Bash=[1]", "Bash={oops"):
        result = subprocess.run(
            [sys.executable, "-m", "tests.fake_engine", "--port", "0", "--tool-call", value],
            cwd=REPO_ROOT,
            capture_output=True,
            timeout=30,
        )
        assert result.returncode == 2 and b"--tool-call" in result.stderr, (value, result)
