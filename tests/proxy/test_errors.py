"""proxy.errors: the OpenAI error envelope, made and normalised."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.errors import (
    ANTHROPIC,
    ECHO_LIMIT,
    RESPONSES,
    HTTPError,
    echo,
    error_body,
    error_type,
    normalize_error,
    sse_error_event,
)
from proxy.upstream_errors import HeadTimeout

ENVELOPE_KEYS = {"message", "type", "param", "code"}

# What http.server.BaseHTTPRequestHandler sends for a method it lacks (mlx_lm.server on HEAD/PUT).
BASEHTTP_501_PAGE = b"""<!DOCTYPE HTML>
<html lang="en">
    <head>
        <meta charset="utf-8">
        <title>Error response</title>
    </head>
    <body>
        <h1>Error response</h1>
        <p>Error code: 501</p>
        <p>Message: Unsupported method ('PUT').</p>
        <p>Error code explanation: 501 - Server does not support this operation.</p>
    </body>
</html>
"""


def error_of(body: bytes) -> dict[str, Any]:
    """The inner ``error`` object of an envelope, checked for its exact shape."""
    doc = orjson.loads(body)
    assert isinstance(doc, dict)
    assert set(doc) == {"error"}
    err = doc["error"]
    assert isinstance(err, dict)
    assert set(err) == ENVELOPE_KEYS
    return err


def test_error_body_has_exactly_the_four_openai_keys() -> None:
    """error_body serialises {"error": {message, type, param, code}} and nothing else."""
    err = error_of(error_body(400, "bad", code="invalid_json", param="model"))
    assert err == {
        "message": "bad",
        "type": "invalid_request_error",
        "param": "model",
        "code": "invalid_json",
    }


def test_error_body_defaults_param_and_code_to_null() -> None:
    """Without code or param, both are present as null rather than missing."""
    err = error_of(error_body(404, "nope"))
    assert err["param"] is None
    assert err["code"] is None


def test_error_body_explicit_type_wins_over_status() -> None:
    """An explicit type_ replaces the one derived from the status."""
    assert error_of(error_body(400, "m", type_="custom_error"))["type"] == "custom_error"


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "invalid_request_error"),
        (405, "invalid_request_error"),
        (413, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "server_error"),
        (502, "server_error"),
        (503, "server_error"),
        (504, "server_error"),
    ],
)
def test_error_type_per_status(status: int, expected: str) -> None:
    """Each status maps to the OpenAI error type openai-python expects for it."""
    assert error_type(status) == expected


def test_http_error_body_carries_status_message_code_and_param() -> None:
    """HTTPError.body() is the envelope of its own status, message, code and param."""
    exc = HTTPError(413, "too large", code="body_too_large", param="messages", headers=((b"x", b"y"),))
    assert str(exc) == "too large"
    assert exc.headers == ((b"x", b"y"),)
    assert error_of(exc.body()) == {
        "message": "too large",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "body_too_large",
    }


def test_normalize_mlx_flat_error_string_keeps_the_text() -> None:
    """mlx_lm.server's flat {"error": "text"} becomes the envelope with the text as message."""
    err = error_of(normalize_error(404, b'{"error": "Model not found: foo"}'))
    assert err["message"] == "Model not found: foo"
    assert err["type"] == "invalid_request_error"
    assert err["param"] is None
    # mlx uses 404 for generation failures too: no "not_found" code is made up.
    assert err["code"] is None


def test_normalize_full_envelope_is_byte_identical() -> None:
    """An upstream body that already is the full OpenAI envelope passes through byte for byte."""
    body = b'{ "error" : {"message":"m", "type":"invalid_request_error","param":null,"code":"x"},"extra":1}'
    assert normalize_error(400, body) == body


def test_normalize_partial_envelope_fills_type_param_code() -> None:
    """An envelope with only a message gets type, param and code filled from the status."""
    err = error_of(normalize_error(429, b'{"error": {"message": "slow down"}}'))
    assert err == {
        "message": "slow down",
        "type": "rate_limit_error",
        "param": None,
        "code": "rate_limit_exceeded",
    }


def test_normalize_partial_envelope_keeps_what_it_has() -> None:
    """A partial envelope's own type and param survive normalisation."""
    body = b'{"error": {"message": "m", "type": "BadRequestError", "param": "temperature"}}'
    err = error_of(normalize_error(400, body))
    assert err["type"] == "BadRequestError"
    assert err["param"] == "temperature"
    assert err["code"] is None


def test_normalize_fastapi_detail_string() -> None:
    """FastAPI's {"detail": "x"} becomes the envelope with message "x"."""
    err = error_of(normalize_error(404, b'{"detail": "Not Found"}'))
    assert err["message"] == "Not Found"
    assert err["type"] == "invalid_request_error"


def test_normalize_fastapi_validation_detail_list() -> None:
    """FastAPI's {"detail": [...]} validation list is kept, as JSON text, in the message."""
    detail = [{"loc": ["body", "messages"], "msg": "field required", "type": "value_error.missing"}]
    err = error_of(normalize_error(422, orjson.dumps({"detail": detail})))
    assert orjson.loads(err["message"]) == detail
    assert err["type"] == "invalid_request_error"


def test_normalize_old_vllm_flat_error_object() -> None:
    """Old vLLM's flat {"object": "error", "message", "type", ...} keeps its message and type."""
    body = b'{"object":"error","message":"m","type":"BadRequestError","param":null,"code":400}'
    err = error_of(normalize_error(400, body))
    assert err == {"message": "m", "type": "BadRequestError", "param": None, "code": 400}


def test_normalize_html_page_gives_status_line_without_html() -> None:
    """An HTML error page (BaseHTTPRequestHandler's 501) becomes a one-line message with no markup."""
    err = error_of(normalize_error(501, BASEHTTP_501_PAGE))
    assert err["message"] == "upstream answered 501 Not Implemented"
    assert err["type"] == "server_error"


def test_normalize_html_page_with_leading_whitespace() -> None:
    """Whitespace before the HTML does not make it quotable text."""
    err = error_of(normalize_error(502, b"\r\n  <html><body>bad gateway</body></html>"))
    assert err["message"] == "upstream answered 502 Bad Gateway"


def test_normalize_plain_text_is_quoted() -> None:
    """A short plain-text body is quoted after the status line."""
    err = error_of(normalize_error(500, b"  engine exploded\n"))
    assert err["message"] == "upstream answered 500 Internal Server Error: engine exploded"


def test_normalize_long_plain_text_is_truncated() -> None:
    """Plain text past 300 characters is cut there and marked with an ellipsis."""
    err = error_of(normalize_error(500, b"x" * 1000))
    assert err["message"] == "upstream answered 500 Internal Server Error: " + "x" * 300 + "..."


def test_normalize_text_of_exactly_the_limit_is_not_truncated() -> None:
    """Plain text of exactly 300 characters is quoted whole, with no ellipsis."""
    err = error_of(normalize_error(500, b"y" * 300))
    assert err["message"].endswith(": " + "y" * 300)


def test_normalize_empty_body() -> None:
    """An empty body becomes the status line alone, with the status's default code."""
    err = error_of(normalize_error(404, b""))
    assert err["message"] == "upstream answered 404 Not Found"
    assert err["code"] == "not_found"


def test_normalize_unknown_status_has_a_phrase() -> None:
    """A status http.HTTPStatus does not know still gets a readable message."""
    err = error_of(normalize_error(599, b""))
    assert err["message"] == "upstream answered 599 Unknown Status"
    assert err["type"] == "server_error"


def test_normalize_invalid_utf8_does_not_raise() -> None:
    """A body that is not UTF-8 is quoted with replacement characters, not an exception."""
    err = error_of(normalize_error(500, b"bad \xff\xfe bytes"))
    assert err["message"] == "upstream answered 500 Internal Server Error: bad \ufffd\ufffd bytes"


@pytest.mark.parametrize(
    "body",
    [b"[1, 2]", b'"just a string"', b"42", b"null", b"{}", b'{"error": ""}', b'{"error": {"message": 5}}'],
)
def test_normalize_json_without_a_usable_message_is_quoted(body: bytes) -> None:
    """JSON with no usable message (non-object, empty, wrong types) is quoted as text."""
    err = error_of(normalize_error(500, body))
    assert err["message"] == "upstream answered 500 Internal Server Error: " + body.decode()


def test_sse_error_event_is_one_parseable_data_event() -> None:
    """sse_error_event is exactly one `data: {...}` line ended by a blank line."""
    event = sse_error_event(502, "upstream closed mid-stream", code="upstream_truncated")
    assert event.startswith(b"data: ")
    assert event.endswith(b"\n\n")
    payload = event[len(b"data: ") : -2]
    assert b"\n" not in payload
    err = error_of(payload)
    assert err == {
        "message": "upstream closed mid-stream",
        "type": "server_error",
        "param": None,
        "code": "upstream_truncated",
    }


def test_sse_error_event_escapes_newlines_in_message() -> None:
    """A newline in the message is JSON-escaped, so it cannot split the SSE event."""
    event = sse_error_event(500, "line one\nline two\r\n\r\ndata: fake")
    assert event.count(b"\n") == 2
    assert error_of(event[len(b"data: ") : -2])["message"] == "line one\nline two\r\n\r\ndata: fake"


def test_echo_keeps_short_input_and_cuts_long_input_to_a_prefix() -> None:
    """Input up to the limit is repeated whole; longer input as its prefix and its length."""
    assert echo("qwen") == "qwen"
    assert echo("x" * ECHO_LIMIT) == "x" * ECHO_LIMIT
    assert echo("y" * 10_000) == "y" * ECHO_LIMIT + "… (10000 characters)"


def test_anthropic_envelope_has_its_type_and_message() -> None:
    """Errors on the Messages API are {"type": "error", "error": {"type", "message"}}, typed by status."""
    body = orjson.loads(ANTHROPIC.body(HTTPError(404, "no such model", code="model_not_found")))
    assert body == {"type": "error", "error": {"type": "not_found_error", "message": "no such model"}}
    for status, kind in [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (429, "rate_limit_error"),
    ]:
        assert orjson.loads(ANTHROPIC.body(HTTPError(status, "x")))["error"]["type"] == kind
    assert orjson.loads(ANTHROPIC.body(HTTPError(503, "x")))["error"]["type"] == "overloaded_error"
    assert orjson.loads(ANTHROPIC.body(HTTPError(502, "x")))["error"]["type"] == "api_error"


def test_anthropic_stream_error_is_an_error_event() -> None:
    """A started Messages stream ends with `event: error` and Anthropic's envelope as its data."""
    event = ANTHROPIC.event(502, "cut short", "upstream_truncated")
    name, data = event.rstrip(b"\n").split(b"\n")
    assert name == b"event: error"
    assert orjson.loads(data.removeprefix(b"data: "))["error"] == {
        "type": "api_error",
        "message": "cut short",
    }


def test_anthropic_envelope_rewrites_upstream_errors_and_keeps_its_own() -> None:
    """An engine's OpenAI-shaped or plain error becomes Anthropic's; one already Anthropic's stays as sent."""
    mlx = ANTHROPIC.upstream(404, b'{"error": "generation thread died"}')
    assert orjson.loads(mlx) == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "generation thread died"},
    }
    own = b'{"type":"error","error":{"type":"invalid_request_error","message":"bad"}}'
    assert ANTHROPIC.upstream(400, own) == own
    html = orjson.loads(ANTHROPIC.upstream(500, b"<html>oops</html>"))
    assert html["error"]["type"] == "api_error" and "500" in html["error"]["message"]


def test_responses_stream_error_is_a_failed_response() -> None:
    """A started Responses stream ends with `response.failed`, its error's code and message in it."""
    event = RESPONSES.event(504, "timed out", "upstream_timeout")
    name, data = event.rstrip(b"\n").split(b"\n")
    doc = orjson.loads(data.removeprefix(b"data: "))
    assert name == b"event: response.failed"
    assert doc["type"] == "response.failed" and doc["response"]["status"] == "failed"
    assert doc["response"]["error"] == {"code": "upstream_timeout", "message": "timed out"}


def test_upstream_errors_are_http_errors() -> None:
    """There is one error type: an upstream failure is an HTTPError with its class's status and code."""
    error = HeadTimeout("no head")
    assert isinstance(error, HTTPError)
    assert (error.status, error.code, error.message) == (504, "upstream_timeout", "no head")
