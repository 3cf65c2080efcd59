"""A fake LLM engine that speaks mlx_lm.server 0.32.0's wire protocol.

Why it exists: the gateway's end-to-end tests need an upstream that misbehaves
on demand (slow prefill, stalls, truncated streams, resets, garbage, odd
statuses) and that tells afterwards exactly what it received and when the
gateway hung up; the benchmarks need an upstream so cheap that what they
measure is the gateway, not the engine. A real mlx child is neither, so this is
a real HTTP server on a raw ``asyncio.Protocol`` with a minimal HTTP/1.x parser
and no framework in the way.

By default it answers like ``mlx_lm.server`` 0.32.0 (``BaseHTTPRequestHandler``,
HTTP/1.0): every response closes the connection, streams are close-delimited
SSE, JSON completions carry Content-Length but errors, ``/health`` and
``/v1/models`` do not, bad field types get an empty reply (0 bytes), a POST
without Content-Length gets 411. ``--http11`` models a vLLM-like server
instead: HTTP/1.1, keep-alive, Content-Length on every body, chunked streams.

Misbehaviour is set server-wide with CLI flags (they apply to the generation
routes only, so readiness probes keep working) and per request with an
``x-fake`` header that overrides them on any route::

    x-fake: prefill=2.0; keepalive=0.5; chunk-delay=0.004; die-after=3

Keys: prefill, keepalive, chunk-delay, stall (seconds); die-after, status,
chunks, chunk-bytes (integers); garbage, reset, empty, mid-event (with
die-after: end on half an event), bad-chunk (chunked streams: a malformed
chunk after the first event): flags, where a bare key means true; head
(a response head that breaks the rules: endless, header lines without end;
huge, one 70 KB header line; te-twice, ``Transfer-Encoding: chunked,
chunked``; cl-te, Content-Length and Transfer-Encoding both; te-gzip,
``Transfer-Encoding: gzip, chunked`` over a gzipped JSON body); gzip (a
stream sent with ``Content-Encoding: gzip``, one gzip member flushed at
each event; with die-after, cut there without the gzip trailer); no-done (a
stream that ends cleanly, its last chunk or its close, without ``[DONE]``);
after-done (a stream whose ``[DONE]`` is followed by half an event, ``: after``
with no blank line after it); sse-length (a stream sent unchunked with the
Content-Length of all its events and ``[DONE]``, kept alive: with die-after,
cut short of that length);
not-sse (a stream request answered with a JSON body); reasoning=N (chat:
N pieces of reasoning before the text, ``reasoning`` in the message or the
deltas, as mlx sends it); stop (the answer ends its turn: finish_reason
``stop``, ``end_turn`` natively, instead of ``length`` at max_tokens);
tool-calls=N (chat: N tool calls after the text, named after the
request's tools in turn, finish_reason ``tool_calls``; a stream sends each
the way OpenAI and vLLM do: a first delta with its index, id, type and
name, then its arguments in three pieces). An unknown key
gets a 400 so that a typo in a test cannot pass silently.

A scripted tool round trip, for agent clients that cannot send x-fake (set
server-wide only)::

    --tool-call 'Bash={"command": "echo hi"}' [--tool-call 'exec_command=...']

A chat request whose tools include a function named by a ``--tool-call``
(the first that matches) is answered with exactly one call of it with those
arguments and no text (finish_reason ``tool_calls``); a chat request whose
last message is a ``tool`` message is answered, whatever its tools, with the
text ``TOOL_RESULT_PREFIX`` followed by that message's content (text parts
joined), finish_reason ``stop``. A client that ran the tool and sent its
output back thus prints that output after the prefix. Streams send the call
as ``tool-calls=N`` does and the text in a few pieces.

Native APIs, off by default: ``--native-apis messages,responses`` adds the
routes llama-server (and vLLM) serve themselves: ``POST /v1/messages`` and
``/v1/messages/count_tokens`` (Anthropic Messages) and ``POST /v1/responses``
(OpenAI Responses), with or without ``/v1`` and whatever the query string.
Their shapes come from llama.cpp's tools/server: the Message and its stream
from server-task.cpp ``to_json_anthropic`` / ``to_json_anthropic_stream``
(``message_start``, ``content_block_start``, ``content_block_delta``, every
``content_block_stop`` at the end, ``message_delta``, ``message_stop``),
count_tokens' ``{"input_tokens": N}`` from server-context.cpp, the Response
and its stream from ``to_json_oaicompat_resp`` / ``_resp_stream``
(``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``, the
``*.done`` events, ``response.completed``) with the spec's ``output_index``,
``content_index`` and ``sequence_number`` that llama-server leaves out and
vLLM sends; the framing ``event: NAME`` + ``data: JSON`` + blank line from
server-common.cpp ``format_anthropic_sse`` / ``format_oai_resp_sse``, and no
``[DONE]`` after the last event. Each of their records holds the whole
reply as built (``planned_b64``), so that a test can compare what a gateway
passed on. Errors there have llama-server's shape,
``{"error": {"code", "message", "type"}}``. HTTP framing is this server's
(HTTP/1.0 close-delimited, or ``--http11`` chunked as llama-server sends).
The faults apply as on chat: die-after counts events, no-done ends the stream
without its API's last event (``message_stop``, ``response.completed``),
after-done puts half an event after it, status=N answers llama-server's
error, tool-calls=N and reasoning=N give tool_use / function_call and
thinking / reasoning items, named after the request's tools.

Observability: every request (but the admin routes) is recorded; ``GET
/_fake/requests[?since=ID]`` returns the records as JSON and ``POST
/_fake/reset`` clears them and heals a broken engine.

Run it as ``python -m tests.fake_engine [--host H] [--port 0] [--http11] ...``:
it prints one line ``PORT <n>`` once listening and serves until SIGTERM or
SIGINT. In process: ``engine = await start_fake_engine(port=0, prefill_s=1.0)``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import dataclasses
import functools
import gzip
import html
import http
import importlib
import itertools
import json
import random
import signal
import socket
import struct
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any, cast

import orjson

# mlx_lm.server is BaseHTTPRequestHandler under whatever Python runs it; we copy
# the header byte for byte so that a client tuned on one is tuned on the other.
SERVER_HEADER = "BaseHTTP/0.6 Python/" + sys.version.split()[0]
SYSTEM_FINGERPRINT = "0.32.0-0.32.2-fake"

# Copied from http.server (3.11) rather than imported: importing http.server
# drags in socketserver, mimetypes and email for one format string.
_ERROR_PAGE = (
    "<!DOCTYPE HTML>\n"
    '<html lang="en">\n'
    "    <head>\n"
    '        <meta charset="utf-8">\n'
    "        <title>Error response</title>\n"
    "    </head>\n"
    "    <body>\n"
    "        <h1>Error response</h1>\n"
    "        <p>Error code: %(code)d</p>\n"
    "        <p>Message: %(message)s.</p>\n"
    "        <p>Error code explanation: %(code)s - %(explain)s.</p>\n"
    "    </body>\n"
    "</html>\n"
)
_ERROR_CONTENT_TYPE = "text/html;charset=utf-8"

_CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
_TEXT_PATH = "/v1/completions"
_EMBEDDINGS_PATH = "/v1/embeddings"
_ADMIN_PREFIX = "/_fake/"
# Native APIs (--native-apis): route -> the API that serves it. Matched without
# the query string (Claude Code posts /v1/messages?beta=true).
NATIVE_APIS = ("messages", "responses")
_NATIVE_ROUTES: dict[str, tuple[str, str]] = {
    "/v1/messages": ("messages", "messages"),
    "/messages": ("messages", "messages"),
    "/v1/messages/count_tokens": ("messages", "count_tokens"),
    "/messages/count_tokens": ("messages", "count_tokens"),
    "/v1/responses": ("responses", "responses"),
    "/responses": ("responses", "responses"),
}

# Limits that keep a hostile or broken client from growing the process.
_MAX_HEAD_BYTES = 65536
_MAX_HEADERS = 100
_MAX_BODY_BYTES = 128 * 1024 * 1024
_MAX_PIPELINED_BYTES = 4 * 1024 * 1024

_GARBAGE = b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03GARBAGE\xff\xfe\x00not http at all\r\n\r\n"
_DONE_EVENT = b"data: [DONE]\n\n"
# Half an event after [DONE] (after-done): a comment line with no blank line to end it.
_AFTER_DONE = b": after"
_CONTENT_SENTINEL = "@@fake-content@@"
# The final text of a scripted tool round trip: this, then the tool's output.
TOOL_RESULT_PREFIX = "fake engine read the tool result: "

OUTCOME_COMPLETED = "completed"
OUTCOME_PEER_CLOSED = "peer_closed"
OUTCOME_ABORTED = "aborted_by_fault"

_REASONS: dict[int, tuple[str, str]] = {s.value: (s.phrase, s.description) for s in http.HTTPStatus}


@dataclasses.dataclass(slots=True)
class FakeOptions:
    """Misbehaviour knobs; server-wide defaults, overridden per request by x-fake."""

    prefill_s: float = 0.0
    keepalive_s: float = 0.0
    chunk_delay_s: float = 0.0
    stall_s: float = 0.0
    die_after: int | None = None
    # With die-after: the last thing written is half of the next event.
    mid_event: bool = False
    # The first event written in two halves, this many seconds apart.
    split_first_s: float = 0.0
    # Chunked (--http11) streams: an invalid chunk-size line after the first event.
    bad_chunk: bool = False
    garbage: bool = False
    reset: bool = False
    empty: bool = False
    status: int | None = None
    chunks: int | None = None
    chunk_bytes: int | None = None
    head: str | None = None
    no_done: bool = False
    after_done: bool = False
    sse_length: bool = False
    not_sse: bool = False
    gzip: bool = False
    reasoning: int = 0
    tool_calls: int = 0
    stop: bool = False

    def is_plain(self) -> bool:
        """True when nothing asks for a delay or a fault: the cheap path applies."""
        return not (
            self.prefill_s > 0
            or self.stall_s > 0
            or self.split_first_s > 0
            or self.chunk_delay_s > 0
            or self.die_after is not None
            or self.bad_chunk
            or self.garbage
            or self.reset
            or self.empty
            or self.status is not None
            or self.head is not None
            or self.no_done
            or self.after_done
            or self.sse_length
            or self.not_sse
            or self.gzip
        )


# x-fake key -> (FakeOptions field, parser). One table feeds both the header and
# the CLI so the two can never drift apart.
def _parse_flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("", "1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a flag value: {text!r}")


def _parse_seconds(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"seconds must be finite and >= 0: {text!r}")
    return value


def _parse_count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"count must be >= 0: {text!r}")
    return value


def _parse_status(text: str) -> int:
    value = int(text)
    if not 100 <= value <= 999:
        raise ValueError(f"status must be 100..999: {text!r}")
    return value


_BAD_HEADS = ("endless", "huge", "te-twice", "cl-te", "te-gzip")


def _parse_bad_head(text: str) -> str:
    value = text.strip()
    if value not in _BAD_HEADS:
        raise ValueError(f"head must be one of {', '.join(_BAD_HEADS)}: {text!r}")
    return value


_CONTROLS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "prefill": ("prefill_s", _parse_seconds),
    "keepalive": ("keepalive_s", _parse_seconds),
    "chunk-delay": ("chunk_delay_s", _parse_seconds),
    "stall": ("stall_s", _parse_seconds),
    "die-after": ("die_after", _parse_count),
    "mid-event": ("mid_event", _parse_flag),
    "split-first": ("split_first_s", _parse_seconds),
    "bad-chunk": ("bad_chunk", _parse_flag),
    "garbage": ("garbage", _parse_flag),
    "reset": ("reset", _parse_flag),
    "empty": ("empty", _parse_flag),
    "status": ("status", _parse_status),
    "chunks": ("chunks", _parse_count),
    "chunk-bytes": ("chunk_bytes", _parse_count),
    "head": ("head", _parse_bad_head),
    "no-done": ("no_done", _parse_flag),
    "after-done": ("after_done", _parse_flag),
    "sse-length": ("sse_length", _parse_flag),
    "not-sse": ("not_sse", _parse_flag),
    "gzip": ("gzip", _parse_flag),
    "reasoning": ("reasoning", _parse_count),
    "tool-calls": ("tool_calls", _parse_count),
    "stop": ("stop", _parse_flag),
}


def parse_fake_header(value: str, base: FakeOptions) -> FakeOptions:
    """Return ``base`` overridden by an ``x-fake`` header; ValueError on a bad item."""
    changes: dict[str, Any] = {}
    for item in value.split(";"):
        item = item.strip()
        if not item:
            continue
        key, sep, raw = item.partition("=")
        key = key.strip().lower()
        control = _CONTROLS.get(key)
        if control is None:
            raise ValueError(f"x-fake: unknown key {key!r}")
        field_name, parse = control
        if not sep and parse is not _parse_flag:
            raise ValueError(f"x-fake: {key} needs a value")
        try:
            changes[field_name] = parse(raw)
        except ValueError as exc:
            raise ValueError(f"x-fake: {key}: {exc}") from None
    return dataclasses.replace(base, **changes) if changes else base


@dataclasses.dataclass(slots=True)
class RequestRecord:
    """What the engine saw of one request and how it ended (times are time.time())."""

    id: int
    conn_id: int
    conn_seq: int
    method: str
    path: str
    version: str
    headers: dict[str, str]
    body: bytes
    model: str | None
    stream: bool | None
    received_at: float
    status: int | None = None
    fault: str | None = None
    error: str | None = None
    events_sent: int = 0
    finished_at: float | None = None
    closed_at: float | None = None
    outcome: str | None = None
    # Native routes: the whole reply body as built, before any fault cuts it,
    # so that a test can check that a gateway passed the bytes on untouched.
    planned: bytes | None = None

    def to_json(self) -> dict[str, Any]:
        """Shape for GET /_fake/requests; the body goes both as text and base64."""
        return {
            "id": self.id,
            "conn_id": self.conn_id,
            "conn_seq": self.conn_seq,
            "method": self.method,
            "path": self.path,
            "version": self.version,
            "headers": self.headers,
            "body": self.body.decode("utf-8", "replace"),
            "body_b64": base64.b64encode(self.body).decode("ascii"),
            "body_len": len(self.body),
            "model": self.model,
            "stream": self.stream,
            "status": self.status,
            "fault": self.fault,
            "error": self.error,
            "events_sent": self.events_sent,
            "received_at": self.received_at,
            "finished_at": self.finished_at,
            "closed_at": self.closed_at,
            "outcome": self.outcome,
            "planned_b64": None if self.planned is None else base64.b64encode(self.planned).decode("ascii"),
        }


@dataclasses.dataclass(slots=True)
class _Request:
    method: str
    path: str
    version: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


@dataclasses.dataclass(slots=True)
class _Reply:
    """A response still to be written; exactly one of body/events/empty applies."""

    status: int
    reason: str
    header_lines: list[str]
    body: bytes | None = None
    # Whether HTTP/1.0 mode sends Content-Length: mlx does only for completions.
    length_in_http10: bool = False
    events: list[bytes] | None = None
    # mlx raises after the last chunk when stream_options lacks include_usage.
    cut_before_done: bool = False
    empty: bool = False
    head_only: bool = False
    close_after: bool = False
    fault: str | None = None
    error: str | None = None
    # What ends a stream: chat's [DONE], or a native API's own last event
    # (message_stop, response.completed); no-done leaves it out.
    final: bytes = _DONE_EVENT
    # A native API's reply: faults answer in llama-server's error shape.
    native: bool = False


def _json_headers() -> list[str]:
    return [
        "Content-type: application/json",
        "Access-Control-Allow-Origin: *",
        "Access-Control-Allow-Methods: *",
        "Access-Control-Allow-Headers: *",
    ]


def _stream_headers() -> list[str]:
    return [
        "Content-type: text/event-stream",
        "Cache-Control: no-cache",
        "Access-Control-Allow-Origin: *",
        "Access-Control-Allow-Methods: *",
        "Access-Control-Allow-Headers: *",
    ]


def _json_reply(status: int, payload: Any, *, with_length: bool = False) -> _Reply:
    return _Reply(
        status=status,
        reason=_REASONS.get(status, ("", ""))[0],
        header_lines=_json_headers(),
        body=orjson.dumps(payload),
        length_in_http10=with_length,
    )


def _mlx_error_reply(status: int, payload: dict[str, str]) -> _Reply:
    """mlx's error bodies: json.dumps spacing, no Content-Length under HTTP/1.0."""
    reply = _json_reply(status, None)
    reply.body = json.dumps(payload).encode()
    return reply


def _error_page_reply(status: int, message: str, *, head_only: bool = False) -> _Reply:
    """BaseHTTPRequestHandler.send_error: HTML page, Connection: close."""
    explain = _REASONS.get(status, ("???", "???"))[1]
    page = _ERROR_PAGE % {
        "code": status,
        "message": html.escape(message, quote=False),
        "explain": html.escape(explain, quote=False),
    }
    return _Reply(
        status=status,
        reason=message,
        header_lines=["Connection: close", "Content-Type: " + _ERROR_CONTENT_TYPE],
        body=page.encode("utf-8", "replace"),
        length_in_http10=True,
        head_only=head_only,
        close_after=True,
    )


def _empty_reply(fault: str, error: str | None = None) -> _Reply:
    return _Reply(status=0, reason="", header_lines=[], empty=True, fault=fault, error=error)


# APIHandler.validate_model_parameters (server.py 0.32.0 l.1227-1255), in its
# order: body key -> (name in mlx's message, allowed types, min, max). Defaults
# of absent fields are valid by construction, so only present keys are checked.
_FIELD_RULES: dict[str, tuple[str, type | tuple[type, ...], float | None, float | None]] = {
    "temperature": ("temperature", (float, int), 0, None),
    "top_p": ("top_p", (float, int), 0, 1),
    "top_k": ("top_k", int, 0, None),
    "min_p": ("min_p", (float, int), 0, 1),
    "num_draft_tokens": ("num_draft_tokens", int, 0, None),
    "repetition_penalty": ("repetition_penalty", (float, int), 0, None),
    "repetition_context_size": ("repetition_context_size", int, 0, None),
    "presence_penalty": ("presence_penalty", (float, int), None, None),
    "presence_context_size": ("presence_context_size", int, 0, None),
    "frequency_penalty": ("frequency_penalty", (float, int), None, None),
    "frequency_context_size": ("frequency_context_size", int, 0, None),
    "logprobs": ("logprobs", bool, None, None),
    "top_logprobs": ("top_logprobs", int, 0, 11),
    "xtc_probability": ("xtc_probability", float, 0, 1),
    "xtc_threshold": ("xtc_threshold", float, 0, 1),
    "model": ("requested_model", str, None, None),
    "adapters": ("adapter", str, None, None),
    "seed": ("seed", int, None, None),
    "logit_bias": ("logit_bias", dict, None, None),
}
_FIELD_ORDER = {key: index for index, key in enumerate(_FIELD_RULES)}
# mlx skips these when null (optional=True); the rest are checked even as null.
_NULLABLE_FIELDS = frozenset({"adapters", "seed", "logit_bias"})


def _type_error(name: str, allowed: type | tuple[type, ...]) -> str:
    names = tuple(t.__name__ for t in allowed) if isinstance(allowed, tuple) else allowed.__name__
    return f"{name} must be of type {names}"


def _mlx_validation_error(body: dict[str, Any], max_tokens: Any) -> str | None:
    """The ValueError text mlx would raise for this body, or None.

    mlx lets that error escape its handler, so the client sees the socket
    close with 0 bytes written.
    """
    if not isinstance(body.get("stream", False), bool):
        return _type_error("stream", bool)
    if not isinstance(max_tokens, int):
        return _type_error("max_tokens", int)
    if max_tokens < 0:
        return "max_tokens must be at least 0"
    present = body.keys() & _FIELD_RULES.keys()
    if not present:
        return None
    try:
        for key in sorted(present, key=_FIELD_ORDER.__getitem__):
            value = body[key]
            if value is None and key in _NULLABLE_FIELDS:
                continue
            name, allowed, min_val, max_val = _FIELD_RULES[key]
            # A bare bool, not an if-condition: mypy would narrow value to object.
            allowed_type = isinstance(value, allowed)
            if not allowed_type:
                return _type_error(name, allowed)
            if key == "top_logprobs" and value == -1:
                continue
            if min_val is not None and value < min_val:
                return f"{name} must be at least {min_val}"
            if max_val is not None and value > max_val:
                return f"{name} must be at most {max_val}"
            if key == "logit_bias":
                for bias_key, bias in value.items():
                    int(bias_key)
                    float(bias)
    except (TypeError, ValueError) as exc:
        return f"{exc}"
    return None


@functools.lru_cache(maxsize=64)
def _pieces(count: int, chunk_bytes: int | None) -> tuple[str, ...]:
    """Deterministic generated text: token i is 'tok{i} ' (padded to chunk_bytes)."""
    pieces = []
    for i in range(count):
        word = f"tok{i}"
        if chunk_bytes is not None and chunk_bytes > len(word) + 1:
            word += "x" * (chunk_bytes - len(word) - 1)
        pieces.append(word + " ")
    return tuple(pieces)


@functools.lru_cache(maxsize=64)
def _encoded_pieces(count: int, chunk_bytes: int | None) -> tuple[bytes, ...]:
    """The pieces as JSON strings, ready to splice into a chunk template."""
    return tuple(orjson.dumps(p) for p in _pieces(count, chunk_bytes))


@functools.lru_cache(maxsize=64)
def _full_text(count: int, chunk_bytes: int | None) -> str:
    return "".join(_pieces(count, chunk_bytes))


def _completion_id(prefix: str) -> str:
    """uuid4-shaped like mlx's ids, without uuid.UUID's cost on the hot path."""
    h = f"{random.getrandbits(128):032x}"
    return f"{prefix}{h[:8]}-{h[8:12]}-4{h[13:16]}-{h[16:20]}-{h[20:]}"


_WEEKDAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


class _DateCache:
    """RFC 7231 Date header, formatted once a second instead of per response."""

    __slots__ = ("_second", "_text")

    def __init__(self) -> None:
        self._second = -1
        self._text = ""

    def get(self) -> str:
        second = int(time.time())
        if second != self._second:
            # Fixed English names: strftime's %a/%b follow the locale.
            t = time.gmtime(second)
            self._second = second
            self._text = (
                f"{_WEEKDAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} "
                f"{t.tm_year} {t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT"
            )
        return self._text


class FakeEngine:
    """The server object: configuration, records, and the listening socket."""

    def __init__(
        self,
        *,
        http11: bool = False,
        embeddings: bool = False,
        default_max_tokens: int = 16,
        model_id: str = "fake-model",
        max_records: int = 10000,
        broken: bool = False,
        hang_after: int | None = None,
        options: FakeOptions | None = None,
        native_apis: frozenset[str] = frozenset(),
        tool_script: tuple[ScriptedCall, ...] = (),
    ) -> None:
        self.http11 = http11
        self.native_apis = native_apis
        self.tool_script = tool_script
        self.hang_after = hang_after
        self.generations = 0
        self.embeddings = embeddings
        self.default_max_tokens = default_max_tokens
        self.model_id = model_id
        self.broken = broken
        self.options = options or FakeOptions()
        self.records: collections.deque[RequestRecord] = collections.deque(maxlen=max_records)
        self.port = 0
        self._record_ids = itertools.count(1)
        self._conn_ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self._dates = _DateCache()
        self._status_version = "HTTP/1.1" if http11 else "HTTP/1.0"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Listen; afterwards ``.port`` holds the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, backlog=4096, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and drop every open connection at once."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def records_json(self, since_id: int = 0) -> list[dict[str, Any]]:
        """Records newer than ``since_id`` in the /_fake/requests shape."""
        return [r.to_json() for r in self.records if r.id > since_id]

    # -- response building -------------------------------------------------

    def build_reply(self, req: _Request, rec: RequestRecord, opts: FakeOptions) -> _Reply:
        """The response mlx_lm.server 0.32.0 would give (server.py l.1099-1201)."""
        method = req.method
        if method == "POST":
            return self._reply_post(req, rec, opts)
        if method == "GET":
            return self._reply_get(req)
        if method == "OPTIONS":
            return _Reply(status=204, reason="No Content", header_lines=_json_headers(), body=b"")
        return _error_page_reply(501, f"Unsupported method ({method!r})", head_only=(method == "HEAD"))

    def _reply_get(self, req: _Request) -> _Reply:
        if req.path.startswith("/v1/models"):
            models = [{"id": self.model_id, "object": "model", "created": int(time.time())}]
            return _json_reply(200, {"object": "list", "data": models})
        if req.path == "/health":
            if self.broken:
                return _mlx_error_reply(503, {"status": "unavailable"})
            return _Reply(
                status=200,
                reason="OK",
                header_lines=_json_headers(),
                body=b'{"status": "ok"}',
            )
        return _not_found_reply()

    def native_route(self, path: str) -> str | None:
        """ "messages", "count_tokens" or "responses" where that API is served natively, else None."""
        if not self.native_apis:
            return None
        api, route = _NATIVE_ROUTES.get(path.partition("?")[0], ("", ""))
        return route if api in self.native_apis else None

    def _reply_post(self, req: _Request, rec: RequestRecord, opts: FakeOptions) -> _Reply:
        path = req.path
        native = self.native_route(path)
        if native is not None:
            return self._reply_native(native, req, rec, opts)
        is_chat = path in _CHAT_PATHS
        is_embeddings = self.embeddings and path == _EMBEDDINGS_PATH
        if not (is_chat or is_embeddings or path == _TEXT_PATH):
            return _not_found_reply()
        if "content-length" not in req.headers:
            return _mlx_error_reply(411, {"error": "Content-Length header is required"})
        parsed = _load_json(req.body)
        if isinstance(parsed, _JsonError):
            if parsed.message is None:
                return _empty_reply("mlx-empty-reply", "request body is not UTF-8")
            return _mlx_error_reply(400, {"error": f"Invalid JSON in request body: {parsed.message}"})
        if not isinstance(parsed, dict):
            return _mlx_error_reply(400, {"error": "Request should be a JSON dictionary"})
        body: dict[str, Any] = parsed
        raw_model = body.get("model")
        rec.model = raw_model if isinstance(raw_model, str) else None
        raw_stream = body.get("stream")
        rec.stream = raw_stream if isinstance(raw_stream, bool) else None
        if is_embeddings:
            return self._reply_embeddings(body)
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens", self.default_max_tokens)
        problem = _mlx_validation_error(body, max_tokens)
        if problem is None and "messages" not in body and is_chat:
            problem = "Request did not contain messages"
        if problem is None and "prompt" not in body and not is_chat:
            problem = "Request did not contain a prompt"
        if problem is not None:
            return _empty_reply("mlx-empty-reply", problem)
        if max_tokens == 0:
            # mlx 0.32.0: max_tokens 0 kills its generation thread for good.
            self.broken = True
        if self.broken:
            return _mlx_error_reply(404, {"error": "generation thread died"})
        count = opts.chunks if opts.chunks is not None else int(max_tokens)
        model = body.get("model", "default_model")
        # From the prompt alone, as an engine counts: a request sent as a stream counts the same.
        prompt = body.get("messages") if is_chat else body.get("prompt")
        prompt_tokens = max(1, len(orjson.dumps(prompt)) // 8)
        extras = _Extras.of(body, opts, self.tool_script) if is_chat else _Extras()
        if extras.text is not None:
            count = len(extras.text)
        if body.get("stream", False):
            return self._reply_stream(body, is_chat, model, count, prompt_tokens, opts, extras)
        return self._reply_complete(is_chat, model, count, prompt_tokens, opts, extras)

    def _reply_complete(
        self,
        is_chat: bool,
        model: str,
        count: int,
        prompt_tokens: int,
        opts: FakeOptions,
        extras: _Extras,
    ) -> _Reply:
        text = _full_text(count, opts.chunk_bytes) if extras.text is None else "".join(extras.text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": extras.finish_reason}
        if is_chat:
            message: dict[str, Any] = {"role": "assistant", "content": text or None}
            if extras.reasoning:
                message["reasoning"] = "".join(extras.reasoning)
            if extras.calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in extras.calls
                ]
            choice["message"] = message
        else:
            choice["text"] = text
        payload = {
            "id": _completion_id("chatcmpl-" if is_chat else "cmpl-"),
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "object": "chat.completion" if is_chat else "text_completion",
            "model": model,
            "created": int(time.time()),
            "choices": [choice],
            "usage": _usage(prompt_tokens, count + extras.tokens),
        }
        return _json_reply(200, payload, with_length=True)

    def _reply_stream(
        self,
        body: dict[str, Any],
        is_chat: bool,
        model: str,
        count: int,
        prompt_tokens: int,
        opts: FakeOptions,
        extras: _Extras,
    ) -> _Reply:
        request_id = _completion_id("chatcmpl-" if is_chat else "cmpl-")
        created = int(time.time())
        object_type = "chat.completion.chunk" if is_chat else "text_completion"

        def chunk(content: str | None, finish_reason: str | None, **delta: Any) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
            if is_chat:
                choice["delta"] = {"role": "assistant"}
                if content:
                    choice["delta"]["content"] = content
                choice["delta"].update(delta)
            else:
                choice["text"] = content or ""
            return {
                "id": request_id,
                "system_fingerprint": SYSTEM_FINGERPRINT,
                "object": object_type,
                "model": model,
                "created": created,
                "choices": [choice],
            }

        # Serialise the token chunk once and splice each piece in: the
        # benchmark path pays one small dumps per token instead of a dict.
        template = orjson.dumps(chunk(_CONTENT_SENTINEL, None))
        before, _, after = template.partition(orjson.dumps(_CONTENT_SENTINEL))
        before = b"data: " + before
        after += b"\n\n"
        events = [
            b"data: " + orjson.dumps(chunk(None, None, reasoning=r)) + b"\n\n" for r in extras.reasoning
        ]
        pieces = (
            _encoded_pieces(count, opts.chunk_bytes)
            if extras.text is None
            else [orjson.dumps(p) for p in extras.text if p]
        )
        events += [before + p + after for p in pieces]
        for index, call in enumerate(extras.calls):
            first = {"index": index, "id": call.id, "type": "function"}
            first["function"] = {"name": call.name, "arguments": ""}
            deltas = [first] + [{"index": index, "function": {"arguments": a}} for a in call.pieces()]
            events += [b"data: " + orjson.dumps(chunk(None, None, tool_calls=[d])) + b"\n\n" for d in deltas]
        events.append(b"data: " + orjson.dumps(chunk(None, extras.finish_reason)) + b"\n\n")
        cut = False
        stream_options = body.get("stream_options")
        if stream_options is not None:
            try:
                include_usage = stream_options["include_usage"]
            except (KeyError, TypeError, IndexError):
                cut = True
            else:
                if include_usage:
                    usage_chunk = {
                        "id": request_id,
                        "system_fingerprint": SYSTEM_FINGERPRINT,
                        "object": "chat.completion",
                        "model": model,
                        "created": created,
                        "choices": [],
                        "usage": _usage(prompt_tokens, count + extras.tokens),
                    }
                    events.append(b"data: " + orjson.dumps(usage_chunk) + b"\n\n")
        reply = _Reply(status=200, reason="OK", header_lines=_stream_headers(), events=events)
        if cut:
            reply.cut_before_done = True
            reply.fault = "mlx-stream-options"
            reply.error = "stream_options without include_usage"
        return reply

    def _reply_embeddings(self, body: dict[str, Any]) -> _Reply:
        raw_input = body.get("input", "")
        inputs = raw_input if isinstance(raw_input, list) else [raw_input]
        data = [
            {"object": "embedding", "index": i, "embedding": [0.125, -0.25, 0.5, 1.0]}
            for i in range(len(inputs))
        ]
        tokens = max(1, sum(len(str(x)) for x in inputs) // 4)
        payload = {
            "object": "list",
            "data": data,
            "model": body.get("model", self.model_id),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return _json_reply(200, payload, with_length=True)

    # -- native APIs (llama-server's /v1/messages and /v1/responses) -----------

    def _reply_native(self, route: str, req: _Request, rec: RequestRecord, opts: FakeOptions) -> _Reply:
        """What llama-server answers on its Anthropic and Responses routes (see _native_reply)."""
        parsed = _load_json(req.body)
        if isinstance(parsed, _JsonError) or not isinstance(parsed, dict):
            return _llama_error_reply(400, "Invalid JSON in request body")
        body: dict[str, Any] = parsed
        raw_model = body.get("model")
        rec.model = raw_model if isinstance(raw_model, str) else None
        raw_stream = body.get("stream")
        rec.stream = raw_stream if isinstance(raw_stream, bool) else None
        if route == "responses":
            prompt: Any = [body.get("instructions"), body.get("input"), body.get("tools")]
            if "input" not in body:
                return _llama_error_reply(400, '"input" is required')
            max_tokens = body.get("max_output_tokens", self.default_max_tokens)
        else:
            prompt = [body.get("system"), body.get("messages"), body.get("tools")]
            if not isinstance(body.get("messages"), list):
                return _llama_error_reply(400, '"messages" must be an array')
            max_tokens = body.get("max_tokens", self.default_max_tokens)
        prompt_tokens = max(1, len(orjson.dumps(prompt)) // 8)
        if route == "count_tokens":
            reply = _native_json(200, {"input_tokens": prompt_tokens})
            rec.planned = reply.body
            return reply
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            return _llama_error_reply(400, "max_tokens must be a non-negative integer")
        count = opts.chunks if opts.chunks is not None else max_tokens
        model = raw_model if isinstance(raw_model, str) else self.model_id
        answer = _NativeAnswer(
            model=model,
            pieces=_pieces(count, opts.chunk_bytes),
            extras=_Extras.of(body, opts),
            prompt_tokens=prompt_tokens,
        )
        stream = body.get("stream") is True
        if route == "responses":
            reply = (
                _native_stream(answer.responses_events()) if stream else _native_json(200, answer.response())
            )
        else:
            reply = (
                _native_stream(answer.messages_events()) if stream else _native_json(200, answer.message())
            )
        rec.planned = reply.body if reply.events is None else b"".join(reply.events) + reply.final
        return reply

    # -- wire ----------------------------------------------------------------

    def head_bytes(self, reply: _Reply, length: int | None, chunked: bool, close: bool) -> bytes:
        """Status line and headers in BaseHTTPRequestHandler's order."""
        parts = [
            f"{self._status_version} {reply.status} {reply.reason}\r\n"
            f"Server: {SERVER_HEADER}\r\nDate: {self._dates.get()}\r\n"
        ]
        parts.extend(line + "\r\n" for line in reply.header_lines)
        if length is not None:
            parts.append(f"Content-Length: {length}\r\n")
        if chunked:
            parts.append("Transfer-Encoding: chunked\r\n")
        if close and self.http11 and not reply.close_after:
            parts.append("Connection: close\r\n")
        parts.append("\r\n")
        return "".join(parts).encode("latin-1")

    def admin_reply(self, req: _Request) -> _Reply:
        """/_fake/requests and /_fake/reset: always framed with Content-Length."""
        path, _, query = req.path.partition("?")
        if req.method == "GET" and path == "/_fake/requests":
            since_id = 0
            for pair in query.split("&"):
                key, _, value = pair.partition("=")
                if key == "since" and value.isdigit():
                    since_id = int(value)
            return _json_reply(200, self.records_json(since_id), with_length=True)
        if req.method == "POST" and path == "/_fake/reset":
            cleared = len(self.records)
            self.records.clear()
            self.broken = False
            return _json_reply(200, {"cleared": cleared}, with_length=True)
        return _json_reply(404, {"error": f"no admin route {req.method} {path}"}, with_length=True)

    def new_record(self, conn_id: int, conn_seq: int, req: _Request, *, parse_body: bool) -> RequestRecord:
        """Create and keep the record of a fully read request.

        Generation routes fill in model/stream when they parse the body, so the
        hot path parses it once.
        """
        model: str | None = None
        stream: bool | None = None
        if parse_body and req.body[:1] == b"{":
            try:
                parsed = orjson.loads(req.body)
            except orjson.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                raw_model = parsed.get("model")
                model = raw_model if isinstance(raw_model, str) else None
                raw_stream = parsed.get("stream")
                stream = raw_stream if isinstance(raw_stream, bool) else None
        rec = RequestRecord(
            id=next(self._record_ids),
            conn_id=conn_id,
            conn_seq=conn_seq,
            method=req.method,
            path=req.path,
            version=req.version,
            headers=req.headers,
            body=req.body,
            model=model,
            stream=stream,
            received_at=time.time(),
        )
        self.records.append(rec)
        return rec

    def next_conn_id(self) -> int:
        return next(self._conn_ids)

    def track(self, conn: _Connection, alive: bool) -> None:
        if alive:
            self._connections.add(conn)
        else:
            self._connections.discard(conn)

    def is_generation_route(self, req: _Request) -> bool:
        """Routes that server-wide misbehaviour applies to (not probes or 404s)."""
        if req.method != "POST":
            return False
        path = req.path
        return (
            path in _CHAT_PATHS
            or path == _TEXT_PATH
            or (self.embeddings and path == _EMBEDDINGS_PATH)
            or self.native_route(path) is not None
        )


@dataclasses.dataclass(frozen=True, slots=True)
class _ToolCall:
    id: str
    name: str
    arguments: str

    def pieces(self) -> list[str]:
        """The arguments in three pieces, as a stream sends them."""
        third = max(1, len(self.arguments) // 3)
        return [self.arguments[:third], self.arguments[third : 2 * third], self.arguments[2 * third :]]


@dataclasses.dataclass(frozen=True, slots=True)
class ScriptedCall:
    """One tool the engine calls when a request offers it (``--tool-call NAME=JSON``)."""

    name: str
    arguments: str

    @classmethod
    def parse(cls, text: str) -> ScriptedCall:
        """``NAME=JSON``: the tool's name and its arguments, a JSON object."""
        name, sep, arguments = text.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"expected NAME=JSON, got {text!r}")
        try:
            parsed = json.loads(arguments)
        except ValueError as exc:
            raise ValueError(f"the arguments of {name!r} are not JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"the arguments of {name!r} must be a JSON object")
        return cls(name.strip(), orjson.dumps(parsed).decode())


def _tool_names(body: dict[str, Any]) -> list[str]:
    tools = body.get("tools")
    return [
        name
        for t in (tools if isinstance(tools, list) else [])
        if isinstance(t, dict)
        # Chat nests the name in "function"; Anthropic and Responses tools carry it flat.
        and isinstance(fn := t.get("function", t), dict)
        and isinstance(name := fn.get("name"), str)
    ]


def _tool_result(body: dict[str, Any]) -> str | None:
    """The content of the last message when it is a ``tool`` message, its text parts joined."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "tool":
        return None
    content = last.get("content")
    if isinstance(content, list):
        return "".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return content if isinstance(content, str) else json.dumps(content)


@dataclasses.dataclass(frozen=True, slots=True)
class _Extras:
    """What a chat reply carries besides its text: reasoning before it, tool calls after it.

    ``text`` replaces the generated ``tok{i}`` pieces when set (a scripted reply).
    """

    reasoning: tuple[str, ...] = ()
    calls: tuple[_ToolCall, ...] = ()
    # The answer ends its turn (an end-of-sequence token) rather than at max_tokens.
    stop: bool = False
    text: tuple[str, ...] | None = None

    @classmethod
    def of(cls, body: dict[str, Any], opts: FakeOptions, script: tuple[ScriptedCall, ...] = ()) -> _Extras:
        if script:
            scripted = cls._scripted(body, script)
            if scripted is not None:
                return scripted
        if not (opts.reasoning or opts.tool_calls or opts.stop):
            return cls()
        names = _tool_names(body) or ["tool"]
        calls = tuple(
            _ToolCall(
                f"call_{i}",
                names[i % len(names)],
                orjson.dumps({"call": i, "city": "Paris", "unit": "celsius"}).decode(),
            )
            for i in range(opts.tool_calls)
        )
        return cls(tuple(f"think{i} " for i in range(opts.reasoning)), calls, opts.stop)

    @classmethod
    def _scripted(cls, body: dict[str, Any], script: tuple[ScriptedCall, ...]) -> _Extras | None:
        result = _tool_result(body)
        if result is not None:
            text = TOOL_RESULT_PREFIX + result
            third = max(1, len(text) // 3)
            return cls(text=(text[:third], text[third : 2 * third], text[2 * third :]))
        offered = set(_tool_names(body))
        for call in script:
            if call.name in offered:
                return cls(calls=(_ToolCall(_completion_id("call_"), call.name, call.arguments),), text=())
        return None

    @property
    def finish_reason(self) -> str:
        if self.calls:
            return "tool_calls"
        return "stop" if self.stop or self.text is not None else "length"

    @property
    def tokens(self) -> int:
        return len(self.reasoning) + 8 * len(self.calls)


def _llama_error_reply(status: int, message: str) -> _Reply:
    """llama-server's error body (format_error_response), on its native routes too."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    reply = _native_json(status, {"error": {"code": status, "message": message, "type": kind}})
    reply.native = True
    return reply


def _native_json(status: int, payload: Any) -> _Reply:
    reply = _json_reply(status, payload, with_length=True)
    reply.native = True
    return reply


def _native_stream(events: list[bytes]) -> _Reply:
    """A native stream: its last event ends it (no [DONE] after it, as llama-server sends none)."""
    reply = _Reply(status=200, reason="OK", header_lines=_stream_headers(), events=events[:-1])
    reply.final = events[-1]
    reply.native = True
    return reply


def _sse(name: str, data: dict[str, Any]) -> bytes:
    """format_anthropic_sse / format_oai_resp_sse: an event line, a data line, a blank line."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


@dataclasses.dataclass(frozen=True, slots=True)
class _NativeAnswer:
    """One generated answer (reasoning, text pieces, tool calls) in the two native APIs' shapes.

    Event names, their order and framing follow llama-server (tools/server/server-task.cpp,
    to_json_anthropic*/to_json_oaicompat_resp*; server-common.cpp format_*_sse): Anthropic
    ``message_start``, ``content_block_start``/``_delta``, every ``content_block_stop`` at the
    end, ``message_delta``, ``message_stop``; Responses ``response.created``,
    ``response.in_progress``, items added, deltas, ``*.done``, ``response.completed``. Where
    llama-server leaves out fields of OpenAI's Responses spec (``output_index``,
    ``content_index``, ``sequence_number``, the response object in ``response.created``), the
    fake adds them as vLLM sends them: the SDKs' stream helpers need them.
    """

    model: str
    pieces: tuple[str, ...]
    extras: _Extras
    prompt_tokens: int

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def output_tokens(self) -> int:
        return len(self.pieces) + self.extras.tokens

    @property
    def stop_reason(self) -> str:
        return "tool_use" if self.extras.calls else "end_turn" if self.extras.stop else "max_tokens"

    def message(self) -> dict[str, Any]:
        """The non-stream Anthropic Message (to_json_anthropic)."""
        content: list[dict[str, Any]] = []
        if self.extras.reasoning:
            content.append({"type": "thinking", "thinking": "".join(self.extras.reasoning), "signature": ""})
        if self.pieces:
            content.append({"type": "text", "text": self.text})
        content += [
            {"type": "tool_use", "id": c.id, "name": c.name, "input": orjson.loads(c.arguments)}
            for c in self.extras.calls
        ]
        return {
            "id": _completion_id("msg_"),
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": self.model,
            "stop_reason": self.stop_reason,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": self.output_tokens},
        }

    def messages_events(self) -> list[bytes]:
        """The Anthropic stream (to_json_anthropic partial and final), message_stop last."""
        message = {**self.message(), "content": [], "stop_reason": None}
        message["usage"] = {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        events = [_sse("message_start", {"type": "message_start", "message": message})]
        index = 0

        def block(kind: dict[str, Any], deltas: list[dict[str, Any]]) -> None:
            events.append(
                _sse(
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": kind},
                )
            )
            events.extend(
                _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})
                for d in deltas
            )

        if self.extras.reasoning:
            thinking = [{"type": "thinking_delta", "thinking": r} for r in self.extras.reasoning]
            block(
                {"type": "thinking", "thinking": ""},
                [*thinking, {"type": "signature_delta", "signature": ""}],
            )
            index += 1
        if self.pieces:
            block({"type": "text", "text": ""}, [{"type": "text_delta", "text": p} for p in self.pieces])
            index += 1
        for call in self.extras.calls:
            kind = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            block(kind, [{"type": "input_json_delta", "partial_json": a} for a in call.pieces()])
            index += 1
        events += [
            _sse("content_block_stop", {"type": "content_block_stop", "index": i}) for i in range(index)
        ]
        delta = {"stop_reason": self.stop_reason, "stop_sequence": None}
        usage = {"output_tokens": self.output_tokens}
        events.append(_sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
        events.append(_sse("message_stop", {"type": "message_stop"}))
        return events

    def _output(self, message_id: str) -> list[dict[str, Any]]:
        output: list[dict[str, Any]] = []
        if self.extras.reasoning:
            summary: list[Any] = []
            text = "".join(self.extras.reasoning)
            output.append(
                {
                    "id": "rs_" + message_id[4:],
                    "type": "reasoning",
                    "summary": summary,
                    "content": [{"type": "reasoning_text", "text": text}],
                    "encrypted_content": "",
                    "status": "completed",
                }
            )
        if self.pieces:
            part = {"type": "output_text", "annotations": [], "logprobs": [], "text": self.text}
            output.append(
                {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [part],
                }
            )
        output += [
            {
                "id": "fc_" + c.id,
                "type": "function_call",
                "status": "completed",
                "arguments": c.arguments,
                "call_id": c.id,
                "name": c.name,
            }
            for c in self.extras.calls
        ]
        return output

    def response(self, response_id: str | None = None, message_id: str | None = None) -> dict[str, Any]:
        """The non-stream Responses object (to_json_oaicompat_resp)."""
        now = int(time.time())
        return {
            "id": response_id or _completion_id("resp_"),
            "object": "response",
            "created_at": now,
            "completed_at": now,
            "status": "completed",
            "model": self.model,
            "output": self._output(message_id or _completion_id("msg_")),
            "usage": {
                "input_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens,
                "total_tokens": self.prompt_tokens + self.output_tokens,
            },
        }

    def responses_events(self) -> list[bytes]:
        """The Responses stream (to_json_oaicompat_resp partial and final), response.completed last."""
        response_id, message_id = _completion_id("resp_"), _completion_id("msg_")
        final = self.response(response_id, message_id)
        items = final["output"]
        started = {
            **final,
            "status": "in_progress",
            "output": [],
            "usage": None,
            "completed_at": None,
        }
        payloads: list[dict[str, Any]] = [
            {"type": "response.created", "response": started},
            {"type": "response.in_progress", "response": started},
        ]
        for index, item in enumerate(items):
            added = {**item, "status": "in_progress"}
            if item["type"] == "message":
                added["content"] = []
            elif item["type"] == "function_call":
                added["arguments"] = ""
            elif item["type"] == "reasoning":
                added["content"] = []
            payloads.append({"type": "response.output_item.added", "output_index": index, "item": added})
            at = {"item_id": item["id"], "output_index": index}
            if item["type"] == "reasoning":
                payloads += [
                    {"type": "response.reasoning_text.delta", **at, "content_index": 0, "delta": r}
                    for r in self.extras.reasoning
                ]
            elif item["type"] == "message":
                part = item["content"][0]
                empty = {**part, "text": ""}
                payloads.append(
                    {"type": "response.content_part.added", **at, "content_index": 0, "part": empty}
                )
                payloads += [
                    {
                        "type": "response.output_text.delta",
                        **at,
                        "content_index": 0,
                        "delta": p,
                        "logprobs": [],
                    }
                    for p in self.pieces
                ]
                payloads.append(
                    {
                        "type": "response.output_text.done",
                        **at,
                        "content_index": 0,
                        "text": self.text,
                        "logprobs": [],
                    }
                )
                payloads.append(
                    {"type": "response.content_part.done", **at, "content_index": 0, "part": part}
                )
            else:
                call = self.extras.calls[index - len(items) + len(self.extras.calls)]
                payloads += [
                    {"type": "response.function_call_arguments.delta", **at, "delta": a}
                    for a in call.pieces()
                ]
                payloads.append(
                    {"type": "response.function_call_arguments.done", **at, "arguments": call.arguments}
                )
            payloads.append({"type": "response.output_item.done", "output_index": index, "item": item})
        payloads.append({"type": "response.completed", "response": final})
        return [_sse(p["type"], {**p, "sequence_number": n}) for n, p in enumerate(payloads)]


def _not_found_reply() -> _Reply:
    return _Reply(status=404, reason="Not Found", header_lines=_json_headers(), body=b"Not Found")


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


class _JsonError:
    """A body that did not parse; message None means it was not even UTF-8."""

    __slots__ = ("message",)

    def __init__(self, message: str | None) -> None:
        self.message = message


def _load_json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    # Slow path only for bodies orjson refuses: the stdlib gives mlx's exact
    # error text, and accepts what mlx accepts (NaN, Infinity).
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return _JsonError(None)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        return _JsonError(str(exc))


class _ParseError(Exception):
    def __init__(self, reply: _Reply | None) -> None:
        super().__init__("bad request head")
        self.reply = reply


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    """Request line and headers; raises _ParseError with the reply to send."""
    text = head.decode("latin-1")
    lines = text.split("\r\n") if "\r\n" in text else text.split("\n")
    words = lines[0].split()
    if not words:
        raise _ParseError(None)
    version = "HTTP/0.9"
    if len(words) >= 3:
        version = words[-1]
        numbers = version[5:].split(".") if version.startswith("HTTP/") else []
        if len(numbers) != 2 or not all(n.isdigit() and len(n) <= 10 for n in numbers):
            raise _ParseError(_error_page_reply(400, f"Bad request version ({version!r})"))
        if int(numbers[0]) >= 2:
            raise _ParseError(_error_page_reply(505, f"Invalid HTTP version ({version[5:]})"))
    if len(words) != 3:
        raise _ParseError(_error_page_reply(400, f"Bad request syntax ({lines[0]!r})"))
    method, path = words[0], words[1]
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    headers: dict[str, str] = {}
    if len(lines) - 1 > _MAX_HEADERS:
        raise _ParseError(_error_page_reply(431, "Too many headers"))
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name[0] in " \t":
            continue
        key = name.strip().lower()
        value = value.strip()
        headers[key] = headers[key] + ", " + value if key in headers else value
    return method, path, version, headers


class _Connection(asyncio.Protocol):
    """One client connection: parse, answer, misbehave, and notice the peer leaving."""

    def __init__(self, engine: FakeEngine) -> None:
        self._engine = engine
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._busy = False
        self._closed_by_us = False
        self._peer_gone = False
        self._task: asyncio.Task[None] | None = None
        self._current: RequestRecord | None = None
        self._conn_id = 0
        self._conn_seq = 0
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        self._conn_id = self._engine.next_conn_id()
        self._engine.track(self, True)

    def data_received(self, data: bytes) -> None:
        if self._closed_by_us:
            return
        self._buf += data
        if self._busy:
            if len(self._buf) > _MAX_PIPELINED_BYTES:
                self._close()
            return
        self._process_buffer()

    def eof_received(self) -> bool:
        # A half-close counts as leaving: mlx cannot tell the two apart either
        # once it next writes, and the tests want the earliest signal.
        self._on_peer_gone()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_peer_gone()
        self._engine.track(self, False)
        self._wake_writer()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writer()

    # -- lifecycle -------------------------------------------------------------

    def abort(self) -> None:
        """Drop the connection now (engine shutdown)."""
        self._closed_by_us = True
        if self._task is not None:
            self._task.cancel()
        if self._transport is not None:
            self._transport.abort()

    def _close(self) -> None:
        self._closed_by_us = True
        if self._transport is not None:
            self._transport.close()

    def _on_peer_gone(self) -> None:
        if self._closed_by_us or self._peer_gone:
            return
        self._peer_gone = True
        now = time.time()
        rec = self._current
        if rec is not None:
            rec.closed_at = now
            if rec.outcome is None:
                rec.outcome = OUTCOME_PEER_CLOSED
                rec.finished_at = now
        if self._task is not None:
            self._task.cancel()

    def _wake_writer(self) -> None:
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _drain(self) -> None:
        if self._write_paused and not self._peer_gone:
            self._drain_waiter = asyncio.get_running_loop().create_future()
            await self._drain_waiter
            self._drain_waiter = None

    # -- parsing -----------------------------------------------------------------

    def _process_buffer(self) -> None:
        while self._buf and not self._busy and not self._closed_by_us:
            req = self._take_request()
            if req is None:
                return
            self._dispatch(req)

    def _take_request(self) -> _Request | None:
        buf = self._buf
        end = buf.find(b"\r\n\r\n")
        sep_len = 4
        if end < 0:
            end = buf.find(b"\n\n")
            sep_len = 2
        if end < 0:
            if len(buf) > _MAX_HEAD_BYTES:
                self._send_and_close(_error_page_reply(431, "Line too long"))
            return None
        try:
            method, path, version, headers = _parse_head(bytes(buf[:end]))
        except _ParseError as exc:
            if exc.reply is None:
                self._close()
            else:
                self._send_and_close(exc.reply)
            return None
        body_start = end + sep_len
        length_text = headers.get("content-length")
        length = 0
        if length_text is not None:
            try:
                length = int(length_text)
                if length < 0:
                    raise ValueError
            except ValueError:
                reply = _mlx_error_reply(400, {"error": "Invalid Content-Length header"})
                self._send_and_close(reply)
                return None
            if length > _MAX_BODY_BYTES:
                self._close()
                return None
        if len(buf) - body_start < length:
            return None
        body = bytes(buf[body_start : body_start + length])
        del buf[: body_start + length]
        keep_alive = self._engine.http11 and _wants_keep_alive(version, headers)
        if "transfer-encoding" in headers:
            # We never parse chunked request bodies; whatever follows is not a
            # request, so this one must be the last on the connection.
            keep_alive = False
            buf.clear()
        return _Request(method, path, version, headers, body, keep_alive)

    def _send_and_close(self, reply: _Reply) -> None:
        if self._transport is None or self._closed_by_us:
            return
        body = b"" if reply.body is None else reply.body
        head = self._engine.head_bytes(reply, len(body), False, True)
        self._transport.write(head if reply.head_only else head + body)
        self._close()

    # -- dispatch --------------------------------------------------------------

    def _dispatch(self, req: _Request) -> None:
        engine = self._engine
        if req.path.startswith(_ADMIN_PREFIX):
            self._write_simple(engine.admin_reply(req), req, None)
            return
        self._conn_seq += 1
        generation = engine.is_generation_route(req)
        rec = engine.new_record(self._conn_id, self._conn_seq, req, parse_body=not generation)
        self._current = rec
        opts = engine.options if generation else _NO_FAULTS
        if generation and engine.hang_after is not None:
            engine.generations += 1
            if engine.generations > engine.hang_after:
                # Generation hangs for good while /health stays 200.
                opts = dataclasses.replace(opts, prefill_s=_HANG_S)
        header = req.headers.get("x-fake")
        if header is not None:
            try:
                opts = parse_fake_header(header, opts)
            except ValueError as exc:
                reply = _mlx_error_reply(400, {"error": str(exc)})
                reply.fault = "bad-x-fake"
                self._write_simple(reply, req, rec)
                return
        if opts.reset:
            self._reset(rec)
            return
        reply = engine.build_reply(req, rec, opts)
        if opts.is_plain() and not reply.empty:
            self._write_simple(reply, req, rec)
            return
        self._busy = True
        self._task = asyncio.get_running_loop().create_task(self._serve_slow(req, rec, reply, opts))

    def _reset(self, rec: RequestRecord) -> None:
        rec.fault = "reset"
        rec.outcome = OUTCOME_ABORTED
        rec.finished_at = time.time()
        transport = self._transport
        self._closed_by_us = True
        if transport is None:
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()

    def _framing(self, req: _Request, reply: _Reply) -> tuple[bool, bool]:
        """(chunked, close) for this reply on this connection."""
        close = not req.keep_alive or reply.close_after
        chunked = reply.events is not None and self._engine.http11 and req.version == "HTTP/1.1"
        if reply.events is not None and not chunked:
            close = True
        return chunked, close

    def _head_for(self, req: _Request, reply: _Reply) -> tuple[bytes, bool, bool]:
        chunked, close = self._framing(req, reply)
        length: int | None = None
        if reply.body is not None and reply.status != 204 and (self._engine.http11 or reply.length_in_http10):
            length = len(reply.body)
        return self._engine.head_bytes(reply, length, chunked, close), chunked, close

    def _write_simple(self, reply: _Reply, req: _Request, rec: RequestRecord | None) -> None:
        """Cheap path: the whole response in one write, no task, no timers."""
        transport = self._transport
        if transport is None or self._closed_by_us:
            return
        head, chunked, close = self._head_for(req, reply)
        if reply.events is not None:
            parts = [head]
            if chunked:
                parts.extend([_frame(ev) for ev in reply.events])
                if not reply.cut_before_done:
                    parts.append(_frame(reply.final))
                    parts.append(b"0\r\n\r\n")
            else:
                parts.extend(reply.events)
                if not reply.cut_before_done:
                    parts.append(reply.final)
            transport.write(b"".join(parts))
            if rec is not None:
                rec.events_sent = len(reply.events)
            close = close or reply.cut_before_done
        elif reply.body is not None and not reply.head_only:
            transport.write(head + reply.body)
        else:
            transport.write(head)
        if rec is not None:
            rec.status = reply.status
            rec.fault = reply.fault
            rec.error = reply.error
            rec.outcome = OUTCOME_ABORTED if reply.cut_before_done else OUTCOME_COMPLETED
            rec.finished_at = time.time()
        if close:
            self._close()

    async def _serve_slow(self, req: _Request, rec: RequestRecord, reply: _Reply, opts: FakeOptions) -> None:
        try:
            await self._play(req, rec, reply, opts)
        except asyncio.CancelledError:
            # Our own cancel: the peer left (recorded already) or shutdown.
            return
        except Exception as exc:  # never let one request take the server down
            rec.error = f"fake engine bug: {exc!r}"
            rec.outcome = rec.outcome or OUTCOME_ABORTED
            self._close()
            return
        finally:
            self._task = None
        self._busy = False
        if not self._closed_by_us and not self._peer_gone:
            self._process_buffer()

    async def _play(self, req: _Request, rec: RequestRecord, reply: _Reply, opts: FakeOptions) -> None:
        transport = self._transport
        assert transport is not None
        if opts.status is not None and not reply.empty:
            if reply.native:
                reply = _llama_error_reply(opts.status, "fake error")
            else:
                reply = _mlx_error_reply(opts.status, {"error": "fake error"})
            reply.fault = "status"
            if opts.status in (429, 503):
                reply.header_lines.append("Retry-After: 7")
        head, chunked, close = self._head_for(req, reply)
        if opts.sse_length and reply.events is not None:
            # The whole stream's length up front, unchunked, and the connection kept.
            chunked, close = False, not req.keep_alive or reply.close_after
            length = sum(map(len, reply.events)) + len(reply.final)
            head = self._engine.head_bytes(reply, length, chunked, close)
        head_sent = False
        # mlx rejects bad fields before any generation work, so no prefill.
        if opts.prefill_s > 0 and not (reply.empty and reply.fault == "mlx-empty-reply"):
            if reply.events is not None and opts.keepalive_s > 0 and not (opts.garbage or opts.empty):
                # mlx sends the 200 head before prefill, then one comment per
                # prompt-progress callback.
                transport.write(head)
                head_sent = True
                await self._keepalive_during(opts.prefill_s, opts.keepalive_s, chunked)
            else:
                await asyncio.sleep(opts.prefill_s)
        if opts.empty or reply.empty:
            rec.fault = reply.fault if reply.empty else "empty"
            rec.error = reply.error
            self._finish(rec, OUTCOME_ABORTED, status=None)
            self._close()
            return
        if opts.not_sse and reply.events is not None:
            rec.fault = "not-sse"
            body = b'{"object": "chat.completion", "choices": []}'
            transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
                + body
            )
            self._finish(rec, OUTCOME_ABORTED, status=200)
            self._close()
            return
        if opts.gzip and reply.events is not None:
            rec.fault = "gzip"
            await self._play_gzip(rec, reply, opts)
            return
        if opts.head is not None:
            rec.fault = f"head-{opts.head}"
            await self._bad_head(opts.head)
            self._finish(rec, OUTCOME_ABORTED, status=None)
            self._close()
            return
        if opts.garbage:
            transport.write(_GARBAGE)
            rec.fault = "garbage"
            self._finish(rec, OUTCOME_ABORTED, status=None)
            self._close()
            return
        rec.status = reply.status
        rec.fault = reply.fault
        rec.error = reply.error
        # split-first: the head goes out in one write with half of the first event.
        lead = head if not head_sent and opts.split_first_s > 0 and reply.events is not None else b""
        if not head_sent and not lead:
            transport.write(head)
        if reply.events is not None:
            await self._play_events(rec, reply, opts, chunked, lead)
            if self._closed_by_us:
                return
        else:
            body = b"" if reply.body is None or reply.head_only else reply.body
            if opts.stall_s > 0:
                await asyncio.sleep(opts.stall_s)
            if opts.die_after is not None and body:
                transport.write(body[: len(body) // 2])
                rec.fault = "die-after"
                self._finish(rec, OUTCOME_ABORTED, status=reply.status)
                self._close()
                return
            if body:
                transport.write(body)
        self._finish(rec, OUTCOME_COMPLETED, status=reply.status)
        if close:
            self._close()

    async def _bad_head(self, kind: str) -> None:
        """A 200 whose head breaks the rules (see ``head`` in the module docstring)."""
        assert self._transport is not None
        body = b'{"object": "chat.completion", "choices": []}'
        start = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        if kind == "endless":
            self._transport.write(start)
            line = b"x-pad: " + b"p" * 1000 + b"\r\n"
            # Up to 32 MiB, or until the peer gives up.
            for _ in range(32 * 1024):
                if self._peer_gone:
                    return
                self._transport.write(line * 1)
                await self._drain()
                await asyncio.sleep(0)
        elif kind == "huge":
            huge = b"x-huge: " + b"h" * 70_000 + b"\r\n"
            self._transport.write(start + huge + b"content-length: %d\r\n\r\n" % len(body) + body)
        elif kind == "te-twice":
            head = start + b"transfer-encoding: chunked, chunked\r\n\r\n"
            self._transport.write(head + _frame(body) + b"0\r\n\r\n")
        elif kind == "te-gzip":
            head = start + b"transfer-encoding: gzip, chunked\r\n\r\n"
            self._transport.write(head + _frame(gzip.compress(body)) + b"0\r\n\r\n")
        else:  # cl-te
            head = start + b"content-length: %d\r\ntransfer-encoding: chunked\r\n\r\n" % len(body)
            self._transport.write(head + _frame(body) + b"0\r\n\r\n")

    async def _play_gzip(self, rec: RequestRecord, reply: _Reply, opts: FakeOptions) -> None:
        """A stream under ``Content-Encoding: gzip``: one member, flushed at each event, chunked or closed."""
        transport = self._transport
        assert transport is not None and reply.events is not None
        chunked = self._engine.http11
        reply.header_lines.append("Content-Encoding: gzip")
        transport.write(self._engine.head_bytes(reply, None, chunked, not chunked))
        packer = zlib.compressobj(wbits=31)
        events = [*reply.events, reply.final]
        for index, event in enumerate(events):
            if opts.die_after is not None and index >= opts.die_after:
                rec.fault = "gzip-die-after"
                self._finish(rec, OUTCOME_ABORTED, status=reply.status)
                self._close()
                return
            data = packer.compress(event) + packer.flush(zlib.Z_SYNC_FLUSH)
            if index == len(events) - 1:
                data += packer.flush()
            transport.write(_frame(data) if chunked else data)
            rec.events_sent = index + 1
            await self._drain()
        if chunked:
            transport.write(b"0\r\n\r\n")
        self._finish(rec, OUTCOME_COMPLETED, status=reply.status)
        if not chunked:
            self._close()

    async def _keepalive_during(self, prefill_s: float, keepalive_s: float, chunked: bool) -> None:
        assert self._transport is not None
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + prefill_s
        # Like mlx's prompt-progress callbacks: i/n, the last one (n/n) at the
        # end of prefill.
        total = max(1, int(prefill_s / keepalive_s + 1e-9))
        for index in range(1, total + 1):
            wake = start + index * keepalive_s
            if wake > deadline + 1e-6:
                break
            await asyncio.sleep(max(0.0, wake - loop.time()))
            comment = f": keepalive {index}/{total}\n\n".encode()
            self._transport.write(_frame(comment) if chunked else comment)
        await asyncio.sleep(max(0.0, deadline - loop.time()))

    async def _play_events(
        self, rec: RequestRecord, reply: _Reply, opts: FakeOptions, chunked: bool, lead: bytes = b""
    ) -> None:
        transport = self._transport
        assert transport is not None and reply.events is not None
        delay_s = opts.chunk_delay_s
        for index, event in enumerate(reply.events):
            if opts.die_after is not None and index >= opts.die_after:
                rec.fault = "die-after"
                if opts.mid_event:
                    half = event[: len(event) // 2]
                    transport.write(_frame(half) if chunked else half)
                self._finish(rec, OUTCOME_ABORTED, status=reply.status)
                self._close()
                return
            if index == 0 and opts.split_first_s > 0:
                half, rest = event[: len(event) // 2], event[len(event) // 2 :]
                transport.write(lead + (_frame(half) if chunked else half))
                await asyncio.sleep(opts.split_first_s)
                event = rest
            transport.write(_frame(event) if chunked else event)
            rec.events_sent = index + 1
            if index == 0 and opts.bad_chunk and chunked:
                rec.fault = "bad-chunk"
                transport.write(b"zz\r\nnot a chunk\r\n")
                self._finish(rec, OUTCOME_ABORTED, status=reply.status)
                self._close()
                return
            if index == 0 and opts.stall_s > 0:
                await asyncio.sleep(opts.stall_s)
            elif delay_s > 0:
                await asyncio.sleep(delay_s)
            await self._drain()
        if opts.die_after is not None and opts.die_after >= len(reply.events):
            rec.fault = "die-after"
            self._finish(rec, OUTCOME_ABORTED, status=reply.status)
            self._close()
            return
        if reply.cut_before_done:
            self._finish(rec, OUTCOME_ABORTED, status=reply.status)
            self._close()
            return
        if opts.no_done:
            rec.fault = "no-done"
            self._finish(rec, OUTCOME_ABORTED, status=reply.status)
            if chunked:
                transport.write(b"0\r\n\r\n")
            else:
                self._close()
            return
        after = _AFTER_DONE if opts.after_done else b""
        if chunked:
            transport.write(_frame(reply.final) + (_frame(after) if after else b"") + b"0\r\n\r\n")
        else:
            transport.write(reply.final + after)

    def _finish(self, rec: RequestRecord, outcome: str, status: int | None) -> None:
        if rec.outcome is None:
            rec.outcome = outcome
            rec.finished_at = time.time()
        if status is not None:
            rec.status = status


_NO_FAULTS = FakeOptions()
_HANG_S = 24 * 3600.0


def _frame(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _wants_keep_alive(version: str, headers: dict[str, str]) -> bool:
    connection = headers.get("connection", "").lower()
    if version == "HTTP/1.1":
        return "close" not in connection
    return "keep-alive" in connection


async def start_fake_engine(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    http11: bool = False,
    embeddings: bool = False,
    default_max_tokens: int = 16,
    model_id: str = "fake-model",
    max_records: int = 10000,
    broken: bool = False,
    hang_after: int | None = None,
    native_apis: frozenset[str] = frozenset(),
    tool_script: tuple[ScriptedCall, ...] = (),
    **options: Any,
) -> FakeEngine:
    """Start an engine in this event loop; ``options`` are FakeOptions fields."""
    engine = FakeEngine(
        hang_after=hang_after,
        native_apis=native_apis,
        tool_script=tool_script,
        http11=http11,
        embeddings=embeddings,
        default_max_tokens=default_max_tokens,
        model_id=model_id,
        max_records=max_records,
        broken=broken,
        options=FakeOptions(**options),
    )
    await engine.start(host, port)
    return engine


def _parse_native_apis(text: str) -> frozenset[str]:
    apis = frozenset(a.strip() for a in text.split(",") if a.strip())
    unknown = apis - set(NATIVE_APIS)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown API {', '.join(sorted(unknown))}: one of {', '.join(NATIVE_APIS)}"
        )
    return apis


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fake_engine",
        description="Fake mlx_lm.server 0.32.0 for fault injection and benchmarks.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--http11", action="store_true", help="HTTP/1.1 keep-alive, chunked streams")
    parser.add_argument("--embeddings", action="store_true", help="serve POST /v1/embeddings")
    parser.add_argument("--default-max-tokens", type=int, default=16)
    parser.add_argument("--model-id", default="fake-model", help="id listed by /v1/models")
    parser.add_argument("--max-records", type=int, default=10000)
    parser.add_argument("--broken", action="store_true", help="start as mlx after max_tokens=0")
    parser.add_argument(
        "--hang-after",
        type=_parse_count,
        default=None,
        metavar="N",
        help="after N generation requests, generation hangs while /health stays 200",
    )
    parser.add_argument(
        "--native-apis",
        type=_parse_native_apis,
        default=frozenset(),
        metavar="API[,API]",
        help="also serve these APIs natively, as llama-server does: messages (POST /v1/messages "
        "and /v1/messages/count_tokens), responses (POST /v1/responses)",
    )
    parser.add_argument("--prefill", type=_parse_seconds, default=0.0, metavar="S")
    parser.add_argument("--keepalive", type=_parse_seconds, default=0.0, metavar="S")
    parser.add_argument("--chunk-delay", type=_parse_seconds, default=0.0, metavar="S")
    parser.add_argument("--stall", type=_parse_seconds, default=0.0, metavar="S")
    parser.add_argument("--die-after", type=_parse_count, default=None, metavar="N")
    parser.add_argument("--garbage", action="store_true")
    parser.add_argument("--reset", action="store_true")
    parser.add_argument("--empty", action="store_true")
    parser.add_argument("--status", type=_parse_status, default=None, metavar="N")
    parser.add_argument("--chunks", type=_parse_count, default=None, metavar="N")
    parser.add_argument("--chunk-bytes", type=_parse_count, default=None, metavar="N")
    parser.add_argument(
        "--tool-call",
        type=ScriptedCall.parse,
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="call tool NAME with these arguments when a request offers it; "
        "answer a tool result with TOOL_RESULT_PREFIX and the result (repeatable)",
    )
    return parser


async def _serve_until_signal(args: argparse.Namespace) -> None:
    engine = await start_fake_engine(
        args.host,
        args.port,
        http11=args.http11,
        embeddings=args.embeddings,
        default_max_tokens=args.default_max_tokens,
        model_id=args.model_id,
        max_records=args.max_records,
        broken=args.broken,
        hang_after=args.hang_after,
        native_apis=args.native_apis,
        prefill_s=args.prefill,
        keepalive_s=args.keepalive,
        chunk_delay_s=args.chunk_delay,
        stall_s=args.stall,
        die_after=args.die_after,
        garbage=args.garbage,
        reset=args.reset,
        empty=args.empty,
        status=args.status,
        chunks=args.chunks,
        chunk_bytes=args.chunk_bytes,
        tool_script=tuple(args.tool_call),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sys.stdout.write(f"PORT {engine.port}\n")
    sys.stdout.flush()
    await stop.wait()
    await engine.close()


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: serve until SIGTERM/SIGINT, then exit 0."""
    args = _build_parser().parse_args(argv)
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        asyncio.run(_serve_until_signal(args))
    else:
        uvloop.run(_serve_until_signal(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
