"""A non-stream reply built from the events of a stream.

Some engines never learn that the client of a non-stream request has gone:
mlx_lm.server writes such a reply only when it is complete, so it generates
to ``max_tokens`` for nobody. A stream's next write fails instead, within a
token. So for those engines (``via_stream`` in their spec) the gateway asks
for a stream, reads its events here as they arrive, and answers the client
with the one JSON body that the engine would have sent:

- ``chat.completion`` from ``chat.completion.chunk`` events (``text_completion``
  stays itself): id, created, model and system_fingerprint as the engine sent
  them, in the order it sent them;
- per choice: the message's role, content (``null`` when empty, as the
  engine's own reply has it), reasoning when the engine sends any, tool calls
  assembled from their deltas by index; the last finish_reason;
- usage from the engine's own usage event (``stream_options.include_usage``),
  cached-token details included.

The stream's bytes are kept as they arrive and parsed once, at the end, in
one loop (see ``feed``); each event once. Pure: no sockets, tested alone.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.errors import HTTPError

# A built reply larger than this is an upstream fault, not something to hold.
LIMIT_BYTES = 64 * 1024 * 1024
# Fields of a reply besides choices and usage, copied from the first event.
_SKIPPED_TOP = frozenset({"choices", "usage", "object"})
_REASONING_KEYS = ("reasoning", "reasoning_content")
_DONE = b"data: [DONE]"
_FIRST_KEYS: tuple[str, ...] = ("id", "system_fingerprint", "object", "model", "created")


class AssemblyError(HTTPError):
    """The stream cannot make a reply: an error event, bad JSON, or too large."""

    def __init__(self, message: str, status: int = 502, code: str = "upstream_bad_response") -> None:
        super().__init__(status, message, code=code)


class _Choice:
    __slots__ = ("finish_reason", "index", "reasoning", "reasoning_key", "role", "text", "tool_calls")

    def __init__(self, index: int) -> None:
        self.index = index
        self.role: str | None = None
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.reasoning_key = "reasoning"
        self.finish_reason: str | None = None
        # Tool call index → its id, type and the pieces of name and arguments.
        self.tool_calls: dict[int, dict[str, Any]] = {}


class ReplyAssembler:
    """Feed it a stream's bytes as they come; ``reply()`` once ``done``, or once the stream ended."""

    __slots__ = (
        "_choices",
        "_chunks",
        "_data",
        "_ended",
        "_size",
        "_tail",
        "_top",
        "_usage",
        "chat",
        "done",
        "first_data",
    )

    def __init__(self, *, chat: bool) -> None:
        self.chat = chat
        # Whether the bytes so far hold the stream's `data: [DONE]` (``reply`` confirms it).
        self.done = False
        # Whether an event with data (not a comment such as `: keepalive`) has come.
        self.first_data = False
        self._chunks: list[bytes] = []
        self._tail = b""
        self._size = 0
        self._data: list[bytes] = []
        self._ended = False
        self._top: dict[str, Any] | None = None
        self._choices: dict[int, _Choice] = {}
        self._usage: Any = None

    def feed(self, chunk: bytes) -> None:
        """Take the next bytes of the stream (any split).

        Only kept here, with a look for ``[DONE]`` and for the first data:
        between an engine's tokens the gateway runs with cold caches, and
        parsing every event as it came cost ~65 µs of wall time an event
        there, against ~4 µs for the same work in one loop at the end.
        """
        self._size += len(chunk)
        if self._size > LIMIT_BYTES:
            raise AssemblyError(f"the upstream's reply is larger than {LIMIT_BYTES} bytes")
        self._chunks.append(chunk)
        if not self.first_data and b"data:" in chunk:
            self.first_data = True
        window = self._tail + chunk
        if _DONE in window:
            self.done = True
        self._tail = window[-len(_DONE) :]

    def reply(self) -> bytes:
        """The non-stream reply, as JSON bytes; AssemblyError if the stream makes none.

        That is: an error event, an event that is not a JSON object, or a
        stream that ended without ``[DONE]`` (the engine stopped or crashed).
        """
        self._parse(b"".join(self._chunks))
        self._chunks = []
        if not self._ended:
            raise AssemblyError(
                "upstream stream ended without [DONE]: the reply is incomplete (the engine may have "
                "stopped or crashed)",
                code="upstream_truncated",
            )
        top = dict(self._top or {})
        top["object"] = "chat.completion" if self.chat else "text_completion"
        # The order the engine's own non-stream reply has: its fields, then choices, then usage.
        ordered: dict[str, Any] = {k: top[k] for k in _FIRST_KEYS if k in top}
        ordered.update(top)
        ordered["choices"] = [self._choice(self._choices[i]) for i in sorted(self._choices)]
        if self._usage is not None:
            ordered["usage"] = self._usage
        return orjson.dumps(ordered)

    def _parse(self, stream: bytes) -> None:
        for line in stream.split(b"\n"):
            if self._ended:
                return  # bytes after [DONE] are no part of the reply
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                self._dispatch()
            elif line.startswith(b"data:"):
                self._data.append(line[6:] if line[5:6] == b" " else line[5:])
            # Comments (": keepalive") and other fields (event:, id:, retry:) carry no reply.

    def _dispatch(self) -> None:
        if not self._data:
            return
        data = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
        self._data = []
        if data == b"[DONE]":
            self._ended = True
            return
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise AssemblyError(f"the upstream sent an event that is not JSON: {data[:80]!r}") from None
        if not isinstance(event, dict):
            raise AssemblyError("the upstream sent an event that is not a JSON object")
        if "error" in event:
            raise _error_of(event["error"])
        self._take(event)

    def _take(self, event: dict[str, Any]) -> None:
        if self._top is None:
            self._top = {k: v for k, v in event.items() if k not in _SKIPPED_TOP}
        if event.get("usage") is not None:
            self._usage = event["usage"]
        for part in event.get("choices") or ():
            index = part.get("index", 0)
            choice = self._choices.get(index)
            if choice is None:
                choice = self._choices[index] = _Choice(index)
            if part.get("finish_reason") is not None:
                choice.finish_reason = part["finish_reason"]
            if not self.chat:
                if part.get("text"):
                    choice.text.append(part["text"])
                continue
            delta = part.get("delta") or {}
            if delta.get("role"):
                choice.role = delta["role"]
            if delta.get("content"):
                choice.text.append(delta["content"])
            for key in _REASONING_KEYS:
                if delta.get(key):
                    choice.reasoning_key = key
                    choice.reasoning.append(delta[key])
            for call in delta.get("tool_calls") or ():
                _take_tool_call(choice, call)

    def _choice(self, choice: _Choice) -> dict[str, Any]:
        text = "".join(choice.text)
        if not self.chat:
            return {"index": choice.index, "finish_reason": choice.finish_reason, "text": text}
        message: dict[str, Any] = {"role": choice.role or "assistant", "content": text or None}
        if choice.reasoning:
            message[choice.reasoning_key] = "".join(choice.reasoning)
        if choice.tool_calls:
            message["tool_calls"] = [_tool_call(choice.tool_calls[i]) for i in sorted(choice.tool_calls)]
        return {"index": choice.index, "finish_reason": choice.finish_reason, "message": message}


def _take_tool_call(choice: _Choice, call: Any) -> None:
    """One tool-call delta: the first of an index names it; later ones add to its arguments."""
    if not isinstance(call, dict):
        return
    index = call.get("index", len(choice.tool_calls))
    held = choice.tool_calls.get(index)
    if held is None:
        held = choice.tool_calls[index] = {"id": None, "type": None, "name": [], "arguments": []}
    if call.get("id"):
        held["id"] = call["id"]
    if call.get("type"):
        held["type"] = call["type"]
    function = call.get("function") or {}
    if function.get("name"):
        held["name"].append(function["name"])
    if function.get("arguments"):
        held["arguments"].append(function["arguments"])


def _tool_call(held: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": held["id"],
        "type": held["type"] or "function",
        "function": {"name": "".join(held["name"]), "arguments": "".join(held["arguments"])},
    }


def _error_of(error: Any) -> AssemblyError:
    """An error event in the stream (a chained gateway's, an engine's) as the reply's error."""
    if isinstance(error, dict):
        message = str(error.get("message") or "the upstream reported an error")
        code = error.get("code")
        status = 502
        if isinstance(code, int) and 400 <= code <= 599:
            status = code
        return AssemblyError(
            f"the upstream failed mid-generation: {message}",
            status,
            code if isinstance(code, str) and code else "upstream_error",
        )
    return AssemblyError(f"the upstream failed mid-generation: {error}", 502, "upstream_error")
