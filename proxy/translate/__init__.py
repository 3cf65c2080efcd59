"""Translation between APIs an engine lacks and the chat completions it serves.

An engine that serves only chat completions (mlx_lm.server,
llama-cpp-python) still serves the Anthropic Messages and OpenAI Responses
APIs through the gateway: the request becomes one chat completion (always a
stream with usage), and the chat stream becomes that API's events, event by
event as the tokens come, or its one JSON reply. Pure: no sockets; the relay
(``proxy.relay.translated``) drives a ``Translator`` per request.
"""

from __future__ import annotations

from typing import Any, Protocol


class Translator(Protocol):
    """One request's translation, made per request from the client's parsed body.

    The relay calls ``chat_request`` once; then, for a 200 event stream from
    the engine, ``start`` once, ``feed`` for each ``chat.completion.chunk``
    (parsed) in order (``keepalive`` in long waits between them), and
    ``finish`` after ``data: [DONE]``; for a stream
    that breaks or ends without ``[DONE]``, ``failed`` instead of ``finish``.
    A stream request gets the bytes ``start``, ``feed``, ``finish`` and
    ``failed`` return, as they are returned; a non-stream request gets
    ``reply()`` after ``finish`` (they return b"" then).
    """

    # Whether the client asked for a stream (its own API's "stream": true).
    stream: bool
    # What was left out or changed and the log should say (a tool the engine cannot run).
    notes: list[str]

    def chat_request(self) -> dict[str, Any]:
        """The chat completion to send: ``model`` as the client gave it, ``stream`` true,
        ``stream_options.include_usage`` true. Raises ``proxy.errors.HTTPError`` (400)
        for a body the API itself refuses."""
        ...

    def start(self) -> bytes:
        """The events that open the stream (before the engine's first token)."""
        ...

    def feed(self, chunk: dict[str, Any]) -> bytes:
        """One ``chat.completion.chunk`` of the engine's → this API's events for it (maybe none)."""
        ...

    def finish(self) -> bytes:
        """The events that end the stream after the engine's ``[DONE]``."""
        ...

    def keepalive(self) -> bytes:
        """An event that says the stream is alive while the engine sends nothing (a long prefill):
        one the API defines and its clients ignore, so that their idle timers start again."""
        ...

    def failed(self, status: int, message: str, code: str | None) -> bytes:
        """The events that end a stream the engine broke: this API's own error end."""
        ...

    def reply(self) -> bytes:
        """Non-stream: the whole JSON reply, after ``finish``."""
        ...
