"""The API endpoints the relay serves: each one object, holding what differs between APIs.

An endpoint has its paths (with and without ``/v1``), its metric label, the
upstream endpoint it is sent to, how its input is checked, how its stream
ends, its error envelope and how its reply is built. Chat and text
completions and embeddings are relayed byte for byte. The Anthropic Messages
API (``/v1/messages``, ``/v1/messages/count_tokens``) and the OpenAI
Responses API (``/v1/responses``) go through untouched to an engine that
serves them itself (its spec's, or its model's config's, ``native-apis``) and
are translated to chat completions for one that does not (``translate``).
Adding the next API is one more ``Endpoint`` here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.errors import ANTHROPIC, OPENAI, RESPONSES, Envelope
from proxy.translate import Translator
from proxy.translate.anthropic import CountTokensTranslator, MessagesTranslator
from proxy.translate.responses import ResponsesTranslator


def _done(tail: bytes, last: bytes) -> bool:
    """OpenAI's chat and text completions: ``data: [DONE]``, or an error event (a chained gateway's)."""
    return b"[DONE]" in tail or b'{"error"' in last


def _starts(*names: bytes) -> tuple[bytes, ...]:
    """How an event named one of ``names`` starts: its ``event:`` line, or its data's ``type`` first."""
    return tuple(
        start
        for name in names
        for start in (
            b"event: " + name + b"\n",
            b"event: " + name + b"\r\n",
            b'data: {"type":"' + name + b'"',
            b'data: {"type": "' + name + b'"',
        )
    )


# Each API's last events: its end, whatever the outcome (an error included).
_MESSAGE_ENDS = _starts(b"message_stop", b"error")
_RESPONSE_ENDS = _starts(b"response.completed", b"response.failed", b"response.incomplete", b"error")


def _message_stop(tail: bytes, head: bytes) -> bool:
    """The Messages API's: its last event is ``message_stop``, or an ``error`` event."""
    return head.startswith(_MESSAGE_ENDS)


def _response_end(tail: bytes, head: bytes) -> bool:
    """The Responses API's: its last event is ``response.completed``, ``.failed`` or ``.incomplete``,
    or an ``error`` event."""
    return head.startswith(_RESPONSE_ENDS)


@dataclass(frozen=True, eq=False, slots=True)
class Endpoint:
    """One API endpoint as the relay serves it."""

    # Below /v1, as the metric label and the access log name it ("chat/completions").
    name: str
    # Where it is sent on an engine that serves it (below the upstream's /v1).
    target: bytes
    envelope: Envelope
    # Whether a stream's end ends it by this API's rules: given its last bytes and, for an
    # endpoint of an ``api``, the first bytes of its last event (else its last write).
    ends_stream: Callable[[bytes, bytes], bool]
    # The API it belongs to, where engines may or may not serve it ("messages", "responses");
    # None: every engine does (chat and text completions, embeddings).
    api: str | None = None
    # For an engine that does not serve ``api``: the request's translation to a chat completion.
    translate: Callable[[dict[str, Any]], Translator] | None = None
    # The field that caps the tokens generated (a model's max-tokens sets it), if the endpoint generates.
    max_tokens_field: str | None = None
    # What ends its stream, as an error message names it.
    end_name: str = "[DONE]"
    # A translated request's chat fields that the client named otherwise (chat's name → the API's):
    # a refusal of the chat document names the client's field.
    renamed: Mapping[str, str] = field(default_factory=dict)

    @property
    def paths(self) -> tuple[str, str]:
        return (f"/v1/{self.name}", f"/{self.name}")


CHAT = Endpoint("chat/completions", b"/chat/completions", OPENAI, _done, max_tokens_field="max_tokens")
COMPLETIONS = Endpoint("completions", b"/completions", OPENAI, _done, max_tokens_field="max_tokens")
EMBEDDINGS = Endpoint("embeddings", b"/embeddings", OPENAI, _done)
MESSAGES = Endpoint(
    "messages",
    b"/messages",
    ANTHROPIC,
    _message_stop,
    api="messages",
    translate=MessagesTranslator,
    max_tokens_field="max_tokens",
    end_name="message_stop",
    renamed={"stop": "stop_sequences"},
)
COUNT_TOKENS = Endpoint(
    "messages/count_tokens",
    b"/messages/count_tokens",
    ANTHROPIC,
    _message_stop,
    api="messages",
    translate=CountTokensTranslator,
    end_name="message_stop",
)
RESPONSES_API = Endpoint(
    "responses",
    b"/responses",
    RESPONSES,
    _response_end,
    api="responses",
    translate=ResponsesTranslator,
    max_tokens_field="max_output_tokens",
    end_name="response.completed",
    renamed={"max_tokens": "max_output_tokens"},
)

ALL: tuple[Endpoint, ...] = (CHAT, COMPLETIONS, EMBEDDINGS, MESSAGES, COUNT_TOKENS, RESPONSES_API)
# The APIs an engine may serve itself (a spec's or a model's native-apis).
NATIVE_APIS = frozenset(e.api for e in ALL if e.api is not None)

# Client path → endpoint. Paths without /v1 are served too: clients often get the base URL wrong.
ENDPOINTS: Mapping[str, Endpoint] = {path: e for e in ALL for path in e.paths}


def envelope_of(path: str) -> Envelope:
    """The error envelope of the API ``path`` belongs to (OpenAI's for any other path)."""
    endpoint = ENDPOINTS.get(path)
    return OPENAI if endpoint is None else endpoint.envelope
