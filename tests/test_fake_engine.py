"""Pins the fake engine's wire behaviour, which the gateway's tests and benchmarks rely on."""

from __future__ import annotations

import asyncio
import base64
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


def _chat_events(raw: bytes) -> list[dict[str, Any]]:
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

    events = _chat_events(_exchange(scripted.port, _request(CHAT, {**body, "stream": True}, _tag())))
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
    events = _chat_events(_exchange(scripted.port, _request(CHAT, body, _tag())))
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


# -- native APIs (--native-apis): llama-server's /v1/messages and /v1/responses ----

MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
ASK: Any = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def native() -> Iterator[Engine]:
    yield from _spawn("--native-apis", "messages,responses")


@pytest.fixture(scope="module")
def native11() -> Iterator[Engine]:
    yield from _spawn("--native-apis", "messages,responses", "--http11")


def _events(payload: bytes) -> list[tuple[str, dict[str, Any]]]:
    """A native stream's events as (name, data); each must be exactly an event line and a data line."""
    out = []
    for block in payload.split(b"\n\n")[:-1]:
        event, data = block.split(b"\n")
        assert event.startswith(b"event: ") and data.startswith(b"data: "), block
        parsed = orjson.loads(data.removeprefix(b"data: "))
        assert parsed["type"] == event.removeprefix(b"event: ").decode()
        out.append((parsed["type"], parsed))
    assert payload.endswith(b"\n\n")
    return out


def test_native_routes_are_off_by_default(mlx: Engine) -> None:
    """Without --native-apis the Messages and Responses routes are 404, as on mlx_lm.server."""
    tag = _tag()
    for path in (MESSAGES, MESSAGES + "/count_tokens", RESPONSES):
        status, _, payload = _split(_exchange(mlx.port, _request(path, {"messages": ASK}, tag)))
        assert status == "HTTP/1.0 404 Not Found" and payload == b"Not Found"


def test_native_messages_stream_is_llama_servers(native: Engine) -> None:
    """A Messages stream is llama-server's event sequence, message_stop last, no [DONE]; query ignored."""
    tag = _tag()
    body = {"model": "m", "max_tokens": 3, "messages": ASK, "stream": True}
    status, headers, payload = _split(_exchange(native.port, _request(MESSAGES + "?beta=true", body, tag)))
    assert status == "HTTP/1.0 200 OK" and headers["content-type"] == "text/event-stream"
    events = _events(payload)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 3,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert b"[DONE]" not in payload
    assert events[0][1]["message"]["model"] == "m"
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == "tok0 tok1 tok2 "
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2][1]["usage"]["output_tokens"] == 3
    record = native.wait_record(tag, lambda r: r["outcome"] == "completed")
    assert record["model"] == "m" and record["stream"] is True and record["path"] == MESSAGES + "?beta=true"
    assert base64.b64decode(record["planned_b64"]) == payload


def test_native_messages_with_tool_calls_and_thinking(native: Engine) -> None:
    """tool-calls and reasoning give thinking, text and tool_use blocks, stop_reason tool_use, both ways."""
    tag = _tag()
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    body = {"model": "m", "max_tokens": 2, "messages": ASK, "tools": tools}
    fake = "tool-calls=2; reasoning=1"
    _, _, payload = _split(_exchange(native.port, _request(MESSAGES, body, tag, fake=fake)))
    message = orjson.loads(payload)
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert (
        message["content"][2]["name"] == "get_weather" and message["content"][2]["input"]["city"] == "Paris"
    )
    assert message["stop_reason"] == "tool_use" and message["usage"]["output_tokens"] > 2

    _, _, payload = _split(
        _exchange(native.port, _request(MESSAGES, {**body, "stream": True}, tag, fake=fake))
    )
    events = _events(payload)
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use", "tool_use"]
    partial = [
        d["delta"]["partial_json"] for n, d in events if d.get("delta", {}).get("type") == "input_json_delta"
    ]
    assert orjson.loads("".join(partial[:3])) == message["content"][2]["input"]
    assert [d["index"] for n, d in events if n == "content_block_stop"] == [0, 1, 2, 3]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_native_count_tokens_grows_with_the_prompt(native: Engine) -> None:
    """count_tokens answers {"input_tokens": N}, N positive and larger for a longer prompt."""
    tag = _tag()
    counts = []
    for text in ("hi", "hi " * 200):
        body = {"model": "m", "messages": [{"role": "user", "content": text}]}
        status, _, payload = _split(_exchange(native.port, _request(MESSAGES + "/count_tokens", body, tag)))
        assert status == "HTTP/1.0 200 OK"
        doc = orjson.loads(payload)
        assert list(doc) == ["input_tokens"]
        counts.append(doc["input_tokens"])
    assert 0 < counts[0] < counts[1]


def test_native_responses_stream_ends_with_completed(native: Engine) -> None:
    """A Responses stream runs response.created .. response.completed, numbered, no [DONE]."""
    tag = _tag()
    tools = [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]
    body = {"model": "m", "max_output_tokens": 2, "input": "hi", "stream": True, "tools": tools}
    _, _, payload = _split(_exchange(native.port, _request(RESPONSES, body, tag, fake="tool-calls=1")))
    events = _events(payload)
    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.completed" and b"[DONE]" not in payload
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert "".join(d["delta"] for n, d in events if n == "response.output_text.delta") == "tok0 tok1 "
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["model"] == "m"
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    call = final["output"][1]
    args = "".join(d["delta"] for n, d in events if n == "response.function_call_arguments.delta")
    assert call["name"] == "shell" and args == call["arguments"]

    _, _, payload = _split(_exchange(native.port, _request(RESPONSES, {**body, "stream": False}, tag)))
    response = orjson.loads(payload)
    assert response["object"] == "response" and response["output"][0]["content"][0]["text"] == "tok0 tok1 "
    assert response["usage"]["output_tokens"] == 2


@pytest.mark.parametrize("path", [MESSAGES, RESPONSES])
def test_native_die_after_and_no_done_cut_before_the_last_event(native: Engine, path: str) -> None:
    """die-after=N sends N events and closes; no-done sends every event but the API's last one."""
    tag = _tag()
    body = {
        "model": "m",
        "max_tokens": 3,
        "max_output_tokens": 3,
        "messages": ASK,
        "input": "hi",
        "stream": True,
    }
    _, _, whole = _split(_exchange(native.port, _request(path, body, tag)))
    last = _events(whole)[-1][0]
    assert last in ("message_stop", "response.completed")

    _, _, payload = _split(_exchange(native.port, _request(path, body, tag, fake="die-after=3")))
    assert len(_events(payload)) == 3
    record = native.wait_record(tag, lambda r: r["fault"] == "die-after")
    assert record["outcome"] == "aborted_by_fault"
    planned = base64.b64decode(record["planned_b64"])
    assert planned.startswith(payload) and _events(planned)[-1][0] == last

    _, _, payload = _split(_exchange(native.port, _request(path, body, tag, fake="no-done")))
    names = [name for name, _ in _events(payload)]
    assert names == [name for name, _ in _events(whole)][:-1] and last not in names
    assert native.wait_record(tag, lambda r: r["fault"] == "no-done")["events_sent"] == len(names)


def test_native_status_fault_is_llama_servers_error(native: Engine) -> None:
    """status=N on a native route answers llama-server's nested error body, not mlx's flat one."""
    tag = _tag()
    body = {"model": "m", "messages": ASK, "stream": True}
    status, headers, payload = _split(
        _exchange(native.port, _request(MESSAGES, body, tag, fake="status=429"))
    )
    assert status == "HTTP/1.0 429 Too Many Requests" and headers["retry-after"] == "7"
    assert orjson.loads(payload) == {
        "error": {"code": 429, "message": "fake error", "type": "invalid_request_error"}
    }
    status, _, payload = _split(_exchange(native.port, _request(RESPONSES, {"model": "m"}, tag)))
    assert status == "HTTP/1.0 400 Bad Request" and orjson.loads(payload)["error"]["code"] == 400


def test_native_http11_chunks_and_keeps_alive_also_without_the_last_event(native11: Engine) -> None:
    """With --http11 native streams are chunked on a kept connection, no-done ends with the 0 chunk."""
    tag = _tag()
    body = {"model": "m", "max_tokens": 2, "messages": ASK, "stream": True}
    with socket.create_connection(("127.0.0.1", native11.port), timeout=5) as sock:
        reader = _Reader(sock)
        sock.sendall(_request(MESSAGES, body, tag))
        status, headers, payload = reader.response()
        assert status == "HTTP/1.1 200 OK" and headers["transfer-encoding"] == "chunked"
        assert _events(payload)[-1][0] == "message_stop"
        sock.sendall(_request(MESSAGES, body, tag, fake="no-done"))
        _, _, payload = reader.response()
        assert _events(payload)[-1][0] == "message_delta"
        sock.sendall(_request(MESSAGES + "/count_tokens", body, tag))
        _, headers, payload = reader.response()
        assert int(headers["content-length"]) == len(payload) and orjson.loads(payload)["input_tokens"] > 0
    assert len({r["conn_id"] for r in native11.records(tag)}) == 1


def test_native_stall_holds_the_stream_after_its_first_event(native: Engine) -> None:
    """stall=S sends the first event, then nothing for S seconds, then the rest."""
    tag = _tag()
    body = {"model": "m", "max_output_tokens": 2, "input": "hi", "stream": True}
    with socket.create_connection(("127.0.0.1", native.port), timeout=5) as sock:
        sock.sendall(_request(RESPONSES, body, tag, fake="stall=0.5"))
        received = b""
        while b"response.created" not in received:
            received += sock.recv(65536)
        native.wait_record(tag, lambda r: r["events_sent"] == 1)
        assert b"response.in_progress" not in received
        while data := sock.recv(65536):
            received += data
    assert _events(_split(received)[2])[-1][0] == "response.completed"


def test_native_shapes_satisfy_the_sdks_stream_helpers(native: Engine) -> None:
    """The anthropic and openai SDKs' strict stream helpers accept the fake's native streams whole."""
    import anthropic
    import openai

    base = f"http://127.0.0.1:{native.port}"
    claude_http = anthropic.DefaultHttpxClient(trust_env=False, timeout=5.0)
    openai_http = openai.DefaultHttpxClient(trust_env=False, timeout=5.0)
    try:
        claude = anthropic.Anthropic(base_url=base, api_key="k", max_retries=0, http_client=claude_http)
        headers = {"x-fake": "tool-calls=1"}
        tools: Any = [{"name": "get_weather", "input_schema": {"type": "object"}}]
        with claude.messages.stream(
            model="m",
            max_tokens=3,
            messages=ASK,
            tools=tools,
            extra_headers=headers,
        ) as stream:
            text = "".join(stream.text_stream)
            message = stream.get_final_message()
        assert text == "tok0 tok1 tok2 " and message.stop_reason == "tool_use"
        assert message.content[-1].type == "tool_use" and message.content[-1].input["city"] == "Paris"
        count = claude.messages.count_tokens(model="m", messages=ASK)
        assert count.input_tokens > 0

        oai = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, http_client=openai_http)
        functions: Any = [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]
        with oai.responses.stream(
            model="m", input="hi", max_output_tokens=2, tools=functions, extra_headers=headers
        ) as rstream:
            deltas = [e.delta for e in rstream if e.type == "response.output_text.delta"]
            response = rstream.get_final_response()
        assert "".join(deltas) == "tok0 tok1 " == response.output_text
        assert response.output[-1].type == "function_call" and response.output[-1].name == "shell"
    finally:
        claude_http.close()
        openai_http.close()


def test_stop_ends_the_turn_instead_of_at_max_tokens(native: Engine) -> None:
    """x-fake stop gives finish_reason stop on chat and stop_reason end_turn on Messages."""
    tag = _tag()
    _, _, payload = _split(
        _exchange(native.port, _request(CHAT, {"messages": ASK, "max_tokens": 2}, tag, fake="stop"))
    )
    assert orjson.loads(payload)["choices"][0]["finish_reason"] == "stop"
    body = {"model": "m", "max_tokens": 2, "messages": ASK, "stream": True}
    _, _, payload = _split(_exchange(native.port, _request(MESSAGES, body, tag, fake="stop")))
    assert _events(payload)[-2][1]["delta"]["stop_reason"] == "end_turn"
    _, _, payload = _split(_exchange(native.port, _request(MESSAGES, body, tag)))
    assert _events(payload)[-2][1]["delta"]["stop_reason"] == "max_tokens"
