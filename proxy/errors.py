"""Errors: the one type the gateway raises, and each API's envelope that renders it.

``HTTPError`` is every error a client is told of: the gateway's refusals and
the upstream's failures (``proxy.upstream_errors.UpstreamError`` is one). An
``Envelope`` writes it in the shape of the API the request came in on:
OpenAI clients read ``{"error": {"message", "type", "param", "code"}}`` and
nothing else (openai-python shows ``error.message`` and picks the exception
class from the status); Anthropic clients ``{"type": "error", "error":
{"type", "message"}}``, and after a stream has started an ``event: error``.
Engines answer in other shapes (mlx_lm.server sends ``{"error": "text"}``,
FastAPI servers ``{"detail": ...}``, some an HTML page), so every error that
reaches a client goes through this module.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson

# How much of an upstream's non-JSON error body to quote in the message.
_QUOTE_LIMIT_CHARS = 300


class HTTPError(Exception):
    """An error answered before the response has started."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers

    def body(self) -> bytes:
        return error_body(self.status, self.message, code=self.code, param=self.param)


# The most of a client's own input (a model name, a path) an error message repeats.
ECHO_LIMIT = 64


def echo(value: str, limit: int = ECHO_LIMIT) -> str:
    """Client input as an error message repeats it: cut to a short prefix, saying how long it was."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}… ({len(value)} characters)"


def error_type(status: int) -> str:
    """The OpenAI error ``type`` for an HTTP status."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    type_: str | None = None,
) -> bytes:
    """Serialise one error in OpenAI's envelope."""
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": type_ or error_type(status),
                "param": param,
                "code": code,
            }
        }
    )


def sse_error_event(status: int, message: str, *, code: str | None = None) -> bytes:
    """One SSE event carrying an error, for failures after a stream has started.

    openai-python raises ``APIError`` when a ``data:`` event holds an ``error``.
    """
    return b"data: " + error_body(status, message, code=code) + b"\n\n"


def normalize_error(status: int, body: bytes) -> bytes:
    """Rewrite an upstream's error body into OpenAI's envelope.

    A body that already is the envelope, with all four keys, comes back as
    it was, byte for byte.
    """
    try:
        doc: Any = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            if all(key in err for key in ("message", "type", "param", "code")):
                return body
            return _envelope(status, err["message"], err)
        for key in ("error", "detail", "message"):
            value = doc.get(key)
            if isinstance(value, str) and value:
                return _envelope(status, value, doc)
        if isinstance(doc.get("detail"), list):
            # FastAPI validation errors: a list of {"loc", "msg", ...}.
            return _envelope(status, orjson.dumps(doc["detail"]).decode(), doc)
    code = "not_found" if status == 404 else _default_code(status)
    return error_body(status, _describe(status, body), code=code)


def _envelope(status: int, message: str, source: dict[str, Any]) -> bytes:
    type_ = source.get("type")
    param = source.get("param")
    code = source.get("code")
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": type_ if isinstance(type_, str) and type_ else error_type(status),
                "param": param if isinstance(param, str) else None,
                "code": code if isinstance(code, (str, int)) else _default_code(status),
            }
        }
    )


def _describe(status: int, body: bytes) -> str:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown Status"
    text = body.decode("utf-8", "replace").strip()
    if not text or text.startswith("<"):
        # An HTML error page says nothing a client can use.
        return f"upstream answered {status} {phrase}"
    if len(text) > _QUOTE_LIMIT_CHARS:
        text = text[:_QUOTE_LIMIT_CHARS] + "..."
    return f"upstream answered {status} {phrase}: {text}"


def _default_code(status: int) -> str | None:
    # Not "not_found" for a JSON 404: mlx_lm.server answers 404 for
    # generation failures too, and its text says which it was.
    if status == 429:
        return "rate_limit_exceeded"
    return None


class Envelope:
    """How one API writes an error: before a response (a JSON body) and inside a started stream.

    This one is OpenAI's (chat and text completions, embeddings, Responses);
    ``ANTHROPIC`` is the Messages API's.
    """

    name = "openai"

    def body(self, error: HTTPError) -> bytes:
        """The JSON body of an error answered before the response has started."""
        return error_body(error.status, error.message, code=error.code, param=error.param)

    def event(self, status: int, message: str, code: str | None) -> bytes:
        """One SSE event that ends a started stream with an error."""
        return sse_error_event(status, message, code=code)

    def upstream(self, status: int, body: bytes) -> bytes:
        """An upstream's error body (any shape) in this envelope."""
        return normalize_error(status, body)

    def only_event(self, status: int, message: str, code: str | None) -> bytes:
        """The events of a stream the gateway started itself (its heartbeats) and ends with an
        error before the upstream sent any."""
        return self.event(status, message, code)


class ResponsesEnvelope(Envelope):
    """OpenAI's envelope; in a started Responses stream, ``response.failed`` with the error in its
    response (what Codex and the openai SDK read as a failed response; the gateway knows no more
    of the response it passed on than that it failed)."""

    name = "responses"

    def event(self, status: int, message: str, code: str | None) -> bytes:
        doc = {
            "type": "response.failed",
            "response": {
                "object": "response",
                "status": "failed",
                "error": {"code": code or error_type(status), "message": message},
                "output": [],
            },
        }
        return b"event: response.failed\ndata: " + orjson.dumps(doc) + b"\n\n"

    def only_event(self, status: int, message: str, code: str | None) -> bytes:
        # The openai SDK's stream helper reads no event before response.created (a RuntimeError).
        created = {"type": "response.created", "response": {"object": "response", "status": "in_progress"}}
        return (
            b"event: response.created\ndata: "
            + orjson.dumps(created)
            + b"\n\n"
            + self.event(status, message, code)
        )


# Anthropic's error types by status (its "Errors" page); 529 is its "overloaded".
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    """The Anthropic error ``type`` for an HTTP status."""
    return _ANTHROPIC_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(status: int, message: str) -> bytes:
    """One error in Anthropic's envelope."""
    return orjson.dumps(
        {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}
    )


class AnthropicEnvelope(Envelope):
    """The Messages API's: ``{"type": "error", "error": {"type", "message"}}``, and
    ``event: error`` in a stream."""

    name = "anthropic"

    def body(self, error: HTTPError) -> bytes:
        return anthropic_error_body(error.status, error.message)

    def event(self, status: int, message: str, code: str | None) -> bytes:
        return b"event: error\ndata: " + anthropic_error_body(status, message) + b"\n\n"

    def upstream(self, status: int, body: bytes) -> bytes:
        try:
            doc: Any = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            doc = None
        if isinstance(doc, dict) and doc.get("type") == "error":
            err = doc.get("error")
            if (
                isinstance(err, dict)
                and isinstance(err.get("type"), str)
                and isinstance(err.get("message"), str)
            ):
                return body  # already Anthropic's (an engine that serves the API itself)
        message = orjson.loads(normalize_error(status, body))["error"]["message"]
        return anthropic_error_body(status, message)


OPENAI = Envelope()
RESPONSES = ResponsesEnvelope()
ANTHROPIC = AnthropicEnvelope()
