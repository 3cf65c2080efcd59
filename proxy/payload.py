"""Reading the request body: the one place the gateway looks inside it.

The body is parsed once, for routing, and forwarded as the client's bytes.
Besides ``model``, only the few fields that would break the engine behind us
are checked here (mlx_lm.server's generation thread dies for good on
``max_tokens: 0``; see shared/design.md).
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import orjson

from proxy.errors import HTTPError

_TOKEN_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")


class RequestGuards(Protocol):
    """What the request path reads of a route's guards: checks and handling its engine needs.

    Only the names and types: each guard's default and meaning are written
    once, in ``engines.spec.Guards``, the object the composition root hands
    to every route (the request path may not import ``engines``; mypy checks
    that the one fits the other).
    """

    # Hashable, as a frozen dataclass is: the sampling checks are built once per guards and endpoint.
    def __hash__(self) -> int: ...

    @property
    def min_max_tokens(self) -> int: ...
    @property
    def require_input(self) -> bool: ...
    @property
    def check_types(self) -> bool: ...
    @property
    def seed_min(self) -> int | None: ...
    @property
    def top_logprobs_max(self) -> int: ...
    @property
    def completion_logprobs(self) -> str: ...
    @property
    def via_stream(self) -> bool: ...
    @property
    def stream_cannot_carry(self) -> tuple[str, ...]: ...


def parse_request(body: bytes | bytearray) -> tuple[str, dict[str, Any]]:
    """The ``model`` field and the parsed body, or a 400."""
    if not body:
        raise HTTPError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        doc: Any = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HTTPError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise HTTPError(400, "request body must be a JSON object", code="invalid_json")
    model = doc.get("model")
    if model is None:
        raise HTTPError(400, "you must provide a model parameter", param="model", code="missing_model")
    if not isinstance(model, str) or not model:
        raise HTTPError(400, "model must be a non-empty string", param="model", code="invalid_model")
    return model, doc


def ask_for_stream(doc: dict[str, Any], endpoint: bytes, guards: RequestGuards) -> bool:
    """Make a non-stream generation request a stream with usage; whether it was made one.

    Not for embeddings, and not when the request sets a field that the
    engine's streams do not carry (mlx: logprobs only in non-stream replies).
    """
    if endpoint not in _GENERATION_ENDPOINTS:
        return False
    for name in guards.stream_cannot_carry:
        value = doc.get(name)
        if value is not None and value is not False and value != 0:
            return False
    doc["stream"] = True
    doc["stream_options"] = {"include_usage": True}
    return True


_GENERATION_ENDPOINTS = frozenset({b"/chat/completions", b"/completions"})


def check_request(doc: dict[str, Any], endpoint: bytes, guards: RequestGuards) -> bool:
    """Raise a 400 for what the route's engine must not receive; True if ``doc`` was changed."""
    for field in _TOKEN_LIMIT_FIELDS:
        value = doc.get(field)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < guards.min_max_tokens
        ):
            raise HTTPError(
                400,
                f"{field} must be an integer of at least {guards.min_max_tokens}",
                param=field,
                code="invalid_value",
            )
    if guards.require_input:
        if endpoint == b"/chat/completions":
            messages = doc.get("messages")
            if not isinstance(messages, list) or not messages:
                raise HTTPError(
                    400, "messages must be a non-empty list", param="messages", code="invalid_value"
                )
        elif endpoint == b"/completions" and not isinstance(doc.get("prompt"), (str, list)):
            raise HTTPError(400, "you must provide a prompt", param="prompt", code="invalid_value")
    if guards.check_types:
        return check_types(doc, endpoint, guards)
    return False


# Field → (what it must be, a check on the value). Only fields that are present are looked at.
_NUMBER = (int, float)


def _number_at_least(low: float) -> tuple[str, Any]:
    def ok(value: Any) -> bool:
        return isinstance(value, _NUMBER) and not isinstance(value, bool) and value >= low

    return f"a number of at least {low:g}", ok


def _number_between(low: float, high: float) -> tuple[str, Any]:
    def ok(value: Any) -> bool:
        return isinstance(value, _NUMBER) and not isinstance(value, bool) and low <= value <= high

    return f"a number from {low:g} to {high:g}", ok


def _integer_at_least(low: int) -> tuple[str, Any]:
    def ok(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= low

    return f"an integer of at least {low}", ok


def _boolean(value: Any) -> bool:
    return isinstance(value, bool)


def _stop(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def _any_number(value: Any) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool)


_FIELD_CHECKS: dict[str, tuple[str, Any]] = {
    "temperature": _number_at_least(0),
    "top_p": _number_between(0, 1),
    "min_p": _number_between(0, 1),
    "top_k": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "n": _integer_at_least(1),
    "seed": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "presence_penalty": ("a number", _any_number),
    "frequency_penalty": ("a number", _any_number),
    "repetition_penalty": _number_at_least(0),
    "repeat_penalty": _number_at_least(0),
    "stream": ("true or false", _boolean),
    "top_logprobs": _integer_at_least(0),
    "stop": ("a string or a list of strings", _stop),
    "logit_bias": ("an object of token ids to numbers", lambda v: isinstance(v, dict)),
}
# The chat API's logprobs is a flag; the legacy completions API's is a count.
_LOGPROBS: dict[bytes, tuple[str, Any]] = {
    b"/chat/completions": ("true or false", _boolean),
    b"/completions": _integer_at_least(0),
}


@functools.lru_cache(maxsize=64)
def _checks(guards: RequestGuards, endpoint: bytes) -> dict[str, tuple[str, Any]]:
    checks = dict(_FIELD_CHECKS)
    if endpoint in _LOGPROBS:
        checks["logprobs"] = _LOGPROBS[endpoint]
        if guards.completion_logprobs == "flag":
            checks["logprobs"] = _LOGPROBS[b"/chat/completions"]
    if guards.seed_min is not None:
        checks["seed"] = _integer_at_least(guards.seed_min)
    low = _integer_at_least(0)[1]
    limit = guards.top_logprobs_max
    checks["top_logprobs"] = (f"an integer from 0 to {limit}", lambda v: low(v) and v <= limit)
    return checks


def check_types(doc: dict[str, Any], endpoint: bytes, guards: RequestGuards) -> bool:
    """A 400 naming the first sampling field of the wrong type or range; True if null fields were dropped."""
    dropped = False
    for field, (expected, ok) in _checks(guards, endpoint).items():
        if field not in doc:
            continue
        value = doc[field]
        if value is None:
            del doc[field]
            dropped = True
        elif not ok(value):
            raise HTTPError(
                400,
                f"{field} must be {expected}, not {orjson.dumps(value).decode()[:80]}",
                param=field,
                code="invalid_type",
            )
    if endpoint == b"/chat/completions":
        messages = doc.get("messages")
        if isinstance(messages, list):
            for index, message in enumerate(messages):
                if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                    raise HTTPError(
                        400,
                        f"messages[{index}] must be an object with a string role",
                        param=f"messages[{index}]",
                        code="invalid_type",
                    )
    return dropped


def extract_model(body: bytes, endpoint: bytes, guards: RequestGuards) -> str:
    """Return the ``model`` field of a JSON request body, or raise a 400."""
    model, doc = parse_request(body)
    check_request(doc, endpoint, guards)
    return model
