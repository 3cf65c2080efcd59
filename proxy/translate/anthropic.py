"""The Anthropic Messages API (``POST /v1/messages``) over chat completions.

The request becomes one chat completion:

- every system text, the ``system`` field's and that of any ``role: "system"``
  message inside ``messages`` (Claude Code sends one after the first user
  turn), merged in order into one system message at the top: chat templates
  refuse a system message anywhere else;
- text blocks joined into a string (the content every template takes), image
  blocks as ``image_url`` parts; ``thinking`` blocks dropped (an engine
  cannot check their signatures, and templates drop past reasoning anyway);
- ``tool_use`` blocks as the assistant's ``tool_calls`` (ids kept), each
  ``tool_result`` as a ``tool`` message, before the rest of its user turn;
- custom tools as functions, their schemas through ``clean_schema``; server
  tools (``web_search_20250305``, ``bash_20250124``...) dropped, said in
  ``notes``; fields with no chat equivalent (``thinking``, ``metadata``,
  ``context_management``...) ignored.

The chat stream becomes Anthropic's events as each chunk comes: a block
opens when the kind of output changes (text, thinking from ``reasoning`` or
``reasoning_content``, one ``tool_use`` block per tool call, whether the call
comes in pieces as from OpenAI and vLLM or whole in one delta as from
mlx_lm.server) and closes when the next opens or the stream ends. The events
are bytes templates around the one string each delta carries.

Choices a client could notice:

- ``usage.input_tokens`` is the prompt's tokens less those read from the
  engine's prompt cache, which are ``cache_read_input_tokens``: Anthropic
  counts the two apart and a client adds them up.
- ``stop_sequence`` is always null: a chat stream does not say which stop
  string ended it, so ``stop`` is ``end_turn``.
- A tool call whose arguments are not a JSON object: a stream passes the
  engine's text on as it is (the client's own parser judges it); a
  non-stream reply gives ``{"_raw": text}`` as the input, so that the tool's
  own input check tells the model what it wrote.
"""

from __future__ import annotations

import secrets
from typing import Any

import orjson

from proxy.errors import HTTPError, anthropic_error_body
from proxy.translate.schema import clean_schema

# What a request without one is refused with, in Anthropic's words.
_FIELD_REQUIRED = "Field required"

# Status -> Anthropic's error type; a status not listed is invalid_request_error
# below 500 and api_error from 500.

# Tool types that are the client's own functions; any other type is a server tool.
_CUSTOM_TOOL_TYPES = frozenset({None, "custom"})

# Chat's finish_reason -> Anthropic's stop_reason.
_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}

# The kinds of content block; the open one decides whether a delta opens a new block.
_NONE, _TEXT, _THINKING, _TOOL = 0, 1, 2, 3

_TEXT_START = (
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":%d,"content_block":{"type":"text","text":""}}\n\n'
)
_THINKING_START = (
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":%d,'
    b'"content_block":{"type":"thinking","thinking":"","signature":""}}\n\n'
)
_TOOL_START = (
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":%d,'
    b'"content_block":{"type":"tool_use","id":%b,"name":%b,"input":{}}}\n\n'
)
_TEXT_DELTA = (
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":%d,"delta":{"type":"text_delta","text":%b}}\n\n'
)
_THINKING_DELTA = (
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":%d,"delta":{"type":"thinking_delta","thinking":%b}}\n\n'
)
_JSON_DELTA = (
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":%d,'
    b'"delta":{"type":"input_json_delta","partial_json":%b}}\n\n'
)
_BLOCK_STOP = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":%d}\n\n'
_MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


class TranslationFailed(HTTPError):
    """The engine's answer cannot become this API's reply (a count without usage): a 502 by default.

    An ``HTTPError``, so that a relay answering those before its response has
    started answers this too, in the endpoint's envelope.
    """

    def __init__(self, message: str, *, status: int = 502, code: str = "bad_upstream_reply") -> None:
        super().__init__(status, message, code=code)


class MessagesTranslator:
    """One ``POST /v1/messages`` over a chat completion stream (see ``proxy.translate.Translator``)."""

    __slots__ = (
        "_blocks",
        "_doc",
        "_finish",
        "_id",
        "_kind",
        "_made_tool_call",
        "_model",
        "_open",
        "_tool_key",
        "_tools",
        "_usage",
        "notes",
        "stream",
    )

    def __init__(self, doc: dict[str, Any]) -> None:
        self._doc = doc
        self.stream = isinstance(doc, dict) and doc.get("stream") is True
        self.notes: list[str] = []
        model = doc.get("model") if isinstance(doc, dict) else None
        self._model = model if isinstance(model, str) else ""
        self._id = "msg_" + secrets.token_hex(12)
        # The open block: its index (-1: none yet) and kind.
        self._open = -1
        self._kind = _NONE
        # The engine's tool call key (its index, else its id) -> the block it opened.
        self._tools: dict[object, int] = {}
        self._tool_key: object = None
        self._made_tool_call = False
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None
        # Non-stream: each block's kind, pieces, and for a tool its id and name.
        self._blocks: list[tuple[int, list[str], str, str]] = []

    def chat_request(self) -> dict[str, Any]:
        """The chat completion for this request; a 400 for a body Anthropic's API refuses."""
        return translate_request(self._doc, self.notes, count_only=False)

    def start(self) -> bytes:
        """``message_start``: the message, empty, with no usage counted yet."""
        if not self.stream:
            return b""
        message = {
            "type": "message_start",
            "message": {
                "id": self._id,
                "type": "message",
                "role": "assistant",
                "model": self._model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0},
            },
        }
        return b"event: message_start\ndata: " + orjson.dumps(message) + b"\n\n"

    def feed(self, chunk: dict[str, Any]) -> bytes:
        """One chat chunk → its content block events: reasoning, then text, then tool calls."""
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        choices = chunk.get("choices")
        if not choices or not isinstance(choices, list):
            return b""
        choice = choices[0]
        if not isinstance(choice, dict):
            return b""
        out = b""
        delta = choice.get("delta")
        if isinstance(delta, dict):
            # Some engines send both names with the same text: one is read.
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if reasoning and isinstance(reasoning, str):
                out += self._piece(_THINKING, reasoning)
            content = delta.get("content")
            if content and isinstance(content, str):
                out += self._piece(_TEXT, content)
            calls = delta.get("tool_calls")
            if calls and isinstance(calls, list):
                for call in calls:
                    if isinstance(call, dict):
                        out += self._tool_call(call)
        finish = choice.get("finish_reason")
        if finish and isinstance(finish, str):
            self._finish = finish
        return out

    def finish(self) -> bytes:
        """The open block's end, ``message_delta`` (stop reason, usage) and ``message_stop``."""
        if not self.stream:
            return b""
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": self._stop_reason(), "stop_sequence": None},
            "usage": self._usage_counts(),
        }
        return self._close() + b"event: message_delta\ndata: " + orjson.dumps(delta) + b"\n\n" + _MESSAGE_STOP

    def failed(self, status: int, message: str, code: str | None) -> bytes:
        """Anthropic's ``event: error``, which its SDK raises as the status's error."""
        if not self.stream:
            return b""
        return b"event: error\ndata: " + anthropic_error_body(status, message) + b"\n\n"

    def reply(self) -> bytes:
        """The whole Message: its content blocks in order, stop reason and usage."""
        content: list[dict[str, Any]] = []
        for kind, pieces, tool_id, name in self._blocks:
            if kind == _TEXT:
                content.append({"type": "text", "text": "".join(pieces)})
            elif kind == _THINKING:
                content.append({"type": "thinking", "thinking": "".join(pieces), "signature": ""})
            else:
                content.append(
                    {"type": "tool_use", "id": tool_id, "name": name, "input": _input("".join(pieces))}
                )
        return orjson.dumps(
            {
                "id": self._id,
                "type": "message",
                "role": "assistant",
                "model": self._model,
                "content": content,
                "stop_reason": self._stop_reason(),
                "stop_sequence": None,
                "usage": self._usage_counts(),
            }
        )

    def _piece(self, kind: int, text: str) -> bytes:
        """Text or thinking: a delta of the open block, opening one of its kind first if need be."""
        out = b""
        if self._kind != kind:
            out = self._close()
            self._open += 1
            self._kind = kind
            if self.stream:
                out += (_TEXT_START if kind == _TEXT else _THINKING_START) % self._open
            else:
                self._blocks.append((kind, [], "", ""))
        if not self.stream:
            self._blocks[self._open][1].append(text)
            return out
        return out + (_TEXT_DELTA if kind == _TEXT else _THINKING_DELTA) % (self._open, orjson.dumps(text))

    def _tool_call(self, call: dict[str, Any]) -> bytes:
        """A tool call delta: a new call opens a tool_use block; argument pieces are its input's JSON."""
        key: object = call.get("index")
        call_id = call.get("id")
        if not isinstance(key, int) or isinstance(key, bool):
            # No index: a call is known by its id, and a piece without one continues the open call.
            key = call_id if isinstance(call_id, str) and call_id else self._tool_key
        function = call.get("function")
        if not isinstance(function, dict):
            function = {}
        arguments = function.get("arguments")
        block = self._tools.get(key) if key is not None else None
        out = b""
        if block is None:
            out = self._close()
            self._open += 1
            self._kind = _TOOL
            block = self._open
            if key is None:
                key = ("call", block)
            self._tools[key] = block
            self._tool_key = key
            self._made_tool_call = True
            tool_id = call_id if isinstance(call_id, str) and call_id else "toolu_" + secrets.token_hex(12)
            name = function.get("name")
            name = name if isinstance(name, str) else ""
            if self.stream:
                out += _TOOL_START % (block, orjson.dumps(tool_id), orjson.dumps(name))
            else:
                self._blocks.append((_TOOL, [], tool_id, name))
        if not arguments or not isinstance(arguments, str):
            return out
        if not self.stream:
            self._blocks[block][1].append(arguments)
            return out
        # A piece for a call whose block is closed (engines send calls one after another, so
        # not seen) still goes to that call's block, where the SDK's accumulator puts it.
        return out + _JSON_DELTA % (block, orjson.dumps(arguments))

    def _close(self) -> bytes:
        """The open block's ``content_block_stop`` (none open: nothing)."""
        if self._kind == _NONE:
            return b""
        self._kind = _NONE
        return _BLOCK_STOP % self._open if self.stream else b""

    def _stop_reason(self) -> str:
        if self._finish is None or self._finish == "stop":
            # An engine that ends a tool call with "stop" still asked for the tool.
            return "tool_use" if self._made_tool_call else "end_turn"
        return _STOP_REASONS.get(self._finish, "end_turn")

    def _usage_counts(self) -> dict[str, int]:
        usage = self._usage or {}
        prompt = _count(usage.get("prompt_tokens"))
        details = usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
        cached = min(cached, prompt)
        counts = {"input_tokens": prompt - cached, "output_tokens": _count(usage.get("completion_tokens"))}
        if cached:
            counts["cache_read_input_tokens"] = cached
        return counts


class CountTokensTranslator:
    """One ``POST /v1/messages/count_tokens``: the same chat request for one token; its prompt's count."""

    __slots__ = ("_doc", "_prompt_tokens", "notes", "stream")

    def __init__(self, doc: dict[str, Any]) -> None:
        self._doc = doc
        self.stream = False
        self.notes: list[str] = []
        self._prompt_tokens: int | None = None

    def chat_request(self) -> dict[str, Any]:
        """The request's chat completion with ``max_tokens`` 1 (a count needs no ``max_tokens``)."""
        return translate_request(self._doc, self.notes, count_only=True)

    def start(self) -> bytes:
        return b""

    def feed(self, chunk: dict[str, Any]) -> bytes:
        """Keeps the usage chunk's ``prompt_tokens``."""
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            prompt = usage.get("prompt_tokens")
            if isinstance(prompt, int) and not isinstance(prompt, bool) and prompt >= 0:
                self._prompt_tokens = prompt
        return b""

    def finish(self) -> bytes:
        return b""

    def failed(self, status: int, message: str, code: str | None) -> bytes:
        return b""

    def reply(self) -> bytes:
        """``{"input_tokens": N}``; ``TranslationFailed`` (502) when the engine's stream had no usage."""
        if self._prompt_tokens is None:
            raise TranslationFailed(
                "the engine's reply did not count the prompt's tokens (no usage in its stream), "
                "so they cannot be counted through this server"
            )
        return orjson.dumps({"input_tokens": self._prompt_tokens})


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _input(arguments: str) -> Any:
    """A tool call's arguments as a tool_use ``input``: the object they are, else ``{"_raw": text}``."""
    if not arguments.strip():
        return {}
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {"_raw": arguments}
    return parsed if isinstance(parsed, dict) else {"_raw": arguments}


# --- the request -------------------------------------------------------------------------------


def _bad(param: str, problem: str, code: str = "invalid_value") -> HTTPError:
    """A 400 whose message names the field the way Anthropic's API does (``messages.0.content``)."""
    return HTTPError(400, f"{param}: {problem}", param=param, code=code)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def translate_request(doc: Any, notes: list[str], *, count_only: bool) -> dict[str, Any]:
    """A Messages request's chat completion (always a stream with usage); a 400 for a bad body.

    ``count_only``: for ``count_tokens``, which has no ``max_tokens`` and asks for one token.
    What was left out is appended to ``notes``.
    """
    if not isinstance(doc, dict):
        raise HTTPError(400, "request body must be a JSON object", code="invalid_json")
    model = doc.get("model")
    if model is None:
        raise _bad("model", _FIELD_REQUIRED, "missing_field")
    if not isinstance(model, str) or not model:
        raise _bad("model", "Input should be a non-empty string", "invalid_type")
    stream = doc.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", "Input should be a valid boolean", "invalid_type")

    system = _system_texts(doc.get("system"), "system")
    messages: list[dict[str, Any]] = []
    turns = doc.get("messages")
    if turns is None:
        raise _bad("messages", _FIELD_REQUIRED, "missing_field")
    if not isinstance(turns, list):
        raise _bad("messages", "Input should be a valid list", "invalid_type")
    if not turns:
        raise _bad("messages", "at least one message is required")
    for index, turn in enumerate(turns):
        param = f"messages.{index}"
        if not isinstance(turn, dict):
            raise _bad(param, "Input should be an object with role and content", "invalid_type")
        role = turn.get("role")
        content = turn.get("content")
        if content is None:
            raise _bad(f"{param}.content", _FIELD_REQUIRED, "missing_field")
        if role == "user":
            messages.extend(_user_turn(content, f"{param}.content", notes))
        elif role == "assistant":
            messages.append(_assistant_turn(content, f"{param}.content"))
        elif role == "system":
            system.extend(_system_texts(content, f"{param}.content"))
        elif role is None:
            raise _bad(f"{param}.role", _FIELD_REQUIRED, "missing_field")
        else:
            raise _bad(
                f"{param}.role",
                f"Unexpected role {_shown(role)}: one of 'user', 'assistant' or 'system'",
                "invalid_value",
            )
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})

    chat: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 1 if count_only else _max_tokens(doc.get("max_tokens")),
    }
    for name in ("temperature", "top_p"):
        value = doc.get(name)
        if value is not None:
            if not _is_number(value):
                raise _bad(name, "Input should be a valid number", "invalid_type")
            chat[name] = value
    top_k = doc.get("top_k")
    if top_k is not None:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
            raise _bad("top_k", "Input should be a non-negative integer", "invalid_type")
        chat["top_k"] = top_k
    stop = doc.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("stop_sequences", "Input should be a list of strings", "invalid_type")
        if stop:
            chat["stop"] = stop
    tools, dropped = _tools(doc.get("tools"), notes)
    choice = _tool_choice(doc.get("tool_choice"), {tool["function"]["name"] for tool in tools} | dropped)
    if tools:
        chat["tools"] = tools
        if choice is not None:
            if isinstance(choice, dict) and choice["function"]["name"] in dropped:
                notes.append("tool_choice left out: the tool it names is a server tool, left out too")
            else:
                chat["tool_choice"] = choice
    return chat


def _max_tokens(value: Any) -> int:
    if value is None:
        raise _bad("max_tokens", _FIELD_REQUIRED, "missing_field")
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad("max_tokens", "Input should be a valid integer", "invalid_type")
    if value < 1:
        raise _bad("max_tokens", "Input should be greater than or equal to 1")
    return value


def _shown(value: Any) -> str:
    """A client's value as a message repeats it: short, and only if it is a string."""
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:40] + "…")
    return f"of type {type(value).__name__}"


def _block_type(block: Any, param: str) -> str:
    if not isinstance(block, dict):
        raise _bad(param, "Input should be a content block object", "invalid_type")
    kind = block.get("type")
    if kind is None:
        raise _bad(f"{param}.type", _FIELD_REQUIRED, "missing_field")
    if not isinstance(kind, str):
        raise _bad(f"{param}.type", "Input should be a valid string", "invalid_type")
    return kind


def _text_of(block: dict[str, Any], param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{param}.text", "Input should be a valid string", "invalid_type")
    return text


def _system_texts(value: Any, param: str) -> list[str]:
    """A system prompt (a string or text blocks, ``cache_control`` ignored) as its texts."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if not isinstance(value, list):
        raise _bad(param, "Input should be a string or a list of text blocks", "invalid_type")
    texts = []
    for index, block in enumerate(value):
        kind = _block_type(block, f"{param}.{index}")
        if kind != "text":
            raise _bad(f"{param}.{index}.type", f"a system prompt takes text blocks, not {_shown(kind)}")
        texts.append(_text_of(block, f"{param}.{index}"))
    joined = "\n".join(texts)
    return [joined] if joined else []


def _image_url(block: dict[str, Any], param: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad(f"{param}.source", _FIELD_REQUIRED, "missing_field")
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise _bad(f"{param}.source", "a base64 image needs media_type and data strings", "invalid_type")
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise _bad(f"{param}.source.url", "Input should be a valid string", "invalid_type")
        return {"type": "image_url", "image_url": {"url": url}}
    raise _bad(f"{param}.source.type", f"image sources here are 'base64' or 'url', not {_shown(kind)}")


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Chat content: a string where every part is text (what every template takes), else the parts."""
    if all(part["type"] == "text" for part in parts):
        return "\n".join(part["text"] for part in parts)
    return parts


def _user_turn(content: Any, param: str, notes: list[str]) -> list[dict[str, Any]]:
    """A user turn: a ``tool`` message per tool_result, then a user message with the rest."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise _bad(param, "Input should be a string or a list of content blocks", "invalid_type")
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        where = f"{param}.{index}"
        kind = _block_type(block, where)
        if kind == "text":
            parts.append({"type": "text", "text": _text_of(block, where)})
        elif kind == "image":
            parts.append(_image_url(block, where))
        elif kind == "tool_result":
            results.append(_tool_result(block, where, notes))
        elif kind == "document":
            parts.append({"type": "text", "text": _document_text(block, where)})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise _bad(
                f"{where}.type",
                f"a user turn here takes text, image, document or tool_result, not {_shown(kind)}",
            )
    if parts or not results:
        results.append({"role": "user", "content": _content(parts)})
    return results


def _document_text(block: dict[str, Any], param: str) -> str:
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "text" and isinstance(source.get("data"), str):
        return str(source["data"])
    raise _bad(f"{param}.source", "only plain-text documents (source type 'text') can be read by this model")


def _tool_result(block: dict[str, Any], param: str, notes: list[str]) -> dict[str, Any]:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise _bad(f"{param}.tool_use_id", "Input should be a non-empty string", "invalid_type")
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            kind = _block_type(part, f"{param}.content.{index}")
            if kind == "text":
                texts.append(_text_of(part, f"{param}.content.{index}"))
            elif kind == "document":
                texts.append(_document_text(part, f"{param}.content.{index}"))
            else:
                # A tool message is text to a chat engine: the model is told what it cannot see.
                texts.append(f"[{kind} omitted: this model reads text only]")
                notes.append(f"a {kind} block in a tool result was left out (tool messages are text)")
        text = "\n".join(texts)
    else:
        raise _bad(f"{param}.content", "Input should be a string or a list of content blocks", "invalid_type")
    if block.get("is_error") is True:
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": tool_use_id, "content": text}


def _assistant_turn(content: Any, param: str) -> dict[str, Any]:
    """An assistant turn: its text as the content, its tool_use blocks as ``tool_calls``."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad(param, "Input should be a string or a list of content blocks", "invalid_type")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        where = f"{param}.{index}"
        kind = _block_type(block, where)
        if kind == "text":
            texts.append(_text_of(block, where))
        elif kind == "tool_use":
            calls.append(_tool_use(block, where))
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise _bad(
                f"{where}.type",
                f"an assistant turn here takes text, thinking or tool_use, not {_shown(kind)}",
            )
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_use(block: dict[str, Any], param: str) -> dict[str, Any]:
    tool_id, name = block.get("id"), block.get("name")
    if not isinstance(tool_id, str) or not tool_id:
        raise _bad(f"{param}.id", "Input should be a non-empty string", "invalid_type")
    if not isinstance(name, str) or not name:
        raise _bad(f"{param}.name", "Input should be a non-empty string", "invalid_type")
    tool_input = block.get("input", {})
    if not isinstance(tool_input, dict):
        raise _bad(f"{param}.input", "Input should be an object", "invalid_type")
    try:
        arguments = orjson.dumps(tool_input).decode()
    except orjson.JSONEncodeError as exc:
        raise _bad(f"{param}.input", f"cannot be written as JSON: {exc}") from None
    return {"id": tool_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tools(value: Any, notes: list[str]) -> tuple[list[dict[str, Any]], set[str]]:
    """The client's own tools as chat functions; the names of the server tools, left out and noted."""
    dropped: set[str] = set()
    if value is None:
        return [], dropped
    if not isinstance(value, list):
        raise _bad("tools", "Input should be a valid list", "invalid_type")
    tools = []
    for index, tool in enumerate(value):
        param = f"tools.{index}"
        if not isinstance(tool, dict):
            raise _bad(param, "Input should be a tool object", "invalid_type")
        kind = tool.get("type")
        name = tool.get("name")
        if kind is not None and not isinstance(kind, str):
            raise _bad(f"{param}.type", "Input should be a valid string", "invalid_type")
        if kind not in _CUSTOM_TOOL_TYPES:
            shown = name if isinstance(name, str) else "?"
            notes.append(f"tool {shown!r} ({_shown(kind)}) left out: a server tool the engine cannot run")
            if isinstance(name, str):
                dropped.add(name)
            continue
        if not isinstance(name, str) or not name:
            raise _bad(f"{param}.name", "Input should be a non-empty string", "invalid_type")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"{param}.input_schema", "Input should be a JSON schema object", "invalid_type")
        function: dict[str, Any] = {"name": name}
        description = tool.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise _bad(f"{param}.description", "Input should be a valid string", "invalid_type")
            function["description"] = description
        function["parameters"] = clean_schema(schema)
        tools.append({"type": "function", "function": function})
    return tools, dropped


def _tool_choice(value: Any, names: set[str]) -> Any:
    """Chat's tool_choice for Anthropic's; a 400 for one that names none of ``names``."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("tool_choice", "Input should be an object with a type", "invalid_type")
    kind = value.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise _bad("tool_choice.name", "Input should be a non-empty string", "invalid_type")
        if name not in names:
            raise _bad("tool_choice.name", f"no tool named {_shown(name)} among the request's tools")
        return {"type": "function", "function": {"name": name}}
    raise _bad("tool_choice.type", f"one of 'auto', 'any', 'tool' or 'none', not {_shown(kind)}")
