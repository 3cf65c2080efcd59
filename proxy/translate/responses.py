"""The OpenAI Responses API (``POST /v1/responses``) over chat completions.

The request becomes one chat completion: ``instructions`` and every
``developer``/``system`` message in ``input`` become one system message at the
top (Codex sends its system prompt as developer messages), input items
become chat messages (``function_call``/``custom_tool_call`` as assistant
``tool_calls``, their outputs as ``tool`` messages), namespace tools are
flattened into functions named ``namespace__name`` (Codex's own flat form,
``ToolName::canonical_flat_name``), custom (freeform) tools become functions
taking one string ``input``, and tools only OpenAI's platform runs
(``web_search``...) are dropped and noted.

The chat stream becomes the Responses events as the chunks come: one output
item per run of reasoning, of text, and per tool call, each opened with
``response.output_item.added`` and closed with ``response.output_item.done``
(Codex builds its history from the done items), and a last
``response.completed`` (or ``response.incomplete`` when the engine stopped at
its token limit) carrying the whole response and its usage. A chat tool call
of a flattened or custom tool comes back as the client's own item: a
``function_call`` with its ``namespace``, or a ``custom_tool_call`` whose
``input`` is the string the model put in the ``input`` argument.

The gateway keeps no responses: ``previous_response_id``, ``store: true``,
``conversation``, ``background`` and stored ``prompt`` templates are refused
with a 400 that says to send the whole history (as llama.cpp and Ollama do).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.errors import HTTPError, echo
from proxy.translate.schema import clean_schema

# Tool types only OpenAI's platform runs; a chat engine has nothing to call.
HOSTED_TOOL_TYPES = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "tool_search",
        "image_generation",
        "code_interpreter",
        "computer",
        "computer_use",
        "computer_use_preview",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
    }
)

# Input items that record what hosted tools or the model's hidden reasoning
# did in earlier turns: nothing a chat engine can read, so left out.
DROPPED_ITEM_TYPES = frozenset(
    {
        "reasoning",
        "web_search_call",
        "file_search_call",
        "image_generation_call",
        "code_interpreter_call",
        "mcp_list_tools",
        "tool_search_call",
        "tool_search_output",
        "additional_tools",
    }
)

# Request fields that need responses stored by the server.
_STATEFUL_FIELDS = ("previous_response_id", "conversation", "prompt")

# A custom tool's grammar is shown to the model when at most this long
# (Codex's apply_patch grammar is ~900 characters).
GRAMMAR_LIMIT_CHARS = 4000

_NAMESPACE_DELIMITER = "__"
_STATELESS = (
    "the gateway is stateless and keeps no responses: send the whole conversation in `input` "
    "with `store: false` (as llama.cpp and Ollama do)"
)


@dataclass(frozen=True, slots=True)
class ToolName:
    """What a chat function name stands for in the client's own tools."""

    kind: str  # "function" or "custom"
    name: str
    namespace: str | None = None


def flat_name(namespace: str, name: str) -> str:
    """A namespaced function's chat name, as Codex itself flattens one: ``ns__name``."""
    return f"{namespace.rstrip('_')}{_NAMESPACE_DELIMITER}{name.lstrip('_')}"


def _bad(message: str, param: str, code: str = "invalid_value") -> HTTPError:
    return HTTPError(400, message, param=param, code=code)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _shown(value: Any) -> str:
    """A client's value as an error message repeats it: a string cut short, else its JSON type."""
    return repr(echo(value)) if isinstance(value, str) else _kind(value)


# ---------------------------------------------------------------- request


@dataclass(slots=True)
class _Chat:
    """The chat completion being built from one request."""

    system: list[str]
    messages: list[dict[str, Any]]
    notes: list[str]
    tools: dict[str, ToolName]


def chat_request(doc: Any) -> tuple[dict[str, Any], dict[str, ToolName], list[str]]:
    """The chat completion for a Responses request, the chat names of its tools, and notes for the log.

    Raises ``HTTPError`` (400) for a body the Responses API refuses or the
    gateway cannot serve.
    """
    if not isinstance(doc, dict):
        raise _bad(f"the request body must be a JSON object, not {_kind(doc)}", "body", "invalid_type")
    for field in _STATEFUL_FIELDS:
        if doc.get(field) not in (None, "", {}):
            raise _bad(f"`{field}` is not supported: {_STATELESS}", field, "unsupported_parameter")
    if doc.get("store") is True:
        raise _bad(f"`store: true` is not supported: {_STATELESS}", "store", "unsupported_parameter")
    if doc.get("background") is True:
        raise _bad(
            "`background: true` is not supported: the gateway is stateless and keeps no responses to poll; "
            "send the request without `background` (stream it to see it progress)",
            "background",
            "unsupported_parameter",
        )
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("`model` is required: a model name string", "model", "missing_required_parameter")
    stream = doc.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad(f"`stream` must be a boolean, not {_kind(stream)}", "stream", "invalid_type")

    chat = _Chat(system=[], messages=[], notes=[], tools={})
    instructions = doc.get("instructions")
    if isinstance(instructions, str):
        if instructions:
            chat.system.append(instructions)
    elif instructions is not None:
        raise _bad(
            f"`instructions` must be a string, not {_kind(instructions)}", "instructions", "invalid_type"
        )

    _add_input(chat, doc.get("input"))
    out: dict[str, Any] = {"model": model, "messages": chat.messages}
    if chat.system:
        out["messages"] = [{"role": "system", "content": "\n\n".join(chat.system)}, *chat.messages]
    if not chat.messages:
        raise _bad("`input` holds no message for the model to answer", "input")

    tools = _tools(chat, doc.get("tools"))
    if tools:
        out["tools"] = tools
        choice = _tool_choice(chat, doc.get("tool_choice"))
        if choice is not None:
            out["tool_choice"] = choice
    out["stream"] = True
    out["stream_options"] = {"include_usage": True}

    max_tokens = doc.get("max_output_tokens")
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise _bad("`max_output_tokens` must be an integer of at least 1", "max_output_tokens")
        out["max_tokens"] = max_tokens
    for field in ("temperature", "top_p"):
        value = doc.get(field)
        if value is not None:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise _bad(f"`{field}` must be a number, not {_kind(value)}", field, "invalid_type")
            out[field] = value
    response_format = _response_format(doc.get("text"))
    if response_format is not None:
        out["response_format"] = response_format
    return out, chat.tools, chat.notes


def _add_input(chat: _Chat, value: Any) -> None:
    if isinstance(value, str):
        chat.messages.append({"role": "user", "content": value})
        return
    if not isinstance(value, list):
        raise _bad(
            f"`input` must be a string or a list of items, not {_kind(value)}",
            "input",
            "missing_required_parameter" if value is None else "invalid_type",
        )
    for index, item in enumerate(value):
        param = f"input[{index}]"
        if not isinstance(item, dict):
            raise _bad(f"{param} must be an object, not {_kind(item)}", param, "invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            _add_message(chat, item, param)
        elif kind in ("function_call", "custom_tool_call"):
            _add_call(chat, item, param, kind)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            _add_output(chat, item, param)
        elif isinstance(kind, str) and kind in DROPPED_ITEM_TYPES:
            continue
        elif kind == "item_reference":
            raise _bad(
                f"{param}: `item_reference` is not supported: {_STATELESS}", param, "unsupported_parameter"
            )
        else:
            raise _bad(
                f"{param}: input items of type {_shown(kind)} are not supported "
                "(message, function_call, function_call_output, custom_tool_call, "
                "custom_tool_call_output and reasoning are)",
                param,
            )


def _add_message(chat: _Chat, item: dict[str, Any], param: str) -> None:
    role = item.get("role")
    content = item.get("content")
    if role in ("system", "developer"):
        text = _text(content, f"{param}.content")
        if text:
            chat.system.append(text)
    elif role == "user":
        chat.messages.append({"role": "user", "content": _user_content(content, f"{param}.content")})
    elif role == "assistant":
        chat.messages.append({"role": "assistant", "content": _text(content, f"{param}.content")})
    else:
        raise _bad(
            f"{param}.role must be user, assistant, system or developer, not {_shown(role)}", f"{param}.role"
        )


def _text(content: Any, param: str) -> str:
    """A message's text: the string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(
            f"{param} must be a string or a list of parts, not {_kind(content)}", param, "invalid_type"
        )
    texts: list[str] = []
    for index, part in enumerate(content):
        text = _part_text(part, f"{param}[{index}]")
        if text is None:
            raise _bad(f"{param}[{index}]: only text parts are taken here", f"{param}[{index}]")
        texts.append(text)
    return "\n".join(texts)


def _part_text(part: Any, param: str) -> str | None:
    """A text part's text; None for a part that is not text."""
    if not isinstance(part, dict):
        raise _bad(f"{param} must be an object, not {_kind(part)}", param, "invalid_type")
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
        text = part.get("text")
    elif kind == "refusal":
        text = part.get("refusal")
    else:
        return None
    if not isinstance(text, str):
        raise _bad(f"{param}: a {kind} part needs a string `text`", param, "invalid_type")
    return text


def _user_content(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A user message's content: one string when all parts are text, else chat parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(
            f"{param} must be a string or a list of parts, not {_kind(content)}", param, "invalid_type"
        )
    parts: list[dict[str, Any]] = []
    only_text = True
    for index, part in enumerate(content):
        text = _part_text(part, f"{param}[{index}]")
        if text is not None:
            parts.append({"type": "text", "text": text})
        else:
            parts.append(_image_part(part, f"{param}[{index}]"))
            only_text = False
    if only_text:
        return "\n".join(part["text"] for part in parts)
    return parts


def _image_part(part: dict[str, Any], param: str) -> dict[str, Any]:
    kind = part.get("type")
    if kind != "input_image":
        raise _bad(
            f"{param}: content parts of type {_shown(kind)} are not supported (text and images are)", param
        )
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise _bad(
            f"{param}: an input_image needs `image_url` (an https or data: URL); "
            "`file_id` needs stored files, which the gateway does not keep",
            param,
        )
    image: dict[str, Any] = {"url": url}
    if isinstance(part.get("detail"), str):
        image["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image}


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and key != "input" and not value):
        raise _bad(
            f"{param}.{key} must be a non-empty string, not {_kind(value)}", f"{param}.{key}", "invalid_type"
        )
    return value


def _add_call(chat: _Chat, item: dict[str, Any], param: str, kind: str) -> None:
    call_id = _string(item, "call_id", param)
    name = _string(item, "name", param)
    namespace = item.get("namespace")
    if isinstance(namespace, str) and namespace:
        name = flat_name(namespace, name)
    elif namespace is not None:
        raise _bad(f"{param}.namespace must be a string", f"{param}.namespace", "invalid_type")
    if kind == "function_call":
        arguments = _arguments(chat, _string(item, "arguments", param), param)
    else:
        arguments = orjson.dumps({"input": _string(item, "input", param)}).decode()
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = chat.messages[-1] if chat.messages else None
    # Calls that follow an assistant turn belong to it: one chat message with content and tool_calls.
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        chat.messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _arguments(chat: _Chat, arguments: str, param: str) -> str:
    """A past call's arguments as a JSON object: engines parse them to render the history
    (mlx_lm.server fails the whole request on text that is not JSON), and a small model
    writes broken JSON now and then; the client then answered with an error, which stays."""
    if not arguments.strip():
        return "{}"
    try:
        doc = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict):
        return arguments
    chat.notes.append(f'{param}.arguments is not a JSON object; sent as {{"input": <the text>}}')
    return orjson.dumps({"input": arguments}).decode()


def _add_output(chat: _Chat, item: dict[str, Any], param: str) -> None:
    call_id = _string(item, "call_id", param)
    output = item.get("output")
    images: list[dict[str, Any]] = []
    if isinstance(output, str):
        text = output
    elif isinstance(output, list):
        texts: list[str] = []
        for index, part in enumerate(output):
            part_text = _part_text(part, f"{param}.output[{index}]")
            if part_text is not None:
                texts.append(part_text)
            elif isinstance(part, dict) and part.get("type") == "input_image":
                images.append(_image_part(part, f"{param}.output[{index}]"))
            else:
                raise _bad(
                    f"{param}.output[{index}]: only text and image parts are taken",
                    f"{param}.output[{index}]",
                )
        text = "\n".join(texts)
    elif isinstance(output, dict) and isinstance(output.get("content"), str):
        text = output["content"]
    else:
        raise _bad(
            f"{param}.output must be a string or a list of parts, not {_kind(output)}",
            f"{param}.output",
            "invalid_type",
        )
    chat.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
    if images:
        # A chat tool message holds text only: the images follow as the user's.
        chat.messages.append(
            {
                "role": "user",
                "content": [{"type": "text", "text": f"Images from tool call {call_id}:"}, *images],
            }
        )


# ------------------------------------------------------------------ tools


def _tools(chat: _Chat, value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad(f"`tools` must be a list, not {_kind(value)}", "tools", "invalid_type")
    out: list[dict[str, Any]] = []
    dropped: list[str] = []
    for index, tool in enumerate(value):
        param = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise _bad(f"{param} must be an object, not {_kind(tool)}", param, "invalid_type")
        kind = tool.get("type")
        if kind == "function":
            _add_function(chat, out, tool, param, None, "")
        elif kind == "namespace":
            namespace = _string(tool, "name", param)
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise _bad(f"{param}.tools must be a list", f"{param}.tools", "invalid_type")
            about = tool.get("description")
            prefix = f"[{namespace}: {about}] " if isinstance(about, str) and about else f"[{namespace}] "
            for inner_index, function in enumerate(inner):
                inner_param = f"{param}.tools[{inner_index}]"
                if not isinstance(function, dict) or function.get("type", "function") != "function":
                    raise _bad(f"{inner_param}: a namespace holds function tools only", inner_param)
                _add_function(chat, out, function, inner_param, namespace, prefix)
        elif kind == "custom":
            _add_custom(chat, out, tool, param)
        else:
            dropped.append(echo(kind) if isinstance(kind, str) else _kind(kind))
    if dropped:
        chat.notes.append("tools the engine cannot run were left out: " + ", ".join(dropped)[:300])
    return out


def _register(chat: _Chat, name: str, tool: ToolName, param: str) -> bool:
    if name in chat.tools:
        chat.notes.append(f"{param}: a second tool named {echo(name)!r} was left out")
        return False
    chat.tools[name] = tool
    return True


def _add_function(
    chat: _Chat,
    out: list[dict[str, Any]],
    tool: dict[str, Any],
    param: str,
    namespace: str | None,
    prefix: str,
) -> None:
    name = _string(tool, "name", param)
    parameters = tool.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    elif not isinstance(parameters, dict):
        raise _bad(f"{param}.parameters must be a JSON schema object", f"{param}.parameters", "invalid_type")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{param}.description must be a string", f"{param}.description", "invalid_type")
    chat_name = name if namespace is None else flat_name(namespace, name)
    if not _register(chat, chat_name, ToolName("function", name, namespace), param):
        return
    function: dict[str, Any] = {"name": chat_name, "parameters": clean_schema(parameters)}
    if description or prefix:
        function["description"] = prefix + (description or "")
    out.append({"type": "function", "function": function})


def _add_custom(chat: _Chat, out: list[dict[str, Any]], tool: dict[str, Any], param: str) -> None:
    name = _string(tool, "name", param)
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{param}.description must be a string", f"{param}.description", "invalid_type")
    text = (description or f"The {name} tool.") + (
        "\n\nCall it with one string argument, `input`, holding the whole text; "
        "the text itself is freeform, not JSON."
    )
    form = tool.get("format")
    if isinstance(form, dict) and form.get("type") == "grammar":
        definition = form.get("definition")
        syntax = form.get("syntax")
        if isinstance(definition, str) and len(definition) <= GRAMMAR_LIMIT_CHARS:
            kind = syntax if isinstance(syntax, str) else "a"
            text += f"\nThe text must follow this {kind} grammar:\n{definition}"
    elif form is not None and not isinstance(form, dict):
        raise _bad(f"{param}.format must be an object", f"{param}.format", "invalid_type")
    if not _register(chat, name, ToolName("custom", name), param):
        return
    parameters = {
        "type": "object",
        "properties": {"input": {"type": "string", "description": f"The whole freeform input of {name}."}},
        "required": ["input"],
        "additionalProperties": False,
    }
    out.append(
        {"type": "function", "function": {"name": name, "description": text, "parameters": parameters}}
    )


def _tool_choice(chat: _Chat, value: Any) -> Any:
    if value is None or value in ("auto", "none", "required"):
        return value
    if not isinstance(value, dict):
        raise _bad("`tool_choice` must be auto, none, required or an object", "tool_choice")
    kind = value.get("type")
    if kind in ("function", "custom"):
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise _bad("`tool_choice.name` must be a string", "tool_choice.name", "invalid_type")
        if name not in chat.tools:
            raise _bad(f"`tool_choice` names {echo(name)!r}, which is not in `tools`", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    if kind == "allowed_tools":
        mode = value.get("mode")
        chat.notes.append("tool_choice allowed_tools was applied as its mode; the tool list was not narrowed")
        return mode if mode in ("auto", "required") else "auto"
    chat.notes.append(f"tool_choice {_shown(kind)} names a tool the engine cannot run; auto instead")
    return "auto"


def _response_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``.

    A JSON schema goes as ``{"type": "json_object", "schema": ...}``: the form
    llama-cpp-python's server takes and turns into a grammar (its request
    model allows only ``text`` and ``json_object``, so ``json_schema`` would be
    a 422); mlx_lm.server ignores ``response_format`` either way.
    """
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad(f"`text` must be an object, not {_kind(text)}", "text", "invalid_type")
    form = text.get("format")
    if form is None:
        return None
    if not isinstance(form, dict):
        raise _bad("`text.format` must be an object", "text.format", "invalid_type")
    kind = form.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = form.get("schema")
        if not isinstance(schema, dict):
            raise _bad(
                "`text.format.schema` must be a JSON schema object", "text.format.schema", "invalid_type"
            )
        return {"type": "json_object", "schema": clean_schema(schema)}
    raise _bad("`text.format.type` must be text, json_object or json_schema", "text.format.type")


# ----------------------------------------------------------------- stream


@dataclass(slots=True)
class _Open:
    """An output item being streamed."""

    item: dict[str, Any]
    output_index: int
    parts: list[str]
    # The bytes every delta event of this item starts with (all but the delta and sequence number).
    prefix: bytes


class ResponsesTranslator:
    """One ``POST /v1/responses`` served by a chat completions engine (see the module doc)."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self._doc = doc
        self.stream = isinstance(doc, dict) and doc.get("stream") is True
        self.notes: list[str] = []
        self._tools: dict[str, ToolName] = {}
        self._id = "resp_" + os.urandom(12).hex()
        self._created_at = int(time.time())
        self._seq = 0
        self._items: list[dict[str, Any]] = []
        self._text: _Open | None = None  # the open message or reasoning item
        self._calls: dict[Any, _Open] = {}  # open tool calls by the chat index
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None
        self._final: dict[str, Any] | None = None

    def chat_request(self) -> dict[str, Any]:
        out, self._tools, notes = chat_request(self._doc)
        self.notes.extend(notes)
        return out

    # -- events

    def _event(self, payload: dict[str, Any]) -> bytes:
        payload["sequence_number"] = self._seq
        self._seq += 1
        kind: str = payload["type"]
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def _delta(self, item: _Open, delta: str) -> bytes:
        seq = self._seq
        self._seq += 1
        return item.prefix + orjson.dumps(delta) + b',"sequence_number":%d}\n\n' % seq

    def _response(self, status: str) -> dict[str, Any]:
        doc = self._doc
        return {
            "id": self._id,
            "object": "response",
            "created_at": self._created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": doc.get("instructions"),
            "max_output_tokens": doc.get("max_output_tokens"),
            "metadata": doc.get("metadata") if isinstance(doc.get("metadata"), dict) else None,
            "model": doc.get("model"),
            "output": [],
            "parallel_tool_calls": doc.get("parallel_tool_calls") is not False,
            "previous_response_id": None,
            "reasoning": doc.get("reasoning") if isinstance(doc.get("reasoning"), dict) else None,
            "store": False,
            "temperature": doc.get("temperature"),
            "text": doc.get("text") if isinstance(doc.get("text"), dict) else {"format": {"type": "text"}},
            "tool_choice": doc.get("tool_choice") or "auto",
            "tools": doc.get("tools") or [],
            "top_p": doc.get("top_p"),
            "truncation": "disabled",
            "usage": None,
        }

    def start(self) -> bytes:
        if not self.stream:
            return b""
        created = self._event({"type": "response.created", "response": self._response("in_progress")})
        return created + self._event(
            {"type": "response.in_progress", "response": self._response("in_progress")}
        )

    def keepalive(self) -> bytes:
        """Before any output, ``response.in_progress`` again (Codex ignores it, and its idle timer
        starts again; the SDK's snapshot is the same empty response); after, an SSE comment."""
        if not self.stream:
            return b""
        if self._items:
            return b": keepalive\n\n"
        return self._event({"type": "response.in_progress", "response": self._response("in_progress")})

    # -- chunks

    def feed(self, chunk: dict[str, Any]) -> bytes:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        choices = chunk.get("choices")
        if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
            return b""
        choice = choices[0]
        out = b""
        delta = choice.get("delta")
        if isinstance(delta, dict):
            reasoning = delta.get("reasoning_content")
            if reasoning is None:
                reasoning = delta.get("reasoning")
            if reasoning and isinstance(reasoning, str):
                out += self._add_text("reasoning", reasoning)
            content = delta.get("content")
            if content and isinstance(content, str):
                out += self._add_text("message", content)
            calls = delta.get("tool_calls")
            if calls and isinstance(calls, list):
                for call in calls:
                    if isinstance(call, dict):
                        out += self._add_call(call)
        finish_reason = choice.get("finish_reason")
        if isinstance(finish_reason, str):
            self._finish_reason = finish_reason
        return out

    def _add_text(self, kind: str, text: str) -> bytes:
        item = self._text
        out = b""
        if item is None or item.item["type"] != kind:
            out = self._close_text("completed") + self._open_text(kind)
            item = self._text
            assert item is not None
        item.parts.append(text)
        return (out + self._delta(item, text)) if self.stream else out

    def _open_text(self, kind: str) -> bytes:
        index = len(self._items)
        if kind == "message":
            item_id = f"msg_{self._id[5:]}_{index}"
            item: dict[str, Any] = {
                "id": item_id,
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            head = b'{"type":"response.output_text.delta","item_id":"%s","output_index":%d,"content_index":0,'
            prefix = b"event: response.output_text.delta\ndata: " + head % (item_id.encode(), index)
            prefix += b'"logprobs":[],"delta":'
        else:
            item_id = f"rs_{self._id[5:]}_{index}"
            item = {"id": item_id, "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
            head = (
                b'{"type":"response.reasoning_text.delta","item_id":"%s","output_index":%d,"content_index":0,'
            )
            prefix = b"event: response.reasoning_text.delta\ndata: " + head % (item_id.encode(), index)
            prefix += b'"delta":'
        self._items.append(item)
        self._text = _Open(item, index, [], prefix)
        if not self.stream:
            return b""
        added = self._event({"type": "response.output_item.added", "output_index": index, "item": dict(item)})
        return added + self._event(
            {
                "type": "response.content_part.added",
                "item_id": item_id,
                "output_index": index,
                "content_index": 0,
                "part": part,
            }
        )

    def _close_text(self, status: str, *, emit: bool = True) -> bytes:
        open_ = self._text
        if open_ is None:
            return b""
        self._text = None
        item = open_.item
        text = "".join(open_.parts)
        if item["type"] == "message":
            part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            done: dict[str, Any] = {"type": "response.output_text.done", "text": text, "logprobs": []}
        else:
            part = {"type": "reasoning_text", "text": text}
            done = {"type": "response.reasoning_text.done", "text": text}
        item["content"] = [part]
        item["status"] = status
        if not (emit and self.stream):
            return b""
        ids = {"item_id": item["id"], "output_index": open_.output_index, "content_index": 0}
        out = self._event(done | ids)
        out += self._event({"type": "response.content_part.done", **ids, "part": part})
        return out + self._event(
            {"type": "response.output_item.done", "output_index": open_.output_index, "item": item}
        )

    def _add_call(self, call: dict[str, Any]) -> bytes:
        key = call.get("index")
        if not isinstance(key, int) or isinstance(key, bool):
            # No index (a server that sends each call whole): each delta with an id is a new call.
            key = call.get("id") if isinstance(call.get("id"), str) else len(self._calls)
        function = call.get("function")
        if not isinstance(function, dict):
            function = {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = orjson.dumps(arguments).decode() if isinstance(arguments, dict) else ""
        open_ = self._calls.get(key)
        if open_ is None:
            out = self._close_text("completed") + self._open_call(key, call, function)
            open_ = self._calls[key]
        else:
            out = b""
            name = function.get("name")
            if isinstance(name, str) and name and not open_.item["name"]:
                # A name sent after the call's first delta; one repeated in every delta is kept once.
                tool = self._tools.get(name)
                open_.item["name"] = tool.name if tool is not None else name
                if tool is not None and tool.namespace is not None:
                    open_.item["namespace"] = tool.namespace
        if arguments:
            open_.parts.append(arguments)
            if self.stream and open_.item["type"] == "function_call":
                out += self._delta(open_, arguments)
        return out

    def _open_call(self, key: Any, call: dict[str, Any], function: dict[str, Any]) -> bytes:
        index = len(self._items)
        name = function.get("name")
        name = name if isinstance(name, str) else ""
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            call_id = f"call_{self._id[5:]}_{index}"
        tool = self._tools.get(name)
        item: dict[str, Any]
        if tool is not None and tool.kind == "custom":
            item_id = f"ctc_{self._id[5:]}_{index}"
            item = {"id": item_id, "type": "custom_tool_call", "status": "in_progress", "call_id": call_id}
            item |= {"name": tool.name, "input": ""}
            prefix = b""  # the input is sent whole at the end: it is a string inside the arguments' JSON
        else:
            item_id = f"fc_{self._id[5:]}_{index}"
            item = {"id": item_id, "type": "function_call", "status": "in_progress", "call_id": call_id}
            item |= {"name": tool.name if tool is not None else name, "arguments": ""}
            if tool is not None and tool.namespace is not None:
                item["namespace"] = tool.namespace
            head = (
                b'{"type":"response.function_call_arguments.delta","item_id":"%s","output_index":%d,"delta":'
            )
            prefix = b"event: response.function_call_arguments.delta\ndata: " + head % (
                item_id.encode(),
                index,
            )
        self._items.append(item)
        self._calls[key] = _Open(item, index, [], prefix)
        if not self.stream:
            return b""
        return self._event({"type": "response.output_item.added", "output_index": index, "item": dict(item)})

    def _close_call(self, open_: _Open, status: str, *, emit: bool = True) -> bytes:
        item = open_.item
        arguments = "".join(open_.parts)
        item["status"] = status
        ids = {"item_id": item["id"], "output_index": open_.output_index}
        if item["type"] == "custom_tool_call":
            text = custom_input(arguments)
            item["input"] = text
            if not (emit and self.stream):
                return b""
            out = b""
            if text:
                out += self._event({"type": "response.custom_tool_call_input.delta", **ids, "delta": text})
            out += self._event({"type": "response.custom_tool_call_input.done", **ids, "input": text})
        else:
            item["arguments"] = arguments
            if not (emit and self.stream):
                return b""
            done = {"type": "response.function_call_arguments.done", **ids, "name": item["name"]}
            out = self._event(done | {"arguments": arguments})
        return out + self._event(
            {"type": "response.output_item.done", "output_index": open_.output_index, "item": item}
        )

    # -- the end

    def _close_all(self, status: str, *, emit: bool = True) -> bytes:
        out = self._close_text(status, emit=emit)
        for open_ in self._calls.values():
            out += self._close_call(open_, status, emit=emit)
        self._calls = {}
        return out

    def finish(self) -> bytes:
        reason = self._finish_reason
        incomplete = reason == "length" or reason == "content_filter"
        out = self._close_all("incomplete" if incomplete else "completed")
        response = self._response("incomplete" if incomplete else "completed")
        if incomplete:
            response["incomplete_details"] = {
                "reason": "max_output_tokens" if reason == "length" else "content_filter"
            }
        else:
            response["completed_at"] = int(time.time())
        response["output"] = self._items
        response["usage"] = response_usage(self._usage)
        self._final = response
        if not self.stream:
            return b""
        return out + self._event({"type": f"response.{response['status']}", "response": response})

    def failed(self, status: int, message: str, code: str | None) -> bytes:
        # What was streamed stays in the output, unfinished; no more item events.
        self._close_all("incomplete", emit=False)
        response = self._response("failed")
        if code is None:
            code = "rate_limit_exceeded" if status == 429 else "server_error"
        response["error"] = {"code": code, "message": message}
        response["output"] = self._items
        response["usage"] = response_usage(self._usage)
        self._final = response
        if not self.stream:
            return b""
        return self._event({"type": "response.failed", "response": response})

    def reply(self) -> bytes:
        if self._final is None:
            self.finish()
        return orjson.dumps(self._final)


def custom_input(arguments: str) -> str:
    """A custom tool's freeform input from the chat call's arguments.

    The function takes ``{"input": "..."}``; a model that wrote the text
    bare, or under another single key, still gets its text through.
    """
    try:
        doc = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(doc, dict):
        value = doc.get("input")
        if isinstance(value, str):
            return value
        strings = [v for v in doc.values() if isinstance(v, str)]
        if len(strings) == 1:
            return strings[0]
    if isinstance(doc, str):
        return doc
    return arguments


def response_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat usage as Responses usage (Codex parses all five numbers)."""
    if usage is None:
        return None
    prompt = _count(usage.get("prompt_tokens"))
    completion = _count(usage.get("completion_tokens"))
    total = _count(usage.get("total_tokens")) or min(prompt + completion, _MAX_COUNT)
    prompt_details = usage.get("prompt_tokens_details")
    completion_details = usage.get("completion_tokens_details")
    cached = _count(prompt_details.get("cached_tokens")) if isinstance(prompt_details, dict) else 0
    reasoning = (
        _count(completion_details.get("reasoning_tokens")) if isinstance(completion_details, dict) else 0
    )
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": total,
    }


# The most a count may be: a signed 64-bit integer's (Codex reads them as i64; past 2**64 orjson
# cannot write the sum of an engine's two counts at all).
_MAX_COUNT = 2**63 - 1


def _count(value: Any) -> int:
    return (
        min(value, _MAX_COUNT) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
    )
